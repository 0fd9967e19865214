#include "tasks.h"

#include <string.h>

#include "rng.h"

static const char *const NAMES[NUM_TASKS] = {"reverse", "sort", "swap", "sub", "copy"};

const char *task_name(SynthTask t) { return NAMES[t]; }

int task_from_name(const char *name) {
    for (int t = 0; t < NUM_TASKS; t++)
        if (!strcmp(name, NAMES[t])) return t;
    return -1;
}

void task_labels(SynthTask t, const int *x, int T, int *y) {
    switch (t) {
    case TASK_REVERSE:
        for (int i = 0; i < T; i++) y[i] = x[T - 1 - i];
        break;
    case TASK_SORT: { /* counting sort: digits only */
        int count[10] = {0}, k = 0;
        for (int i = 0; i < T; i++) count[x[i]]++;
        for (int d = 0; d < 10; d++)
            while (count[d]--) y[k++] = d;
        break;
    }
    case TASK_SWAP:
        for (int i = 0; i < T; i++) y[i] = x[(i + T / 2) % T];
        break;
    case TASK_SUB:
        for (int i = 0; i < T; i++) y[i] = 9 - x[i];
        break;
    case TASK_COPY:
    default:
        memcpy(y, x, (size_t)T * sizeof(int));
        break;
    }
}

void task_generate(SynthTask t, int n, int T, uint64_t seed, uint64_t stream, int *x, int *y) {
    Rng rng = rng_seeded(seed, stream);
    for (int s = 0; s < n; s++) {
        for (int i = 0; i < T; i++) x[(size_t)s * T + i] = (int)rng_below(&rng, 10);
        task_labels(t, x + (size_t)s * T, T, y + (size_t)s * T);
    }
}
