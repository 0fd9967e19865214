/* The backend-neutral part of every backend's non-attention ops
 * (kernels/backend.h): dropout seeds, thresholds and batch offsets. */
#include "backend.h"

#include "common.h"
#include "hash.h"
#include "kernels.h"

/* ------------------------------------------------------------------ argument checks */

void args_btc(const char *op, int B, int T, int C, int min_T) {
    if (!(B > 0 && T >= min_T && C > 0)) FATAL("%s: bad shape B=%d T=%d C=%d", op, B, T, C);
}

void args_pool(const char *op, int B, int T, int C, int first, int count) {
    if (!(B > 0 && C > 0 && first >= 0 && count > 0 && first + count <= T))
        FATAL("%s: bad range: tokens %d..%d of %d (B=%d C=%d)", op, first, first + count - 1, T, B, C);
}

void args_rows(const char *op, int N, int C) {
    if (!(N > 0 && C > 0)) FATAL("%s: bad shape N=%d C=%d", op, N, C);
}

void args_linear(const char *op, int N, int C, int OC) {
    if (!(N > 0 && C > 0 && OC > 0)) FATAL("%s: bad shape N=%d C=%d OC=%d", op, N, C, OC);
}

void args_distinct(const char *op, const char *names, const void *a, const void *b, const void *c) {
    if (a == b || (c && (a == c || b == c))) FATAL("%s: %s must be different buffers", op, names);
}

void args_classes(const char *op, int N, int V, float smoothing) {
    if (!(N > 0 && V > 0)) FATAL("%s: bad shape N=%d V=%d", op, N, V);
    if (!(smoothing >= 0.0f && smoothing < 1.0f))
        FATAL("%s: label smoothing must be in [0, 1), got %g", op, (double)smoothing);
}

void args_adamw(int t) {
    if (t < 1) FATAL("adamw_update: step t must be >= 1, got %d", t);
}

void args_clip(const char *op, double max_norm) {
    if (!(max_norm >= 0.0)) FATAL("%s: max_norm must be >= 0 (0: no clipping), got %g", op, max_norm);
}

void args_embedding(int B, int T, int C, int V) {
    args_btc("embedding_forward", B, T, C, 1);
    if (V <= 0) FATAL("embedding_forward: vocabulary size V must be > 0, got %d", V);
}

void args_gelu_linear(const void *dpre, const void *act, const void *dout, const void *pre, int N, int C, int OC) {
    args_linear("gelu_linear_backward", N, C, OC);
    args_distinct("gelu_linear_backward", "dpre and pre", dpre, pre, NULL);
    args_distinct("gelu_linear_backward", "dpre, act and dout", dpre, act, dout);
}

void args_bad_id(const char *op, IdsKind kind, int id, int index, int V) {
    if (kind == IDS_TOKENS) FATAL("%s: token %d at position %d is outside the vocabulary (size %d)", op, id, index, V);
    FATAL("%s: target %d at row %d is outside [0, %d)", op, id, index, V);
}

int args_ids(const char *op, IdsKind kind, const int *ids, int n, int V, int has_skip, int skip) {
    int counted = 0;
    for (int i = 0; i < n; i++) {
        if (has_skip && ids[i] == skip) continue;
        if (ids[i] < 0 || ids[i] >= V) args_bad_id(op, kind, ids[i], i, V);
        counted++;
    }
    return counted;
}

/* ------------------------------------------------------------------ dropout */

uint64_t dropout_seed(uint64_t run_seed, uint64_t step, uint64_t site) {
    return mix64(mix64(run_seed * 0x9e3779b97f4a7c15ull + step) ^ (site * 0xd1b54a32d192ed03ull));
}

/* One tensor's AdamW: a single span of the batched update each backend implements. */
void adamw_update(float *param, const float *grad, float *m, float *v, size_t n,
                  float lr, float beta1, float beta2, float eps, float weight_decay, int t) {
    AdamwSpan s = {.offset = 0, .state_offset = 0, .n = n, .weight_decay = weight_decay};
    adamw_update_spans(param, grad, m, v, &s, 1, lr, beta1, beta2, eps, t);
}

/* ------------------------------------------------------------------ values returned to the host
 *
 * Each backend computes these into device memory (the *_into ops, which a training step uses so that it never
 * waits for a GPU); the forms that return the value are the same op and a download, here once for every backend. */

static double *scratch_double(void) {
    static double *d;
    if (!d) d = dev_alloc(sizeof(double));
    return d;
}

static double download_double(const double *d) {
    double v;
    dev_download(&v, d, sizeof v);
    return v;
}

int argmax_correct(const act_t *logits, const int *targets, int N, int V, int ignore_index) {
    KPROF_OP();
    double *d = scratch_double();
    dev_zero(d, sizeof(double));
    argmax_correct_into(d, logits, targets, N, V, ignore_index);
    return (int)download_double(d);
}

double sum_of(const float *x, size_t n) {
    KPROF_OP();
    double *d = scratch_double();
    dev_zero(d, sizeof(double));
    sum_into(d, x, n, 1.0);
    return download_double(d);
}

double clip_grad_norm(float *grad, size_t n, double max_norm) {
    KPROF_OP();
    if (!(max_norm > 0.0)) FATAL("clip_grad_norm: max_norm must be > 0, got %g", max_norm);
    clip_grad_norm_into(grad, n, max_norm, scratch_double());
    return download_double(scratch_double());
}

double grad_norm(const float *grad, size_t n) {
    KPROF_OP();
    clip_grad_norm_into((float *)grad, n, 0.0, scratch_double()); /* max_norm 0: the norm only, grad not written */
    return download_double(scratch_double());
}

uint32_t dropout_threshold(float p, const char *op) {
    if (!(p >= 0.0f && p < 1.0f)) FATAL("%s: dropout probability must be in [0, 1), got %g", op, (double)p);
    return (uint32_t)(p * 16777216.0f);
}

static int g_batch_first, g_batch_count; /* dropout_batch_rows */

void dropout_batch_rows(int first, int count) {
    if (first < 0 || count < 0 || (first > 0 && count == 0))
        FATAL("dropout_batch_rows: rows [%d, %d + %d) of a global batch", first, first, count);
    g_batch_first = first;
    g_batch_count = count;
}

int dropout_batch_first(void) { return g_batch_first; }

size_t dropout_batch_offset(size_t n, const char *op) {
    if (!g_batch_count) return 0;
    if (n % (size_t)g_batch_count)
        FATAL("%s: %zu values are not %d batch rows (dropout_batch_rows)", op, n, g_batch_count);
    return (size_t)g_batch_first * (n / (size_t)g_batch_count);
}
