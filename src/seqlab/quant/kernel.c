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

#define RB 4 /* activation rows handled together: each weight is unpacked once per RB rows */

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
    const __m128i mask = _mm_set1_epi8(0x0F);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *row = qw + n * (K / 2);
        const float *sc = scales + n * ng, *mn = mins + n * ng;
        for (int64_t m0 = 0; m0 < M; m0 += RB) {
            const int64_t rb = M - m0 < RB ? M - m0 : RB;
            __m256 tot[RB];
            float moff[RB];
            for (int r = 0; r < RB; r++) { tot[r] = _mm256_setzero_ps(); moff[r] = 0.f; }
            for (int64_t g = 0; g < ng; g++) {
                __m256 acc[RB];
                for (int r = 0; r < RB; r++) acc[r] = _mm256_setzero_ps();
                for (int64_t k0 = g * G; k0 < (g + 1) * G; k0 += 32) {
                    __m128i b = _mm_loadu_si128((const __m128i *)(row + k0 / 2));
                    __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
                    __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
                    __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
                    __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
                    __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
                    for (int r = 0; r < rb; r++) {
                        const float *xr = x + (m0 + r) * K + k0;
                        acc[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), acc[r]);
                        acc[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), acc[r]);
                        acc[r] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xr + 16), acc[r]);
                        acc[r] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xr + 24), acc[r]);
                    }
                }
                const __m256 s = _mm256_set1_ps(sc[g]);
                for (int r = 0; r < rb; r++) {
                    tot[r] = _mm256_fmadd_ps(acc[r], s, tot[r]);
                    moff[r] += mn[g] * xsum[(m0 + r) * ng + g];
                }
            }
            for (int r = 0; r < rb; r++)
                y[(m0 + r) * N + n] = hsum256(tot[r]) + moff[r] + (bias ? bias[n] : 0.f);
        }
    }
    free(xsum);
}

void seqlab_q8_gemm(const float *x, int64_t M, int64_t K, const int8_t *qw, const float *scales, int64_t N,
                    int64_t G, const float *bias, float *y, int nthreads) {
    const int64_t ng = K / G;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *row = qw + n * K;
        const float *sc = scales + n * ng;
        for (int64_t m0 = 0; m0 < M; m0 += RB) {
            const int64_t rb = M - m0 < RB ? M - m0 : RB;
            __m256 tot[RB];
            for (int r = 0; r < RB; r++) tot[r] = _mm256_setzero_ps();
            for (int64_t g = 0; g < ng; g++) {
                __m256 acc[RB];
                for (int r = 0; r < RB; r++) acc[r] = _mm256_setzero_ps();
                int64_t k0 = g * G;
                for (; k0 + 16 <= (g + 1) * G; k0 += 16) {
                    __m128i b = _mm_loadu_si128((const __m128i *)(row + k0));
                    __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
                    __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
                    for (int r = 0; r < rb; r++) {
                        const float *xr = x + (m0 + r) * K + k0;
                        acc[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), acc[r]);
                        acc[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), acc[r]);
                    }
                }
                for (; k0 < (g + 1) * G; k0 += 8) {
                    __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + k0))));
                    for (int r = 0; r < rb; r++)
                        acc[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + (m0 + r) * K + k0), acc[r]);
                }
                const __m256 s = _mm256_set1_ps(sc[g]);
                for (int r = 0; r < rb; r++) tot[r] = _mm256_fmadd_ps(acc[r], s, tot[r]);
            }
            for (int r = 0; r < rb; r++) y[(m0 + r) * N + n] = hsum256(tot[r]) + (bias ? bias[n] : 0.f);
        }
    }
}

/* Dequantise rows [r0, r1) into fp32 out [(r1 - r0), K]: the blockwise route for many activation rows, where the
 * product is compute-bound and a dense GEMM on a dequantised block beats unpacking per row. Same two roundings
 * (q * scale, then + min) as seqlab.quant.schemes.dequantize_weight. */
void seqlab_q4_dequant(const uint8_t *qw, const float *scales, const float *mins, int64_t K, int64_t G, int64_t r0,
                       int64_t r1, float *out, int nthreads) {
    const int64_t ng = K / G;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = r0; n < r1; n++) {
        const uint8_t *row = qw + n * (K / 2);
        float *o = out + (n - r0) * K;
        for (int64_t k0 = 0; k0 < K; k0 += 32) {
            const float s = scales[n * ng + k0 / G], m = mins[n * ng + k0 / G];
            for (int j = 0; j < 16; j++) {
                uint8_t b = row[k0 / 2 + j];
                float lo = (float)(b & 0x0F) * s, hi = (float)(b >> 4) * s;
                o[k0 + j] = lo + m;
                o[k0 + 16 + j] = hi + m;
            }
        }
    }
}

void seqlab_q8_dequant(const int8_t *qw, const float *scales, int64_t K, int64_t G, int64_t r0, int64_t r1,
                       float *out, int nthreads) {
    const int64_t ng = K / G;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = r0; n < r1; n++)
        for (int64_t k = 0; k < K; k++) out[(n - r0) * K + k] = (float)qw[n * K + k] * scales[n * ng + k / G];
}

/* Evict a buffer from every cache level: the route timer measures products on weights streamed from DRAM, as
 * they are in a decode step, without allocating a cache-sized buffer to thrash. */
void seqlab_flush(const void *p, int64_t nbytes) {
    const char *c = (const char *)p;
    for (int64_t i = 0; i < nbytes; i += 64) _mm_clflush(c + i);
    _mm_mfence();
}
