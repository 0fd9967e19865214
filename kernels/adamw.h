/* One AdamW update of one value, the formula every backend applies (host and
 * CUDA device code): decoupled weight decay, bias corrections
 * bc1 = 1 - beta1^t and bc2 = 1 - beta2^t computed once per call. */
#ifndef KVLAB_ADAMW_H
#define KVLAB_ADAMW_H

#include <math.h>

#ifdef __CUDACC__
#define KV_ADAMW_FN static inline __host__ __device__
#else
#define KV_ADAMW_FN static inline
#endif

KV_ADAMW_FN void adamw_value(float *param, float *m, float *v, float g, float lr, float beta1, float beta2, float eps,
                             float weight_decay, float bc1, float bc2) {
    float mi = beta1 * *m + (1.0f - beta1) * g;
    float vi = beta2 * *v + (1.0f - beta2) * g * g;
    *m = mi;
    *v = vi;
    float mhat = mi / bc1, vhat = vi / bc2;
    *param -= lr * (mhat / (sqrtf(vhat) + eps) + weight_decay * *param);
}

#endif
