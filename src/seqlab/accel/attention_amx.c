/* Causal self-attention for bf16 training on AMX tiles: the forward (with each row's log-sum-exp) and the backward
 * (queries and keys start together). Why: at a small width the attention of a bf16 training step takes a quarter of
 * it in fp32 vector arithmetic (attention_backward.c), while an AMX tile product does 16 x 16 x 32 multiply-adds per
 * instruction. Every product here is a tile product on bf16 operands with fp32 sums; softmax, the log-sum-exp and
 * dS = P (dP - delta) are fp32 vector arithmetic. P and dS are rounded to bf16 once, as operands of the next product
 * (as flash attention does in bf16 on GPUs); the outputs are rounded once from fp32 sums.
 *
 * Tile products read A as 16 rows of 32 bf16 and B in pairs along the reduction: B row kk, column n holds the two
 * reduction steps 2kk and 2kk + 1 of column n. Hence the packed layouts below: "rows" (a [TP][D] copy, A operands),
 * "word columns" (a [T][D] matrix as B whose reduction runs along D: its 32-bit words transposed) and "row pairs"
 * (a [T][N] matrix as B whose reduction runs along T: rows 2i and 2i+1 interleaved). A task is one batch row's kv
 * head with every query head that reads it (grouped-query heads add into one dK and dV); all of its packed operands
 * and a whole head's P and dS fit in a core's L2 cache at training lengths (MAX_LEN bounds the scratch). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "simd.h"

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define TR 16 /* rows of a tile; fp32 columns of an accumulator */
#define TK 32 /* bf16 reduction steps of one tile product */

typedef struct {
    const uint16_t *q, *k, *v;
    uint16_t *out;
    float *lse; /* [batch, n_heads, len], contiguous: each row's log-sum-exp of its scaled scores */
    int64_t batch, n_heads, n_kv, len, head_dim;
    int64_t q_strides[3], k_strides[3], v_strides[3], out_strides[3]; /* batch, head, position; in elements */
    float scale;
} AmxAttention;

typedef struct {
    const uint16_t *q, *k, *v, *out, *dout;
    const float *lse;
    uint16_t *dq, *dk, *dv;
    int64_t batch, n_heads, n_kv, len, head_dim;
    int64_t q_strides[3], k_strides[3], v_strides[3], out_strides[3], dout_strides[3];
    int64_t dq_strides[3], dk_strides[3], dv_strides[3];
    float scale;
} AmxAttentionGrad;

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Linux hands out the tile state only to processes that ask for it; 0 where granted */
int seqlab_amx_enable(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1; }

static void configure_tiles(void) { /* eight tiles of 16 rows x 64 bytes, per thread */
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.colsb[t] = 64, c.rows[t] = TR;
    _tile_loadconfig(&c);
}

static inline int64_t up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* 16 fp32 lanes rounded to bf16 (nearest even, as torch), each in the low half of a 32-bit lane */
static inline __m512i bf16_bits(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
}

/* the lanes of the 16 columns from j that lie below n */
static inline __mmask16 lanes_below(int64_t n, int64_t j) {
    return n - j >= VL ? (__mmask16)0xffff : n > j ? (__mmask16)((1u << (n - j)) - 1) : (__mmask16)0;
}

/* two rows' bf16 bits (low halves) as pairs: row r in the low half of each 32-bit word, row r + 1 in the high one */
static inline __m512i paired(__m512i r0, __m512i r1) { return _mm512_or_si512(r0, _mm512_slli_epi32(r1, 16)); }

/* rows: dst[i][0..D) = src row i for i < n, zero for n <= i < tp */
static void pack_rows(const uint16_t *src, int64_t st, int64_t n, int64_t D, int64_t tp, uint16_t *dst) {
    for (int64_t i = 0; i < tp; i++)
        if (i < n) memcpy(dst + i * D, src + i * st, (size_t)D * 2);
        else memset(dst + i * D, 0, (size_t)D * 2);
}

/* dst[c][0..16) = column c of the 16 x 16 array of 32-bit words at src (rows sst words apart; rows from `valid` on
 * read as zero), rows dst_st words apart: three rounds of interleaving in registers */
static void transpose_words(const uint32_t *src, int64_t sst, int64_t valid, uint32_t *dst, int64_t dst_st) {
    __m512i r[16], t[16], u[16];
    for (int i = 0; i < 16; i++) r[i] = i < valid ? _mm512_loadu_si512(src + i * sst) : _mm512_setzero_si512();
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* u[i + m], 128-bit lane l: column 4 l + m of rows i .. i + 3 */
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int m = 0; m < 4; m++) {
        const __m512i v = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x88);
        const __m512i w = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x88);
        const __m512i v1 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xdd);
        const __m512i w1 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xdd);
        _mm512_storeu_si512(dst + m * dst_st, _mm512_shuffle_i32x4(v, w, 0x88));
        _mm512_storeu_si512(dst + (8 + m) * dst_st, _mm512_shuffle_i32x4(v, w, 0xdd));
        _mm512_storeu_si512(dst + (4 + m) * dst_st, _mm512_shuffle_i32x4(v1, w1, 0x88));
        _mm512_storeu_si512(dst + (12 + m) * dst_st, _mm512_shuffle_i32x4(v1, w1, 0xdd));
    }
}

/* word columns: the B operand of (rows) x src^T, reduction along D. Block (db, jb) is a 16 x 16 array of 32-bit
 * words, [kk][jj] = word db * 16 + kk of src row jb * 16 + jj (zero for rows >= n): 1 KiB, contiguous. */
static void pack_word_columns(const uint16_t *src, int64_t st, int64_t n, int64_t D, int64_t tp, uint32_t *dst) {
    const int64_t nb = tp / TR;
    for (int64_t jb = 0; jb < nb; jb++) {
        const int64_t valid = n - jb * TR < 0 ? 0 : n - jb * TR;
        for (int64_t db = 0; db < D / TK; db++)
            transpose_words((const uint32_t *)(src + jb * TR * st + db * TK), st / 2, valid,
                            dst + (db * nb + jb) * TR * TR, TR);
    }
}

/* row pairs: the B operand of x src, reduction along src's rows: dst[i / 2][c][i % 2] = src[i][c] for i < n, zero
 * to tp. The tile for rows 32 c .. 32 c + 31 and columns 16 m .. 16 m + 15 starts at dst + c * 32 * N + m * 32,
 * rows 4 N bytes apart. */
static void pack_row_pairs(const uint16_t *src, int64_t st, int64_t n, int64_t N, int64_t tp, uint16_t *dst) {
    for (int64_t i = 0; i < tp; i += 2)
        for (int64_t c = 0; c < N; c += 16) {
            const __m256i *r0 = (const __m256i *)(src + i * st + c), *r1 = (const __m256i *)(src + (i + 1) * st + c);
            const __m512i lo = i < n ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(r0)) : _mm512_setzero_si512();
            const __m512i hi = i + 1 < n ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(r1)) : _mm512_setzero_si512();
            _mm512_storeu_si512(dst + i * N + 2 * c, paired(lo, hi));
        }
}

/* transposed: dst[d][0..tp) = column d of src (rows i < n; zero after), an A operand whose rows are src's columns:
 * row pairs first (`pairs`, [tp / 2][D] words), whose word transpose is the bf16 transpose */
static void pack_transposed(const uint16_t *src, int64_t st, int64_t n, int64_t D, int64_t tp, uint32_t *pairs,
                            uint16_t *dst) {
    pack_row_pairs(src, st, n, D, tp, (uint16_t *)pairs);
    for (int64_t i0 = 0; i0 < tp / 2; i0 += TR)
        for (int64_t d0 = 0; d0 < D; d0 += TR)
            transpose_words(pairs + i0 * D + d0, D, TR, (uint32_t *)dst + d0 * (tp / 2) + i0, tp / 2);
}

/* out[0..16) of row r = fp32 acc row (16 lanes) as bf16 */
static inline void store_bf16_row(uint16_t *dst, const float *src, int64_t D, float mul) {
    for (int64_t d = 0; d < D; d += VL) vstore_bf16(dst + d, vmul(vload(src + d), vset1(mul)));
}

/* o[16][D] (fp32) = a[16][0 .. 32 chunks) (bf16 rows, lda apart) x the row-pairs matrix `pairs` ([32 chunks][D]),
 * 32 columns at a time */
static void rows_by_pairs(const uint16_t *a, int64_t lda, const uint16_t *pairs, int64_t D, int64_t chunks, float *o) {
    for (int64_t m0 = 0; m0 < D / TR; m0 += 2) {
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t c = 0; c < chunks; c++) {
            _tile_loadd(4, a + c * TK, lda * 2);
            _tile_loadd(6, pairs + c * TK * D + m0 * TK, D * 4);
            _tile_loadd(7, pairs + c * TK * D + (m0 + 1) * TK, D * 4);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
        }
        _tile_stored(0, o + m0 * TR, D * 4);
        _tile_stored(1, o + (m0 + 1) * TR, D * 4);
    }
}

int seqlab_amx_attention(const AmxAttention *a, int nthreads) {
    const int64_t B = a->batch, H = a->n_heads, G = a->n_kv, T = a->len, D = a->head_dim;
    if (D % TK || H % G || T <= 0) return -1;
    const int64_t group = H / G, tp = up(T, TK), nb = tp / TR;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        uint32_t *kt = aligned_alloc(64, (size_t)(tp * D) * 2);  /* K, word columns */
        uint16_t *vv = aligned_alloc(64, (size_t)(tp * D) * 2);  /* V, row pairs */
        uint16_t *qp = aligned_alloc(64, (size_t)(tp * D) * 2);  /* Q, rows */
        float *s = aligned_alloc(64, (size_t)(TR * tp) * 4);     /* a block's scores */
        uint16_t *p = aligned_alloc(64, (size_t)(TR * tp) * 2);  /* its probabilities, bf16 */
        float *o = aligned_alloc(64, (size_t)(TR * D) * 4);
        const int ok = kt && vv && qp && s && p && o;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        } else
            configure_tiles();
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < B * G; task++) {
            if (!ok) continue;
            const int64_t b = task / G, g = task % G;
            pack_word_columns(a->k + b * a->k_strides[0] + g * a->k_strides[1], a->k_strides[2], T, D, tp, kt);
            pack_row_pairs(a->v + b * a->v_strides[0] + g * a->v_strides[1], a->v_strides[2], T, D, tp, vv);
            for (int64_t h = g * group; h < (g + 1) * group; h++) {
                pack_rows(a->q + b * a->q_strides[0] + h * a->q_strides[1], a->q_strides[2], T, D, tp, qp);
                uint16_t *out = a->out + b * a->out_strides[0] + h * a->out_strides[1];
                float *lse = a->lse + (b * H + h) * T;
                for (int64_t ib = 0; ib * TR < T; ib++) {
                    const int64_t i0 = ib * TR, rows = T - i0 < TR ? T - i0 : TR, kend = up(i0 + TR, TK);
                    if (D == 2 * TK) { /* the block's queries stay in two tiles across the key blocks */
                        _tile_loadd(4, qp + i0 * D, D * 2);
                        _tile_loadd(5, qp + i0 * D + TK, D * 2);
                    }
                    for (int64_t jb = 0; jb <= ib; jb++) { /* scores against the keys up to the block's last */
                        _tile_zero(0);
                        if (D == 2 * TK) {
                            _tile_loadd(6, kt + jb * TR * TR, 64);
                            _tile_loadd(7, kt + (nb + jb) * TR * TR, 64);
                            _tile_dpbf16ps(0, 4, 6);
                            _tile_dpbf16ps(0, 5, 7);
                        } else
                            for (int64_t db = 0; db < D / TK; db++) {
                                _tile_loadd(4, qp + i0 * D + db * TK, D * 2);
                                _tile_loadd(6, kt + (db * nb + jb) * TR * TR, 64);
                                _tile_dpbf16ps(0, 4, 6);
                            }
                        _tile_stored(0, s + jb * TR, tp * 4);
                    }
                    for (int64_t r = 0; r < TR; r++) { /* softmax over keys 0..i, rounded to bf16; zero after */
                        float *sr = s + r * tp;
                        uint16_t *pr = p + r * tp;
                        const int64_t n = r < rows ? i0 + r + 1 : 0;
                        vf m = vset1(-3.4e38f);
                        for (int64_t j = 0; j < n; j += VL)
                            m = _mm512_mask_max_ps(m, lanes_below(n, j), m, vmul(vload(sr + j), vset1(a->scale)));
                        const float mx = _mm512_reduce_max_ps(m);
                        vf sum = vzero();
                        for (int64_t j = 0; j < n; j += VL) {
                            const vf x = vsub(vmul(vload(sr + j), vset1(a->scale)), vset1(mx));
                            const vf e = _mm512_maskz_mov_ps(lanes_below(n, j), vexp(x));
                            vstore(sr + j, e);
                            sum = vadd(sum, e);
                        }
                        const float total = n ? vsum(sum) : 1.0f, inv = 1.0f / total;
                        if (r < rows) lse[i0 + r] = mx + logf(total);
                        for (int64_t j = 0; j < kend; j += VL) {
                            const __m512i bits = j < n ? bf16_bits(vmul(vload(sr + j), vset1(inv)))
                                                       : _mm512_setzero_si512();
                            _mm256_storeu_si256((__m256i *)(pr + j),
                                                _mm512_cvtepi32_epi16(_mm512_maskz_mov_epi32(lanes_below(n, j), bits)));
                        }
                    }
                    rows_by_pairs(p, tp, vv, D, kend / TK, o); /* O = P V */
                    for (int64_t r = 0; r < rows; r++)
                        store_bf16_row(out + (i0 + r) * a->out_strides[2], o + r * D, D, 1.0f);
                }
            }
        }
        if (ok) _tile_release();
        free(kt);
        free(vv);
        free(qp);
        free(s);
        free(p);
        free(o);
    }
    return failed ? -1 : 0;
}

/* d^T (16 rows of d, 16 keys) accumulators over the query pairs [c0, tp/2 * 2): A from a transposed [D][tp] operand,
 * B from a row-pairs [tp/2][tp][2] matrix; added into acc ([D][tp] fp32) */
static void keys_by_queries(const uint16_t *at, const uint16_t *bpairs, int64_t D, int64_t tp, float *acc) {
    const int64_t nb = tp / TR;
    for (int64_t jb = 0; jb < nb; jb++) {
        const int64_t c0 = jb * TR / TK; /* queries before the key block's pair chunk see none of its keys */
        for (int64_t m0 = 0; m0 < D / TR; m0 += 2) {
            _tile_loadd(0, acc + m0 * TR * tp + jb * TR, tp * 4);
            _tile_loadd(1, acc + (m0 + 1) * TR * tp + jb * TR, tp * 4);
            for (int64_t c = c0; c < tp / TK; c++) {
                _tile_loadd(6, bpairs + c * TK * tp + jb * TK, tp * 4);
                _tile_loadd(4, at + m0 * TR * tp + c * TK, tp * 2);
                _tile_loadd(5, at + (m0 + 1) * TR * tp + c * TK, tp * 2);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 5, 6);
            }
            _tile_stored(0, acc + m0 * TR * tp + jb * TR, tp * 4);
            _tile_stored(1, acc + (m0 + 1) * TR * tp + jb * TR, tp * 4);
        }
    }
}

int seqlab_amx_attention_backward(const AmxAttentionGrad *a, int nthreads) {
    const int64_t B = a->batch, H = a->n_heads, G = a->n_kv, T = a->len, D = a->head_dim;
    if (D % TK || H % G || T <= 0) return -1;
    const int64_t group = H / G, tp = up(T, TK), nb = tp / TR;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        uint32_t *kt = aligned_alloc(64, (size_t)(tp * D) * 2);   /* K, word columns (scores) */
        uint32_t *vt = aligned_alloc(64, (size_t)(tp * D) * 2);   /* V, word columns (dP = dO V^T) */
        uint16_t *kv = aligned_alloc(64, (size_t)(tp * D) * 2);   /* K, row pairs (dQ = dS K) */
        uint16_t *qp = aligned_alloc(64, (size_t)(tp * D) * 2);   /* Q, rows */
        uint16_t *qt = aligned_alloc(64, (size_t)(tp * D) * 2);   /* Q^T (dK^T = Q^T dS) */
        uint16_t *gp = aligned_alloc(64, (size_t)(tp * D) * 2);   /* dO, rows */
        uint16_t *gt = aligned_alloc(64, (size_t)(tp * D) * 2);   /* dO^T (dV^T = dO^T P) */
        uint16_t *pp = aligned_alloc(64, (size_t)(tp * tp) * 2);  /* P, row pairs */
        uint16_t *dsp = aligned_alloc(64, (size_t)(tp * tp) * 2); /* dS, row pairs */
        uint16_t *dsr = aligned_alloc(64, (size_t)(TR * tp) * 2); /* a block's dS, rows */
        float *s = aligned_alloc(64, (size_t)(TR * tp) * 4), *dp = aligned_alloc(64, (size_t)(TR * tp) * 4);
        float *dkt = aligned_alloc(64, (size_t)(tp * D) * 4), *dvt = aligned_alloc(64, (size_t)(tp * D) * 4);
        float *o = aligned_alloc(64, (size_t)(TR * D) * 4), *delta = aligned_alloc(64, (size_t)tp * 4);
        uint32_t *pairs = aligned_alloc(64, (size_t)(tp * D) * 2);
        const int ok = kt && vt && kv && qp && qt && gp && gt && pp && dsp && dsr && s && dp && dkt && dvt && o && delta
                       && pairs;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        } else
            configure_tiles();
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < B * G; task++) {
            if (!ok) continue;
            const int64_t b = task / G, g = task % G;
            const uint16_t *k = a->k + b * a->k_strides[0] + g * a->k_strides[1];
            const uint16_t *v = a->v + b * a->v_strides[0] + g * a->v_strides[1];
            pack_word_columns(k, a->k_strides[2], T, D, tp, kt);
            pack_word_columns(v, a->v_strides[2], T, D, tp, vt);
            pack_row_pairs(k, a->k_strides[2], T, D, tp, kv);
            memset(dkt, 0, (size_t)(tp * D) * 4);
            memset(dvt, 0, (size_t)(tp * D) * 4);
            for (int64_t h = g * group; h < (g + 1) * group; h++) {
                const uint16_t *q = a->q + b * a->q_strides[0] + h * a->q_strides[1];
                const uint16_t *gout = a->dout + b * a->dout_strides[0] + h * a->dout_strides[1];
                const uint16_t *out = a->out + b * a->out_strides[0] + h * a->out_strides[1];
                const float *lse = a->lse + (b * H + h) * T;
                uint16_t *dq = a->dq + b * a->dq_strides[0] + h * a->dq_strides[1];
                pack_rows(q, a->q_strides[2], T, D, tp, qp);
                pack_transposed(q, a->q_strides[2], T, D, tp, pairs, qt);
                pack_rows(gout, a->dout_strides[2], T, D, tp, gp);
                pack_transposed(gout, a->dout_strides[2], T, D, tp, pairs, gt);
                for (int64_t i = 0; i < T; i++) { /* delta_i = dO_i . O_i */
                    vf acc = vzero();
                    for (int64_t d = 0; d < D; d += VL)
                        acc = vfma(vload_bf16(gout + i * a->dout_strides[2] + d),
                                   vload_bf16(out + i * a->out_strides[2] + d), acc);
                    delta[i] = vsum(acc);
                }
                for (int64_t ib = 0; ib < nb; ib++) {
                    const int64_t i0 = ib * TR, rows = T - i0 < 0 ? 0 : T - i0 < TR ? T - i0 : TR;
                    /* columns written: through the end of the block's key pair chunk, so that the transposed
                     * products, which read whole 32-query chunks, find zeros above the diagonal */
                    const int64_t jw = up(i0 + TR, TK);
                    const int hold = rows && D == 2 * TK; /* Q and dO rows stay in four tiles across key blocks */
                    if (hold) {
                        _tile_loadd(2, qp + i0 * D, D * 2);
                        _tile_loadd(3, qp + i0 * D + TK, D * 2);
                        _tile_loadd(4, gp + i0 * D, D * 2);
                        _tile_loadd(5, gp + i0 * D + TK, D * 2);
                    }
                    for (int64_t jb = 0; rows && jb <= ib; jb++) { /* scores and dO V^T */
                        _tile_zero(0);
                        _tile_zero(1);
                        if (hold) {
                            _tile_loadd(6, kt + jb * TR * TR, 64);
                            _tile_loadd(7, vt + jb * TR * TR, 64);
                            _tile_dpbf16ps(0, 2, 6);
                            _tile_dpbf16ps(1, 4, 7);
                            _tile_loadd(6, kt + (nb + jb) * TR * TR, 64);
                            _tile_loadd(7, vt + (nb + jb) * TR * TR, 64);
                            _tile_dpbf16ps(0, 3, 6);
                            _tile_dpbf16ps(1, 5, 7);
                        } else
                            for (int64_t db = 0; db < D / TK; db++) {
                                _tile_loadd(4, qp + i0 * D + db * TK, D * 2);
                                _tile_loadd(5, gp + i0 * D + db * TK, D * 2);
                                _tile_loadd(6, kt + (db * nb + jb) * TR * TR, 64);
                                _tile_loadd(7, vt + (db * nb + jb) * TR * TR, 64);
                                _tile_dpbf16ps(0, 4, 6);
                                _tile_dpbf16ps(1, 5, 7);
                            }
                        _tile_stored(0, s + jb * TR, tp * 4);
                        _tile_stored(1, dp + jb * TR, tp * 4);
                    }
                    for (int64_t r = 0; r < TR; r += 2) { /* P and dS of rows r, r + 1: rows and row pairs */
                        const int64_t i = i0 + r;
                        const int64_t n0 = r < rows ? i + 1 : 0, n1 = r + 1 < rows ? i + 2 : 0;
                        const vf m0 = vset1(n0 ? lse[i] : 0.0f), m1 = vset1(n1 ? lse[i + 1] : 0.0f);
                        const vf d0 = vset1(n0 ? delta[i] : 0.0f), d1 = vset1(n1 ? delta[i + 1] : 0.0f);
                        for (int64_t j = 0; j < jw; j += VL) {
                            const __mmask16 in0 = lanes_below(n0, j), in1 = lanes_below(n1, j);
                            const vf sc = vset1(a->scale);
                            vf p0 = vzero(), p1 = vzero(), g0 = vzero(), g1 = vzero();
                            if (in0) {
                                p0 = _mm512_maskz_mov_ps(in0, vexp(vsub(vmul(vload(s + r * tp + j), sc), m0)));
                                g0 = vmul(p0, vsub(vload(dp + r * tp + j), d0));
                            }
                            if (in1) {
                                p1 = _mm512_maskz_mov_ps(in1, vexp(vsub(vmul(vload(s + (r + 1) * tp + j), sc), m1)));
                                g1 = vmul(p1, vsub(vload(dp + (r + 1) * tp + j), d1));
                            }
                            const __m512i pb0 = bf16_bits(p0), pb1 = bf16_bits(p1);
                            const __m512i gb0 = bf16_bits(g0), gb1 = bf16_bits(g1);
                            _mm512_storeu_si512(pp + (i / 2) * 2 * tp + 2 * j, paired(pb0, pb1));
                            _mm512_storeu_si512(dsp + (i / 2) * 2 * tp + 2 * j, paired(gb0, gb1));
                            _mm256_storeu_si256((__m256i *)(dsr + r * tp + j), _mm512_cvtepi32_epi16(gb0));
                            _mm256_storeu_si256((__m256i *)(dsr + (r + 1) * tp + j), _mm512_cvtepi32_epi16(gb1));
                        }
                    }
                    if (!rows) continue;
                    rows_by_pairs(dsr, tp, kv, D, jw / TK, o); /* dQ / scale = dS K, keys the rows see */
                    for (int64_t r = 0; r < rows; r++)
                        store_bf16_row(dq + (i0 + r) * a->dq_strides[2], o + r * D, D, a->scale);
                }
                keys_by_queries(gt, pp, D, tp, dvt);  /* dV^T += dO^T P */
                keys_by_queries(qt, dsp, D, tp, dkt); /* dK^T += Q^T dS */
            }
            uint16_t *dk = a->dk + b * a->dk_strides[0] + g * a->dk_strides[1];
            uint16_t *dv = a->dv + b * a->dv_strides[0] + g * a->dv_strides[1];
            for (int64_t j0 = 0; j0 < T; j0 += TR) /* dK and dV from their transposes, 16 x 16 at a time */
                for (int64_t d0 = 0; d0 < D; d0 += TR) {
                    const int64_t n = T - j0 < TR ? T - j0 : TR;
                    transpose_words((const uint32_t *)(dkt + d0 * tp + j0), tp, TR, (uint32_t *)o, TR);
                    for (int64_t j = 0; j < n; j++)
                        vstore_bf16(dk + (j0 + j) * a->dk_strides[2] + d0, vmul(vload(o + j * TR), vset1(a->scale)));
                    transpose_words((const uint32_t *)(dvt + d0 * tp + j0), tp, TR, (uint32_t *)o, TR);
                    for (int64_t j = 0; j < n; j++)
                        vstore_bf16(dv + (j0 + j) * a->dv_strides[2] + d0, vload(o + j * TR));
                }
        }
        if (ok) _tile_release();
        free(kt);
        free(vt);
        free(kv);
        free(qp);
        free(qt);
        free(gp);
        free(gt);
        free(pp);
        free(dsp);
        free(dsr);
        free(s);
        free(dp);
        free(dkt);
        free(dvt);
        free(o);
        free(delta);
        free(pairs);
    }
    return failed ? -1 : 0;
}
