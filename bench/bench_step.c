/* One benchmark record: the training-step speed of the configured attention
 * variant at a fixed GPT-2 shape, next to the backend's own matmul rate
 * (linear_forward at 2048^3: OpenBLAS's sgemm on the CPU, cuBLAS on a GPU,
 * TF32 tensor cores when CUDA_TF32 is on) measured in the same process.
 * Only the interface of kernels.h is used, so one program times either
 * target; every timing ends with a wait for the device (a download), so a
 * GPU's asynchronous queue is timed whole. Prints one JSON object
 * (scripts/bench.py collects them into output/bench/bench.json).
 *
 * With --profile, PROFILE_STEPS more steps run under the backend's profile
 * (kernels.h, kprof_start) after the timed ones, and the record adds where
 * their time went: ms and calls per step of every op of the interface and, on
 * a GPU, of every kernel and cuBLAS product inside them.
 *
 * usage: bench_step [--profile] [L H C T B V steps] (defaults: the issue's
 * shape 6 6 384 256 12 65, 10 timed steps after 2 warm-up steps) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "bench.h"
#include "common.h"
#include "gpt2/model.h"
#include "kernels.h"
#include "rng.h"
#include "trainer.h"

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* A device buffer of n floats (weights), and one of n activations, from values made on the host. */
static float *uploaded(const float *host, size_t n) {
    float *d = dev_alloc(n * sizeof(float));
    dev_upload(d, host, n * sizeof(float));
    return d;
}

static act_t *uploaded_act(const float *host, size_t n) {
    act_t *d = dev_alloc(n * sizeof(act_t));
    act_upload(d, host, n);
    return d;
}

/* GFLOP/s of reps n^3 matmuls of the backend (linear_forward, no bias) into rates[]; returns the median. Each
 * sample times a batch of calls long enough (>= 20 ms) that the wait for the device and a GPU's launch are
 * noise: one call on the CPU, hundreds on a fast GPU. */
static double sgemm_gflops(int n, int reps, double *rates) {
    size_t nn = (size_t)n * n;
    float *h = xmalloc(nn * sizeof(float));
    for (size_t i = 0; i < nn; i++) h[i] = (float)(i % 7) * 0.1f;
    act_t *a = uploaded_act(h, nn), *c = dev_alloc(nn * sizeof(act_t));
    for (size_t i = 0; i < nn; i++) h[i] = (float)(i % 5) * 0.1f;
    float *b = uploaded(h, nn);
    double *t = xmalloc((size_t)reps * sizeof(double));
    int calls = 1;
    for (;;) { /* warm-up, and the batch size */
        double t0 = wall_seconds();
        for (int i = 0; i < calls; i++) linear_forward(c, a, b, NULL, n, n, n);
        device_wait(c);
        if (wall_seconds() - t0 >= 0.02 || calls >= 1 << 16) break;
        calls *= 2;
    }
    for (int r = 0; r < reps; r++) {
        double t0 = wall_seconds();
        for (int i = 0; i < calls; i++) linear_forward(c, a, b, NULL, n, n, n);
        device_wait(c);
        t[r] = (wall_seconds() - t0) / calls;
    }
    for (int r = 0; r < reps; r++) rates[r] = 2.0 * n * n * (double)n / t[r] / 1e9;
    qsort(t, (size_t)reps, sizeof(double), cmp_double);
    double g = 2.0 * n * n * (double)n / t[reps / 2] / 1e9;
    dev_free(a), dev_free(b), dev_free(c), free(t), free(h);
    return g;
}

/* Median ms of one self-attention forward + backward at (B, T, H, C): bidirectional, as an encoder or ViT
 * layer would run it, or causal, as GPT-2's. */
static double attention_ms(int B, int T, int H, int C, int reps, int causal) {
    int hd = C / H, m = ATTN_POS_DIM, groups = ATTN_POS_PER_HEAD ? H : 1, G = attn_kv_heads(H);
    size_t np = (size_t)B * T * attn_proj_width(ATTN_VARIANT, C, G * hd), no = (size_t)B * T * C;
    float *h = xmalloc((np > no ? np : no) * sizeof(float));
    Rng rng = rng_seeded(5, 6);
    for (size_t i = 0; i < np; i++) h[i] = (float)rng_normal(&rng);
    act_t *proj = uploaded_act(h, np), *dproj = dev_alloc(np * sizeof(act_t));
    for (size_t i = 0; i < no; i++) h[i] = (float)rng_normal(&rng);
    act_t *dout = uploaded_act(h, no), *out = dev_alloc(no * sizeof(act_t));
    float *lse = dev_alloc((size_t)B * H * T * sizeof(float));
    free(h);
    AttnPos pos = {0};
    AttnPosGrad dpos = {0};
    float *feat = NULL;
    if (ATTN_POS) {
        feat = attn_pos_features_dev(T, m);
        pos = (AttnPos){.m = m, .groups = groups, .feat = feat, .T = T, .w = dev_alloc((size_t)groups * m * 4),
                        .b = dev_alloc((size_t)groups * 4)};
        dpos = (AttnPosGrad){.dw = dev_alloc((size_t)groups * m * 4), .db = dev_alloc((size_t)groups * 4)};
    }
    AttnArgs a = {.B = B, .T = T, .H = H, .hd = hd, .kv_heads = G, .causal = causal};
    double *t = xmalloc((size_t)reps * sizeof(double));
    for (int r = -1; r < reps; r++) {
        double t0 = wall_seconds();
        attention_forward(out, lse, proj, ATTN_POS ? &pos : NULL, &a);
        attention_backward(dproj, ATTN_POS ? &dpos : NULL, dout, proj, out, lse, ATTN_POS ? &pos : NULL, &a);
        device_wait(dproj);
        if (r >= 0) t[r] = wall_seconds() - t0;
    }
    qsort(t, (size_t)reps, sizeof(double), cmp_double);
    double ms = 1e3 * t[reps / 2];
    dev_free(proj), dev_free(dproj), dev_free(out), dev_free(dout), dev_free(lse), dev_free(feat);
    if (ATTN_POS) dev_free((void *)pos.w), dev_free((void *)pos.b), dev_free(dpos.dw), dev_free(dpos.db);
    free(t);
    return ms;
}

/* One training step: forward, backward, AdamW (step s; s < 0 for the warm-up). */
static void train_step(GPT2 *m, const int *in, const int *tg, int B, int T, int s) {
    gpt2_forward_pass(m, in, tg, B, T, 1, (uint64_t)s); /* the loss stays on the device, as in training */
    params_zero_grad(&m->w);
    gpt2_backward(m, 1.0f);
    params_adamw(&m->w, 1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, s + 3);
}

enum { PROFILE_STEPS = 3 };

/* Prints the record's "profile": PROFILE_STEPS steps under the backend's profile, per step (profile_json). */
static void print_profile(GPT2 *m, const int *in, const int *tg, int B, int T, int first) {
    const KprofRow *rows;
    kprof_start();
    double t0 = wall_seconds();
    for (int s = 0; s < PROFILE_STEPS; s++) train_step(m, in, tg, B, T, first + s);
    int n = kprof_stop(&rows); /* waits for the device */
    cJSON *o = profile_json(rows, n, PROFILE_STEPS, 1e3 * (wall_seconds() - t0) / PROFILE_STEPS);
    char *text = cJSON_PrintUnformatted(o);
    printf(", \"profile\": %s", text);
    free(text);
    cJSON_Delete(o);
}

int main(int argc, char **argv) {
    int L = 6, H = 6, C = 384, T = 256, B = 12, V = 65, steps = 10, profile = 0;
    if (argc > 1 && !strcmp(argv[1], "--profile")) profile = 1, argc--, argv++;
    if (argc == 8) {
        L = atoi(argv[1]), H = atoi(argv[2]), C = atoi(argv[3]), T = atoi(argv[4]), B = atoi(argv[5]);
        V = atoi(argv[6]), steps = atoi(argv[7]);
    } else if (argc != 1) {
        fprintf(stderr, "usage: bench_step [--profile] [L H C T B V steps]\n");
        return 2;
    }
    if (L < 1 || H < 1 || C < H || C % H || T < 2 || B < 1 || V < 2 || steps < 1)
        FATAL("bench_step: bad arguments L=%d H=%d C=%d T=%d B=%d V=%d steps=%d (hint: C a multiple of H, T >= 2, at "
              "least one row and one step)", L, H, C, T, B, V, steps);
    backend_init(0);
    GPT2Config cfg = {.V = V, .T = T, .L = L, .H = H, .C = C, .bias = 1, .attn_bias = 1, .tie = 1, .gelu = 1,
                      .variant = ATTN_VARIANT, .pos = ATTN_POS, .pos_m = ATTN_POS_DIM,
                      .pos_groups = ATTN_POS ? (ATTN_POS_PER_HEAD ? H : 1) : 0, .kv_heads = attn_kv_heads(H)};
    if (H % cfg.kv_heads != 0) FATAL("bench: CONFIG_ATTN_KV_HEADS=%d does not divide the %d heads", cfg.kv_heads, H);
    GPT2 m;
    gpt2_init(&m, &cfg, 1);
    int *in = xmalloc((size_t)B * T * sizeof(int)), *tg = xmalloc((size_t)B * T * sizeof(int));
    Rng rng = rng_seeded(1, 2);
    for (int i = 0; i < B * T; i++) in[i] = (int)rng_below(&rng, V), tg[i] = (int)rng_below(&rng, V);
    double rates[10];
    double sg_before = sgemm_gflops(2048, 5, rates);
    dev_mem_peak_reset(); /* the steps' peak: the model, its activations and optimizer state */
    double *t = xmalloc((size_t)steps * sizeof(double));
    for (int s = -2; s < steps; s++) {
        double t0 = wall_seconds();
        train_step(&m, in, tg, B, T, s);
        device_wait(m.w.params);
        if (s >= 0) t[s] = wall_seconds() - t0;
    }
    size_t step_peak = dev_mem_peak();
    double sg_after = sgemm_gflops(2048, 5, rates + 5);
    double *sorted = xmalloc((size_t)steps * sizeof(double));
    memcpy(sorted, t, (size_t)steps * sizeof(double));
    qsort(sorted, (size_t)steps, sizeof(double), cmp_double);
    double ms = 1e3 * sorted[steps / 2];
    double fpt = gpt2_flops_per_token(&cfg, T);
    double tokens = (double)B * T, gflops = fpt * tokens / (ms * 1e-3) / 1e9;
    double sg = sg_before > sg_after ? sg_before : sg_after;
    /* the symmetric-score saving: bidirectional attention alone, with and
     * (for KV and K) without the each-pair-once path */
    double attn_ms = attention_ms(B, T, H, C, 10, 0), attn_general_ms = -1.0;
    if (attn_key_block(ATTN_VARIANT) == 0) {
        attention_set_symmetric_path(0);
        attn_general_ms = attention_ms(B, T, H, C, 10, 0);
        attention_set_symmetric_path(1);
    }
    /* GPT-2's causal attention alone; on a GPU with bf16 products beside the WMMA kernels (attention.h) */
    double causal_ms = attention_ms(B, T, H, C, 10, 1), causal_wmma_ms = -1.0;
    if (!strncmp(backend_name(), "cuda", 4) && (IS_ENABLED(CONFIG_CUDA_BF16) || IS_ENABLED(CONFIG_CUDA_BF16_MATMUL))) {
        attention_set_mma_path(0);
        causal_wmma_ms = attention_ms(B, T, H, C, 10, 1);
        attention_set_mma_path(1);
    }
    /* a GPU's memory (the CPU backend does not count it): peak allocated during the steps, and the device's */
    char memory[96] = "";
    if (dev_mem_capacity() > 0)
        snprintf(memory, sizeof memory, ", \"memory_peak_mib\": %.1f, \"memory_total_mib\": %.0f",
                 step_peak / 1048576.0, dev_mem_capacity() / 1048576.0);
    /* attention FLOPs counted over the causal triangle only, for reference */
    double fpt_causal = fpt - 6.0 * L * (double)T * C;
    printf("{\"variant\": \"%s\", \"label\": \"%s\", \"kv_heads\": %d, \"parameters\": %zu, \"flops_per_token\": %.0f, "
           "\"ms_per_step\": %.2f, \"tokens_per_s\": %.0f, \"gflops\": %.2f, \"sgemm_gflops\": %.2f, "
           "\"ratio\": %.4f, \"threads\": %d, \"shape\": {\"L\": %d, \"H\": %d, \"C\": %d, \"T\": %d, \"B\": %d, "
           "\"V\": %d}, \"steps\": %d, \"ratio_causal_flops\": %.4f, \"bidir_attention_ms\": %.2f, "
           "\"bidir_attention_ms_general_path\": %.2f, \"causal_attention_ms\": %.2f, "
           "\"causal_attention_ms_wmma\": %.2f, \"backend\": \"%s\"%s, \"step_ms\": [",
           attn_variant_id(ATTN_VARIANT, ATTN_POS), attn_variant_label(ATTN_VARIANT, ATTN_POS), cfg.kv_heads,
           m.w.table.count, fpt,
           ms, tokens / (ms * 1e-3), gflops, sg, gflops / sg, backend_threads(), L, H, C, T, B, V, steps,
           fpt_causal * tokens / (ms * 1e-3) / 1e9 / sg, attn_ms, attn_general_ms, causal_ms, causal_wmma_ms,
           backend_name(),
           memory);
    for (int s = 0; s < steps; s++) printf("%s%.3f", s ? ", " : "", 1e3 * t[s]);
    printf("], \"sgemm_gflops_runs\": [");
    for (int r = 0; r < 10; r++) printf("%s%.2f", r ? ", " : "", rates[r]);
    printf("]");
    if (profile) print_profile(&m, in, tg, B, T, steps);
    printf("}\n");
    gpt2_free(&m);
    free(in), free(tg), free(t), free(sorted);
    return 0;
}
