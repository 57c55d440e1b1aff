/* A prefill's three pointwise steps, each one pass over its rows: RMSNorm, the rotate-half rotary, and SwiGLU.
 * torch computes each as a chain of ops that each read and write the whole [rows, width] tensor (RMSNorm: a norm,
 * then x * r, then * w; rotary: negate, concatenate, two products, a sum; SwiGLU: silu, then a product), which at a
 * 512-token prompt costs about as much as the attention. The arithmetic is the model's own, in the same order where
 * it matters (rotary: bitwise; RMSNorm: the sum of squares in another order; SwiGLU: exp to 2 ulp). fp32 only.
 * Rows are split between threads; every row is independent. */
#include <math.h>
#include <stdint.h>

#include "simd.h"

/* y[r] = (x[r] * rsqrt(mean(x[r]^2) + eps)) * w for `rows` rows of `dim` (x row r at x + r * x_st; y dense) */
void seqlab_rms_norm(const float *x, int64_t x_st, const float *w, float *y, int64_t rows, int64_t dim, float eps,
                     int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_st;
        float *yr = y + r * dim;
        vf acc = vzero();
        int64_t j = 0;
        for (; j + VL <= dim; j += VL) acc = vfma(vload(xr + j), vload(xr + j), acc);
        float sq = vsum(acc);
        for (; j < dim; j++) sq += xr[j] * xr[j];
        const float s = 1.0f / sqrtf(sq / (float)dim + eps);
        const vf vs = vset1(s);
        for (j = 0; j + VL <= dim; j += VL) vstore(yr + j, vmul(vmul(vload(xr + j), vs), vload(w + j)));
        for (; j < dim; j++) yr[j] = (xr[j] * s) * w[j];
    }
}

/* Rotate-half rotary: for each of `rows` positions (x row r at x + r * x_st, its `heads` heads of `dim` contiguous,
 * cos/sin row r at r * dim), y = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[half:], x[:half]); y dense.
 * Products and sum rounded as torch rounds them (no fused multiply-add), so the result is bitwise torch's. */
void seqlab_rotary(const float *x, int64_t x_st, const float *cos, const float *sin, float *y, int64_t rows,
                   int64_t heads, int64_t dim, int nthreads) {
    const int64_t half = dim / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * dim, *s = sin + r * dim;
        for (int64_t h = 0; h < heads; h++) {
            const float *xh = x + r * x_st + h * dim;
            float *yh = y + (r * heads + h) * dim;
            int64_t j = 0;
            for (; j + VL <= half; j += VL) {
                const vf x1 = vload(xh + j), x2 = vload(xh + half + j);
                vstore(yh + j, vsub(vmul(x1, vload(c + j)), vmul(x2, vload(s + j))));
                vstore(yh + half + j, vadd(vmul(x2, vload(c + half + j)), vmul(x1, vload(s + half + j))));
            }
            for (; j < half; j++) {
                const float x1 = xh[j], x2 = xh[half + j];
                yh[j] = x1 * c[j] - x2 * s[j];
                yh[half + j] = x2 * c[half + j] + x1 * s[half + j];
            }
        }
    }
}

/* SwiGLU: y[r][j] = silu(h[r][j]) * h[r][f + j] for `rows` rows of h (row r at h + r * h_st: gate then up, f each) */
void seqlab_swiglu(const float *h, int64_t h_st, float *y, int64_t rows, int64_t f, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = h + r * h_st, *u = g + f;
        float *yr = y + r * f;
        int64_t j = 0;
        for (; j + VL <= f; j += VL) {
            const vf x = vload(g + j);
            const vf silu = vdiv(x, vadd(vset1(1.0f), vexp(vsub(vzero(), x))));
            vstore(yr + j, vmul(silu, vload(u + j)));
        }
        for (; j < f; j++) yr[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    }
}
