/* CPU attention: every variant through one code path (docs/kernels.md).
 *
 * Work is split over (batch, head) pairs with OpenMP; inside a pair the
 * score, value and gradient products are single-threaded sgemm calls (the
 * OpenMP build of OpenBLAS stays on one thread inside a parallel region).
 * The T x T probabilities are never stored: the forward pass keeps the row
 * log-sum-exp and the backward pass recomputes the scores block by block,
 * so memory is O(B H T) and each score block is walked once per pass while
 * it is hot in cache.
 *
 *  - causal or general (cross): query rows in blocks of ATTN_ROW_BLOCK; a
 *    causal block only multiplies the keys up to its last row.
 *  - bidirectional KV and K (query role = key role): the score matrix is
 *    symmetric, so ssyrk computes each pair once, and the backward pass
 *    forms dK = s (G + G^T) K with one product instead of two.
 *
 * Roles are pointers into the projection buffer: a variant that reuses a
 * projection in several roles simply passes the same pointer, and its
 * gradients from each role accumulate into the same place.
 *
 * Grouped K/V heads (GQA/MQA): query head h reads key and value head
 * h / group (group = H / kv_heads). The forward pass still runs one task per
 * (batch, query head); the backward pass runs one task per (batch, K/V
 * head) that walks its query heads in order, so the dK and dV of a shared
 * head are accumulated by one thread in a fixed order (no atomics, the same
 * result for every thread count). */
#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "backend.h"
#include "common.h"
#include "hash.h"
#include "kernels.h"
#include "vecmath.h"

#define ATTN_ROW_BLOCK 64

/* ------------------------------------------------------------------ problem */

/* the CPU has one set of kernels: attention_set_mma_path (kernels/attention.c) changes nothing here */
int attention_mma_check(void) { return -1; } /* no such kernels here */

/* One attention call with its roles resolved to strided pointers. Head h of
 * batch b of a role X starts at X + b*X_bstride + h*hd, rows X_ld apart. */
typedef struct {
    int B, Tq, Tk, H, hd;
    int group;          /* query heads per K/V head (H / kv_heads); K/V head of query head h: h / group */
    int causal, symmetric, pos;
    float scale;
    const float *q, *k, *v;
    float *dq, *dk, *dv;
    int q_ld, k_ld, v_ld;
    size_t q_bstride, k_bstride, v_bstride;
    float *out;
    const float *dout;
    size_t o_bstride;
    int o_ld;
    float *lse;
    const float *padf;  /* (B, Tk) 1 = key visible, 0 = padding */
    float dropout;
    uint32_t drop_thr;
    uint64_t seed;
    int batch_first;    /* global batch row of b = 0 (dropout_batch_first: data parallelism) */
    /* +Pos: per group f (Tq), g (Tk), alpha, bias; per task accumulators */
    int pos_groups;
    const float *f, *g, *alpha, *bias;
    float *pos_acc; /* (B*H, 2 + Tq + Tk): sum G'S, sum G', row sums, column sums */
    /* position bias (ALiBi, relative bias): head h's bias at j - i = d is pe_bias[h * pe_nd + d + Tq - 1] */
    const float *pe_bias;
    int pe_nd;
    float *rel_acc;     /* (B*H, pe_nd): sum of G' per offset j - i (relative bias backward) */
    /* RoPE: the rotated query and key roles are copies (q, k point there); the backward pass gathers their
     * gradients in rope_dq, rope_dk and rotates them back into the projection gradient */
    const float *rope;
    float *rope_dq, *rope_dk;
    float *dq_proj, *dk_proj; /* where they go: the query and key blocks of dproj, row stride proj_ld */
    int proj_ld, kv_heads;
} Problem;

static int pos_group(const Problem *p, int h) { return p->pos_groups == 1 ? 0 : h; }

/* Dropout index of probability (i, 0) of batch b, query head h: its place in the probabilities of the global
 * batch, so that a rank holding rows [first, first + B) of it draws the masks one process would. Forward
 * (softmax_row) and backward (backward_row) must agree; the backward pass walks a K/V head's query heads, but
 * the mask stays per query head. */
static size_t drop_base(const Problem *p, int b, int h, int i) {
    return (((size_t)(p->batch_first + b) * p->H + h) * p->Tq + i) * p->Tk;
}

/* Offset of query head h's K/V head inside a K/V row. */
static size_t kv_off(const Problem *p, int h) { return (size_t)(h / p->group) * p->hd; }

/* This row's bias over keys 0..: b[j] is the bias of (i, j). */
static const float *bias_row(const Problem *p, int h, int i) {
    return p->pe_bias ? p->pe_bias + (size_t)h * p->pe_nd + (size_t)(p->Tq - 1 - i) : NULL;
}

/* Build-time facts: +Pos code exists only in +Pos builds and the symmetric
 * (ssyrk) path only where the query role is the key role; the compiler
 * removes the rest, since these are constant-false elsewhere. */
static inline int uses_pos(const Problem *p) { return ATTN_POS && p->pos; }
static inline int uses_symmetric(const Problem *p) { return attn_symmetric(ATTN_VARIANT) && p->symmetric; }

/* dO_i . O_i over one head; the configured head dim gets its own copy with
 * a constant trip count. */
static inline __attribute__((always_inline)) float dot_n(const float *a, const float *b, int n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int k = 0; k < n; k++) s += a[k] * b[k];
    return s;
}

static float head_dot(const float *a, const float *b, int hd) {
    return ATTN_HEAD_DIM > 0 && hd == ATTN_HEAD_DIM ? dot_n(a, b, ATTN_HEAD_DIM) : dot_n(a, b, hd);
}

/* A buffer that grows on demand, one per use (calls come from serial code). */
static float *grown(float **buf, size_t *cap, size_t floats) {
    if (floats > *cap) {
        dev_free(*buf);
        *buf = dev_alloc(floats * sizeof(float));
        *cap = floats;
    }
    return *buf;
}

/* Per-thread scratch (calls come from serial code). */
static float *workspace(size_t floats) {
    static float *buf;
    static size_t cap;
    return grown(&buf, &cap, floats);
}

static float *scratch_for(const Problem *p, size_t *per_thread) {
    size_t rows = uses_symmetric(p) ? (size_t)p->Tq : (size_t)(ATTN_ROW_BLOCK < p->Tq ? ATTN_ROW_BLOCK : p->Tq);
    *per_thread = 2 * rows * (size_t)p->Tk;
    return workspace(*per_thread * (size_t)omp_get_max_threads());
}

/* Key-padding mask as floats (1 visible, 0 padded; all ones without
 * padding), so the inner loops multiply instead of branching and vectorise. */
static float *pad_floats(const unsigned char *key_pad, int B, int Tk) {
    static float *buf;
    static size_t cap;
    size_t n = (size_t)B * Tk;
    grown(&buf, &cap, n);
    for (size_t i = 0; i < n; i++) buf[i] = key_pad && key_pad[i] ? 0.0f : 1.0f;
    return buf;
}

/* f, g, alpha, bias of every +Pos group (O(groups * T * m)). */
static float *pos_prepare(Problem *p, const AttnPos *P, int T) {
    static float *buf;
    static size_t cap;
    int G = P->groups, m = P->m, c = attn_pos_channels(m), ci = attn_pos_query_channels(m);
    float *f = grown(&buf, &cap, (size_t)G * (2 * T + 2)), *g = f + (size_t)G * T, *alpha = g + (size_t)G * T, *bias = alpha + G;
    for (int gi = 0; gi < G; gi++) {
        const float *w = P->w + (size_t)gi * m;
        float a = 0.0f;
        for (int k = 0; k < m; k++) a += w[k];
        alpha[gi] = a;
        bias[gi] = P->b[gi];
        for (int t = 0; t < T; t++) {
            const float *ft = P->feat + (size_t)t * c;
            float fi = 0.0f, gj = 0.0f;
            for (int k = 0; k < ci; k++) fi += w[k] * ft[k];
            for (int k = ci; k < m; k++) gj += w[k] * ft[k - ci];
            f[(size_t)gi * T + t] = fi;
            g[(size_t)gi * T + t] = gj;
        }
    }
    p->pos_groups = G;
    p->f = f;
    p->g = g;
    p->alpha = alpha;
    p->bias = bias;
    return buf;
}

/* ------------------------------------------------------------------ scores */

/* S[0:rows, 0:kmax] = scale * Q[r0:r0+rows] K[0:kmax]^T, row stride ldS. */
static void scores_block(const Problem *p, const float *Q, const float *K, int r0, int rows, int kmax,
                         float *S, int ldS) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, kmax, p->hd, p->scale,
                Q + (size_t)r0 * p->q_ld, p->q_ld, K, p->k_ld, 0.0f, S, ldS);
}

/* Full symmetric S = scale * K K^T: ssyrk fills the lower triangle once,
 * the upper one is a mirror copy. */
static void scores_symmetric(const Problem *p, const float *K, float *S) {
    int T = p->Tk;
    cblas_ssyrk(CblasRowMajor, CblasLower, CblasNoTrans, T, p->hd, p->scale, K, p->k_ld, 0.0f, S, T);
    for (int i = 0; i < T; i++)
        for (int j = i + 1; j < T; j++) S[(size_t)i * T + j] = S[(size_t)j * T + i];
}

/* Turns one row of raw scores into probabilities in place: +Pos, masks,
 * softmax, dropout. Keys [jmax, kmax) are causally masked. Returns lse. */
static float softmax_row(const Problem *p, float *row, int b, int h, int i, int jmax, int kmax, int dropout) {
    const float *padf = p->padf + (size_t)b * p->Tk;
    if (uses_pos(p)) {
        int gi = pos_group(p, h);
        const float *g = p->g + (size_t)gi * p->Tk;
        float alpha = p->alpha[gi], fib = p->f[(size_t)gi * p->Tq + i] + p->bias[gi];
#pragma omp simd
        for (int j = 0; j < jmax; j++) row[j] = alpha * row[j] + g[j] + fib;
    }
    const float *bt = bias_row(p, h, i);
    if (bt) {
#pragma omp simd
        for (int j = 0; j < jmax; j++) row[j] += bt[j];
    }
#pragma omp simd
    for (int j = 0; j < jmax; j++) row[j] = padf[j] != 0.0f ? row[j] : -INFINITY;
    float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
    for (int j = 0; j < jmax; j++) mx = row[j] > mx ? row[j] : mx;
    if (mx == -INFINITY) { /* every key masked: the row attends to nothing */
        memset(row, 0, (size_t)kmax * sizeof(float));
        return -INFINITY;
    }
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int j = 0; j < jmax; j++) {
        float e = vexpf(row[j] - mx);
        row[j] = e;
        sum += e;
    }
    float inv = 1.0f / sum;
    if (dropout) {
        float ds = inv / (1.0f - p->dropout);
        size_t base = drop_base(p, b, h, i);
#pragma omp simd
        for (int j = 0; j < jmax; j++) row[j] = dropout_keep(p->seed, base + j, p->drop_thr) ? row[j] * ds : 0.0f;
    } else {
#pragma omp simd
        for (int j = 0; j < jmax; j++) row[j] *= inv;
    }
    for (int j = jmax; j < kmax; j++) row[j] = 0.0f;
    return mx + logf(sum);
}

/* ------------------------------------------------------------------ forward */

/* Probabilities of query rows [r0, r0+rows) into S (row stride Tk) and their
 * lse; returns the number of keys the block uses. The forward pass and
 * attention_probs() both go through here, so they agree bit for bit. */
static int probs_block(const Problem *p, int b, int h, int r0, int rows, float *S, float *lse, int dropout) {
    const float *Q = p->q + b * p->q_bstride + (size_t)h * p->hd;
    const float *K = p->k + b * p->k_bstride + kv_off(p, h);
    int Tk = p->Tk;
    int kmax = p->causal ? r0 + rows : Tk;
    if (uses_symmetric(p)) /* one call for the whole matrix (r0 == 0, rows == Tq) */
        scores_symmetric(p, K, S);
    else
        scores_block(p, Q, K, r0, rows, kmax, S, Tk);
    for (int r = 0; r < rows; r++) {
        int i = r0 + r;
        lse[i] = softmax_row(p, S + (size_t)r * Tk, b, h, i, p->causal ? i + 1 : kmax, kmax, dropout);
    }
    return kmax;
}

static int row_block(const Problem *p) { return uses_symmetric(p) ? p->Tq : ATTN_ROW_BLOCK; }

static void forward_one(const Problem *p, int b, int h, float *S) {
    size_t hoff = (size_t)h * p->hd;
    const float *V = p->v + b * p->v_bstride + kv_off(p, h);
    float *O = p->out + b * p->o_bstride + hoff;
    float *lse = p->lse + ((size_t)b * p->H + h) * p->Tq;
    for (int r0 = 0; r0 < p->Tq; r0 += row_block(p)) {
        int rows = p->Tq - r0 < row_block(p) ? p->Tq - r0 : row_block(p);
        int kmax = probs_block(p, b, h, r0, rows, S, lse, p->dropout > 0.0f);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, p->hd, kmax, 1.0f, S, p->Tk, V, p->v_ld,
                    0.0f, O + (size_t)r0 * p->o_ld, p->o_ld);
    }
}

static void run_forward(const Problem *p) {
    size_t per;
    float *ws = scratch_for(p, &per);
#pragma omp parallel
    {
        float *S = ws + per * (size_t)omp_get_thread_num();
#pragma omp for schedule(dynamic)
        for (int task = 0; task < p->B * p->H; task++) forward_one(p, task / p->H, task % p->H, S);
    }
}

/* ------------------------------------------------------------------ backward */

/* Softmax backward of one row, in place. On entry S holds raw scaled scores
 * and dA = dO V^T; on exit S holds the (dropped-out) probabilities, for dV,
 * and dA holds the score gradient (times alpha under +Pos), for dQ and dK.
 * G'_ij = A_ij (dA_ij - D_i) with D_i = dO_i . O_i (= sum_j A_ij dA_ij). */
static void backward_row(const Problem *p, float *S, float *dA, int b, int h, int i, int jmax, int kmax,
                         float lse, float D, float *acc, float *colsum) {
    if (lse == -INFINITY) { /* fully masked row: no probability, no gradient */
        memset(S, 0, (size_t)kmax * sizeof(float));
        memset(dA, 0, (size_t)kmax * sizeof(float));
        return;
    }
    const float *padf = p->padf + (size_t)b * p->Tk;
    float alpha = 1.0f, fib = 0.0f;
    const float *g = NULL;
    if (uses_pos(p)) {
        int gi = pos_group(p, h);
        alpha = p->alpha[gi];
        fib = p->f[(size_t)gi * p->Tq + i] + p->bias[gi];
        g = p->g + (size_t)gi * p->Tk;
    }
    float gs = 0.0f, rsum = 0.0f;
    /* position bias: bt[j] of (i, j); racc[j] collects G' per offset j - i */
    const float *bt = bias_row(p, h, i);
    float *racc = p->rel_acc ? p->rel_acc + ((size_t)b * p->H + h) * p->pe_nd + (size_t)(p->Tq - 1 - i) : NULL;
    if (p->dropout > 0.0f || bt) {
        float ds = 1.0f / (1.0f - p->dropout);
        size_t base = drop_base(p, b, h, i);
        for (int j = 0; j < jmax; j++) {
            float s = S[j];
            float x = (uses_pos(p) ? alpha * s + g[j] + fib : s) + (bt ? bt[j] : 0.0f);
            float a = vexpf(x - lse) * padf[j];
            float keep = p->dropout == 0.0f ? 1.0f : dropout_keep(p->seed, base + j, p->drop_thr) ? ds : 0.0f;
            float gp = a * (dA[j] * keep - D);
            if (uses_pos(p)) {
                gs += gp * s;
                rsum += gp;
                colsum[j] += gp;
            }
            if (racc) racc[j] += gp;
            S[j] = a * keep;
            dA[j] = alpha * gp;
        }
    } else if (uses_pos(p)) {
#pragma omp simd reduction(+ : gs, rsum)
        for (int j = 0; j < jmax; j++) {
            float s = S[j];
            float a = vexpf(alpha * s + g[j] + fib - lse) * padf[j];
            float gp = a * (dA[j] - D);
            gs += gp * s;
            rsum += gp;
            colsum[j] += gp;
            S[j] = a;
            dA[j] = alpha * gp;
        }
    } else {
#pragma omp simd
        for (int j = 0; j < jmax; j++) {
            float a = vexpf(S[j] - lse) * padf[j];
            S[j] = a;
            dA[j] = a * (dA[j] - D);
        }
    }
    for (int j = jmax; j < kmax; j++) S[j] = dA[j] = 0.0f;
    if (uses_pos(p)) {
        acc[0] += gs;
        acc[1] += rsum;
        acc[2 + i] += rsum;
    }
}

static void backward_one(const Problem *p, int b, int h, float *S, float *dA) {
    size_t hoff = (size_t)h * p->hd, kvoff = kv_off(p, h);
    const float *Q = p->q + b * p->q_bstride + hoff;
    const float *K = p->k + b * p->k_bstride + kvoff;
    const float *V = p->v + b * p->v_bstride + kvoff;
    float *dQ = p->dq + b * p->q_bstride + hoff;
    float *dK = p->dk + b * p->k_bstride + kvoff;
    float *dV = p->dv + b * p->v_bstride + kvoff;
    const float *O = p->out + b * p->o_bstride + hoff;
    const float *dO = p->dout + b * p->o_bstride + hoff;
    const float *lse = p->lse + ((size_t)b * p->H + h) * p->Tq;
    int Tq = p->Tq, Tk = p->Tk, hd = p->hd;
    float *acc = uses_pos(p) ? p->pos_acc + ((size_t)b * p->H + h) * (2 + Tq + Tk) : NULL;
    float *colsum = acc ? acc + 2 + Tq : NULL;

    if (uses_symmetric(p)) {
        scores_symmetric(p, K, S);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, Tq, Tk, hd, 1.0f, dO, p->o_ld, V, p->v_ld,
                    0.0f, dA, Tk);
        for (int i = 0; i < Tq; i++) {
            float D = head_dot(dO + (size_t)i * p->o_ld, O + (size_t)i * p->o_ld, hd);
            backward_row(p, S + (size_t)i * Tk, dA + (size_t)i * Tk, b, h, i, Tk, Tk, lse[i], D, acc, colsum);
        }
        /* dV += A^T dO */
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, Tk, hd, Tq, 1.0f, S, Tk, dO, p->o_ld, 1.0f, dV,
                    p->v_ld);
        /* K plays query and key: dK += s (G + G^T) K, symmetrised in place */
        for (int i = 0; i < Tq; i++) {
            dA[(size_t)i * Tk + i] *= 2.0f;
            for (int j = 0; j < i; j++) {
                float t = dA[(size_t)i * Tk + j] + dA[(size_t)j * Tk + i];
                dA[(size_t)i * Tk + j] = t;
                dA[(size_t)j * Tk + i] = t;
            }
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, Tq, hd, Tk, p->scale, dA, Tk, K, p->k_ld, 1.0f,
                    dK, p->k_ld);
        return;
    }
    for (int r0 = 0; r0 < Tq; r0 += ATTN_ROW_BLOCK) {
        int rows = Tq - r0 < ATTN_ROW_BLOCK ? Tq - r0 : ATTN_ROW_BLOCK;
        int kmax = p->causal ? r0 + rows : Tk;
        scores_block(p, Q, K, r0, rows, kmax, S, Tk);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, kmax, hd, 1.0f, dO + (size_t)r0 * p->o_ld,
                    p->o_ld, V, p->v_ld, 0.0f, dA, Tk);
        for (int r = 0; r < rows; r++) {
            int i = r0 + r;
            const float *o = O + (size_t)i * p->o_ld, *d = dO + (size_t)i * p->o_ld;
            float D = head_dot(d, o, hd);
            backward_row(p, S + (size_t)r * Tk, dA + (size_t)r * Tk, b, h, i, p->causal ? i + 1 : kmax, kmax,
                         lse[i], D, acc, colsum);
        }
        /* dV[0:kmax] += A_blk^T dO_blk; dQ_blk += s G_blk K; dK[0:kmax] += s G_blk^T Q_blk */
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, kmax, hd, rows, 1.0f, S, Tk,
                    dO + (size_t)r0 * p->o_ld, p->o_ld, 1.0f, dV, p->v_ld);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, hd, kmax, p->scale, dA, Tk, K, p->k_ld,
                    1.0f, dQ + (size_t)r0 * p->q_ld, p->q_ld);
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, kmax, hd, rows, p->scale, dA, Tk,
                    Q + (size_t)r0 * p->q_ld, p->q_ld, 1.0f, dK, p->k_ld);
    }
}

static void run_backward(const Problem *p) {
    size_t per;
    float *ws = scratch_for(p, &per);
#pragma omp parallel
    {
        float *S = ws + per * (size_t)omp_get_thread_num();
        float *dA = S + per / 2;
        int G = p->H / p->group; /* K/V heads: one task each, its query heads in order */
#pragma omp for schedule(dynamic)
        for (int task = 0; task < p->B * G; task++)
            for (int h = (task % G) * p->group; h < (task % G + 1) * p->group; h++) backward_one(p, task / G, h, S, dA);
    }
}

/* Reduces the per-task +Pos sums into dw, db (fixed order: deterministic).
 * dw_c = sum G'S + sum_i feat_c(i) rowsum_i (query channels)
 *      = sum G'S + sum_j feat_c(j) colsum_j (key channels); db = sum G'. */
static void pos_reduce(const Problem *p, const AttnPos *P, AttnPosGrad *dP) {
    int Tq = p->Tq, Tk = p->Tk, m = P->m, c = attn_pos_channels(m), ci = attn_pos_query_channels(m);
    size_t stride = 2 + (size_t)Tq + Tk;
    float *sum = workspace(stride); /* free again: the backward pass is done */
    for (int gi = 0; gi < P->groups; gi++) {
        memset(sum, 0, stride * sizeof(float));
        for (int b = 0; b < p->B; b++)
            for (int h = 0; h < p->H; h++) {
                if (pos_group(p, h) != gi) continue;
                const float *a = p->pos_acc + ((size_t)b * p->H + h) * stride;
                for (size_t k = 0; k < stride; k++) sum[k] += a[k];
            }
        float *dw = dP->dw + (size_t)gi * m;
        for (int k = 0; k < m; k++) {
            double s = sum[0];
            if (k < ci)
                for (int i = 0; i < Tq; i++) s += (double)P->feat[(size_t)i * c + k] * sum[2 + i];
            else
                for (int j = 0; j < Tk; j++) s += (double)P->feat[(size_t)j * c + (k - ci)] * sum[2 + Tq + j];
            dw[k] += (float)s;
        }
        dP->db[gi] += sum[1];
    }
}

/* ------------------------------------------------------------------ position schemes */

/* The bias of every head at every offset d = j - i in [-(T-1), T-1]: (H, 2T-1). */
static float *bias_table(const AttnPos *P, int H, int T, int causal) {
    static float *buf;
    static size_t cap;
    int nd = 2 * T - 1;
    float *tab = grown(&buf, &cap, (size_t)H * nd);
    for (int h = 0; h < H; h++) {
        double slope = P->scheme == ATTN_POSITION_ALIBI ? attn_alibi_slope(h, H) : 0.0;
        for (int d = -(T - 1); d <= T - 1; d++)
            tab[(size_t)h * nd + d + T - 1] =
                P->scheme == ATTN_POSITION_ALIBI
                    ? (float)(-slope * (d < 0 ? -d : d))
                    : P->rel[(size_t)h * P->rel_buckets + attn_rel_bucket(d, causal, P->rel_buckets, P->rel_max_distance)];
    }
    return tab;
}

/* One channel pair (x0, x1) turned by the angle whose cos and sin are cs[0], cs[1]. */
static inline void rope_pair(const float *cs, float x0, float x1, float *y0, float *y1) {
    *y0 = cs[0] * x0 - cs[1] * x1;
    *y1 = cs[1] * x0 + cs[0] * x1;
}

/* RoPE over rows of `heads` heads of hd channels: dst = R_t src (inverse: R_t^T src, added to dst), row r at
 * position r % T; pairs (2k, 2k+1) rotated by the table's angle of (t, k). */
static void rope_rows(float *dst, int dst_ld, const float *src, int src_ld, int rows, int T, int heads, int hd,
                      const float *tab, int inverse) {
    int half = hd / 2;
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++) {
        const float *cs = tab + (size_t)(r % T) * hd;
        const float *x = src + (size_t)r * src_ld;
        float *y = dst + (size_t)r * dst_ld;
        for (int h = 0; h < heads; h++)
            for (int k = 0; k < half; k++) {
                size_t c = (size_t)h * hd + 2 * (size_t)k;
                if (inverse) { /* R^T: the angle negated */
                    const float back[2] = {cs[2 * k], -cs[2 * k + 1]};
                    float y0, y1;
                    rope_pair(back, x[c], x[c + 1], &y0, &y1);
                    y[c] += y0;
                    y[c + 1] += y1;
                } else {
                    rope_pair(cs + 2 * k, x[c], x[c + 1], &y[c], &y[c + 1]);
                }
            }
    }
}

/* ------------------------------------------------------------------ entry points */

static void self_problem(Problem *p, const char *op, float *out, float *lse, const float *proj, float *dproj,
                         const float *dout, const AttnPos *pos, const AttnArgs *a) {
    attn_check_args(op, a->B, a->T, a->T, a->H, a->hd, a->dropout);
    if (!proj || !out || !lse) FATAL("%s: NULL buffer", op);
    int scheme = attn_check_pos(op, pos, a->H, a->hd, a->T);
    int G = attn_check_kv_heads(op, a->H, a->kv_heads);
    int C = a->H * a->hd, kvC = G * a->hd, W = attn_proj_width(ATTN_VARIANT, C, kvC);
    int qo = attn_block_offset(ATTN_VARIANT, attn_query_block(ATTN_VARIANT), C, kvC);
    int ko = attn_block_offset(ATTN_VARIANT, attn_key_block(ATTN_VARIANT), C, kvC);
    int vo = attn_block_offset(ATTN_VARIANT, attn_value_block(ATTN_VARIANT), C, kvC);
    memset(p, 0, sizeof *p);
    p->B = a->B;
    p->Tq = p->Tk = a->T;
    p->H = a->H;
    p->hd = a->hd;
    p->group = a->H / G;
    p->causal = a->causal;
    p->symmetric = attn_symmetric(ATTN_VARIANT) && !a->causal && attention_symmetric_path();
    p->pos = ATTN_POS;
    p->scale = 1.0f / sqrtf((float)a->hd);
    p->q = proj + qo;
    p->k = proj + ko;
    p->v = proj + vo;
    if (dproj) {
        p->dq = dproj + qo;
        p->dk = dproj + ko;
        p->dv = dproj + vo;
    }
    p->q_ld = p->k_ld = p->v_ld = W;
    p->q_bstride = p->k_bstride = p->v_bstride = (size_t)a->T * W;
    p->proj_ld = W;
    p->kv_heads = G;
    if (attn_positions[scheme].where == ATTN_PE_ROTARY) {
        /* the rotated query and key roles (one copy when they are one block), and their gradients */
        static float *buf;
        static size_t cap;
        int same = attn_symmetric(ATTN_VARIANT);
        size_t nq = (size_t)a->B * a->T * C, nk = same ? 0 : (size_t)a->B * a->T * kvC;
        float *rq = grown(&buf, &cap, 2 * (nq + nk)), *rk = same ? rq : rq + nq;
        int rows = a->B * a->T;
        rope_rows(rq, C, proj + qo, W, rows, a->T, a->H, a->hd, pos->rope, 0);
        if (!same) rope_rows(rk, kvC, proj + ko, W, rows, a->T, G, a->hd, pos->rope, 0);
        p->rope = pos->rope;
        p->q = rq;
        p->k = rk;
        p->q_ld = C;
        p->k_ld = same ? C : kvC;
        p->q_bstride = (size_t)a->T * C;
        p->k_bstride = (size_t)a->T * p->k_ld;
        if (dproj) {
            p->rope_dq = rq + nq + nk;
            p->rope_dk = same ? p->rope_dq : p->rope_dq + nq;
            memset(p->rope_dq, 0, (nq + nk) * sizeof(float));
            p->dq_proj = dproj + qo;
            p->dk_proj = dproj + ko;
            p->dq = p->rope_dq;
            p->dk = p->rope_dk;
        }
    }
    if (attn_positions[scheme].where == ATTN_PE_BIAS) {
        p->pe_bias = bias_table(pos, a->H, a->T, a->causal);
        p->pe_nd = 2 * a->T - 1;
    }
    p->out = out;
    p->dout = dout;
    p->o_ld = C;
    p->o_bstride = (size_t)a->T * C;
    p->lse = lse;
    p->padf = pad_floats(a->key_pad, a->B, a->T);
    p->dropout = a->dropout;
    p->drop_thr = (uint32_t)(a->dropout * 16777216.0f);
    p->seed = a->seed;
    p->batch_first = dropout_batch_first();
    if (ATTN_POS) pos_prepare(p, pos, a->T);
}

void attention_forward(float *out, float *lse, const float *proj, const AttnPos *pos, const AttnArgs *a) {
    KPROF_OP();
    Problem p;
    self_problem(&p, "attention_forward", out, lse, proj, NULL, NULL, pos, a);
    run_forward(&p);
}

void attention_backward(float *dproj, AttnPosGrad *dpos, const float *dout, const float *proj,
                        const float *out, const float *lse, const AttnPos *pos, const AttnArgs *a) {
    KPROF_OP();
    Problem p;
    if (!dproj || !dout) FATAL("attention_backward: NULL gradient buffer");
    if (ATTN_POS && (!dpos || !dpos->dw || !dpos->db))
        FATAL("attention_backward: +Pos is configured but no positional gradient buffers given");
    self_problem(&p, "attention_backward", (float *)out, (float *)lse, proj, dproj, dout, pos, a);
    static float *acc;
    static size_t cap;
    if (ATTN_POS) {
        size_t n = (size_t)a->B * a->H * (2 + 2 * (size_t)a->T);
        p.pos_acc = grown(&acc, &cap, n);
        memset(p.pos_acc, 0, n * sizeof(float));
    }
    int rel = pos && pos->scheme == ATTN_POSITION_REL_BIAS;
    if (rel) {
        if (!dpos || !dpos->drel) FATAL("attention_backward: relative bias without its gradient buffer");
        static float *racc;
        static size_t rcap;
        size_t n = (size_t)a->B * a->H * p.pe_nd;
        p.rel_acc = grown(&racc, &rcap, n);
        memset(p.rel_acc, 0, n * sizeof(float));
    }
    run_backward(&p);
    if (ATTN_POS) pos_reduce(&p, pos, dpos);
    if (rel) /* each offset's sum over the batch, into its bucket (fixed order) */
        for (int h = 0; h < a->H; h++)
            for (int d = -(a->T - 1); d <= a->T - 1; d++) {
                double sum = 0.0;
                for (int b = 0; b < a->B; b++) sum += p.rel_acc[((size_t)b * a->H + h) * p.pe_nd + d + a->T - 1];
                int k = attn_rel_bucket(d, a->causal, pos->rel_buckets, pos->rel_max_distance);
                dpos->drel[(size_t)h * pos->rel_buckets + k] += (float)sum;
            }
    if (p.rope) { /* the roles' gradients rotated back: d proj += R^T d(rotated) */
        int C = a->H * a->hd, G = p.kv_heads, rows = a->B * a->T;
        rope_rows(p.dq_proj, p.proj_ld, p.rope_dq, C, rows, a->T, a->H, a->hd, p.rope, 1);
        if (p.rope_dk != p.rope_dq)
            rope_rows(p.dk_proj, p.proj_ld, p.rope_dk, G * a->hd, rows, a->T, G, a->hd, p.rope, 1);
    }
}

static void cross_problem(Problem *p, const char *op, float *out, float *lse, const float *q, const float *kv,
                          float *dq, float *dkv, const float *dout, const CrossAttnArgs *a) {
    attn_check_args(op, a->B, a->Tq, a->Tk, a->H, a->hd, a->dropout);
    if (!q || !kv || !out || !lse) FATAL("%s: NULL buffer", op);
    int C = a->H * a->hd;
    memset(p, 0, sizeof *p);
    p->B = a->B;
    p->Tq = a->Tq;
    p->Tk = a->Tk;
    p->H = a->H;
    p->hd = a->hd;
    p->group = 1; /* cross-attention keeps one K/V head per query head */
    p->scale = 1.0f / sqrtf((float)a->hd);
    p->q = q;
    p->k = kv;
    p->v = kv + C;
    if (dq) {
        p->dq = dq;
        p->dk = dkv;
        p->dv = dkv + C;
    }
    p->q_ld = C;
    p->k_ld = p->v_ld = 2 * C;
    p->q_bstride = (size_t)a->Tq * C;
    p->k_bstride = p->v_bstride = (size_t)a->Tk * 2 * C;
    p->out = out;
    p->dout = dout;
    p->o_ld = C;
    p->o_bstride = (size_t)a->Tq * C;
    p->lse = lse;
    p->padf = pad_floats(a->key_pad, a->B, a->Tk);
    p->dropout = a->dropout;
    p->drop_thr = (uint32_t)(a->dropout * 16777216.0f);
    p->seed = a->seed;
    p->batch_first = dropout_batch_first();
}

void cross_attention_forward(float *out, float *lse, const float *q, const float *kv, const CrossAttnArgs *a) {
    KPROF_OP();
    Problem p;
    cross_problem(&p, "cross_attention_forward", out, lse, q, kv, NULL, NULL, NULL, a);
    run_forward(&p);
}

void cross_attention_backward(float *dq, float *dkv, const float *dout, const float *q, const float *kv,
                              const float *out, const float *lse, const CrossAttnArgs *a) {
    KPROF_OP();
    Problem p;
    if (!dq || !dkv || !dout) FATAL("cross_attention_backward: NULL gradient buffer");
    cross_problem(&p, "cross_attention_backward", (float *)out, (float *)lse, q, kv, dq, dkv, dout, a);
    run_backward(&p);
}

/* ------------------------------------------------------------------ decoding */

void attention_decode(float *out, const float *q, int q_ld, const float *keys, const float *values, int T, int t,
                      int N, int H, int hd, int kv_heads, const AttnPos *pos) {
    KPROF_OP();
    int scheme = attn_check_decode(pos, q_ld, T, t, N, H, hd, kv_heads);
    int C = H * hd, G = attn_kv_count(H, kv_heads);
    int kvC = G * hd, group = H / G;
    int n = t + 1;
    int rope = attn_positions[scheme].where == ATTN_PE_ROTARY;
    /* position bias of (t, j): the table's row t (causal) */
    const float *bias = attn_positions[scheme].where == ATTN_PE_BIAS ? bias_table(pos, H, n, 1) : NULL;
    float scale = 1.0f / sqrtf((float)hd);
    size_t per = (size_t)n + (rope ? (size_t)hd : 0);
    float *ws = workspace(per * omp_get_max_threads());
#pragma omp parallel for schedule(static)
    for (int task = 0; task < N * H; task++) {
        int r = task / H, h = task % H;
        float *s = ws + per * omp_get_thread_num();
        const float *qh = q + (size_t)r * q_ld + (size_t)h * hd;
        size_t kvo = (size_t)r * T * kvC + (size_t)(h / group) * hd; /* this query head's K/V head */
        const float *kh = keys + kvo, *vh = values + kvo;
        if (rope) {
            /* the cache holds unrotated rows (in K and KV tying they are also the values): rotate the query by
             * R_t and each cached key by R_j as it is read, s_j = scale * (R_j k_j) . (R_t q) */
            float *qr = s + n;
            const float *ct = pos->rope + (size_t)t * hd;
            for (int k = 0; k < hd / 2; k++) rope_pair(ct + 2 * k, qh[2 * k], qh[2 * k + 1], &qr[2 * k], &qr[2 * k + 1]);
            for (int j = 0; j < n; j++) {
                const float *cj = pos->rope + (size_t)j * hd, *kj = kh + (size_t)j * kvC;
                float acc = 0.0f;
                for (int k = 0; k < hd / 2; k++) {
                    float k0, k1;
                    rope_pair(cj + 2 * k, kj[2 * k], kj[2 * k + 1], &k0, &k1);
                    acc += qr[2 * k] * k0 + qr[2 * k + 1] * k1;
                }
                s[j] = scale * acc;
            }
        } else {
            /* s_j = scale * k_j . q for the cached rows j = 0..t */
            cblas_sgemv(CblasRowMajor, CblasNoTrans, n, hd, scale, kh, kvC, qh, 1, 0.0f, s, 1);
        }
        if (ATTN_POS) { /* alpha s_j + g(j) + f(t) + b, with this head's weights */
            int gi = pos->groups == 1 ? 0 : h, m = pos->m, c = attn_pos_channels(m), ci = attn_pos_query_channels(m);
            const float *w = pos->w + (size_t)gi * m;
            float alpha = 0.0f, ft = 0.0f;
            for (int k = 0; k < m; k++) alpha += w[k];
            for (int k = 0; k < ci; k++) ft += w[k] * pos->feat[(size_t)t * c + k];
            for (int j = 0; j < n; j++) {
                float g = 0.0f;
                for (int k = ci; k < m; k++) g += w[k] * pos->feat[(size_t)j * c + (k - ci)];
                s[j] = alpha * s[j] + g + ft + pos->b[gi];
            }
        }
        if (bias) {
            const float *bt = bias + (size_t)h * (2 * n - 1) + (size_t)(n - 1 - t);
            for (int j = 0; j < n; j++) s[j] += bt[j];
        }
        float mx = -INFINITY, sum = 0.0f;
        for (int j = 0; j < n; j++) mx = s[j] > mx ? s[j] : mx;
        for (int j = 0; j < n; j++) sum += (s[j] = vexpf(s[j] - mx));
        for (int j = 0; j < n; j++) s[j] /= sum;
        /* out_h = sum_j a_j v_j */
        cblas_sgemv(CblasRowMajor, CblasTrans, n, hd, 1.0f, vh, kvC, s, 1, 0.0f, out + (size_t)r * C + (size_t)h * hd, 1);
    }
}

/* ------------------------------------------------------------------ dense views */

void attention_scores(float *S, const float *proj, const AttnPos *pos, const AttnArgs *a, int b, int h) {
    KPROF_OP();
    Problem p;
    float dummy;
    self_problem(&p, "attention_scores", &dummy, &dummy, proj, NULL, NULL, pos, a);
    if (b < 0 || b >= a->B || h < 0 || h >= a->H) FATAL("attention_scores: (b, h) = (%d, %d) out of range", b, h);
    int T = a->T;
    const float *Q = p.q + b * p.q_bstride + (size_t)h * p.hd;
    const float *K = p.k + b * p.k_bstride + kv_off(&p, h);
    if (attn_symmetric(ATTN_VARIANT))
        scores_symmetric(&p, K, S);
    else
        scores_block(&p, Q, K, 0, T, T, S, T);
    if (uses_pos(&p)) {
        int gi = pos_group(&p, h);
        for (int i = 0; i < T; i++)
            for (int j = 0; j < T; j++)
                S[(size_t)i * T + j] = p.alpha[gi] * S[(size_t)i * T + j] + p.g[(size_t)gi * T + j] +
                                       p.f[(size_t)gi * T + i] + p.bias[gi];
    }
    for (int i = 0; p.pe_bias && i < T; i++) {
        const float *bt = bias_row(&p, h, i);
        for (int j = 0; j < T; j++) S[(size_t)i * T + j] += bt[j];
    }
}

void attention_probs(float *A, const float *proj, const AttnPos *pos, const AttnArgs *a, int b, int h) {
    KPROF_OP();
    Problem p;
    self_problem(&p, "attention_probs", A, A, proj, NULL, NULL, pos, a);
    if (b < 0 || b >= a->B || h < 0 || h >= a->H) FATAL("attention_probs: (b, h) = (%d, %d) out of range", b, h);
    float *lse = xmalloc((size_t)a->T * sizeof(float));
    for (int r0 = 0; r0 < a->T; r0 += row_block(&p)) {
        int rows = a->T - r0 < row_block(&p) ? a->T - r0 : row_block(&p);
        int kmax = probs_block(&p, b, h, r0, rows, A + (size_t)r0 * a->T, lse, 0);
        for (int r = 0; r < rows; r++) /* keys beyond the block's reach are masked */
            memset(A + (size_t)(r0 + r) * a->T + kmax, 0, (size_t)(a->T - kmax) * sizeof(float));
    }
    free(lse);
}
