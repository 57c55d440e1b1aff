/* Weight-only int4 / int8 matrix products for a few activation rows (decode), AVX2 + FMA.
 *
 * Why a kernel of our own: a decode step streams every weight once per token, so its speed is bytes per weight.
 * torch's own weight-only CPU kernels were measured slower than fp32 at one row; this one reads the packed
 * nibbles / bytes once per call, converts them to fp32 in registers and keeps activations in fp32 (no activation
 * quantisation, so results equal the dequantised matmul to fp32 rounding).
 *
 * int4 layout (llama.cpp's Q4 order, so GGUF blocks map without reshuffling): per row, per 32-element sub-block,
 * 16 bytes; byte j holds element j in its low nibble and element j+16 in its high nibble. w = q * scale + min,
 * one (scale, min) per group of G elements (G a multiple of 32).
 * int8 layout: plain [N, K] signed bytes, w = q * scale, one scale per group of G elements (G a multiple of 8).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Software prefetch distance in bytes of the weight stream. A decode step reads every weight once from DRAM, and
 * these loops consume only 16 bytes per few instructions: the hardware prefetchers alone left the int4 product at a
 * third of the memory bandwidth (measured on an AVX-512 Xeon: 14.7 ms a SmolLM2 step, 8.3 ms with a page ahead). */
#ifndef PF_AHEAD
#define PF_AHEAD 4096
#endif
#define RB 4 /* activation rows handled together: each weight is unpacked once per RB rows */

/* The row-block bodies take the row count R as a compile-time constant (always inlined into a switch on 1..RB), so
 * the compiler unrolls the loops over rows and keeps every accumulator in a register; with a run-time count the
 * accumulators lived on the stack and each FMA waited on a store-to-load round trip. */
#define INLINE static inline __attribute__((always_inline))

INLINE void q4_unpack32(const uint8_t *p, __m128i mask, __m256 w[4]) {
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

#ifndef __AVX512F__ /* ---------------------------------------------------------------- AVX2 + FMA build */

/* y[r * N] for R activation rows of one weight row. With one or two rows, two partial sums per row break the FMA
 * dependency chain; with more, the rows themselves are independent chains (and 16 ymm registers hold no more). */
INLINE void q4_row(const int R, const float *x, int64_t K, const uint8_t *row, const float *sc, const float *mn,
                   int64_t G, int64_t ng, const float *xsum, float bias, float *y, int64_t N) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    const int64_t blocks = G / 32; /* 32-element sub-blocks per group: walked by pointer, no index arithmetic */
    const uint8_t *p = row;
    const float *xp = x;
    __m256 tot[RB];
    float moff[RB];
    for (int r = 0; r < R; r++) { tot[r] = _mm256_setzero_ps(); moff[r] = 0.f; }
    for (int64_t g = 0; g < ng; g++) {
        __m256 a[RB], b[RB];
        for (int r = 0; r < R; r++) { a[r] = _mm256_setzero_ps(); b[r] = _mm256_setzero_ps(); }
        for (int64_t j = 0; j < blocks; j++, p += 16, xp += 32) {
            _mm_prefetch((const char *)p + PF_AHEAD, _MM_HINT_T0);
            __m256 w[4];
            q4_unpack32(p, mask, w);
            for (int r = 0; r < R; r++) {
                const float *xr = xp + r * K;
                if (R <= 2) {
                    a[r] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr), a[r]);
                    b[r] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), b[r]);
                    a[r] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), a[r]);
                    b[r] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), b[r]);
                } else {
                    a[r] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr), a[r]);
                    a[r] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), a[r]);
                    a[r] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), a[r]);
                    a[r] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), a[r]);
                }
            }
        }
        const __m256 s = _mm256_set1_ps(sc[g]);
        const float m = mn[g];
        for (int r = 0; r < R; r++) {
            tot[r] = _mm256_fmadd_ps(R <= 2 ? _mm256_add_ps(a[r], b[r]) : a[r], s, tot[r]);
            moff[r] += m * xsum[r * ng + g];
        }
    }
    for (int r = 0; r < R; r++) y[r * N] = hsum256(tot[r]) + moff[r] + bias;
}

#else /* ------------------------------------------------------------------------- AVX-512 build (-mavx512f -mavx512bw)
 * The same products 16 lanes wide: one widening per 16 weights instead of per 8, so the shuffle port that limits
 * the AVX2 build does half the work. Which build runs is decided by timing both (seqlab.quant.routes). */
INLINE void q4_row(const int R, const float *x, int64_t K, const uint8_t *row, const float *sc, const float *mn,
                   int64_t G, int64_t ng, const float *xsum, float bias, float *y, int64_t N) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    const int64_t blocks = G / 32;
    const uint8_t *p = row;
    const float *xp = x;
    __m512 tot[RB];
    float moff[RB];
    for (int r = 0; r < R; r++) { tot[r] = _mm512_setzero_ps(); moff[r] = 0.f; }
    for (int64_t g = 0; g < ng; g++) {
        __m512 a[RB], b[RB];
        for (int r = 0; r < R; r++) { a[r] = _mm512_setzero_ps(); b[r] = _mm512_setzero_ps(); }
        for (int64_t j = 0; j < blocks; j++, p += 16, xp += 32) {
            _mm_prefetch((const char *)p + PF_AHEAD, _MM_HINT_T0);
            __m128i q = _mm_loadu_si128((const __m128i *)p);
            __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, mask)));
            __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), mask)));
            for (int r = 0; r < R; r++) {
                a[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xp + r * K), a[r]);
                b[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xp + r * K + 16), b[r]);
            }
        }
        const __m512 s = _mm512_set1_ps(sc[g]);
        const float m = mn[g];
        for (int r = 0; r < R; r++) {
            tot[r] = _mm512_fmadd_ps(_mm512_add_ps(a[r], b[r]), s, tot[r]);
            moff[r] += m * xsum[r * ng + g];
        }
    }
    for (int r = 0; r < R; r++) y[r * N] = _mm512_reduce_add_ps(tot[r]) + moff[r] + bias;
}
#endif

void seqlab_q4_gemm(const float *x, int64_t M, int64_t K, const uint8_t *qw, const float *scales,
                    const float *mins, int64_t N, int64_t G, const float *bias, float *y, int nthreads) {
    const int64_t ng = K / G;
    float *xsum = (float *)malloc(sizeof(float) * (size_t)(M * ng));
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < ng; g++) {
            float s = 0.f;
            for (int64_t k = 0; k < G; k++) s += x[m * K + g * G + k];
            xsum[m * ng + g] = s;
        }
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *row = qw + n * (K / 2);
        const float *sc = scales + n * ng, *mn = mins + n * ng;
        const float bn = bias ? bias[n] : 0.f;
        for (int64_t m0 = 0; m0 < M; m0 += RB) {
            const float *xm = x + m0 * K, *xs = xsum + m0 * ng;
            float *ym = y + m0 * N + n;
            switch (M - m0 < RB ? M - m0 : RB) {
            case 1: q4_row(1, xm, K, row, sc, mn, G, ng, xs, bn, ym, N); break;
            case 2: q4_row(2, xm, K, row, sc, mn, G, ng, xs, bn, ym, N); break;
            case 3: q4_row(3, xm, K, row, sc, mn, G, ng, xs, bn, ym, N); break;
            default: q4_row(4, xm, K, row, sc, mn, G, ng, xs, bn, ym, N); break;
            }
        }
    }
    free(xsum);
}

#ifndef __AVX512F__
INLINE void q8_row(const int R, const float *x, int64_t K, const int8_t *row, const float *sc, int64_t G,
                   int64_t ng, float bias, float *y, int64_t N) {
    __m256 tot[RB];
    for (int r = 0; r < R; r++) tot[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        __m256 a[RB], b[RB];
        for (int r = 0; r < R; r++) { a[r] = _mm256_setzero_ps(); b[r] = _mm256_setzero_ps(); }
        int64_t k0 = g * G;
        for (; k0 + 16 <= (g + 1) * G; k0 += 16) {
            _mm_prefetch((const char *)(row + k0) + PF_AHEAD, _MM_HINT_T0);
            __m128i q = _mm_loadu_si128((const __m128i *)(row + k0));
            __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
            __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)));
            for (int r = 0; r < R; r++) {
                const float *xr = x + r * K + k0;
                a[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), a[r]);
                if (R <= 2) b[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), b[r]);
                else a[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), a[r]);
            }
        }
        for (; k0 < (g + 1) * G; k0 += 8) {
            __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + k0))));
            for (int r = 0; r < R; r++) a[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * K + k0), a[r]);
        }
        const __m256 s = _mm256_set1_ps(sc[g]);
        for (int r = 0; r < R; r++) tot[r] = _mm256_fmadd_ps(_mm256_add_ps(a[r], b[r]), s, tot[r]);
    }
    for (int r = 0; r < R; r++) y[r * N] = hsum256(tot[r]) + bias;
}

#else
INLINE void q8_row(const int R, const float *x, int64_t K, const int8_t *row, const float *sc, int64_t G,
                   int64_t ng, float bias, float *y, int64_t N) {
    __m512 tot[RB];
    for (int r = 0; r < R; r++) tot[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        __m512 a[RB];
        for (int r = 0; r < R; r++) a[r] = _mm512_setzero_ps();
        int64_t k0 = g * G;
        for (; k0 + 16 <= (g + 1) * G; k0 += 16) {
            _mm_prefetch((const char *)(row + k0) + PF_AHEAD, _MM_HINT_T0);
            __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + k0))));
            for (int r = 0; r < R; r++) a[r] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + r * K + k0), a[r]);
        }
        if (k0 < (g + 1) * G) { /* a last 8 (rows and groups are multiples of 8) */
            __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + k0))));
            for (int r = 0; r < R; r++)
                a[r] = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(0x00FF, x + r * K + k0), a[r]);
        }
        const __m512 s = _mm512_set1_ps(sc[g]);
        for (int r = 0; r < R; r++) tot[r] = _mm512_fmadd_ps(a[r], s, tot[r]);
    }
    for (int r = 0; r < R; r++) y[r * N] = _mm512_reduce_add_ps(tot[r]) + bias;
}
#endif

void seqlab_q8_gemm(const float *x, int64_t M, int64_t K, const int8_t *qw, const float *scales, int64_t N,
                    int64_t G, const float *bias, float *y, int nthreads) {
    const int64_t ng = K / G;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *row = qw + n * K;
        const float *sc = scales + n * ng;
        const float bn = bias ? bias[n] : 0.f;
        for (int64_t m0 = 0; m0 < M; m0 += RB) {
            const float *xm = x + m0 * K;
            float *ym = y + m0 * N + n;
            switch (M - m0 < RB ? M - m0 : RB) {
            case 1: q8_row(1, xm, K, row, sc, G, ng, bn, ym, N); break;
            case 2: q8_row(2, xm, K, row, sc, G, ng, bn, ym, N); break;
            case 3: q8_row(3, xm, K, row, sc, G, ng, bn, ym, N); break;
            default: q8_row(4, xm, K, row, sc, G, ng, bn, ym, N); break;
            }
        }
    }
}

/* Dequantise rows [r0, r1) into fp32 out [(r1 - r0), K]: the blockwise route for many activation rows, where the
 * product is compute-bound and a dense GEMM on a dequantised block beats unpacking per row. Same two roundings
 * (q * scale, then + min) as seqlab.quant.schemes.dequantize_weight. */
void seqlab_q4_dequant(const uint8_t *qw, const float *scales, const float *mins, int64_t K, int64_t G, int64_t r0,
                       int64_t r1, float *out, int nthreads) {
    const int64_t ng = K / G;
    const __m128i mask = _mm_set1_epi8(0x0F);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = r0; n < r1; n++) {
        const uint8_t *row = qw + n * (K / 2);
        float *o = out + (n - r0) * K;
        for (int64_t k0 = 0; k0 < K; k0 += 32) {
            const __m256 s = _mm256_set1_ps(scales[n * ng + k0 / G]), m = _mm256_set1_ps(mins[n * ng + k0 / G]);
            __m256 w[4];
            q4_unpack32(row + k0 / 2, mask, w);
            for (int j = 0; j < 4; j++) _mm256_storeu_ps(o + k0 + 8 * j, _mm256_add_ps(_mm256_mul_ps(w[j], s), m));
        }
    }
}

void seqlab_q8_dequant(const int8_t *qw, const float *scales, int64_t K, int64_t G, int64_t r0, int64_t r1,
                       float *out, int nthreads) {
    const int64_t ng = K / G;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = r0; n < r1; n++) {
        const int8_t *row = qw + n * K;
        float *o = out + (n - r0) * K;
        for (int64_t k = 0; k < K; k += 8) {  /* K and G are multiples of 8 */
            __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + k))));
            _mm256_storeu_ps(o + k, _mm256_mul_ps(w, _mm256_set1_ps(scales[n * ng + k / G])));
        }
    }
}

/* Evict a buffer from every cache level: the route timer measures products on weights streamed from DRAM, as
 * they are in a decode step, without allocating a cache-sized buffer to thrash. */
void seqlab_flush(const void *p, int64_t nbytes) {
    const char *c = (const char *)p;
    for (int64_t i = 0; i < nbytes; i += 64) _mm_clflush(c + i);
    _mm_mfence();
}
