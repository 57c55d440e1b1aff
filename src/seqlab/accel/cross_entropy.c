/* A training step's cross-entropy and its gradient in one pass per row, for fp32 or bf16 logits.
 * torch's route (seqlab.objectives.loss): widen bf16 logits into an fp32 copy, softmax it, gather the targets'
 * probabilities, scatter the -1s, and round the gradient back to bf16: five to six passes over the step's largest
 * tensor. Here each row is read once from memory (its max), then twice from cache (the sum of exponentials, then
 * the gradient), and the gradient is written once in the logits' dtype. The arithmetic is the same softmax in fp32
 * (exp to 2 ulp); the loss is logsumexp - logit[target], which stays exact where the target's probability
 * underflows. Rows are split between threads; every row is independent. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd.h"

INLINE float logit_at(const void *x, int bf16, int64_t i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

INLINE vf load_logits(const void *x, int bf16, int64_t i) {
    return bf16 ? vload_bf16((const uint16_t *)x + i) : vload((const float *)x + i);
}

/* the row's max, or NAN where it holds a NaN or +inf, or only -inf (torch's softmax turns such a row into NaNs) */
static float row_max(const void *x, int bf16, int64_t V) {
    vf m0 = vset1(-INFINITY), m1 = m0, s = vzero();
    int64_t j = 0;
    for (; j + 2 * VL <= V; j += 2 * VL) {
        const vf a = load_logits(x, bf16, j), b = load_logits(x, bf16, j + VL);
        m0 = vmax(m0, a);
        m1 = vmax(m1, b);
        s = vadd(s, vadd(a, b)); /* NaN and +inf survive a sum; used only to spot them */
    }
    for (; j + VL <= V; j += VL) {
        const vf a = load_logits(x, bf16, j);
        m0 = vmax(m0, a);
        s = vadd(s, a);
    }
    float m = -INFINITY, sum = vsum(s);
    float lanes[VL];
    vstore(lanes, vmax(m0, m1));
    for (int l = 0; l < VL; l++) m = lanes[l] > m ? lanes[l] : m;
    for (; j < V; j++) {
        const float v = logit_at(x, bf16, j);
        m = v > m ? v : m;
        sum += v;
    }
    if (isnan(sum) || sum == INFINITY) { /* a NaN or +inf in the row, or a finite sum that overflowed: look */
        for (int64_t i = 0; i < V; i++) {
            const float v = logit_at(x, bf16, i);
            if (isnan(v) || v == INFINITY) return NAN;
        }
    }
    return m == -INFINITY ? NAN : m;
}

/* gradient row `g` (V wide, fp32 or bf16) all `value`: an ignored row's zeros, a bad row's NaNs */
static void fill_row(void *g, int bf16, int64_t V, float value) {
    const uint16_t h = f32_to_bf16(value);
    for (int64_t j = 0; j < V; j++) {
        if (bf16) ((uint16_t *)g)[j] = h;
        else ((float *)g)[j] = value;
    }
}

/* For each of `rows` rows (row r of the logits at r * ld elements; fp32, or bf16 where `bf16`): nll[r] =
 * logsumexp(row) - row[label] and grad row r (dense, V wide, the logits' dtype) = softmax(row) - onehot(label); a
 * row whose label is `ignore` gets nll 0 and a zero gradient. Returns 0, -1 where a label is outside [0, V) and
 * not `ignore`, -2 where the scratch could not be allocated. */
int seqlab_cross_entropy(const void *logits, int64_t ld, int bf16, const int64_t *labels, int64_t rows, int64_t V,
                         int64_t ignore, float *nll, void *grad, int nthreads) {
    for (int64_t r = 0; r < rows; r++)
        if (labels[r] != ignore && (labels[r] < 0 || labels[r] >= V)) return -1;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *scratch = bf16 ? aligned_alloc(64, ((size_t)V * sizeof(float) + 63) / 64 * 64) : NULL;
        if (bf16 && scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (bf16 && scratch == NULL) continue; /* reported through `failed` */
            const void *x = bf16 ? (const void *)((const uint16_t *)logits + r * ld)
                                 : (const void *)((const float *)logits + r * ld);
            float *e = bf16 ? scratch : (float *)grad + r * V; /* fp32: the exponentials go straight to the gradient */
            uint16_t *gb = bf16 ? (uint16_t *)grad + r * V : NULL;
            void *g = bf16 ? (void *)gb : (void *)e;
            const int64_t label = labels[r];
            if (label == ignore) {
                nll[r] = 0.0f;
                fill_row(g, bf16, V, 0.0f);
                continue;
            }
            const float m = row_max(x, bf16, V);
            if (isnan(m)) {
                nll[r] = NAN;
                fill_row(g, bf16, V, NAN);
                continue;
            }
            const vf vm = vset1(m);
            vf s0 = vzero(), s1 = vzero();
            int64_t j = 0;
            for (; j + 2 * VL <= V; j += 2 * VL) {
                const vf a = vexp_or_zero(vsub(load_logits(x, bf16, j), vm));
                const vf b = vexp_or_zero(vsub(load_logits(x, bf16, j + VL), vm));
                vstore(e + j, a);
                vstore(e + j + VL, b);
                s0 = vadd(s0, a);
                s1 = vadd(s1, b);
            }
            for (; j + VL <= V; j += VL) {
                const vf a = vexp_or_zero(vsub(load_logits(x, bf16, j), vm));
                vstore(e + j, a);
                s0 = vadd(s0, a);
            }
            float sum = vsum(vadd(s0, s1));
            for (; j < V; j++) {
                e[j] = expf(logit_at(x, bf16, j) - m);
                sum += e[j];
            }
            const float inv = 1.0f / sum;
            const float p_label = e[label] * inv;
            nll[r] = (m + logf(sum)) - logit_at(x, bf16, label);
            const vf vinv = vset1(inv);
            for (j = 0; j + VL <= V; j += VL) {
                const vf p = vmul(vload(e + j), vinv);
                if (bf16) vstore_bf16(gb + j, p);
                else vstore(e + j, p);
            }
            for (; j < V; j++) {
                if (bf16) gb[j] = f32_to_bf16(e[j] * inv);
                else e[j] *= inv;
            }
            if (bf16) gb[label] = f32_to_bf16(p_label - 1.0f);
            else e[label] = p_label - 1.0f;
        }
        free(scratch);
    }
    return failed ? -2 : 0;
}

/* The backward's one pass: the saved gradient (n values, fp32 or bf16 where `bf16`) times the loss's gradient
 * `scale`, in place. bf16 values are widened, multiplied in fp32 and rounded to nearest even, as torch's mul_ by
 * an fp32 scalar does, so every non-NaN result is the same bits (a NaN stays a NaN; torch's own NaN bits depend on
 * its vector or scalar loop); ATen's bf16 loop converts lane by lane and took about three times as long. */
void seqlab_scale_inplace(void *g, int bf16, int64_t n, float scale, int nthreads) {
    const int64_t chunk = 1 << 16;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t c = 0; c < n; c += chunk) {
        const int64_t end = c + chunk < n ? c + chunk : n;
        const vf s = vset1(scale);
        int64_t j = c;
        if (bf16) {
            uint16_t *h = (uint16_t *)g;
            for (; j + VL <= end; j += VL) vstore_bf16(h + j, vmul(vload_bf16(h + j), s));
            for (; j < end; j++) h[j] = f32_to_bf16(bf16_to_f32(h[j]) * scale);
        } else {
            float *f = (float *)g;
            for (; j + VL <= end; j += VL) vstore(f + j, vmul(vload(f + j), s));
            for (; j < end; j++) f[j] *= scale;
        }
    }
}
