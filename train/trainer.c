#define _GNU_SOURCE
#include "trainer.h"

#include <cjson/cJSON.h>
#include <float.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "buildinfo.h"
#include "kernels.h"
#include "runconfig.h"
#include "tracking.h"

/* The run whose metrics still say "running": a fatal error marks them failed. */
static TrainRun *g_running;

void run_die(const Err *e) {
    fflush(stdout);
    fprintf(stderr, "error: %s%s\n", process_label(), e->msg);
    TrainRun *r = g_running;
    g_running = NULL; /* once: writing the metrics may be what failed */
    if (r && r->rank == 0) {
        Err ignored;
        metrics_set_string(r->metrics, "status", "failed");
        metrics_set_string(r->metrics, "error", e->msg);
        metrics_write(r->metrics, &ignored); /* best effort, e.g. on a full disk */
    }
    process_exit(1); /* in a job of several processes: all of them */
}

int run_train_args(int argc, char **argv, const char **out, const char **step) {
    *out = *step = NULL;
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--out") && i + 1 < argc)
            *out = argv[++i];
        else if (!strcmp(argv[i], "--step") && i + 1 < argc)
            *step = argv[++i];
        else if (!strcmp(argv[i], "--set") && i + 1 < argc)
            kconfig_runtime_set(argv[++i]);
        else {
            usage_refuse(argv[i]);
            return 0;
        }
    }
    if (!*out || !*step)
        fprintf(stderr, "error: train needs --out DIR and --step NAME (hint: make passes both; the usage follows)\n");
    return *out && *step;
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
    r->rank = dist_rank();
    r->procs = dist_size();
    if (r->rank == 0 && make_dirs(out, &e) != 0) run_die(&e); /* rank 0 alone writes (its machine's folder) */
    /* ZeRO-1: this rank keeps the AdamW moments of its slice only */
    r->zero1 = IS_ENABLED(CONFIG_DIST_ZERO1) && r->procs > 1;
    r->zslice = dist_split(r->w->table.total, r->rank, r->procs);
    if (r->zero1) {
        dev_free(r->w->m), dev_free(r->w->v);
        r->w->m = dev_alloc(r->zslice.n * sizeof(float));
        r->w->v = dev_alloc(r->zslice.n * sizeof(float));
    }
    grad_sync_init(&r->sync, r->w, DIST_BUCKET_BYTES, r->zero1);
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
    run_profile_init(r);
}

void run_free(TrainRun *r) {
    if (r->rec_dev) dev_free(r->rec_dev);
    free(r->recs);
    r->rec_dev = r->recs = NULL;
    r->rec_cap = r->rec_pending = r->nrecs = 0;
    metrics_free(r->metrics);
    free(r->model_json), free(r->vocab_json);
    grad_sync_free(&r->sync);
    r->metrics = NULL;
    r->model_json = r->vocab_json = NULL;
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
    if (r->rank != 0) return; /* every rank holds the same parameters */
    Meta m;
    base_meta(r, &m);
    meta_num(&m, "val_loss", "%.9g", val_loss);
    Err e;
    if (checkpoint_save_params(path, r->w, 0, m.kv, m.n, &e) != 0) run_die(&e);
}

void run_save_state(TrainRun *r) {
    size_t total = r->w->table.total;
    float *hm = NULL, *hv = NULL; /* ZeRO-1: the whole moments, gathered on rank 0 */
    if (r->zero1) {
        if (r->rank == 0) hm = xmalloc(total * sizeof(float)), hv = xmalloc(total * sizeof(float));
        dist_gather_dev(hm, r->w->m, total);
        dist_gather_dev(hv, r->w->v, total);
    }
    if (r->rank != 0) return;
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
    if (!r->zero1) hm = params_to_host(r->w, r->w->m), hv = params_to_host(r->w, r->w->v);
    float *hp = params_to_host(r->w, r->w->params);
    /* a loss can stay finite a few steps after the moments overflowed: such a state is not written, so the last
     * good one stays the resume point (the reader would refuse it) */
    int rc = checkpoint_finite(r->state_path, &r->w->table, hp, hm, hv, &e);
    if (rc == 0) rc = checkpoint_save(r->state_path, &r->w->table, hp, hm, hv, m.kv, m.n, &e);
    free(hp), free(hm), free(hv);
    if (rc != 0) run_die(&e);
}

static const char *const damaged_hint = "the state file is damaged; move it away to restart the step";

static double meta_number(StFile *f, const char *key) {
    const char *s = st_meta(f, key);
    char *end = NULL;
    double v = s ? strtod(s, &end) : 0.0;
    if (!s || end == s || *end) {
        Err e;
        err_set(&e, "%s: metadata '%s' is missing or not a number (hint: %s)", st_path(f), key, damaged_hint);
        run_die(&e);
    }
    return v;
}

/* A metadata number held to what the trainer can have written: within [lo, hi], a whole number where whole is
 * set; NaN (no evaluation yet) only where nan_ok, +inf only where inf_ok. A state written by this trainer always
 * passes, so a value outside is damage, and resuming from it would go wrong later and further from the cause
 * (a negative step truncates the metrics to their header). */
static double meta_checked(StFile *f, const char *key, double lo, double hi, int whole, int nan_ok, int inf_ok) {
    double v = meta_number(f, key);
    int ok = isnan(v) ? nan_ok : isinf(v) ? inf_ok && v > 0 : v >= lo && v <= hi && (!whole || v == floor(v));
    if (!ok) {
        Err e;
        char range[96];
        if (hi == DBL_MAX)
            snprintf(range, sizeof range, ">= %.17g", lo);
        else
            snprintf(range, sizeof range, "in [%.17g, %.17g]", lo, hi);
        err_set(&e, "%s: metadata '%s' is %s, not %s %s%s%s (hint: %s)", st_path(f), key, st_meta(f, key),
                whole ? "a whole number" : "a number", range, nan_ok ? " or nan" : "", inf_ok ? " or inf" : "",
                damaged_hint);
        run_die(&e);
    }
    return v;
}

/* The configuration JSON without the Distributed menu's symbols: how many processes train a step does not
 * change what it computes, so a state file resumes with any of them. */
static char *config_sans_dist(const char *json) {
    cJSON *o = cJSON_Parse(json);
    if (!cJSON_IsObject(o)) {
        cJSON_Delete(o);
        return NULL;
    }
    for (cJSON *it = o->child, *next; it; it = next) {
        next = it->next;
        if (it->string && strncmp(it->string, "DIST_", 5) == 0) cJSON_DeleteItemFromObjectCaseSensitive(o, it->string);
    }
    char *text = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return text;
}

/* What a state file holds besides the tensors, as rank 0 sends it to the others. */
typedef struct {
    double iter, train_seconds, elapsed, examples, best_val, best_iter, last_eval_iter, last_val;
    double extra[8];
    uint64_t data_rng;
} Progress;

static void check_state_config(StFile *f, const char *model_json) {
    static const char *hint = "it was written with another configuration; make moves such outputs aside before "
                              "running, or move the file away to restart the step";
    Err e;
    /* the model's shape first: of all the settings that differ, the one that makes the tensors differ is named */
    if (checkpoint_expect_json(f, "model", model_json, hint, &e) != 0) run_die(&e);
    const char *cfg = st_meta(f, "config");
    char *got = cfg ? config_sans_dist(cfg) : NULL, *want = config_sans_dist(build_config_json());
    int same = got && want && strcmp(got, want) == 0;
    if (!same) {
        /* name the first field that differs, when it is one this binary has */
        if (!want || checkpoint_expect_json(f, "config", want, hint, &e) == 0)
            err_set(&e, "%s: mismatched checkpoint: its config has settings this binary does not (hint: %s)",
                    st_path(f), hint);
        cJSON_free(got);
        cJSON_free(want);
        run_die(&e);
    }
    cJSON_free(got);
    cJSON_free(want);
}

int run_try_resume(TrainRun *r, int max_iters) {
    double have = r->rank == 0 && file_exists(r->state_path);
    /* no state but a final model: the step finished here, and a fresh run would write over its best and final
     * models as it went (make skips such a step, or with FORCE=1 moves its files to previous/ first) */
    if (r->rank == 0 && !have && file_exists(r->final_path)) {
        Err e;
        err_set(&e, "%s: step %s already finished in %s, and there is no state file to resume (hint: make skips a "
                    "complete step; to train it again, move the step's files away, or run make FORCE=1, which moves "
                    "them to previous/)", r->final_path, r->step, r->out);
        run_die(&e);
    }
    dist_bcast(&have, sizeof have);
    if (!have) return 0;
    size_t total = r->w->table.total;
    Progress p;
    memset(&p, 0, sizeof p);
    float *hp = NULL, *hm = NULL, *hv = NULL;
    if (r->rank == 0) {
        Err e;
        StFile *f = checkpoint_open(r->state_path, r->family, &e);
        if (!f) run_die(&e);
        if (checkpoint_expect(f, "variant", r->variant, "it belongs to another ablation step; use that step's binary",
                              &e) != 0)
            run_die(&e);
        check_state_config(f, r->model_json);
        hp = xcalloc(3 * total, sizeof(float)), hm = hp + total, hv = hp + 2 * total; /* zero: alignment gaps */
        if (checkpoint_read(f, &r->w->table, hp, hm, hv, &e) != 0) run_die(&e);
        /* the state's config is this binary's, so it was written at an iteration of this very run length */
        p.iter = meta_checked(f, "step", 0, max_iters, 1, 0, 0);
        const char *rng = st_meta(f, "data_rng");
        char *end = NULL;
        p.data_rng = rng && *rng >= '0' && *rng <= '9' ? strtoull(rng, &end, 10) : 0;
        if (!end || *end) {
            err_set(&e, "%s: metadata 'data_rng' is missing or not a whole number (hint: %s)", st_path(f),
                    damaged_hint);
            run_die(&e);
        }
        p.train_seconds = meta_checked(f, "train_seconds", 0, DBL_MAX, 0, 0, 0);
        p.elapsed = meta_checked(f, "elapsed_seconds", 0, DBL_MAX, 0, 0, 0);
        p.examples = meta_checked(f, "examples", 0, DBL_MAX, 1, 0, 0);
        /* before the first evaluation: best +inf at iteration -1, last nan at -1 */
        p.best_val = meta_checked(f, "best_val_loss", 0, DBL_MAX, 0, 0, 1);
        p.best_iter = meta_checked(f, "best_val_iteration", -1, p.iter, 1, 0, 0);
        p.last_eval_iter = meta_checked(f, "last_eval_iteration", -1, p.iter, 1, 0, 0);
        p.last_val = meta_checked(f, "last_val_loss", 0, DBL_MAX, 0, 1, 1);
        /* the families' counters are sums of losses and counts */
        for (int i = 0; i < r->nextra; i++) p.extra[i] = meta_checked(f, r->extra[i].name, 0, DBL_MAX, 0, 0, 0);
        st_close(f);
        dev_upload(r->w->params, hp, total * sizeof(float));
        if (!r->zero1) dev_upload(r->w->m, hm, total * sizeof(float)), dev_upload(r->w->v, hv, total * sizeof(float));
    }
    dist_bcast(&p, sizeof p);
    dist_bcast_dev(r->w->params, total);
    if (r->zero1) {
        dist_scatter_dev(r->w->m, hm, total);
        dist_scatter_dev(r->w->v, hv, total);
    } else {
        dist_bcast_dev(r->w->m, total);
        dist_bcast_dev(r->w->v, total);
    }
    free(hp);
    r->iter = (int)p.iter;
    r->data_rng.state = p.data_rng;
    r->train_seconds = p.train_seconds;
    r->elapsed = p.elapsed;
    r->examples = p.examples;
    r->best_val = p.best_val;
    r->best_iter = (int)p.best_iter;
    r->last_eval_iter = (int)p.last_eval_iter;
    r->last_val = p.last_val;
    for (int i = 0; i < r->nextra; i++) *r->extra[i].value = p.extra[i];
    printf("resuming step %s from iteration %d (%s)\n", r->step, r->iter, r->state_path);
    return 1;
}

void run_load_params(TrainRun *r, const char *path) {
    if (r->rank == 0) {
        Err e;
        StFile *f = checkpoint_open(path, r->family, &e);
        if (!f || checkpoint_read_params(f, r->w, 0, &e) != 0) run_die(&e);
        st_close(f);
    }
    dist_bcast_dev(r->w->params, r->w->table.total);
}

/* ------------------------------------------------------------------ metrics */

void run_open_metrics(TrainRun *r, int resumed, const char *const *train_series, int ntrain,
                      const char *const *val_series, int nval) {
    Err e;
    /* the other ranks keep an unwritten copy: only rank 0 has the file (and its machine the folder) */
    r->metrics = metrics_open(r->metrics_path, resumed && r->rank == 0, &e);
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
    metrics_set_number(m, "parameters", (double)r->w->table.count);
    metrics_set_number(m, "threads", backend_threads());
    metrics_set_string(m, "backend", backend_name());
    metrics_set_number(m, "processes", r->procs);
    metrics_set_string(m, "distributed", r->procs == 1 ? "none" : r->zero1 ? "data parallel, ZeRO-1" : "data parallel");
    if (r->procs > 1) metrics_set_number(m, "grad_buckets", r->sync.nb); /* 0: one sum after the backward pass */
    metrics_set_string(m, "status", "running");
    g_running = r;
    if (!resumed) metrics_set_number(m, "started_unix", unix_seconds());
    if (r->rank == 0) tracking_start(r);
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
    metrics_set_number(m, "peak_memory_mib", peak_rss_mib()); /* rank 0's */
    /* of them, the buckets rank 0 started during its last step's backward pass (the overlap) */
    if (r->procs > 1 && r->sync.nb) metrics_set_number(m, "grad_buckets_overlapped", r->sync.early_last);
    if (dev_mem_capacity()) { /* a GPU backend: its memory, which the RSS does not show */
        metrics_set_number(m, "gpu_memory_peak_mib", dev_mem_peak() / 1048576.0);
        metrics_set_number(m, "gpu_memory_total_mib", dev_mem_capacity() / 1048576.0);
    }
    if (r->rank != 0) return;
    if (metrics_write(m, &e) != 0) run_die(&e);
    tracking_log(r);
}

void run_finish(TrainRun *r, const char *stopped_by) {
    run_profile_finish(r);
    metrics_set_string(r->metrics, "stopped_by", stopped_by);
    metrics_set_number(r->metrics, "final_val_loss", r->last_val);
    metrics_set_string(r->metrics, "status", "complete");
    metrics_set_number(r->metrics, "finished_unix", unix_seconds());
    run_write_metrics(r);
    g_running = NULL; /* its final status is written */
    if (r->rank != 0) return;
    unlink(r->state_path); /* the final model and the metrics hold everything now */
    tracking_finish(r, 0);
}

void run_fail(TrainRun *r, const char *status, const char *msg) {
    metrics_set_string(r->metrics, "status", status);
    metrics_set_string(r->metrics, "error", msg);
    run_write_metrics(r);
    g_running = NULL;
    if (r->rank == 0) tracking_finish(r, run_stop_signal() ? 128 + run_stop_signal() : 1);
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
    signal(SIGUSR1, on_signal); /* the stop request mpirun forwards (scripts/run_steps.py) */
    /* Output to a runner that is gone must not kill the trainer before it
     * saves: the write fails instead, and run_stop_signal() reports it. */
    signal(SIGPIPE, SIG_IGN);
}

int run_stop_signal(void) {
    if (!g_stop_signal && (ferror(stdout) || ferror(stderr))) g_stop_signal = SIGPIPE;
    return (int)g_stop_signal;
}

static const char *signal_name(int sig) {
    return sig == SIGINT    ? "SIGINT"
           : sig == SIGTERM ? "SIGTERM"
           : sig == SIGHUP  ? "SIGHUP"
           : sig == SIGUSR1 ? "SIGUSR1 (a stop request)"
                            : "a signal";
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
    if (r->rank == 0)
        fprintf(stderr, "kvlab: %s; state saved to %s, run make again to continue\n", msg, r->state_path);
    fflush(stderr);
    return 128 + sig;
}

/* ------------------------------------------------------------------ the training-loop tail */

void optim_step(const Optim *o, Params *w, double lr, int step, double *norm) {
    clip_grad_norm_into(w->grads, w->table.total, o->clip, norm); /* clip 0: the norm only */
    params_adamw(w, (float)lr, (float)o->beta1, (float)o->beta2, (float)o->eps, (float)o->weight_decay, step);
}

/* ------------------------------------------------------------------ step records */

void run_step_begin(TrainRun *r) {
    run_profile_step_begin(r);
    if (r->rec_pending == r->rec_cap) { /* more steps than ever between two reads: a larger buffer, on the device */
        int cap = r->rec_cap ? 2 * r->rec_cap : 64;
        StepRecord *d = dev_alloc((size_t)cap * sizeof *d); /* zero-filled */
        if (r->rec_dev) {
            dev_copy(d, r->rec_dev, (size_t)r->rec_pending * sizeof *d);
            dev_free(r->rec_dev);
        }
        r->rec_dev = d;
        r->recs = xrealloc(r->recs, (size_t)cap * sizeof *r->recs);
        r->rec_cap = cap;
    }
    StepRecord *h = &r->recs[r->rec_pending++]; /* the host's fields until the read */
    h->counted = 0.0;
    h->iter = r->iter + 1;
}

StepRecord *run_record(TrainRun *r) {
    if (!r->rec_pending) FATAL("run_record: no step begun (call run_step_begin first)");
    return r->rec_dev + r->rec_pending - 1;
}

RunShare run_loss_share(TrainRun *r, double local_counted, double scale) {
    double counted = local_counted;
    if (r->procs > 1) dist_sum(&counted, 1); /* host values: no wait for a device */
    if (r->rec_pending) r->recs[r->rec_pending - 1].counted += counted;
    RunShare s = {.counted = counted, .loss_factor = counted > 0 ? scale / counted : 0.0,
                  .backward_scale = (float)scale};
    if (r->procs > 1) s.backward_scale = (float)(counted > 0 ? scale * local_counted / counted : 0.0);
    return s;
}

int run_read_records(TrainRun *r) {
    int n = r->rec_pending;
    r->nrecs = n;
    if (!n) return 0;
    StepRecord *d = xmalloc((size_t)n * sizeof *d);
    dev_download(d, r->rec_dev, (size_t)n * sizeof *d); /* the one wait for the device since the last read */
    dev_zero(r->rec_dev, (size_t)n * sizeof *d);
    r->rec_pending = 0;
    if (r->procs > 1) { /* each rank's part of the loss and its correct count; the norm is every rank's alike */
        double *v = xmalloc(2 * (size_t)n * sizeof *v);
        for (int i = 0; i < n; i++) v[2 * i] = d[i].loss, v[2 * i + 1] = d[i].correct;
        dist_sum(v, 2 * n);
        for (int i = 0; i < n; i++) d[i].loss = v[2 * i], d[i].correct = v[2 * i + 1];
        free(v);
    }
    for (int i = 0; i < n; i++) {
        r->recs[i].loss = d[i].loss;
        r->recs[i].correct = d[i].correct;
        r->recs[i].norm = d[i].norm;
    }
    free(d);
    for (int i = 0; i < n; i++) { /* the first bad one, every rank alike: the steps after it go with it */
        if (run_check_loss(r, r->recs[i].loss, r->recs[i].iter)) return 1;
        if (r->on_record) r->on_record(r->on_record_ctx, &r->recs[i]);
    }
    return 0;
}

/* dt seconds of training on this rank: the slowest rank's, added to the run's clocks (one clock for all: time
 * budgets end every rank at the same step); returns that */
static double add_train_time(TrainRun *r, double dt) {
    dist_max(&dt, 1);
    r->train_seconds += dt;
    r->elapsed += dt;
    return dt;
}

int run_read_last(TrainRun *r) {
    double t0 = wall_seconds();
    int bad = run_read_records(r);
    add_train_time(r, wall_seconds() - t0);
    return bad;
}

void run_before_backward(TrainRun *r, int last) {
    if (last) grad_sync_arm(&r->sync);
}

void run_optim_step(TrainRun *r, const Optim *o, double lr, int step) {
    Params *w = r->w;
    size_t total = w->table.total;
    grad_sync_finish(&r->sync); /* the sum over the ranks (ZeRO-1: of this rank's slice), or what is left of it */
    if (!r->zero1) {
        optim_step(o, w, lr, step, &run_record(r)->norm);
        return;
    }
    /* ZeRO-1: the summed gradients of this rank's slice; the global norm from every slice's squares, summed over
     * the ranks on the device in the step record's norm (a square until clip_grad_sumsq_into roots it: no host
     * wait); clipping as clip_grad_norm; AdamW on the slice; then every rank's updated slice to all */
    DistRange z = r->zslice;
    float *g = w->grads + z.lo;
    double *norm = &run_record(r)->norm;
    grad_sumsq_into(g, z.n, norm); /* an empty slice: 0 */
    dist_sum_dev(norm, 1);
    clip_grad_sumsq_into(g, z.n, o->clip, norm, norm);
    params_adamw_slice(w, w->m, w->v, z.lo, z.n, (float)lr, (float)o->beta1, (float)o->beta2, (float)o->eps,
                       (float)o->weight_decay, step);
    dist_allgather_dev(w->params, total);
}

void run_reset_optimizer(TrainRun *r) {
    size_t n = r->zero1 ? r->zslice.n : r->w->table.total;
    dev_zero(r->w->m, n * sizeof(float));
    dev_zero(r->w->v, n * sizeof(float));
}

DistRange run_batch_rows(TrainRun *r, int n) {
    DistRange rows = dist_split((size_t)n, r->rank, r->procs);
    if (rows.n)
        dropout_batch_rows((int)rows.lo, (int)rows.n);
    else
        dropout_batch_rows(0, 0);
    return rows;
}

void run_banner_dist(const TrainRun *r) {
    /* a job of one process says nothing, unless it runs NCCL's collectives all the same (on the CUDA target) */
    if (r->procs <= 1 && !IS_ENABLED(CONFIG_DIST_NCCL)) return;
    char sums[160] = "";
    if (r->sync.nb)
        snprintf(sums, sizeof sums, "; gradients summed in %d buckets of %g KiB or more, started as the backward "
                 "pass finishes them", r->sync.nb, (double)DIST_BUCKET_BYTES / 1024.0);
    printf("distributed: %d process%s (%s, rank 0 on %s), %d threads each, each trains on its rows of every global "
           "batch%s%s\n", r->procs, r->procs == 1 ? "" : "es", dist_transport(), dist_host(), backend_threads(),
           r->zero1 ? "; ZeRO-1: AdamW moments sharded over the ranks" : "", sums);
    fflush(stdout);
}

int run_check_loss(TrainRun *r, double loss, int iter) {
    if (isfinite(loss)) return 0; /* the global loss: every rank decides alike */
    /* the families read records after run_optim_step, when no gradient sum is pending; one read between
     * run_before_backward and the optimiser step ends the sums on every rank first, so the collectives match */
    if (r->w->grads_final) grad_sync_finish(&r->sync);
    char msg[256];
    snprintf(msg, sizeof msg, "training loss is %g at iteration %d", loss, iter);
    run_fail(r, "failed", msg);
    fflush(stdout);
    if (r->rank != 0) return 1;
    fprintf(stderr, "error: %s (hint: %s; %s)\n", msg, r->loss_hint ? r->loss_hint : "lower the learning rate",
            file_exists(r->state_path) ? "the last good state is in the state_step file and is kept"
                                       : "no checkpoint was written yet");
    return 1;
}

double run_step_done(TrainRun *r, double t0, double examples) {
    double dt = add_train_time(r, wall_seconds() - t0);
    r->iter++;
    r->examples += examples;
    run_profile_step_done(r);
    return dt;
}

int run_checkpoint_or_stop(TrainRun *r, int checkpoint_due) {
    double sig = run_stop_signal(); /* a stop request of any rank stops all of them at this step */
    dist_max(&sig, 1);
    /* a state is written only after the steps before it are known good (nothing to read where the family read) */
    if ((checkpoint_due || sig > 0) && run_read_records(r)) return 1;
    if (checkpoint_due) {
        run_save_state(r);
        printf("checkpoint step %d -> %s\n", r->iter, r->state_path);
        fflush(stdout);
    }
    if (sig > 0 && !g_stop_signal) g_stop_signal = (int)sig;
    return sig > 0 ? run_stop(r) : 0;
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

const char *run_gpu_memory_note(void) {
    static char note[64];
    size_t cap = dev_mem_capacity();
    if (!cap) return "";
    double peak = dev_mem_peak() / 1048576.0;
    snprintf(note, sizeof note, " | GPU %.*f/%.0f MiB", peak < 100 ? 1 : 0, peak, cap / 1048576.0);
    return note;
}
