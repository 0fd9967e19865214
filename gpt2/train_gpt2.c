/* train_gpt2: trains, resumes, samples from and describes the GPT-2 model
 * this binary was built for (one binary per ablation step; everything comes
 * from the build configuration).
 *
 *   train_gpt2 train --out DIR --step NAME      train (resuming if DIR holds a checkpoint of this step)
 *       [--set NAME=VALUE]...                   with run-time symbols replaced (lib/runconfig.h, docs/sweeps.md)
 *   train_gpt2 sample --ckpt FILE [options]     generate text with the KV cache
 *   train_gpt2 info                             configuration, parameters, FLOPs, cache size
 *
 * Files of step NAME in DIR: final_model_step<NAME>.safetensors,
 * best_model_step<NAME>.safetensors, state_step<NAME>.safetensors (resume
 * point, removed when the step completes) and training_metrics_step<NAME>.json. */
#define _GNU_SOURCE
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "attention.h"
#include "buildinfo.h"
#include "checkpoint.h"
#include "common.h"
#include "data.h"
#include "dist.h"
#include "kernels.h"
#include "metrics.h"
#include "model.h"
#include "rng.h"
#include "sample.h"
#include "schedule.h"
#include "trainer.h"

/* ------------------------------------------------------------------ settings */

typedef struct {
    int B, T, accum, max_iters, max_time, warmup, eval_interval, eval_iters, log_interval, ckpt_interval;
    double lr, min_lr;
    Optim optim;
    uint64_t seed;
} Hyper;

static Hyper hyper_from_kconfig(void) {
    Hyper h = {
        .B = CONFIG_GPT2_BATCH_SIZE,
        .T = CONFIG_GPT2_BLOCK_SIZE,
        .accum = CONFIG_GPT2_GRAD_ACCUM,
        .max_iters = CONFIG_GPT2_MAX_ITERS,
        .max_time = CONFIG_GPT2_MAX_TIME,
        .warmup = CONFIG_GPT2_WARMUP_ITERS,
        .eval_interval = CONFIG_GPT2_EVAL_INTERVAL,
        .eval_iters = CONFIG_GPT2_EVAL_ITERS,
        .log_interval = CONFIG_GPT2_LOG_INTERVAL,
        .ckpt_interval = CONFIG_GPT2_CHECKPOINT_INTERVAL,
        .lr = KCONFIG_NUMBER(CONFIG_GPT2_LR, 0.0, 10.0),
        .min_lr = KCONFIG_NUMBER(CONFIG_GPT2_MIN_LR, 0.0, 10.0),
        .optim = OPTIM_FROM_KCONFIG(CONFIG_GPT2_BETA1, CONFIG_GPT2_BETA2, CONFIG_GPT2_ADAM_EPS, CONFIG_GPT2_WEIGHT_DECAY,
                                   CONFIG_GPT2_GRAD_CLIP),
        .seed = CONFIG_SEED,
    };
    if (h.min_lr > h.lr)
        FATAL("CONFIG_GPT2_MIN_LR=%g is above CONFIG_GPT2_LR=%g (hint: the floor must not exceed the peak)", h.min_lr,
              h.lr);
    return h;
}


/* ------------------------------------------------------------------ run state */

typedef struct {
    TrainRun run;  /* files, progress, metrics (train/trainer.h) */
    Dataset data;
    GPT2 model;
    Hyper h;
} Run;

static const char *const TRAIN_SERIES[] = {"train_losses", "train_perplexities", "learning_rates", "timestamps",
                                           "tokens", "tokens_per_s", "ms_per_iter", "grad_norms"};
static const char *const VAL_SERIES[] = {"val_losses", "val_perplexities", "val_accuracies", "val_timestamps",
                                         "val_tokens"};

static void metrics_header(Run *r, int resumed) {
    TrainRun *t = &r->run;
    run_open_metrics(t, resumed, TRAIN_SERIES, 8, VAL_SERIES, 5);
    const GPT2Config *c = &r->model.cfg;
    Metrics *m = t->metrics;
    metrics_set_string(m, "variant_label", attn_variant_label(ATTN_VARIANT, ATTN_POS));
    metrics_set_string(m, "metric", "val_loss");
    metrics_set_number(m, "matmul_parameters", (double)gpt2_matmul_params(c));
    metrics_set_number(m, "flops_per_token", gpt2_flops_per_token(c, r->h.T));
    metrics_set_string(m, "flops_formula", "6*N_matmul + 12*L*T*C (training, attention over the full T x T)");
    metrics_set_number(m, "tokens_per_iter", (double)r->h.B * r->h.T * r->h.accum);
    metrics_set_number(m, "kv_cache_bytes_per_token", (double)gpt2_cache_bytes_per_token(c));
    run_write_metrics(t);
}

/* ------------------------------------------------------------------ evaluation */

/* Validation loss (mean over counted tokens), token accuracy; no dropout. Batch k runs on rank k % procs. */
static double evaluate(Run *r, double *acc) {
    const Hyper *h = &r->h;
    int nb = dataset_val_batches(&r->data, h->B, h->eval_iters);
    int *x = xmalloc((size_t)h->B * h->T * sizeof(int)), *y = xmalloc((size_t)h->B * h->T * sizeof(int));
    double sum[3] = {0.0, 0.0, 0.0}; /* loss sum, counted, correct */
    Err e;
    for (int k = dist_rank(); k < nb; k += dist_size()) {
        if (dataset_val_batch(&r->data, k, h->B, h->eval_iters, x, y, &e) != 0) run_die(&e);
        double l = gpt2_forward(&r->model, x, y, h->B, h->T, 0, 0);
        sum[0] += l * r->model.counted;
        sum[1] += r->model.counted;
        sum[2] += gpt2_correct(&r->model);
    }
    free(x);
    free(y);
    dist_sum(sum, 3);
    *acc = sum[1] > 0 ? sum[2] / sum[1] : 0.0;
    return sum[1] > 0 ? sum[0] / sum[1] : NAN;
}

static void eval_and_record(Run *r) {
    TrainRun *t = &r->run;
    double t0 = wall_seconds(), acc;
    double val = evaluate(r, &acc);
    int best = val < t->best_val;
    if (best) {
        t->best_val = val;
        t->best_iter = t->iter;
        run_save_model(t, t->best_path, val);
    }
    t->last_val = val;
    t->last_eval_iter = t->iter;
    t->elapsed += wall_seconds() - t0;
    metrics_append(t->metrics, "val_iterations", t->iter);
    metrics_append(t->metrics, "val_losses", val);
    metrics_append(t->metrics, "val_perplexities", perplexity(val));
    metrics_append(t->metrics, "val_accuracies", acc);
    metrics_append(t->metrics, "val_timestamps", t->elapsed);
    metrics_append(t->metrics, "val_tokens", t->examples);
    run_write_metrics(t);
    printf("eval  step %6d | val loss %.4f | ppl %8.2f | acc %.3f | best %.4f @ %d%s\n", t->iter, val,
           perplexity(val), acc, t->best_val, t->best_iter, best ? " (saved)" : "");
    fflush(stdout);
}

/* ------------------------------------------------------------------ training */

static void banner(const Run *r) {
    const GPT2Config *c = &r->model.cfg;
    const Hyper *h = &r->h;
    printf("kvlab gpt2 | step %s | attention %s | %s\n", r->run.step, attn_variant_label(ATTN_VARIANT, ATTN_POS),
           backend_name());
    printf("model: %d layers, %d heads, %d channels, context %d, vocab %d (%s) | %zu parameters\n", c->L, c->H, c->C,
           c->T, c->V, r->data.name, r->model.w.table.count);
    printf("cost: %.1f MFLOP/token (6 N_matmul + 12 L T C) | KV cache %zu bytes/token (%d tensor%s per layer)\n",
           gpt2_flops_per_token(c, h->T) / 1e6, gpt2_cache_bytes_per_token(c), attn_cache_tensors(c->variant),
           attn_cache_tensors(c->variant) == 1 ? "" : "s");
    printf("train: %d iters%s, batch %d x %d x %d accum, lr %.3g -> %.3g (warmup %d), wd %g, clip %g, seed %llu, "
           "%d threads\n", h->max_iters, h->max_time ? " or time budget" : "", h->B, h->T, h->accum, h->lr, h->min_lr,
           h->warmup, h->optim.weight_decay, h->optim.clip, (unsigned long long)h->seed, backend_threads());
    run_banner_dist(&r->run);
    fflush(stdout);
}

static void log_step(Run *r, double loss, double lr, double norm, double ms, double tps) {
    TrainRun *t = &r->run;
    const Hyper *h = &r->h;
    metrics_append(t->metrics, "iterations", t->iter);
    metrics_append(t->metrics, "train_losses", loss);
    metrics_append(t->metrics, "train_perplexities", perplexity(loss));
    metrics_append(t->metrics, "learning_rates", lr);
    metrics_append(t->metrics, "timestamps", t->elapsed);
    metrics_append(t->metrics, "tokens", t->examples);
    metrics_append(t->metrics, "tokens_per_s", tps);
    metrics_append(t->metrics, "ms_per_iter", ms);
    metrics_append(t->metrics, "grad_norms", norm);
    run_write_metrics(t);
    double left = (h->max_iters - t->iter) * ms / 1e3;
    if (h->max_time > 0 && h->max_time - t->train_seconds < left) left = h->max_time - t->train_seconds;
    char eta[32];
    format_eta(eta, sizeof eta, left);
    printf("step %6d/%d | loss %.4f | lr %.2e | norm %6.3f | %7.1f ms/step | %7.0f tok/s%s | ETA %s\n", t->iter,
           h->max_iters, loss, lr, norm, ms, tps, run_gpu_memory_note(), eta);
    fflush(stdout);
}

/* Cached decoding speed of the trained model, into the metrics (decode_tokens_per_s, decode_tokens,
 * decode_context): greedy generation through gpt2_generate from token 0 until the sequence fills the
 * context, i.e. T - 1 decode steps with the KV cache, each reading back every cached position before it.
 * Greedy, so what it generates depends on the parameters alone; only the time varies. Rank 0 (it writes
 * the metrics); counts in the step's wall time, not in its training time. */
static void measure_decode(Run *r) {
    TrainRun *t = &r->run;
    int T = r->model.cfg.T, prompt = 0;
    if (T < 2) return;
    SampleOptions opt = {.length = T - 1, .top_k = 0, .use_cache = 1, .temperature = 0.0f, .seed = r->h.seed};
    Err e;
    double t0 = wall_seconds();
    if (gpt2_generate(&r->model, &r->data, &prompt, 1, &opt, NULL, &e) != 0) run_die(&e);
    double s = wall_seconds() - t0;
    t->elapsed += s;
    double tps = s > 0 ? opt.length / s : 0.0;
    metrics_set_number(t->metrics, "decode_tokens_per_s", tps);
    metrics_set_number(t->metrics, "decode_tokens", opt.length);
    metrics_set_number(t->metrics, "decode_context", T);
    printf("decode: %d tokens with the KV cache up to context %d in %.3f s (%.0f tok/s, greedy, batch 1)\n",
           opt.length, T, s, tps);
    fflush(stdout);
}

static int train(Run *r) {
    const Hyper *h = &r->h;
    TrainRun *t = &r->run;
    GPT2 *m = &r->model;
    int *x = xmalloc((size_t)h->B * h->T * sizeof(int)), *y = xmalloc((size_t)h->B * h->T * sizeof(int));
    double interval_t = 0.0, interval_tokens = 0.0;
    int interval_n = 0;
    const char *stopped_by = "max_iters";
    Err e;
    run_catch_signals();
    while (t->iter < h->max_iters) {
        if (h->max_time > 0 && t->train_seconds >= h->max_time) {
            stopped_by = "max_time";
            break;
        }
        double t0 = wall_seconds();
        run_step_begin(t);
        double lr = lr_warmup_cosine(t->iter, h->warmup, h->max_iters, h->lr, h->min_lr);
        params_zero_grad(&m->w);
        DistRange rows = run_batch_rows(t, h->B); /* this rank's rows of every micro-batch */
        for (int k = 0; k < h->accum; k++) {
            if (dataset_train_rows(&r->data, &t->data_rng, h->B, (int)rows.lo, (int)rows.n, x, y, &e) != 0)
                run_die(&e);
            uint64_t dseed = dropout_seed(h->seed, (uint64_t)t->iter * h->accum + k, 0);
            if (rows.n) gpt2_forward_pass(m, x, y, (int)rows.n, h->T, 1, dseed);
            double counted = rows.n ? m->counted : 0;
            RunShare share = run_loss_share(t, counted, 1.0 / h->accum);
            if (counted > 0) gpt2_loss_into(m, &run_record(t)->loss, share.loss_factor);
            run_before_backward(t, k == h->accum - 1);
            if (counted > 0) gpt2_backward(m, share.backward_scale);
        }
        run_optim_step(t, &h->optim, lr, t->iter + 1);
        /* the records come back where the host needs them: the steps that log, evaluate or save, and the last */
        int it = t->iter + 1, logs = it % h->log_interval == 0 || it == 1 || it == h->max_iters;
        if ((logs || it % h->eval_interval == 0 || it % h->ckpt_interval == 0) && run_read_records(t)) {
            free(x), free(y);
            return 1;
        }
        double dt = run_step_done(t, t0, (double)h->B * h->T * h->accum);
        interval_t += dt;
        interval_tokens += (double)h->B * h->T * h->accum;
        interval_n++;
        /* the loss of this very step, so that a resumed run logs the same curve */
        if (logs) {
            const StepRecord *rec = &t->recs[t->nrecs - 1];
            log_step(r, rec->loss, lr, rec->norm, 1e3 * interval_t / interval_n, interval_tokens / interval_t);
            interval_t = interval_tokens = 0.0;
            interval_n = 0;
        }
        if (t->iter % h->eval_interval == 0 && t->iter < h->max_iters) eval_and_record(r);
        int stop = run_checkpoint_or_stop(t, t->iter % h->ckpt_interval == 0 && t->iter < h->max_iters);
        if (stop) {
            free(x), free(y);
            return stop;
        }
    }
    free(x);
    free(y);
    if (run_read_last(t)) return 1; /* a time budget ends the loop on any step */
    if (t->last_eval_iter != t->iter || t->best_iter < 0) eval_and_record(r);
    run_save_model(t, t->final_path, t->last_val);
    if (t->rank == 0) measure_decode(r);
    run_finish(t, stopped_by);
    printf("done: %d iterations (%s), %.0f tokens in %.1f s (%.0f tok/s), best val loss %.4f @ %d -> %s\n", t->iter,
           stopped_by, t->examples, t->train_seconds, t->examples / (t->train_seconds > 0 ? t->train_seconds : 1),
           t->best_val, t->best_iter, t->final_path);
    return 0;
}

/* ------------------------------------------------------------------ commands */

static void usage(void) {
    fprintf(stderr,
            "usage: train_gpt2 train --out DIR --step NAME [--set NAME=VALUE]...\n"
            "       train_gpt2 sample --ckpt FILE [--prompt TEXT] [--length N] [--temperature T] [--top-k K]\n"
            "                         [--seed S] [--no-cache]\n"
            "       train_gpt2 info\n");
    exit(2);
}

/* Data, model and the run description every command needs. */
static void setup(Run *r) {
    Err e;
    r->h = hyper_from_kconfig();
    backend_init(dist_threads(CONFIG_NUM_THREADS));
    if (dataset_load(&r->data, CONFIG_DATA_DIR, r->h.T, &e) != 0) run_die(&e);
    GPT2Config cfg = gpt2_config_from_kconfig(r->data.V);
    gpt2_init(&r->model, &cfg, r->h.seed);
    TrainRun *t = &r->run;
    t->dataset = r->data.name;
    t->loss_hint = "lower CONFIG_GPT2_LR or set CONFIG_GPT2_GRAD_CLIP";
    t->variant = attn_variant_id(ATTN_VARIANT, ATTN_POS);
    t->unit = "tokens";
    t->model_json = gpt2_config_json(&cfg);
    t->vocab_json = dataset_vocab_json(&r->data);
    t->w = &r->model.w;
}

static void teardown(Run *r) {
    run_free(&r->run);
    gpt2_free(&r->model);
    dataset_free(&r->data);
}

static SampleOptions sample_defaults(void) {
    SampleOptions opt = {.length = CONFIG_GPT2_SAMPLE_LENGTH, .top_k = CONFIG_GPT2_SAMPLE_TOP_K, .use_cache = 1,
                         .temperature = (float)KCONFIG_NUMBER(CONFIG_GPT2_SAMPLE_TEMPERATURE, 0.0, 100.0),
                         .seed = CONFIG_SEED};
    return opt;
}

/* Prints the prompt's tokens, then the continuation as it is generated. */
static void generate(Run *r, const char *prompt_text, const SampleOptions *opt) {
    Err e;
    int *prompt;
    size_t np;
    if (dataset_encode(&r->data, prompt_text, &prompt, &np, &e) != 0) run_die(&e);
    for (size_t i = 0; i < np; i++) dataset_print_token(&r->data, prompt[i], stdout);
    if (gpt2_generate(&r->model, &r->data, prompt, np, opt, stdout, &e) != 0) run_die(&e);
    free(prompt);
}

static int cmd_train(int argc, char **argv) {
    const char *out, *step;
    if (!run_train_args(argc, argv, &out, &step)) usage();
    dist_init(); /* a rank of a job when started by mpirun or srun (Kconfig Distributed) */
    Run r;
    memset(&r, 0, sizeof r);
    setup(&r);
    run_init(&r.run, "gpt2", out, step, r.h.seed);
    int resumed = run_try_resume(&r.run, r.h.max_iters);
    banner(&r);
    metrics_header(&r, resumed);
    int rc = train(&r);
    if (rc == 0 && CONFIG_GPT2_SAMPLE_LENGTH > 0 && r.run.rank == 0) {
        SampleOptions opt = sample_defaults();
        printf("sample (temperature %g, top-k %d):\n---\n", (double)opt.temperature, opt.top_k);
        generate(&r, CONFIG_GPT2_SAMPLE_PROMPT, &opt);
        printf("\n---\n");
    }
    teardown(&r);
    dist_finalize();
    return rc;
}

#define SAMPLE_NUMBER(opt, s, lo, hi, integer) \
    option_number("sample", opt, s, lo, hi, integer, "e.g. --length 200 --temperature 0.8 --top-k 40")

static int cmd_sample(int argc, char **argv) {
    const char *ckpt = NULL, *prompt_text = CONFIG_GPT2_SAMPLE_PROMPT;
    SampleOptions opt = sample_defaults();
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--ckpt") && i + 1 < argc)
            ckpt = argv[++i];
        else if (!strcmp(argv[i], "--prompt") && i + 1 < argc)
            prompt_text = argv[++i];
        else if (!strcmp(argv[i], "--length") && i + 1 < argc)
            opt.length = (int)SAMPLE_NUMBER("--length", argv[++i], 0, 100000, 1);
        else if (!strcmp(argv[i], "--temperature") && i + 1 < argc)
            opt.temperature = (float)SAMPLE_NUMBER("--temperature", argv[++i], 0, 100, 0);
        else if (!strcmp(argv[i], "--top-k") && i + 1 < argc)
            opt.top_k = (int)SAMPLE_NUMBER("--top-k", argv[++i], 0, 1e9, 1);
        else if (!strcmp(argv[i], "--seed") && i + 1 < argc)
            opt.seed = (uint64_t)SAMPLE_NUMBER("--seed", argv[++i], 0, 2147483647, 1);
        else if (!strcmp(argv[i], "--no-cache"))
            opt.use_cache = 0;
        else
            usage_refuse(argv[i]), usage();
    }
    if (!ckpt) usage();
    Run r;
    memset(&r, 0, sizeof r);
    setup(&r);
    Err e;
    if (checkpoint_load_model(ckpt, "gpt2", r.run.variant,
                              "use the binary of the step that wrote the checkpoint (output/<run>/train_gpt2_step<STEP>)",
                              r.run.model_json,
                              "the checkpoint has another model shape or vocabulary; use the binary of the step "
                              "that wrote it",
                              r.run.dataset, r.run.vocab_json, &r.model.w, &e) != 0)
        run_die(&e);
    generate(&r, prompt_text, &opt);
    fputc('\n', stdout);
    teardown(&r);
    return 0;
}

static int cmd_info(void) {
    Run r;
    memset(&r, 0, sizeof r);
    r.run.step = "-";
    setup(&r);
    banner(&r);
    build_info_print();
    teardown(&r);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2) usage();
    if (!strcmp(argv[1], "train")) return cmd_train(argc - 2, argv + 2);
    if (!strcmp(argv[1], "sample")) return cmd_sample(argc - 2, argv + 2);
    if (!strcmp(argv[1], "info")) return cmd_info();
    usage();
    return 2;
}
