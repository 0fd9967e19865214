/* Learning-rate schedule: linear warmup from lr/warmup to lr over `warmup`
 * steps, then cosine decay to min_lr at the last step (max_iters - 1). */
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

#endif
