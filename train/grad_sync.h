/* The gradient sum of data-parallel training, in buckets overlapped with
 * the backward pass (Kconfig "Distributed", DIST_BUCKET_KIB;
 * docs/distributed.md). Without buckets the whole gradient buffer is summed
 * once, after the last backward pass of an optimizer step. With them the
 * buffer is cut, from its top down at tensor boundaries, into buckets of at
 * least the configured size; the backward pass says which gradients are
 * final (params_grads_final_from, after each block) and every bucket above
 * that mark starts its sum at once (dist_sum_start_dev: MPI's non-blocking
 * collectives on the CPU target, NCCL on a stream of its own on GPUs), so
 * the sums of the upper blocks run while the lower ones are differentiated.
 * grad_sync_finish starts whatever is left and waits for all of them.
 *
 * Every rank cuts the same buckets (the same table) and starts them in the
 * same order, top down, whatever its backward pass did: a rank without
 * counted rows, which skips its backward pass, starts them all in
 * grad_sync_finish. With ZeRO-1 (scatter) each bucket is reduce-scattered:
 * a rank receives the sum of its slice's part of the bucket. The same values
 * are summed over the same ranks, so results equal the single sum's up to
 * rounding: bit for bit with 2 ranks; with more, MPI and NCCL may order a
 * value's additions differently for a bucket than for the whole buffer. */
#ifndef KVLAB_GRAD_SYNC_H
#define KVLAB_GRAD_SYNC_H

#include <stddef.h>

#include "params.h"

typedef struct {
    Params *w;
    int scatter;  /* ZeRO-1: each rank gets the sum of its slice dist_split(total, rank, size) only */
    int nb;       /* buckets; 0: one sum of the whole buffer in grad_sync_finish */
    size_t *lo;   /* bucket k is [lo[k], k ? lo[k - 1] : total), k = 0 at the top of the buffer */
    int next;     /* buckets started in this optimizer step */
    int early;    /* of them, started during the backward pass */
    int early_last; /* `early` of the last finished step (the metrics' grad_buckets_overlapped) */
} GradSync;

/* The buckets of w's table for bucket_bytes (0: none, one sum). */
void grad_sync_init(GradSync *g, Params *w, size_t bucket_bytes, int scatter);
void grad_sync_free(GradSync *g);
/* Before the last backward pass of an optimizer step (gradient accumulation: the earlier passes' gradients
 * are not final): from now on the pass's params_grads_final_from calls start buckets. */
void grad_sync_arm(GradSync *g);
/* After it: the buckets not yet started, then the wait for all; w->grads then holds the sum over the ranks
 * (scatter: in this rank's slice). Disarms. */
void grad_sync_finish(GradSync *g);

#endif
