#define _GNU_SOURCE
#include "trainer.h"

#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "buildinfo.h"
#include "kernels.h"
#include "tracking.h"

/* The run whose metrics still say "running": a fatal error marks them failed. */
static TrainRun *g_running;

void run_die(const Err *e) {
    fflush(stdout);
    fprintf(stderr, "error: %s\n", e->msg);
    TrainRun *r = g_running;
    g_running = NULL; /* once: writing the metrics may be what failed */
    if (r) {
        Err ignored;
        metrics_set_string(r->metrics, "status", "failed");
        metrics_set_string(r->metrics, "error", e->msg);
        metrics_write(r->metrics, &ignored); /* best effort, e.g. on a full disk */
    }
    _exit(1);
}

void run_init(TrainRun *r, const char *family, const char *out, const char *step, uint64_t seed) {
    Err e;
    /* the step is part of file names in out (scripts/kconfig.py holds steps to the same characters) */
    if (!*step || strspn(step, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.") != strlen(step) ||
        *step == '-') {
        err_set(&e, "--step '%s': a step name is letters, digits, '-', '_' and '.', not starting with '-' (hint: "
                    "the name make gives it, e.g. V0)", step);
        run_die(&e);
    }
    r->family = family;
    r->out = out;
    r->step = step;
    r->seed = seed;
    if (make_dirs(out, &e) != 0) run_die(&e);
    snprintf(r->final_path, sizeof r->final_path, "%s/final_model_step%s.safetensors", out, step);
    snprintf(r->best_path, sizeof r->best_path, "%s/best_model_step%s.safetensors", out, step);
    snprintf(r->state_path, sizeof r->state_path, "%s/state_step%s.safetensors", out, step);
    snprintf(r->metrics_path, sizeof r->metrics_path, "%s/training_metrics_step%s.json", out, step);
    r->iter = 0;
    r->data_rng = rng_seeded(seed, 2);
    r->train_seconds = r->elapsed = r->examples = 0.0;
    r->best_val = INFINITY;
    r->best_iter = -1;
    r->last_val = NAN;
    r->last_eval_iter = -1;
}

/* ------------------------------------------------------------------ checkpoints */

#define META_MAX 32

typedef struct {
    StMeta kv[META_MAX];
    char buf[META_MAX][64];
    int n;
} Meta;

static void meta_add(Meta *m, const char *key, const char *value) { m->kv[m->n++] = (StMeta){key, value}; }

static void meta_num(Meta *m, const char *key, const char *fmt, double v) {
    snprintf(m->buf[m->n], sizeof m->buf[m->n], fmt, v);
    meta_add(m, key, m->buf[m->n]);
}

/* Metadata common to every file a step writes (formats.md 1.5). */
static void base_meta(const TrainRun *r, Meta *m) {
    m->n = 0;
    meta_add(m, "family", r->family);
    meta_add(m, "variant", r->variant);
    meta_add(m, "config", build_config_json());
    meta_add(m, "model", r->model_json);
    meta_add(m, "dataset", r->dataset);
    if (r->vocab_json) meta_add(m, "tokenizer", r->vocab_json);
    meta_add(m, "ablation_step", r->step);
    meta_add(m, "git_commit", build_git_commit());
    snprintf(m->buf[m->n], 64, "%llu", (unsigned long long)r->seed);
    meta_add(m, "seed", m->buf[m->n]);
    meta_num(m, "step", "%.0f", r->iter);
    meta_num(m, "created_unix", "%.0f", unix_seconds());
    meta_num(m, "best_val_loss", "%.9g", r->best_val);
}

void run_track(TrainRun *r, const char *name, double *value) {
    if (r->nextra == (int)(sizeof r->extra / sizeof r->extra[0])) FATAL("run_track: too many tracked values");
    r->extra[r->nextra].name = name;
    r->extra[r->nextra].value = value;
    r->nextra++;
}

void run_save_model(TrainRun *r, const char *path, double val_loss) {
    Meta m;
    base_meta(r, &m);
    meta_num(&m, "val_loss", "%.9g", val_loss);
    Err e;
    if (checkpoint_save_params(path, r->w, 0, m.kv, m.n, &e) != 0) run_die(&e);
}

void run_save_state(TrainRun *r) {
    Meta m;
    base_meta(r, &m);
    snprintf(m.buf[m.n], 64, "%llu", (unsigned long long)r->data_rng.state);
    meta_add(&m, "data_rng", m.buf[m.n]);
    meta_num(&m, "train_seconds", "%.17g", r->train_seconds);
    meta_num(&m, "elapsed_seconds", "%.17g", r->elapsed);
    meta_num(&m, "examples", "%.17g", r->examples);
    meta_num(&m, "best_val_iteration", "%.0f", r->best_iter);
    meta_num(&m, "last_eval_iteration", "%.0f", r->last_eval_iter);
    meta_num(&m, "last_val_loss", "%.17g", r->last_val);
    for (int i = 0; i < r->nextra; i++) meta_num(&m, r->extra[i].name, "%.17g", *r->extra[i].value);
    Err e;
    if (checkpoint_save_params(r->state_path, r->w, 1, m.kv, m.n, &e) != 0) run_die(&e);
}

static double meta_number(StFile *f, const char *key) {
    const char *s = st_meta(f, key);
    char *end = NULL;
    double v = s ? strtod(s, &end) : 0.0;
    if (!s || *end) {
        Err e;
        err_set(&e, "%s: metadata '%s' is missing or not a number (hint: the state file is damaged; move it away "
                    "to restart the step)", st_path(f), key);
        run_die(&e);
    }
    return v;
}

int run_try_resume(TrainRun *r) {
    if (!file_exists(r->state_path)) return 0;
    Err e;
    StFile *f = checkpoint_open(r->state_path, r->family, &e);
    if (!f) run_die(&e);
    if (checkpoint_expect(f, "variant", r->variant, "it belongs to another ablation step; use that step's binary",
                          &e) != 0 ||
        checkpoint_expect(f, "config", build_config_json(),
                          "it was written with another configuration; make moves such outputs aside before running, "
                          "or move the file away to restart the step", &e) != 0 ||
        checkpoint_read_params(f, r->w, 1, &e) != 0)
        run_die(&e);
    r->iter = (int)meta_number(f, "step");
    const char *rng = st_meta(f, "data_rng");
    r->data_rng.state = rng ? strtoull(rng, NULL, 10) : 0;
    r->train_seconds = meta_number(f, "train_seconds");
    r->elapsed = meta_number(f, "elapsed_seconds");
    r->examples = meta_number(f, "examples");
    r->best_val = meta_number(f, "best_val_loss");
    r->best_iter = (int)meta_number(f, "best_val_iteration");
    r->last_eval_iter = (int)meta_number(f, "last_eval_iteration");
    r->last_val = meta_number(f, "last_val_loss");
    for (int i = 0; i < r->nextra; i++) *r->extra[i].value = meta_number(f, r->extra[i].name);
    st_close(f);
    printf("resuming step %s from iteration %d (%s)\n", r->step, r->iter, r->state_path);
    return 1;
}

/* ------------------------------------------------------------------ metrics */

void run_open_metrics(TrainRun *r, int resumed, const char *const *train_series, int ntrain,
                      const char *const *val_series, int nval) {
    Err e;
    r->metrics = metrics_open(r->metrics_path, resumed, &e);
    if (!r->metrics) run_die(&e);
    if (resumed) {
        metrics_truncate(r->metrics, "iterations", train_series, ntrain, r->iter);
        metrics_truncate(r->metrics, "val_iterations", val_series, nval, r->iter);
    }
    Metrics *m = r->metrics;
    metrics_set_number(m, "format_version", 1);
    metrics_set_string(m, "family", r->family);
    metrics_set_string(m, "step", r->step);
    metrics_set_string(m, "variant", r->variant);
    metrics_set_json(m, "model", r->model_json);
    metrics_set_json(m, "config", build_config_json());
    metrics_set_string(m, "git_commit", build_git_commit());
    metrics_set_number(m, "seed", (double)r->seed);
    metrics_set_string(m, "dataset", r->dataset);
    metrics_set_string(m, "unit", r->unit);
    metrics_set_number(m, "parameters", (double)r->w->table.total);
    metrics_set_number(m, "threads", backend_threads());
    metrics_set_string(m, "backend", backend_name());
    metrics_set_string(m, "status", "running");
    g_running = r;
    if (!resumed) metrics_set_number(m, "started_unix", unix_seconds());
    tracking_start(r);
}

void run_write_metrics(TrainRun *r) {
    Err e;
    Metrics *m = r->metrics;
    metrics_set_number(m, "final_iteration", r->iter);
    metrics_set_number(m, "best_val_loss", r->best_val);
    metrics_set_number(m, "best_val_iteration", r->best_iter);
    char key[64];
    snprintf(key, sizeof key, "%s_seen", r->unit);
    metrics_set_number(m, key, r->examples);
    snprintf(key, sizeof key, "%s_per_s", r->unit);
    metrics_set_number(m, key, r->train_seconds > 0 ? r->examples / r->train_seconds : 0.0);
    metrics_set_number(m, "train_seconds", r->train_seconds);
    metrics_set_number(m, "wall_seconds", r->elapsed);
    double trained = r->iter - r->skipped_iters; /* a time budget may have skipped the rest of a job */
    metrics_set_number(m, "ms_per_iter", trained > 0 ? 1e3 * r->train_seconds / trained : 0.0);
    metrics_set_number(m, "trained_iterations", trained);
    metrics_set_number(m, "peak_memory_mib", peak_rss_mib());
    if (metrics_write(m, &e) != 0) run_die(&e);
    tracking_log(r);
}

void run_finish(TrainRun *r, const char *stopped_by) {
    metrics_set_string(r->metrics, "stopped_by", stopped_by);
    metrics_set_number(r->metrics, "final_val_loss", r->last_val);
    metrics_set_string(r->metrics, "status", "complete");
    metrics_set_number(r->metrics, "finished_unix", unix_seconds());
    run_write_metrics(r);
    g_running = NULL; /* its final status is written */
    unlink(r->state_path); /* the final model and the metrics hold everything now */
    tracking_finish(r, 0);
}

void run_fail(TrainRun *r, const char *status, const char *msg) {
    metrics_set_string(r->metrics, "status", status);
    metrics_set_string(r->metrics, "error", msg);
    run_write_metrics(r);
    g_running = NULL;
    tracking_finish(r, run_stop_signal() ? 128 + run_stop_signal() : 1);
}

/* ------------------------------------------------------------------ signals, formatting */

static volatile sig_atomic_t g_stop_signal;

static void on_signal(int sig) {
    if (!g_stop_signal) g_stop_signal = sig; /* the first reason is the one reported */
}

void run_catch_signals(void) {
    signal(SIGINT, on_signal);
    signal(SIGTERM, on_signal);
    signal(SIGHUP, on_signal);
    /* Output to a runner that is gone must not kill the trainer before it
     * saves: the write fails instead, and run_stop_signal() reports it. */
    signal(SIGPIPE, SIG_IGN);
}

int run_stop_signal(void) {
    if (!g_stop_signal && (ferror(stdout) || ferror(stderr))) g_stop_signal = SIGPIPE;
    return (int)g_stop_signal;
}

static const char *signal_name(int sig) {
    return sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : sig == SIGHUP ? "SIGHUP" : "a signal";
}

int run_stop(TrainRun *r) {
    int sig = run_stop_signal();
    run_save_state(r);
    char msg[256];
    if (sig == SIGPIPE)
        snprintf(msg, sizeof msg, "stopped at iteration %d: its output was closed (the step runner is gone)", r->iter);
    else
        snprintf(msg, sizeof msg, "stopped by %s at iteration %d", signal_name(sig), r->iter);
    run_fail(r, "stopped", msg);
    fprintf(stderr, "kvlab: %s; state saved to %s, run make again to continue\n", msg, r->state_path);
    fflush(stderr);
    return 128 + sig;
}

/* ------------------------------------------------------------------ the training-loop tail */

double optim_step(const Optim *o, Params *w, double lr, int step) {
    double norm = o->clip > 0 ? clip_grad_norm(w->grads, w->table.total, o->clip) : grad_norm(w->grads, w->table.total);
    params_adamw(w, (float)lr, (float)o->beta1, (float)o->beta2, (float)o->eps, (float)o->weight_decay, step);
    return norm;
}

int run_check_loss(TrainRun *r, double loss, const char *hint) {
    if (isfinite(loss)) return 0;
    char msg[256];
    snprintf(msg, sizeof msg, "training loss is %g at iteration %d", loss, r->iter + 1);
    run_fail(r, "failed", msg);
    fflush(stdout);
    fprintf(stderr, "error: %s (hint: %s; %s)\n", msg, hint,
            file_exists(r->state_path) ? "the last good state is in the state_step file and is kept"
                                       : "no checkpoint was written yet");
    return 1;
}

double run_step_done(TrainRun *r, double t0, double examples) {
    double dt = wall_seconds() - t0;
    r->iter++;
    r->train_seconds += dt;
    r->elapsed += dt;
    r->examples += examples;
    return dt;
}

int run_checkpoint_or_stop(TrainRun *r, int checkpoint_due) {
    if (checkpoint_due) {
        run_save_state(r);
        printf("checkpoint step %d -> %s\n", r->iter, r->state_path);
        fflush(stdout);
    }
    return run_stop_signal() ? run_stop(r) : 0;
}

void format_eta(char *buf, size_t n, double s) {
    if (!isfinite(s) || s < 0) s = 0;
    int hrs = (int)(s / 3600), min = (int)(fmod(s, 3600) / 60), sec = (int)fmod(s, 60);
    if (hrs)
        snprintf(buf, n, "%dh%02dm", hrs, min);
    else
        snprintf(buf, n, "%dm%02ds", min, sec);
}

double perplexity(double loss) { return exp(loss < 20.0 ? loss : 20.0); }
