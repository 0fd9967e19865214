/* Data-driven analyses on held-out data, through the family's own forward
 * pass (runner.h): A7 attention asymmetry (Hodge), A8 head detectors, A10
 * head ablation, A11 learned K/V channel masks. */
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

static cJSON *grid_json(const double *v, int L, int H) {
    cJSON *a = cJSON_CreateArray();
    for (int l = 0; l < L; l++) {
        cJSON *row = cJSON_CreateArray();
        for (int h = 0; h < H; h++) cJSON_AddItemToArray(row, num(v[(size_t)l * H + h]));
        cJSON_AddItemToArray(a, row);
    }
    return a;
}

static void progress(const char *what, int done, int total) {
    if (getenv("KVLAB_QUIET")) return; /* tests */
    fprintf(stderr, "\r  %-28s %4d/%d", what, done, total);
    if (done == total) fputc('\n', stderr);
    fflush(stderr);
}

/* ------------------------------------------------------------------ detectors on patterns */

HeadScores head_scores(const double *A, int n, int causal, const unsigned char *valid) {
    HeadScores s = {0};
    int rows = 0, prow = 0, srow = 0;
    for (int i = 0; i < n; i++) {
        if (valid && !valid[i]) continue;
        const double *a = A + (size_t)i * n;
        double ent = 0.0, dist = 0.0, local = 0.0;
        int arg = 0;
        for (int j = 0; j < n; j++) {
            if (a[j] > 0) ent -= a[j] * log(a[j]);
            dist += a[j] * abs(i - j);
            if (abs(i - j) <= 2) local += a[j];
            if (a[j] > a[arg]) arg = j;
        }
        s.entropy += ent, s.mean_distance += dist, s.local += local, s.self += a[i], s.self_argmax += arg == i;
        rows++;
        if (i >= 1) s.prev += a[i - 1], s.sink += a[0], prow++;
        if (!causal && i + 1 < n) s.next += a[i + 1], srow++;
    }
    if (rows) s.entropy /= rows, s.mean_distance /= rows, s.local /= rows, s.self /= rows, s.self_argmax /= rows;
    if (prow) s.prev /= prow, s.sink /= prow;
    if (srow) s.next /= srow;
    return s;
}

double induction_score(const double *A, int n, int N) {
    double s = 0.0;
    int cnt = 0;
    for (int p = N; p < n && p < 2 * N; p++) s += A[(size_t)p * n + (p - N + 1)], cnt++;
    return cnt ? s / cnt : 0.0;
}

const char *head_label(double prev, double induction, double self, double sink) {
    if (induction >= 0.4) return "induction";
    if (prev >= 0.4) return "previous-token";
    if (sink >= 0.5) return "sink";
    if (self >= 0.5) return "self";
    return "mixed";
}

/* ------------------------------------------------------------------ pattern collection (A7, A8) */

typedef struct {
    BlockHook hook;
    const Runner *r;
    int L, H, max_seqs, nmap;
    int induction_N;       /* > 0: repeated-sequence batch, score the second copy */
    double *acc;           /* [L][H][NACC] sums */
    long *cnt;             /* [L][H] sequences */
    float *maps;           /* [L][H][nmap][nmap]: first sequence of the first batch */
    int maps_done;
} Collect;

enum { C_PREV, C_SELF, C_SINK, C_LOCAL, C_DIST, C_ENT, C_SELFARG, C_NEXT, C_ASYM, C_KAPPA, C_CURL, C_REV,
       C_IND, NACC };

static AttnPos hook_pos(const Runner *r, int layer, const BlockShape *s) {
    const BlockParams *bp = &r->src.bp[layer];
    AttnPos pos = {.m = s->pos_m, .groups = s->pos_groups, .w = r->w->params + bp->posw, .b = r->w->params + bp->posb,
                   .feat = s->pos_feat, .T = s->pos_T};
    return pos;
}

static void collect_after_proj(const BlockHook *hk, int layer, const act_t *in, const act_t *proj,
                               const BlockShape *s) {
    (void)in;
    Collect *c = hk->ctx;
    const Runner *r = c->r;
    int T = s->T, H = s->H;
    AttnArgs args = {.B = s->B, .T = T, .H = H, .hd = s->C / H, .kv_heads = s->kv_heads, .causal = s->causal,
                     .key_pad = s->key_pad};
    AttnPos pos = hook_pos(r, layer, s);
    size_t nn = (size_t)T * T;
    float *S = xmalloc(nn * sizeof(float)), *Af = xmalloc(nn * sizeof(float));
    float *dS = dev_alloc(nn * sizeof(float)), *dA = dev_alloc(nn * sizeof(float)); /* the kernels' outputs */
    double *Sd = xmalloc(nn * sizeof(double)), *Ad = xmalloc(nn * sizeof(double));
    unsigned char *valid = xmalloc((size_t)T), *pad = NULL;
    int nb = s->B < c->max_seqs ? s->B : c->max_seqs;
    if (s->key_pad) {
        pad = xmalloc((size_t)nb * T);
        dev_download(pad, s->key_pad, (size_t)nb * T);
    }
    for (int b = 0; b < nb; b++) {
        int n = T; /* padding sits at the end: analyse the real prefix */
        if (pad)
            while (n > 0 && pad[(size_t)b * T + n - 1]) n--;
        if (n < 2) continue;
        for (int h = 0; h < H; h++) {
            attention_scores(dS, proj, s->pos ? &pos : NULL, &args, b, h);
            attention_probs(dA, proj, s->pos ? &pos : NULL, &args, b, h);
            dev_download(S, dS, nn * sizeof(float));
            dev_download(Af, dA, nn * sizeof(float));
            for (int i = 0; i < n; i++)
                for (int j = 0; j < n; j++)
                    Sd[(size_t)i * n + j] = S[(size_t)i * T + j], Ad[(size_t)i * n + j] = Af[(size_t)i * T + j];
            for (int i = 0; i < n; i++) valid[i] = 1;
            double *acc = c->acc + ((size_t)layer * c->H + h) * NACC;
            if (c->induction_N > 0) {
                acc[C_IND] += induction_score(Ad, n, c->induction_N);
                HeadScores hs = head_scores(Ad, n, s->causal, valid);
                acc[C_PREV] += hs.prev;
            } else {
                HeadScores hs = head_scores(Ad, n, s->causal, valid);
                acc[C_PREV] += hs.prev, acc[C_SELF] += hs.self, acc[C_SINK] += hs.sink, acc[C_LOCAL] += hs.local;
                acc[C_DIST] += hs.mean_distance, acc[C_ENT] += hs.entropy, acc[C_SELFARG] += hs.self_argmax;
                acc[C_NEXT] += hs.next;
                Hodge hd = hodge(Sd, n);
                acc[C_ASYM] += hd.antisym_share, acc[C_KAPPA] += hd.kappa, acc[C_CURL] += hd.curl_share;
                if (!s->causal) acc[C_REV] += reversibility(Ad, n);
                if (!c->maps_done && b == 0) {
                    float *mp = c->maps + ((size_t)layer * c->H + h) * c->nmap * c->nmap;
                    for (int i = 0; i < c->nmap && i < n; i++)
                        for (int j = 0; j < c->nmap && j < n; j++) mp[(size_t)i * c->nmap + j] = (float)Ad[(size_t)i * n + j];
                }
            }
            c->cnt[(size_t)layer * c->H + h]++;
        }
    }
    free(S), free(Af), free(Sd), free(Ad), free(valid), free(pad);
    dev_free(dS), dev_free(dA);
}

cJSON *analysis_patterns(Runner *r, const Model *m, int batches, int max_seqs, int induction_len, uint64_t seed,
                         cJSON **maps_out) {
    int L = m->L, H = m->H;
    Collect c = {.r = r, .L = L, .H = H, .max_seqs = max_seqs};
    c.hook.after_proj = collect_after_proj;
    c.hook.ctx = &c;
    c.acc = xcalloc((size_t)L * H * NACC, sizeof(double));
    c.cnt = xcalloc((size_t)L * H, sizeof(long));
    c.nmap = 32;
    c.maps = xcalloc((size_t)L * H * c.nmap * c.nmap, sizeof(float));
    int nb = batches < r->nbatches ? batches : r->nbatches;
    for (int k = 0; k < nb; k++) {
        r->forward(r, k, &c.hook);
        c.maps_done = 1;
        progress("A7/A8 patterns on data", k + 1, nb);
    }
    double *v[NACC];
    for (int a = 0; a < NACC; a++) v[a] = xcalloc((size_t)L * H, sizeof(double));
    for (size_t i = 0; i < (size_t)L * H; i++)
        for (int a = 0; a < NACC; a++) v[a][i] = c.cnt[i] ? c.acc[i * NACC + a] / c.cnt[i] : NAN;
    /* repeated random sequences: induction (token models only) */
    double ind_loss = NAN, ind_loss_first = NAN;
    double *ind = NULL, *ind_prev = NULL;
    int N = 0;
    if (r->forward_tokens && induction_len > 0) {
        N = induction_len < r->ctx / 2 ? induction_len : r->ctx / 2;
        int B = max_seqs, T = 2 * N;
        int *x = xmalloc((size_t)B * T * sizeof(int)), *y = xmalloc((size_t)B * T * sizeof(int));
        int *y1 = xmalloc((size_t)B * T * sizeof(int));
            Rng g = rng_seeded(seed, 7);
        for (int b = 0; b < B; b++)
            for (int t = 0; t < N; t++) {
                int tok, dup;
                do { /* no repeats inside a copy (when the vocabulary allows) */
                    tok = (int)rng_below(&g, (uint64_t)r->vocab);
                    dup = 0;
                    for (int u = 0; u < t && N <= r->vocab; u++) dup |= x[(size_t)b * T + u] == tok;
                } while (dup);
                x[(size_t)b * T + t] = x[(size_t)b * T + t + N] = tok;
            }
        for (int b = 0; b < B; b++)
            for (int t = 0; t < T; t++) {
                int next = t + 1 < T ? x[(size_t)b * T + t + 1] : -1;
                y[(size_t)b * T + t] = t >= N && t + 1 < T ? next : -1;  /* second copy: predictable */
                y1[(size_t)b * T + t] = t + 1 < N ? next : -1;           /* first copy: not */
            }
        memset(c.acc, 0, (size_t)L * H * NACC * sizeof(double));
        memset(c.cnt, 0, (size_t)L * H * sizeof(long));
        c.induction_N = N;
        ind_loss = r->forward_tokens(r, x, y, B, T, &c.hook);
        ind_loss_first = r->forward_tokens(r, x, y1, B, T, NULL);
        ind = xcalloc((size_t)L * H, sizeof(double)), ind_prev = xcalloc((size_t)L * H, sizeof(double));
        for (size_t i = 0; i < (size_t)L * H; i++)
            ind[i] = c.acc[i * NACC + C_IND] / c.cnt[i], ind_prev[i] = c.acc[i * NACC + C_PREV] / c.cnt[i];
        free(x), free(y), free(y1);
    }
    cJSON *asym = cJSON_CreateObject(), *heads = cJSON_CreateObject();
    /* A7 */
    cJSON_AddTrueToObject(asym, "applies");
    cJSON *ph = cJSON_CreateArray();
    double sa = 0, sk = 0, sc = 0;
    for (int l = 0; l < L; l++) {
        cJSON *row = cJSON_CreateArray();
        for (int h = 0; h < H; h++) {
            size_t i = (size_t)l * H + h;
            cJSON *o = cJSON_CreateObject();
            cJSON_AddItemToObject(o, "antisym_share", num(v[C_ASYM][i]));
            cJSON_AddItemToObject(o, "kappa", num(v[C_KAPPA][i]));
            cJSON_AddItemToObject(o, "curl_share", num(v[C_CURL][i]));
            if (!m->layer[l].causal) cJSON_AddItemToObject(o, "reversibility", num(v[C_REV][i]));
            cJSON_AddItemToObject(o, "entropy", num(v[C_ENT][i]));
            cJSON_AddItemToArray(row, o);
            sa += v[C_ASYM][i] / (L * H), sk += v[C_KAPPA][i] / (L * H), sc += v[C_CURL][i] / (L * H);
        }
        cJSON_AddItemToArray(ph, row);
    }
    cJSON_AddItemToObject(asym, "per_head", ph);
    cJSON *s = cJSON_CreateObject();
    cJSON_AddItemToObject(s, "mean_antisym_share", num(sa));
    cJSON_AddItemToObject(s, "mean_kappa", num(sk));
    cJSON_AddItemToObject(s, "mean_curl_share", num(sc));
    cJSON_AddNumberToObject(s, "batches", nb);
    cJSON_AddNumberToObject(s, "sequences_per_batch", max_seqs);
    cJSON_AddItemToObject(asym, "summary", s);
    cJSON_AddItemToObject(asym, "grid_curl_share", grid_json(v[C_CURL], L, H));
    cJSON_AddItemToObject(asym, "grid_antisym_share", grid_json(v[C_ASYM], L, H));
    cJSON_AddStringToObject(asym, "formula",
                            "on the full pre-mask logits L of each head and sequence: N = (L - L^T)/2, "
                            "phi_j = mean_i N_ij, curl C_ij = N_ij - (phi_j - phi_i); antisym_share = |N|^2/|L - mean|^2, "
                            "kappa = |C|^2/|N|^2, curl_share = |C|^2/|double-centred L|^2; reversibility (bidirectional) "
                            "= |Pi A - (Pi A)^T| / |Pi A|");
    /* A8 */
    cJSON_AddTrueToObject(heads, "applies");
    cJSON *ph2 = cJSON_CreateArray(), *census = cJSON_CreateObject();
    for (int l = 0; l < L; l++) {
        cJSON *row = cJSON_CreateArray();
        for (int h = 0; h < H; h++) {
            size_t i = (size_t)l * H + h;
            cJSON *o = cJSON_CreateObject();
            cJSON_AddItemToObject(o, "prev", num(v[C_PREV][i]));
            cJSON_AddItemToObject(o, "self", num(v[C_SELF][i]));
            cJSON_AddItemToObject(o, "self_argmax", num(v[C_SELFARG][i]));
            cJSON_AddItemToObject(o, "sink", num(v[C_SINK][i]));
            cJSON_AddItemToObject(o, "local2", num(v[C_LOCAL][i]));
            cJSON_AddItemToObject(o, "mean_distance", num(v[C_DIST][i]));
            if (!m->layer[l].causal) cJSON_AddItemToObject(o, "next", num(v[C_NEXT][i]));
            double indv = ind ? ind[i] : NAN;
            if (ind) cJSON_AddItemToObject(o, "induction", num(indv)), cJSON_AddItemToObject(o, "prev_repeated", num(ind_prev[i]));
            const char *lab = head_label(v[C_PREV][i], ind ? indv : 0.0, v[C_SELF][i], v[C_SINK][i]);
            cJSON_AddStringToObject(o, "type", lab);
            cJSON *cnt = cJSON_GetObjectItem(census, lab);
            if (cnt)
                cJSON_SetNumberValue(cnt, cnt->valuedouble + 1);
            else
                cJSON_AddNumberToObject(census, lab, 1);
            cJSON_AddItemToArray(row, o);
        }
        cJSON_AddItemToArray(ph2, row);
    }
    cJSON_AddItemToObject(heads, "per_head", ph2);
    cJSON *s2 = cJSON_CreateObject();
    cJSON_AddItemToObject(s2, "census", census);
    if (ind) {
        cJSON_AddNumberToObject(s2, "repeat_length", N);
        cJSON_AddItemToObject(s2, "induction_loss_second_copy", num(ind_loss));
        cJSON_AddItemToObject(s2, "loss_first_copy", num(ind_loss_first));
    } else {
        cJSON_AddStringToObject(s2, "induction", r->forward_tokens
                                                     ? "not measured: CONFIG_MECHINT_INDUCTION_LEN is 0 (off)"
                                                     : "not measured: only token models (gpt2) take repeated random "
                                                       "sequences");
    }
    cJSON_AddItemToObject(heads, "summary", s2);
    cJSON_AddItemToObject(heads, "grid_prev", grid_json(v[C_PREV], L, H));
    cJSON_AddItemToObject(heads, "grid_self", grid_json(v[C_SELF], L, H));
    cJSON_AddItemToObject(heads, "grid_sink", grid_json(v[C_SINK], L, H));
    if (ind) cJSON_AddItemToObject(heads, "grid_induction", grid_json(ind, L, H));
    cJSON_AddStringToObject(heads, "rules", "induction >= 0.4 -> induction; prev >= 0.4 -> previous-token; sink >= 0.5 "
                                            "-> sink; self >= 0.5 -> self; else mixed (first match wins). "
                                            "'mul' scores: mean attention mass; BOS/first position not excluded.");
    /* attention maps (first sequence, first 32 positions) for the plots */
    cJSON *maps = cJSON_CreateArray();
    for (int l = 0; l < L; l++) {
        cJSON *row = cJSON_CreateArray();
        for (int h = 0; h < H; h++) {
            cJSON *mat = cJSON_CreateArray();
            const float *mp = c.maps + ((size_t)l * H + h) * c.nmap * c.nmap;
            for (int i = 0; i < c.nmap; i++) {
                cJSON *mr = cJSON_CreateArray();
                for (int j = 0; j < c.nmap; j++) cJSON_AddItemToArray(mr, cJSON_CreateNumber(round(mp[i * c.nmap + j] * 1e4) / 1e4));
                cJSON_AddItemToArray(mat, mr);
            }
            cJSON_AddItemToArray(row, mat);
        }
        cJSON_AddItemToArray(maps, row);
    }
    *maps_out = maps;
    cJSON *both = cJSON_CreateObject();
    cJSON_AddItemToObject(both, "attn_asymmetry", asym);
    cJSON_AddItemToObject(both, "head_types", heads);
    for (int a = 0; a < NACC; a++) free(v[a]);
    free(ind), free(ind_prev), free(c.acc), free(c.cnt), free(c.maps);
    return both;
}

/* ------------------------------------------------------------------ A10 head ablation */

typedef struct {
    BlockHook hook;
    int layer, head, mode; /* mode 0: record means, 1: zero, 2: mean */
    int r, T, C;
    double *mean;          /* [L][T][C] sums of head outputs per position */
    long *mcount;          /* [L] batch rows */
    float *atty;           /* host copy of the head outputs the hook sees */
    size_t cap;
} Ablate;

static void ablate_after_attn(const BlockHook *hk, int layer, act_t *dev_atty, const BlockShape *s) {
    Ablate *a = hk->ctx;
    size_t C = (size_t)s->C, n = (size_t)s->B * s->T * C, bytes = n * sizeof(float);
    if (a->mode != 0 && layer != a->layer) return;
    if (bytes > a->cap) {
        free(a->atty);
        a->atty = xmalloc(bytes);
        a->cap = bytes;
    }
    float *atty = a->atty;
    act_download(atty, dev_atty, n);
    if (a->mode == 0) {
        for (int b = 0; b < s->B; b++)
            for (int t = 0; t < s->T && t < a->T; t++)
                for (size_t k = 0; k < C; k++)
                    a->mean[((size_t)layer * a->T + t) * C + k] += atty[((size_t)b * s->T + t) * C + k];
        a->mcount[layer] += s->B;
        return;
    }
    for (int b = 0; b < s->B; b++)
        for (int t = 0; t < s->T; t++) {
            float *z = atty + ((size_t)b * s->T + t) * C + (size_t)a->head * a->r;
            for (int k = 0; k < a->r; k++) {
                double mu = a->mcount[layer] && t < a->T
                                ? a->mean[((size_t)layer * a->T + t) * C + (size_t)a->head * a->r + k] / a->mcount[layer]
                                : 0.0;
                z[k] = a->mode == 1 ? 0.0f : (float)mu;
            }
        }
    act_upload(dev_atty, atty, n);
}

static double head_ablation_delta(Runner *r, int layer, int head, int mode, int batches, const double *clean,
                           void *state) {
    Ablate *a = state;
    a->layer = layer, a->head = head, a->mode = mode;
    double d = 0.0;
    for (int k = 0; k < batches; k++) d += r->forward(r, k, &a->hook) - clean[k];
    return d / batches;
}

cJSON *analysis_ablation(Runner *r, const Model *m, int batches) {
    int L = m->L, H = m->H, nb = batches < r->nbatches ? batches : r->nbatches;
    Ablate a = {.r = m->r, .C = m->d, .T = r->max_T};
    a.hook.after_attn = ablate_after_attn;
    a.hook.ctx = &a;
    double *clean = xmalloc((size_t)nb * sizeof(double)), clean_mean = 0.0;
    /* clean pass, recording the mean head outputs per position */
    a.mean = xcalloc((size_t)L * a.T * a.C, sizeof(double));
    a.mcount = xcalloc((size_t)L, sizeof(long));
    for (int k = 0; k < nb; k++) {
        a.mode = 0;
        clean[k] = r->forward(r, k, &a.hook);
        clean_mean += clean[k] / nb;
    }
    double *dz = xmalloc((size_t)L * H * sizeof(double)), *dm = xmalloc((size_t)L * H * sizeof(double));
    int done = 0;
    for (int l = 0; l < L; l++)
        for (int h = 0; h < H; h++) {
            dz[(size_t)l * H + h] = head_ablation_delta(r, l, h, 1, nb, clean, &a);
            dm[(size_t)l * H + h] = head_ablation_delta(r, l, h, 2, nb, clean, &a);
            progress("A10 head ablation", ++done, L * H);
        }
    /* circuit size: heads (by mean-ablation importance) whose removal is needed to lose 90% of the summed effect */
    double tot = 0.0;
    int *ord = xmalloc((size_t)L * H * sizeof(int));
    for (int i = 0; i < L * H; i++) ord[i] = i, tot += fmax(dm[i], 0.0);
    for (int i = 0; i < L * H; i++)
        for (int j = i + 1; j < L * H; j++)
            if (dm[ord[j]] > dm[ord[i]]) {
                int t = ord[i];
                ord[i] = ord[j], ord[j] = t;
            }
    int needed = 0;
    double acc = 0.0;
    while (needed < L * H && acc < 0.9 * tot) acc += fmax(dm[ord[needed++]], 0.0);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddTrueToObject(o, "applies");
    cJSON *ph = cJSON_CreateArray();
    for (int l = 0; l < L; l++) {
        cJSON *row = cJSON_CreateArray();
        for (int h = 0; h < H; h++) {
            cJSON *c = cJSON_CreateObject();
            cJSON_AddItemToObject(c, "dloss_zero", num(dz[(size_t)l * H + h]));
            cJSON_AddItemToObject(c, "dloss_mean", num(dm[(size_t)l * H + h]));
            cJSON_AddItemToArray(row, c);
        }
        cJSON_AddItemToArray(ph, row);
    }
    cJSON_AddItemToObject(o, "per_head", ph);
    cJSON_AddItemToObject(o, "grid_dloss_mean", grid_json(dm, L, H));
    cJSON_AddItemToObject(o, "grid_dloss_zero", grid_json(dz, L, H));
    cJSON *s = cJSON_CreateObject();
    cJSON_AddItemToObject(s, "clean_loss", num(clean_mean));
    cJSON_AddNumberToObject(s, "batches", nb);
    cJSON_AddStringToObject(s, "data", r->data_desc);
    cJSON_AddNumberToObject(s, "heads_for_90pct_of_effect", needed);
    cJSON_AddNumberToObject(s, "heads", L * H);
    double mx = -INFINITY;
    int arg = 0;
    for (int i = 0; i < L * H; i++)
        if (dm[i] > mx) mx = dm[i], arg = i;
    cJSON_AddItemToObject(s, "max_dloss_mean", num(mx));
    char name[32];
    snprintf(name, sizeof name, "L%dH%d", arg / H, arg % H);
    cJSON_AddStringToObject(s, "most_important_head", name);
    cJSON_AddItemToObject(o, "summary", s);
    cJSON_AddStringToObject(o, "formula", "dloss = loss(head output replaced) - loss(clean), averaged over held-out "
                                          "batches; zero: output 0; mean: the head's mean output at that position");
    free(clean), free(dz), free(dm), free(ord), free(a.mean), free(a.mcount), free(a.atty);
    return o;
}
