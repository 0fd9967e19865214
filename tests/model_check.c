#include "model_check.h"

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
            P[j] = old + 1e-5;
            double lp = loss(ctx);
            P[j] = old - 1e-5;
            double lm = loss(ctx);
            P[j] = old;
            double fd = (lp - lm) / 2e-5;
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
