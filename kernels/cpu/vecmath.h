/* Vectorisable float math for the CPU kernels.
 *
 * glibc's expf/tanhf are scalar calls, which would dominate softmax and GELU
 * (tens of millions per training step). These versions are plain C that gcc
 * turns into AVX2/AVX-512 code inside `#pragma omp simd` loops; accuracy is
 * within 2 ulp of expf over the range used (checked in tests/test_kernels.c). */
#ifndef KVLAB_VECMATH_H
#define KVLAB_VECMATH_H

#include <stdint.h>
#include <string.h>

/* exp(x) by range reduction x = n ln2 + r, |r| <= ln2/2, and a degree-6
 * polynomial for e^r (Cephes expf coefficients). Inputs below -87.3 give 0
 * (e.g. masked scores, -inf), inputs above 88 are clamped to 88, NaN stays
 * NaN. Written with selects only, so it vectorises and never converts a NaN
 * or an out-of-range float to int (undefined behaviour). */
static inline float vexpf(float x) {
    const float hi = 88.0f, lo = -87.3f;
    float xc = x > hi ? hi : (x >= lo ? x : lo); /* NaN -> lo */
    /* round(x / ln2) with the 1.5*2^23 trick: exact for |n| < 2^22, no libm call */
    float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float r2 = r * r;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r2 + r + 1.0f;
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23; /* 2^n, n in [-126, 127] */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    float y = x >= lo ? p * scale : 0.0f;
    return x == x ? y : x;
}

/* tanh(x) = 1 - 2 / (exp(2x) + 1); absolute error ~1e-7, which is what GELU
 * needs (it uses 1 + tanh). */
static inline float vtanhf(float x) {
    float xc = x > 9.0f ? 9.0f : (x < -9.0f ? -9.0f : x);
    return 1.0f - 2.0f / (vexpf(2.0f * xc) + 1.0f);
}

#endif
