#include "model_check.h"

#include "attention.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

float *perturb_params(Params *w, float scale) {
    float *p = params_to_host(w, w->params);
    for (int i = 0; i < w->table.n; i++) {
        const ParamSpec *s = &w->table.specs[i];
        if (strstr(s->name, "ln") && strstr(s->name, ".weight"))
            for (size_t k = 0; k < s->numel; k++) p[s->offset + k] = 1.0f + 0.2f * (float)cos(5.0 * k + i);
        else if (strstr(s->name, ".bias") || strstr(s->name, ".pos."))
            for (size_t k = 0; k < s->numel; k++) p[s->offset + k] = 0.1f * (float)sin(3.0 * k + i);
        else if (strstr(s->name, ".rel_bias")) /* relative bias: distinct per bucket, large enough to matter */
            for (size_t k = 0; k < s->numel; k++) p[s->offset + k] = 0.8f * (float)sin(1.7 * k + i);
    }
    for (int i = 0; i < w->table.n; i++)
        for (size_t k = 0; k < w->table.specs[i].numel; k++) p[w->table.specs[i].offset + k] *= scale;
    params_from_host(w, w->params, p);
    return p;
}

int init_matches(const char *what, const float *p, const ParamSpec *s, InitRule rule, double x) {
    static const char *const rules[] = {"constant", "normal", "uniform"};
    const float *v = p + s->offset;
    size_t n = s->numel, off = 0, distinct = 0;
    double sum = 0.0, sq = 0.0, amax = 0.0;
    for (size_t k = 0; k < n; k++) {
        double y = v[k];
        if (rule == INIT_CONST ? y != x : !isfinite(y) || (rule == INIT_UNIFORM && fabs(y) > x * (1.0 + 1e-6))) off++;
        distinct += k > 0 && v[k] != v[0];
        sum += y, sq += y * y, amax = fmax(amax, fabs(y));
    }
    double mean = n ? sum / (double)n : 0.0, sd = n > 1 ? sqrt(fmax(0.0, (sq - sum * mean) / (double)(n - 1))) : 0.0;
    double want_sd = rule == INIT_UNIFORM ? x / sqrt(3.0) : x;
    int ok = off == 0;
    if (rule != INIT_CONST) {
        if (n >= 2 && distinct == 0) ok = 0;
        if (n >= 1000)
            ok = ok && fabs(sd / want_sd - 1.0) <= 0.1 && fabs(mean) <= 5.0 * want_sd / sqrt((double)n) &&
                 (rule != INIT_UNIFORM || amax > 0.9 * x);
    }
    if (!ok)
        printf("  %s: %s (%zu values) is not %s %g: %zu values off, mean %.4g, sd %.4g (the rule's %.4g), max |x| "
               "%.4g\n", what, s->name, n, rules[rule], x, off, mean, sd, rule == INIT_CONST ? 0.0 : want_sd, amax);
    return ok;
}

int init_errors(const char *what, const Params *w, InitRuleOf rule_of, const void *ctx) {
    float *p = params_to_host(w, w->params);
    int bad = 0;
    for (int i = 0; i < w->table.n; i++) {
        double x = 0.0;
        InitRule rule = rule_of(&w->table.specs[i], ctx, &x);
        bad += !init_matches(what, p, &w->table.specs[i], rule, x);
    }
    free(p);
    return bad;
}

/* b may continue a's fused block: both "<prefix>attn.<block>.<kind>" with the same prefix and kind, b's block a
 * later one of the variant's (attn_block_name), or v after k in cross-attention ("xattn.") */
static int fused_next(const char *a, const char *b) {
    const char *pa = strstr(a, "attn."), *pb = strstr(b, "attn."), *ka = strrchr(a, '.'), *kb = strrchr(b, '.');
    if (!pa || !pb || pa - a != pb - b || strncmp(a, b, (size_t)(pa - a)) || strcmp(ka, kb)) return 0;
    const char *blk = pb + 5;
    size_t len = (size_t)(kb - blk);
    if (pb > b && pb[-1] == 'x') return len == 1 && *blk == 'v';
    for (int p = 1; p < attn_num_proj(ATTN_VARIANT); p++) {
        const char *want = attn_block_name(ATTN_VARIANT, p);
        if (strlen(want) == len && !strncmp(blk, want, len)) return 1;
    }
    return 0;
}

int param_layout_errors(const char *name, const Params *w) {
    const ParamTable *t = &w->table;
    int bad = 0;
    size_t end = 0, count = 0;
    unsigned char *used = xcalloc(t->total, 1);
    for (int i = 0; i < t->n; i++) {
        const ParamSpec *s = &t->specs[i];
        if (s->offset < end) printf("  %s: %s at %zu overlaps the tensor before it (ends at %zu)\n", name, s->name,
                                    s->offset, end), bad++;
        if (s->offset % PARAM_ALIGN && !(i > 0 && s->offset == end && fused_next(t->specs[i - 1].name, s->name)))
            printf("  %s: %s at %zu: not a multiple of %d floats, nor a fused block after %s\n", name, s->name,
                   s->offset, PARAM_ALIGN, i > 0 ? t->specs[i - 1].name : "nothing"), bad++;
        end = s->offset + s->numel;
        count += s->numel;
        if (end <= t->total) memset(used + s->offset, 1, s->numel);
    }
    if (end > t->total || count != t->count)
        printf("  %s: tensors end at %zu of %zu floats, %zu parameters counted %zu\n", name, end, t->total, count,
               t->count), bad++;
    float *p = params_to_host(w, w->params), *g = params_to_host(w, w->grads);
    size_t gaps = 0, nonzero = 0;
    for (size_t k = 0; k < t->total; k++)
        if (!used[k]) gaps++, nonzero += p[k] != 0.0f || g[k] != 0.0f;
    if (nonzero) printf("  %s: %zu of the %zu gap floats are not zero\n", name, nonzero, gaps), bad++;
    free(p), free(g), free(used);
    return bad;
}

int gradcheck(const char *name, const Params *w, double *P, double (*loss)(void *ctx), void *ctx, int samples,
              double *worst_rel) {
    float *g = params_to_host(w, w->grads);
    int bad = 0, n = w->table.n;
    double *err = xcalloc((size_t)n, sizeof(double)), *fdmax = xcalloc((size_t)n, sizeof(double)), top = 0.0;
    *worst_rel = 0.0;
    for (int i = 0; i < n; i++) {
        const ParamSpec *s = &w->table.specs[i];
        size_t step = s->numel > (size_t)samples ? s->numel / (size_t)samples : 1;
        for (size_t k = 0; k < s->numel; k += step) {
            size_t j = s->offset + k;
            /* central differences at step 1e-5 (the float64 loss keeps ~1e-8 absolute accuracy there); an
             * entry off at that step is measured again at 1e-7, where a ReLU model rarely has a pre-activation
             * within reach of its kink (the char-GPT with RoPE crossed kinks in 7 of 31 tensors at 1e-5, none
             * at 1e-7), and the closer of the two counts. Both estimate the same derivative: a wrong gradient
             * is off at both. (1e-7 alone is too noisy for gradients near 0, e.g. a key bias's.) */
            double fd = ref_central_difference(P, j, 1e-5, loss, ctx);
            if (fabs(fd - g[j]) > 2e-3 * fabs(fd) + 1e-6) {
                double fd2 = ref_central_difference(P, j, 1e-7, loss, ctx);
                if (fabs(fd2 - g[j]) < fabs(fd - g[j])) fd = fd2;
            }
            err[i] = fmax(err[i], fabs(fd - g[j]));
            fdmax[i] = fmax(fdmax[i], fabs(fd));
        }
        top = fmax(top, fdmax[i]);
    }
    /* pass: within 2e-3 of the tensor's largest difference, plus an absolute floor at float32 resolution of
     * the model's largest gradient (1e-6 of it, at least 1e-6): a gradient that is 0 by symmetry (a key
     * bias: softmax rows sum to one) comes out of float32 sums as ~1e-7 of the terms it cancels */
    double floor = 1e-6 * fmax(1.0, top);
    for (int i = 0; i < n; i++) {
        if (err[i] > 2e-3 * fdmax[i] + floor) {
            printf("  %s: %s gradient error %.3g (max |fd| %.3g)\n", name, w->table.specs[i].name, err[i], fdmax[i]);
            bad++;
        }
        if (fdmax[i] > 0) *worst_rel = fmax(*worst_rel, err[i] / fdmax[i]);
    }
    free(g), free(err), free(fdmax);
    return bad;
}

long position_param_delta(int L, int H, int T, int C) {
    long d = ATTN_POSITION == ATTN_POSITION_ABSOLUTE ? 0 : -(long)T * C;
    if (ATTN_POSITION == ATTN_POSITION_REL_BIAS) d += (long)L * H * CONFIG_POSITION_REL_BUCKETS;
    return d;
}

double ref_abs_position(const double *P, size_t learned, int t, int k, int C) {
    if (ATTN_POSITION == ATTN_POSITION_ABSOLUTE) return P[learned + (size_t)t * C + k];
    if (ATTN_POSITION != ATTN_POSITION_SINUSOIDAL) return 0.0;
    double w = pow(10000.0, -(double)(k - k % 2) / C);
    return k % 2 ? cos(t * w) : sin(t * w);
}

RefPositions ref_layer_positions(const double *P, const BlockParams *lp) {
    RefPositions pe = {ATTN_POSITION, (double)CONFIG_POSITION_ROPE_BASE,
                       ATTN_POSITION == ATTN_POSITION_REL_BIAS ? P + lp->relw : NULL, CONFIG_POSITION_REL_BUCKETS,
                       CONFIG_POSITION_REL_MAX_DISTANCE};
    return pe;
}

/* the index of the tensor at offset `off` of w's table, or -1 */
static int spec_at(const ParamTable *t, size_t off) {
    for (int i = 0; i < t->n; i++)
        if (t->specs[i].offset == off) return i;
    return -1;
}

/* whether the n floats at a are all zero */
static int all_zero(const float *a, size_t n) {
    for (size_t k = 0; k < n; k++)
        if (a[k] != 0.0f) return 0;
    return 1;
}

int attn_grads_only_errors(const char *name, Params *w, void (*pass)(void *ctx), void *ctx,
                           const BlockParams *const *blocks, int nblocks) {
    const ParamTable *t = &w->table;
    pass(ctx);
    float *full = params_to_host(w, w->grads);
    w->attn_grads_only = 1;
    pass(ctx);
    w->attn_grads_only = 0;
    float *only = params_to_host(w, w->grads);
    int bad = 0, P = attn_num_proj(ATTN_VARIANT);
    for (int l = 0; l < nblocks; l++) {
        const BlockParams *b = blocks[l];
        /* the projections: P weight blocks from attnw, and P bias blocks from attnb where the model has them */
        int iw = spec_at(t, b->attnw), ib = spec_at(t, b->attnb);
        int biased = ib >= 0 && strstr(t->specs[ib].name, "attn.") && str_ends_with(t->specs[ib].name, ".bias");
        for (int k = 0; k < P * (biased ? 2 : 1); k++) {
            int i = (k < P ? iw : ib) + k % P;
            const ParamSpec *s = iw >= 0 && i < t->n ? &t->specs[i] : NULL;
            if (!s || !strstr(s->name, "attn.")) {
                printf("  %s: block %d: no projection tensor %d after %s\n", name, l, k % P, s ? s->name : "?"), bad++;
                continue;
            }
            if (memcmp(full + s->offset, only + s->offset, s->numel * sizeof(float)))
                printf("  %s: %s: its gradient differs without the other products' weight gradients\n", name,
                       s->name), bad++;
        }
        /* the products the flag skips: zero with it, not without it (else the comparison shows nothing) */
        const size_t skipped[3] = {b->projw, b->fcw, b->fcpw};
        for (int k = 0; k < 3; k++) {
            int i = spec_at(t, skipped[k]);
            if (i < 0) {
                printf("  %s: block %d: no tensor at offset %zu\n", name, l, skipped[k]), bad++;
                continue;
            }
            const ParamSpec *s = &t->specs[i];
            if (!all_zero(only + s->offset, s->numel) || all_zero(full + s->offset, s->numel))
                printf("  %s: %s: gradient %s with attn_grads_only, %s without\n", name, s->name,
                       all_zero(only + s->offset, s->numel) ? "zero" : "not zero",
                       all_zero(full + s->offset, s->numel) ? "zero" : "not zero"), bad++;
        }
    }
    free(full), free(only);
    return bad;
}
