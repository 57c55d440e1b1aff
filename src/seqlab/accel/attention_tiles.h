/* The register tiles of seqlab's causal attention kernels (prefill_attention.c, its forward; attention_backward.c,
 * the training backward): MR rows x NR columns of fp32 accumulators, each an outer-product step over the reduction
 * (a broadcast from one side, two vector loads from the other), so no tile needs a horizontal sum. */
#ifndef SEQLAB_ATTENTION_TILES_H
#define SEQLAB_ATTENTION_TILES_H
#include <stdint.h>

#include "simd.h"

#define NR (2 * VL) /* columns per register tile: keys in the score product, head dims in the value product */
#define MR 6  /* rows per register tile: 12 accumulators, 2 loads and a broadcast fit AVX2's 16 registers */

static inline float element(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* dst[d][j] = src[j][d] (row j at src + j * st; fp32, or bf16 widened) for j < n, and 0 for n <= j < ld. Eight
 * rows at a time, so that each store is a run of eight floats: element by element, the stores went to D different
 * cache lines per row and took a fifth of a training-sized forward. */
static inline void transpose_rows(const void *src, int64_t st, int bf16, int64_t n, int64_t D, float *dst,
                                  int64_t ld) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int64_t d = 0; d < D; d++)
            for (int l = 0; l < 8; l++) dst[d * ld + j + l] = element(src, (j + l) * st + d, bf16);
    for (; j < n; j++)
        for (int64_t d = 0; d < D; d++) dst[d * ld + j] = element(src, j * st + d, bf16);
    for (int64_t d = 0; d < D; d++)
        for (int64_t i = n; i < ld; i++) dst[d * ld + i] = 0.0f;
}

/* s[r][j0 .. j0+NR) = qs[r] . kt[:, j0 .. j0+NR) for MR rows */
static inline void score_tile(const float *qs, int64_t D, const float *kt, int64_t ld_kt, float *s, int64_t ld_s) {
    vf acc[MR][2];
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = vzero();
    for (int64_t d = 0; d < D; d++) {
        const vf k0 = vload(kt + d * ld_kt), k1 = vload(kt + d * ld_kt + VL);
        for (int r = 0; r < MR; r++) {
            const vf b = vset1(qs[r * D + d]);
            acc[r][0] = vfma(b, k0, acc[r][0]);
            acc[r][1] = vfma(b, k1, acc[r][1]);
        }
    }
    for (int r = 0; r < MR; r++) {
        vstore(s + r * ld_s, acc[r][0]);
        vstore(s + r * ld_s + VL, acc[r][1]);
    }
}
#endif
