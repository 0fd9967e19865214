/* Counter-based random bits for dropout: the decision for element i is a
 * pure function of (seed, i), so the backward pass recomputes the forward
 * mask without storing it and no result depends on thread scheduling. */
#ifndef KVLAB_HASH_H
#define KVLAB_HASH_H

#include <stddef.h>
#include <stdint.h>

/* The same functions in host and CUDA device code (kernels/cuda/): masks agree on every target. */
#ifdef __CUDACC__
#define KV_HASH_FN static inline __host__ __device__
#else
#define KV_HASH_FN static inline
#endif

KV_HASH_FN uint32_t mix32(uint32_t x) { /* murmur3 finaliser */
    x ^= x >> 16;
    x *= 0x85ebca6bu;
    x ^= x >> 13;
    x *= 0xc2b2ae35u;
    x ^= x >> 16;
    return x;
}

KV_HASH_FN uint64_t mix64(uint64_t x) { /* splitmix64 finaliser */
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

/* Keep element i with probability 1 - threshold / 2^24. */
KV_HASH_FN int dropout_keep(uint64_t seed, size_t i, uint32_t threshold) {
    uint32_t h = mix32((uint32_t)i ^ (uint32_t)seed) ^ (uint32_t)(seed >> 32);
    h = mix32(h + (uint32_t)((uint64_t)i >> 32));
    return (h >> 8) >= threshold;
}

#endif
