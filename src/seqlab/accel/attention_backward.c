/* Backward of causal self-attention (queries and keys start together), given the forward's output and each row's
 * log-sum-exp: with P = softmax(scale q k^T) recomputed from the log-sum-exp,
 *   dV = P^T dO,   dS = P * (dO V^T - rowsum(dO * O)),   dQ = scale dS K,   dK = scale dS^T Q.
 * Each task is one batch row's kv head, with every query head that reads it (grouped-query heads add into the
 * same dK and dV, so no two tasks write one row). Where those tasks would leave threads idle (one kv head at batch
 * 1: MQA), each kv head's query blocks are cut into slices of about equal causal work, and a slice after the first
 * adds into its own dK and dV scratch, summed in at the end. Per block of BQ query rows a task computes the scores
 * and dO V^T in the lower triangle only, in the register tiles of the forward, and the three products from them;
 * K^T and V^T are packed once per task, in the forward's panels. Everything is fp32. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention_tiles.h"

#define BQ 48 /* query rows per block (the forward's block) */
#define MAX_SLICES 8

typedef struct {
    const float *q, *k, *v, *out, *dout, *lse; /* lse: [batch, n_heads, len], contiguous */
    float *dq, *dk, *dv;                       /* written whole (dk and dv start from zero here) */
    int64_t batch, n_heads, n_kv, len, head_dim;
    /* batch, head, position; in elements (the last dimension is contiguous) */
    int64_t q_strides[3], k_strides[3], v_strides[3], out_strides[3], dout_strides[3];
    int64_t dq_strides[3], dk_strides[3], dv_strides[3];
    float scale;
} AttentionGrad;

/* dst[r][c0 .. c0+NR) = mul * sum_{j < n} a[r][j] m[j][c0 ..) for MR rows (a: ld_a; m: rows of stride m_st);
 * rows r < `rows` are stored */
static inline void rows_by_matrix(const float *a, int64_t ld_a, const float *m, int64_t m_st, int64_t n, float mul,
                                  float *dst, int64_t dst_st, int rows) {
    vf acc[MR][2];
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = vzero();
    for (int64_t j = 0; j < n; j++) {
        const vf m0 = vload(m + j * m_st), m1 = vload(m + j * m_st + VL);
        for (int r = 0; r < MR; r++) {
            const vf b = vset1(a[r * ld_a + j]);
            acc[r][0] = vfma(b, m0, acc[r][0]);
            acc[r][1] = vfma(b, m1, acc[r][1]);
        }
    }
    const vf s = vset1(mul);
    for (int r = 0; r < rows; r++) {
        vstore(dst + r * dst_st, vmul(acc[r][0], s));
        vstore(dst + r * dst_st + VL, vmul(acc[r][1], s));
    }
}

/* dst[j][c0 .. c0+NR) += sum_{r0 <= r < r1} a[r][j] x[r][c0 ..) for the MR columns j of a starting at its pointer
 * (a transposed product: the block's rows are the reduction); columns j < `cols` are stored */
static inline void columns_by_rows(const float *a, int64_t ld_a, const float *x, int64_t x_st, int64_t r0,
                                   int64_t r1, float *dst, int64_t dst_st, int cols) {
    vf acc[MR][2];
    for (int j = 0; j < MR; j++) acc[j][0] = acc[j][1] = vzero();
    for (int64_t r = r0; r < r1; r++) {
        const vf x0 = vload(x + r * x_st), x1 = vload(x + r * x_st + VL);
        for (int j = 0; j < MR; j++) {
            const vf b = vset1(a[r * ld_a + j]);
            acc[j][0] = vfma(b, x0, acc[j][0]);
            acc[j][1] = vfma(b, x1, acc[j][1]);
        }
    }
    for (int j = 0; j < cols; j++) {
        vstore(dst + j * dst_st, vadd(vload(dst + j * dst_st), acc[j][0]));
        vstore(dst + j * dst_st + VL, vadd(vload(dst + j * dst_st + VL), acc[j][1]));
    }
}

/* Slices per kv head: 1 where the B x G tasks already share out evenly over the threads (or are so many that the
 * last round's idle threads cost little), else the fewest that make the task count a multiple of the thread count
 * (at most MAX_SLICES, and no more than the query blocks). */
static int64_t slices_per_head(int64_t tasks, int64_t nqb, int nthreads) {
    if (nthreads <= 1 || tasks % nthreads == 0 || tasks >= 4 * nthreads) return 1;
    int64_t s = 2;
    while (s < MAX_SLICES && (tasks * s) % nthreads) s++;
    return s < nqb ? s : nqb;
}

/* The first query block of slice `s` of `slices`: block b costs about b + 1 units (its causal keys), so slices
 * start where the running sum passes each s / slices of the whole. */
static int64_t slice_start(int64_t nqb, int64_t s, int64_t slices) {
    if (s >= slices) return nqb;
    const double goal = (double)s / (double)slices * (double)(nqb * (nqb + 1) / 2);
    int64_t b = 0;
    for (double done = 0.0; b < nqb && done < goal; b++) done += (double)(b + 1);
    return b;
}

/* Returns 0, or -1 where the shape is not one this kernel takes (head_dim not a multiple of NR) or memory ran out. */
int seqlab_causal_attention_backward(const AttentionGrad *a, int nthreads) {
    const int64_t B = a->batch, H = a->n_heads, G = a->n_kv, T = a->len, D = a->head_dim;
    if (D % NR || H % G || T <= 0) return -1;
    const int64_t group = H / G, mq = round_up(BQ, MR);
    /* score rows: every key, plus a tile's worth of zero columns that the transposed products may read past i1 */
    const int64_t ld = round_up(T, NR) + NR;
    const int64_t nqb = (T + BQ - 1) / BQ, slices = slices_per_head(B * G, nqb, nthreads);
    int64_t first[MAX_SLICES + 1]; /* slice s runs query blocks first[s] .. first[s + 1] */
    for (int64_t s = 0; s <= slices; s++) first[s] = slice_start(nqb, s, slices);
    /* dK and dV of the slices after the first: [B * G][slices - 1][T][D] each */
    float *part_k = NULL, *part_v = NULL;
    if (slices > 1) {
        const size_t n = (size_t)round_up(B * G * (slices - 1) * T * D, 16) * sizeof(float);
        part_k = aligned_alloc(64, n);
        part_v = aligned_alloc(64, n);
        if (!part_k || !part_v) {
            free(part_k);
            free(part_v);
            return -1;
        }
    }
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *kt = aligned_alloc(64, (size_t)(D * ld) * sizeof(float)); /* K^T and V^T of the task's kv head, in
                                                                            panels of NR keys */
        float *vt = aligned_alloc(64, (size_t)(D * ld) * sizeof(float));
        float *qs = aligned_alloc(64, (size_t)(mq * D) * sizeof(float)); /* scale * Q rows of the block */
        float *dos = aligned_alloc(64, (size_t)(mq * D) * sizeof(float));
        float *p = aligned_alloc(64, (size_t)(mq * ld) * sizeof(float));
        float *ds = aligned_alloc(64, (size_t)(mq * ld) * sizeof(float)); /* dO V^T, then dS in place */
        float delta[BQ + MR];
        const int ok = kt && vt && qs && dos && p && ds;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < B * G * slices; task++) {
            if (!ok) continue;
            const int64_t bg = task / slices, slice = task % slices, b = bg / G, g = bg % G;
            const int64_t seen = first[slice + 1] * BQ < T ? first[slice + 1] * BQ : T; /* keys it sees: 0 .. seen */
            const float *k = a->k + b * a->k_strides[0] + g * a->k_strides[1];
            const float *v = a->v + b * a->v_strides[0] + g * a->v_strides[1];
            float *dk, *dv;
            int64_t dk_st, dv_st, zeroed;
            if (slice == 0) { /* the first slice owns the outputs, and zeroes every row of them */
                dk = a->dk + b * a->dk_strides[0] + g * a->dk_strides[1];
                dv = a->dv + b * a->dv_strides[0] + g * a->dv_strides[1];
                dk_st = a->dk_strides[2], dv_st = a->dv_strides[2], zeroed = T;
            } else {
                dk = part_k + (bg * (slices - 1) + slice - 1) * T * D;
                dv = part_v + (bg * (slices - 1) + slice - 1) * T * D;
                dk_st = dv_st = D, zeroed = seen;
            }
            const int64_t k_st = a->k_strides[2], v_st = a->v_strides[2];
            pack_key_panels(k, k_st, 0, seen, D, kt, round_up(seen, NR));
            pack_key_panels(v, v_st, 0, seen, D, vt, round_up(seen, NR));
            for (int64_t j = 0; j < zeroed; j++) {
                memset(dk + j * dk_st, 0, (size_t)D * sizeof(float));
                memset(dv + j * dv_st, 0, (size_t)D * sizeof(float));
            }
            for (int64_t h = g * group; h < (g + 1) * group; h++) {
                const float *q = a->q + b * a->q_strides[0] + h * a->q_strides[1];
                const float *o = a->out + b * a->out_strides[0] + h * a->out_strides[1];
                const float *dout = a->dout + b * a->dout_strides[0] + h * a->dout_strides[1];
                const float *lse = a->lse + (b * H + h) * T;
                float *dq = a->dq + b * a->dq_strides[0] + h * a->dq_strides[1];
                for (int64_t i0 = first[slice] * BQ; i0 < seen; i0 += BQ) {
                    const int64_t rows = (i0 + BQ < T ? i0 + BQ : T) - i0, mrows = round_up(rows, MR);
                    const int64_t i1 = i0 + rows, cols = round_up(i1, NR);
                    for (int64_t r = 0; r < mrows; r++) {
                        const float *qr = q + (i0 + r) * a->q_strides[2];
                        const float *gr = dout + (i0 + r) * a->dout_strides[2];
                        const float *orow = o + (i0 + r) * a->out_strides[2];
                        float dot = 0.0f;
                        for (int64_t d = 0; d < D; d++) {
                            qs[r * D + d] = r < rows ? qr[d] * a->scale : 0.0f;
                            dos[r * D + d] = r < rows ? gr[d] : 0.0f;
                            if (r < rows) dot += gr[d] * orow[d];
                        }
                        delta[r] = dot;
                    }
                    for (int64_t r0 = 0; r0 < mrows; r0 += MR) {
                        const int64_t last = i0 + r0 + MR - 1; /* the tile's last query sees keys 0..last */
                        for (int64_t j0 = 0; j0 <= last && j0 < cols; j0 += NR) {
                            score_tile(qs + r0 * D, D, kt + j0 * D, NR, p + r0 * ld + j0, ld);
                            score_tile(dos + r0 * D, D, vt + j0 * D, NR, ds + r0 * ld + j0, ld);
                        }
                    }
                    /* P from the forward's log-sum-exp, and dS = P (dP - delta); zero past each row's last key */
                    for (int64_t r = 0; r < mrows; r++) {
                        float *pr = p + r * ld, *dr = ds + r * ld;
                        const int64_t n = r < rows ? i0 + r + 1 : 0;
                        const vf m = vset1(r < rows ? lse[i0 + r] : 0.0f), dl = vset1(delta[r]);
                        int64_t j = 0;
                        for (; j + VL <= n; j += VL) {
                            const vf e = vexp(vsub(vload(pr + j), m));
                            vstore(pr + j, e);
                            vstore(dr + j, vmul(e, vsub(vload(dr + j), dl)));
                        }
                        for (; j < n; j++) {
                            const float e = expf(pr[j] - lse[i0 + r]);
                            pr[j] = e;
                            dr[j] = e * (dr[j] - delta[r]);
                        }
                        memset(pr + n, 0, (size_t)(cols + NR - n) * sizeof(float));
                        memset(dr + n, 0, (size_t)(cols + NR - n) * sizeof(float));
                    }
                    /* dQ rows of the block: scale * dS K over the keys each row tile sees */
                    for (int64_t r0 = 0; r0 < mrows; r0 += MR) {
                        const int64_t n = i0 + r0 + MR < i1 ? i0 + r0 + MR : i1;
                        const int nrows = (int)(rows - r0 < MR ? rows - r0 : MR);
                        for (int64_t c0 = 0; c0 < D; c0 += NR)
                            rows_by_matrix(ds + r0 * ld, ld, k + c0, k_st, n, a->scale,
                                           dq + (i0 + r0) * a->dq_strides[2] + c0, a->dq_strides[2], nrows);
                    }
                    /* dV += P^T dO and dK += dS^T (scale Q) for keys 0..i1: key j sees the block's rows from j on */
                    for (int64_t j0 = 0; j0 < i1; j0 += MR) {
                        const int64_t r_from = j0 > i0 ? j0 - i0 : 0;
                        const int ncols = (int)(i1 - j0 < MR ? i1 - j0 : MR);
                        for (int64_t c0 = 0; c0 < D; c0 += NR) {
                            columns_by_rows(p + j0, ld, dos + c0, D, r_from, rows, dv + j0 * dv_st + c0, dv_st, ncols);
                            columns_by_rows(ds + j0, ld, qs + c0, D, r_from, rows, dk + j0 * dk_st + c0, dk_st, ncols);
                        }
                    }
                }
            }
        }
        free(kt);
        free(vt);
        free(qs);
        free(dos);
        free(p);
        free(ds);
        if (slices > 1) { /* the later slices' dK and dV into the outputs, row by row (after the loop's barrier) */
#pragma omp for schedule(static)
            for (int64_t row = 0; row < B * G * T; row++) {
                const int64_t bg = row / T, j = row % T, b = bg / G, g = bg % G;
                float *dk = a->dk + b * a->dk_strides[0] + g * a->dk_strides[1] + j * a->dk_strides[2];
                float *dv = a->dv + b * a->dv_strides[0] + g * a->dv_strides[1] + j * a->dv_strides[2];
                for (int64_t slice = 1; slice < slices; slice++) {
                    if (j >= first[slice + 1] * BQ) continue; /* a key the slice never saw */
                    const int64_t at = ((bg * (slices - 1) + slice - 1) * T + j) * D;
                    for (int64_t d = 0; d < D; d += VL) {
                        vstore(dk + d, vadd(vload(dk + d), vload(part_k + at + d)));
                        vstore(dv + d, vadd(vload(dv + d), vload(part_v + at + d)));
                    }
                }
            }
        }
    }
    free(part_k);
    free(part_v);
    return failed ? -1 : 0;
}
