/* training_metrics_step<STEP>.json, written as training goes.
 *
 * The document is kept in memory (cJSON) and rewritten atomically at every
 * log and evaluation, so a killed run keeps everything up to its last
 * write. Series are arrays under "metrics"; each value series is paired
 * with its own iteration series (train_losses with iterations, val_losses
 * with val_iterations), so no interval has to be inferred. */
#ifndef KVLAB_METRICS_H
#define KVLAB_METRICS_H

#include "common.h"

typedef struct Metrics Metrics;

/* Starts a new document, or continues the existing file at path (resume). */
Metrics *metrics_open(const char *path, int resume, Err *e);
void metrics_free(Metrics *m);
void metrics_set_number(Metrics *m, const char *key, double v);
/* A number set with metrics_set_number (also after a resume); NAN if absent. */
double metrics_get_number(const Metrics *m, const char *key);
void metrics_set_string(Metrics *m, const char *key, const char *v);
/* Parses json_text and stores the value under key (e.g. the resolved config). */
void metrics_set_json(Metrics *m, const char *key, const char *json_text);
void metrics_append(Metrics *m, const char *series, double v);
/* The values appended since the previous call, in order (what experiment
 * tracking reports); valid until the next call or metrics_free. */
typedef struct {
    const char *series;
    double value;
} MetricsValue;
int metrics_fresh(Metrics *m, const MetricsValue **values);
/* Drops the entries recorded after iteration `last` from every series that
 * is paired with iter_series (used when a run resumes from a checkpoint). */
void metrics_truncate(Metrics *m, const char *iter_series, const char *const *series, int nseries, double last);
int metrics_write(Metrics *m, Err *e);

#endif
