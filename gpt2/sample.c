#include "sample.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "kernels.h"

/* one cached row: kv_heads * head_dim activations (C without grouped K/V heads) */
static int kv_dim(const GPT2Config *g) { return attn_kv_width(g->C, g->H, g->kv_heads); }

size_t gpt2_cache_bytes_per_token(const GPT2Config *cfg) {
    return kv_cache_bytes_per_token(cfg->L, kv_dim(cfg), cfg->variant);
}

void gpt2_decoder_init(GPT2Decoder *d, const GPT2 *m) {
    const GPT2Config *g = &m->cfg;
    kv_cache_init(&d->cache, g->L, 1, g->T, kv_dim(g), g->variant);
    decode_scratch_init(&d->scratch, 1, g->C, g->H, 4 * g->C, attn_proj_width(g->variant, g->C, kv_dim(g)));
    d->x = dev_alloc((size_t)g->C * sizeof(act_t));
    d->logits = dev_alloc((size_t)g->V * sizeof(act_t));
    d->token = dev_alloc(sizeof(int));
}

void gpt2_decoder_free(GPT2Decoder *d) {
    kv_cache_free(&d->cache);
    decode_scratch_free(&d->scratch);
    dev_free(d->x), dev_free(d->logits), dev_free(d->token);
    memset(d, 0, sizeof *d);
}

const act_t *gpt2_decode(GPT2 *m, GPT2Decoder *d, int token) {
    const GPT2Config *g = &m->cfg;
    int C = g->C, t = d->cache.len;
    if (t >= d->cache.T) FATAL("gpt2_decode: cache full (%d positions)", d->cache.T);
    const float *W = m->w.params;
    dev_upload(d->token, &token, sizeof(int));
    const float *pe = gpt2_positions(m);
    embedding_forward(d->x, d->token, W + m->wte, pe ? pe + (size_t)t * C : NULL, 1, 1, C, g->V, 1.0f);
    for (int l = 0; l < g->L; l++) {
        BlockShape s = gpt2_block_shape(m, 1, 1, 0, 0, l);
        block_decode(d->x, t, &d->cache, l, W, &m->layer[l], NULL, &s, &d->scratch);
    }
    DecodeScratch *sc = &d->scratch;
    layernorm_forward(sc->ln, sc->mean, sc->rstd, d->x, W + m->lnfw, g->bias ? W + m->lnfb : NULL, 1, C);
    linear_forward(d->logits, sc->ln, W + m->headw, !g->tie && g->head_bias ? W + m->headb : NULL, 1, C, g->V);
    d->cache.len++;
    return d->logits;
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
    size_t total = nprompt + (size_t)opt->length, V = (size_t)g->V;
    int *toks = xmalloc(total * sizeof(int));
    memcpy(toks, prompt, nprompt * sizeof(int));
    float *logits = xmalloc(V * sizeof(float));
    Rng rng = rng_seeded(opt->seed, 77);
    GPT2Decoder dec;
    if (opt->use_cache) gpt2_decoder_init(&dec, m);
    size_t n = nprompt, start = 0; /* the window is toks[start, n) */
    if (n > (size_t)g->T) start = n - (size_t)g->T;
    if (opt->use_cache)
        for (size_t i = start; i < n; i++) act_download(logits, gpt2_decode(m, &dec, toks[i]), V);
    for (int k = 0; k < opt->length; k++) {
        if (!opt->use_cache) { /* full forward over the window, logits of its last position */
            size_t T = n - start;
            gpt2_forward(m, toks + start, NULL, 1, (int)T, 0, 0);
            act_download(logits, m->acts.logits + (T - 1) * V, V);
        }
        int next = sample_token(logits, gpt2_data_vocab(g), opt, &rng); /* never a padding token */
        toks[n++] = next;
        if (out) {
            dataset_print_token(d, next, out);
            fflush(out);
        }
        if (n - start > (size_t)g->T) { /* the window is full: slide it by half a context */
            start = n - (size_t)g->T / 2;
            if (opt->use_cache) {
                dec.cache.len = 0;
                for (size_t i = start; i + 1 < n; i++) gpt2_decode(m, &dec, toks[i]);
            }
        }
        if (opt->use_cache && k + 1 < opt->length) act_download(logits, gpt2_decode(m, &dec, next), V);
    }
    if (opt->use_cache) gpt2_decoder_free(&dec);
    free(logits);
    free(toks);
    return 0;
}
