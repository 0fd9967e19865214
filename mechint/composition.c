/* A9 composition: how much the output of a head h1 feeds the query (Q), the key (K) or the value (V) side of a
 * head h2 in a later layer of the same stack (catalogue A9; TransformerLens' composition scores):
 *
 *   CS_Q = CS(W_OV1, W_QK2), CS_K = CS(W_OV1, W_QK2^T), CS_V = CS(W_OV1, W_OV2), CS(A, B) = ||AB|| / (||A|| ||B||)
 *
 * with W_OV = W_V W_O and W_QK = W_Q W_K^T (d x d, never formed): for A = U1 V1^T and B = U2 V2^T,
 * ||AB|| = ||(V1 R_U1^T)^T (U2 R_V2^T)|| with R_W the r x r QR factor of W (W^T W = R_W^T R_W), so the scores of
 * a head into a whole later layer are one BLAS product of d x r matrices. Beside each score: z against 64 random
 * heads of the same shapes and the same tying of roles (the variant's), and the rank-normalised overlap PK of
 * h1's write space col(W_O^T) with h2's read space col(W_Q), col(W_K) or col(W_V). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "linalg.h"
#include "mechint.h"
#include "rng.h"

enum { DRAWS = 64, TOP_EDGES = 20 };

static cJSON *num(double v) { return isfinite(v) ? cJSON_CreateNumber(v) : cJSON_CreateNull(); }

/* The square root R of a Gram W^T W (W = Q R, r x r): ||U V^T|| = ||R_U R_V^T||, and for A = U1 V1^T, B = U2 V2^T,
 * ||A B|| = ||(V1 R_U1^T)^T (U2 R_V2^T)||, one r x r block of a product of d x r matrices. */
static void gram_root(const double *W, int d, int r, double *R) {
    if (la_qr(W, d, r, NULL, R) != 0) memset(R, 0, (size_t)r * r * sizeof(double));
}

/* Orthonormal basis of col(W) (d x r, la_orth) into B, zero-padded to r vectors: as rows (r x d) or as columns
 * (d x r); returns the numerical rank (0 for NaN weights: no overlap is reported). */
static int basis(const double *W, int d, int r, double *B, int as_rows) {
    double *Q = xmalloc((size_t)d * r * sizeof(double));
    int rank = la_orth(W, d, r, Q);
    memset(B, 0, (size_t)r * d * sizeof(double));
    for (int i = 0; i < d; i++)
        for (int c = 0; c < rank; c++) B[as_rows ? (size_t)c * d + i : (size_t)i * r + c] = Q[(size_t)i * rank + c];
    free(Q);
    return rank;
}

static double frob_of_product(const double *A, const double *B, int r) {
    double *P = xmalloc((size_t)r * r * sizeof(double));
    la_gemm(P, A, 0, B, 1, r, r, r);
    double f = sqrt(la_frob2(P, r * r));
    free(P);
    return f;
}

/* What one head contributes to the pair products. As h1 (writing): write = W_O^T R_V^T and a basis of col W_O^T
 * (both d x r). As h2 (reading), per mode Q, K, V: read[k] = (U2 R_V2^T)^T (r x d) with (U2, V2) = (W_Q, W_K),
 * (W_K, W_Q), (W_V, W_O^T), and the bases of col W_Q, W_K, W_V as rows; heads of a layer are consecutive in one
 * array, so a head's products with a whole later layer are one BLAS call. */
typedef struct {
    double *write, *write_basis; /* N x d x r */
    double *read, *read_basis;   /* N x 3 x r x d */
    int *write_rank, *read_rank; /* N, N x 3 */
    double *n_ov, *n_qk;         /* ||W_OV||, ||W_QK|| per head */
} Factors;

static void factors_alloc(Factors *f, int N, int d, int r) {
    f->write = xmalloc((size_t)N * d * r * sizeof(double));
    f->write_basis = xmalloc((size_t)N * d * r * sizeof(double));
    f->read = xmalloc((size_t)N * 3 * r * d * sizeof(double));
    f->read_basis = xmalloc((size_t)N * 3 * r * d * sizeof(double));
    f->write_rank = xmalloc((size_t)N * sizeof(int));
    f->read_rank = xmalloc((size_t)N * 3 * sizeof(int));
    f->n_ov = xmalloc((size_t)N * sizeof(double));
    f->n_qk = xmalloc((size_t)N * sizeof(double));
}

static void factors_free(Factors *f) {
    free(f->write), free(f->write_basis), free(f->read), free(f->read_basis);
    free(f->write_rank), free(f->read_rank), free(f->n_ov), free(f->n_qk);
}

/* Head p's factors from Wq, Wk, Wv (d x r, the weight rows) and Wo (r x d). */
static void factors_set(Factors *f, int p, const double *Wq, const double *Wk, const double *Wv, const double *Wo,
                        int d, int r) {
    size_t rr = (size_t)r * r, dr = (size_t)d * r;
    double *WoT = xmalloc(dr * sizeof(double)), *R = xmalloc(4 * rr * sizeof(double)), *T = xmalloc(dr * sizeof(double));
    for (int i = 0; i < r; i++)
        for (int j = 0; j < d; j++) WoT[(size_t)j * r + i] = Wo[(size_t)i * d + j];
    double *Rq = R, *Rk = R + rr, *Rv = R + 2 * rr, *Ro = R + 3 * rr;
    gram_root(Wq, d, r, Rq), gram_root(Wk, d, r, Rk), gram_root(Wv, d, r, Rv), gram_root(WoT, d, r, Ro);
    f->n_qk[p] = frob_of_product(Rq, Rk, r);
    f->n_ov[p] = frob_of_product(Rv, Ro, r);
    la_gemm(f->write + p * dr, WoT, 0, Rv, 1, d, r, r);
    f->write_rank[p] = basis(WoT, d, r, f->write_basis + p * dr, 0);
    const double *U2[3] = {Wq, Wk, Wv}, *S2[3] = {Rk, Rq, Ro};
    for (int k = 0; k < 3; k++) {
        double *read = f->read + ((size_t)p * 3 + k) * dr;
        la_gemm(T, U2[k], 0, S2[k], 1, d, r, r); /* d x r, stored transposed */
        for (int i = 0; i < d; i++)
            for (int c = 0; c < r; c++) read[(size_t)c * d + i] = T[(size_t)i * r + c];
        f->read_rank[p * 3 + k] = basis(U2[k], d, r, f->read_basis + ((size_t)p * 3 + k) * dr, 1);
    }
    free(WoT), free(R), free(T);
}

/* Scores and overlaps of head p1 writing into the n2 heads from p2 on: cs and pk get n2 x 3 values (head-major).
 * X is scratch of 3 n2 r x r. */
static void compose(const Factors *f, int p1, int p2, int n2, int d, int r, double *cs, double *pk, double *X) {
    size_t dr = (size_t)d * r, rr = (size_t)r * r;
    la_gemm(X, f->read + (size_t)p2 * 3 * dr, 0, f->write + p1 * dr, 0, 3 * n2 * r, d, r);
    for (int j = 0; j < 3 * n2; j++) {
        double nb = j % 3 == 2 ? f->n_ov[p2 + j / 3] : f->n_qk[p2 + j / 3], na = f->n_ov[p1];
        cs[j] = na > 0 && nb > 0 ? sqrt(la_frob2(X + j * rr, (int)rr)) / (na * nb) : NAN;
    }
    la_gemm(X, f->read_basis + (size_t)p2 * 3 * dr, 0, f->write_basis + p1 * dr, 0, 3 * n2 * r, d, r);
    for (int j = 0; j < 3 * n2; j++) {
        int ra = f->write_rank[p1], rb = f->read_rank[p2 * 3 + j];
        pk[j] = ra && rb ? la_frob2(X + j * rr, (int)rr) / (ra < rb ? ra : rb) : NAN;
    }
}

/* A random head with the roles tied as in hd (the same pointer for two roles), into f's slot p. */
static void random_head(Factors *f, int p, const Head *hd, Rng *g, int d, int r, double *store[4]) {
    for (int k = 0; k < 4; k++)
        for (size_t i = 0; i < (size_t)d * r; i++) store[k][i] = rng_normal(g);
    const double *q = store[0], *k = hd->Wk == hd->Wq ? q : store[1];
    const double *v = hd->Wv == hd->Wk ? k : hd->Wv == hd->Wq ? q : store[2];
    factors_set(f, p, q, k, v, store[3], d, r);
}

/* The stack of a layer: its name up to the '.', so that encoder and decoder layers are not paired. */
static int same_stack(const char *a, const char *b) {
    size_t n = strcspn(a, ".");
    return n == strcspn(b, ".") && !strncmp(a, b, n);
}

static const char *const MODE[3] = {"q", "k", "v"};

static cJSON *edge(const Model *m, int p1, int p2, double cs, double z) {
    cJSON *e = cJSON_CreateObject();
    char name[64];
    snprintf(name, sizeof name, "%s h%d", m->layer[p1 / m->H].name, p1 % m->H);
    cJSON_AddStringToObject(e, "from", name);
    snprintf(name, sizeof name, "%s h%d", m->layer[p2 / m->H].name, p2 % m->H);
    cJSON_AddStringToObject(e, "to", name);
    cJSON_AddItemToObject(e, "cs", num(cs));
    cJSON_AddItemToObject(e, "z", num(z));
    return e;
}

cJSON *analysis_composition(const Model *m, uint64_t seed) {
    int L = m->L, H = m->H, d = m->d, r = m->r, N = L * H;
    long pairs = 0;
    for (int l1 = 0; l1 < L; l1++)
        for (int l2 = l1 + 1; l2 < L; l2++) pairs += same_stack(m->layer[l1].name, m->layer[l2].name);
    if (!pairs) return not_applicable("no two layers of one stack: nothing composes");
    if (d < r) return not_applicable("the head dim is above the model dim");
    /* the baseline: CS of random heads with this variant's tying, per mode */
    Rng g = rng_seeded(seed, 9);
    double *store[4], mean[3] = {0}, m2[3] = {0}, *X = xmalloc((size_t)3 * H * r * r * sizeof(double));
    for (int k = 0; k < 4; k++) store[k] = xmalloc((size_t)d * r * sizeof(double));
    const Head *shape = &m->layer[0].head[0];
    Factors rf;
    factors_alloc(&rf, 2, d, r);
    for (int t = 0; t < DRAWS; t++) {
        random_head(&rf, 0, shape, &g, d, r, store);
        random_head(&rf, 1, shape, &g, d, r, store);
        double c[3], o[3];
        compose(&rf, 0, 1, 1, d, r, c, o, X);
        for (int k = 0; k < 3; k++) mean[k] += c[k] / DRAWS, m2[k] += c[k] * c[k] / DRAWS;
    }
    factors_free(&rf);
    for (int k = 0; k < 4; k++) free(store[k]);
    double sd[3];
    for (int k = 0; k < 3; k++) sd[k] = sqrt(fmax(0.0, (m2[k] - mean[k] * mean[k]) * DRAWS / (DRAWS - 1)));

    Factors f;
    factors_alloc(&f, N, d, r);
    for (int p = 0; p < N; p++) {
        const Head *hd = &m->layer[p / H].head[p % H];
        factors_set(&f, p, hd->Wq, hd->Wk, hd->Wv, hd->Wo, d, r);
    }
    /* [N x N] matrices per mode, NaN where h2 is not in a later layer of h1's stack */
    double *cs = xmalloc((size_t)3 * N * N * sizeof(double)), *pk = xmalloc((size_t)3 * N * N * sizeof(double));
    for (size_t i = 0; i < (size_t)3 * N * N; i++) cs[i] = pk[i] = NAN;
    /* sums per mode over the pairs with a finite score (a head with W_O = 0 has none as h1, and none in V as h2),
     * and for the K/V correlation over the pairs with both */
    double sum[3] = {0}, sk = 0, sv = 0, skk = 0, svv = 0, skv = 0, *in_z = xmalloc((size_t)3 * N * sizeof(double));
    long finite[3] = {0}, finite_kv = 0;
    double *c = xmalloc((size_t)3 * H * sizeof(double)), *o = xmalloc((size_t)3 * H * sizeof(double));
    for (int i = 0; i < 3 * N; i++) in_z[i] = NAN;
    for (int p1 = 0; p1 < N; p1++)
        for (int l2 = p1 / H + 1; l2 < L; l2++) {
            if (!same_stack(m->layer[p1 / H].name, m->layer[l2].name)) continue;
            compose(&f, p1, l2 * H, H, d, r, c, o, X);
            for (int h2 = 0; h2 < H; h2++) {
                int p2 = l2 * H + h2;
                for (int k = 0; k < 3; k++) {
                    size_t at = ((size_t)k * N + p1) * N + p2;
                    cs[at] = c[h2 * 3 + k], pk[at] = o[h2 * 3 + k];
                    double z = sd[k] > 0 ? (cs[at] - mean[k]) / sd[k] : NAN;
                    if (isfinite(z) && !(in_z[k * N + p2] >= z)) in_z[k * N + p2] = z;
                }
                for (int k = 0; k < 3; k++)
                    if (isfinite(c[h2 * 3 + k])) sum[k] += c[h2 * 3 + k], finite[k]++;
                double ck = c[h2 * 3 + 1], cv = c[h2 * 3 + 2];
                if (!isfinite(ck) || !isfinite(cv)) continue;
                finite_kv++;
                sk += ck, sv += cv, skk += ck * ck, svv += cv * cv, skv += ck * cv;
            }
        }
    factors_free(&f);
    free(c), free(o), free(X);

    cJSON *res = cJSON_CreateObject(), *modes = cJSON_CreateObject(), *top = cJSON_CreateObject();
    cJSON_AddTrueToObject(res, "applies");
    cJSON *s = cJSON_CreateObject();
    cJSON_AddNumberToObject(s, "pairs", (double)pairs * H * H);

    for (int k = 0; k < 3; k++) {
        cJSON *mo = cJSON_CreateObject(), *mc = cJSON_CreateArray(), *mz = cJSON_CreateArray(), *mp = cJSON_CreateArray();
        double best_z = -INFINITY;
        for (int p1 = 0; p1 < N; p1++) {
            cJSON *rc = cJSON_CreateArray(), *rz = cJSON_CreateArray(), *rp = cJSON_CreateArray();
            for (int p2 = 0; p2 < N; p2++) {
                size_t at = ((size_t)k * N + p1) * N + p2;
                double z = sd[k] > 0 && isfinite(cs[at]) ? (cs[at] - mean[k]) / sd[k] : NAN;
                if (z > best_z) best_z = z;
                cJSON_AddItemToArray(rc, num(cs[at]));
                cJSON_AddItemToArray(rz, num(z));
                cJSON_AddItemToArray(rp, num(pk[at]));
            }
            cJSON_AddItemToArray(mc, rc), cJSON_AddItemToArray(mz, rz), cJSON_AddItemToArray(mp, rp);
        }
        cJSON_AddItemToObject(mo, "cs", mc);
        cJSON_AddItemToObject(mo, "z", mz);
        cJSON_AddItemToObject(mo, "pk", mp);
        cJSON_AddItemToObject(mo, "baseline_mean", num(mean[k]));
        cJSON_AddItemToObject(mo, "baseline_sd", num(sd[k]));
        cJSON_AddItemToObject(modes, MODE[k], mo);
        /* the strongest edges, by score: selection of the largest still unused, TOP_EDGES times */
        cJSON *edges = cJSON_CreateArray();
        unsigned char *used = xcalloc((size_t)N * N, 1);
        for (int t = 0; t < TOP_EDGES; t++) {
            long best = -1;
            for (long i = 0; i < (long)N * N; i++)
                if (!used[i] && isfinite(cs[(size_t)k * N * N + i]) &&
                    (best < 0 || cs[(size_t)k * N * N + i] > cs[(size_t)k * N * N + best]))
                    best = i;
            if (best < 0) break;
            used[best] = 1;
            double score = cs[(size_t)k * N * N + best];
            cJSON_AddItemToArray(edges, edge(m, (int)(best / N), (int)(best % N), score,
                                             sd[k] > 0 ? (score - mean[k]) / sd[k] : NAN));
        }
        free(used);
        cJSON_AddItemToObject(top, MODE[k], edges);
        char key[32];
        snprintf(key, sizeof key, "mean_cs_%s", MODE[k]);
        cJSON_AddItemToObject(s, key, num(finite[k] ? sum[k] / (double)finite[k] : NAN));
        snprintf(key, sizeof key, "pairs_with_cs_%s", MODE[k]);
        cJSON_AddNumberToObject(s, key, (double)finite[k]);
        snprintf(key, sizeof key, "max_z_%s", MODE[k]);
        cJSON_AddItemToObject(s, key, num(best_z));
    }
    double np = finite_kv ? (double)finite_kv : 1.0, cov = skv / np - sk / np * (sv / np);
    double vk = skk / np - sk / np * (sk / np), vv = svv / np - sv / np * (sv / np);
    cJSON_AddItemToObject(s, "corr_cs_k_v", num(vk > 0 && vv > 0 ? cov / sqrt(vk * vv) : NAN));
    cJSON_AddNumberToObject(s, "baseline_draws", DRAWS);
    /* per head h2: the largest z of any head composing into it, per mode (NaN in the first layer of a stack) */
    cJSON *layers = cJSON_CreateArray();
    for (int l = 0; l < L; l++) {
        cJSON *row = cJSON_CreateArray();
        for (int h = 0; h < H; h++) {
            cJSON *hd = cJSON_CreateObject();
            for (int k = 0; k < 3; k++) {
                char key[32];
                snprintf(key, sizeof key, "max_in_z_%s", MODE[k]);
                cJSON_AddItemToObject(hd, key, num(in_z[k * N + l * H + h]));
            }
            cJSON_AddItemToArray(row, hd);
        }
        cJSON_AddItemToArray(layers, row);
    }
    cJSON_AddItemToObject(res, "per_head", layers);
    cJSON_AddItemToObject(res, "modes", modes);
    cJSON_AddItemToObject(res, "top_edges", top);
    cJSON_AddItemToObject(res, "summary", s);
    cJSON_AddStringToObject(res, "formula",
                            "CS_Q = CS(W_OV1, W_QK2), CS_K = CS(W_OV1, W_QK2^T), CS_V = CS(W_OV1, W_OV2) with CS(A, B) = "
                            "||AB||_F / (||A||_F ||B||_F), for h1 in an earlier layer of h2's stack; matrices [from "
                            "head][to head], head index = layer * n_head + head; z against random heads of the same "
                            "shapes and tying; PK = overlap of col(W_O1^T) with col(W_Q2), col(W_K2), col(W_V2)");
    free(cs), free(pk), free(in_z);
    return res;
}
