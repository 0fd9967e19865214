/* Training plumbing: the learning-rate schedule, the metrics file (written
 * as training goes, continued and truncated on resume), seeded streams. */
#define _GNU_SOURCE
#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common.h"
#include "metrics.h"
#include "rng.h"
#include "schedule.h"
#include "test.h"

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

int main(void) {
    test_schedule();
    test_metrics();
    test_rng();
    return TEST_SUMMARY("test_train");
}
