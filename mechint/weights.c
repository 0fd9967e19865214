/* Weight-only analyses: A1 circuits, A2 QK symmetry, A3 K-V alignment,
 * A5 positional kernel (layer 0), A6 +Pos bias decomposition. Everything
 * is computed in factored form on r x r (or 2r x 2r) matrices: no d x d or
 * V x V product is formed. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "common.h"
#include "linalg.h"
#include "mechint.h"

static cJSON *num(double v) { return isfinite(v) ? cJSON_CreateNumber(v) : cJSON_CreateNull(); }

static cJSON *num_array(const double *v, int n) {
    cJSON *a = cJSON_CreateArray();
    for (int i = 0; i < n; i++) cJSON_AddItemToArray(a, num(v[i]));
    return a;
}

/* (n x r) transpose of Wo (r x d) */
static double *transpose(const double *A, int rows, int cols) {
    double *t = xmalloc((size_t)rows * cols * sizeof(double));
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++) t[(size_t)j * rows + i] = A[(size_t)i * cols + j];
    return t;
}

cJSON *not_applicable(const char *why) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddFalseToObject(o, "applies");
    cJSON_AddStringToObject(o, "why", why);
    return o;
}

static cJSON *new_analysis(void) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddTrueToObject(o, "applies");
    return o;
}

/* ------------------------------------------------------------------ A1 */

int factored_svals(const double *A, int n, const double *B, int m, int r, double *s) {
    if (n < r || m < r) { /* fewer rows than the head dim: form the small product itself */
        double *P = xmalloc((size_t)n * m * sizeof(double));
        la_gemm(P, A, 0, B, 1, n, r, m);
        int k = n < m ? n : m;
        double *sv = xmalloc((size_t)k * sizeof(double));
        int info = la_svd(P, n, m, NULL, sv, NULL);
        for (int i = 0; i < r; i++) s[i] = i < k ? sv[i] : 0.0;
        free(P), free(sv);
        return info;
    }
    double *R1 = xmalloc((size_t)r * r * sizeof(double)), *R2 = xmalloc((size_t)r * r * sizeof(double));
    double *M = xmalloc((size_t)r * r * sizeof(double));
    int info = la_qr(A, n, r, NULL, R1);
    if (!info) info = la_qr(B, m, r, NULL, R2);
    if (!info) {
        la_gemm(M, R1, 0, R2, 1, r, r, r);
        info = la_svd(M, r, r, NULL, s, NULL);
    }
    free(R1), free(R2), free(M);
    return info;
}

static cJSON *spectrum_json(const double *s, int r) {
    cJSON *o = cJSON_CreateObject();
    double f2 = 0.0;
    for (int i = 0; i < r; i++) f2 += s[i] * s[i];
    cJSON_AddItemToObject(o, "top", num_array(s, r < 16 ? r : 16));
    cJSON_AddItemToObject(o, "erank", num(la_erank(s, r)));
    cJSON_AddItemToObject(o, "frobenius", num(sqrt(f2)));
    cJSON_AddItemToObject(o, "spectral", num(r ? s[0] : 0.0));
    return o;
}

cJSON *analysis_circuits(const Model *m) {
    cJSON *o = new_analysis(), *layers = cJSON_CreateArray();
    int d = m->d, r = m->r;
    double *s = xmalloc((size_t)r * sizeof(double)), sum_qk = 0.0, sum_ov = 0.0;
    for (int l = 0; l < m->L; l++) {
        cJSON *row = cJSON_CreateArray();
        for (int h = 0; h < m->H; h++) {
            const Head *hd = &m->layer[l].head[h];
            cJSON *c = cJSON_CreateObject();
            factored_svals(hd->Wq, d, hd->Wk, d, r, s); /* weights only: the d rows, no bias row */
            cJSON *qk = spectrum_json(s, r);
            sum_qk += la_erank(s, r);
            double *WoT = transpose(hd->Wo, r, d);
            factored_svals(hd->Wv, d, WoT, d, r, s);
            free(WoT);
            cJSON *ov = spectrum_json(s, r);
            sum_ov += la_erank(s, r);
            cJSON_AddItemToObject(c, "qk", qk);
            cJSON_AddItemToObject(c, "ov", ov);
            cJSON_AddItemToArray(row, c);
        }
        cJSON_AddItemToArray(layers, row);
    }
    cJSON_AddItemToObject(o, "per_head", layers);
    cJSON *sum = cJSON_CreateObject();
    cJSON_AddItemToObject(sum, "mean_erank_qk", num(sum_qk / (m->L * m->H)));
    cJSON_AddItemToObject(sum, "mean_erank_ov", num(sum_ov / (m->L * m->H)));
    cJSON_AddNumberToObject(sum, "head_dim", r);
    cJSON_AddItemToObject(o, "summary", sum);
    cJSON_AddStringToObject(o, "formula", "singular values of W_QK = W_Q W_K^T and W_OV = W_V W_O from the r x r "
                                          "middle of their QR factors; erank = exp(-sum p ln p), p = s / sum s");
    free(s);
    return o;
}

/* ------------------------------------------------------------------ A2 */

QKSymmetry qk_symmetry(const double *Wq, const double *Wk, int n, int r) {
    QKSymmetry q = {NAN, NAN, NAN, NAN, NAN};
    double *Gq = xmalloc((size_t)r * r * sizeof(double)), *Gk = xmalloc((size_t)r * r * sizeof(double));
    double *X = xmalloc((size_t)r * r * sizeof(double));
    la_gemm(Gq, Wq, 1, Wq, 0, r, n, r);
    la_gemm(Gk, Wk, 1, Wk, 0, r, n, r);
    la_gemm(X, Wk, 1, Wq, 0, r, n, r); /* Wk^T Wq: same nonzero spectrum as M */
    double trM2 = 0.0, normM2 = 0.0;
    for (int i = 0; i < r; i++)
        for (int j = 0; j < r; j++) {
            trM2 += X[(size_t)i * r + j] * X[(size_t)j * r + i];
            normM2 += Gq[(size_t)i * r + j] * Gk[(size_t)j * r + i];
        }
    if (normM2 <= 0.0) goto out;
    q.sigma_sym = trM2 / normM2;
    q.sym_ratio = sqrt(fmax(0.0, (1.0 + q.sigma_sym) / 2.0));
    /* eigenvalues of S = (M + M^T) / 2: in the span of [Wq Wk] when that is thin */
    int k = 2 * r;
    double *lam;
    int nl;
    if (n > k) {
        double *F = xmalloc((size_t)n * k * sizeof(double)), *R = xmalloc((size_t)k * k * sizeof(double));
        double *RJ = xmalloc((size_t)k * k * sizeof(double)), *S = xmalloc((size_t)k * k * sizeof(double));
        for (int i = 0; i < n; i++) {
            memcpy(F + (size_t)i * k, Wq + (size_t)i * r, (size_t)r * sizeof(double));
            memcpy(F + (size_t)i * k + r, Wk + (size_t)i * r, (size_t)r * sizeof(double));
        }
        la_qr(F, n, k, NULL, R);
        for (int i = 0; i < k; i++) /* R J with J = [[0, I], [I, 0]] / 2: swap the column halves */
            for (int j = 0; j < k; j++) RJ[(size_t)i * k + j] = 0.5 * R[(size_t)i * k + (j < r ? j + r : j - r)];
        la_gemm(S, RJ, 0, R, 1, k, k, k);
        lam = xmalloc((size_t)k * sizeof(double));
        nl = k;
        la_syev(S, k, lam, NULL);
        free(F), free(R), free(RJ), free(S);
    } else {
        double *M = xmalloc((size_t)n * n * sizeof(double)), *S = xmalloc((size_t)n * n * sizeof(double));
        la_gemm(M, Wq, 0, Wk, 1, n, r, n);
        for (int i = 0; i < n; i++)
            for (int j = 0; j < n; j++) S[(size_t)i * n + j] = 0.5 * (M[(size_t)i * n + j] + M[(size_t)j * n + i]);
        lam = xmalloc((size_t)n * sizeof(double));
        nl = n;
        la_syev(S, n, lam, NULL);
        free(M), free(S);
    }
    double sl = 0.0, sa = 0.0, kept = 0.0;
    for (int i = 0; i < nl; i++) sl += lam[i], sa += fabs(lam[i]);
    for (int i = nl - 1, c = 0; i >= 0 && c < r && lam[i] > 0.0; i--, c++) kept += lam[i] * lam[i];
    q.positivity = sa > 0.0 ? sl / sa : NAN;
    q.psd_residual = sqrt(fmax(0.0, normM2 - kept) / normM2);
    free(lam);
    /* the Framework's positivity: sum Re(lambda) / sum |lambda| over the eigenvalues of M */
    double *wr = xmalloc((size_t)r * sizeof(double)), *wi = xmalloc((size_t)r * sizeof(double));
    if (la_geev(X, r, wr, wi) == 0) {
        double re = 0.0, ab = 0.0;
        for (int i = 0; i < r; i++) re += wr[i], ab += hypot(wr[i], wi[i]);
        q.framework_positivity = ab > 0.0 ? re / ab : NAN;
    }
    free(wr), free(wi);
out:
    free(Gq), free(Gk), free(X);
    return q;
}

cJSON *analysis_qk_symmetry(const Model *m) {
    cJSON *o = new_analysis(), *layers = cJSON_CreateArray();
    double sum = 0.0, mn = INFINITY;
    for (int l = 0; l < m->L; l++) {
        cJSON *row = cJSON_CreateArray();
        for (int h = 0; h < m->H; h++) {
            const Head *hd = &m->layer[l].head[h];
            QKSymmetry q = qk_symmetry(hd->Wq, hd->Wk, m->d + 1, m->r); /* bias-augmented */
            cJSON *c = cJSON_CreateObject();
            cJSON_AddItemToObject(c, "sigma_sym", num(q.sigma_sym));
            cJSON_AddItemToObject(c, "sym_ratio", num(q.sym_ratio));
            cJSON_AddItemToObject(c, "positivity", num(q.positivity));
            cJSON_AddItemToObject(c, "framework_positivity", num(q.framework_positivity));
            cJSON_AddItemToObject(c, "psd_residual", num(q.psd_residual));
            cJSON_AddItemToArray(row, c);
            sum += q.sigma_sym;
            mn = fmin(mn, q.sigma_sym);
        }
        cJSON_AddItemToArray(layers, row);
    }
    cJSON_AddItemToObject(o, "per_head", layers);
    cJSON *s = cJSON_CreateObject();
    cJSON_AddItemToObject(s, "mean_sigma_sym", num(sum / (m->L * m->H)));
    cJSON_AddItemToObject(s, "min_sigma_sym", num(mn));
    cJSON_AddBoolToObject(s, "symmetric_by_construction", attn_symmetric(m->variant));
    cJSON_AddItemToObject(o, "summary", s);
    cJSON_AddStringToObject(o, "formula",
                            "bias-augmented M = W_Q W_K^T; sigma_sym = tr(M^2)/||M||_F^2 in [-1, 1]; positivity = "
                            "sum lambda(S)/sum |lambda(S)|, S = (M+M^T)/2; psd_residual = ||M - P||/||M||, P the "
                            "top-r positive part of S (the best KV replacement)");
    return o;
}

/* ------------------------------------------------------------------ A3 */

KVAlignment kv_alignment(const double *Wq, const double *Wk, const double *Wv, const double *Wo, int n, int r, int d) {
    KVAlignment a = {NAN, (double)r / n, NAN, NAN, NAN, NAN};
    double *Qk = xmalloc((size_t)n * r * sizeof(double)), *Qv = xmalloc((size_t)n * r * sizeof(double));
    int rk = la_orth(Wk, n, r, Qk), rv = la_orth(Wv, n, r, Qv);
    if (rk == 0 || rv == 0) goto out;
    double *X = xmalloc((size_t)rk * rv * sizeof(double)), *s = xmalloc((size_t)(rk < rv ? rk : rv) * sizeof(double));
    la_gemm(X, Qk, 1, Qv, 0, rk, n, rv);
    a.pk = la_frob2(X, rk * rv) / (rk < rv ? rk : rv);
    la_svd(X, rk, rv, NULL, s, NULL);
    a.cos_max = s[0];
    a.cos_min = s[(rk < rv ? rk : rv) - 1];
    free(X), free(s);
    /* tau_QK^2 = tr(Gq (Gk - Y^T Y)) / tr(Gq Gk), Y = Qv^T Wk */
    double *Gq = xmalloc((size_t)r * r * sizeof(double)), *Gk = xmalloc((size_t)r * r * sizeof(double));
    double *Y = xmalloc((size_t)rv * r * sizeof(double)), *YY = xmalloc((size_t)r * r * sizeof(double));
    la_gemm(Gq, Wq, 1, Wq, 0, r, n, r);
    la_gemm(Gk, Wk, 1, Wk, 0, r, n, r);
    la_gemm(Y, Qv, 1, Wk, 0, rv, n, r);
    la_gemm(YY, Y, 1, Y, 0, r, rv, r);
    double full = la_dot(Gq, Gk, r * r), res = full - la_dot(Gq, YY, r * r);
    a.tau_qk = full > 0 ? sqrt(fmax(0.0, res) / full) : NAN;
    /* tau_OV^2 = tr((Gv - Z^T Z) Wo Wo^T) / tr(Gv Wo Wo^T), Z = Qk^T Wv */
    double *Gv = xmalloc((size_t)r * r * sizeof(double)), *Z = xmalloc((size_t)rk * r * sizeof(double));
    double *ZZ = xmalloc((size_t)r * r * sizeof(double)), *OO = xmalloc((size_t)r * r * sizeof(double));
    la_gemm(Gv, Wv, 1, Wv, 0, r, n, r);
    la_gemm(Z, Qk, 1, Wv, 0, rk, n, r);
    la_gemm(ZZ, Z, 1, Z, 0, r, rk, r);
    la_gemm(OO, Wo, 0, Wo, 1, r, d, r);
    full = la_dot(Gv, OO, r * r);
    res = full - la_dot(ZZ, OO, r * r);
    a.tau_ov = full > 0 ? sqrt(fmax(0.0, res) / full) : NAN;
    free(Gq), free(Gk), free(Y), free(YY), free(Gv), free(Z), free(ZZ), free(OO);
out:
    free(Qk), free(Qv);
    return a;
}

cJSON *analysis_kv_alignment(const Model *m) {
    cJSON *o = new_analysis(), *layers = cJSON_CreateArray();
    double sum_pk = 0.0, sum_tau = 0.0;
    for (int l = 0; l < m->L; l++) {
        cJSON *row = cJSON_CreateArray();
        for (int h = 0; h < m->H; h++) {
            const Head *hd = &m->layer[l].head[h];
            KVAlignment a = kv_alignment(hd->Wq, hd->Wk, hd->Wv, hd->Wo, m->d, m->r, m->d);
            cJSON *c = cJSON_CreateObject();
            cJSON_AddItemToObject(c, "pk", num(a.pk));
            cJSON_AddItemToObject(c, "pk_random", num(a.pk_random));
            cJSON_AddItemToObject(c, "cos_max", num(a.cos_max));
            cJSON_AddItemToObject(c, "cos_min", num(a.cos_min));
            cJSON_AddItemToObject(c, "tau_qk", num(a.tau_qk));
            cJSON_AddItemToObject(c, "tau_ov", num(a.tau_ov));
            cJSON_AddItemToArray(row, c);
            sum_pk += a.pk;
            sum_tau += a.tau_qk;
        }
        cJSON_AddItemToArray(layers, row);
    }
    cJSON_AddItemToObject(o, "per_head", layers);
    cJSON *s = cJSON_CreateObject();
    cJSON_AddItemToObject(s, "mean_pk", num(sum_pk / (m->L * m->H)));
    cJSON_AddItemToObject(s, "pk_random", num((double)m->r / m->d));
    cJSON_AddItemToObject(s, "mean_tau_qk", num(sum_tau / (m->L * m->H)));
    cJSON_AddBoolToObject(s, "k_equals_v_by_construction", attn_key_block(m->variant) == attn_value_block(m->variant));
    cJSON_AddItemToObject(o, "summary", s);
    cJSON_AddStringToObject(o, "formula", "PK = ||Q_K^T Q_V||_F^2 / r (principal-angle overlap of col W_K and col W_V; "
                                          "random r/d); tau_QK = ||W_QK (I - P_V)|| / ||W_QK|| (0: a KV-tying model "
                                          "with a refitted Q computes the same scores); tau_OV = ||(I - P_K) W_OV|| / "
                                          "||W_OV||");
    return o;
}

/* ------------------------------------------------------------------ A5 */

static int allowed(int causal, int i, int j) { return !causal || j <= i; }

PosKernel pos_kernel_metrics(const double *K, int n, int causal, double *profile) {
    PosKernel p = {NAN, NAN, NAN, 0};
    double *Kt = xmalloc((size_t)n * n * sizeof(double)), grand = 0.0;
    long cnt = 0;
    for (int i = 0; i < n; i++) { /* row-centre over the allowed keys */
        double mu = 0.0;
        int c = 0;
        for (int j = 0; j < n; j++)
            if (allowed(causal, i, j)) mu += K[(size_t)i * n + j], c++;
        mu /= c;
        for (int j = 0; j < n; j++) Kt[(size_t)i * n + j] = allowed(causal, i, j) ? K[(size_t)i * n + j] - mu : NAN;
        for (int j = 0; j < n; j++)
            if (allowed(causal, i, j)) grand += K[(size_t)i * n + j], cnt++;
    }
    grand /= cnt;
    /* profile over offsets o = j - i, and the diagonal means of K - grand mean */
    double *dsum = xcalloc((size_t)2 * n, sizeof(double)), *tsum = xcalloc((size_t)2 * n, sizeof(double));
    int *dcnt = xcalloc((size_t)2 * n, sizeof(int));
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) {
            if (!allowed(causal, i, j)) continue;
            int o = j - i + n - 1;
            dsum[o] += K[(size_t)i * n + j] - grand;
            tsum[o] += Kt[(size_t)i * n + j];
            dcnt[o]++;
        }
    double toep = 0.0, all = 0.0, best = -INFINITY;
    for (int o = 0; o < 2 * n - 1; o++) {
        if (profile) profile[o] = dcnt[o] ? tsum[o] / dcnt[o] : NAN;
        if (dcnt[o]) {
            toep += dsum[o] * dsum[o] / dcnt[o]; /* sum over the diagonal of its mean squared */
            if (tsum[o] / dcnt[o] > best) best = tsum[o] / dcnt[o], p.argmax_offset = o - (n - 1);
        }
    }
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++)
            if (allowed(causal, i, j)) all += (K[(size_t)i * n + j] - grand) * (K[(size_t)i * n + j] - grand);
    p.toeplitz = all > 0 ? toep / all : 1.0;
    double prev = 0.0;
    for (int i = 1; i < n; i++) prev += Kt[(size_t)i * n + i - 1] - Kt[(size_t)i * n + i];
    p.mu_prev = n > 1 ? prev / (n - 1) : NAN;
    if (n <= 1024) { /* smallest eigenvalue of the symmetric part */
        double *S = xmalloc((size_t)n * n * sizeof(double)), *w = xmalloc((size_t)n * sizeof(double));
        for (int i = 0; i < n; i++)
            for (int j = 0; j < n; j++) S[(size_t)i * n + j] = 0.5 * (K[(size_t)i * n + j] + K[(size_t)j * n + i]);
        if (la_syev(S, n, w, NULL) == 0) p.min_eig = w[0];
        free(S), free(w);
    }
    free(Kt), free(dsum), free(tsum), free(dcnt);
    return p;
}

cJSON *analysis_pos_kernel(const Model *m) {
    if (!m->pos_table) return not_applicable("the model has no absolute positions entering layer 0");
    cJSON *o = new_analysis(), *row = cJSON_CreateArray();
    int n = m->npos < 256 ? m->npos : 256, d = m->d, r = m->r;
    const Layer *ly = &m->layer[0];
    double *A = xmalloc((size_t)n * r * sizeof(double)), *B = xmalloc((size_t)n * r * sizeof(double));
    double *K = xmalloc((size_t)n * n * sizeof(double)), *prof = xmalloc((size_t)(2 * n) * sizeof(double));
    double sum_prev = 0.0;
    for (int h = 0; h < m->H; h++) {
        const Head *hd = &ly->head[h];
        la_gemm(A, m->pos_table, 0, hd->Wq, 0, n, d, r); /* positions through the d weight rows */
        la_gemm(B, m->pos_table, 0, hd->Wk, 0, n, d, r);
        la_gemm(K, A, 0, B, 1, n, r, n);
        for (size_t i = 0; i < (size_t)n * n; i++) K[i] /= sqrt((double)r);
        PosKernel p = pos_kernel_metrics(K, n, ly->causal, prof);
        cJSON *c = cJSON_CreateObject();
        cJSON_AddItemToObject(c, "toeplitz_fraction", num(p.toeplitz));
        cJSON_AddItemToObject(c, "mu_prev", num(p.mu_prev));
        cJSON_AddNumberToObject(c, "argmax_offset", p.argmax_offset);
        cJSON_AddItemToObject(c, "min_eigenvalue", num(p.min_eig));
        int lo = n - 1 - (n < 32 ? n - 1 : 32), hi = ly->causal ? n - 1 : n - 1 + (n < 32 ? n - 1 : 32);
        cJSON_AddNumberToObject(c, "profile_first_offset", lo - (n - 1));
        cJSON_AddItemToObject(c, "profile", num_array(prof + lo, hi - lo + 1));
        if (m->grid_w > 0) { /* ViT: locality on the patch grid, CLS excluded */
            double sx = 0, sy = 0, sxx = 0, syy = 0, sxy = 0;
            long cnt = 0;
            int off = m->cls ? 1 : 0, np = m->grid_w * m->grid_h;
            for (int q = 0; q < np && q + off < n; q++)
                for (int k = 0; k < np && k + off < n; k++) {
                    double rowmean = 0.0;
                    for (int j = off; j < np + off && j < n; j++) rowmean += K[(size_t)(q + off) * n + j];
                    rowmean /= np;
                    double x = K[(size_t)(q + off) * n + k + off] - rowmean;
                    double y = -hypot(q % m->grid_w - k % m->grid_w, q / m->grid_w - k / m->grid_w);
                    sx += x, sy += y, sxx += x * x, syy += y * y, sxy += x * y, cnt++;
                }
            double cov = sxy / cnt - sx / cnt * sy / cnt, vx = sxx / cnt - sx * sx / cnt / cnt,
                   vy = syy / cnt - sy * sy / cnt / cnt;
            cJSON_AddItemToObject(c, "locality_2d", num(vx > 0 && vy > 0 ? cov / sqrt(vx * vy) : NAN));
        }
        cJSON_AddItemToArray(row, c);
        sum_prev += p.mu_prev;
    }
    cJSON *layers = cJSON_CreateArray();
    cJSON_AddItemToArray(layers, row);
    cJSON_AddItemToObject(o, "per_head", layers);
    cJSON *s = cJSON_CreateObject();
    cJSON_AddNumberToObject(s, "layer", 0);
    cJSON_AddNumberToObject(s, "positions", n);
    cJSON_AddStringToObject(s, "positions_kind", m->pos_kind);
    cJSON_AddItemToObject(s, "mean_mu_prev", num(sum_prev / m->H));
    cJSON_AddItemToObject(o, "summary", s);
    cJSON_AddStringToObject(o, "formula", "K_pos = E W_QK E^T / sqrt(r) over the (row-centred) position table E, "
                                          "layer 0; profile t(o) = mean_i of the row-centred K_pos[i, i+o]; "
                                          "mu_prev = mean_i (K~[i,i-1] - K~[i,i]) (< 0: self beats previous)");
    free(A), free(B), free(K), free(prof);
    return o;
}

/* ------------------------------------------------------------------ A6 */

Hodge hodge(const double *Lg, int n) {
    Hodge h = {NAN, NAN, NAN};
    size_t nn = (size_t)n * n;
    double *N = xmalloc(nn * sizeof(double)), *phi = xcalloc((size_t)n, sizeof(double));
    double *rm = xcalloc((size_t)n, sizeof(double)), *cm = xcalloc((size_t)n, sizeof(double)), mean = 0.0;
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) {
            double v = Lg[(size_t)i * n + j];
            N[(size_t)i * n + j] = 0.5 * (v - Lg[(size_t)j * n + i]);
            rm[i] += v / n, cm[j] += v / n, mean += v / nn;
        }
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) phi[j] += N[(size_t)i * n + j] / n;
    double nN = 0.0, nC = 0.0, nL = 0.0, nDC = 0.0;
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) {
            double v = Lg[(size_t)i * n + j], a = N[(size_t)i * n + j], c = a - (phi[j] - phi[i]);
            double dc = v - rm[i] - cm[j] + mean;
            nN += a * a, nC += c * c, nL += (v - mean) * (v - mean), nDC += dc * dc;
        }
    /* parts below rounding level of the whole map count as zero (a ratio of two rounding errors means nothing) */
    double floor2 = 1e-24 * nL;
    h.antisym_share = nL > 0 ? nN / nL : 0.0;
    h.kappa = nN > floor2 ? nC / nN : 0.0;
    h.curl_share = nDC > floor2 ? nC / nDC : 0.0;
    free(N), free(phi), free(rm), free(cm);
    return h;
}

double reversibility(const double *A, int n) {
    double *pi = xmalloc((size_t)n * sizeof(double)), *nx = xmalloc((size_t)n * sizeof(double));
    for (int i = 0; i < n; i++) pi[i] = 1.0 / n;
    for (int it = 0; it < 2000; it++) {
        memset(nx, 0, (size_t)n * sizeof(double));
        for (int i = 0; i < n; i++)
            for (int j = 0; j < n; j++) nx[j] += pi[i] * A[(size_t)i * n + j];
        double s = 0.0, diff = 0.0;
        for (int j = 0; j < n; j++) s += nx[j];
        for (int j = 0; j < n; j++) nx[j] /= s, diff += fabs(nx[j] - pi[j]);
        memcpy(pi, nx, (size_t)n * sizeof(double));
        if (diff < 1e-14) break;
    }
    double num2 = 0.0, den = 0.0;
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) {
            double a = pi[i] * A[(size_t)i * n + j], b = pi[j] * A[(size_t)j * n + i];
            num2 += (a - b) * (a - b), den += a * a;
        }
    free(pi), free(nx);
    return den > 0 ? sqrt(num2 / den) : 0.0;
}

BiasParts bias_parts(const double *Bm, int n, int causal) {
    (void)causal; /* the decomposition uses the full grid; attention sees the allowed part */
    BiasParts p = {0, 0, 0, 1, 0};
    size_t nn = (size_t)n * n;
    double *rm = xcalloc((size_t)n, sizeof(double)), *cm = xcalloc((size_t)n, sizeof(double)), mu = 0.0;
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) {
            double v = Bm[(size_t)i * n + j];
            rm[i] += v / n, cm[j] += v / n, mu += v / nn;
        }
    double tot = 0.0, er = 0.0, ec = 0.0, ei = 0.0;
    double *dsum = xcalloc((size_t)2 * n, sizeof(double));
    int *dcnt = xcalloc((size_t)2 * n, sizeof(int));
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) {
            double v = Bm[(size_t)i * n + j] - mu, ri = rm[i] - mu, cj = cm[j] - mu, in = v - ri - cj;
            tot += v * v, er += ri * ri, ec += cj * cj, ei += in * in;
            dsum[j - i + n - 1] += v, dcnt[j - i + n - 1]++;
        }
    double toep = 0.0;
    for (int o = 0; o < 2 * n - 1; o++) toep += dcnt[o] ? dsum[o] * dsum[o] / dcnt[o] : 0.0;
    if (tot > 1e-300) {
        p.e_row = er / tot, p.e_col = ec / tot, p.e_int = ei / tot, p.toeplitz = toep / tot;
        p.curl = hodge(Bm, n).curl_share;
    }
    free(rm), free(cm), free(dsum), free(dcnt);
    return p;
}

cJSON *analysis_pos_bias(const Model *m, int n) {
    if (!m->pos) return not_applicable("the variant has no +Pos term");
    cJSON *o = new_analysis(), *layers = cJSON_CreateArray();
    int mm = m->pos_m;
    double *P = xmalloc((size_t)mm * sizeof(double)), *B = xmalloc((size_t)n * n * sizeof(double));
    for (int l = 0; l < m->L; l++) {
        const Layer *ly = &m->layer[l];
        cJSON *row = cJSON_CreateArray();
        for (int h = 0; h < m->H; h++) {
            int g = m->pos_groups == 1 ? 0 : h;
            const double *w = ly->pos_w + (size_t)g * mm;
            double alpha = 0.0;
            for (int k = 0; k < mm; k++) alpha += w[k];
            for (int i = 0; i < n; i++)
                for (int j = 0; j < n; j++) {
                    attn_pos_entry(P, i, j, mm);
                    double v = ly->pos_b[g];
                    for (int k = 0; k < mm; k++) v += w[k] * P[k];
                    B[(size_t)i * n + j] = v;
                }
            BiasParts bp = bias_parts(B, n, ly->causal);
            /* positional-only attention softmax_j(B_ij) over the allowed keys */
            double ent = 0.0;
            int *votes = xcalloc((size_t)2 * n, sizeof(int));
            for (int i = 0; i < n; i++) {
                double mx = -INFINITY, z = 0.0;
                int arg = 0;
                for (int j = 0; j < n; j++)
                    if (allowed(ly->causal, i, j) && B[(size_t)i * n + j] > mx) mx = B[(size_t)i * n + j], arg = j;
                for (int j = 0; j < n; j++)
                    if (allowed(ly->causal, i, j)) z += exp(B[(size_t)i * n + j] - mx);
                for (int j = 0; j < n; j++)
                    if (allowed(ly->causal, i, j)) {
                        double p = exp(B[(size_t)i * n + j] - mx) / z;
                        if (p > 0) ent -= p * log(p) / n;
                    }
                votes[arg - i + n - 1]++;
            }
            int mode = 0;
            for (int o2 = 0; o2 < 2 * n - 1; o2++)
                if (votes[o2] > votes[mode]) mode = o2;
            double g_prof[64];
            int ng = n < 64 ? n : 64;
            for (int j = 0; j < ng; j++) { /* the key-position prior g(j): column effect of B */
                double cmj = 0.0, mu = 0.0;
                for (int i = 0; i < n; i++) cmj += B[(size_t)i * n + j] / n;
                for (size_t k = 0; k < (size_t)n * n; k++) mu += B[k] / ((double)n * n);
                g_prof[j] = cmj - mu;
            }
            cJSON *c = cJSON_CreateObject();
            cJSON_AddItemToObject(c, "alpha", num(alpha));
            cJSON_AddItemToObject(c, "bias", num(ly->pos_b[g]));
            cJSON_AddItemToObject(c, "e_row", num(bp.e_row));
            cJSON_AddItemToObject(c, "e_col", num(bp.e_col));
            cJSON_AddItemToObject(c, "e_int", num(bp.e_int));
            cJSON_AddItemToObject(c, "toeplitz_fraction", num(bp.toeplitz));
            cJSON_AddItemToObject(c, "curl_share", num(bp.curl));
            cJSON_AddItemToObject(c, "positional_attention_entropy", num(ent));
            cJSON_AddNumberToObject(c, "positional_argmax_offset", mode - (n - 1));
            cJSON_AddItemToObject(c, "key_prior_g", num_array(g_prof, ng));
            cJSON_AddItemToArray(row, c);
            free(votes);
        }
        cJSON_AddItemToArray(layers, row);
    }
    cJSON_AddItemToObject(o, "per_head", layers);
    cJSON *s = cJSON_CreateObject();
    cJSON_AddNumberToObject(s, "positions", n);
    cJSON_AddNumberToObject(s, "pos_dim", mm);
    cJSON_AddStringToObject(s, "groups", m->pos_groups == 1 ? "one per layer" : "one per head");
    cJSON_AddItemToObject(o, "summary", s);
    cJSON_AddStringToObject(o, "formula", "alpha = sum_c w_c (temperature on the content scores); B_ij = w.P_ij + b "
                                          "= mu + r_i + c_j + I_ij; only c_j (a key-position prior) and I_ij change "
                                          "attention; e_* are energy shares of B - mu");
    free(P), free(B);
    return o;
}
