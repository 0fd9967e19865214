#include "sample.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "kernels.h"

size_t kv_cache_bytes_per_token(const GPT2Config *cfg) {
    return (size_t)cfg->L * (size_t)attn_cache_tensors(cfg->variant) * (size_t)cfg->C * sizeof(float);
}

void kv_cache_init(KVCache *c, const GPT2 *m) {
    const GPT2Config *g = &m->cfg;
    memset(c, 0, sizeof *c);
    c->L = g->L;
    c->T = g->T;
    c->C = g->C;
    c->tensors = attn_cache_tensors(g->variant);
    size_t n = (size_t)g->L * g->T * g->C;
    c->keys = dev_alloc(n * sizeof(float));
    c->values = c->tensors == 2 ? dev_alloc(n * sizeof(float)) : c->keys;
    int P = attn_num_proj(g->variant);
    c->x = dev_alloc((size_t)g->C * sizeof(float));
    c->ln = dev_alloc((size_t)g->C * sizeof(float));
    c->proj = dev_alloc((size_t)P * g->C * sizeof(float));
    c->att = dev_alloc((size_t)g->C * sizeof(float));
    c->branch = dev_alloc((size_t)g->C * sizeof(float));
    c->fc = dev_alloc((size_t)4 * g->C * sizeof(float));
    c->fc_act = dev_alloc((size_t)4 * g->C * sizeof(float));
    c->logits = dev_alloc((size_t)g->V * sizeof(float));
}

void kv_cache_free(KVCache *c) {
    if (c->values != c->keys) dev_free(c->values);
    dev_free(c->keys);
    dev_free(c->x), dev_free(c->ln), dev_free(c->proj), dev_free(c->att), dev_free(c->branch);
    dev_free(c->fc), dev_free(c->fc_act), dev_free(c->logits);
    memset(c, 0, sizeof *c);
}

const float *gpt2_decode(GPT2 *m, KVCache *c, int token) {
    const GPT2Config *g = &m->cfg;
    int C = g->C, P = attn_num_proj(g->variant), t = c->len;
    int kb = attn_key_block(g->variant), vb = attn_value_block(g->variant);
    if (t >= c->T) FATAL("gpt2_decode: cache full (%d positions)", c->T);
    float mean, rstd;
    const float *W = m->params;
    embedding_forward(c->x, &token, W + m->wte, W + m->wpe + (size_t)t * C, 1, 1, C, g->V, 1.0f);
    for (int l = 0; l < g->L; l++) {
        const BlockParams *lp = &m->layer[l];
        float *keys = c->keys + (size_t)l * c->T * C, *values = c->values + (size_t)l * c->T * C;
        layernorm_forward(c->ln, &mean, &rstd, c->x, W + lp->ln1w, g->bias ? W + lp->ln1b : NULL, 1, C);
        linear_forward(c->proj, c->ln, W + lp->attnw, g->attn_bias ? W + lp->attnb : NULL, 1, C, P * C);
        /* cache this position's key-role and value-role rows */
        memcpy(keys + (size_t)t * C, c->proj + (size_t)kb * C, (size_t)C * sizeof(float));
        if (c->tensors == 2) memcpy(values + (size_t)t * C, c->proj + (size_t)vb * C, (size_t)C * sizeof(float));
        AttnPos pos = {.m = g->pos_m, .groups = g->pos_groups, .w = W + lp->posw, .b = W + lp->posb,
                       .feat = m->pos_feat, .T = g->T};
        attention_decode(c->att, c->proj, keys, values, C, t, g->H, C / g->H, g->pos ? &pos : NULL);
        linear_forward(c->branch, c->att, W + lp->projw, g->bias ? W + lp->projb : NULL, 1, C, C);
        residual_forward(c->x, c->x, c->branch, (size_t)C);
        layernorm_forward(c->ln, &mean, &rstd, c->x, W + lp->ln2w, g->bias ? W + lp->ln2b : NULL, 1, C);
        linear_forward(c->fc, c->ln, W + lp->fcw, g->bias ? W + lp->fcb : NULL, 1, C, 4 * C);
        if (g->gelu)
            gelu_forward(c->fc_act, c->fc, (size_t)4 * C);
        else
            relu_forward(c->fc_act, c->fc, (size_t)4 * C);
        linear_forward(c->branch, c->fc_act, W + lp->fcpw, g->bias ? W + lp->fcpb : NULL, 1, 4 * C, C);
        residual_forward(c->x, c->x, c->branch, (size_t)C);
    }
    layernorm_forward(c->ln, &mean, &rstd, c->x, W + m->lnfw, g->bias ? W + m->lnfb : NULL, 1, C);
    linear_forward(c->logits, c->ln, W + m->headw, !g->tie && g->head_bias ? W + m->headb : NULL, 1, C, g->V);
    c->len++;
    return c->logits;
}

/* Temperature and top-k sampling from logits (modified in place). */
static int sample_token(float *logits, int V, const SampleOptions *opt, Rng *rng) {
    if (opt->temperature <= 0.0f) { /* greedy */
        int best = 0;
        for (int i = 1; i < V; i++)
            if (logits[i] > logits[best]) best = i;
        return best;
    }
    if (opt->top_k > 0 && opt->top_k < V) { /* keep the k largest: threshold = k-th largest value */
        float *sorted = xmalloc((size_t)V * sizeof(float));
        memcpy(sorted, logits, (size_t)V * sizeof(float));
        int k = opt->top_k;
        for (int i = 0; i < k; i++) { /* partial selection, k is small */
            int best = i;
            for (int j = i + 1; j < V; j++)
                if (sorted[j] > sorted[best]) best = j;
            float tmp = sorted[i];
            sorted[i] = sorted[best];
            sorted[best] = tmp;
        }
        float thr = sorted[k - 1];
        free(sorted);
        for (int i = 0; i < V; i++)
            if (logits[i] < thr) logits[i] = -INFINITY;
    }
    float mx = -INFINITY;
    for (int i = 0; i < V; i++) mx = logits[i] > mx ? logits[i] : mx;
    double sum = 0.0;
    for (int i = 0; i < V; i++) sum += exp((double)(logits[i] - mx) / opt->temperature);
    double u = rng_uniform(rng) * sum, acc = 0.0;
    int last = 0;
    for (int i = 0; i < V; i++) {
        if (logits[i] == -INFINITY) continue; /* masked by top-k */
        last = i;
        acc += exp((double)(logits[i] - mx) / opt->temperature);
        if (acc >= u) return i;
    }
    return last; /* rounding, or a NaN sum: the last token top-k kept, never a masked one */
}

int gpt2_generate(GPT2 *m, Dataset *d, const int *prompt, size_t nprompt, const SampleOptions *opt, FILE *out,
                  Err *e) {
    const GPT2Config *g = &m->cfg;
    if (nprompt == 0) return err_set(e, "sample: empty prompt");
    size_t total = nprompt + (size_t)opt->length;
    int *toks = xmalloc(total * sizeof(int));
    memcpy(toks, prompt, nprompt * sizeof(int));
    float *logits = xmalloc((size_t)g->V * sizeof(float));
    Rng rng = rng_seeded(opt->seed, 77);
    KVCache cache;
    if (opt->use_cache) kv_cache_init(&cache, m);
    size_t n = nprompt, start = 0; /* the window is toks[start, n) */
    if (n > (size_t)g->T) start = n - (size_t)g->T;
    if (opt->use_cache)
        for (size_t i = start; i < n; i++) memcpy(logits, gpt2_decode(m, &cache, toks[i]), (size_t)g->V * 4);
    for (int k = 0; k < opt->length; k++) {
        if (!opt->use_cache) { /* full forward over the window, logits of its last position */
            size_t T = n - start;
            gpt2_forward(m, toks + start, NULL, 1, (int)T, 0, 0);
            dev_download(logits, m->acts.logits + (T - 1) * (size_t)g->V, (size_t)g->V * sizeof(float));
        }
        int next = sample_token(logits, g->V, opt, &rng);
        toks[n++] = next;
        dataset_print_token(d, next, out);
        fflush(out);
        if (n - start > (size_t)g->T) { /* the window is full: slide it by half a context */
            start = n - (size_t)g->T / 2;
            if (opt->use_cache) {
                cache.len = 0;
                for (size_t i = start; i + 1 < n; i++) gpt2_decode(m, &cache, toks[i]);
            }
        }
        if (opt->use_cache && k + 1 < opt->length) memcpy(logits, gpt2_decode(m, &cache, next), (size_t)g->V * 4);
    }
    if (opt->use_cache) kv_cache_free(&cache);
    free(logits);
    free(toks);
    return 0;
}
