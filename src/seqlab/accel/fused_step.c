/* One decode step of a Llama-family decoder in one call: every block, the final norm and the LM head.
 *
 * Why: at one (or a few) rows per step a decode step is a chain of matrix-vector products, so its floor is the time
 * to stream the weights once. In eager PyTorch each block also runs ~45 small ops (norms, rotary, cache writes,
 * attention, residuals) whose dispatch costs as much as a quarter of the step; here they are a few loops between
 * the products, inside one OpenMP region (no thread hand-offs between ops, one barrier where data flows).
 *
 * The math is the model's (seqlab.model): pre-norm RMSNorm, fused QKV, optional per-head q/k RMSNorm (Qwen3),
 * rotate-half rotary at explicit positions, grouped-query attention over the static cache, SwiGLU, residuals.
 * Activations are fp32; weights are read in their stored format (fp32, bf16, or the int4/int8 blocks of
 * seqlab.quant, through the row bodies of quant/kernel.c) and widened in registers. Python prepares the token
 * embeddings and reserves the cache slots; this file writes each layer's K/V into the cache tensors directly.
 */
#include "kernel.c" /* q4_row, q8_row, RB, INLINE: the int products' row bodies */
#include "simd.h"   /* vf, VL, vload... for this build's vector width; bf16 conversions */

#include <math.h>
#include <omp.h>
#include <string.h>

enum { W_F32 = 0, W_BF16 = 1, W_Q4 = 2, W_Q8 = 3 };

typedef struct {
    int64_t kind, n, k, g;  /* format, out features, in features, group size (int formats) */
    const void *w;          /* [n, k] fp32/bf16; int4: [n, k/2] nibbles; int8: [n, k] bytes */
    const float *scales, *mins, *bias; /* int formats: [n, k/g] each (mins: int4 only); bias [n] or NULL */
} sl_mat;

typedef struct {
    const float *attn_norm, *mlp_norm, *q_norm, *k_norm; /* [d], [d], [head_dim] x 2 (or NULL) */
    sl_mat qkv, out, up, down;
} sl_layer;

typedef struct {
    int64_t n_layers, d, n_heads, n_kv, head_dim, d_ff, max_len, cache_bf16;
    double eps;
    const sl_layer *layers;
    const float *final_norm; /* [d] or NULL */
    sl_mat head;
} sl_model;

/* y[r * N] = x[r] . w (+ bias) for R activation rows of one dense weight row (fp32 or bf16, a constant). */
INLINE void dense_row(const int R, const int bf16, const float *x, int64_t K, const void *wrow, float bias, float *y,
                      int64_t N) {
    const float *wf = (const float *)wrow;
    const uint16_t *wb = (const uint16_t *)wrow;
    vf a[RB], b[RB];
    for (int r = 0; r < R; r++) { a[r] = vzero(); b[r] = vzero(); }
    int64_t k = 0;
    const char *pf = (const char *)wrow + PF_AHEAD;
    const int64_t step = (bf16 ? 2 : 4) * 2 * VL; /* bytes of weight per iteration */
    for (; k + 2 * VL <= K; k += 2 * VL, pf += step) {
        _mm_prefetch(pf, _MM_HINT_T0);
        if (step > 64) _mm_prefetch(pf + 64, _MM_HINT_T0);
        const vf w0 = bf16 ? vload_bf16(wb + k) : vload(wf + k);
        const vf w1 = bf16 ? vload_bf16(wb + k + VL) : vload(wf + k + VL);
        for (int r = 0; r < R; r++) {
            a[r] = vfma(w0, vload(x + r * K + k), a[r]);
            b[r] = vfma(w1, vload(x + r * K + k + VL), b[r]);
        }
    }
    for (; k + VL <= K; k += VL) {
        const vf w0 = bf16 ? vload_bf16(wb + k) : vload(wf + k);
        for (int r = 0; r < R; r++) a[r] = vfma(w0, vload(x + r * K + k), a[r]);
    }
    float tail[RB];
    for (int r = 0; r < R; r++) tail[r] = vsum(vadd(a[r], b[r]));
    for (; k < K; k++) {
        const float w = bf16 ? bf16_to_f32(wb[k]) : wf[k];
        for (int r = 0; r < R; r++) tail[r] += w * x[r * K + k];
    }
    for (int r = 0; r < R; r++) y[r * N] = tail[r] + bias;
}

#define ROWS_SWITCH(call_R)                   \
    switch (B - m0 < RB ? B - m0 : RB) {      \
    case 1: call_R(1); break;                 \
    case 2: call_R(2); break;                 \
    case 3: call_R(3); break;                 \
    default: call_R(4); break;                \
    }

/* y [B, N] = x [B, K] @ W^T (+ bias), output rows shared among the threads of the enclosing parallel region.
 * ``xsum`` [B, K/g]: per-group sums of x (int4 only; filled by the caller). Ends with the loop's barrier. */
static void matmul(const sl_mat *W, int64_t B, const float *x, const float *xsum, float *y) {
    const int64_t N = W->n, K = W->k, kind = W->kind;
    const int64_t G = W->g, ng = (kind == W_Q4 || kind == W_Q8) ? K / G : 0;
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float bn = W->bias ? W->bias[n] : 0.f;
        for (int64_t m0 = 0; m0 < B; m0 += RB) {
            const float *xm = x + m0 * K;
            float *ym = y + m0 * N + n;
            if (kind == W_F32) {
                const float *row = (const float *)W->w + n * K;
#define CALL(R) dense_row(R, 0, xm, K, row, bn, ym, N)
                ROWS_SWITCH(CALL)
#undef CALL
            } else if (kind == W_BF16) {
                const uint16_t *row = (const uint16_t *)W->w + n * K;
#define CALL(R) dense_row(R, 1, xm, K, row, bn, ym, N)
                ROWS_SWITCH(CALL)
#undef CALL
            } else if (kind == W_Q4) {
                const uint8_t *row = (const uint8_t *)W->w + n * (K / 2);
                const float *sc = W->scales + n * ng, *mn = W->mins + n * ng, *xs = xsum + m0 * ng;
#define CALL(R) q4_row(R, xm, K, row, sc, mn, G, ng, xs, bn, ym, N)
                ROWS_SWITCH(CALL)
#undef CALL
            } else {
                const int8_t *row = (const int8_t *)W->w + n * K;
                const float *sc = W->scales + n * ng;
#define CALL(R) q8_row(R, xm, K, row, sc, G, ng, bn, ym, N)
                ROWS_SWITCH(CALL)
#undef CALL
            }
        }
    }
}

/* Per-group sums of x for an int4 product (w = q * scale + min, so x . w = scale * (x . q) + min * sum(x)). */
static void group_sums(const sl_mat *W, int64_t B, const float *x, float *xsum) {
    if (W->kind != W_Q4) return;
    const int64_t K = W->k, G = W->g, ng = K / G;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < B * ng; i++) {
        const float *p = x + (i / ng) * K + (i % ng) * G;
        float s = 0.f;
        for (int64_t k = 0; k < G; k++) s += p[k];
        xsum[i] = s;
    }
}

/* out = x * rsqrt(mean(x^2) + eps) * w over the last dimension (RMSNorm, as seqlab.model.layers.RMSNorm). */
static void rms_norm(const float *x, const float *w, int64_t d, double eps, float *out) {
    vf acc = vzero();
    int64_t k = 0;
    for (; k + VL <= d; k += VL) { const vf v = vload(x + k); acc = vfma(v, v, acc); }
    float ss = vsum(acc);
    for (; k < d; k++) ss += x[k] * x[k];
    const float inv = 1.0f / sqrtf(ss / (float)d + (float)eps);
    for (k = 0; k < d; k++) out[k] = (x[k] * inv) * w[k];
}

/* Rotate-half rotary at one position: x * cos + rotate_half(x) * sin (as seqlab.model.layers.apply_rotary). */
static void rotate(float *x, const float *cos_row, const float *sin_row, int64_t D) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos_row[i] + (-b) * sin_row[i];
        x[i + half] = b * cos_row[i + half] + a * sin_row[i + half];
    }
}

static inline float *kv_f32(void *base, int64_t i) { return (float *)base + i; }
static inline uint16_t *kv_bf16(void *base, int64_t i) { return (uint16_t *)base + i; }

/* softmax(q . K^T * scale) V over keys [0, n_keys) of one (row, kv head), skipping invalid slots. */
static void attend(const sl_model *m, const void *kc, const void *vc, int64_t base, const float *q,
                   const uint8_t *valid_row, int64_t n_keys, float *scores, float *out) {
    const int64_t D = m->head_dim;
    const float scale = 1.0f / sqrtf((float)D);
    float mx = -INFINITY;
    for (int64_t t = 0; t < n_keys; t++) {
        if (valid_row && !valid_row[t]) { scores[t] = -INFINITY; continue; }
        const int64_t off = base + t * D;
        float s = 0.f;
        if (m->cache_bf16) {
            const uint16_t *kt = kv_bf16((void *)kc, off);
            vf acc = vzero();
            int64_t i = 0;
            for (; i + VL <= D; i += VL) acc = vfma(vload(q + i), vload_bf16(kt + i), acc);
            s = vsum(acc);
            for (; i < D; i++) s += q[i] * bf16_to_f32(kt[i]);
        } else {
            const float *kt = kv_f32((void *)kc, off);
            vf acc = vzero();
            int64_t i = 0;
            for (; i + VL <= D; i += VL) acc = vfma(vload(q + i), vload(kt + i), acc);
            s = vsum(acc);
            for (; i < D; i++) s += q[i] * kt[i];
        }
        scores[t] = s * scale;
        if (scores[t] > mx) mx = scores[t];
    }
    float total = 0.f;
    for (int64_t t = 0; t < n_keys; t++) {
        const float e = scores[t] == -INFINITY ? 0.f : expf(scores[t] - mx);
        scores[t] = e;
        total += e;
    }
    const float inv = 1.0f / total;
    for (int64_t i = 0; i < D; i++) out[i] = 0.f;
    for (int64_t t = 0; t < n_keys; t++) {
        if (scores[t] == 0.f) continue;
        const float p = scores[t] * inv;
        const int64_t off = base + t * D;
        int64_t i = 0;
        if (m->cache_bf16) {
            const uint16_t *vt = kv_bf16((void *)vc, off);
            for (; i + VL <= D; i += VL) vstore(out + i, vfma(vset1(p), vload_bf16(vt + i), vload(out + i)));
            for (; i < D; i++) out[i] += p * bf16_to_f32(vt[i]);
        } else {
            const float *vt = kv_f32((void *)vc, off);
            for (; i + VL <= D; i += VL) vstore(out + i, vfma(vset1(p), vload(vt + i), vload(out + i)));
            for (; i < D; i++) out[i] += p * vt[i];
        }
    }
}

static inline float silu(float g) { return g / (1.0f + expf(-g)); }

static int64_t max_cols(const sl_model *m) {
    int64_t c = m->d_ff * 2, qkv = (m->n_heads + 2 * m->n_kv) * m->head_dim;
    if (qkv > c) c = qkv;
    if (m->d > c) c = m->d;
    return c;
}

/* One decode step for B rows. ``x`` [B, d]: the token embeddings in, the final hidden states out (after the final
 * norm). Row b's K/V go to cache slot ``slots[b]`` (or ``slot`` for every row when ``slots`` is NULL), its rotary
 * angles are row ``positions[b]`` of the cos/sin tables [*, head_dim], and attention reads slots [0, n_keys), skipping
 * those whose ``valid`` [rows, max_len] byte is 0 (NULL: all valid). ``k_caches``/``v_caches``: each layer's cache
 * tensor [rows, n_kv, max_len, head_dim] in the cache dtype. ``logits`` [B, vocab] (NULL: no head). */
void seqlab_fused_decode(const sl_model *m, int64_t B, float *x, int64_t slot, const int64_t *slots,
                         const int64_t *positions, const float *cos_t, const float *sin_t, const uint8_t *valid,
                         int64_t n_keys, void *const *k_caches, void *const *v_caches, float *logits, int nthreads) {
    const int64_t d = m->d, H = m->n_heads, Hkv = m->n_kv, D = m->head_dim, F = m->d_ff, L = m->max_len;
    const int64_t qkv_n = (H + 2 * Hkv) * D, group = H / Hkv;
    const int64_t cols = max_cols(m);
    float *xn = (float *)malloc(sizeof(float) * (size_t)(B * d));
    float *buf = (float *)malloc(sizeof(float) * (size_t)(B * cols));
    float *att = (float *)malloc(sizeof(float) * (size_t)(B * H * D));
    float *act = (float *)malloc(sizeof(float) * (size_t)(B * F));
    float *xsum = (float *)malloc(sizeof(float) * (size_t)(B * (cols / 32 + 1)));
    float *scores = (float *)malloc(sizeof(float) * (size_t)(nthreads * n_keys));
#pragma omp parallel num_threads(nthreads)
    {
        float *my_scores = scores + (int64_t)omp_get_thread_num() * n_keys;
        for (int64_t li = 0; li < m->n_layers; li++) {
            const sl_layer *ly = &m->layers[li];
            void *kc = k_caches[li], *vc = v_caches[li];
#pragma omp for schedule(static)
            for (int64_t b = 0; b < B; b++) rms_norm(x + b * d, ly->attn_norm, d, m->eps, xn + b * d);
            group_sums(&ly->qkv, B, xn, xsum);
            matmul(&ly->qkv, B, xn, xsum, buf);
            /* q/k norms and rotation per head; K and V written to the cache */
#pragma omp for schedule(static)
            for (int64_t i = 0; i < B * (H + Hkv); i++) {
                const int64_t b = i / (H + Hkv), h = i % (H + Hkv);
                float *v = buf + b * qkv_n + h * D;
                const float *nw = h < H ? ly->q_norm : ly->k_norm;
                if (nw) rms_norm(v, nw, D, m->eps, v);
                rotate(v, cos_t + positions[b] * D, sin_t + positions[b] * D, D);
                if (h >= H) {
                    const int64_t g = h - H, s = slots ? slots[b] : slot;
                    const int64_t off = ((b * Hkv + g) * L + s) * D;
                    const float *vv = buf + b * qkv_n + (H + Hkv + g) * D;
                    if (m->cache_bf16) {
                        for (int64_t j = 0; j < D; j++) {
                            kv_bf16(kc, off)[j] = f32_to_bf16(v[j]);
                            kv_bf16(vc, off)[j] = f32_to_bf16(vv[j]);
                        }
                    } else {
                        memcpy(kv_f32(kc, off), v, sizeof(float) * (size_t)D);
                        memcpy(kv_f32(vc, off), vv, sizeof(float) * (size_t)D);
                    }
                }
            }
#pragma omp for schedule(static)
            for (int64_t i = 0; i < B * H; i++) {
                const int64_t b = i / H, h = i % H, g = h / group;
                attend(m, kc, vc, (b * Hkv + g) * L * D, buf + b * qkv_n + h * D,
                       valid ? valid + b * L : NULL, n_keys, my_scores, att + b * H * D + h * D);
            }
            group_sums(&ly->out, B, att, xsum);
            matmul(&ly->out, B, att, xsum, buf);
#pragma omp for schedule(static)
            for (int64_t b = 0; b < B; b++) {
                for (int64_t j = 0; j < d; j++) x[b * d + j] += buf[b * d + j];
                rms_norm(x + b * d, ly->mlp_norm, d, m->eps, xn + b * d);
            }
            group_sums(&ly->up, B, xn, xsum);
            matmul(&ly->up, B, xn, xsum, buf);
#pragma omp for schedule(static)
            for (int64_t i = 0; i < B * F; i++) {
                const int64_t b = i / F, j = i % F;
                act[i] = silu(buf[b * 2 * F + j]) * buf[b * 2 * F + F + j];
            }
            group_sums(&ly->down, B, act, xsum);
            matmul(&ly->down, B, act, xsum, buf);
#pragma omp for schedule(static)
            for (int64_t i = 0; i < B * d; i++) x[i] += buf[i];
        }
        if (m->final_norm) {
#pragma omp for schedule(static)
            for (int64_t b = 0; b < B; b++) {
                rms_norm(x + b * d, m->final_norm, d, m->eps, xn + b * d);
                memcpy(x + b * d, xn + b * d, sizeof(float) * (size_t)d);
            }
        }
        if (logits) {
            group_sums(&m->head, B, x, xsum);
            matmul(&m->head, B, x, xsum, logits);
        }
    }
    free(xn); free(buf); free(att); free(act); free(xsum); free(scores);
}
