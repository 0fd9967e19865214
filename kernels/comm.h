/* Collectives on device memory between the processes of a data-parallel
 * job, one GPU each: NCCL, the device half of the Distributed menu on the
 * CUDA target (CONFIG_DIST_NCCL, kernels/cuda/nccl.cu). The job itself (its
 * launch, its ranks, the host collectives) is MPI's: train/dist_mpi.c calls
 * these, and they know nothing of MPI. Bootstrap: rank 0 makes an id, the
 * caller sends it to every rank, and every rank joins with it.
 *
 * Buffers are float buffers of dev_alloc (doubles for dev_comm_sum_doubles). Every collective is queued on the
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

/* This process's GPU, from local_rank, its rank among the local_size ranks of its machine: GPU CUDA_DEVICE +
 * local_rank when the process sees that many GPUs; GPU 0 when it sees exactly one (a launcher that gives each
 * rank a GPU of its own: Slurm's --gpus-per-task=1, CUDA_VISIBLE_DEVICES per rank); otherwise it stops with a
 * hint. Call before the backend's first use (it stops if the backend already runs). Two ranks that end up on
 * one GPU are found by comparing dev_comm_gpu_uuid over the machine's ranks. */
void dev_comm_select_gpu(int local_rank, int local_size);
#define DEV_COMM_UUID_BYTES 16
/* The chosen GPU's UUID (the same bytes in every process that drives that GPU). */
void dev_comm_gpu_uuid(unsigned char uuid[DEV_COMM_UUID_BYTES]);
/* Rank 0: a new id for the job (ncclGetUniqueId). */
void dev_comm_make_id(unsigned char id[DEV_COMM_ID_BYTES]);
/* Every rank: joins the job's communicator (ncclCommInitRank) as rank of size. */
void dev_comm_join(const unsigned char id[DEV_COMM_ID_BYTES], int rank, int size);
/* Waits for the queued collectives and leaves the communicator (the end of a run). While it is up, every host
 * wait of the backend also asks NCCL for an asynchronous error (a collective that failed without ending, a
 * peer's network gone): it aborts the communicator and stops the process, which stops the job. */
void dev_comm_leave(void);

/* buf (n floats) = its sum over the ranks, on every rank */
void dev_comm_allreduce(float *buf, size_t n);
/* The slices of a buffer: rank r owns cnt[r] floats at lo[r] (a partition in rank order). Reduce-scatter:
 * the sum over the ranks of this rank's slice, written in place; the rest of buf is left as it was. */
void dev_comm_reduce_scatter(float *buf, const size_t *lo, const size_t *cnt);
/* All-gather: every rank's slice from that rank to all, in place. */
void dev_comm_allgather(float *buf, const size_t *lo, const size_t *cnt);
/* rank 0's n floats to every rank */
void dev_comm_bcast(float *buf, size_t n);
/* v (n doubles of dev_alloc) = its sum over the ranks, on every rank (statistics made on the device) */
void dev_comm_sum_doubles(double *v, size_t n);

/* The overlapped forms (the gradient sum in parts during the backward pass): queued on a second stream of
 * their own, after everything queued on the backend's stream so far, so the caller's kernels go on while NCCL
 * sums; dev_comm_async_wait makes the backend's stream wait for all of them (queued, no host wait). Between
 * the two the caller must not write the parts. */
void dev_comm_allreduce_async(float *buf, size_t n);
void dev_comm_reduce_scatter_async(float *buf, const size_t *lo, const size_t *cnt);
void dev_comm_async_wait(void);

#endif
