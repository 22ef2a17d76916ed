/* The elementwise work of a Qwen3 decoder layer on the CPU, between its matmuls (sparrow_nemo/rollout/cpu_layer.py).
 *
 * A decode step of a small model at batch 32-128 is dominated by dozens of tiny torch ops per layer (norms,
 * rotary, SwiGLU, residual adds: ~30 op launches of a few microseconds each), not by its arithmetic. These
 * functions do that work in one pass over the rows each; the matmuls stay torch's. Rows are contiguous fp32:
 *   sparrow_rms_norm:       out = w * x / sqrt(mean(x^2) + eps)                             (x, out [N, H])
 *   sparrow_add_rms_norm:   h_out = h + delta; out = rms_norm(h_out)                        ([N, H] each)
 *   sparrow_qk_norm_rope:   per head of q and k (rows of qkv [N, (Hq + 2 Hkv) * D]): RMSNorm with its weight,
 *                           then the rotary embedding with the row's cos / sin [N, D] (rotate-half convention)
 *   sparrow_silu_mul:       out = silu(gate) * up, gate_up [N, 2 I] -> out [N, I]
 * Statistics and arithmetic are fp32, as transformers' Qwen3 (RMSNorm statistics in fp32 of an fp32 model);
 * the summation order is this code's, so results agree with the torch ops to rounding, not bit for bit.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 16
typedef float v16 __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t i16 __attribute__((vector_size(LANES * sizeof(int32_t))));

static inline v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

/* 1 / sqrt(mean of x[0 .. n)^2 + eps): lane partial sums, then the lanes in order, then the tail. */
static inline float inv_rms(const float *x, int64_t n, float eps) {
    const int64_t full = n - n % LANES;
    v16 acc = {0};
    for (int64_t i = 0; i < full; i += LANES) {
        const v16 v = load16(x + i);
        acc += v * v;
    }
    float sum = 0.0f;
    for (int i = 0; i < LANES; ++i) sum += acc[i];
    for (int64_t i = full; i < n; ++i) sum += x[i] * x[i];
    return 1.0f / sqrtf(sum / (float)n + eps);
}

/* out[0 .. n) = w * (x * r). */
static inline void scale_row(const float *x, int64_t n, float r, const float *w, float *out) {
    const int64_t full = n - n % LANES;
    for (int64_t i = 0; i < full; i += LANES) store16(out + i, load16(w + i) * (load16(x + i) * r));
    for (int64_t i = full; i < n; ++i) out[i] = w[i] * (x[i] * r);
}

void sparrow_rms_norm(const float *x, int64_t rows, int64_t dim, const float *w, float eps, float *out) {
    for (int64_t r = 0; r < rows; ++r) scale_row(x + r * dim, dim, inv_rms(x + r * dim, dim, eps), w, out + r * dim);
}

void sparrow_add_rms_norm(const float *h, const float *delta, int64_t rows, int64_t dim, const float *w, float eps,
                          float *h_out, float *out) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *a = h + r * dim, *b = delta + r * dim;
        float *s = h_out + r * dim;
        for (int64_t i = 0; i < dim; ++i) s[i] = a[i] + b[i];
        scale_row(s, dim, inv_rms(s, dim, eps), w, out + r * dim);
    }
}

/* One head vector x [D] -> out [D]: RMSNorm with w, then rotated by cos / sin [D] (out[i] = y[i] cos[i] +
 * rot[i] sin[i], rot = (-y[D/2 ..], y[.. D/2])). */
static inline void norm_rope_head(const float *x, int64_t d, const float *w, float eps, const float *cos_,
                                  const float *sin_, float *out) {
    float y[512];
    const int64_t half = d / 2;
    scale_row(x, d, inv_rms(x, d, eps), w, y);
    for (int64_t i = 0; i < half; ++i) out[i] = y[i] * cos_[i] + -y[i + half] * sin_[i];
    for (int64_t i = half; i < d; ++i) out[i] = y[i] * cos_[i] + y[i - half] * sin_[i];
}

void sparrow_qk_norm_rope(const float *qkv, int64_t rows, int64_t hq, int64_t hkv, int64_t d, const float *wq,
                          const float *wk, const float *cos_, const float *sin_, float eps, float *q_out,
                          float *k_out) {
    const int64_t width = (hq + 2 * hkv) * d;
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = qkv + r * width, *c = cos_ + r * d, *s = sin_ + r * d;
        for (int64_t h = 0; h < hq; ++h) norm_rope_head(row + h * d, d, wq, eps, c, s, q_out + (r * hq + h) * d);
        for (int64_t h = 0; h < hkv; ++h)
            norm_rope_head(row + (hq + h) * d, d, wk, eps, c, s, k_out + (r * hkv + h) * d);
    }
}

/* Lane-wise mask ? a : b (mask lanes all ones or all zeros, as comparisons give). */
static inline v16 pick16(i16 mask, v16 a, v16 b) {
    i16 ia, ib;
    memcpy(&ia, &a, sizeof ia);
    memcpy(&ib, &b, sizeof ib);
    ia = (ia & mask) | (ib & ~mask);
    memcpy(&a, &ia, sizeof a);
    return a;
}

/* exp(x) lane-wise for x in [-87, 88] (clamped outside): 2^n times Cephes' degree-6 polynomial on |r| <= ln2/2. */
static inline v16 exp16(v16 x) {
    const v16 lo = (v16){0} - 87.0f, hi = (v16){0} + 88.0f;
    x = pick16(x < lo, lo, x);
    x = pick16(x > hi, hi, x);
    const v16 magic = (v16){0} + 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    v16 n = (x * 1.44269504088896341f + magic) - magic;
    v16 r = x - n * 0.693359375f - n * -2.12194440e-4f;
    v16 y = (v16){0} + 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * (r * r) + r + 1.0f;
    i16 bits = (__builtin_convertvector(n, i16) + 127) << 23;
    v16 scale;
    memcpy(&scale, &bits, sizeof scale);
    return y * scale;
}

void sparrow_silu_mul(const float *gate_up, int64_t rows, int64_t inter, float *out) {
    const int64_t full = inter - inter % LANES;
    for (int64_t r = 0; r < rows; ++r) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        for (int64_t i = 0; i < full; i += LANES) {
            const v16 x = load16(g + i);
            store16(o + i, x / (1.0f + exp16(-x)) * load16(u + i));
        }
        for (int64_t i = full; i < inter; ++i) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}
