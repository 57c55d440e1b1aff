/* Causal self-attention of a prefill: out_i = softmax(q_i . k_j * scale, j <= i) . v_j, for every query i of a
 * fresh prompt (queries and keys start together). Each task is one head's block of BQ queries: it computes the
 * block's scores against keys 0..i in one register-tiled product, takes each row's softmax exactly (no online
 * rescaling: the whole score row fits the task's scratch), and multiplies by V with the 1/sum folded into the store.
 * Keys are first packed once per kv head into panels of K^T, so that each score tile reads its keys as one
 * contiguous run. Tasks run largest first (the causal blocks grow along the prompt) under a dynamic OpenMP schedule.
 * The math is fp32; bf16 inputs are widened once (K and V into the same scratch), and a bf16 output is rounded
 * once, from fp32 partial sums. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention_tiles.h"

#define BK 512 /* keys per block: each block of K^T and V is reused from cache by all of a task's row tiles */
#define BQ 48 /* query rows per task (measured: 6 x 48 beat 4 x 64 by 5-15 % in the AVX2 build, and
                 matched 8 x 64 in the AVX-512 one) */

typedef struct {
    const void *q, *k, *v; /* fp32, or bf16 where `bf16`: then widened once (K and V into scratch), out bf16 */
    void *out;
    int64_t batch, n_heads, n_kv, len, head_dim;
    int64_t q_strides[3], k_strides[3], v_strides[3], out_strides[3]; /* batch, head, position; in elements */
    float scale;
    int64_t bf16;
    float *lse; /* NULL, or [batch, n_heads, len]: each row's log-sum-exp of its scaled scores (for a backward) */
} Attention;

/* rows r < `rows` of sum_{j0 <= j < j1} p[r][j] v[j][c0 .. c0+NR), for MR rows: the first key block starts from
 * zero, later ones add to the partial sums the earlier ones left in `part` (stride part_st), and the last scales by
 * inv[r] = 1 / the row's softmax sum and stores into `dst` (fp32, or bf16 where dst_bf16; stride dst_st). Key
 * blocks keep the V rows a block reads in cache across the row tiles. */
static inline void value_tile(const float *p, int64_t ld_p, const float *v, int64_t v_st, int64_t j0, int64_t j1,
                              float *part, int64_t part_st, void *dst, int64_t dst_st, int dst_bf16, const float *inv,
                              int rows, int first, int last) {
    vf acc[MR][2];
    for (int r = 0; r < MR; r++) {
        acc[r][0] = first || r >= rows ? vzero() : vload(part + r * part_st);
        acc[r][1] = first || r >= rows ? vzero() : vload(part + r * part_st + VL);
    }
    for (int64_t j = j0; j < j1; j++) {
        const vf v0 = vload(v + j * v_st), v1 = vload(v + j * v_st + VL);
        for (int r = 0; r < MR; r++) {
            const vf b = vset1(p[r * ld_p + j]);
            acc[r][0] = vfma(b, v0, acc[r][0]);
            acc[r][1] = vfma(b, v1, acc[r][1]);
        }
    }
    for (int r = 0; r < rows; r++) {
        if (!last) {
            vstore(part + r * part_st, acc[r][0]);
            vstore(part + r * part_st + VL, acc[r][1]);
        } else if (dst_bf16) {
            const vf s = vset1(inv[r]);
            vstore_bf16((uint16_t *)dst + r * dst_st, vmul(acc[r][0], s));
            vstore_bf16((uint16_t *)dst + r * dst_st + VL, vmul(acc[r][1], s));
        } else {
            const vf s = vset1(inv[r]);
            vstore((float *)dst + r * dst_st, vmul(acc[r][0], s));
            vstore((float *)dst + r * dst_st + VL, vmul(acc[r][1], s));
        }
    }
}

/* qs[r] := scale * query row r (fp32, or bf16 widened), r < rows, as vectors (D is a multiple of NR); zero rows
 * from `rows` to `mrows` (the last tile's padding). Element by element this copy took 4 % of the kernel. */
static void scaled_queries(const void *q, int64_t q0, int64_t st, int bf16, int64_t rows, int64_t mrows, int64_t D,
                           float scale, float *qs) {
    const vf s = vset1(scale);
    for (int64_t r = 0; r < mrows; r++)
        for (int64_t d = 0; d < D; d += VL) {
            const int64_t i = q0 + r * st + d;
            const vf x = r >= rows ? vzero() : bf16 ? vload_bf16((const uint16_t *)q + i) : vload((const float *)q + i);
            vstore(qs + r * D + d, vmul(x, s));
        }
}

/* row := exp(row - max) over its first n entries, zero from n to end; returns 1 / sum, and the max in *max */
static float softmax_row(float *row, int64_t n, int64_t end, float *max) {
    vf m = vset1(-3.4e38f);
    int64_t j = 0;
    for (; j + VL <= n; j += VL) m = vmax(m, vload(row + j));
    float mx = -3.4e38f;
    {
        float lanes[VL];
        vstore(lanes, m);
        for (int l = 0; l < VL; l++) mx = lanes[l] > mx ? lanes[l] : mx;
    }
    for (; j < n; j++) mx = row[j] > mx ? row[j] : mx;
    const vf vm = vset1(mx);
    vf acc = vzero();
    for (j = 0; j + VL <= n; j += VL) {
        const vf e = vexp(vsub(vload(row + j), vm));
        vstore(row + j, e);
        acc = vadd(acc, e);
    }
    if (j < n) { /* the tail through a zero-padded vector */
        float tail[VL];
        for (int l = 0; l < VL; l++) tail[l] = j + l < n ? row[j + l] - mx : -88.0f;
        vf e = vexp(vload(tail));
        vstore(tail, e);
        for (int l = 0; l < VL; l++) tail[l] = j + l < n ? tail[l] : 0.0f;
        e = vload(tail);
        acc = vadd(acc, e);
        for (int l = 0; j + l < n; l++) row[j + l] = tail[l];
        j = n;
    }
    if (end > n) memset(row + n, 0, (size_t)(end - n) * sizeof(float));
    *max = mx;
    return 1.0f / vsum(acc);
}

/* Returns 0, or -1 where the shape is not one this kernel takes (head_dim not a multiple of NR) or memory ran out. */
int seqlab_causal_attention(const Attention *a, int nthreads) {
    const int64_t B = a->batch, H = a->n_heads, G = a->n_kv, T = a->len, D = a->head_dim;
    if (D % NR || H % G || T <= 0) return -1;
    const int64_t tpad = round_up(T, NR), nqb = (T + BQ - 1) / BQ, group = H / G;
    const int bf16 = a->bf16 != 0;
    float *kt = aligned_alloc(64, (size_t)(B * G * D * tpad) * sizeof(float));
    /* bf16 values are widened once into [B, G, T, D] fp32; fp32 ones are read where they are */
    float *vw = bf16 ? aligned_alloc(64, (size_t)(B * G * D * tpad) * sizeof(float)) : NULL;
    if (!kt || (bf16 && !vw)) {
        free(kt);
        free(vw);
        return -1;
    }
    const int64_t v_st = bf16 ? D : a->v_strides[2];
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for collapse(2) schedule(static)
        for (int64_t b = 0; b < B; b++)
            for (int64_t g = 0; g < G; g++) {
                const int64_t k0 = b * a->k_strides[0] + g * a->k_strides[1];
                const int64_t v0 = b * a->v_strides[0] + g * a->v_strides[1];
                const void *k = (const char *)a->k + k0 * (bf16 ? sizeof(uint16_t) : sizeof(float));
                pack_key_panels(k, a->k_strides[2], bf16, T, D, kt + (b * G + g) * D * tpad, tpad);
                if (bf16)
                    for (int64_t j = 0; j < T; j++)
                        for (int64_t d = 0; d < D; d++)
                            vw[((b * G + g) * tpad + j) * D + d] = element(a->v, v0 + j * a->v_strides[2] + d, 1);
            }
        float *qs = aligned_alloc(64, (size_t)(round_up(BQ, MR) * D) * sizeof(float));
        float *s = aligned_alloc(64, (size_t)(round_up(BQ, MR) * tpad) * sizeof(float));
        /* a bf16 call's rows add up over key blocks in fp32 here before their one rounding to bf16 */
        float *o32 = bf16 ? aligned_alloc(64, (size_t)(round_up(BQ, MR) * D) * sizeof(float)) : NULL;
        float inv[BQ + MR];
        const int ok = qs && s && (!bf16 || o32);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < B * H * nqb; t++) {
            if (!ok) continue; /* its tasks are left undone: the caller sees -1 and falls back */
            const int64_t qb = nqb - 1 - t / (B * H), bh = t % (B * H), b = bh / H, h = bh % H, g = h / group;
            const int64_t i0 = qb * BQ, rows = (i0 + BQ < T ? i0 + BQ : T) - i0, mrows = round_up(rows, MR);
            const int64_t i1 = i0 + rows, cols = round_up(i1, NR);
            const int64_t q0 = b * a->q_strides[0] + h * a->q_strides[1] + i0 * a->q_strides[2];
            const int64_t o0 = b * a->out_strides[0] + h * a->out_strides[1] + i0 * a->out_strides[2];
            const int64_t o_st = a->out_strides[2];
            const float *ktg = kt + (b * G + g) * D * tpad;
            const float *v = bf16 ? vw + (b * G + g) * tpad * D
                                  : (const float *)a->v + b * a->v_strides[0] + g * a->v_strides[1];
            void *out = bf16 ? (void *)((uint16_t *)a->out + o0) : (void *)((float *)a->out + o0);
            /* partial sums across key blocks: in the fp32 output itself, or in fp32 scratch for a bf16 one */
            float *part = bf16 ? o32 : (float *)out;
            const int64_t part_st = bf16 ? D : o_st;
            scaled_queries(a->q, q0, a->q_strides[2], bf16, rows, mrows, D, a->scale, qs);
            for (int64_t jb = 0; jb < cols; jb += BK) /* key blocks: the block of K^T stays in cache */
                for (int64_t r0 = 0; r0 < mrows; r0 += MR) {
                    const int64_t last = i0 + r0 + MR - 1; /* the tile's last query sees keys 0..last */
                    for (int64_t j0 = jb; j0 < jb + BK && j0 <= last && j0 < cols; j0 += NR)
                        score_tile(qs + r0 * D, D, ktg + j0 * D, NR, s + r0 * tpad + j0, tpad);
                }
            for (int64_t r = 0; r < mrows; r++) {
                if (r < rows) {
                    float mx;
                    inv[r] = softmax_row(s + r * tpad, i0 + r + 1, cols, &mx);
                    if (a->lse) a->lse[(b * H + h) * T + i0 + r] = mx - logf(inv[r]);
                } else
                    memset(s + r * tpad, 0, (size_t)cols * sizeof(float));
            }
            for (int64_t j0 = 0; j0 < i1; j0 += BK)
                for (int64_t r0 = 0; r0 < mrows; r0 += MR) {
                    const int64_t n = i0 + r0 + MR < i1 ? i0 + r0 + MR : i1; /* keys the tile's rows see */
                    if (j0 >= n) continue;
                    const int64_t j1 = j0 + BK < n ? j0 + BK : n;
                    const int nrows = (int)(rows - r0 < MR ? rows - r0 : MR);
                    for (int64_t c0 = 0; c0 < D; c0 += NR) {
                        void *dst = bf16 ? (void *)((uint16_t *)out + r0 * o_st + c0)
                                         : (void *)((float *)out + r0 * o_st + c0);
                        value_tile(s + r0 * tpad, tpad, v + c0, v_st, j0, j1, part + r0 * part_st + c0, part_st,
                                   dst, o_st, bf16, inv + r0, nrows, j0 == 0, j1 == n);
                    }
                }
        }
        free(qs);
        free(s);
        free(o32);
    }
    free(kt);
    free(vw);
    return failed ? -1 : 0;
}
