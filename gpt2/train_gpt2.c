/* train_gpt2: trains, resumes, samples from and describes the GPT-2 model
 * this binary was built for (one binary per ablation step; everything comes
 * from the build configuration).
 *
 *   train_gpt2 train --out DIR --step NAME      train (resuming if DIR holds a checkpoint of this step)
 *   train_gpt2 sample --ckpt FILE [options]     generate text with the KV cache
 *   train_gpt2 info                             configuration, parameters, FLOPs, cache size
 *
 * Files of step NAME in DIR: final_model_step<NAME>.safetensors,
 * best_model_step<NAME>.safetensors, state_step<NAME>.safetensors (resume
 * point, removed when the step completes) and training_metrics_step<NAME>.json. */
#define _GNU_SOURCE
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "attention.h"
#include "buildinfo.h"
#include "checkpoint.h"
#include "common.h"
#include "data.h"
#include "kernels.h"
#include "metrics.h"
#include "model.h"
#include "rng.h"
#include "sample.h"

/* ------------------------------------------------------------------ settings */

typedef struct {
    int B, T, accum, max_iters, max_time, warmup, eval_interval, eval_iters, log_interval, ckpt_interval;
    double lr, min_lr, wd, beta1, beta2, eps, clip;
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
        .wd = KCONFIG_NUMBER(CONFIG_GPT2_WEIGHT_DECAY, 0.0, 10.0),
        .beta1 = KCONFIG_NUMBER(CONFIG_GPT2_BETA1, 0.0, 0.999999),
        .beta2 = KCONFIG_NUMBER(CONFIG_GPT2_BETA2, 0.0, 0.999999),
        .eps = KCONFIG_NUMBER(CONFIG_GPT2_ADAM_EPS, 1e-30, 1.0),
        .clip = KCONFIG_NUMBER(CONFIG_GPT2_GRAD_CLIP, 0.0, 1e9),
        .seed = CONFIG_SEED,
    };
    if (h.min_lr > h.lr)
        FATAL("CONFIG_GPT2_MIN_LR=%g is above CONFIG_GPT2_LR=%g (hint: the floor must not exceed the peak)", h.min_lr,
              h.lr);
    return h;
}

/* Linear warmup, then cosine from lr down to min_lr at the last step. */
static double learning_rate(const Hyper *h, int it) {
    if (it < h->warmup) return h->lr * (it + 1) / h->warmup;
    if (h->max_iters <= h->warmup + 1) return h->lr;
    double p = (double)(it - h->warmup) / (double)(h->max_iters - 1 - h->warmup);
    if (p > 1.0) p = 1.0;
    return h->min_lr + 0.5 * (1.0 + cos(M_PI * p)) * (h->lr - h->min_lr);
}

/* ------------------------------------------------------------------ run state */

typedef struct {
    const char *out, *step;
    char final_path[4096], best_path[4096], state_path[4096], metrics_path[4096];
    Dataset data;
    GPT2 model;
    Hyper h;
    Metrics *metrics;
    char *model_json, *vocab_json;
    /* progress, all part of the resume state */
    int iter;              /* optimiser steps done */
    Rng data_rng;
    double train_seconds;  /* time spent in training steps (the wall-time budget) */
    double elapsed;        /* wall time since the step started, across resumes */
    double tokens;         /* training tokens processed */
    double best_val;
    int best_iter, last_eval_iter;
    double last_val;
} Run;

static volatile sig_atomic_t g_stop_signal;

static void on_signal(int sig) { g_stop_signal = sig; }

static void die(const char *what, const Err *e) {
    fflush(stdout);
    fprintf(stderr, "error: %s%s%s\n", what ? what : "", what ? ": " : "", e->msg);
    _exit(1);
}

/* ------------------------------------------------------------------ checkpoints */

static void u64_text(char *buf, size_t n, uint64_t v) { snprintf(buf, n, "%llu", (unsigned long long)v); }

/* Metadata common to every file a step writes (formats.md 1.5). */
static int base_meta(const Run *r, StMeta *meta, char bufs[][64]) {
    int n = 0;
    meta[n++] = (StMeta){"family", "gpt2"};
    meta[n++] = (StMeta){"variant", attn_variant_id(ATTN_VARIANT, ATTN_POS)};
    meta[n++] = (StMeta){"config", build_config_json()};
    meta[n++] = (StMeta){"model", r->model_json};
    meta[n++] = (StMeta){"dataset", r->data.name};
    meta[n++] = (StMeta){"tokenizer", r->vocab_json};
    meta[n++] = (StMeta){"ablation_step", r->step};
    meta[n++] = (StMeta){"git_commit", build_git_commit()};
    u64_text(bufs[0], 64, r->h.seed);
    meta[n++] = (StMeta){"seed", bufs[0]};
    snprintf(bufs[1], 64, "%d", r->iter);
    meta[n++] = (StMeta){"step", bufs[1]};
    snprintf(bufs[2], 64, "%.0f", unix_seconds());
    meta[n++] = (StMeta){"created_unix", bufs[2]};
    snprintf(bufs[3], 64, "%.9g", r->best_val);
    meta[n++] = (StMeta){"best_val_loss", bufs[3]};
    return n;
}

static void save_model(Run *r, const char *path, double val_loss) {
    StMeta meta[20];
    char bufs[8][64];
    int n = base_meta(r, meta, bufs);
    snprintf(bufs[4], 64, "%.9g", val_loss);
    meta[n++] = (StMeta){"val_loss", bufs[4]};
    Err e;
    if (checkpoint_save(path, &r->model.table, r->model.params, NULL, NULL, meta, n, &e) != 0) die(NULL, &e);
}

static void save_state(Run *r) {
    StMeta meta[24];
    char bufs[12][64];
    int n = base_meta(r, meta, bufs);
    u64_text(bufs[4], 64, r->data_rng.state);
    meta[n++] = (StMeta){"data_rng", bufs[4]};
    snprintf(bufs[5], 64, "%.17g", r->train_seconds);
    meta[n++] = (StMeta){"train_seconds", bufs[5]};
    snprintf(bufs[6], 64, "%.17g", r->elapsed);
    meta[n++] = (StMeta){"elapsed_seconds", bufs[6]};
    snprintf(bufs[7], 64, "%.17g", r->tokens);
    meta[n++] = (StMeta){"tokens", bufs[7]};
    snprintf(bufs[8], 64, "%d", r->best_iter);
    meta[n++] = (StMeta){"best_val_iteration", bufs[8]};
    snprintf(bufs[9], 64, "%d", r->last_eval_iter);
    meta[n++] = (StMeta){"last_eval_iteration", bufs[9]};
    snprintf(bufs[10], 64, "%.17g", r->last_val);
    meta[n++] = (StMeta){"last_val_loss", bufs[10]};
    Err e;
    GPT2 *m = &r->model;
    if (checkpoint_save(r->state_path, &m->table, m->params, m->m, m->v, meta, n, &e) != 0) die(NULL, &e);
}

static double meta_number(StFile *f, const char *key) {
    const char *s = st_meta(f, key);
    char *end;
    double v = s ? strtod(s, &end) : 0.0;
    if (!s || *end) {
        Err e;
        err_set(&e, "%s: metadata '%s' is missing or not a number (hint: the state file is damaged; move it away "
                    "to restart the step)", st_path(f), key);
        die(NULL, &e);
    }
    return v;
}

/* Continues from state_step<STEP>.safetensors when it exists. */
static int try_resume(Run *r) {
    if (!file_exists(r->state_path)) return 0;
    Err e;
    StFile *f = checkpoint_open(r->state_path, "gpt2", &e);
    if (!f) die(NULL, &e);
    if (checkpoint_expect(f, "variant", attn_variant_id(ATTN_VARIANT, ATTN_POS),
                          "it belongs to another ablation step; use that step's binary", &e) != 0 ||
        checkpoint_expect(f, "config", build_config_json(),
                          "it was written with another configuration; make archives such outputs before running, or "
                          "move the file away to restart the step", &e) != 0 ||
        checkpoint_read(f, &r->model.table, r->model.params, r->model.m, r->model.v, &e) != 0)
        die(NULL, &e);
    r->iter = (int)meta_number(f, "step");
    const char *rng = st_meta(f, "data_rng");
    r->data_rng.state = rng ? strtoull(rng, NULL, 10) : 0;
    r->train_seconds = meta_number(f, "train_seconds");
    r->elapsed = meta_number(f, "elapsed_seconds");
    r->tokens = meta_number(f, "tokens");
    r->best_val = meta_number(f, "best_val_loss");
    r->best_iter = (int)meta_number(f, "best_val_iteration");
    r->last_eval_iter = (int)meta_number(f, "last_eval_iteration");
    r->last_val = meta_number(f, "last_val_loss");
    st_close(f);
    printf("resuming step %s from iteration %d (%s)\n", r->step, r->iter, r->state_path);
    return 1;
}

/* ------------------------------------------------------------------ metrics */

static const char *const TRAIN_SERIES[] = {"train_losses", "train_perplexities", "learning_rates", "timestamps",
                                           "tokens", "tokens_per_s", "ms_per_iter", "grad_norms"};
static const char *const VAL_SERIES[] = {"val_losses", "val_perplexities", "val_accuracies", "val_timestamps",
                                         "val_tokens"};

static double ppl(double loss) { return exp(loss < 20.0 ? loss : 20.0); }

static void write_metrics(Run *r) {
    Err e;
    metrics_set_number(r->metrics, "final_iteration", r->iter);
    metrics_set_number(r->metrics, "best_val_loss", r->best_val);
    metrics_set_number(r->metrics, "best_val_iteration", r->best_iter);
    metrics_set_number(r->metrics, "tokens_seen", r->tokens);
    metrics_set_number(r->metrics, "train_seconds", r->train_seconds);
    metrics_set_number(r->metrics, "wall_seconds", r->elapsed);
    metrics_set_number(r->metrics, "tokens_per_s", r->train_seconds > 0 ? r->tokens / r->train_seconds : 0.0);
    metrics_set_number(r->metrics, "ms_per_iter", r->iter > 0 ? 1e3 * r->train_seconds / r->iter : 0.0);
    metrics_set_number(r->metrics, "peak_memory_mib", peak_rss_mib());
    if (metrics_write(r->metrics, &e) != 0) die(NULL, &e);
}

static void metrics_header(Run *r, int resumed) {
    Err e;
    r->metrics = metrics_open(r->metrics_path, resumed, &e);
    if (!r->metrics) die(NULL, &e);
    if (resumed) {
        metrics_truncate(r->metrics, "iterations", TRAIN_SERIES, 8, r->iter);
        metrics_truncate(r->metrics, "val_iterations", VAL_SERIES, 5, r->iter);
    }
    Metrics *m = r->metrics;
    const GPT2Config *c = &r->model.cfg;
    metrics_set_number(m, "format_version", 1);
    metrics_set_string(m, "family", "gpt2");
    metrics_set_string(m, "step", r->step);
    metrics_set_string(m, "variant", attn_variant_id(ATTN_VARIANT, ATTN_POS));
    metrics_set_string(m, "variant_label", attn_variant_label(ATTN_VARIANT, ATTN_POS));
    metrics_set_json(m, "model", r->model_json);
    metrics_set_json(m, "config", build_config_json());
    metrics_set_string(m, "git_commit", build_git_commit());
    metrics_set_number(m, "seed", (double)r->h.seed);
    metrics_set_string(m, "dataset", r->data.name);
    metrics_set_string(m, "metric", "val_loss");
    metrics_set_number(m, "parameters", (double)r->model.table.total);
    metrics_set_number(m, "matmul_parameters", (double)gpt2_matmul_params(c));
    metrics_set_number(m, "flops_per_token", gpt2_flops_per_token(c, r->h.T));
    metrics_set_string(m, "flops_formula", "6*N_matmul + 12*L*T*C (training, attention over the full T x T)");
    metrics_set_number(m, "tokens_per_iter", (double)r->h.B * r->h.T * r->h.accum);
    metrics_set_number(m, "kv_cache_bytes_per_token", (double)kv_cache_bytes_per_token(c));
    metrics_set_number(m, "threads", backend_threads());
    metrics_set_string(m, "backend", backend_name());
    metrics_set_string(m, "status", "running");
    if (!resumed) metrics_set_number(m, "started_unix", unix_seconds());
    write_metrics(r);
}

/* ------------------------------------------------------------------ evaluation */

/* Validation loss (mean over counted tokens), token accuracy; no dropout. */
static double evaluate(Run *r, double *acc) {
    const Hyper *h = &r->h;
    int nb = dataset_val_batches(&r->data, h->B, h->eval_iters);
    int *x = xmalloc((size_t)h->B * h->T * sizeof(int)), *y = xmalloc((size_t)h->B * h->T * sizeof(int));
    double loss_sum = 0.0;
    long counted = 0, correct = 0;
    Err e;
    for (int k = 0; k < nb; k++) {
        if (dataset_val_batch(&r->data, k, h->B, h->eval_iters, x, y, &e) != 0) die(NULL, &e);
        double l = gpt2_forward(&r->model, x, y, h->B, h->T, 0, 0);
        loss_sum += l * r->model.counted;
        counted += r->model.counted;
        correct += gpt2_correct(&r->model);
    }
    free(x);
    free(y);
    *acc = counted ? (double)correct / counted : 0.0;
    return counted ? loss_sum / counted : NAN;
}

static void eval_and_record(Run *r) {
    double t0 = wall_seconds(), acc;
    double val = evaluate(r, &acc);
    int best = val < r->best_val;
    if (best) {
        r->best_val = val;
        r->best_iter = r->iter;
        save_model(r, r->best_path, val);
    }
    r->last_val = val;
    r->last_eval_iter = r->iter;
    r->elapsed += wall_seconds() - t0;
    metrics_append(r->metrics, "val_iterations", r->iter);
    metrics_append(r->metrics, "val_losses", val);
    metrics_append(r->metrics, "val_perplexities", ppl(val));
    metrics_append(r->metrics, "val_accuracies", acc);
    metrics_append(r->metrics, "val_timestamps", r->elapsed);
    metrics_append(r->metrics, "val_tokens", r->tokens);
    write_metrics(r);
    printf("eval  step %6d | val loss %.4f | ppl %8.2f | acc %.3f | best %.4f @ %d%s\n", r->iter, val, ppl(val), acc,
           r->best_val, r->best_iter, best ? " (saved)" : "");
    fflush(stdout);
}

/* ------------------------------------------------------------------ training */

static void format_eta(char *buf, size_t n, double s) {
    if (!isfinite(s) || s < 0) s = 0;
    int hrs = (int)(s / 3600), min = (int)(fmod(s, 3600) / 60), sec = (int)fmod(s, 60);
    if (hrs)
        snprintf(buf, n, "%dh%02dm", hrs, min);
    else
        snprintf(buf, n, "%dm%02ds", min, sec);
}

static void banner(const Run *r) {
    const GPT2Config *c = &r->model.cfg;
    const Hyper *h = &r->h;
    printf("kvlab gpt2 | step %s | attention %s | %s\n", r->step, attn_variant_label(ATTN_VARIANT, ATTN_POS),
           backend_name());
    printf("model: %d layers, %d heads, %d channels, context %d, vocab %d (%s) | %zu parameters\n", c->L, c->H, c->C,
           c->T, c->V, r->data.name, r->model.table.total);
    printf("cost: %.1f MFLOP/token (6 N_matmul + 12 L T C) | KV cache %zu bytes/token (%d tensor%s per layer)\n",
           gpt2_flops_per_token(c, h->T) / 1e6, kv_cache_bytes_per_token(c), attn_cache_tensors(c->variant),
           attn_cache_tensors(c->variant) == 1 ? "" : "s");
    printf("train: %d iters%s, batch %d x %d x %d accum, lr %.3g -> %.3g (warmup %d), wd %g, clip %g, seed %llu, "
           "%d threads\n", h->max_iters, h->max_time ? " or time budget" : "", h->B, h->T, h->accum, h->lr, h->min_lr,
           h->warmup, h->wd, h->clip, (unsigned long long)h->seed, backend_threads());
    fflush(stdout);
}

static void finish_failed(Run *r, const char *status, const char *msg) {
    metrics_set_string(r->metrics, "status", status);
    metrics_set_string(r->metrics, "error", msg);
    write_metrics(r);
}

static int train(Run *r) {
    const Hyper *h = &r->h;
    GPT2 *m = &r->model;
    int *x = xmalloc((size_t)h->B * h->T * sizeof(int)), *y = xmalloc((size_t)h->B * h->T * sizeof(int));
    double interval_loss = 0.0, interval_t = 0.0, interval_tokens = 0.0;
    int interval_n = 0;
    const char *stopped_by = "max_iters";
    Err e;
    signal(SIGINT, on_signal);
    signal(SIGTERM, on_signal);
    while (r->iter < h->max_iters) {
        if (h->max_time > 0 && r->train_seconds >= h->max_time) {
            stopped_by = "max_time";
            break;
        }
        double t0 = wall_seconds();
        double lr = learning_rate(h, r->iter);
        gpt2_zero_grad(m);
        double loss = 0.0;
        for (int k = 0; k < h->accum; k++) {
            if (dataset_train_batch(&r->data, &r->data_rng, h->B, x, y, &e) != 0) die(NULL, &e);
            uint64_t dseed = dropout_seed(h->seed, (uint64_t)r->iter * h->accum + k, 0);
            loss += gpt2_forward(m, x, y, h->B, h->T, 1, dseed) / h->accum;
            gpt2_backward(m, 1.0f / h->accum);
        }
        if (!isfinite(loss)) {
            char msg[512];
            snprintf(msg, sizeof msg, "training loss is %g at iteration %d", loss, r->iter);
            finish_failed(r, "failed", msg);
            fprintf(stderr, "error: %s (hint: lower CONFIG_GPT2_LR or set CONFIG_GPT2_GRAD_CLIP; %s)\n", msg,
                    file_exists(r->state_path) ? "the last good state is in the state_step file and is kept"
                                               : "no checkpoint was written yet");
            return 1;
        }
        double norm = h->clip > 0 ? clip_grad_norm(m->grads, m->table.total, h->clip)
                                  : grad_norm(m->grads, m->table.total);
        gpt2_adamw(m, (float)lr, (float)h->beta1, (float)h->beta2, (float)h->eps, (float)h->wd, r->iter + 1);
        r->iter++;
        double dt = wall_seconds() - t0;
        r->train_seconds += dt;
        r->elapsed += dt;
        r->tokens += (double)h->B * h->T * h->accum;
        interval_loss += loss;
        interval_t += dt;
        interval_tokens += (double)h->B * h->T * h->accum;
        interval_n++;

        if (r->iter % h->log_interval == 0 || r->iter == 1 || r->iter == h->max_iters) {
            double mean = interval_loss / interval_n, tps = interval_tokens / interval_t;
            double ms = 1e3 * interval_t / interval_n;
            metrics_append(r->metrics, "iterations", r->iter);
            metrics_append(r->metrics, "train_losses", mean);
            metrics_append(r->metrics, "train_perplexities", ppl(mean));
            metrics_append(r->metrics, "learning_rates", lr);
            metrics_append(r->metrics, "timestamps", r->elapsed);
            metrics_append(r->metrics, "tokens", r->tokens);
            metrics_append(r->metrics, "tokens_per_s", tps);
            metrics_append(r->metrics, "ms_per_iter", ms);
            metrics_append(r->metrics, "grad_norms", norm);
            write_metrics(r);
            double left = (h->max_iters - r->iter) * ms / 1e3;
            if (h->max_time > 0 && h->max_time - r->train_seconds < left) left = h->max_time - r->train_seconds;
            char eta[32];
            format_eta(eta, sizeof eta, left);
            printf("step %6d/%d | loss %.4f | lr %.2e | norm %6.3f | %7.1f ms/step | %7.0f tok/s | ETA %s\n",
                   r->iter, h->max_iters, mean, lr, norm, ms, tps, eta);
            fflush(stdout);
            interval_loss = interval_t = interval_tokens = 0.0;
            interval_n = 0;
        }
        if (r->iter % h->eval_interval == 0 && r->iter < h->max_iters) eval_and_record(r);
        if (r->iter % h->ckpt_interval == 0 && r->iter < h->max_iters) {
            save_state(r);
            printf("checkpoint step %d -> %s\n", r->iter, r->state_path);
            fflush(stdout);
        }
        if (g_stop_signal) {
            save_state(r);
            char msg[256];
            snprintf(msg, sizeof msg, "interrupted by signal %d at iteration %d", (int)g_stop_signal, r->iter);
            finish_failed(r, "interrupted", msg);
            fprintf(stderr, "kvlab: %s; state saved to %s, run make again to continue\n", msg, r->state_path);
            return 128 + (int)g_stop_signal;
        }
    }
    free(x);
    free(y);
    if (r->last_eval_iter != r->iter || r->best_iter < 0) eval_and_record(r);
    save_model(r, r->final_path, r->last_val);
    metrics_set_string(r->metrics, "stopped_by", stopped_by);
    metrics_set_number(r->metrics, "final_val_loss", r->last_val);
    metrics_set_string(r->metrics, "status", "complete");
    metrics_set_number(r->metrics, "finished_unix", unix_seconds());
    write_metrics(r);
    unlink(r->state_path); /* the final model and metrics hold everything now */
    printf("done: %d iterations (%s), %.0f tokens in %.1f s (%.0f tok/s), best val loss %.4f @ %d -> %s\n", r->iter,
           stopped_by, r->tokens, r->train_seconds, r->tokens / (r->train_seconds > 0 ? r->train_seconds : 1),
           r->best_val, r->best_iter, r->final_path);
    return 0;
}

/* ------------------------------------------------------------------ commands */

static void usage(void) {
    fprintf(stderr,
            "usage: train_gpt2 train --out DIR --step NAME\n"
            "       train_gpt2 sample --ckpt FILE [--prompt TEXT] [--length N] [--temperature T] [--top-k K]\n"
            "                         [--seed S] [--no-cache]\n"
            "       train_gpt2 info\n");
    exit(2);
}

static void setup(Run *r) {
    Err e;
    r->h = hyper_from_kconfig();
    backend_init(CONFIG_NUM_THREADS);
    if (dataset_load(&r->data, CONFIG_DATA_DIR, r->h.T, &e) != 0) die(NULL, &e);
    GPT2Config cfg = gpt2_config_from_kconfig(r->data.V);
    gpt2_init(&r->model, &cfg, r->h.seed);
    r->model_json = gpt2_config_json(&cfg);
    r->vocab_json = dataset_vocab_json(&r->data);
}

static int cmd_train(int argc, char **argv) {
    Run r;
    memset(&r, 0, sizeof r);
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--out") && i + 1 < argc)
            r.out = argv[++i];
        else if (!strcmp(argv[i], "--step") && i + 1 < argc)
            r.step = argv[++i];
        else
            usage();
    }
    if (!r.out || !r.step) usage();
    Err e;
    if (make_dirs(r.out, &e) != 0) die(NULL, &e);
    snprintf(r.final_path, sizeof r.final_path, "%s/final_model_step%s.safetensors", r.out, r.step);
    snprintf(r.best_path, sizeof r.best_path, "%s/best_model_step%s.safetensors", r.out, r.step);
    snprintf(r.state_path, sizeof r.state_path, "%s/state_step%s.safetensors", r.out, r.step);
    snprintf(r.metrics_path, sizeof r.metrics_path, "%s/training_metrics_step%s.json", r.out, r.step);
    setup(&r);
    r.best_val = INFINITY;
    r.best_iter = -1;
    r.last_eval_iter = -1;
    r.last_val = NAN;
    r.data_rng = rng_seeded(r.h.seed, 2);
    int resumed = try_resume(&r);
    banner(&r);
    metrics_header(&r, resumed);
    int rc = train(&r);
    if (rc == 0 && CONFIG_GPT2_SAMPLE_LENGTH > 0) {
        int *prompt;
        size_t np;
        if (dataset_encode(&r.data, CONFIG_GPT2_SAMPLE_PROMPT, &prompt, &np, &e) != 0) die("CONFIG_GPT2_SAMPLE_PROMPT", &e);
        SampleOptions opt = {.length = CONFIG_GPT2_SAMPLE_LENGTH, .top_k = CONFIG_GPT2_SAMPLE_TOP_K, .use_cache = 1,
                             .temperature = (float)KCONFIG_NUMBER(CONFIG_GPT2_SAMPLE_TEMPERATURE, 0.0, 100.0),
                             .seed = r.h.seed};
        printf("sample (temperature %g, top-k %d):\n---\n", (double)opt.temperature, opt.top_k);
        for (size_t i = 0; i < np; i++) dataset_print_token(&r.data, prompt[i], stdout);
        if (gpt2_generate(&r.model, &r.data, prompt, np, &opt, stdout, &e) != 0) die(NULL, &e);
        printf("\n---\n");
        free(prompt);
    }
    metrics_free(r.metrics);
    free(r.model_json);
    free(r.vocab_json);
    gpt2_free(&r.model);
    dataset_free(&r.data);
    return rc;
}

static int cmd_sample(int argc, char **argv) {
    const char *ckpt = NULL, *prompt_text = CONFIG_GPT2_SAMPLE_PROMPT;
    SampleOptions opt = {.length = CONFIG_GPT2_SAMPLE_LENGTH, .top_k = CONFIG_GPT2_SAMPLE_TOP_K, .use_cache = 1,
                         .temperature = (float)KCONFIG_NUMBER(CONFIG_GPT2_SAMPLE_TEMPERATURE, 0.0, 100.0),
                         .seed = CONFIG_SEED};
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--ckpt") && i + 1 < argc)
            ckpt = argv[++i];
        else if (!strcmp(argv[i], "--prompt") && i + 1 < argc)
            prompt_text = argv[++i];
        else if (!strcmp(argv[i], "--length") && i + 1 < argc)
            opt.length = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--temperature") && i + 1 < argc)
            opt.temperature = (float)atof(argv[++i]);
        else if (!strcmp(argv[i], "--top-k") && i + 1 < argc)
            opt.top_k = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--seed") && i + 1 < argc)
            opt.seed = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--no-cache"))
            opt.use_cache = 0;
        else
            usage();
    }
    if (!ckpt) usage();
    if (opt.length < 0 || opt.top_k < 0 || !(opt.temperature >= 0.0f))
        FATAL("sample: --length and --top-k must be >= 0 and --temperature >= 0");
    Run r;
    memset(&r, 0, sizeof r);
    setup(&r);
    Err e;
    StFile *f = checkpoint_open(ckpt, "gpt2", &e);
    if (!f) die(NULL, &e);
    if (checkpoint_expect(f, "variant", attn_variant_id(ATTN_VARIANT, ATTN_POS),
                          "use the binary of the step that wrote the checkpoint (output/<run>/train_gpt2_step<STEP>)",
                          &e) != 0 ||
        checkpoint_expect(f, "model", r.model_json, "the checkpoint has another model shape or vocabulary", &e) != 0 ||
        checkpoint_read(f, &r.model.table, r.model.params, NULL, NULL, &e) != 0)
        die(NULL, &e);
    st_close(f);
    int *prompt;
    size_t np;
    if (dataset_encode(&r.data, prompt_text, &prompt, &np, &e) != 0) die(NULL, &e);
    for (size_t i = 0; i < np; i++) dataset_print_token(&r.data, prompt[i], stdout);
    if (gpt2_generate(&r.model, &r.data, prompt, np, &opt, stdout, &e) != 0) die(NULL, &e);
    fputc('\n', stdout);
    free(prompt);
    free(r.model_json);
    free(r.vocab_json);
    gpt2_free(&r.model);
    dataset_free(&r.data);
    return 0;
}

static int cmd_info(void) {
    Run r;
    memset(&r, 0, sizeof r);
    r.step = "-";
    setup(&r);
    banner(&r);
    printf("config: %s\n", build_config_json());
    printf("git commit: %s\n", build_git_commit());
    free(r.model_json);
    free(r.vocab_json);
    gpt2_free(&r.model);
    dataset_free(&r.data);
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
