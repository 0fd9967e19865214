/* mechint known-answer tests (catalogue section 6): hand-built matrices and
 * models with known answers for A1, A2, A3, A5, A6, A7, A8, A9, A10 and A11,
 * gauge invariance of the invariant metrics, and bad checkpoints. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "attention.h"
#include "common.h"
#include "kernels.h"
#include "mechint/linalg.h"
#include "mechint/probes.h"
#include "mechint/mechint.h"
#include "mechint/runner.h"
#include "rng.h"
#include "test.h"
#include "trainer.h"
#if IS_ENABLED(CONFIG_GPT2)
#include "gpt2/data.h"
#include "gpt2/model.h"
#endif

static double *gauss(Rng *g, int n, int m) {
    double *a = xmalloc((size_t)n * m * sizeof(double));
    for (int i = 0; i < n * m; i++) a[i] = rng_normal(g);
    return a;
}

/* ------------------------------------------------------------------ A1, A2, A3 */

static void test_weights(void) {
    Rng g = rng_seeded(5, 1);
    int d = 64, r = 16;
    double *W = gauss(&g, d, r), *W2 = gauss(&g, d, r);
    QKSymmetry q = qk_symmetry(W, W, d, r);
    CHECK(fabs(q.sigma_sym - 1) < 1e-9 && fabs(q.positivity - 1) < 1e-9 && q.psd_residual < 1e-6,
          "A2: M = W W^T has sigma_sym 1, positivity 1, psd residual 0 (%.3g %.3g %.3g)", q.sigma_sym, q.positivity,
          q.psd_residual);
    /* antisymmetric M = a b^T - b a^T from factors [a b] and [b -a] */
    double *Fa = xmalloc((size_t)d * 2 * sizeof(double)), *Fb = xmalloc((size_t)d * 2 * sizeof(double));
    for (int i = 0; i < d; i++) {
        Fa[i * 2] = W[i * r], Fa[i * 2 + 1] = W[i * r + 1];
        Fb[i * 2] = W[i * r + 1], Fb[i * 2 + 1] = -W[i * r];
    }
    q = qk_symmetry(Fa, Fb, d, 2);
    CHECK(fabs(q.sigma_sym + 1) < 1e-9, "A2: antisymmetric M has sigma_sym -1 (%.12f)", q.sigma_sym);
    double *Wq = gauss(&g, 768, 64), *Wk = gauss(&g, 768, 64);
    q = qk_symmetry(Wq, Wk, 768, 64);
    CHECK(fabs(q.sigma_sym) < 0.01 && fabs(q.sym_ratio - 0.708) < 0.01,
          "A2: independent Gaussian factors (768, 64): sigma_sym %.4f ~ 0, ratio %.3f ~ 0.708", q.sigma_sym, q.sym_ratio);
    free(Wq), free(Wk), free(Fa), free(Fb);

    /* A3: W_K = W_V R -> PK 1, tau 0; independent with r/d = 0.25 -> PK 0.25, tau ~ 0.866 */
    double *R = gauss(&g, r, r), *Wk2 = xmalloc((size_t)d * r * sizeof(double)), *Wo = gauss(&g, r, d);
    la_gemm(Wk2, W2, 0, R, 0, d, r, r);
    KVAlignment a = kv_alignment(W, Wk2, W2, Wo, d, r, d);
    CHECK(fabs(a.pk - 1) < 1e-9 && a.tau_qk < 1e-6 && a.tau_ov < 1e-6, /* residual norms via differences: ~sqrt(eps) */
          "A3: K = V R is exactly tieable (PK %.12f, tau_qk %.2g, tau_ov %.2g)", a.pk, a.tau_qk, a.tau_ov);
    double *Wq3 = gauss(&g, 256, 64), *Wk3 = gauss(&g, 256, 64), *Wv3 = gauss(&g, 256, 64), *Wo3 = gauss(&g, 64, 256);
    a = kv_alignment(Wq3, Wk3, Wv3, Wo3, 256, 64, 256);
    CHECK(fabs(a.pk - 0.25) < 0.03 && fabs(a.tau_qk - 0.866) < 0.03,
          "A3: independent K, V with r/d = 1/4: PK %.3f ~ 0.25, tau_qk %.3f ~ 0.866", a.pk, a.tau_qk);
    free(Wq3), free(Wk3), free(Wv3), free(Wo3);

    /* A1: W_Q = W_K = [I_k 0]^T -> erank k */
    int k = 5;
    double *E = xcalloc((size_t)d * r, sizeof(double)), s[16];
    for (int i = 0; i < k; i++) E[i * r + i] = 1.0;
    factored_svals(E, d, E, d, r, s);
    CHECK(fabs(la_erank(s, r) - k) < 1e-9, "A1: [I_5 0] circuits have effective rank 5 (%.12f)", la_erank(s, r));
    free(E), free(W), free(W2), free(R), free(Wk2), free(Wo);
}

/* Model-level invariance: a random gauge leaves A2 and A3 unchanged. */
static void test_gauge(void) {
    Rng g = rng_seeded(9, 1);
    int d = 32, r = 8, n = d + 1;
    double *Wq = gauss(&g, n, r), *Wk = gauss(&g, n, r), *Wv = gauss(&g, n, r), *Wo = gauss(&g, r, d);
    double *R = gauss(&g, r, r), *Rinv = xmalloc((size_t)r * r * sizeof(double)), *RinvT = xmalloc((size_t)r * r * sizeof(double));
    la_pinv(R, r, r, 1e-12, Rinv);
    for (int i = 0; i < r; i++)
        for (int j = 0; j < r; j++) RinvT[i * r + j] = Rinv[j * r + i];
    double *Wq2 = xmalloc((size_t)n * r * 8), *Wk2 = xmalloc((size_t)n * r * 8), *Wv2 = xmalloc((size_t)n * r * 8),
           *Wo2 = xmalloc((size_t)r * d * 8);
    la_gemm(Wk2, Wk, 0, R, 0, n, r, r);    /* W_K R */
    la_gemm(Wq2, Wq, 0, RinvT, 0, n, r, r); /* W_Q R^-T */
    double *S = gauss(&g, r, r), *Sinv = xmalloc((size_t)r * r * 8);
    la_pinv(S, r, r, 1e-12, Sinv);
    la_gemm(Wv2, Wv, 0, S, 0, n, r, r);  /* W_V S */
    la_gemm(Wo2, Sinv, 0, Wo, 0, r, r, d); /* S^-1 W_O */
    QKSymmetry a = qk_symmetry(Wq, Wk, n, r), b = qk_symmetry(Wq2, Wk2, n, r);
    KVAlignment c = kv_alignment(Wq, Wk, Wv, Wo, n, r, d), e = kv_alignment(Wq2, Wk2, Wv2, Wo2, n, r, d);
    CHECK(fabs(a.sigma_sym - b.sigma_sym) < 1e-8 && fabs(a.positivity - b.positivity) < 1e-8 &&
              fabs(a.psd_residual - b.psd_residual) < 1e-8,
          "gauge W_Q R^-T, W_K R: A2 unchanged (%.10f vs %.10f)", a.sigma_sym, b.sigma_sym);
    CHECK(fabs(c.pk - e.pk) < 1e-8 && fabs(c.tau_qk - e.tau_qk) < 1e-8 && fabs(c.tau_ov - e.tau_ov) < 1e-8,
          "gauge on K and on V/O: A3 PK and tieability unchanged (%.10f vs %.10f, %.10f vs %.10f)", c.pk, e.pk,
          c.tau_qk, e.tau_qk);
    free(Wq), free(Wk), free(Wv), free(Wo), free(R), free(Rinv), free(RinvT), free(Wq2), free(Wk2), free(Wv2);
    free(Wo2), free(S), free(Sinv);
}

/* ------------------------------------------------------------------ A5, A6, A7 */

static void test_positional_and_hodge(void) {
    for (int n = 8; n <= 64; n *= 8) { /* previous-token logits */
        double *Lg = xcalloc((size_t)n * n, sizeof(double));
        for (int i = 1; i < n; i++) Lg[i * n + i - 1] = 3.0;
        Hodge h = hodge(Lg, n);
        double want = 1.0 - 2.0 / (n * (n - 1.0));
        CHECK(fabs(h.kappa - want) < 1e-9, "A7: previous-token logits, n %d: kappa %.9f = 1 - 2/(n(n-1)) %.9f", n,
              h.kappa, want);
        free(Lg);
    }
    Rng g = rng_seeded(3, 1);
    int n = 12;
    double *K = gauss(&g, n, 3), *Lg = xmalloc((size_t)n * n * 8), *A = xmalloc((size_t)n * n * 8);
    double f[12], gg[12];
    for (int i = 0; i < n; i++) f[i] = rng_normal(&g), gg[i] = rng_normal(&g);
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) {
            double s = 0;
            for (int c = 0; c < 3; c++) s += K[i * 3 + c] * K[j * 3 + c];
            Lg[i * n + j] = s + f[i] + gg[j];
        }
    Hodge h = hodge(Lg, n);
    CHECK(h.kappa < 1e-12 && h.curl_share < 1e-12 && h.antisym_share > 1e-3,
          "A7: symmetric + f(i) + g(j) is asymmetric (%.3f) but has no curl (kappa %.2g)", h.antisym_share, h.kappa);
    for (int i = 0; i < n; i++) { /* softmax rows of symmetric logits + key prior: reversible */
        double z = 0;
        for (int j = 0; j < n; j++) z += exp(Lg[i * n + j] - f[i]);
        for (int j = 0; j < n; j++) A[i * n + j] = exp(Lg[i * n + j] - f[i]) / z;
    }
    CHECK(reversibility(A, n) < 1e-9, "A7: symmetric logits + key prior give a reversible chain (%.2g)", reversibility(A, n));
    free(K), free(Lg), free(A);

    /* A5: one-hot shift kernel beta at offset -1 */
    n = 16;
    double *Kp = xcalloc((size_t)n * n, sizeof(double)), prof[64];
    for (int i = 1; i < n; i++) Kp[i * n + i - 1] = 5.0;
    PosKernel p = pos_kernel_metrics(Kp, n, 1, prof);
    CHECK(p.argmax_offset == -1 && fabs(p.mu_prev - 5.0) < 1e-9 && fabs(p.toeplitz - 1.0) < 1e-9,
          "A5: shift kernel: argmax offset %d, mu_prev %.6f = beta, Toeplitz %.6f", p.argmax_offset, p.mu_prev, p.toeplitz);
    for (int i = 0; i < n; i++) /* symmetric PSD Toeplitz kernel: self beats previous */
        for (int j = 0; j < n; j++) Kp[i * n + j] = exp(-0.5 * (i - j) * (i - j));
    p = pos_kernel_metrics(Kp, n, 1, prof);
    CHECK(p.mu_prev <= 0 && p.min_eig > -1e-9, "A5: PSD Toeplitz kernel: mu_prev %.4f <= 0", p.mu_prev);
    free(Kp);

    /* A6: the reference P is separable: no interaction energy */
    int ms[3] = {10, 20, 50};
    for (int t = 0; t < 3; t++) {
        int m = ms[t];
        n = 24;
        double *w = gauss(&g, 1, m), *P = xmalloc((size_t)m * 8), *B = xmalloc((size_t)n * n * 8);
        for (int i = 0; i < n; i++)
            for (int j = 0; j < n; j++) {
                attn_pos_entry(P, i, j, m);
                double v = 0.3;
                for (int c = 0; c < m; c++) v += w[c] * P[c];
                B[i * n + j] = v;
            }
        BiasParts bp = bias_parts(B, n, 0);
        CHECK(bp.e_int < 1e-12 && bp.curl < 1e-12, "A6: reference P, m %d: interaction energy %.2g, curl %.2g", m,
              bp.e_int, bp.curl);
        for (int i = 0; i < n; i++) /* relative encoding: Toeplitz, not separable */
            for (int j = 0; j < n; j++) {
                attn_pos_entry(P, i - j + n, 0, m);
                double v = 0.0;
                for (int c = 0; c < m; c++) v += w[c] * P[c];
                B[i * n + j] = v;
            }
        bp = bias_parts(B, n, 0);
        CHECK(fabs(bp.toeplitz - 1) < 1e-9 && bp.e_int > 0.05, "A6: relative P, m %d: Toeplitz %.9f, E_int %.3f", m,
              bp.toeplitz, bp.e_int);
        free(w), free(P), free(B);
    }
}

/* ------------------------------------------------------------------ A8 on a hand-built induction model */

/* Two attention-only layers over residual blocks [tok | pos | prev]: layer 0
 * attends to the previous position and writes its token into prev; layer 1
 * matches the current token against prev and so attends to the position
 * after the earlier occurrence (catalogue A8). */
static void test_detectors(void) {
    enum { V = 40, N = 16, n = 2 * N };
    double beta = 30.0;
    Rng g = rng_seeded(7, 1);
    int tok[n];
    int perm[V];
    for (int i = 0; i < V; i++) perm[i] = i;
    for (int i = V - 1; i > 0; i--) {
        int j = (int)rng_below(&g, (uint64_t)i + 1), t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    for (int t = 0; t < N; t++) tok[t] = tok[t + N] = perm[t];
    double *A0 = xcalloc((size_t)n * n, 8), *A1 = xcalloc((size_t)n * n, 8);
    int prev_tok[n];
    for (int i = 0; i < n; i++) { /* layer 0: s_ij = beta [j == i-1], causal */
        double z = 0;
        for (int j = 0; j <= i; j++) z += exp(beta * (j == i - 1) - beta);
        for (int j = 0; j <= i; j++) A0[i * n + j] = exp(beta * (j == i - 1) - beta) / z;
        prev_tok[i] = i > 0 ? tok[i - 1] : -1; /* OV copies the attended token (A0 is one-hot up to e^-30) */
    }
    for (int i = 0; i < n; i++) { /* layer 1: s_ij = beta [tok_i == prev_tok_j] */
        double z = 0;
        for (int j = 0; j <= i; j++) z += exp(beta * (tok[i] == prev_tok[j]) - beta);
        for (int j = 0; j <= i; j++) A1[i * n + j] = exp(beta * (tok[i] == prev_tok[j]) - beta) / z;
    }
    HeadScores h0 = head_scores(A0, n, 1, NULL);
    CHECK(fabs(h0.prev - 1.0) < 1e-6, "A8: the hand-built layer-0 head is previous-token (prev %.6f)", h0.prev);
    double ind = induction_score(A1, n, N);
    CHECK(fabs(ind - 1.0) < 1e-6 && !strcmp(head_label(0, ind, 0, 0), "induction"),
          "A8: the hand-built layer-1 head is an induction head (score %.6f)", ind);
    CHECK(induction_score(A0, n, N) < 1e-6 && !strcmp(head_label(h0.prev, induction_score(A0, n, N), h0.self, h0.sink),
                                                       "previous-token"),
          "A8: the previous-token head is not called induction");
    /* a uniform causal head: prev = mean_{i>=1} 1/(i+1) exactly */
    double want = 0;
    for (int i = 1; i < n; i++) want += 1.0 / (i + 1) / (n - 1);
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) A0[i * n + j] = j <= i ? 1.0 / (i + 1) : 0.0;
    HeadScores u = head_scores(A0, n, 1, NULL);
    CHECK(fabs(u.prev - want) < 1e-12, "A8: uniform head prev %.12f = mean 1/(i+1) %.12f", u.prev, want);
    free(A0), free(A1);
}

/* ------------------------------------------------------------------ grouped K/V heads */

/* A hand-built layer with 4 query heads and 2 K/V heads (raw weights, no bias): query head h is a copy of K/V
 * head h/2's key rows, so with the right grouping every W_QK = W_K W_K^T is symmetric PSD (A2 sigma_sym 1,
 * PSD residual 0) and, with the value rows equal to the key rows (A3), PK = 1 and tau_QK = 0. Reading head h's
 * K/V from head h % 2 (or from a standard layout) breaks it for heads 1 and 2. */
static void test_grouped_heads(void) {
    if (attn_symmetric(ATTN_VARIANT)) return; /* KV and K have no grouped form */
    int H = 4, G = 2, r = 4, C = H * r, kvC = G * r, PW = attn_proj_width(ATTN_VARIANT, C, kvC);
    int qo = attn_block_offset(ATTN_VARIANT, attn_query_block(ATTN_VARIANT), C, kvC);
    int ko = attn_block_offset(ATTN_VARIANT, attn_key_block(ATTN_VARIANT), C, kvC);
    int vo = attn_block_offset(ATTN_VARIANT, attn_value_block(ATTN_VARIANT), C, kvC);
    float *W = xcalloc((size_t)(PW + C) * C, sizeof(float));
    Rng g = rng_seeded(5, 1);
    for (size_t k = 0; k < (size_t)(PW + C) * C; k++) W[k] = (float)rng_normal(&g);
    for (int h = 0; h < H; h++) /* q rows of head h = k rows of K/V head h / 2 */
        memcpy(W + (size_t)(qo + h * r) * C, W + (size_t)(ko + h / 2 * r) * C, (size_t)r * C * sizeof(float));
    if (vo != ko) memcpy(W + (size_t)vo * C, W + (size_t)ko * C, (size_t)kvC * C * sizeof(float)); /* V = K */
    BlockParams bp = {.attnw = 0, .projw = (size_t)PW * C};
    int causal = 0;
    ModelSource src = {.params = W, .bp = &bp, .L = 1, .H = H, .C = C, .variant = ATTN_VARIANT, .kv_heads = G,
                       .post_ln = 1, .causal = &causal};
    Model m;
    model_build(&m, "gpt2", &src);
    CHECK(m.kv_heads == G, "model_build keeps the K/V head count (%d)", m.kv_heads);
    int same = 1;
    for (int h = 0; h < H; h++)
        for (int i = 0; i < C; i++)
            for (int c = 0; c < r; c++) /* Wk is (d+1) x r: row i, column c = weight row (ko + (h/2) r + c), input i */
                same &= m.layer[0].head[h].Wk[(size_t)i * r + c] == W[(size_t)(ko + h / 2 * r + c) * C + i];
    CHECK(same, "grouped heads: head h reads the key rows of K/V head h / (H/G)");
    cJSON *sym = analysis_qk_symmetry(&m), *al = analysis_kv_alignment(&m);
    double worst = 0.0, worst_pk = 0.0;
    for (int h = 0; h < H; h++) {
        cJSON *c = cJSON_GetArrayItem(cJSON_GetArrayItem(cJSON_GetObjectItem(sym, "per_head"), 0), h);
        cJSON *a = cJSON_GetArrayItem(cJSON_GetArrayItem(cJSON_GetObjectItem(al, "per_head"), 0), h);
        worst = fmax(worst, fabs(cJSON_GetObjectItem(c, "sigma_sym")->valuedouble - 1.0));
        worst = fmax(worst, fabs(cJSON_GetObjectItem(c, "psd_residual")->valuedouble));
        worst_pk = fmax(worst_pk, fabs(cJSON_GetObjectItem(a, "pk")->valuedouble - 1.0));
        worst_pk = fmax(worst_pk, fabs(cJSON_GetObjectItem(a, "tau_qk")->valuedouble));
    }
    CHECK(worst < 1e-6, "A2 on grouped heads: every W_Q = W_K of its group gives sigma_sym 1, PSD residual 0 "
          "(worst %.3g)", worst);
    CHECK(worst_pk < 1e-6, "A3 on grouped heads: V = K of the group gives PK 1, tau_QK 0 (worst %.3g)", worst_pk);
    cJSON_Delete(sym), cJSON_Delete(al);
    model_free(&m);
    free(W);
}

/* ------------------------------------------------------------------ A9 */

/* A9 against the explicit d x d products, the Gaussian value 1/sqrt(d), and a hand-built two-layer circuit over
 * residual blocks [tok | prev | out] (40 each): layer 0's OV copies tok into prev, layer 1's QK matches tok (query)
 * against prev (key) and its OV copies tok into out. So layer 0 K-composes into layer 1 with CS_K = 1/sqrt(40)
 * (catalogue A9's 0.1581) and writes where layer 1's keys read (PK_K = 1), while Q- and V-composition and their
 * overlaps are exactly 0. */
static double cs_explicit(const double *U1, const double *V1, const double *U2, const double *V2, int n, int r) {
    double *A = xmalloc((size_t)n * n * 8), *B = xmalloc((size_t)n * n * 8), *AB = xmalloc((size_t)n * n * 8);
    la_gemm(A, U1, 0, V1, 1, n, r, n);
    la_gemm(B, U2, 0, V2, 1, n, r, n);
    la_gemm(AB, A, 0, B, 0, n, n, n);
    double cs = sqrt(la_frob2(AB, n * n) / (la_frob2(A, n * n) * la_frob2(B, n * n)));
    free(A), free(B), free(AB);
    return cs;
}

static double item_num(const cJSON *o, const char *a, const char *b) {
    const cJSON *c = cJSON_GetObjectItem(cJSON_GetObjectItem(o, a), b);
    return cJSON_IsNumber(c) ? c->valuedouble : NAN;
}

static double mode_at(const cJSON *o, const char *mode, const char *what, int p1, int p2) {
    const cJSON *mx = cJSON_GetObjectItem(cJSON_GetObjectItem(cJSON_GetObjectItem(o, "modes"), mode), what);
    const cJSON *c = cJSON_GetArrayItem(cJSON_GetArrayItem(mx, p1), p2);
    return cJSON_IsNumber(c) ? c->valuedouble : NAN;
}

/* A model of L layers x H heads of Gaussian weights (bias rows too: they must not count); free with free_random. */
static Model random_model(Rng *g, int L, int H, int d, int r, Layer *layers, Head *heads) {
    for (int l = 0; l < L; l++) {
        snprintf(layers[l].name, sizeof layers[l].name, "h.%d", l);
        layers[l].head = heads + l * H;
        for (int h = 0; h < H; h++)
            heads[l * H + h] = (Head){gauss(g, d + 1, r), gauss(g, d + 1, r), gauss(g, d + 1, r), gauss(g, r, d)};
    }
    return (Model){.family = "gpt2", .L = L, .H = H, .d = d, .r = r, .kv_heads = H, .layer = layers};
}

static void free_random(Model *m) {
    for (int p = 0; p < m->L * m->H; p++) {
        Head *hd = &m->layer[p / m->H].head[p % m->H];
        free((void *)hd->Wq), free((void *)hd->Wk), free((void *)hd->Wv), free((void *)hd->Wo);
    }
}

static void test_composition(void) {
    Rng g = rng_seeded(9, 1);
    Layer rl[2];
    Head rh[4];
    Model rm = random_model(&g, 2, 2, 12, 3, rl, rh);
    cJSON *o = analysis_composition(&rm, 3);
    double worst = 0;
    for (int h1 = 0; h1 < 2; h1++)
        for (int h2 = 0; h2 < 2; h2++) {
            const Head *a = &rh[h1], *b = &rh[2 + h2];
            double *WoTa = xmalloc(12 * 3 * 8), *WoTb = xmalloc(12 * 3 * 8);
            for (int i = 0; i < 3; i++)
                for (int j = 0; j < 12; j++) WoTa[j * 3 + i] = a->Wo[i * 12 + j], WoTb[j * 3 + i] = b->Wo[i * 12 + j];
            double want[3] = {cs_explicit(a->Wv, WoTa, b->Wq, b->Wk, 12, 3), cs_explicit(a->Wv, WoTa, b->Wk, b->Wq, 12, 3),
                              cs_explicit(a->Wv, WoTa, b->Wv, WoTb, 12, 3)};
            for (int k = 0; k < 3; k++) {
                double got = mode_at(o, (const char *[]){"q", "k", "v"}[k], "cs", h1, 2 + h2);
                worst = isfinite(got) ? fmax(worst, fabs(got - want[k]) / want[k]) : INFINITY;
            }
            free(WoTa), free(WoTb);
        }
    CHECK(worst < 1e-12, "A9 on random heads: every score equals the one of the explicit d x d products, bias rows "
          "left out (worst relative difference %.2g)", worst);
    cJSON_Delete(o);
    /* heads that write nothing (W_O = 0): layer 0's head 1 has no scores, layer 1's head 1 no V score; each mode's
     * mean is over the pairs it has a score for */
    memset((void *)rh[1].Wo, 0, 3 * 12 * sizeof(double));
    memset((void *)rh[3].Wo, 0, 3 * 12 * sizeof(double));
    o = analysis_composition(&rm, 3);
    double want_k = (mode_at(o, "k", "cs", 0, 2) + mode_at(o, "k", "cs", 0, 3)) / 2;
    CHECK(item_num(o, "summary", "pairs") == 4 && item_num(o, "summary", "pairs_with_cs_k") == 2 &&
              item_num(o, "summary", "pairs_with_cs_v") == 1 && isnan(mode_at(o, "k", "cs", 1, 2)) &&
              isnan(mode_at(o, "v", "cs", 0, 3)) && fabs(item_num(o, "summary", "mean_cs_k") - want_k) < 1e-15 &&
              fabs(item_num(o, "summary", "mean_cs_v") - mode_at(o, "v", "cs", 0, 2)) < 1e-15,
          "A9: heads with W_O = 0 have no scores, and each mode's mean is over the pairs with one (K %g of 2, V %g "
          "of 1)", item_num(o, "summary", "pairs_with_cs_k"), item_num(o, "summary", "pairs_with_cs_v"));
    cJSON_Delete(o);
    free_random(&rm);
    /* random heads compose at 1/sqrt(d): the baseline of a model of that shape */
    Layer gl[2];
    Head gh[2];
    Model gm = random_model(&g, 2, 1, 768, 64, gl, gh);
    o = analysis_composition(&gm, 3);
    double base_q = item_num(cJSON_GetObjectItem(o, "modes"), "q", "baseline_mean");
    CHECK(fabs(base_q - 0.0361) < 0.0005, "A9: Gaussian heads (d 768, r 64) compose at %.4f ~ 1/sqrt(768) = 0.0361",
          base_q);
    cJSON_Delete(o);
    free_random(&gm);

    enum { B = 40, D = 3 * B };
    double beta = 30.0;
    double *W[2][4];
    for (int l = 0; l < 2; l++)
        for (int k = 0; k < 4; k++) W[l][k] = xcalloc((size_t)(D + 1) * B, sizeof(double));
    for (int i = 0; i < B; i++) {
        W[0][0][(size_t)i * B + i] = 1.0;                 /* layer 0 Q, K: tok (not what is tested) */
        W[0][1][(size_t)i * B + i] = 1.0;
        W[0][2][(size_t)i * B + i] = 1.0;                 /* V reads tok */
        W[0][3][(size_t)i * D + B + i] = 1.0;             /* O (r x d) writes prev */
        W[1][0][(size_t)i * B + i] = beta;                /* Q reads tok */
        W[1][1][(size_t)(B + i) * B + i] = 1.0;           /* K reads prev */
        W[1][2][(size_t)i * B + i] = 1.0;                 /* V reads tok */
        W[1][3][(size_t)i * D + 2 * B + i] = 1.0;         /* O writes out */
    }
    Head heads[2];
    Layer layers[2] = {{.name = "h.0", .causal = 1, .head = &heads[0]}, {.name = "h.1", .causal = 1, .head = &heads[1]}};
    for (int l = 0; l < 2; l++) heads[l] = (Head){W[l][0], W[l][1], W[l][2], W[l][3]};
    Model m = {.family = "gpt2", .L = 2, .H = 1, .d = D, .r = B, .kv_heads = 1, .layer = layers};
    o = analysis_composition(&m, 3);
    double k = mode_at(o, "k", "cs", 0, 1), q = mode_at(o, "q", "cs", 0, 1), v = mode_at(o, "v", "cs", 0, 1);
    CHECK(fabs(k - 1 / sqrt(40.0)) < 1e-12 && q == 0 && v == 0,
          "A9: layer 0 K-composes into layer 1 at 1/sqrt(40) (%.6f), Q and V at exactly 0 (%g, %g)", k, q, v);
    double pk_k = mode_at(o, "k", "pk", 0, 1), pk_q = mode_at(o, "q", "pk", 0, 1), pk_v = mode_at(o, "v", "pk", 0, 1);
    CHECK(fabs(pk_k - 1) < 1e-12 && fabs(pk_q) < 1e-12 && fabs(pk_v) < 1e-12,
          "A9: layer 0 writes where layer 1's keys read (PK_K %.6f), not its queries or values (%g, %g)", pk_k, pk_q,
          pk_v);
    double zk = mode_at(o, "k", "z", 0, 1), zq = mode_at(o, "q", "z", 0, 1);
    CHECK(zk > 5 && zq < 0 && isnan(mode_at(o, "k", "cs", 1, 0)) && isnan(mode_at(o, "k", "cs", 0, 0)),
          "A9: K-composition stands out of the random baseline (z %.1f), Q-composition below it (z %.1f); no score "
          "backwards or within a layer", zk, zq);
    const cJSON *top = cJSON_GetArrayItem(cJSON_GetObjectItem(cJSON_GetObjectItem(o, "top_edges"), "k"), 0);
    CHECK(top && !strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(top, "from")), "h.0 h0") &&
              !strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(top, "to")), "h.1 h0") &&
              fabs(item_num(o, "summary", "max_z_k") - zk) < 1e-12 && item_num(o, "summary", "pairs") == 1,
          "A9: the top K edge is h.0 h0 -> h.1 h0, and the summary holds its z and one pair");
    cJSON *again = analysis_composition(&m, 3), *other = analysis_composition(&m, 4);
    char *a = cJSON_PrintUnformatted(o), *b = cJSON_PrintUnformatted(again);
    double base3 = item_num(cJSON_GetObjectItem(o, "modes"), "k", "baseline_mean"),
           base3_q = item_num(cJSON_GetObjectItem(o, "modes"), "q", "baseline_mean"),
           base4 = item_num(cJSON_GetObjectItem(other, "modes"), "k", "baseline_mean");
    CHECK(!strcmp(a, b) && base3 != base4 && mode_at(other, "k", "cs", 0, 1) == k,
          "A9: the same seed gives the same report, another seed another baseline (%.6f, %.6f), the same scores",
          base3, base4);
    free(a), free(b);
    cJSON_Delete(again), cJSON_Delete(other);
    cJSON_Delete(o);
    /* Q = K tied (the KV variant's pointers, the same in every head): the random heads are tied too, so W_QK is
     * symmetric in every draw and Q- and K-composition have one baseline (untied, each its own) */
    heads[0].Wq = heads[0].Wk;
    heads[1].Wq = heads[1].Wk;
    o = analysis_composition(&m, 3);
    double tied_q = item_num(cJSON_GetObjectItem(o, "modes"), "q", "baseline_mean"),
           tied_k = item_num(cJSON_GetObjectItem(o, "modes"), "k", "baseline_mean");
    CHECK(isfinite(tied_q) && tied_q == tied_k && base3_q != base3,
          "A9 with Q = K: a tied baseline, the same for Q and K (%.6f, %.6f; untied %.6f, %.6f)", tied_q, tied_k,
          base3_q, base3);
    cJSON_Delete(o);
    /* one layer, or layers of two stacks (encoder, decoder): nothing composes */
    layers[1].name[0] = 'x';
    o = analysis_composition(&m, 3);
    CHECK(cJSON_IsFalse(cJSON_GetObjectItem(o, "applies")), "A9: layers of two stacks are not paired");
    cJSON_Delete(o);
    for (int l = 0; l < 2; l++)
        for (int kk = 0; kk < 4; kk++) free(W[l][kk]);
}

/* ------------------------------------------------------------------ A10, A11 through the gpt2 runner */

#if IS_ENABLED(CONFIG_GPT2)
static char g_dir[256];

/* A checkpoint of a freshly initialised model (the test's own data set and
 * config); edit changes its parameters (a host copy, W) first. */
static void save_checkpoint(const char *path, void (*edit)(const GPT2 *m, float *W)) {
    Dataset ds;
    Err e;
    if (dataset_load(&ds, CONFIG_DATA_DIR, CONFIG_GPT2_BLOCK_SIZE, &e) != 0) FATAL("%s", e.msg);
    GPT2Config cfg = gpt2_config_from_kconfig(ds.V);
    GPT2 m;
    gpt2_init(&m, &cfg, 11);
    if (edit) {
        float *W = params_to_host(&m.w, m.w.params);
        edit(&m, W);
        params_from_host(&m.w, m.w.params, W);
        free(W);
    }
    TrainRun t;
    memset(&t, 0, sizeof t);
    t.w = &m.w; /* before run_init, which sizes the ZeRO-1 slice from it (trainer.h) */
    run_init(&t, "gpt2", g_dir, "t", 1);
    t.dataset = ds.name, t.variant = attn_variant_id(ATTN_VARIANT, ATTN_POS), t.unit = "tokens";
    t.model_json = gpt2_config_json(&cfg);
    t.vocab_json = dataset_vocab_json(&ds);
    run_save_model(&t, path, 1.0);
    free(t.model_json), free(t.vocab_json);
    gpt2_free(&m);
    dataset_free(&ds);
}

static int zero_L, zero_H;
static void zero_head_output(const GPT2 *m, float *params) {
    int C = m->cfg.C, r = C / m->cfg.H;
    float *W = params + m->layer[zero_L].projw; /* (out C, in C): head h reads columns h*r.. */
    for (int j = 0; j < C; j++)
        for (int c = 0; c < r; c++) W[(size_t)j * C + zero_H * r + c] = 0.0f;
}

/* planted: each head's keys and values use only the first r/2 directions of its r channels */
static void plant(const GPT2 *m, float *params) {
    int C = m->cfg.C, H = m->cfg.H, r = C / H, P = attn_num_proj(ATTN_VARIANT);
    for (int l = 0; l < m->cfg.L; l++) { /* attention that matters: at initialisation its effect on the output is tiny */
        for (size_t k = 0; k < (size_t)P * C * C; k++) params[m->layer[l].attnw + k] *= 6.0f;
        for (size_t k = 0; k < (size_t)C * C; k++) params[m->layer[l].projw + k] *= 6.0f;
        /* +Pos scales the content scores by alpha = sum of the pos weights, random in sign and often near 0 at
         * initialisation: then the planted key directions hardly matter and no mask could find them. alpha = 1
         * makes them count as they do without +Pos; the key-position bias stays as initialised. */
        for (int g = 0; m->cfg.pos && g < m->cfg.pos_groups; g++) {
            float *w = params + m->layer[l].posw + (size_t)g * m->cfg.pos_m, alpha = 0.0f;
            for (int c = 0; c < m->cfg.pos_m; c++) alpha += w[c];
            for (int c = 0; c < m->cfg.pos_m; c++) w[c] += (1.0f - alpha) / (float)m->cfg.pos_m;
        }
    }
    for (int l = 0; l < m->cfg.L; l++)
        for (int p = 0; p < P; p++) {
            if (p != attn_key_block(ATTN_VARIANT) && p != attn_value_block(ATTN_VARIANT)) continue;
            for (int h = 0; h < H; h++)
                for (int c = r / 2; c < r; c++) {
                    size_t row = (size_t)p * C + (size_t)h * r + c;
                    memset(params + m->layer[l].attnw + row * C, 0, (size_t)C * sizeof(float));
                    if (m->cfg.attn_bias) params[m->layer[l].attnb + row] = 0.0f;
                }
        }
}

/* attention that matters (as plant's), and biases of the projections drawn from N(0, 0.1^2) */
static void bias_attention(const GPT2 *m, float *params) {
    int C = m->cfg.C, P = attn_num_proj(ATTN_VARIANT);
    Rng g = rng_seeded(17, 1);
    for (int l = 0; l < m->cfg.L; l++) {
        for (size_t k = 0; k < (size_t)P * C * C; k++) params[m->layer[l].attnw + k] *= 6.0f;
        for (size_t k = 0; m->cfg.attn_bias && k < (size_t)P * C; k++) params[m->layer[l].attnb + k] = 0.1f * (float)rng_normal(&g);
    }
}

/* The KL along mask m + h u, for the central differences below */
static double kl_at(Runner *r, const MaskPlan *p, void *ref, const double *m, const double *u, double h, double *mp,
                    double *junk, size_t nm) {
    for (size_t i = 0; i < nm; i++) mp[i] = m[i] + h * u[i];
    return mask_kl_grad(r, p, ref, 0, mp, junk);
}

/* The masks' KL gradient (what mask_train descends) against the KL's central differences along two random
 * directions, at masks away from 0 and 1. The model computes in float, so the step cannot be small (at 3e-4
 * float noise is 3e-4 of the derivative), and one difference at 1e-2 is 4.6% off from curvature: the
 * differences at 4e-3 and 2e-3 are combined (Richardson, (4 D(h/2) - D(h)) / 3), which cancels the curvature
 * term. Their difference is measured against the gradient's norm (a random direction's derivative can be
 * small by cancellation): at most 1.6e-4 of it measured in the attention test configurations; the bound is 1e-3. */
static void mask_gradient_check(Runner *r, const MaskPlan *p, void *ref) {
    size_t nm = (size_t)p->L * p->H * p->nroles * p->r;
    Rng g = rng_seeded(13, 1);
    double *m = xmalloc(nm * 8), *dm = xmalloc(nm * 8), *u = xmalloc(nm * 8), *mp = xmalloc(nm * 8), *junk = xmalloc(nm * 8);
    for (size_t i = 0; i < nm; i++) m[i] = 0.3 + 0.4 * rng_uniform(&g);
    mask_kl_grad(r, p, ref, 0, m, dm);
    double norm = sqrt(la_dot(dm, dm, (int)nm)); /* a direction's derivative is about this, whatever its signs */
    for (int dir = 0; dir < 2; dir++) {
        double analytic = 0.0, h = 4e-3, d[2];
        for (size_t i = 0; i < nm; i++) u[i] = rng_uniform(&g) < 0.5 ? -1.0 : 1.0, analytic += dm[i] * u[i];
        for (int s = 0; s < 2; s++, h /= 2)
            d[s] = (kl_at(r, p, ref, m, u, h, mp, junk, nm) - kl_at(r, p, ref, m, u, -h, mp, junk, nm)) / (2 * h);
        double numeric = (4 * d[1] - d[0]) / 3, err = fabs(analytic - numeric) / fmax(norm, 1e-12);
        printf("# A11 gradient, direction %d: %.9g analytic, %.9g from central differences (%.2g of its norm)\n", dir,
               analytic, numeric, err);
        CHECK(err < 1e-3 && fabs(numeric) > 1e-6, "A11: the masks' KL gradient against central differences along "
              "direction %d: %.6g vs %.6g (%.2g of the gradient's norm %.3g)", dir, analytic, numeric, err, norm);
    }
    mask_apply(p, NULL);
    free(m), free(dm), free(u), free(mp), free(junk);
}

/* A checkpoint saved as g_dir/<name>.safetensors after edit, opened with its model, mask plan and the reference
 * of one batch; 0 (and a failed check) when it does not open. masks_close frees what it made. */
static int masks_open(const char *name, void (*edit)(const GPT2 *m, float *W), Runner *r, Model *m, MaskPlan *p,
                      void **ref) {
    char path[512];
    Err e;
    snprintf(path, sizeof path, "%s/%s.safetensors", g_dir, name);
    save_checkpoint(path, edit);
    int opened = runner_open(r, path, 1, 1, 1, &e) == 0;
    CHECK(opened, "runner opens the %s checkpoint: %s", name, opened ? "" : e.msg);
    if (!opened) return 0;
    model_build(m, r->family, &r->src);
    mask_plan(p, m, r);
    *ref = mask_ref_new(r, 1);
    return 1;
}

static void masks_close(Runner *r, Model *m, MaskPlan *p, void *ref) {
    mask_ref_free(ref);
    mask_plan_free(p);
    model_free(m);
    runner_close(r);
}

static void test_runner(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/kvlab_test_mechint_%d", (int)getpid());
    char path[512];
    snprintf(path, sizeof path, "%s/zero.safetensors", g_dir);
    zero_L = CONFIG_GPT2_N_LAYER - 1, zero_H = 0;
    save_checkpoint(path, zero_head_output);
    Runner r;
    Err e;
    int opened = runner_open(&r, path, 1, 1, 1, &e) == 0;
    CHECK(opened, "runner opens a gpt2 checkpoint: %s", opened ? "" : e.msg);
    if (!opened) return;
    Model m;
    model_build(&m, r.family, &r.src);
    cJSON *ab = analysis_ablation(&r, &m, 1);
    cJSON *ph = cJSON_GetArrayItem(cJSON_GetArrayItem(cJSON_GetObjectItem(ab, "per_head"), zero_L), zero_H);
    double dz = cJSON_GetObjectItem(ph, "dloss_zero")->valuedouble, dm = cJSON_GetObjectItem(ph, "dloss_mean")->valuedouble;
    cJSON *other = cJSON_GetArrayItem(cJSON_GetArrayItem(cJSON_GetObjectItem(ab, "per_head"), 0), 0);
    CHECK(dz == 0.0 && dm == 0.0, "A10: a head with zero output projection has no ablation effect (%g, %g)", dz, dm);
    CHECK(cJSON_GetObjectItem(other, "dloss_zero")->valuedouble != 0.0, "A10: ablating another head does change the loss");
    cJSON_Delete(ab);
    if (m.kv_heads != m.H) { /* grouped K/V heads: A11 says it does not apply; the rest is the standard layout's */
        cJSON *mk = analysis_masks(&r, &m, 1, (double[]){0.5}, 1, 2, 0.1, 1);
        CHECK(cJSON_IsFalse(cJSON_GetObjectItem(mk, "applies")) && strstr(cJSON_GetStringValue(
                  cJSON_GetObjectItem(mk, "why")), "grouped"), "A11 does not apply to grouped K/V heads");
        cJSON_Delete(mk);
        int G = m.kv_heads, group = m.H / G, r_ = m.r, same = 1, C = m.d;
        int ko = attn_block_offset(ATTN_VARIANT, attn_key_block(ATTN_VARIANT), C, G * r_);
        float *W = params_to_host(r.w, r.w->params);
        const float *g1 = W + r.src.bp[0].ln1w; /* the folded gain (biases are 0 at initialisation) */
        for (int h = 0; h < m.H; h++)
            for (int i = 0; i < C; i++)
                for (int c = 0; c < r_; c++)
                    same &= fabs(m.layer[0].head[h].Wk[(size_t)i * r_ + c] -
                                 (double)W[r.src.bp[0].attnw + (size_t)(ko + h / group * r_ + c) * C + i] * g1[i]) < 1e-12;
        CHECK(same, "the runner's model: head h reads the key rows of K/V head h / %d", group);
        free(W);
        model_free(&m);
        runner_close(&r);
        char cmd[1024];
        snprintf(cmd, sizeof cmd, "rm -rf %s", g_dir);
        if (system(cmd) != 0) FATAL("cannot remove %s", g_dir);
        return;
    }
    /* R1: the initial (all-on) masks are exactly the model; all-off differs */
    MaskPlan p;
    mask_plan(&p, &m, &r);
    void *ref = mask_ref_new(&r, 1);
    size_t nm = (size_t)p.L * p.H * p.nroles * p.r;
    double *ones = xmalloc(nm * 8), *zeros = xcalloc(nm, 8);
    for (size_t i = 0; i < nm; i++) ones[i] = 1.0;
    MaskEval on = mask_evaluate(&r, &p, ones, ref), off = mask_evaluate(&r, &p, zeros, ref);
    CHECK(on.loss == mask_ref_loss(ref) && on.kl < 1e-7, /* KL against float probabilities */ "A11: all-on masks give the plain loss exactly (%.9f vs %.9f)",
          on.loss, mask_ref_loss(ref));
    CHECK(off.kl > 1e-4, "A11: all-off masks change the output (KL %.4g)", off.kl);
    free(ones), free(zeros);
    masks_close(&r, &m, &p, ref);

    /* the masks' gradient, with biases that take part (initialised biases are 0) */
    if (!masks_open("biased", bias_attention, &r, &m, &p, &ref)) return;
    mask_gradient_check(&r, &p, ref);
    masks_close(&r, &m, &p, ref);

    /* planted directions: masks at the planted fraction keep exactly them */
    if (!masks_open("planted", plant, &r, &m, &p, &ref)) return;
    nm = (size_t)p.L * p.H * p.nroles * p.r;
    double *hard = xmalloc(nm * 8), *planted = xmalloc(nm * 8);
    int R = p.r;
    for (size_t i = 0; i < nm; i++) planted[i] = p.sv[i] > 1e-6 * p.sv[i - i % R] ? 1.0 : 0.0; /* non-zero singular directions */
    (void)R;
    MaskEval only = mask_evaluate(&r, &p, planted, ref);
    double kept_target = 0.0;
    for (size_t i = 0; i < nm; i++) kept_target += planted[i] / nm;
    CHECK(only.kl < 1e-7, "A11: masking the zero-weight directions changes nothing (KL %.3g)", only.kl);
    double *none = xcalloc(nm, 8);
    MaskEval all_off = mask_evaluate(&r, &p, none, ref);
    free(none);
    CHECK(all_off.kl > 1e-2, "A11: the planted directions matter (KL with all off %.4f)", all_off.kl);
    /* the learned masks at the planted fraction keep the planted directions. Exactly (Jaccard 1) for every
     * variant with and without +Pos, except QKV: one weak planted direction out of ~500 was measured to trade
     * places with an unused one (Jaccard 0.999, KL 2e-5), so the bound is 0.99 (docs/mechint.md) */
    double *theta = xmalloc(nm * 8);
    mask_train(&r, &p, ref, kept_target, 150, 0.1, hard, theta);
    double inter = 0.0, uni = 0.0, mean_planted = 0.0, mean_zero = 0.0, np = 0.0;
    for (size_t i = 0; i < nm; i++) {
        inter += hard[i] * planted[i], uni += fmax(hard[i], planted[i]);
        if (planted[i] > 0.5) mean_planted += theta[i], np += 1.0;
        else mean_zero += theta[i];
    }
    mean_planted /= np > 0 ? np : 1, mean_zero /= nm - np > 0 ? nm - np : 1;
    double jac = uni > 0 ? inter / uni : 0.0;
    printf("# A11 planted: Jaccard %.4f, mean logit planted %.2f, unused %.2f\n", jac, mean_planted, mean_zero);
    /* Position schemes make the weakest planted directions weaker (docs/mechint.md): under RoPE the masked key
     * directions pass through the rotation, which mixes each channel pair of a head (KV+RoPE measured 0.984);
     * under ALiBi each head's distance penalty takes part of every score from the content (KV+ALiBi+Pos: 0.984,
     * no closer at 300 or 600 steps); the fixed sinusoidal table (RMS 0.7) dwarfs the initial token embeddings
     * (std 0.02), so the planted keys are mostly positional (KV tying+Sin: 0.978, KL 2.7e-4) */
    double bound = ATTN_POSITION == ATTN_POSITION_ROPE || ATTN_POSITION == ATTN_POSITION_ALIBI ? 0.98
                   : ATTN_POSITION == ATTN_POSITION_SINUSOIDAL                                 ? 0.97
                                                                                             : 0.99;
    double kl_bound = ATTN_POSITION == ATTN_POSITION_SINUSOIDAL ? 5e-4 : 1e-4;
    CHECK(jac >= bound, "A11: learned masks recover the planted directions (Jaccard %.4f, bound %.2f)", jac, bound);
    CHECK(mean_planted - mean_zero > 1.0, "A11: the masks learned it: planted logits %.2f above unused %.2f on average",
          mean_planted, mean_zero);
    MaskEval learned = mask_evaluate(&r, &p, hard, ref);
    CHECK(learned.kl < kl_bound, "A11: the learned mask is faithful (KL %.3g, bound %.0e, loss change %.3g)",
          learned.kl, kl_bound, learned.loss - mask_ref_loss(ref));
    free(theta);
    free(hard), free(planted);
    masks_close(&r, &m, &p, ref);

    /* bad files: one clear error each */
    snprintf(path, sizeof path, "%s/junk.safetensors", g_dir);
    FILE *f = fopen(path, "wb");
    fputs("this is not a checkpoint", f);
    fclose(f);
    CHECK(runner_open(&r, path, 1, 1, 1, &e) != 0 && strstr(e.msg, path), "a non-safetensors file is refused: %s", e.msg);
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "rm -rf %s", g_dir);
    if (system(cmd) != 0) FATAL("cannot remove %s", g_dir);
}
#endif

int main(void) {
    backend_init(1);
    test_weights();
    test_gauge();
    test_positional_and_hodge();
    test_detectors();
    test_grouped_heads();
    test_composition();
#if IS_ENABLED(CONFIG_GPT2)
    test_runner();
#endif
    return TEST_SUMMARY("test_mechint");
}
