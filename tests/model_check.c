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
    for (size_t k = 0; k < w->table.total; k++) p[k] *= scale;
    params_from_host(w, w->params, p);
    return p;
}

int gradcheck(const char *name, const Params *w, double *P, double (*loss)(void *ctx), void *ctx, int samples,
              double *worst_rel) {
    float *g = params_to_host(w, w->grads);
    int bad = 0;
    *worst_rel = 0.0;
    for (int i = 0; i < w->table.n; i++) {
        const ParamSpec *s = &w->table.specs[i];
        double err = 0.0, fdmax = 0.0;
        size_t step = s->numel > (size_t)samples ? s->numel / (size_t)samples : 1;
        for (size_t k = 0; k < s->numel; k += step) {
            size_t j = s->offset + k;
            double old = P[j];
            /* step 1e-7: the float64 loss is exact to ~1e-14, so the difference stays ~1e-7 accurate, far
             * below the tolerance, and a ReLU model rarely has a pre-activation within reach of its kink (the
             * char-GPT with RoPE crossed kinks in 7 of 31 tensors at 1e-5, 2 at 1e-6, none at 1e-7) */
            P[j] = old + 1e-7;
            double lp = loss(ctx);
            P[j] = old - 1e-7;
            double lm = loss(ctx);
            P[j] = old;
            double fd = (lp - lm) / 2e-7;
            err = fmax(err, fabs(fd - g[j]));
            fdmax = fmax(fdmax, fabs(fd));
        }
        if (err > 2e-3 * fdmax + 1e-6) {
            printf("  %s: %s gradient error %.3g (max |fd| %.3g)\n", name, s->name, err, fdmax);
            bad++;
        }
        if (fdmax > 0) *worst_rel = fmax(*worst_rel, err / fdmax);
    }
    free(g);
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
