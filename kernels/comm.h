/* Collectives on device memory between the processes of a data-parallel
 * job, one GPU each: NCCL, the device half of the Distributed menu on the
 * CUDA target (CONFIG_DIST_NCCL, kernels/cuda/nccl.cu). The job itself (its
 * launch, its ranks, the host collectives) is MPI's: train/dist_mpi.c calls
 * these, and they know nothing of MPI. Bootstrap: rank 0 makes an id, the
 * caller sends it to every rank, and every rank joins with it.
 *
 * Buffers are float buffers of dev_alloc. Every collective is queued on the
 * backend's stream, in order with the kernels around it (no host wait), and
 * must be called by every rank in the same order with the same sizes. An
 * error stops this process with one line naming the call, NCCL's message and
 * a hint; the launcher then stops the job. Only the trainer's transport uses
 * this header; model code never does. */
#ifndef KVLAB_COMM_H
#define KVLAB_COMM_H

#include <stddef.h>

/* NCCL's unique id, as bytes the caller can send (NCCL_UNIQUE_ID_BYTES). */
#define DEV_COMM_ID_BYTES 128

/* This process's GPU: the configured GPU index (CUDA_DEVICE) plus local_rank, this process's rank among the
 * local_size ranks of its machine, so that every rank of a machine drives its own GPU. Call before the
 * backend's first use; stops with a hint when the machine has fewer GPUs than that. */
void dev_comm_select_gpu(int local_rank, int local_size);
/* Rank 0: a new id for the job (ncclGetUniqueId). */
void dev_comm_make_id(unsigned char id[DEV_COMM_ID_BYTES]);
/* Every rank: joins the job's communicator (ncclCommInitRank) as rank of size. */
void dev_comm_join(const unsigned char id[DEV_COMM_ID_BYTES], int rank, int size);
/* Waits for the queued collectives and leaves the communicator (the end of a run). */
void dev_comm_leave(void);
/* "NCCL 2.28.3" (the library the process runs with). */
const char *dev_comm_version(void);

/* buf (n floats) = its sum over the ranks, on every rank */
void dev_comm_allreduce(float *buf, size_t n);
/* The slices of a buffer: rank r owns cnt[r] floats at lo[r] (a partition in rank order). Reduce-scatter:
 * the sum over the ranks of this rank's slice, written in place; the rest of buf is left as it was. */
void dev_comm_reduce_scatter(float *buf, const size_t *lo, const size_t *cnt);
/* All-gather: every rank's slice from that rank to all, in place. */
void dev_comm_allgather(float *buf, const size_t *lo, const size_t *cnt);
/* rank 0's n floats to every rank */
void dev_comm_bcast(float *buf, size_t n);

#endif
