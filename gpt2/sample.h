/* Generation with a KV cache: the decode side of the shared transformer
 * block (nn/block.h), one token at a time. Each layer caches the rows its
 * attention reads back: the key-role and value-role projections, which are
 * one and the same tensor for K and KV tying, so those variants keep one
 * cached tensor per layer instead of two. */
#ifndef KVLAB_GPT2_SAMPLE_H
#define KVLAB_GPT2_SAMPLE_H

#include <stdio.h>

#include "data.h"
#include "model.h"
#include "rng.h"

/* A sequence being decoded: the cache and the one-token buffers (device). */
typedef struct {
    KVCache cache;
    DecodeScratch scratch;
    act_t *x, *logits; /* (C), (V) */
    int *token;        /* (1) */
} GPT2Decoder;

void gpt2_decoder_init(GPT2Decoder *d, const GPT2 *m);
void gpt2_decoder_free(GPT2Decoder *d);
/* Bytes the cache holds per token (all layers). */
size_t gpt2_cache_bytes_per_token(const GPT2Config *cfg);
/* Appends token at the next position and returns its logits (V activations
 * of device memory, valid until the next call: act_download reads them). */
const act_t *gpt2_decode(GPT2 *m, GPT2Decoder *d, int token);

typedef struct {
    int length, top_k, use_cache;
    float temperature;
    uint64_t seed;
} SampleOptions;

/* Continues the prompt ids for opt->length tokens, printing each token to
 * out as it comes (nothing when out is NULL: timing the decode). Without the cache every token reruns the full forward
 * pass over the window (for checking the cache). Returns 0 or -1. */
int gpt2_generate(GPT2 *m, Dataset *d, const int *prompt, size_t nprompt, const SampleOptions *opt, FILE *out,
                  Err *e);

#endif
