/* The op profile of a training run (KVLAB_PROFILE_STEPS=N in the environment): the third optimizer step this
 * process runs and the N-1 after it are timed op by op with the backend's profile (kernels.h, kprof_start),
 * paused between steps so that evaluation, logging and checkpoints are not counted. After the last of them, rank 0
 * prints where their time went and the metrics file keeps it under "profile". Every family calls run_step_begin
 * (train/trainer.c, which calls run_profile_step_begin) before a step's forward pass; run_step_done and run_finish
 * call the rest. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "kernels.h"
#include "trainer.h"

enum { PROFILE_WARMUP = 2, PROFILE_MAX_STEPS = 100000, PROFILE_TOP = 12 };

void run_profile_init(TrainRun *r) {
    r->profile_steps = r->profile_done = r->steps_here = 0;
    r->profiling = 0;
    const char *v = getenv("KVLAB_PROFILE_STEPS");
    if (!v || !*v) return;
    char *end;
    errno = 0;
    long n = strtol(v, &end, 10);
    if (errno || *end || n < 0 || n > PROFILE_MAX_STEPS) {
        Err e;
        err_set(&e, "KVLAB_PROFILE_STEPS='%s': not a whole number of steps from 0 to %d (hint: e.g. "
                    "KVLAB_PROFILE_STEPS=5 make, or unset it)", v, PROFILE_MAX_STEPS);
        run_die(&e);
    }
    r->profile_steps = (int)n;
}

void run_profile_step_begin(TrainRun *r) {
    if (!r->profile_steps || r->profile_done >= r->profile_steps) return;
    if (r->profiling)
        kprof_resume();
    else if (r->steps_here == PROFILE_WARMUP) {
        kprof_start();
        r->profiling = 1;
        r->profile_first = r->iter + 1;
    }
}

/* Rows in order of time, the ops' first: a comparison for qsort. */
static int by_ms(const void *a, const void *b) {
    const KprofRow *x = a, *y = b;
    if (!x->part != !y->part) return x->part ? 1 : -1;
    return (x->ms < y->ms) - (x->ms > y->ms);
}

cJSON *profile_json(const KprofRow *rows, int n, int steps, double step_ms) {
    cJSON *o = cJSON_CreateObject();
    double ops_ms = 0.0, waits = 0.0;
    for (int i = 0; i < n; i++) {
        ops_ms += rows[i].part ? 0.0 : rows[i].ms / steps;
        if (rows[i].part && !strcmp(rows[i].part, KPROF_HOST_WAIT)) waits += (double)rows[i].calls / steps;
    }
    cJSON_AddNumberToObject(o, "steps", steps);
    cJSON_AddNumberToObject(o, "step_ms", step_ms);
    cJSON_AddNumberToObject(o, "ops_ms", ops_ms);
    cJSON_AddNumberToObject(o, "host_waits", waits);
    cJSON *arr = cJSON_AddArrayToObject(o, "rows");
    for (int i = 0; i < n; i++) {
        cJSON *x = cJSON_CreateObject();
        cJSON_AddStringToObject(x, "op", rows[i].op);
        if (rows[i].part) cJSON_AddStringToObject(x, "part", rows[i].part);
        cJSON_AddNumberToObject(x, "calls", (double)rows[i].calls / steps);
        cJSON_AddNumberToObject(x, "ms", rows[i].ms / steps);
        cJSON_AddItemToArray(arr, x);
    }
    return o;
}

/* One line of the table: a row's calls and ms per step and its share of the step. */
static void print_row(const char *name, double calls, double ms, double step_ms) {
    printf("  %-44s %10.4g %10.3f %6.1f%%\n", name, calls, ms, step_ms > 0 ? 100.0 * ms / step_ms : 0.0);
}

/* Ends the profile after the steps it saw: the table on stdout (rank 0) and "profile" in the metrics. */
static void report(TrainRun *r) {
    const KprofRow *got;
    int n = kprof_stop(&got);
    r->profiling = 0;
    int steps = r->profile_done;
    r->profile_done = r->profile_steps; /* once per process */
    if (r->rank != 0 || steps == 0) return;
    KprofRow *rows = xmalloc((size_t)(n ? n : 1) * sizeof *rows);
    memcpy(rows, got, (size_t)n * sizeof *rows);
    qsort(rows, (size_t)n, sizeof *rows, by_ms);
    double step_ms = kprof_on_ms() / steps; /* the device's clock, as the ops' (kernels.h) */
    cJSON *o = profile_json(rows, n, steps, step_ms);
    cJSON_AddNumberToObject(o, "first_iteration", r->profile_first);
    cJSON_AddStringToObject(o, "backend", backend_name());
    char which[64];
    if (steps == 1)
        snprintf(which, sizeof which, "step %d (%.2f ms)", r->profile_first, step_ms);
    else
        snprintf(which, sizeof which, "steps %d-%d (%.2f ms each)", r->profile_first, r->profile_first + steps - 1,
                 step_ms);
    printf("profile of %s, op by op (KVLAB_PROFILE_STEPS=%d):\n", which, r->profile_steps);
    printf("  %-44s %10s %10s %7s\n", "op", "calls/step", "ms/step", "share");
    int ops = 0, parts = 0;
    for (int i = 0; i < n; i++) {
        if (rows[i].part)
            parts++;
        else if (ops++ < PROFILE_TOP)
            print_row(rows[i].op, (double)rows[i].calls / steps, rows[i].ms / steps, step_ms);
    }
    if (ops > PROFILE_TOP) printf("  (%d more ops in the metrics file)\n", ops - PROFILE_TOP);
    double ops_ms = cJSON_GetObjectItem(o, "ops_ms")->valuedouble;
    printf("  %-44s %10s %10.3f %6.1f%%\n", "all ops (the rest: host work between them)", "", ops_ms,
           step_ms > 0 ? 100.0 * ops_ms / step_ms : 0.0);
    double waits = cJSON_GetObjectItem(o, "host_waits")->valuedouble;
    if (parts) {
        /* the ops in which the host waited for the device (a GPU's round trips), then the kernels */
        printf("  host waits for the device: %.4g a step", waits);
        const char *sep = " (";
        for (int i = ops; i < n; i++)
            if (!strcmp(rows[i].part, KPROF_HOST_WAIT)) {
                printf("%s%s %.4g", sep, rows[i].op, (double)rows[i].calls / steps);
                sep = ", ";
            }
        printf("%s\n", waits ? ")" : "");
        printf("  kernels and cuBLAS products inside the ops:\n");
    }
    for (int i = ops, k = 0; i < n && k < PROFILE_TOP; i++, k++) { /* the parts follow the ops (by_ms) */
        char name[160];
        snprintf(name, sizeof name, "%s / %s", rows[i].op, rows[i].part);
        print_row(name, (double)rows[i].calls / steps, rows[i].ms / steps, step_ms);
    }
    fflush(stdout);
    char *text = cJSON_PrintUnformatted(o);
    metrics_set_json(r->metrics, "profile", text);
    free(text);
    cJSON_Delete(o);
    free(rows);
}

void run_profile_step_done(TrainRun *r) {
    r->steps_here++;
    if (!r->profiling) return;
    r->profile_done++;
    if (r->profile_done == r->profile_steps)
        report(r);
    else
        kprof_pause(); /* evaluation and logging before the next step are not the step's */
}

void run_profile_finish(TrainRun *r) {
    if (r->profiling) report(r); /* training ended inside the window: the steps it saw */
}
