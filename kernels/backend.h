/* For backends only (kernels/cpu/, kernels/cuda/): the argument checks and
 * the dropout bookkeeping every backend shares, so that each fact lives once
 * and the backends stop on bad input with the same messages. Model code uses
 * kernels.h and attention.h, never this header. */
#ifndef KVLAB_BACKEND_H
#define KVLAB_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "attention.h"

/* Dropout with probability p keeps element i when the hash of (seed, i) is at or above this threshold
 * (hash.h); stops with a message naming op unless 0 <= p < 1. */
uint32_t dropout_threshold(float p, const char *op);
/* The global index of element 0 of an n-value buffer of this process's batch rows (dropout_batch_rows). */
size_t dropout_batch_offset(size_t n, const char *op);

/* Attention: shapes and dropout of a call. */
void attn_check_args(const char *op, int B, int Tq, int Tk, int H, int hd, float dropout);
/* The K/V head count G of a self-attention call (kv_heads 0 = H), checked against H and the variant. */
int attn_check_kv_heads(const char *op, int H, int kv_heads);
/* An AttnPos against the call and the build (+Pos weights, RoPE table, relative bias); returns its scheme. */
int attn_check_pos(const char *op, const AttnPos *pos, int H, int hd, int T);

#endif
