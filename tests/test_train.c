/* Training plumbing: the learning-rate schedule, the metrics file (written
 * as training goes, continued and truncated on resume), seeded streams, and
 * the training-loop tail every family calls (optimiser step, non-finite loss,
 * step counting, checkpoint cadence and stop signals). */
#define _GNU_SOURCE
#include <cjson/cJSON.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common.h"
#include "metrics.h"
#include "rng.h"
#include "params.h"
#include "schedule.h"
#include "test.h"
#include "trainer.h"

static void test_schedule(void) {
    /* warmup 10 to lr 1e-3, then cosine over steps 10..110 to 1e-4 at the last of 111 steps */
    CHECK_CLOSE(lr_warmup_cosine(0, 10, 111, 1e-3, 1e-4), 1e-4, 1e-15, 0, "first warmup step is lr/warmup");
    CHECK_CLOSE(lr_warmup_cosine(4, 10, 111, 1e-3, 1e-4), 5e-4, 1e-15, 0, "warmup is linear");
    CHECK_CLOSE(lr_warmup_cosine(10, 10, 111, 1e-3, 1e-4), 1e-3, 1e-15, 0, "peak right after warmup");
    CHECK_CLOSE(lr_warmup_cosine(60, 10, 111, 1e-3, 1e-4), 5.5e-4, 1e-12, 0, "half way down: (lr + min)/2");
    CHECK_CLOSE(lr_warmup_cosine(110, 10, 111, 1e-3, 1e-4), 1e-4, 1e-15, 0, "the last step reaches the floor");
    CHECK_CLOSE(lr_warmup_cosine(500, 10, 111, 1e-3, 1e-4), 1e-4, 1e-15, 0, "the floor holds after the end");
    int mono = 1;
    for (int it = 11; it < 111; it++)
        mono &= lr_warmup_cosine(it, 10, 111, 1e-3, 1e-4) <= lr_warmup_cosine(it - 1, 10, 111, 1e-3, 1e-4);
    CHECK(mono, "the cosine part decreases monotonically");
    CHECK_CLOSE(lr_warmup_cosine(3, 0, 1, 2e-3, 0), 2e-3, 0, 0, "no warmup, one step: the peak");
    /* reference synthetic schedule: 0 at step 0, cosine times t/warmup, 0 at the end */
    CHECK(lr_cosine_ref(0, 5, 100, 1e-3) == 0.0, "the synthetic schedule starts at 0");
    CHECK_CLOSE(lr_cosine_ref(2, 5, 100, 1e-3), 1e-3 * 0.4 * 0.5 * (1 + cos(3.14159265358979 * 0.02)), 1e-15, 0,
                "warmup multiplies the cosine by t/warmup");
    CHECK_CLOSE(lr_cosine_ref(50, 5, 100, 1e-3), 5e-4, 1e-15, 0, "half way: half the rate");
    CHECK_CLOSE(lr_cosine_ref(100, 5, 100, 1e-3), 0.0, 1e-18, 0, "0 at the end");
    /* Noam: peak factor d^-0.5 warmup^-0.5 at step = warmup */
    CHECK_CLOSE(lr_noam(4000, 512, 4000, 1.0), 1.0 / sqrt(512.0) / sqrt(4000.0), 1e-15, 0, "Noam peak at the warmup");
    CHECK_CLOSE(lr_noam(1, 512, 4000, 1.0), 1.0 / sqrt(512.0) / (4000.0 * sqrt(4000.0)), 1e-18, 0,
                "Noam starts at step 1");
    CHECK_CLOSE(lr_noam(16000, 512, 4000, 2.0), 2.0 / sqrt(512.0) / 126.49110640673517, 1e-15, 0,
                "Noam decays as step^-0.5 after the warmup");
}

static cJSON *load(const char *path) {
    char *text = read_file(path, NULL, NULL);
    cJSON *j = text ? cJSON_Parse(text) : NULL;
    free(text);
    return j;
}

static void test_metrics(void) {
    char dir[] = "/tmp/kvlab_test_metrics_XXXXXX";
    if (!mkdtemp(dir)) FATAL("mkdtemp failed");
    char path[256];
    snprintf(path, sizeof path, "%s/training_metrics_stepX.json", dir);
    Err e;
    Metrics *m = metrics_open(path, 0, &e);
    metrics_set_string(m, "status", "running");
    metrics_set_json(m, "config", "{\"SEED\":5}");
    metrics_set_number(m, "job_copy_seed1_test_accuracy", 0.875);
    CHECK(metrics_get_number(m, "job_copy_seed1_test_accuracy") == 0.875 && isnan(metrics_get_number(m, "nope")) &&
              isnan(metrics_get_number(m, "status")),
          "metrics_get_number: a set number back, NAN for absent keys and strings");
    for (int it = 1; it <= 6; it++) {
        metrics_append(m, "iterations", it);
        metrics_append(m, "train_losses", 10.0 - it);
        if (it % 3 == 0) {
            metrics_append(m, "val_iterations", it);
            metrics_append(m, "val_losses", 20.0 - it);
        }
    }
    metrics_append(m, "train_losses", NAN); /* NaN has no JSON form */
    metrics_append(m, "iterations", 7);
    CHECK(metrics_write(m, &e) == 0, "write: %s", e.msg);
    metrics_free(m);
    cJSON *j = load(path);
    CHECK(j && cJSON_IsObject(j), "the file is one JSON object");
    cJSON *s = cJSON_GetObjectItem(j, "metrics");
    CHECK(cJSON_GetArraySize(cJSON_GetObjectItem(s, "iterations")) == 7 &&
              cJSON_GetArraySize(cJSON_GetObjectItem(s, "val_iterations")) == 2,
          "every series is stored with its own iteration list");
    CHECK(cJSON_IsNull(cJSON_GetArrayItem(cJSON_GetObjectItem(s, "train_losses"), 6)), "NaN is written as null");
    CHECK(cJSON_GetObjectItem(cJSON_GetObjectItem(j, "config"), "SEED")->valueint == 5, "embedded JSON");
    cJSON_Delete(j);
    /* resume from iteration 4: later entries go, earlier ones stay */
    m = metrics_open(path, 1, &e);
    CHECK(m != NULL, "reopen: %s", m ? "" : e.msg);
    CHECK(metrics_get_number(m, "job_copy_seed1_test_accuracy") == 0.875, "numbers survive a resume");
    const char *train[] = {"train_losses"}, *val[] = {"val_losses"};
    metrics_truncate(m, "iterations", train, 1, 4);
    metrics_truncate(m, "val_iterations", val, 1, 4);
    metrics_write(m, &e);
    metrics_free(m);
    j = load(path);
    s = cJSON_GetObjectItem(j, "metrics");
    cJSON *tl = cJSON_GetObjectItem(s, "train_losses");
    CHECK(cJSON_GetArraySize(cJSON_GetObjectItem(s, "iterations")) == 4 && cJSON_GetArraySize(tl) == 4 &&
              cJSON_GetArrayItem(tl, 3)->valuedouble == 6.0,
          "truncation keeps iterations <= 4 and their values");
    CHECK(cJSON_GetArraySize(cJSON_GetObjectItem(s, "val_losses")) == 1, "validation series truncated too");
    CHECK(!strcmp(cJSON_GetObjectItem(j, "status")->valuestring, "running"), "the rest of the document stays");
    cJSON_Delete(j);
    /* a damaged file cannot be continued, with a clear error */
    write_file_atomic(path, "{\"metrics\": [1,", 15, &e);
    m = metrics_open(path, 1, &e);
    CHECK(m == NULL && strstr(e.msg, path) && strstr(e.msg, "hint"), "a damaged metrics file is named: %s", e.msg);
    unlink(path);
    rmdir(dir);
}

static void test_rng(void) {
    Rng a = rng_seeded(42, 1), b = rng_seeded(42, 1), c = rng_seeded(42, 2);
    int same = 1, differ = 0;
    for (int i = 0; i < 100; i++) {
        uint64_t x = rng_u64(&a), y = rng_u64(&b), z = rng_u64(&c);
        same &= x == y;
        differ += x != z;
    }
    CHECK(same && differ == 100, "streams are determined by (seed, stream) and differ between streams");
    double mean = 0.0, var = 0.0;
    int n = 100000, below = 1;
    for (int i = 0; i < n; i++) {
        double g = rng_normal(&a);
        mean += g;
        var += g * g;
        below &= rng_below(&b, 7) < 7;
    }
    mean /= n;
    var = var / n - mean * mean;
    CHECK(fabs(mean) < 0.02 && fabs(var - 1.0) < 0.03, "normal draws: mean %.4f, variance %.4f", mean, var);
    CHECK(below, "rng_below stays below its bound");
}

/* optim_step, and the norm it leaves in device memory */
static double norm_of_step(const Optim *o, Params *w, double lr, int step) {
    double *d = dev_alloc(sizeof(double)), norm;
    optim_step(o, w, lr, step, d);
    dev_download(&norm, d, sizeof norm);
    dev_free(d);
    return norm;
}

/* Two optimiser steps against a float64 AdamW written out here: clipping to the global norm, bias correction,
 * betas, epsilon, and decoupled weight decay on the decay tensor only. */
static void test_optim_step(void) {
    Params w = {0};
    param_add(&w.table, "w", 1, 2, 2, 3);
    param_add_next(&w.table, "b", 0, 1, 3); /* no alignment gap: the flat buffers are the 9 values below */
    params_alloc(&w);
    enum { N = 9 };
    CHECK(w.table.total == N && w.table.specs[1].offset == 6, "b follows w: %zu floats", w.table.total);
    float p0[N], g[2][N]; /* different gradients in the two steps, or bias correction hides the betas */
    for (int i = 0; i < N; i++) {
        p0[i] = 0.5f + 0.1f * (float)i;
        g[0][i] = 0.3f * (float)(i - 4) + 0.05f;
        g[1][i] = -0.2f * g[0][i] + 0.03f * (float)i;
    }
    const Optim o = {.beta1 = 0.8, .beta2 = 0.99, .eps = 1e-3, .weight_decay = 0.1, .clip = 1.0};
    const double lr[2] = {0.01, 0.02};
    double p[N], m[N] = {0}, v[N] = {0}, norm0 = 0.0;
    for (int i = 0; i < N; i++) p[i] = p0[i];
    params_from_host(&w, w.params, p0);
    for (int step = 1; step <= 2; step++) {
        const float *gs = g[step - 1];
        double want = 0.0;
        for (int i = 0; i < N; i++) want += (double)gs[i] * gs[i];
        want = sqrt(want);
        if (step == 1) norm0 = want;
        params_from_host(&w, w.grads, gs);
        double norm = norm_of_step(&o, &w, lr[step - 1], step);
        CHECK_CLOSE(norm, want, 0, 1e-6, "optim_step returns the norm before clipping (step %d)", step);
        double scale = want > o.clip ? o.clip / want : 1.0;
        for (int i = 0; i < N; i++) {
            double gi = gs[i] * scale, decay = i < 6 ? o.weight_decay : 0.0;
            m[i] = o.beta1 * m[i] + (1 - o.beta1) * gi;
            v[i] = o.beta2 * v[i] + (1 - o.beta2) * gi * gi;
            double mh = m[i] / (1 - pow(o.beta1, step)), vh = v[i] / (1 - pow(o.beta2, step));
            p[i] -= lr[step - 1] * (mh / (sqrt(vh) + o.eps) + decay * p[i]);
        }
    }
    CHECK(norm0 > o.clip, "the first step is clipped (norm %.3f)", norm0);
    float *got = params_to_host(&w, w.params), *gg = params_to_host(&w, w.grads);
    double worst = 0.0;
    for (int i = 0; i < N; i++) worst = fmax(worst, fabs(got[i] - p[i]) / fabs(p[i]));
    CHECK(worst < 2e-6, "two AdamW steps with clipping and decay match float64 (worst relative error %.2e)", worst);
    double norm1 = 0.0;
    for (int i = 0; i < N; i++) norm1 += (double)g[1][i] * g[1][i];
    norm1 = sqrt(norm1);
    CHECK_CLOSE(gg[0], norm1 > o.clip ? g[1][0] * o.clip / norm1 : g[1][0], 0, 1e-6,
                "the gradients are clipped in place to the max norm");
    free(got), free(gg);
    const Optim noclip = {.beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .clip = 0.0};
    params_from_host(&w, w.grads, g[0]);
    double norm = norm_of_step(&noclip, &w, 0.0, 3);
    gg = params_to_host(&w, w.grads);
    CHECK(fabs(norm - norm0) <= 1e-6 * norm0 && gg[0] == g[0][0], "clip 0: the norm is measured, the gradients kept");
    free(gg);
    params_free(&w);
}

static const char *status_of(const char *path, const char **error) {
    static char status[64], err[256];
    cJSON *j = load(path);
    cJSON *s = j ? cJSON_GetObjectItem(j, "status") : NULL, *e = j ? cJSON_GetObjectItem(j, "error") : NULL;
    snprintf(status, sizeof status, "%s", cJSON_IsString(s) ? s->valuestring : "?");
    snprintf(err, sizeof err, "%s", cJSON_IsString(e) ? e->valuestring : "");
    cJSON_Delete(j);
    if (error) *error = err;
    return status;
}

/* A run of a made-up family over w, its files in dir. */
static void new_run(TrainRun *r, Params *w, const char *dir, const char *step) {
    memset(r, 0, sizeof *r);
    r->w = w;
    r->variant = "test";
    r->dataset = "none";
    r->unit = "examples";
    r->model_json = "{\"test\":1}";
    run_init(r, "test", dir, step, 7);
}

static void open_run(TrainRun *r, Params *w, const char *dir, const char *step) {
    new_run(r, w, dir, step);
    static const char *const series[] = {"iterations", "train_losses"};
    static const char *const val[] = {"val_iterations", "val_losses"};
    run_open_metrics(r, 0, series, 2, val, 2);
    run_write_metrics(r);
}

static void fold_loss(void *ctx, const StepRecord *rec) { *(double *)ctx += rec->loss; }

static void test_loop_tail(void) {
    char dir[] = "/tmp/kvlab_test_train_XXXXXX";
    if (!mkdtemp(dir)) FATAL("mkdtemp failed");
    Params w = {0};
    param_add(&w.table, "w", 1, 1, 4);
    params_alloc(&w);
    TrainRun r;
    const char *error;
    open_run(&r, &w, dir, "A");
    r.iter = 3;
    CHECK(run_check_loss(&r, 2.5, 4) == 0 && !strcmp(status_of(r.metrics_path, NULL), "running"),
          "a finite loss goes on");
    CHECK(run_read_records(&r) == 0 && r.nrecs == 0, "nothing to read before a step");
    /* five steps' records on the device: the first two each read at once (each step's loss, correct count and
     * norm, the host's count and iteration beside them, the folding callback for each good one), the last three
     * read together: a good one, a NaN, and a good one after it (iterations 5, 6 and 7) */
    double fold_sum = 0.0;
    r.on_record = fold_loss;
    r.on_record_ctx = &fold_sum;
    const double loss[5] = {2.5, 1.5, 0.25, NAN, 8.0};
    for (int k = 0; k < 5; k++) {
        if (k >= 2) r.iter = k + 2; /* run_step_done's count: the record is iteration r.iter + 1 */
        run_step_begin(&r);
        double rec[3] = {loss[k], 10.0 + k, 0.5 * k};
        dev_upload(&run_record(&r)->loss, rec, sizeof rec); /* loss, correct, norm: a step's ops write them there */
        RunShare s = run_loss_share(&r, 8, 0.5);
        CHECK(s.counted == 8 && s.loss_factor == 0.5 / 8 && s.backward_scale == 0.5f,
              "one process: the count is its own, loss factor scale/count, backward scale the scale");
        run_loss_share(&r, 4, 0.5); /* a second micro-batch adds to the step's count */
        if (k < 2) {
            int read = run_read_records(&r);
            CHECK(read == 0 && r.nrecs == 1 && r.recs[0].loss == loss[k] && r.recs[0].correct == 10 + k &&
                      r.recs[0].norm == 0.5 * k && r.recs[0].counted == 12 && r.recs[0].iter == 4,
                  "step %d read back: loss %g, correct %g, norm %g, counted %g, iteration %d", k, r.recs[0].loss,
                  r.recs[0].correct, r.recs[0].norm, r.recs[0].counted, r.recs[0].iter);
            CHECK(run_read_records(&r) == 0 && r.nrecs == 0, "a record is read once");
        }
    }
    CHECK(fold_sum == 4.0, "the callback saw each good record read so far once (sum of losses %g)", fold_sum);
    CHECK(run_read_records(&r) == 1 && r.nrecs == 3, "a NaN loss among the unread records stops the step");
    CHECK(!strcmp(status_of(r.metrics_path, &error), "failed") && !strcmp(error, "training loss is nan at iteration 6"),
          "the metrics say failed and name the iteration that produced the loss: %s", error);
    CHECK(!file_exists(r.state_path), "a failed step writes no state over the last good one");
    CHECK(fold_sum == 4.25, "the good record before the bad one is folded, the bad one and the one after it are not "
          "(sum of losses %g, want 4.25)", fold_sum);
    dev_free(r.rec_dev), free(r.recs); /* run_free would free the literal model_json */
    metrics_free(r.metrics);

    open_run(&r, &w, dir, "B");
    double t0 = wall_seconds();
    double dt = run_step_done(&r, t0, 48);
    CHECK(r.iter == 1 && dt >= 0 && r.train_seconds == dt && r.elapsed == dt && r.examples == 48,
          "a finished step counts one iteration, its time and its examples");
    /* the loop's unread tail: read with its wait counted as training time, no iteration added */
    run_step_begin(&r);
    double tail_rec[3] = {3.25, 0.0, 0.0};
    dev_upload(&run_record(&r)->loss, tail_rec, sizeof tail_rec);
    double before = r.train_seconds;
    CHECK(run_read_last(&r) == 0 && r.nrecs == 1 && r.recs[0].loss == 3.25 && r.iter == 1,
          "run_read_last reads the unread record (%d read) and adds no iteration", r.nrecs);
    CHECK(r.train_seconds > before && r.elapsed - dt == r.train_seconds - before,
          "the read's wait is training time (%g s more) and wall time alike", r.train_seconds - before);
    CHECK(run_checkpoint_or_stop(&r, 0) == 0 && !file_exists(r.state_path), "no checkpoint when none is due");
    CHECK(run_checkpoint_or_stop(&r, 1) == 0 && file_exists(r.state_path), "a due checkpoint writes the state");
    run_step_done(&r, wall_seconds(), 48);
    run_catch_signals();
    raise(SIGTERM);
    CHECK(run_checkpoint_or_stop(&r, 0) == 128 + SIGTERM, "SIGTERM stops the step with status 128 + SIGTERM");
    CHECK(!strcmp(status_of(r.metrics_path, &error), "stopped") && strstr(error, "SIGTERM at iteration 2"),
          "the metrics say stopped, by what and where: %s", error);
    dev_free(r.rec_dev), free(r.recs);
    metrics_free(r.metrics);
    TrainRun again;
    new_run(&again, &w, dir, "B");
    CHECK(run_try_resume(&again, 2) == 1 && again.iter == 2 && again.examples == 96,
          "the stop saved the state at the current iteration (resumed at %d)", again.iter);
    params_free(&w);
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    CHECK(system(cmd) == 0, "clean up %s", dir);
}

int main(void) {
    test_schedule();
    test_metrics();
    test_rng();
    test_optim_step();
    test_loop_tail(); /* last: it leaves a stop request set */
    return TEST_SUMMARY("test_train");
}
