/* The backend-neutral part of every backend's non-attention ops
 * (kernels/backend.h): dropout seeds, thresholds and batch offsets. */
#include "backend.h"

#include "common.h"
#include "hash.h"
#include "kernels.h"

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
