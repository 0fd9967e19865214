/* CPU implementations of the non-attention ops in kernels/kernels.h.
 * Forward and backward of each op sit side by side. Loops are written so gcc
 * vectorises them; reductions use per-thread partial sums combined in a fixed
 * order, so results depend only on the thread count, never on timing. */
#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <string.h>

#include "adamw.h"
#include "backend.h"
#include "common.h"
#include "hash.h"
#include "kernels.h"
#include "vecmath.h"

/* ------------------------------------------------------------------ embedding */

void embedding_forward(float *out, const int *tokens, const float *wte, const float *wpe,
                       int B, int T, int C, int V, float scale) {
    KPROF_OP();
    args_embedding(B, T, C, V);
    args_ids("embedding_forward", IDS_TOKENS, tokens, B * T, V, 0, 0);
#pragma omp parallel for schedule(static)
    for (int i = 0; i < B * T; i++) {
        const float *e = wte + (size_t)tokens[i] * C;
        float *o = out + (size_t)i * C;
        if (wpe) {
            const float *p = wpe + (size_t)(i % T) * C;
#pragma omp simd
            for (int c = 0; c < C; c++) o[c] = scale * e[c] + p[c];
        } else {
#pragma omp simd
            for (int c = 0; c < C; c++) o[c] = scale * e[c];
        }
    }
}

void embedding_backward(float *dwte, float *dwpe, const float *dout, const int *tokens,
                        int B, int T, int C, int V, float scale) {
    KPROF_OP();
    args_btc("embedding_backward", B, T, C, 1);
    args_ids("embedding_backward", IDS_TOKENS, tokens, B * T, V, 0, 0); /* the forward pass stopped at one already */
    /* Tokens repeat, so rows of dwte get several updates: split the work by
     * channel ranges instead of rows, which needs no atomics and keeps the
     * summation order fixed. */
    const int chunk = 64;
    int nchunks = (C + chunk - 1) / chunk;
#pragma omp parallel for schedule(static)
    for (int k = 0; k < nchunks; k++) {
        int c0 = k * chunk, c1 = c0 + chunk < C ? c0 + chunk : C;
        for (int i = 0; i < B * T; i++) {
            const float *d = dout + (size_t)i * C;
            float *e = dwte + (size_t)tokens[i] * C;
            for (int c = c0; c < c1; c++) e[c] += scale * d[c];
            if (dwpe) {
                float *p = dwpe + (size_t)(i % T) * C;
                for (int c = c0; c < c1; c++) p[c] += d[c];
            }
        }
    }
}

/* ------------------------------------------------------------------ token assembly */

void tokens_embed_forward(float *out, const float *x, const float *cls, const float *pos, int B, int T, int C) {
    KPROF_OP();
    args_btc("tokens_embed_forward", B, T, C, cls ? 2 : 1);
    int off = cls ? 1 : 0;
#pragma omp parallel for schedule(static)
    for (int bt = 0; bt < B * T; bt++) {
        int b = bt / T, t = bt % T;
        const float *src = t < off ? cls : x + ((size_t)b * (T - off) + (size_t)(t - off)) * C;
        float *o = out + (size_t)bt * C;
        if (pos) {
            const float *p = pos + (size_t)t * C;
#pragma omp simd
            for (int c = 0; c < C; c++) o[c] = src[c] + p[c];
        } else {
#pragma omp simd
            for (int c = 0; c < C; c++) o[c] = src[c];
        }
    }
}

void tokens_embed_backward(float *dx, float *dcls, float *dpos, const float *dout, int B, int T, int C) {
    KPROF_OP();
    args_btc("tokens_embed_backward", B, T, C, dcls ? 2 : 1);
    int off = dcls ? 1 : 0;
    /* position and CLS gradients sum over the batch: one thread per token row, fixed order */
#pragma omp parallel for schedule(static)
    for (int t = 0; t < T; t++) {
        for (int b = 0; b < B; b++) {
            const float *d = dout + ((size_t)b * T + t) * C;
            float *dsrc = t < off ? dcls : dx + ((size_t)b * (T - off) + (size_t)(t - off)) * C;
            for (int c = 0; c < C; c++) dsrc[c] += d[c];
            if (dpos)
                for (int c = 0; c < C; c++) dpos[(size_t)t * C + c] += d[c];
        }
    }
}

/* ------------------------------------------------------------------ pooling */

void pool_tokens_forward(float *out, const float *inp, int B, int T, int C, int first, int count) {
    KPROF_OP();
    args_pool("pool_tokens_forward", B, T, C, first, count);
    float inv = 1.0f / count;
#pragma omp parallel for schedule(static)
    for (int b = 0; b < B; b++) {
        float *o = out + (size_t)b * C;
        memset(o, 0, (size_t)C * sizeof(float));
        for (int t = first; t < first + count; t++) {
            const float *x = inp + ((size_t)b * T + t) * C;
#pragma omp simd
            for (int c = 0; c < C; c++) o[c] += x[c];
        }
#pragma omp simd
        for (int c = 0; c < C; c++) o[c] *= inv;
    }
}

void pool_tokens_backward(float *dinp, const float *dout, int B, int T, int C, int first, int count) {
    KPROF_OP();
    args_pool("pool_tokens_backward", B, T, C, first, count);
    float inv = 1.0f / count;
#pragma omp parallel for schedule(static)
    for (int b = 0; b < B; b++) {
        const float *d = dout + (size_t)b * C;
        for (int t = first; t < first + count; t++) {
            float *dx = dinp + ((size_t)b * T + t) * C;
#pragma omp simd
            for (int c = 0; c < C; c++) dx[c] += d[c] * inv;
        }
    }
}

/* ------------------------------------------------------------------ layernorm */

void layernorm_forward(float *out, float *mean, float *rstd, const float *inp,
                       const float *w, const float *b, int N, int C) {
    KPROF_OP();
    args_rows("layernorm_forward", N, C);
#pragma omp parallel for schedule(static)
    for (int i = 0; i < N; i++) {
        const float *x = inp + (size_t)i * C;
        float *o = out + (size_t)i * C;
        float m = 0.0f;
#pragma omp simd reduction(+ : m)
        for (int c = 0; c < C; c++) m += x[c];
        m /= C;
        float v = 0.0f;
#pragma omp simd reduction(+ : v)
        for (int c = 0; c < C; c++) v += (x[c] - m) * (x[c] - m);
        v /= C;
        float s = 1.0f / sqrtf(v + 1e-5f);
        if (b) {
#pragma omp simd
            for (int c = 0; c < C; c++) o[c] = (x[c] - m) * s * w[c] + b[c];
        } else {
#pragma omp simd
            for (int c = 0; c < C; c++) o[c] = (x[c] - m) * s * w[c];
        }
        mean[i] = m;
        rstd[i] = s;
    }
}

/* Per-thread partial sums of the weight/bias gradients, combined in thread order. */
static float *partials(size_t n) {
    static float *buf;
    static size_t cap;
    if (n > cap) {
        dev_free(buf);
        buf = dev_alloc(n * sizeof(float));
        cap = n;
    }
    memset(buf, 0, n * sizeof(float));
    return buf;
}

void layernorm_backward(float *dinp, float *dw, float *db, const float *dout, const float *inp,
                        const float *w, const float *mean, const float *rstd, int N, int C) {
    KPROF_OP();
    args_rows("layernorm_backward", N, C);
    int nt = omp_get_max_threads();
    float *part = partials((size_t)nt * 2 * C);
#pragma omp parallel
    {
        int tid = omp_get_thread_num();
        float *pw = part + (size_t)tid * 2 * C, *pb = pw + C;
#pragma omp for schedule(static)
        for (int i = 0; i < N; i++) {
            const float *x = inp + (size_t)i * C, *d = dout + (size_t)i * C;
            float *dx = dinp + (size_t)i * C;
            float m = mean[i], s = rstd[i];
            /* dx = s * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), dxhat = d * w */
            float sum_d = 0.0f, sum_dx = 0.0f;
#pragma omp simd reduction(+ : sum_d, sum_dx)
            for (int c = 0; c < C; c++) {
                float xh = (x[c] - m) * s, dxh = d[c] * w[c];
                sum_d += dxh;
                sum_dx += dxh * xh;
            }
            sum_d /= C;
            sum_dx /= C;
#pragma omp simd
            for (int c = 0; c < C; c++) {
                float xh = (x[c] - m) * s;
                pw[c] += d[c] * xh;
                pb[c] += d[c];
                dx[c] += s * (d[c] * w[c] - sum_d - xh * sum_dx);
            }
        }
    }
    for (int t = 0; t < nt; t++) {
        const float *pw = part + (size_t)t * 2 * C, *pb = pw + C;
        for (int c = 0; c < C; c++) dw[c] += pw[c];
        if (db)
            for (int c = 0; c < C; c++) db[c] += pb[c];
    }
}

/* ------------------------------------------------------------------ linear */

void linear_forward(float *out, const float *inp, const float *w, const float *b,
                    int N, int C, int OC) {
    KPROF_OP();
    args_linear("linear_forward", N, C, OC);
    args_distinct("linear_forward", "out and inp", out, inp, NULL);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, OC, C, 1.0f, inp, C, w, C, 0.0f, out, OC);
    if (b) {
#pragma omp parallel for schedule(static)
        for (int i = 0; i < N; i++) {
            float *o = out + (size_t)i * OC;
#pragma omp simd
            for (int j = 0; j < OC; j++) o[j] += b[j];
        }
    }
}

void linear_backward(float *dinp, float *dw, float *db, const float *dout, const float *inp,
                     const float *w, int N, int C, int OC) {
    KPROF_OP();
    args_linear("linear_backward", N, C, OC);
    if (dinp)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, C, OC, 1.0f, dout, OC, w, C, 1.0f, dinp, C);
    if (dw) cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OC, C, N, 1.0f, dout, OC, inp, C, 1.0f, dw, C);
    if (db) {
        /* column sums in blocks of 64 columns: contiguous reads, fixed order */
        const int chunk = 64;
        int nchunks = (OC + chunk - 1) / chunk;
#pragma omp parallel for schedule(static)
        for (int k = 0; k < nchunks; k++) {
            int j0 = k * chunk, j1 = j0 + chunk < OC ? j0 + chunk : OC;
            float acc[64] = {0};
            for (int i = 0; i < N; i++) {
                const float *d = dout + (size_t)i * OC;
#pragma omp simd
                for (int j = j0; j < j1; j++) acc[j - j0] += d[j];
            }
            for (int j = j0; j < j1; j++) db[j] += acc[j - j0];
        }
    }
}

/* ------------------------------------------------------------------ activations */

#define GELU_K 0.7978845608028654f /* sqrt(2/pi) */

void gelu_forward(float *out, const float *inp, size_t n) {
    KPROF_OP();
#pragma omp parallel for simd schedule(static)
    for (size_t i = 0; i < n; i++) {
        float x = inp[i];
        float u = GELU_K * (x + 0.044715f * x * x * x);
        out[i] = 0.5f * x * (1.0f + vtanhf(u));
    }
}

/* GELU's derivative at x */
static inline float gelu_grad(float x) {
    float u = GELU_K * (x + 0.044715f * x * x * x);
    float th = vtanhf(u);
    float du = GELU_K * (1.0f + 3.0f * 0.044715f * x * x);
    return 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * du;
}

void gelu_backward(float *dinp, const float *inp, const float *dout, size_t n) {
    KPROF_OP();
#pragma omp parallel for simd schedule(static)
    for (size_t i = 0; i < n; i++) dinp[i] += gelu_grad(inp[i]) * dout[i];
}

void relu_forward(float *out, const float *inp, size_t n) {
    KPROF_OP();
#pragma omp parallel for simd schedule(static)
    for (size_t i = 0; i < n; i++) out[i] = inp[i] > 0.0f ? inp[i] : 0.0f;
}

void relu_backward(float *dinp, const float *inp, const float *dout, size_t n) {
    KPROF_OP();
#pragma omp parallel for simd schedule(static)
    for (size_t i = 0; i < n; i++) dinp[i] += inp[i] > 0.0f ? dout[i] : 0.0f;
}

/* The linear layers of the MLP with the GELU beside them: on the CPU the ops in turn (what the fusion saves on a
 * GPU, a pass over the activations in memory, is in cache here); the backward's dpre is the product, then scaled in
 * place by GELU's derivative: the values of linear_backward into zeros then gelu_backward, bit for bit. */
void linear_gelu_forward(float *pre, float *out, const float *inp, const float *w, const float *b, int N, int C,
                         int OC) {
    KPROF_OP();
    args_linear("linear_gelu_forward", N, C, OC);
    args_distinct("linear_gelu_forward", "pre, out and inp", pre, out, inp);
    linear_forward(pre, inp, w, b, N, C, OC);
    gelu_forward(out, pre, (size_t)N * OC);
}

void gelu_linear_backward(float *dpre, float *dw, float *db, const float *dout, const float *act, const float *pre,
                          const float *w, int N, int C, int OC) {
    KPROF_OP();
    args_gelu_linear(dpre, act, dout, pre, N, C, OC);
    size_t n = (size_t)N * C;
    memset(dpre, 0, n * sizeof(float));
    linear_backward(dpre, dw, db, dout, act, w, N, C, OC);
#pragma omp parallel for simd schedule(static)
    for (size_t i = 0; i < n; i++) dpre[i] = 0.0f + gelu_grad(pre[i]) * dpre[i];
}

/* ------------------------------------------------------------------ residual */

void residual_forward(float *out, const float *a, const float *b, size_t n) {
    KPROF_OP();
#pragma omp parallel for simd schedule(static)
    for (size_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}

/* The CPU gains nothing from the fusion (the rows are in cache between the two): the two ops in turn. */
void residual_layernorm_forward(float *res, float *out, float *mean, float *rstd, const float *a, const float *b,
                                const float *w, const float *bias, int N, int C) {
    KPROF_OP();
    args_rows("residual_layernorm_forward", N, C);
    residual_forward(res, a, b, (size_t)N * C);
    layernorm_forward(out, mean, rstd, res, w, bias, N, C);
}

/* ------------------------------------------------------------------ dropout */

void dropout_forward(float *out, const float *inp, size_t n, float p, uint64_t seed) {
    KPROF_OP();
    uint32_t thr = dropout_threshold(p, "dropout_forward");
    float scale = 1.0f / (1.0f - p);
    size_t off = dropout_batch_offset(n, "dropout_forward");
#pragma omp parallel for simd schedule(static)
    for (size_t i = 0; i < n; i++) out[i] = dropout_keep(seed, off + i, thr) ? inp[i] * scale : 0.0f;
}

void dropout_backward(float *dinp, const float *dout, size_t n, float p, uint64_t seed) {
    KPROF_OP();
    uint32_t thr = dropout_threshold(p, "dropout_backward");
    float scale = 1.0f / (1.0f - p);
    size_t off = dropout_batch_offset(n, "dropout_backward");
#pragma omp parallel for simd schedule(static)
    for (size_t i = 0; i < n; i++) dinp[i] += dropout_keep(seed, off + i, thr) ? dout[i] * scale : 0.0f;
}

/* ------------------------------------------------------------------ cross-entropy */

void crossentropy_forward(float *losses, float *lse, const float *logits, const int *targets,
                          int N, int V, int ignore_index, float smoothing) {
    KPROF_OP();
    args_classes("crossentropy_forward", N, V, smoothing);
    args_ids("crossentropy_forward", IDS_TARGETS, targets, N, V, 1, ignore_index);
#pragma omp parallel for schedule(static)
    for (int i = 0; i < N; i++) {
        const float *x = logits + (size_t)i * V;
        float mx = -INFINITY;
        for (int j = 0; j < V; j++) mx = x[j] > mx ? x[j] : mx;
        float s = 0.0f, sx = 0.0f;
#pragma omp simd reduction(+ : s, sx)
        for (int j = 0; j < V; j++) {
            s += vexpf(x[j] - mx);
            sx += x[j];
        }
        float l = mx + logf(s);
        lse[i] = l;
        int t = targets[i];
        losses[i] = t == ignore_index ? 0.0f : l - (1.0f - smoothing) * x[t] - smoothing * sx / V;
    }
}

void crossentropy_backward(float *dlogits, const float *logits, const float *lse,
                           const int *targets, int N, int V, int ignore_index,
                           float smoothing, float scale) {
    KPROF_OP();
    args_classes("crossentropy_backward", N, V, smoothing);
    float off = smoothing / V;
#pragma omp parallel for schedule(static)
    for (int i = 0; i < N; i++) {
        const float *x = logits + (size_t)i * V;
        float *d = dlogits + (size_t)i * V;
        int t = targets[i];
        if (t == ignore_index) {
            if (d != x) continue; /* accumulate nothing */
            memset(d, 0, (size_t)V * sizeof(float));
            continue;
        }
        float l = lse[i];
        if (d == x) {
#pragma omp simd
            for (int j = 0; j < V; j++) d[j] = (vexpf(x[j] - l) - off) * scale;
        } else {
#pragma omp simd
            for (int j = 0; j < V; j++) d[j] += (vexpf(x[j] - l) - off) * scale;
        }
        d[t] -= (1.0f - smoothing) * scale;
    }
}

void argmax_correct_into(double *acc, const float *logits, const int *targets, int N, int V, int ignore_index) {
    KPROF_OP();
    args_classes("argmax_correct", N, V, 0.0f);
    int correct = 0;
#pragma omp parallel for schedule(static) reduction(+ : correct)
    for (int i = 0; i < N; i++) {
        if (targets[i] == ignore_index) continue;
        const float *x = logits + (size_t)i * V;
        int best = 0;
        for (int j = 1; j < V; j++)
            if (x[j] > x[best]) best = j;
        correct += best == targets[i];
    }
    *acc += correct;
}

void sum_into(double *acc, const float *x, size_t n, double scale) {
    KPROF_OP();
    double s = 0.0;
    for (size_t i = 0; i < n; i++) s += x[i];
    *acc += scale * s;
}

/* ------------------------------------------------------------------ optimiser */

void adamw_update_spans(float *param, const float *grad, float *m, float *v, const AdamwSpan *spans, int nspans,
                        float lr, float beta1, float beta2, float eps, int t) {
    KPROF_OP();
    args_adamw(t);
    float bc1 = 1.0f - powf(beta1, (float)t), bc2 = 1.0f - powf(beta2, (float)t);
    for (int k = 0; k < nspans; k++) {
        float *p = param + spans[k].offset, *mk = m + spans[k].state_offset, *vk = v + spans[k].state_offset;
        const float *g = grad + spans[k].offset;
        float wd = spans[k].weight_decay;
#pragma omp parallel for simd schedule(static)
        for (size_t i = 0; i < spans[k].n; i++)
            adamw_value(&p[i], &mk[i], &vk[i], g[i], lr, beta1, beta2, eps, wd, bc1, bc2);
    }
}

static double sum_of_squares(const float *grad, size_t n) {
    int nt = omp_get_max_threads();
    double part[1024] = {0};
    if (nt > 1024) nt = 1024;
#pragma omp parallel num_threads(nt)
    {
        int tid = omp_get_thread_num(), T = omp_get_num_threads();
        size_t lo = n * (size_t)tid / (size_t)T, hi = n * (size_t)(tid + 1) / (size_t)T;
        double s = 0.0;
        for (size_t i = lo; i < hi; i++) s += (double)grad[i] * grad[i];
        part[tid] = s;
    }
    double s = 0.0;
    for (int t = 0; t < nt; t++) s += part[t];
    return s;
}

void scale_inplace(float *x, size_t n, float s) {
    KPROF_OP();
#pragma omp parallel for simd schedule(static)
    for (size_t i = 0; i < n; i++) x[i] *= s;
}

void grad_sumsq_into(const float *grad, size_t n, double *sumsq) {
    KPROF_OP();
    *sumsq = sum_of_squares(grad, n);
}

void clip_grad_sumsq_into(float *grad, size_t n, double max_norm, const double *sumsq, double *norm) {
    KPROF_OP();
    args_clip("clip_grad_sumsq_into", max_norm);
    *norm = sqrt(*sumsq);
    if (max_norm > 0 && *norm > max_norm) scale_inplace(grad, n, (float)(max_norm / (*norm + 1e-6)));
}

void clip_grad_norm_into(float *grad, size_t n, double max_norm, double *norm) {
    KPROF_OP();
    args_clip("clip_grad_norm_into", max_norm);
    double sq = sum_of_squares(grad, n);
    clip_grad_sumsq_into(grad, n, max_norm, &sq, norm);
}
