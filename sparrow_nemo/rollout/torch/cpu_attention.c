/* Paged decode attention on the CPU, reading the KV cache in place (sparrow_nemo/rollout/cpu_attention.py).
 *
 * Page j of (sequence b, KV head h) is the logical page page_idx[b, h, j] (or j itself when page_idx is
 * NULL: every page, dense) and its physical page is block_table[b, logical]. Slots at or past seq_len[b],
 * and padding entries (logical page < 0), get score -inf and are never read, so they may hold anything.
 * Keys/values are fp32 with element strides (page, head, slot; the head dim is contiguous); q, scores,
 * probs and out are contiguous fp32.
 *   one fused pass per sequence (scores, softmax, p.V), out[b, h * G + g, :] = sum_t softmax_t(scale *
 *   <q[b, h * G + g], K_t>) * V_t over the slots t of its pages: sparrow_paged_attention (every page, dense, read
 *   in order; or a given page list, the pages of a later sequence touched first), sparrow_sparse_attention (the
 *   page choice in the same pass)
 *   the page choice alone: sparrow_select_pages
 * The page choice scores each page on its landmarks: the centroid (the paper's mean key) or, with the minmax
 * page score, the per-channel key bounds (key_min, key_max: sum_d max(q_d * min_d, q_d * max_d)).
 *
 * Every key and value is read once. With a head dim that is a multiple of 16 and 16-token pages, a page's
 * 16 dot products are 16-lane vector FMAs followed by one transpose-and-add tree (no per-token horizontal
 * sums); other shapes take a plain loop. The summation order is fixed by this code, not by the data.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 16
typedef float v16 __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t i16 __attribute__((vector_size(LANES * sizeof(int32_t))));

#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (i16){__VA_ARGS__})
#endif

static inline v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

/* The 16 lane-sums of acc[0..15], in order: out[i] = sum over lanes of acc[i]. */
static inline v16 reduce16(v16 acc[LANES]) {
    v16 c[8], e[4], f[2];
    for (int i = 0; i < 8; ++i) /* lanes: 8 partials of acc[2i], then 8 of acc[2i+1] */
        c[i] = SHUFFLE(acc[2 * i], acc[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               SHUFFLE(acc[2 * i], acc[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; ++i) /* 4 partials each of 4 consecutive slots */
        e[i] = SHUFFLE(c[2 * i], c[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               SHUFFLE(c[2 * i], c[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; ++i) /* 2 partials each of 8 consecutive slots */
        f[i] = SHUFFLE(e[2 * i], e[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               SHUFFLE(e[2 * i], e[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return SHUFFLE(f[0], f[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           SHUFFLE(f[0], f[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* exp(x) lane-wise for x <= 0 (softmax weights after the max is subtracted): Cephes' expf (2^n times a
 * degree-6 polynomial on |r| <= ln2 / 2, within a few ulp of expf); x < -87 (incl. -inf) gives 0. */
static inline v16 exp16(v16 x) {
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
    i16 live = x >= -87.0f; /* lanes: -1 where exp(x) is a normal float */
    v16 out = y * scale;
    i16 ob;
    memcpy(&ob, &out, sizeof ob);
    ob &= live;
    memcpy(&out, &ob, sizeof out);
    return out;
}

/* In place: w[0 .. width) <- softmax(w) (fp32, max subtracted; -inf entries weigh 0; all -inf gives 0).
 * Entry t always takes lane t % 16 of the sum and exp16, so a wider row whose extra entries are -inf gives
 * the same bits (dense and a covering sparse budget agree exactly). */
static inline v16 max16(v16 a, v16 b) {
    i16 pick = a > b, ia, ib;
    memcpy(&ia, &a, sizeof ia);
    memcpy(&ib, &b, sizeof ib);
    ia = (ia & pick) | (ib & ~pick);
    memcpy(&a, &ia, sizeof a);
    return a;
}

static void softmax_row(float *w, int64_t width) {
    const int64_t full = width - width % LANES;
    v16 tops = (v16){0} - INFINITY;
    for (int64_t t = 0; t < full; t += LANES) tops = max16(tops, load16(w + t));
    float top = -INFINITY;
    for (int i = 0; i < LANES; ++i) top = tops[i] > top ? tops[i] : top;
    for (int64_t t = full; t < width; ++t) top = w[t] > top ? w[t] : top;
    if (top == -INFINITY) {
        memset(w, 0, sizeof(float) * width);
        return;
    }
    v16 acc = {0};
    for (int64_t t = 0; t < full; t += LANES) {
        v16 e = exp16(load16(w + t) - top);
        acc += e;
        store16(w + t, e);
    }
    if (full < width) { /* the tail as one chunk padded with -inf (its entries keep their lanes) */
        float chunk[LANES];
        for (int i = 0; i < LANES; ++i) chunk[i] = full + i < width ? w[full + i] : -INFINITY;
        v16 e = exp16(load16(chunk) - top);
        acc += e;
        store16(chunk, e);
        memcpy(w + full, chunk, sizeof(float) * (width - full));
    }
    float total = 0.0f;
    for (int i = 0; i < LANES; ++i) total += acc[i];
    const v16 inv = (v16){0} + 1.0f / total;
    for (int64_t t = 0; t < full; t += LANES) store16(w + t, load16(w + t) * inv);
    for (int64_t t = full; t < width; ++t) w[t] *= inv[0];
}

/* Scores of one page: out[s] = scale * <q, key_s> for s < valid, -inf after; keys at k (slot stride ks). */
static void page_scores(const float *restrict q, const float *restrict k, int64_t ks, int64_t head_dim,
                        int64_t page_size, int64_t valid, float scale, float *restrict out) {
    if (page_size == LANES && head_dim % LANES == 0 && valid == LANES) {
        v16 acc[LANES];
        for (int s = 0; s < LANES; ++s) {
            v16 a = load16(q) * load16(k + s * ks);
            for (int64_t d = LANES; d < head_dim; d += LANES) a += load16(q + d) * load16(k + s * ks + d);
            acc[s] = a;
        }
        store16(out, reduce16(acc) * scale);
        return;
    }
    for (int64_t s = 0; s < page_size; ++s) {
        float acc = -INFINITY;
        if (s < valid) {
            acc = 0.0f;
            for (int64_t d = 0; d < head_dim; ++d) acc += q[d] * k[s * ks + d];
            acc *= scale;
        }
        out[s] = acc;
    }
}

/* page_scores for the group queries q[g * D ..] (g < group) of one KV head against the same page: out rows
 * g * out_stride. Full vector pages take two queries per pass over the page's keys (each key loaded once
 * for both); the arithmetic of each query is page_scores', so the results are the same bits. */
static void group_scores(const float *restrict q, int64_t group, const float *restrict k, int64_t ks,
                         int64_t head_dim, int64_t page_size, int64_t valid, float scale, float *restrict out,
                         int64_t out_stride) {
    int64_t g = 0;
    if (page_size == LANES && head_dim % LANES == 0 && valid == LANES)
        for (; g + 2 <= group; g += 2) {
            const float *q0 = q + g * head_dim, *q1 = q0 + head_dim;
            v16 acc0[LANES], acc1[LANES];
            for (int s = 0; s < LANES; ++s) {
                const float *ks0 = k + s * ks;
                v16 kd = load16(ks0), a0 = load16(q0) * kd, a1 = load16(q1) * kd;
                for (int64_t d = LANES; d < head_dim; d += LANES) {
                    kd = load16(ks0 + d);
                    a0 += load16(q0 + d) * kd;
                    a1 += load16(q1 + d) * kd;
                }
                acc0[s] = a0;
                acc1[s] = a1;
            }
            store16(out + g * out_stride, reduce16(acc0) * scale);
            store16(out + (g + 1) * out_stride, reduce16(acc1) * scale);
        }
    for (; g < group; ++g)
        page_scores(q + g * head_dim, k, ks, head_dim, page_size, valid, scale, out + g * out_stride);
}

/* out[:] += sum over the page's valid slots s of p[s] * value_s (values at v, slot stride vs). */
static void page_values(const float *restrict p, const float *restrict v, int64_t vs, int64_t head_dim,
                        int64_t valid, float *restrict out) {
    if (head_dim % LANES == 0) {
        for (int64_t d = 0; d < head_dim; d += LANES) {
            /* four independent sums over the slots (s mod 4): no chain of dependent FMAs */
            v16 acc[4] = {load16(out + d), {0}, {0}, {0}};
            int64_t s = 0;
            for (; s + 4 <= valid; s += 4)
                for (int u = 0; u < 4; ++u) acc[u] += p[s + u] * load16(v + (s + u) * vs + d);
            for (; s < valid; ++s) acc[0] += p[s] * load16(v + s * vs + d);
            store16(out + d, (acc[0] + acc[1]) + (acc[2] + acc[3]));
        }
        return;
    }
    for (int64_t s = 0; s < valid; ++s)
        for (int64_t d = 0; d < head_dim; ++d) out[d] += p[s] * v[s * vs + d];
}

/* page_values for the group's weights p[g * p_stride ..] (g < group) of one KV head over the same page: out
 * rows g * D. With a vector head dim, two queries per pass over the page's values (each value loaded once
 * for both); the arithmetic of each query is page_values', so the results are the same bits. */
static void group_values(const float *restrict p, int64_t p_stride, int64_t group, const float *restrict v,
                         int64_t vs, int64_t head_dim, int64_t valid, float *restrict out) {
    int64_t g = 0;
    if (head_dim % LANES == 0)
        for (; g + 2 <= group; g += 2) {
            const float *p0 = p + g * p_stride, *p1 = p0 + p_stride;
            float *o0 = out + g * head_dim, *o1 = o0 + head_dim;
            for (int64_t d = 0; d < head_dim; d += LANES) {
                v16 a[4] = {load16(o0 + d), {0}, {0}, {0}}, c[4] = {load16(o1 + d), {0}, {0}, {0}};
                int64_t s = 0;
                for (; s + 4 <= valid; s += 4)
                    for (int u = 0; u < 4; ++u) {
                        const v16 x = load16(v + (s + u) * vs + d);
                        a[u] += p0[s + u] * x;
                        c[u] += p1[s + u] * x;
                    }
                for (; s < valid; ++s) {
                    const v16 x = load16(v + s * vs + d);
                    a[0] += p0[s] * x;
                    c[0] += p1[s] * x;
                }
                store16(o0 + d, (a[0] + a[1]) + (a[2] + a[3]));
                store16(o1 + d, (c[0] + c[1]) + (c[2] + c[3]));
            }
        }
    for (; g < group; ++g) page_values(p + g * p_stride, v, vs, head_dim, valid, out + g * head_dim);
}

/* A sparse row's page list: rows[h * stride + j] is logical page j of KV head h (-1: padding). The pages of
 * row b lie scattered over the pool, so waiting on their loads is what costs there. */
typedef struct {
    const int64_t *rows;
    int64_t stride, n;
} PageList;

/* Valid slots of page j of KV head h of row b (0 for padding or past seq_len) and its address in a pool. */
static inline int64_t list_page(PageList list, const float *pages, int64_t stride_p, int64_t stride_h,
                                const int32_t *table, int64_t len, int64_t h, int64_t j, int64_t page_size,
                                const float **at) {
    const int64_t logical = list.rows ? list.rows[h * list.stride + j] : j;
    int64_t valid = logical < 0 ? 0 : len - logical * page_size;
    valid = valid < 0 ? 0 : (valid > page_size ? page_size : valid);
    *at = valid ? pages + (int64_t)table[logical] * stride_p + h * stride_h : pages;
    return valid;
}

/* The decode-attention pools of one layer and the row geometry the row functions share. */
typedef struct {
    const float *k_pages, *v_pages;
    int64_t stride_kp, stride_kh, stride_ks, stride_vp, stride_vh, stride_vs;
    const int32_t *block_table;
    int64_t stride_bt;
    const int64_t *seq_len;
    int64_t hkv, group, head_dim, page_size;
} Pools;

/* Touch (one demand load) the first key and value of each page of row b's list: their address translations
 * and line fetches start now, and the hardware prefetcher follows the rest of each page. Measured on the
 * 2-core CI machine (10% of 2K, batch 128): 3.2 -> 2.75 ms per layer against no touch; touching 2, 4 or every
 * line, or 1 or 4 rows ahead, measured the same; __builtin_prefetch of every line did no better than none. */
static void touch_row(const Pools *m, int64_t b, PageList list) {
    const int32_t *table = m->block_table + b * m->stride_bt;
    for (int64_t j = 0; j < list.n; ++j)
        for (int64_t h = 0; h < m->hkv; ++h) {
            const float *at;
            if (!list_page(list, m->k_pages, m->stride_kp, m->stride_kh, table, m->seq_len[b], h, j, m->page_size,
                           &at))
                continue;
            (void)*(const volatile float *)at;
            list_page(list, m->v_pages, m->stride_vp, m->stride_vh, table, m->seq_len[b], h, j, m->page_size, &at);
            (void)*(const volatile float *)at;
        }
}

/* Row b's attention over the pages of its list: the scores of its pages into work [Hkv, G, n * P] (pages
 * outer, heads inner), the softmax of each (h, g) over them (fp32, max subtracted; -inf slots weigh 0), then
 * p.V into out [Hkv * G, D]. */
static void attend_row(const Pools *m, const float *q, int64_t b, PageList list, float scale, float *out,
                       float *work) {
    const int64_t hkv = m->hkv, group = m->group, d = m->head_dim, ps = m->page_size, width = list.n * ps;
    const int32_t *table = m->block_table + b * m->stride_bt;
    const float *kp, *vp;
    for (int64_t j = 0; j < list.n; ++j)
        for (int64_t h = 0; h < hkv; ++h) {
            const int64_t valid =
                list_page(list, m->k_pages, m->stride_kp, m->stride_kh, table, m->seq_len[b], h, j, ps, &kp);
            group_scores(q + h * group * d, group, kp, m->stride_ks, d, ps, valid, scale,
                         work + h * group * width + j * ps, width);
        }
    for (int64_t r = 0; r < hkv * group; ++r) softmax_row(work + r * width, width);
    memset(out, 0, sizeof(float) * hkv * group * d);
    for (int64_t j = 0; j < list.n; ++j)
        for (int64_t h = 0; h < hkv; ++h) {
            const int64_t valid =
                list_page(list, m->v_pages, m->stride_vp, m->stride_vh, table, m->seq_len[b], h, j, ps, &vp);
            if (!valid) continue;
            group_values(work + h * group * width + j * ps, width, group, vp, m->stride_vs, d, valid,
                         out + h * group * d);
        }
}

/* Row b's page list: its n listed pages of page_idx [B, Hkv, n], or (page_idx NULL, dense) its own pages in
 * order, at most n (pages past its length would only add -inf scores and zero weights). */
static inline PageList row_list(const int64_t *page_idx, const int64_t *seq_len, int64_t b, int64_t hkv,
                                int64_t n, int64_t page_size) {
    if (page_idx) return (PageList){page_idx + b * hkv * n, n, n};
    const int64_t own = (seq_len[b] + page_size - 1) / page_size;
    return (PageList){NULL, n, own < n ? own : n};
}

/* Rows touched ahead of the one computed (touch_row). */
#define TOUCH_AHEAD 2

/* Decode attention over the pages of every (row b, KV head h), one row at a time (attend_row) into out
 * [B, Hkv * G, D]; page_idx [B, Hkv, n] (NULL: every page, dense: the row's own, at most n). With a page list
 * (sparse), the pages of row b + TOUCH_AHEAD are touched before row b is computed. */
void sparrow_paged_attention(const float *q, const float *k_pages, int64_t stride_kp, int64_t stride_kh,
                             int64_t stride_ks, const float *v_pages, int64_t stride_vp, int64_t stride_vh,
                             int64_t stride_vs, const int32_t *block_table, int64_t stride_bt,
                             const int64_t *seq_len, const int64_t *page_idx, int64_t n, int64_t batch,
                             int64_t hkv, int64_t group, int64_t head_dim, int64_t page_size, float scale,
                             float *out, float *work) {
    const Pools m = {k_pages,  v_pages,   stride_kp, stride_kh, stride_ks, stride_vp, stride_vh, stride_vs,
                     block_table, stride_bt, seq_len, hkv,    group,     head_dim,  page_size};
    const int64_t heads = hkv * group * head_dim;
    for (int64_t b = 0; b < batch; ++b) {
        if (page_idx)
            for (int64_t t = b ? b + TOUCH_AHEAD : 0; t <= b + TOUCH_AHEAD && t < batch; ++t)
                touch_row(&m, t, row_list(page_idx, seq_len, t, hkv, n, page_size));
        attend_row(&m, q + b * heads, b, row_list(page_idx, seq_len, b, hkv, n, page_size), scale, out + b * heads,
                   work);
    }
}

/* Store one token per row at positions[b] (its index = the row's old length) and update its page's
 * landmarks as PagedKVCache.append does: the centroid incrementally in fp32, c <- c + (k - c) / (n + 1) with
 * n = keys already in the page, or (centroids NULL, the minmax page score) the key bounds key_min / key_max
 * taking the key in, set to it at slot 0. k_new, v_new: [B, Hkv, D] contiguous; the landmark pools share
 * the (page, head) strides. */
void sparrow_paged_append(float *k_pages, float *v_pages, int64_t stride_kp, int64_t stride_kh,
                          int64_t stride_ks, int64_t stride_vp, int64_t stride_vh, int64_t stride_vs,
                          float *centroids, float *key_min, float *key_max, int64_t stride_cp, int64_t stride_ch,
                          const int32_t *block_table, int64_t stride_bt, const int64_t *positions,
                          const float *k_new, const float *v_new, int64_t batch, int64_t hkv, int64_t head_dim,
                          int64_t page_size) {
    for (int64_t b = 0; b < batch; ++b) {
        const int64_t pos = positions[b], slot = pos % page_size;
        const int64_t page = block_table[b * stride_bt + pos / page_size];
        const float count = (float)(slot + 1);
        for (int64_t h = 0; h < hkv; ++h) {
            const float *kn = k_new + (b * hkv + h) * head_dim, *vn = v_new + (b * hkv + h) * head_dim;
            float *kd = k_pages + page * stride_kp + h * stride_kh + slot * stride_ks;
            float *vd = v_pages + page * stride_vp + h * stride_vh + slot * stride_vs;
            for (int64_t d = 0; d < head_dim; ++d) {
                kd[d] = kn[d];
                vd[d] = vn[d];
            }
            const int64_t at = page * stride_cp + h * stride_ch;
            if (centroids) {
                float *c = centroids + at;
                for (int64_t d = 0; d < head_dim; ++d) c[d] = c[d] + (kn[d] - c[d]) / count;
            } else {
                float *lo = key_min + at, *hi = key_max + at;
                for (int64_t d = 0; d < head_dim; ++d) {
                    lo[d] = slot == 0 || kn[d] < lo[d] ? kn[d] : lo[d];
                    hi[d] = slot == 0 || kn[d] > hi[d] ? kn[d] : hi[d];
                }
            }
        }
    }
}

/* Scores of row b's middle pages lo .. hi-1 for every KV head: scores[h * NP + p] = <q_mean[b, h], centroid of
 * block_table[b, p], head h> (fp32). With a head dim that is a multiple of 16, 16 pages at a time as 16-lane
 * FMAs and one transpose-and-add tree (reduce16); else a plain loop. */
static void centroid_scores(const float *qm, const float *centroids, int64_t stride_cp, int64_t stride_ch,
                            const int32_t *table, int64_t lo, int64_t hi, int64_t hkv, int64_t head_dim,
                            int64_t num_pages, float *scores) {
    if (head_dim % LANES == 0) {
        for (int64_t p0 = lo; p0 < hi; p0 += LANES) {
            const int64_t live = hi - p0 < LANES ? hi - p0 : LANES;
            const float *cp[LANES];
            for (int64_t i = 0; i < LANES; ++i) /* lanes past hi score page p0 again and are not stored */
                cp[i] = centroids + (int64_t)table[p0 + (i < live ? i : 0)] * stride_cp;
            for (int64_t h = 0; h < hkv; ++h) {
                const float *q = qm + h * head_dim;
                v16 acc[LANES];
                for (int i = 0; i < LANES; ++i) {
                    const float *c = cp[i] + h * stride_ch;
                    v16 a = load16(q) * load16(c);
                    for (int64_t d = LANES; d < head_dim; d += LANES) a += load16(q + d) * load16(c + d);
                    acc[i] = a;
                }
                float sums[LANES];
                store16(sums, reduce16(acc));
                memcpy(scores + h * num_pages + p0, sums, sizeof(float) * live);
            }
        }
        return;
    }
    for (int64_t p = lo; p < hi; ++p) {
        const float *cp = centroids + (int64_t)table[p] * stride_cp;
        for (int64_t h = 0; h < hkv; ++h) {
            const float *q = qm + h * head_dim, *c = cp + h * stride_ch;
            float acc = 0.0f;
            for (int64_t d = 0; d < head_dim; ++d) acc += q[d] * c[d];
            scores[h * num_pages + p] = acc;
        }
    }
}

/* centroid_scores for the minmax page score: scores[h * NP + p] = sum_d max(q_d * min_d, q_d * max_d) over
 * the key bounds of block_table[b, p], head h (fp32; an upper bound on q . k over the page's keys). Same
 * layout and lane scheme: 16 pages at a time as 16-lane products, a lane-wise max and one reduce16. */
static void bound_scores(const float *qm, const float *key_min, const float *key_max, int64_t stride_cp,
                         int64_t stride_ch, const int32_t *table, int64_t lo, int64_t hi, int64_t hkv,
                         int64_t head_dim, int64_t num_pages, float *scores) {
    if (head_dim % LANES == 0) {
        for (int64_t p0 = lo; p0 < hi; p0 += LANES) {
            const int64_t live = hi - p0 < LANES ? hi - p0 : LANES;
            int64_t at[LANES];
            for (int64_t i = 0; i < LANES; ++i) /* lanes past hi score page p0 again and are not stored */
                at[i] = (int64_t)table[p0 + (i < live ? i : 0)] * stride_cp;
            for (int64_t h = 0; h < hkv; ++h) {
                const float *q = qm + h * head_dim;
                v16 acc[LANES];
                for (int i = 0; i < LANES; ++i) {
                    const float *mn = key_min + at[i] + h * stride_ch, *mx = key_max + at[i] + h * stride_ch;
                    v16 qd = load16(q), a = max16(qd * load16(mn), qd * load16(mx));
                    for (int64_t d = LANES; d < head_dim; d += LANES) {
                        qd = load16(q + d);
                        a += max16(qd * load16(mn + d), qd * load16(mx + d));
                    }
                    acc[i] = a;
                }
                float sums[LANES];
                store16(sums, reduce16(acc));
                memcpy(scores + h * num_pages + p0, sums, sizeof(float) * live);
            }
        }
        return;
    }
    for (int64_t p = lo; p < hi; ++p) {
        const int64_t at = (int64_t)table[p] * stride_cp;
        for (int64_t h = 0; h < hkv; ++h) {
            const float *q = qm + h * head_dim, *mn = key_min + at + h * stride_ch, *mx = key_max + at + h * stride_ch;
            float acc = 0.0f;
            for (int64_t d = 0; d < head_dim; ++d) {
                const float a = q[d] * mn[d], b = q[d] * mx[d];
                acc += a > b ? a : b;
            }
            scores[h * num_pages + p] = acc;
        }
    }
}

/* The geometry of the page choice of one layer (sparrow_select_pages' arguments). landmarks: the centroids, or
 * with the minmax page score the key minima (key_max: the maxima; NULL for centroids), one (page, head) stride
 * pair for both. */
typedef struct {
    const float *landmarks, *key_max;
    int64_t stride_cp, stride_ch;
    const int32_t *block_table;
    int64_t stride_bt;
    const int64_t *seq_len, *budget;
    int64_t hkv, head_dim, num_pages, page_size, sink, local;
} Choice;

/* Row b's page choice (sparrow_select_pages' rule) for q_mean [Hkv, D]: out [Hkv, NP] the kept pages ascending
 * then -1, counts [Hkv]; returns the most pages any head keeps. scores, scratch, keep: Hkv * NP work space,
 * best: NP. The middle pages are scored for all heads at once (centroid_scores), then each head keeps its best
 * top_k in one pass over its scores (an insertion list, best first; a page enters only when it beats the
 * current last, so an equal score never displaces a lower page). */
static int64_t select_row(const Choice *c, const float *q_mean, int64_t b, int64_t *out, int64_t *counts,
                          float *scores, int64_t *scratch, uint8_t *keep, float *best) {
    const int64_t np = c->num_pages, sink = c->sink, local = c->local;
    const int64_t n = (c->seq_len[b] + c->page_size - 1) / c->page_size, pages = c->budget[b] / c->page_size;
    int64_t top_k = pages - sink - local, most = 0;
    top_k = top_k < 0 ? 0 : top_k;
    const int64_t lo = sink, hi = n - local; /* the middle pages */
    const int choose = n > pages && top_k > 0 && hi > lo;
    if (choose && c->key_max)
        bound_scores(q_mean, c->landmarks, c->key_max, c->stride_cp, c->stride_ch, c->block_table + b * c->stride_bt,
                     lo, hi, c->hkv, c->head_dim, np, scores);
    else if (choose)
        centroid_scores(q_mean, c->landmarks, c->stride_cp, c->stride_ch, c->block_table + b * c->stride_bt, lo, hi,
                        c->hkv, c->head_dim, np, scores);
    for (int64_t h = 0; h < c->hkv; ++h) {
        uint8_t *k = keep + h * np;
        for (int64_t p = 0; p < n; ++p) k[p] = n <= pages || p < sink || p >= n - local;
        if (choose) {
            const float *sc = scores + h * np;
            int64_t *id = scratch + h * np, held = 0;
            for (int64_t p = lo; p < hi; ++p) {
                const float s = sc[p];
                if (held == top_k && !(s > best[top_k - 1])) continue;
                int64_t i = held < top_k ? held++ : top_k - 1;
                for (; i > 0 && s > best[i - 1]; --i) {
                    best[i] = best[i - 1];
                    id[i] = id[i - 1];
                }
                best[i] = s;
                id[i] = p;
            }
            for (int64_t i = 0; i < held; ++i) k[id[i]] = 1;
        }
        int64_t *dst = out + h * np, kept = 0;
        for (int64_t p = 0; p < n; ++p) {
            dst[kept] = p;
            kept += k[p];
        }
        for (int64_t p = kept; p < np; ++p) dst[p] = -1;
        counts[h] = kept;
        most = kept > most ? kept : most;
    }
    return most;
}

/* The GQA group's mean query of row b: q [Hkv * G, D] -> q_mean [Hkv, D] (sum over the group, then / G). */
static void mean_query(const float *q, int64_t hkv, int64_t group, int64_t head_dim, float *q_mean) {
    for (int64_t h = 0; h < hkv; ++h)
        for (int64_t d = 0; d < head_dim; ++d) {
            float sum = 0.0f;
            for (int64_t g = 0; g < group; ++g) sum += q[(h * group + g) * head_dim + d];
            q_mean[h * head_dim + d] = sum / (float)group;
        }
}

/* The Sparrow page choice (select_pages_from_centroids' rule) on the cache's centroids, read in place: page
 * p of row (b, h) scores <q_mean[b, h], centroid of block_table[b, p], head h> (fp32) or, with key_max given
 * (centroids then holds the key minima: the minmax page score, select_pages_from_key_bounds' rule), the
 * bound_scores of its key bounds; the row keeps every
 * page when n = ceil(seq_len / P) <= budget / P, else its sink and local pages plus the top
 * max(budget / P - sink - local, 0) middle pages by score, equal scores to the lower page index (select_row).
 * q_mean: [B, Hkv, D] contiguous (the GQA group's mean query); centroids: (page, head) strides, head dim
 * contiguous; out: [B, Hkv, NP] int64, the kept pages ascending then -1 (NP >= every row's n);
 * counts: [B * Hkv] int64 pages kept per row; scores, scratch, keep: Hkv * NP-element work space. */
void sparrow_select_pages(const float *q_mean, const float *centroids, const float *key_max, int64_t stride_cp,
                          int64_t stride_ch,
                          const int32_t *block_table, int64_t stride_bt, const int64_t *seq_len,
                          const int64_t *budget, int64_t batch, int64_t hkv, int64_t head_dim,
                          int64_t num_pages, int64_t page_size, int64_t sink, int64_t local, int64_t *out,
                          int64_t *counts, float *scores, int64_t *scratch, uint8_t *keep) {
    const Choice c = {centroids, key_max,  stride_cp, stride_ch, block_table, stride_bt, seq_len,
                      budget,    hkv,      head_dim,  num_pages, page_size,   sink,      local};
    float best[num_pages > 0 ? num_pages : 1];
    for (int64_t b = 0; b < batch; ++b)
        select_row(&c, q_mean + b * hkv * head_dim, b, out + b * hkv * num_pages, counts + b * hkv, scores,
                   scratch, keep, best);
}

/* Sparse decode attention in one pass over the batch: row b's page choice (select_row on the group-mean
 * query) then its attention over the kept pages (attend_row), the choice running TOUCH_AHEAD rows ahead so
 * that the chosen pages are touched before they are read. Equal to sparrow_select_pages followed by
 * sparrow_paged_attention on its pages, bit for bit (centroids, key_max: as sparrow_select_pages').
 * q: [B, Hkv * G, D]; out: [B, Hkv * G, D];
 * page_idx: [B, Hkv, NP] int64 the choice (as sparrow_select_pages' out), counts [B * Hkv];
 * work: Hkv * G * NP * P + Hkv * D floats; scores, scratch, keep: Hkv * NP elements. */
void sparrow_sparse_attention(const float *q, const float *centroids, const float *key_max, int64_t stride_cp,
                              int64_t stride_ch,
                              const float *k_pages, int64_t stride_kp, int64_t stride_kh, int64_t stride_ks,
                              const float *v_pages, int64_t stride_vp, int64_t stride_vh, int64_t stride_vs,
                              const int32_t *block_table, int64_t stride_bt, const int64_t *seq_len,
                              const int64_t *budget, int64_t batch, int64_t hkv, int64_t group, int64_t head_dim,
                              int64_t num_pages, int64_t page_size, int64_t sink, int64_t local, float scale,
                              float *out, int64_t *page_idx, int64_t *counts, float *work, float *scores,
                              int64_t *scratch, uint8_t *keep) {
    const Choice c = {centroids, key_max,  stride_cp, stride_ch, block_table, stride_bt, seq_len,
                      budget,    hkv,      head_dim,  num_pages, page_size,   sink,      local};
    const Pools m = {k_pages,  v_pages,   stride_kp, stride_kh, stride_ks, stride_vp, stride_vh, stride_vs,
                     block_table, stride_bt, seq_len, hkv,    group,     head_dim,  page_size};
    const int64_t heads = hkv * group * head_dim;
    float best[num_pages > 0 ? num_pages : 1], *q_mean = work + hkv * group * num_pages * page_size;
    int64_t most[TOUCH_AHEAD + 1]; /* pages kept by rows b .. b + TOUCH_AHEAD (ring) */
    for (int64_t t = 0; t < batch + TOUCH_AHEAD; ++t) {
        if (t < batch) { /* choose row t and touch its pages */
            mean_query(q + t * heads, hkv, group, head_dim, q_mean);
            int64_t *rows = page_idx + t * hkv * num_pages;
            most[t % (TOUCH_AHEAD + 1)] = select_row(&c, q_mean, t, rows, counts + t * hkv, scores, scratch, keep, best);
            touch_row(&m, t, (PageList){rows, num_pages, most[t % (TOUCH_AHEAD + 1)]});
        }
        const int64_t b = t - TOUCH_AHEAD;
        if (b >= 0)
            attend_row(&m, q + b * heads, b,
                       (PageList){page_idx + b * hkv * num_pages, num_pages, most[b % (TOUCH_AHEAD + 1)]}, scale,
                       out + b * heads, work);
    }
}

/* ---------------------------------------------------------------- speculative verify (multi-query, dense)
 * Dense causal attention of T query positions per row over the paged cache: query t of row b sits at cache
 * position start[b] + t and attends to positions 0 .. start[b] + t (its own key/value already stored); only
 * the first num_queries[b] queries of a row are computed (the rest of out is zero) and only the pages holding
 * positions below start[b] + num_queries[b] are read, each once (pages in order, both KV heads of a page
 * together) for all num_queries * G query rows of its KV head (the T positions and the G query heads sharing it).
 * The query rows sit on the 16 lanes of a vector (a row vector; the last one of a head padded with zero queries
 * that see every position, whose outputs are dropped), so nothing is transposed per page: a slot's score for 16
 * rows is D FMAs of the slot's key coordinates broadcast against the rows' transposed queries, the page's max
 * per row is lane-wise, and p.V is one FMA per (slot, coordinate) for 16 rows. The softmax is online (flash
 * style): per row a running max and weight sum, the unnormalised output rescaled when the max grows, divided by
 * the sum at the end.
 * q, out: [B, T, Hq, D] contiguous fp32 (Hq = Hkv * G, head h * G + g); work: 2 * Hkv * ceil(T * G / 16) * D * 16
 * floats. */
#define SLOTS 8 /* slots scored per register block */

/* Prefetch the lines of `slots` slots of one (page, KV head) of a pool (slot stride `stride` floats). The
 * verify's pages lie scattered over the pool and each is computed on for long enough that fetching the next
 * one meanwhile hides its loads, which the hardware prefetcher does not (it stops at a page's end). Measured
 * on the 2-core CI machine (tiny shape, batch 32, 2K cached, T = 8, G = 2; one layer of six, so the pool
 * comes from memory): 6.4-7.1 -> 4.4-4.7 ms per layer; 2 or 4 pages ahead no better. The dense decode's
 * row-at-a-time pass did not gain from it (3.0 ms either way). */
static inline void prefetch_page(const float *at, int64_t slots, int64_t stride) {
    for (int64_t byte = 0; byte < slots * stride * (int64_t)sizeof(float); byte += 64)
        __builtin_prefetch((const char *)at + byte, 0, 3);
}

void sparrow_paged_verify_attention(const float *q, const float *k_pages, int64_t stride_kp, int64_t stride_kh,
                                    int64_t stride_ks, const float *v_pages, int64_t stride_vp,
                                    int64_t stride_vh, int64_t stride_vs, const int32_t *block_table,
                                    int64_t stride_bt, const int64_t *start, const int64_t *num_queries,
                                    int64_t batch, int64_t t_max, int64_t hkv, int64_t group, int64_t head_dim,
                                    int64_t page_size, float scale, float *out, float *work) {
    const int64_t hq = hkv * group, D = head_dim;
    const int64_t vecs = (t_max * group + LANES - 1) / LANES; /* row vectors per KV head, at most */
    float *qt = work;                                         /* [Hkv, vecs, D, 16]: scaled queries, rows on lanes */
    float *ot = work + hkv * vecs * D * LANES;                /* [Hkv, vecs, D, 16]: unnormalised outputs */
    v16 run_max[hkv * vecs], run_sum[hkv * vecs], last[vecs];
    memset(out, 0, sizeof(float) * batch * t_max * hq * D);
    for (int64_t b = 0; b < batch; ++b) {
        const int64_t nq = num_queries[b], length = start[b] + nq, rows = nq * group;
        const int64_t nv = (rows + LANES - 1) / LANES, pages = (length + page_size - 1) / page_size;
        const int32_t *table = block_table + b * stride_bt;
        /* lane i of row vector v is row r = 16 v + i = t * G + g; it sees positions <= last (padding: all) */
        for (int64_t v = 0; v < nv; ++v)
            for (int i = 0; i < LANES; ++i) {
                const int64_t r = v * LANES + i;
                last[v][i] = (float)(r < rows ? start[b] + r / group : length - 1);
            }
        for (int64_t h = 0; h < hkv; ++h)
            for (int64_t v = 0; v < nv; ++v) {
                float *dst = qt + (h * vecs + v) * D * LANES;
                for (int i = 0; i < LANES; ++i) {
                    const int64_t r = v * LANES + i;
                    const float *src = q + ((b * t_max + r / group) * hq + h * group + r % group) * D;
                    for (int64_t d = 0; d < D; ++d) dst[d * LANES + i] = r < rows ? src[d] * scale : 0.0f;
                }
                memset(ot + (h * vecs + v) * D * LANES, 0, sizeof(float) * D * LANES);
                run_max[h * vecs + v] = (v16){0} - INFINITY;
                run_sum[h * vecs + v] = (v16){0};
            }
        for (int64_t j = 0; j < pages; ++j) {
            if (j + 1 < pages) /* the next page's keys and values, while this one is computed */
                for (int64_t h = 0; h < hkv; ++h) {
                    prefetch_page(k_pages + (int64_t)table[j + 1] * stride_kp + h * stride_kh, page_size, stride_ks);
                    prefetch_page(v_pages + (int64_t)table[j + 1] * stride_vp + h * stride_vh, page_size, stride_vs);
                }
            const int64_t valid = length - j * page_size < page_size ? length - j * page_size : page_size;
            const int masked = j * page_size + valid - 1 >= start[b]; /* holds a position some row must not see */
            for (int64_t h = 0; h < hkv; ++h) {
                const float *kp = k_pages + (int64_t)table[j] * stride_kp + h * stride_kh;
                const float *vp = v_pages + (int64_t)table[j] * stride_vp + h * stride_vh;
                for (int64_t v = 0; v < nv; ++v) {
                    const float *qv = qt + (h * vecs + v) * D * LANES;
                    float *ov = ot + (h * vecs + v) * D * LANES;
                    for (int64_t c = 0; c < valid; c += LANES) { /* chunks of at most 16 slots */
                        const int64_t n = valid - c < LANES ? valid - c : LANES;
                        v16 s[LANES];
                        for (int64_t s0 = 0; s0 < n; s0 += SLOTS) { /* scores, SLOTS slots per pass over q */
                            const int64_t m = n - s0 < SLOTS ? n - s0 : SLOTS;
                            v16 acc[SLOTS];
                            for (int i = 0; i < SLOTS; ++i) acc[i] = (v16){0};
                            const float *key = kp + (c + s0) * stride_ks;
                            if (m == SLOTS)
                                for (int64_t d = 0; d < D; ++d) {
                                    const v16 qd = load16(qv + d * LANES);
                                    for (int i = 0; i < SLOTS; ++i) acc[i] += key[i * stride_ks + d] * qd;
                                }
                            else
                                for (int64_t d = 0; d < D; ++d) {
                                    const v16 qd = load16(qv + d * LANES);
                                    for (int64_t i = 0; i < m; ++i) acc[i] += key[i * stride_ks + d] * qd;
                                }
                            for (int64_t i = 0; i < m; ++i) s[s0 + i] = acc[i];
                        }
                        if (masked)
                            for (int64_t i = 0; i < n; ++i) {
                                const i16 hide = (v16){0} + (float)(j * page_size + c + i) > last[v];
                                i16 bits;
                                memcpy(&bits, &s[i], sizeof bits);
                                const i16 ninf = (i16){0} + (int32_t)0xff800000;
                                bits = (bits & ~hide) | (ninf & hide);
                                memcpy(&s[i], &bits, sizeof bits);
                            }
                        v16 top = run_max[h * vecs + v];
                        for (int64_t i = 0; i < n; ++i) top = max16(top, s[i]);
                        const v16 shrink = exp16(run_max[h * vecs + v] - top); /* 0 on the first chunk */
                        run_max[h * vecs + v] = top;
                        v16 sum = run_sum[h * vecs + v] * shrink;
                        for (int64_t i = 0; i < n; ++i) {
                            s[i] = exp16(s[i] - top);
                            sum += s[i];
                        }
                        run_sum[h * vecs + v] = sum;
                        const float *val = vp + c * stride_vs;
                        for (int64_t d = 0; d < D; d += SLOTS) { /* out[d] = out[d] * shrink + sum_i v[i][d] p_i */
                            const int64_t w = D - d < SLOTS ? D - d : SLOTS;
                            v16 acc[SLOTS];
                            for (int64_t e = 0; e < w; ++e) acc[e] = load16(ov + (d + e) * LANES) * shrink;
                            if (w == SLOTS)
                                for (int64_t i = 0; i < n; ++i)
                                    for (int e = 0; e < SLOTS; ++e) acc[e] += val[i * stride_vs + d + e] * s[i];
                            else
                                for (int64_t i = 0; i < n; ++i)
                                    for (int64_t e = 0; e < w; ++e) acc[e] += val[i * stride_vs + d + e] * s[i];
                            for (int64_t e = 0; e < w; ++e) store16(ov + (d + e) * LANES, acc[e]);
                        }
                    }
                }
            }
        }
        for (int64_t h = 0; h < hkv; ++h)
            for (int64_t v = 0; v < nv; ++v) {
                const v16 inv = 1.0f / run_sum[h * vecs + v];
                const float *ov = ot + (h * vecs + v) * D * LANES;
                for (int i = 0; i < LANES && v * LANES + i < rows; ++i) {
                    const int64_t r = v * LANES + i;
                    float *dst = out + ((b * t_max + r / group) * hq + h * group + r % group) * D;
                    for (int64_t d = 0; d < D; ++d) dst[d] = ov[d * LANES + i] * inv[i];
                }
            }
    }
}
