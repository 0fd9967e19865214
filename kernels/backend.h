/* For backends only (kernels/cpu/, kernels/cuda/): the dropout bookkeeping
 * every backend shares, so that each fact lives once. (The attention checks
 * they share are in attention.h: this header stays free of the attention
 * configuration, so the non-attention ops do not recompile when it changes.)
 * Model code uses kernels.h and attention.h, never this header. */
#ifndef KVLAB_BACKEND_H
#define KVLAB_BACKEND_H

#include <stddef.h>
#include <stdint.h>

/* Dropout with probability p keeps element i when the hash of (seed, i) is at or above this threshold
 * (hash.h); stops with a message naming op unless 0 <= p < 1. */
uint32_t dropout_threshold(float p, const char *op);
/* The global index of element 0 of an n-value buffer of this process's batch rows (dropout_batch_rows). */
size_t dropout_batch_offset(size_t n, const char *op);

#endif
