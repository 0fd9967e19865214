/* Generation with a KV cache. Each layer caches the rows its attention
 * reads back: the key-role and value-role projections, which are one and
 * the same tensor for K and KV tying, so those variants keep one cached
 * tensor per layer instead of two. */
#ifndef KVLAB_GPT2_SAMPLE_H
#define KVLAB_GPT2_SAMPLE_H

#include <stdio.h>

#include "data.h"
#include "model.h"
#include "rng.h"

typedef struct {
    int L, T, C, tensors; /* tensors per layer: 2 (key, value) or 1 */
    float *keys, *values; /* (L, T, C) each; values == keys when tensors == 1 */
    int len;              /* positions cached */
    float *x, *ln, *proj, *att, *branch, *fc, *fc_act, *logits; /* one-token scratch */
} KVCache;

void kv_cache_init(KVCache *c, const GPT2 *m);
void kv_cache_free(KVCache *c);
/* Bytes the cache holds per token (all layers). */
size_t kv_cache_bytes_per_token(const GPT2Config *cfg);
/* Appends token at the next position and returns its logits (V floats,
 * valid until the next call). */
const float *gpt2_decode(GPT2 *m, KVCache *c, int token);

typedef struct {
    int length, top_k, use_cache;
    float temperature;
    uint64_t seed;
} SampleOptions;

/* Continues the prompt ids for opt->length tokens, printing each token to
 * out as it comes. Without the cache every token reruns the full forward
 * pass over the window (for checking the cache). Returns 0 or -1. */
int gpt2_generate(GPT2 *m, Dataset *d, const int *prompt, size_t nprompt, const SampleOptions *opt, FILE *out,
                  Err *e);

#endif
