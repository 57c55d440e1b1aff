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

/* K^T in panels of NR keys: panel p holds keys p*NR .. p*NR+NR-1 as [D][NR], so a score tile reads its D x NR
 * slice of K^T as one contiguous run, where a plain [D][tpad] transpose spreads it over D rows a whole prompt
 * apart (measured on a Zen 3, one thread: the forward 5-13 % faster with the panels). Keys n .. tpad-1 are zero. */
static inline void pack_key_panels(const void *src, int64_t st, int bf16, int64_t n, int64_t D, float *dst,
                                   int64_t tpad) {
    for (int64_t j0 = 0; j0 < tpad; j0 += NR) {
        float *panel = dst + j0 * D;
        for (int64_t jj = 0; jj < NR; jj++) {
            const int64_t j = j0 + jj;
            for (int64_t d = 0; d < D; d++) panel[d * NR + jj] = j < n ? element(src, j * st + d, bf16) : 0.0f;
        }
    }
}

/* s[r][j0 .. j0+NR) = qs[r] . kt[:, j0 .. j0+NR) for MR rows (kt: a panel of pack_key_panels, ld_kt = NR) */
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
