/* One decode benchmark record: the speed of cached generation (tokens/s) of
 * the configured attention variant and K/V head count at a few context
 * lengths, and the KV-cache memory per token, both from the formula and as
 * allocated. Prints one JSON object (scripts/bench.py --only decode collects
 * them into output/bench/decode.json and prints the table).
 *
 * Generation runs through GPT-2's own decoder (gpt2/sample.c: gpt2_decode,
 * one position at a time, every layer through block_decode and the KV
 * cache), greedy: each token is the argmax of the previous one's logits,
 * read back to the host as sampling does. For each context c of 128, 512
 * and the model's maximum T (those <= T): the cache is filled by decoding
 * up to position c - N, then the N tokens at positions c - N .. c - 1 are
 * timed (the cache grows from c - N to c rows; the last token attends to c
 * positions), reps times, each repetition rewinding the cache to c - N and
 * feeding the same tokens.
 *
 * The cache bytes per token are checked two ways: kv_cache_bytes_per_token
 * (the formula) and the bytes kv_cache_init really asks dev_alloc for
 * (dev_alloc_total across a cache of T positions minus one of 1 position,
 * divided by T - 1); the program stops if they differ, so memory a variant
 * does not need (the second tensor of K and KV tying, the narrower K/V of
 * GQA and MQA) is shown not to be allocated.
 *
 * usage: bench_decode [L H C T V [tokens reps [threads]]]
 * (defaults: the configured GPT-2 shape, gpt2_config_from_kconfig, vocabulary 65,
 * 32 timed tokens per context, 5 repetitions, one thread per core) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "common.h"
#include "gpt2/model.h"
#include "gpt2/sample.h"
#include "kernels.h"

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Bytes kv_cache_init allocates for T positions of one sequence. */
static size_t cache_alloc_bytes(const GPT2Config *g, int T) {
    KVCache c;
    size_t before = dev_alloc_total();
    kv_cache_init(&c, g->L, 1, T, attn_kv_width(g->C, g->H, g->kv_heads), g->variant);
    size_t bytes = dev_alloc_total() - before;
    kv_cache_free(&c);
    return bytes;
}

/* Decodes toks[pos] at the decoder's next position; the next token (greedy) goes to toks[pos + 1]. */
static void decode_one(GPT2 *m, GPT2Decoder *d, int *toks, float *logits) {
    int pos = d->cache.len, V = m->cfg.V;
    act_download(logits, gpt2_decode(m, d, toks[pos]), (size_t)V);
    int best = 0;
    for (int i = 1; i < V; i++)
        if (logits[i] > logits[best]) best = i;
    if (pos + 1 < d->cache.T) toks[pos + 1] = best;
}

int main(int argc, char **argv) {
    GPT2Config cfg = gpt2_config_from_kconfig(65);
    int ntok = 32, reps = 5, threads = 0;
    if (argc == 6 || argc == 8 || argc == 9) {
        cfg.L = atoi(argv[1]), cfg.H = atoi(argv[2]), cfg.C = atoi(argv[3]), cfg.T = atoi(argv[4]);
        cfg.V = atoi(argv[5]);
        if (argc >= 8) ntok = atoi(argv[6]), reps = atoi(argv[7]);
        if (argc == 9) threads = atoi(argv[8]);
    } else if (argc != 1) {
        fprintf(stderr, "usage: %s [L H C T V [tokens reps [threads]]]\n", argv[0]);
        return 2;
    }
    if (cfg.L < 1 || cfg.H < 1 || cfg.C < cfg.H || cfg.C % cfg.H || cfg.T < 2 || cfg.V < 2 || ntok < 1 || reps < 1 ||
        threads < 0)
        FATAL("bench_decode: bad arguments L=%d H=%d C=%d T=%d V=%d tokens=%d reps=%d threads=%d (hint: C a "
              "multiple of H, T >= 2, at least one token and one repetition, threads >= 0)", cfg.L, cfg.H, cfg.C,
              cfg.T, cfg.V, ntok, reps, threads);
    /* the K/V heads and +Pos weight groups follow the head count given here */
    cfg.kv_heads = attn_kv_heads(cfg.H);
    cfg.pos_groups = ATTN_POS ? (ATTN_POS_PER_HEAD ? cfg.H : 1) : 0;
    if (cfg.H % cfg.kv_heads != 0)
        FATAL("bench_decode: CONFIG_ATTN_KV_HEADS=%d does not divide the %d heads (hint: build with a divisor of H, "
              "as scripts/bench.py --only decode does)", cfg.kv_heads, cfg.H);
    cfg.dropout = 0.0f;
    backend_init(threads);

    /* cache memory: the formula against what kv_cache_init allocates */
    size_t formula = gpt2_cache_bytes_per_token(&cfg);
    size_t full = cache_alloc_bytes(&cfg, cfg.T), one = cache_alloc_bytes(&cfg, 1);
    size_t grown = full - one, measured = grown / (size_t)(cfg.T - 1);
    if (grown % (size_t)(cfg.T - 1) != 0 || measured != formula)
        FATAL("bench_decode: the KV cache allocates %zu bytes for %d positions and %zu for 1, %.2f bytes per token, "
              "but kv_cache_bytes_per_token says %zu (%s, %d K/V heads): the cache holds memory the variant does "
              "not need, or the formula is wrong (nn/block.c)", full, cfg.T, one, (double)grown / (cfg.T - 1),
              formula, attn_variant_label(cfg.variant, cfg.pos), cfg.kv_heads);

    GPT2 m;
    gpt2_init(&m, &cfg, 1);
    GPT2Decoder d;
    size_t before = dev_alloc_total();
    gpt2_decoder_init(&d, &m);
    size_t decoder_bytes = dev_alloc_total() - before;

    int contexts[3] = {128, 512, cfg.T}, nctx = 0;
    for (int i = 0; i < 3; i++) /* ascending, at most T, each once */
        if (contexts[i] <= cfg.T && (nctx == 0 || contexts[i] > contexts[nctx - 1])) contexts[nctx++] = contexts[i];
    int n = ntok < contexts[0] ? ntok : contexts[0]; /* timed tokens per context */
    int *toks = xmalloc((size_t)cfg.T * sizeof(int));
    float *logits = xmalloc((size_t)cfg.V * sizeof(float));
    double *secs = xmalloc((size_t)nctx * reps * sizeof(double)), *sorted = xmalloc((size_t)reps * sizeof(double));
    toks[0] = 0;
    double t_start = wall_seconds();
    for (int k = 0; k < nctx; k++) {
        int first = contexts[k] - n;
        while (d.cache.len < first) decode_one(&m, &d, toks, logits); /* fill the cache up to c - N */
        for (int r = 0; r < reps; r++) {
            d.cache.len = first; /* rewind: the same N positions again, the same tokens */
            double t0 = wall_seconds();
            for (int i = 0; i < n; i++) decode_one(&m, &d, toks, logits);
            secs[k * reps + r] = wall_seconds() - t0;
        }
    }
    double total_s = wall_seconds() - t_start;

    printf("{\"variant\": \"%s\", \"label\": \"%s\", \"heads\": %d, \"kv_heads\": %d, \"cache_tensors\": %d, "
           "\"parameters\": %zu, \"threads\": %d, \"shape\": {\"L\": %d, \"H\": %d, \"C\": %d, \"T\": %d, \"V\": %d}, "
           "\"kv_cache_bytes_per_token\": %zu, \"kv_cache_bytes_per_token_measured\": %zu, "
           "\"kv_cache_bytes_allocated\": %zu, \"decoder_bytes_allocated\": %zu, \"tokens_timed\": %d, "
           "\"reps\": %d, \"timed_positions\": \"context-N .. context-1 (N = tokens_timed): the cache grows from "
           "context-N to context rows, the last token attends to context positions\", \"seconds\": %.3f, "
           "\"backend\": \"%s\", \"contexts\": [",
           attn_variant_id(cfg.variant, cfg.pos), attn_variant_label(cfg.variant, cfg.pos), cfg.H, cfg.kv_heads,
           d.cache.tensors, m.w.table.count, backend_threads(), cfg.L, cfg.H, cfg.C, cfg.T, cfg.V, formula, measured,
           full, decoder_bytes, n, reps, total_s, backend_name());
    for (int k = 0; k < nctx; k++) {
        memcpy(sorted, secs + k * reps, (size_t)reps * sizeof(double));
        qsort(sorted, (size_t)reps, sizeof(double), cmp_double);
        printf("%s{\"context\": %d, \"tokens_per_s\": %.1f, \"tokens_per_s_median\": %.1f, \"ms_per_token\": [",
               k ? ", " : "", contexts[k], n / sorted[0], n / sorted[reps / 2]);
        for (int r = 0; r < reps; r++) printf("%s%.4f", r ? ", " : "", 1e3 * secs[k * reps + r] / n);
        printf("]}");
    }
    printf("]}\n");
    gpt2_decoder_free(&d);
    gpt2_free(&m);
    free(toks), free(logits), free(secs), free(sorted);
    return 0;
}
