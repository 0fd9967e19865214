/* A11: learned K/V channel masks, done faithfully (catalogue A11, R1-R5).
 *
 * A mask m in {0,1}^r per head and role lives in a gauge-fixed basis: for
 * the key role the key-side singular vectors of W_QK, for the value role the
 * value-side singular vectors of W_OV. Masking the role's projection W
 * ((d+1) x r with the bias row) is W' = W T(m) with
 *     T(m) = R^+ U diag(m) U^T R,   W = Q R (thin QR),
 * so that W_QK' (or W_OV') keeps exactly the singular directions m keeps;
 * T(1) = R^+ R leaves W unchanged. Roles follow the variant's sharing:
 * QKV masks K and V separately, KV masks the shared q=k projection and V,
 * KV tying and K have one projection to mask (one mask).
 * Optimisation: m = sigmoid(theta / tau), theta starting at +3 (all on, R1),
 * objective KL(p_full || p_masked) on held-out batches under the constraint
 * mean(m) <= c_t, c_t falling from 1 to the target kept fraction over the
 * first half of the steps (R2; its multiplier solved exactly each step as a
 * common shift of the logits), momentum steps on theta under one shared RMS
 * scale, tau annealed 1 -> 0.2, dropout off (R7). Reported with the hard mask at the target
 * (the largest logits): KL, loss change and faithfulness against random and
 * magnitude masks with the same count per head (R4). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "common.h"
#include "probes.h"
#include "kernels.h"
#include "linalg.h"
#include "rng.h"

static cJSON *num(double v) { return isfinite(v) ? cJSON_CreateNumber(v) : cJSON_CreateNull(); }

/* W (n x r) = Q R; A = R^+ U, Bm = U^T R for the basis U (r x r). */
static void basis_factors(const double *W, int n, int r, const double *U, double *A, double *Bm) {
    double *R = xmalloc((size_t)r * r * sizeof(double)), *Rp = xmalloc((size_t)r * r * sizeof(double));
    if (la_qr(W, n, r, NULL, R) != 0 || la_pinv(R, r, r, 1e-10, Rp) != 0) FATAL("mechint masks: QR/pinv failed");
    la_gemm(A, Rp, 0, U, 0, r, r, r);
    la_gemm(Bm, U, 1, R, 0, r, r, r);
    free(R), free(Rp);
}

/* Key-side singular basis of Wq Wk^T (both n x r): V of the middle R_q R_k^T = U S V^T, in Q_k coordinates.
 * Value-side basis of Wv Wo (Wv n x r, WoT d x r): U of R_v R_o^T. s gets the singular values. */
static void circuit_basis(const double *Wa, int na, const double *Wb, int nb, int r, int want_b_side, double *basis,
                          double *s) {
    double *Ra = xmalloc((size_t)r * r * sizeof(double)), *Rb = xmalloc((size_t)r * r * sizeof(double));
    double *M = xmalloc((size_t)r * r * sizeof(double)), *U = xmalloc((size_t)r * r * sizeof(double));
    double *Vt = xmalloc((size_t)r * r * sizeof(double));
    if (la_qr(Wa, na, r, NULL, Ra) != 0 || la_qr(Wb, nb, r, NULL, Rb) != 0) FATAL("mechint masks: QR failed");
    la_gemm(M, Ra, 0, Rb, 1, r, r, r);
    if (la_svd(M, r, r, U, s, Vt) != 0) FATAL("mechint masks: SVD failed");
    for (int i = 0; i < r; i++)
        for (int j = 0; j < r; j++) basis[(size_t)i * r + j] = want_b_side ? Vt[(size_t)j * r + i] : U[(size_t)i * r + j];
    free(Ra), free(Rb), free(M), free(U), free(Vt);
}

void mask_plan(MaskPlan *p, const Model *m, const Runner *run) {
    const ModelSource *src = &run->src;
    if (m->kv_heads != m->H) FATAL("mask_plan: grouped K/V heads (%d for %d query heads) have no per-head K/V masks",
                                   m->kv_heads, m->H);
    memset(p, 0, sizeof *p);
    int v = m->variant, r = m->r, d = m->d, n = d + 1;
    p->L = m->L, p->H = m->H, p->r = r, p->C = src->C;
    /* the key side of W_QK and the value side of W_OV: one block when the key is the value ("kv" when it is
     * not the query as well, as in KV tying; "k" when one projection plays every role) */
    p->nroles = attn_cache_tensors(v);
    p->role_block[0] = attn_key_block(v);
    p->role_name[0] = p->nroles == 2 || attn_symmetric(v) ? "k" : "kv";
    if (p->nroles == 2) p->role_block[1] = attn_value_block(v), p->role_name[1] = "v";
    size_t per = (size_t)p->L * p->H * p->nroles;
    p->A = xmalloc(per * r * r * sizeof(double));
    p->Bm = xmalloc(per * r * r * sizeof(double));
    p->sv = xmalloc(per * r * sizeof(double));
    double *basis = xmalloc((size_t)r * r * sizeof(double));
    double *WoT = xmalloc((size_t)d * r * sizeof(double));
    for (int l = 0; l < p->L; l++)
        for (int h = 0; h < p->H; h++) {
            const Head *hd = &m->layer[l].head[h];
            for (int ro = 0; ro < p->nroles; ro++) {
                size_t idx = ((size_t)l * p->H + h) * p->nroles + ro;
                const double *W;
                if (ro == 0) { /* key side of W_QK */
                    W = hd->Wk;
                    circuit_basis(hd->Wq, n, hd->Wk, n, r, 1, basis, p->sv + idx * r);
                } else { /* value side of W_OV */
                    W = hd->Wv;
                    for (int i = 0; i < r; i++)
                        for (int j = 0; j < d; j++) WoT[(size_t)j * r + i] = hd->Wo[(size_t)i * d + j];
                    circuit_basis(hd->Wv, n, WoT, d, r, 0, basis, p->sv + idx * r);
                }
                basis_factors(W, n, r, basis, p->A + idx * r * r, p->Bm + idx * r * r);
            }
        }
    free(basis), free(WoT);
    /* the raw projection rows and biases, restored before every application */
    p->dev_params = run->w->params;
    p->dev_grads = run->w->grads;
    p->bp = src->bp;
    p->attn_bias = src->attn_bias;
    size_t P = (size_t)attn_num_proj(v);
    p->raw_w = xmalloc((size_t)p->L * P * p->C * p->C * sizeof(float));
    p->raw_b = xmalloc((size_t)p->L * P * p->C * sizeof(float));
    for (int l = 0; l < p->L; l++) {
        memcpy(p->raw_w + (size_t)l * P * p->C * p->C, src->params + src->bp[l].attnw, P * p->C * p->C * sizeof(float));
        if (src->attn_bias)
            memcpy(p->raw_b + (size_t)l * P * p->C, src->params + src->bp[l].attnb, P * p->C * sizeof(float));
    }
    p->work_w = xmalloc(P * p->C * p->C * sizeof(float));
    p->work_b = xmalloc(P * p->C * sizeof(float));
    p->P = (int)P;
}

void mask_plan_free(MaskPlan *p) {
    free(p->A), free(p->Bm), free(p->sv), free(p->raw_w), free(p->raw_b), free(p->work_w), free(p->work_b);
    memset(p, 0, sizeof *p);
}

/* T = A diag(m) Bm into the role's rows of the parameter buffer (from the raw copy). NULL m: restore. */
void mask_apply(const MaskPlan *p, const double *mask) {
    int r = p->r, C = p->C, P = p->P;
    double *T = xmalloc((size_t)r * r * sizeof(double)), *Am = xmalloc((size_t)r * r * sizeof(double));
    double *Wd = xmalloc((size_t)r * C * sizeof(double)), *Td = xmalloc((size_t)r * C * sizeof(double));
    float *W = p->work_w, *b = p->work_b;
    for (int l = 0; l < p->L; l++) {
        const float *W0 = p->raw_w + (size_t)l * P * C * C, *b0 = p->raw_b + (size_t)l * P * C;
        memcpy(W, W0, (size_t)P * C * C * sizeof(float));
        if (p->attn_bias) memcpy(b, b0, (size_t)P * C * sizeof(float));
        for (int h = 0; mask && h < p->H; h++) /* no mask: the raw rows */
            for (int ro = 0; ro < p->nroles; ro++) {
                size_t idx = ((size_t)l * p->H + h) * p->nroles + ro;
                const double *m = mask + idx * r, *A = p->A + idx * r * r, *Bm = p->Bm + idx * r * r;
                int all_on = 1;
                for (int c = 0; c < r; c++) all_on &= m[c] == 1.0;
                if (all_on) continue; /* exactly the unmasked model (R1) */
                for (int a = 0; a < r; a++)
                    for (int k = 0; k < r; k++) Am[(size_t)a * r + k] = A[(size_t)a * r + k] * m[k];
                la_gemm(T, Am, 0, Bm, 0, r, r, r);
                size_t row0 = (size_t)p->role_block[ro] * C + (size_t)h * r; /* Linear rows (out, in) */
                for (size_t i = 0; i < (size_t)r * C; i++) Wd[i] = W0[row0 * C + i];
                la_gemm(Td, T, 1, Wd, 0, r, r, C); /* the new rows: T^T W0's rows */
                for (int c = 0; c < r; c++) {
                    float *dst = W + (row0 + c) * C;
                    for (int i = 0; i < C; i++) dst[i] = (float)Td[(size_t)c * C + i];
                    if (p->attn_bias) {
                        double acc = 0.0;
                        for (int a = 0; a < r; a++) acc += T[(size_t)a * r + c] * b0[row0 + a];
                        b[row0 + c] = (float)acc;
                    }
                }
            }
        dev_upload(p->dev_params + p->bp[l].attnw, W, (size_t)P * C * C * sizeof(float));
        if (p->attn_bias) dev_upload(p->dev_params + p->bp[l].attnb, b, (size_t)P * C * sizeof(float));
    }
    free(T), free(Am), free(Wd), free(Td);
}

/* d(objective)/d(m) from the parameter gradients of the masked rows:
 * dT = W0^T dW' (augmented), dm_c = (A^T dT Bm^T)_cc. */
static void mask_grad(const MaskPlan *p, double *dm) {
    int r = p->r, C = p->C, P = p->P;
    double *dT = xmalloc((size_t)r * r * sizeof(double)), *X = xmalloc((size_t)r * r * sizeof(double));
    double *Wd = xmalloc((size_t)r * C * sizeof(double)), *Gd = xmalloc((size_t)r * C * sizeof(double));
    for (int l = 0; l < p->L; l++) {
        const float *W0 = p->raw_w + (size_t)l * P * C * C, *b0 = p->raw_b + (size_t)l * P * C;
        float *gW = p->work_w, *gb = p->work_b;
        dev_download(gW, p->dev_grads + p->bp[l].attnw, (size_t)P * C * C * sizeof(float));
        if (p->attn_bias) dev_download(gb, p->dev_grads + p->bp[l].attnb, (size_t)P * C * sizeof(float));
        for (int h = 0; h < p->H; h++)
            for (int ro = 0; ro < p->nroles; ro++) {
                size_t idx = ((size_t)l * p->H + h) * p->nroles + ro;
                size_t row0 = (size_t)p->role_block[ro] * C + (size_t)h * r;
                for (size_t i = 0; i < (size_t)r * C; i++) Wd[i] = W0[row0 * C + i], Gd[i] = gW[row0 * C + i];
                la_gemm(dT, Wd, 0, Gd, 1, r, C, r); /* W0's rows times their gradients' */
                for (int a = 0; p->attn_bias && a < r; a++)
                    for (int c = 0; c < r; c++) dT[(size_t)a * r + c] += (double)b0[row0 + a] * gb[row0 + c];
                const double *A = p->A + idx * r * r, *Bm = p->Bm + idx * r * r;
                la_gemm(X, dT, 0, Bm, 1, r, r, r); /* dm_k = (A^T dT Bm^T)_kk = sum_a A_ak (dT Bm^T)_ak */
                for (int k = 0; k < r; k++) dm[idx * r + k] = 0.0;
                for (int a = 0; a < r; a++)
                    for (int k = 0; k < r; k++) dm[idx * r + k] += A[(size_t)a * r + k] * X[(size_t)a * r + k];
            }
    }
    free(dT), free(X), free(Wd), free(Gd);
}

/* Reference distributions of the unmasked model on the mask batches. */
typedef struct {
    int nb, V;
    int *rows;
    float **p_full;
    double loss_full;
} Ref;

static double softmax_kl_rows(const float *logits, const float *pf, const int *tg, int rows, int V, float *dlogits,
                              int *counted) {
    double kl = 0.0;
    int n = 0;
    for (int i = 0; i < rows; i++) n += tg[i] >= 0;
    for (int i = 0; i < rows; i++) {
        const float *z = logits + (size_t)i * V;
        float *dz = dlogits ? dlogits + (size_t)i * V : NULL;
        if (tg[i] < 0) {
            if (dz) memset(dz, 0, (size_t)V * sizeof(float));
            continue;
        }
        double mx = z[0], s = 0.0;
        for (int v = 1; v < V; v++) mx = z[v] > mx ? z[v] : mx;
        for (int v = 0; v < V; v++) s += exp(z[v] - mx);
        double lse = mx + log(s);
        const float *q = pf + (size_t)i * V;
        for (int v = 0; v < V; v++) {
            double lp = z[v] - lse;
            if (q[v] > 0) kl += q[v] * (log(q[v]) - lp);
            if (dz) dz[v] = (float)((exp(lp) - q[v]) / (n ? n : 1));
        }
    }
    *counted = n;
    return n ? kl / n : 0.0;
}

static void ref_build(Ref *f, Runner *r, int nb) {
    f->nb = nb;
    f->rows = xmalloc((size_t)nb * sizeof(int));
    f->p_full = xmalloc((size_t)nb * sizeof(float *));
    f->loss_full = 0.0;
    for (int k = 0; k < nb; k++) {
        f->loss_full += r->forward(r, k, NULL) / nb;
        f->V = r->V;
        f->rows[k] = r->rows;
        size_t n = (size_t)r->rows * r->V;
        f->p_full[k] = xmalloc(n * sizeof(float));
        const float *logits = runner_logits(r);
        for (int i = 0; i < r->rows; i++) {
            const float *z = logits + (size_t)i * r->V;
            float *q = f->p_full[k] + (size_t)i * r->V;
            double mx = z[0], s = 0.0;
            for (int v = 1; v < r->V; v++) mx = z[v] > mx ? z[v] : mx;
            for (int v = 0; v < r->V; v++) s += exp(z[v] - mx);
            for (int v = 0; v < r->V; v++) q[v] = (float)(exp(z[v] - mx) / s);
        }
    }
}

static void ref_free(Ref *f) {
    for (int k = 0; k < f->nb; k++) free(f->p_full[k]);
    free(f->p_full), free(f->rows);
}

MaskEval mask_evaluate(Runner *r, const MaskPlan *p, const double *mask, const void *refp) {
    const Ref *f = refp;
    MaskEval e = {0};
    mask_apply(p, mask);
    for (int k = 0; k < f->nb; k++) {
        e.loss += r->forward(r, k, NULL) / f->nb;
        int n;
        e.kl += softmax_kl_rows(runner_logits(r), f->p_full[k], r->targets, r->rows, r->V, NULL, &n) / f->nb;
    }
    mask_apply(p, NULL);
    return e;
}

/* mean over the n logits of sigmoid((theta - b) / tau): the kept fraction after a common shift b */
static double mean_kept(const double *theta, size_t n, double tau, double b) {
    double m = 0.0;
    for (size_t i = 0; i < n; i++) m += 1.0 / (1.0 + exp(-(theta[i] - b) / tau)) / n;
    return m;
}

/* The common shift b >= 0 of all logits with mean_kept(theta, b) <= c (bisection). */
static double kept_shift(const double *theta, size_t n, double tau, double c) {
    double lo = 0.0, hi = 1.0;
    if (mean_kept(theta, n, tau, 0.0) <= c) return 0.0;
    while (mean_kept(theta, n, tau, hi) > c && hi <= 1e6) lo = hi, hi *= 2.0; /* an upper end that satisfies it */
    for (int it = 0; it < 60; it++) {
        double b = 0.5 * (lo + hi);
        if (mean_kept(theta, n, tau, b) > c) lo = b;
        else hi = b;
    }
    return hi;
}

double mask_kl_grad(Runner *r, const MaskPlan *p, const void *refp, int batch, const double *mask, double *dm) {
    const Ref *f = refp;
    int counted;
    mask_apply(p, mask);
    r->forward(r, batch, NULL);
    float *logits = runner_logits(r); /* replaced by d(KL)/d(logits) in place */
    double kl = softmax_kl_rows(logits, f->p_full[batch], r->targets, r->rows, r->V, logits, &counted);
    runner_backward(r, logits);
    mask_grad(p, dm);
    return kl;
}

void mask_train(Runner *r, const MaskPlan *p, const void *refp, double target, int steps, double lr, double *hard,
                double *theta_out) {
    const Ref *f = refp;
    size_t n = (size_t)p->L * p->H * p->nroles * p->r;
    double *theta = xmalloc(n * sizeof(double)), *m = xmalloc(n * sizeof(double)), *dm = xmalloc(n * sizeof(double));
    double *mom = xcalloc(n, sizeof(double)), v = 0.0;
    int ramp = steps / 2 > 0 ? steps / 2 : 1;
    for (size_t i = 0; i < n; i++) theta[i] = 3.0; /* masks start on (R1) */
    for (int t = 0; t < steps; t++) {
        double tau = 1.0 - 0.8 * t / (steps > 1 ? steps - 1 : 1);
        for (size_t i = 0; i < n; i++) m[i] = 1.0 / (1.0 + exp(-theta[i] / tau));
        mask_kl_grad(r, p, f, t % f->nb, m, dm);
        /* Momentum per logit under one shared RMS scale: a per-logit (Adam) scale would move a direction the
         * KL ignores as fast as one it defends, erasing the very difference the masks are meant to find. */
        double g2 = 0.0;
        for (size_t i = 0; i < n; i++) {
            dm[i] *= m[i] * (1.0 - m[i]) / tau;
            g2 += dm[i] * dm[i] / n;
        }
        v = 0.99 * v + 0.01 * g2;
        double scale = lr / (sqrt(v / (1.0 - pow(0.99, t + 1))) + 1e-30);
        for (size_t i = 0; i < n; i++) {
            mom[i] = 0.9 * mom[i] + 0.1 * dm[i];
            theta[i] -= scale * mom[i] / (1.0 - pow(0.9, t + 1));
        }
        /* The sparsity constraint mean(m) <= c_t, c_t falling from 1 to the target over the first half of the
         * steps: the multiplier of lambda * sum(m) solved exactly, as a common shift of every logit. Shifting
         * keeps their order, so which directions stay is decided by the KL gradients alone. */
        double c = 1.0 - (1.0 - target) * fmin(1.0, (double)(t + 1) / ramp);
        double b = kept_shift(theta, n, tau, c);
        for (size_t i = 0; i < n; i++) theta[i] -= b;
    }
    mask_apply(p, NULL);
    /* hard masks at the target: the round(target * n) directions with the largest logits */
    size_t keep = (size_t)llround(target * (double)n);
    size_t *ord = xmalloc(n * sizeof(size_t));
    for (size_t i = 0; i < n; i++) ord[i] = i;
    for (size_t i = 0; i < keep; i++) { /* partial selection: largest first, ties by index */
        size_t b = i;
        for (size_t j = i + 1; j < n; j++)
            if (theta[ord[j]] > theta[ord[b]]) b = j;
        size_t t = ord[i];
        ord[i] = ord[b], ord[b] = t;
    }
    for (size_t i = 0; i < n; i++) hard[i] = 0.0;
    for (size_t i = 0; i < keep; i++) hard[ord[i]] = 1.0;
    if (theta_out) memcpy(theta_out, theta, n * sizeof(double));
    free(ord);
    free(theta), free(m), free(dm), free(mom);
}

/* Same count per head and role as `hard`, chosen by singular value (magnitude) or at random. */
static void baseline_mask(const MaskPlan *p, const double *hard, int random, Rng *g, double *out) {
    int r = p->r;
    size_t nh = (size_t)p->L * p->H * p->nroles;
    int *ord = xmalloc((size_t)r * sizeof(int));
    for (size_t idx = 0; idx < nh; idx++) {
        int keep = 0;
        for (int c = 0; c < r; c++) keep += hard[idx * r + c] > 0.5;
        for (int c = 0; c < r; c++) ord[c] = c; /* singular values are descending already */
        if (random)
            for (int c = r - 1; c > 0; c--) {
                int j = (int)rng_below(g, (uint64_t)(c + 1)), t = ord[c];
                ord[c] = ord[j], ord[j] = t;
            }
        for (int c = 0; c < r; c++) out[idx * r + c] = 0.0;
        for (int c = 0; c < keep; c++) out[idx * r + ord[c]] = 1.0;
    }
    free(ord);
}

static double kept_fraction(const double *mk, size_t n) {
    double s = 0.0;
    for (size_t i = 0; i < n; i++) s += mk[i];
    return s / n;
}

cJSON *analysis_masks(Runner *r, const Model *m, int batches, const double *targets, int ntargets, int steps,
                      double lr, uint64_t seed) {
    if (m->kv_heads != m->H) { /* a mask per query head would edit K/V rows its group shares */
        cJSON *no = cJSON_CreateObject();
        cJSON_AddFalseToObject(no, "applies");
        cJSON_AddStringToObject(no, "why", "grouped K/V heads: the query heads of a group share their key and value "
                                           "directions, so per-head K/V masks are not defined (see docs/mechint.md)");
        return no;
    }
    MaskPlan p;
    mask_plan(&p, m, r);
    int nb = batches < r->nbatches ? batches : r->nbatches;
    Ref f;
    ref_build(&f, r, nb);
    size_t n = (size_t)p.L * p.H * p.nroles * p.r;
    double *hard = xmalloc(n * sizeof(double)), *base = xmalloc(n * sizeof(double));
    double *zero = xcalloc(n, sizeof(double));
    MaskEval off = mask_evaluate(r, &p, zero, &f);
    cJSON *o = cJSON_CreateObject(), *curve = cJSON_CreateArray();
    cJSON_AddTrueToObject(o, "applies");
    Rng g = rng_seeded(seed, 11);
#define FAITH(x) ((off.loss - f.loss_full) != 0 ? 1.0 - ((x) - f.loss_full) / (off.loss - f.loss_full) : NAN)
    for (int ti = 0; ti < ntargets; ti++) {
        mask_train(r, &p, &f, targets[ti], steps, lr, hard, NULL);
        MaskEval e = mask_evaluate(r, &p, hard, &f);
        baseline_mask(&p, hard, 0, &g, base);
        MaskEval mag = mask_evaluate(r, &p, base, &f);
        double rs = 0.0, rs2 = 0.0;
        for (int k = 0; k < 5; k++) {
            baseline_mask(&p, hard, 1, &g, base);
            double fr = FAITH(mask_evaluate(r, &p, base, &f).loss);
            rs += fr / 5, rs2 += fr * fr / 5;
        }
        cJSON *pt = cJSON_CreateObject();
        cJSON_AddNumberToObject(pt, "target_kept", targets[ti]);
        cJSON_AddItemToObject(pt, "kept", num(kept_fraction(hard, n)));
        cJSON_AddItemToObject(pt, "kl", num(e.kl));
        cJSON_AddItemToObject(pt, "dloss", num(e.loss - f.loss_full));
        cJSON_AddItemToObject(pt, "faithfulness", num(FAITH(e.loss)));
        cJSON_AddItemToObject(pt, "magnitude_faithfulness", num(FAITH(mag.loss)));
        cJSON_AddItemToObject(pt, "random_faithfulness_mean", num(rs));
        cJSON_AddItemToObject(pt, "random_faithfulness_sd", num(sqrt(fmax(0.0, rs2 - rs * rs))));
        cJSON *per_layer = cJSON_CreateArray();
        for (int l = 0; l < p.L; l++) {
            cJSON *lo = cJSON_CreateObject();
            for (int ro = 0; ro < p.nroles; ro++) {
                double s = 0.0;
                for (int h = 0; h < p.H; h++)
                    for (int c = 0; c < p.r; c++) s += hard[(((size_t)l * p.H + h) * p.nroles + ro) * p.r + c];
                cJSON_AddItemToObject(lo, p.role_name[ro], num(s / (p.H * p.r)));
            }
            cJSON_AddItemToArray(per_layer, lo);
        }
        cJSON_AddItemToObject(pt, "kept_per_layer", per_layer);
        if (ti == ntargets / 2) { /* one mask for the heatmap plot: [role][L*H][r] */
            cJSON *mk = cJSON_CreateArray();
            for (int ro = 0; ro < p.nroles; ro++) {
                cJSON *rows = cJSON_CreateArray();
                for (int lh = 0; lh < p.L * p.H; lh++) {
                    cJSON *row = cJSON_CreateArray();
                    for (int c = 0; c < p.r; c++) cJSON_AddItemToArray(row, cJSON_CreateNumber(hard[((size_t)lh * p.nroles + ro) * p.r + c]));
                    cJSON_AddItemToArray(rows, row);
                }
                cJSON_AddItemToArray(mk, rows);
            }
            cJSON_AddItemToObject(pt, "mask", mk);
        }
        cJSON_AddItemToArray(curve, pt);
        fprintf(stderr, "  A11 masks: target %.2f kept %.3f faithfulness %.3f (magnitude %.3f, random %.3f)\n",
                targets[ti], kept_fraction(hard, n), FAITH(e.loss), FAITH(mag.loss), rs);
    }
#undef FAITH
    cJSON_AddItemToObject(o, "curve", curve);
    cJSON *s = cJSON_CreateObject(), *roles = cJSON_CreateArray();
    for (int ro = 0; ro < p.nroles; ro++) cJSON_AddItemToArray(roles, cJSON_CreateString(p.role_name[ro]));
    cJSON_AddItemToObject(s, "roles", roles);
    cJSON_AddItemToObject(s, "loss_full", num(f.loss_full));
    cJSON_AddItemToObject(s, "loss_all_masked", num(off.loss));
    cJSON_AddNumberToObject(s, "batches", nb);
    cJSON_AddNumberToObject(s, "steps", steps);
    cJSON_AddNumberToObject(s, "lr", lr);
    cJSON_AddItemToObject(o, "summary", s);
    cJSON_AddStringToObject(o, "formula", "masks in the singular bases of W_QK (key side) and W_OV (value side); "
                                          "faithfulness = 1 - (loss_masked - loss_full)/(loss_all_masked - loss_full); "
                                          "baselines keep the same count per head: top singular directions "
                                          "(magnitude) or random (5 draws)");
    free(hard), free(base), free(zero);
    ref_free(&f);
    mask_plan_free(&p);
    return o;
}

/* for tests: the reference distributions as an opaque object */
void *mask_ref_new(Runner *r, int batches) {
    Ref *f = xmalloc(sizeof *f);
    ref_build(f, r, batches);
    return f;
}
void mask_ref_free(void *f) {
    ref_free(f);
    free(f);
}
double mask_ref_loss(const void *f) { return ((const Ref *)f)->loss_full; }
