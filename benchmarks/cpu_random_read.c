/* Read bandwidth of one core for runs of 2, 4 and 8 KB: in order, at random places, and at random places with
 * the next runs prefetched (__builtin_prefetch of every line, 8 runs ahead) or touched (one demand load of
 * each run's first line, 8 runs ahead). What the CPU sparse decode reads is runs like these: one page of one
 * KV head (2 KB for 16 tokens x 32 fp32) at the chosen pages (docs/cpu_decode.md).
 *
 *     cc -O3 -march=native benchmarks/cpu_random_read.c -o /tmp/cpu_random_read && /tmp/cpu_random_read
 *
 * Prints GB/s read (best of 3) for a 512 MB buffer, a tenth of its runs read per measurement. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef float v16 __attribute__((vector_size(64)));

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void) {
    const size_t total = (size_t)512 << 20, ahead = 8;
    char *buf = aligned_alloc(4096, total);
    memset(buf, 1, total);
    const char *modes[] = {"in order", "random", "random, prefetched", "random, touched"};
    srand(1);
    for (size_t run = 2048; run <= 8192; run *= 2) {
        const size_t n = total / run, m = n / 10;
        size_t *at = malloc(m * sizeof *at);
        for (size_t i = 0; i < m; ++i) at[i] = ((size_t)rand() * 7919u + (size_t)rand()) % n;
        for (int mode = 0; mode < 4; ++mode) {
            double best = 1e30;
            v16 acc = {0};
            float touched = 0.0f;
            for (int rep = 0; rep < 3; ++rep) {
                const double t0 = now();
                for (size_t i = 0; i < m; ++i) {
                    if (mode >= 2 && i + ahead < m) {
                        const char *next = buf + at[i + ahead] * run;
                        if (mode == 2)
                            for (size_t o = 0; o < run; o += 64) __builtin_prefetch(next + o, 0, 3);
                        else
                            touched += *(const volatile float *)next;
                    }
                    const v16 *p = (const v16 *)(buf + (mode == 0 ? i : at[i]) * run);
                    for (size_t o = 0; o < run / sizeof(v16); ++o) acc += p[o];
                }
                const double t = now() - t0;
                best = t < best ? t : best;
            }
            printf("%5zu B runs, %-20s %6.2f GB/s  (%g)\n", run, modes[mode], m * run / best / 1e9,
                   (double)(acc[0] + touched) * 0.0);
        }
        free(at);
    }
    free(buf);
    return 0;
}
