#include "params.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "kernels.h"

static size_t param_vadd(ParamTable *t, const char *name, int decay, int next, int ndim, va_list ap) {
    if (ndim < 1 || ndim > PARAM_MAX_DIMS) FATAL("param_add: %s: %d dimensions", name, ndim);
    if (strlen(name) >= PARAM_NAME_MAX) FATAL("param_add: name too long: %s", name);
    if (t->n == t->cap) {
        t->cap = t->cap ? 2 * t->cap : 64;
        t->specs = xrealloc(t->specs, (size_t)t->cap * sizeof(ParamSpec));
    }
    ParamSpec *s = &t->specs[t->n++];
    memset(s, 0, sizeof *s);
    snprintf(s->name, sizeof s->name, "%s", name);
    s->ndim = ndim;
    s->decay = decay;
    s->numel = 1;
    for (int d = 0; d < ndim; d++) {
        s->shape[d] = va_arg(ap, int);
        s->numel *= (size_t)s->shape[d];
    }
    if (next && t->n == 1) FATAL("param_add_next: %s: no tensor before it", name);
    s->offset = next ? t->total : (t->total + PARAM_ALIGN - 1) / PARAM_ALIGN * PARAM_ALIGN;
    t->total = s->offset + s->numel;
    t->count += s->numel;
    return s->offset;
}

size_t param_add(ParamTable *t, const char *name, int decay, int ndim, ...) {
    va_list ap;
    va_start(ap, ndim);
    size_t off = param_vadd(t, name, decay, 0, ndim, ap);
    va_end(ap);
    return off;
}

size_t param_add_next(ParamTable *t, const char *name, int decay, int ndim, ...) {
    va_list ap;
    va_start(ap, ndim);
    size_t off = param_vadd(t, name, decay, 1, ndim, ap);
    va_end(ap);
    return off;
}

const ParamSpec *param_find(const ParamTable *t, const char *name) {
    for (int i = 0; i < t->n; i++)
        if (strcmp(t->specs[i].name, name) == 0) return &t->specs[i];
    return NULL;
}

void param_table_free(ParamTable *t) {
    free(t->specs);
    memset(t, 0, sizeof *t);
}

void params_alloc(Params *p) {
    size_t bytes = p->table.total * sizeof(float);
    p->params = dev_alloc(bytes);
    p->grads = dev_alloc(bytes);
    p->m = dev_alloc(bytes);
    p->v = dev_alloc(bytes);
}

void params_free(Params *p) {
    dev_free(p->params), dev_free(p->grads), dev_free(p->m), dev_free(p->v);
    param_table_free(&p->table);
    memset(p, 0, sizeof *p);
}

void params_init(Params *p, uint64_t seed, ParamInit rule, void *ctx) {
    float *host = xcalloc(p->table.total, sizeof(float));
    Rng rng = rng_seeded(seed, 1);
    for (int i = 0; i < p->table.n; i++) rule(&p->table.specs[i], host + p->table.specs[i].offset, &rng, ctx);
    dev_upload(p->params, host, p->table.total * sizeof(float));
    free(host);
}

void params_zero_grad(Params *p) { dev_zero(p->grads, p->table.total * sizeof(float)); }

void params_adamw(Params *p, float lr, float beta1, float beta2, float eps, float weight_decay, int t) {
    params_adamw_slice(p, p->m, p->v, 0, p->table.total, lr, beta1, beta2, eps, weight_decay, t);
}

void params_adamw_slice(Params *p, float *m, float *v, size_t lo, size_t n, float lr, float beta1, float beta2,
                        float eps, float weight_decay, int t) {
    if (lo + n > p->table.total) FATAL("params_adamw_slice: [%zu, %zu) of %zu values", lo, lo + n, p->table.total);
    /* each tensor's part of [lo, lo + n), with its weight decay: one batched call (one GPU launch per ~100) */
    AdamwSpan *spans = xmalloc((size_t)(p->table.n > 0 ? p->table.n : 1) * sizeof *spans);
    int k = 0;
    for (int i = 0; i < p->table.n; i++) {
        const ParamSpec *s = &p->table.specs[i];
        size_t a = s->offset > lo ? s->offset : lo, b = s->offset + s->numel < lo + n ? s->offset + s->numel : lo + n;
        if (a >= b) continue;
        spans[k++] = (AdamwSpan){.offset = a, .state_offset = a - lo, .n = b - a,
                                 .weight_decay = s->decay ? weight_decay : 0.0f};
    }
    adamw_update_spans(p->params, p->grads, m, v, spans, k, lr, beta1, beta2, eps, t);
    free(spans);
}

float *params_to_host(const Params *p, const float *buf) {
    float *host = xmalloc(p->table.total * sizeof(float));
    dev_download(host, buf, p->table.total * sizeof(float));
    return host;
}

void params_from_host(Params *p, float *buf, const float *host) {
    dev_upload(buf, host, p->table.total * sizeof(float));
}
