#include "metrics.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

struct Metrics {
    cJSON *root, *series;
    char *path;
    MetricsValue *fresh; /* appended since the last metrics_fresh; series names owned */
    int nfresh, capfresh, taken;
};

Metrics *metrics_open(const char *path, int resume, Err *e) {
    Metrics *m = xcalloc(1, sizeof *m);
    m->path = xstrdup(path);
    if (resume && file_exists(path)) {
        char *text = read_file(path, NULL, e);
        if (!text) goto fail;
        m->root = cJSON_Parse(text);
        free(text);
        if (!cJSON_IsObject(m->root) || !cJSON_IsObject(cJSON_GetObjectItem(m->root, "metrics"))) {
            err_set(e, "%s: not a metrics file this run can continue (hint: move it away to start the step afresh)",
                    path);
            goto fail;
        }
    } else {
        m->root = cJSON_CreateObject();
        cJSON_AddItemToObject(m->root, "metrics", cJSON_CreateObject());
    }
    m->series = cJSON_GetObjectItem(m->root, "metrics");
    return m;
fail:
    metrics_free(m);
    return NULL;
}

static void fresh_clear(Metrics *m) {
    for (int i = 0; i < m->nfresh; i++) free((char *)m->fresh[i].series);
    m->nfresh = 0;
}

void metrics_free(Metrics *m) {
    if (!m) return;
    fresh_clear(m);
    free(m->fresh);
    cJSON_Delete(m->root);
    free(m->path);
    free(m);
}

static void replace(cJSON *obj, const char *key, cJSON *item) {
    if (cJSON_GetObjectItem(obj, key))
        cJSON_ReplaceItemInObject(obj, key, item);
    else
        cJSON_AddItemToObject(obj, key, item);
}

/* Non-finite numbers have no JSON form: they are written as null. */
static cJSON *number(double v) { return isfinite(v) ? cJSON_CreateNumber(v) : cJSON_CreateNull(); }

void metrics_set_number(Metrics *m, const char *key, double v) { replace(m->root, key, number(v)); }

double metrics_get_number(const Metrics *m, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(m->root, key);
    return cJSON_IsNumber(v) ? v->valuedouble : NAN;
}

void metrics_set_string(Metrics *m, const char *key, const char *v) { replace(m->root, key, cJSON_CreateString(v)); }

void metrics_set_json(Metrics *m, const char *key, const char *json_text) {
    cJSON *v = cJSON_Parse(json_text);
    replace(m->root, key, v ? v : cJSON_CreateNull());
}

void metrics_append(Metrics *m, const char *series, double v) {
    cJSON *arr = cJSON_GetObjectItem(m->series, series);
    if (!arr) {
        arr = cJSON_CreateArray();
        cJSON_AddItemToObject(m->series, series, arr);
    }
    cJSON_AddItemToArray(arr, number(v));
    if (m->taken) fresh_clear(m);
    m->taken = 0;
    if (m->nfresh == m->capfresh) {
        m->capfresh = m->capfresh ? 2 * m->capfresh : 32;
        m->fresh = xrealloc(m->fresh, (size_t)m->capfresh * sizeof *m->fresh);
    }
    m->fresh[m->nfresh++] = (MetricsValue){xstrdup(series), v};
}

int metrics_fresh(Metrics *m, const MetricsValue **values) {
    if (m->taken) fresh_clear(m);
    m->taken = 1;
    *values = m->fresh;
    return m->nfresh;
}

void metrics_truncate(Metrics *m, const char *iter_series, const char *const *series, int nseries, double last) {
    cJSON *iters = cJSON_GetObjectItem(m->series, iter_series);
    if (!iters) return;
    int keep = 0, n = cJSON_GetArraySize(iters);
    while (keep < n && cJSON_GetArrayItem(iters, keep)->valuedouble <= last) keep++;
    for (int s = -1; s < nseries; s++) {
        cJSON *arr = s < 0 ? iters : cJSON_GetObjectItem(m->series, series[s]);
        if (!arr) continue;
        while (cJSON_GetArraySize(arr) > keep) cJSON_DeleteItemFromArray(arr, cJSON_GetArraySize(arr) - 1);
    }
}

int metrics_write(Metrics *m, Err *e) {
    char *text = cJSON_PrintUnformatted(m->root);
    if (!text) return err_set(e, "%s: out of memory formatting metrics", m->path);
    size_t n = strlen(text);
    text[n] = '\n'; /* replaces the NUL; write_file_atomic takes the length */
    int rc = write_file_atomic(m->path, text, n + 1, e);
    cJSON_free(text);
    return rc;
}
