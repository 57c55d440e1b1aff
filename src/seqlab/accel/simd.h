/* One vector vocabulary for seqlab's C files: 16 fp32 lanes in the AVX-512 build, 8 in the AVX2 + FMA build (the
 * same source is compiled both ways; which build runs is decided by timing, in Python). */
#ifndef SEQLAB_SIMD_H
#define SEQLAB_SIMD_H
#include <immintrin.h>
#include <stdint.h>

#ifndef INLINE
#define INLINE static inline __attribute__((always_inline))
#endif

#ifdef __AVX512F__
#define VL 16
typedef __m512 vf;
#define vzero() _mm512_setzero_ps()
#define vload(p) _mm512_loadu_ps(p)
#define vstore(p, v) _mm512_storeu_ps(p, v)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vadd(a, b) _mm512_add_ps(a, b)
#define vsub(a, b) _mm512_sub_ps(a, b)
#define vmul(a, b) _mm512_mul_ps(a, b)
#define vdiv(a, b) _mm512_div_ps(a, b)
#define vmin(a, b) _mm512_min_ps(a, b)
#define vmax(a, b) _mm512_max_ps(a, b)
#define vset1(s) _mm512_set1_ps(s)
#define vsum(v) _mm512_reduce_add_ps(v)
#define vround(v) _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
/* v where d >= t or d is NaN (a NaN must reach the sums, as in torch), else 0 */
#define vkeep_ge(v, d, t) _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, vset1(t), _CMP_NLT_UQ), v)
/* 2^n for integral-valued float n, by building the exponent field */
#define vpow2i(n) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23))
INLINE vf vload_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
/* round to nearest even, as torch's conversion (f32_to_bf16 below, lane by lane) */
INLINE void vstore_bf16(uint16_t *p, vf v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(r));
}
#else
#define VL 8
typedef __m256 vf;
INLINE float simd_hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#define vzero() _mm256_setzero_ps()
#define vload(p) _mm256_loadu_ps(p)
#define vstore(p, v) _mm256_storeu_ps(p, v)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vadd(a, b) _mm256_add_ps(a, b)
#define vsub(a, b) _mm256_sub_ps(a, b)
#define vmul(a, b) _mm256_mul_ps(a, b)
#define vdiv(a, b) _mm256_div_ps(a, b)
#define vmin(a, b) _mm256_min_ps(a, b)
#define vmax(a, b) _mm256_max_ps(a, b)
#define vset1(s) _mm256_set1_ps(s)
#define vsum(v) simd_hsum256(v)
#define vround(v) _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vkeep_ge(v, d, t) _mm256_and_ps(_mm256_cmp_ps(d, vset1(t), _CMP_NLT_UQ), v) /* NaN kept */
#define vpow2i(n) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23))
INLINE vf vload_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
INLINE void vstore_bf16(uint16_t *p, vf v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
#endif

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch's conversion */
    union { float f; uint32_t u; } v = {f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* exp(x) to about 2 ulp (Cephes' expf: x = n ln2 + r, |r| <= ln2/2, a degree-5 polynomial for e^r - 1 - r) */
INLINE vf vexp(vf x) {
    /* the clamp's operands in this order keep a NaN: max/min return their second operand when one is NaN (a NaN
     * score must reach the softmax's sum, as in torch, or a run gone to NaN reads finite) */
    x = vmin(vset1(88.3f), vmax(vset1(-87.3f), x));
    const vf n = vround(vmul(x, vset1(1.44269504088896341f)));
    vf r = vfma(n, vset1(-0.693359375f), x);
    r = vfma(n, vset1(2.12194440e-4f), r);
    vf p = vset1(1.9875691500e-4f);
    p = vfma(p, r, vset1(1.3981999507e-3f));
    p = vfma(p, r, vset1(8.3334519073e-3f));
    p = vfma(p, r, vset1(4.1665795894e-2f));
    p = vfma(p, r, vset1(1.6666665459e-1f));
    p = vfma(p, r, vset1(5.0000001201e-1f));
    p = vfma(p, vmul(r, r), vadd(r, vset1(1.0f)));
    return vmul(p, vpow2i(n));
}

/* exp(x), and exactly 0 below vexp's range (-87.3: a masked-out logit's -inf among them), where expf would give
 * subnormals down to -103.97: softmax weights too small to matter, kept out of the sums */
INLINE vf vexp_or_zero(vf x) { return vkeep_ge(vexp(x), x, -87.3f); }
#endif
