/* Learning-rate schedules. lr_warmup_cosine: linear warmup from lr/warmup
 * to lr over `warmup` steps, then cosine decay to min_lr at the last step
 * (max_iters - 1). */
#ifndef KVLAB_SCHEDULE_H
#define KVLAB_SCHEDULE_H

#include <math.h>

static inline double lr_warmup_cosine(int it, int warmup, int max_iters, double lr, double min_lr) {
    if (it < warmup) return lr * (it + 1) / warmup;
    if (max_iters - 1 <= warmup) return lr;
    double p = (double)(it - warmup) / (double)(max_iters - 1 - warmup);
    if (p > 1.0) p = 1.0;
    return min_lr + 0.5 * (1.0 + cos(3.14159265358979323846 * p)) * (lr - min_lr);
}


/* The reference synthetic runs: lr * 0.5 (1 + cos(pi t / total)), times
 * t / warmup during the warmup (so 0 at step 0); t counts from 0. */
static inline double lr_cosine_ref(int t, int warmup, int total, double lr) {
    double f = 0.5 * (1.0 + cos(3.14159265358979323846 * (double)t / (double)total));
    if (t < warmup) f *= (double)t / (double)warmup;
    return lr * f;
}

/* "Attention is all you need": factor * d^-0.5 * min(step^-0.5, step * warmup^-1.5),
 * step counted from 1. */
static inline double lr_noam(int step, int d, int warmup, double factor) {
    double s = step < 1 ? 1.0 : (double)step, w = warmup < 1 ? 1.0 : (double)warmup;
    double a = 1.0 / sqrt(s), b = s / (w * sqrt(w));
    return factor / sqrt((double)d) * (a < b ? a : b);
}

#endif
