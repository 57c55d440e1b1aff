/* LayerNorm over each row for training: the forward keeps each row's mean and 1 / std for the backward, and may
 * write its output in bf16; the backward takes the output's gradient in that dtype.
 *
 * Why: under bf16 autocast a pre-norm block's norm runs in fp32 (autocast's rule for layer_norm) and its one reader,
 * a linear layer, rounds the output to bf16: torch runs the norm, a cast, and in the backward the cast's backward
 * and the norm's, four passes over [tokens, d] where this takes two. fp32 arithmetic throughout:
 *     y = (x - mean) rstd w + b,   dx = rstd (g - mean(g) - xhat mean(g xhat)),   g = dy w,   xhat = (x - mean) rstd,
 * and dw, db summed over rows per thread, then over threads. Row width: a multiple of the vector length. */
#include <math.h>
#include <omp.h>
#include <string.h>

#include "simd.h"

void seqlab_layer_norm_fwd(const float *x, const float *w, const float *b, void *y, int y_bf16, float *mean,
                           float *rstd, int64_t rows, int64_t n, float eps, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        vf s = vzero();
        for (int64_t j = 0; j < n; j += VL) s = vadd(s, vload(xr + j));
        const float m = vsum(s) / (float)n;
        const vf vm = vset1(m);
        vf q = vzero();
        for (int64_t j = 0; j < n; j += VL) {
            const vf d = vsub(vload(xr + j), vm);
            q = vfma(d, d, q);
        }
        const float rs = 1.0f / sqrtf(vsum(q) / (float)n + eps);
        mean[r] = m;
        rstd[r] = rs;
        const vf vr = vset1(rs);
        for (int64_t j = 0; j < n; j += VL) {
            const vf v = vfma(vmul(vsub(vload(xr + j), vm), vr), vload(w + j), b ? vload(b + j) : vzero());
            if (y_bf16) vstore_bf16((uint16_t *)y + r * n + j, v);
            else vstore((float *)y + r * n + j, v);
        }
    }
}

/* partial: [nthreads][2 n] fp32 zeros, each thread's sums of dy xhat and dy; dw and db (may be NULL) are written */
void seqlab_layer_norm_bwd(const void *dy, int dy_bf16, const float *x, const float *w, const float *mean,
                           const float *rstd, float *dx, float *dw, float *db, float *partial, int64_t rows,
                           int64_t n, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    {
        float *pw = partial + (int64_t)omp_get_thread_num() * 2 * n, *pb = pw + n;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            const float *xr = x + r * n;
            const vf vm = vset1(mean[r]), vr = vset1(rstd[r]);
            vf s1 = vzero(), s2 = vzero();
            for (int64_t j = 0; j < n; j += VL) {
                const vf d = dy_bf16 ? vload_bf16((const uint16_t *)dy + r * n + j) : vload((const float *)dy + r * n + j);
                const vf xh = vmul(vsub(vload(xr + j), vm), vr), g = vmul(d, vload(w + j));
                s1 = vadd(s1, g);
                s2 = vfma(g, xh, s2);
                vstore(pw + j, vfma(d, xh, vload(pw + j)));
                vstore(pb + j, vadd(d, vload(pb + j)));
            }
            const vf a = vset1(vsum(s1) / (float)n), c = vset1(vsum(s2) / (float)n);
            for (int64_t j = 0; j < n; j += VL) {
                const vf d = dy_bf16 ? vload_bf16((const uint16_t *)dy + r * n + j) : vload((const float *)dy + r * n + j);
                const vf xh = vmul(vsub(vload(xr + j), vm), vr), g = vmul(d, vload(w + j));
                vstore(dx + r * n + j, vmul(vr, vsub(vsub(g, a), vmul(xh, c))));
            }
        }
#pragma omp for schedule(static)
        for (int64_t j = 0; j < n; j += VL) { /* after the rows' barrier: every thread's sums */
            vf sw = vzero(), sb = vzero();
            for (int t = 0; t < nthreads; t++) {
                sw = vadd(sw, vload(partial + (int64_t)t * 2 * n + j));
                sb = vadd(sb, vload(partial + (int64_t)t * 2 * n + n + j));
            }
            vstore(dw + j, sw);
            if (db) vstore(db + j, sb);
        }
    }
}
