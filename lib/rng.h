/* Seeded random numbers: splitmix64 for streams, Box-Muller for normals.
 * One 64-bit state per stream, so a stream's position is a single number
 * that checkpoints can store (training resumes exactly). */
#ifndef KVLAB_RNG_H
#define KVLAB_RNG_H

#include <math.h>
#include <stdint.h>

typedef struct {
    uint64_t state;
} Rng;

static inline Rng rng_seeded(uint64_t seed, uint64_t stream) {
    Rng r = {seed * 0x9e3779b97f4a7c15ull ^ (stream + 1) * 0xd1b54a32d192ed03ull};
    return r;
}

static inline uint64_t rng_u64(Rng *r) {
    uint64_t z = (r->state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* uniform in [0, 1) with 53 random bits */
static inline double rng_uniform(Rng *r) { return (double)(rng_u64(r) >> 11) * (1.0 / 9007199254740992.0); }

/* uniform integer in [0, n), n > 0 (rejection keeps it unbiased) */
static inline uint64_t rng_below(Rng *r, uint64_t n) {
    uint64_t limit = UINT64_MAX - UINT64_MAX % n;
    uint64_t x;
    do x = rng_u64(r);
    while (x >= limit);
    return x % n;
}

static inline double rng_normal(Rng *r) {
    double u1 = rng_uniform(r), u2 = rng_uniform(r);
    if (u1 < 1e-300) u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

#endif
