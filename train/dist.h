/* The transport of data-parallel training: the processes (ranks) of a job
 * and the collectives the trainer needs (Kconfig "Distributed",
 * docs/distributed.md). train/trainer.c builds data parallelism on top of
 * it (batch shards, the global loss, the gradient sum, ZeRO-1, rank 0 as
 * the only writer); a family only calls dist_init and the helpers of
 * trainer.h, plus dist_sum for its evaluation counts.
 *
 * Implementations, one per build (kbuild style, train/Makefile):
 *   CONFIG_DIST_NONE  the inline single-process stubs below (nothing linked)
 *   CONFIG_DIST_MPI   train/dist_mpi.c: OpenMPI for the launch and the host
 *                     collectives; the device ones staged through host
 *                     memory on the CPU target, and on the CUDA target
 *                     (CONFIG_DIST_NCCL) NCCL on the GPU buffers
 *                     (kernels/comm.h), bootstrapped over MPI
 *
 * Two kinds of collectives:
 *  - host: small arrays of doubles or bytes in host memory (losses, counts,
 *    stop requests, progress), always from every rank in the same order;
 *  - device: float buffers from dev_alloc (gradients, parameters, AdamW
 *    moments). The MPI transport stages them through host memory with
 *    dev_download / dev_upload (so the device-memory guard holds); a GPU
 *    transport hands the device pointers to NCCL.
 * Every collective must be called by every rank with the same sizes. A
 * failure of the transport, or a rank that dies, ends the whole job
 * (the launcher kills the rest); nothing here returns an error. */
#ifndef KVLAB_DIST_H
#define KVLAB_DIST_H

#include <stddef.h>
#include <stdint.h>
#include <unistd.h>

#include "common.h"

_Static_assert(IS_ENABLED(CONFIG_DIST_NONE) + IS_ENABLED(CONFIG_DIST_MPI) == 1,
               "data parallelism is a Kconfig choice (Distributed)");

/* A contiguous range [lo, lo + n) of a buffer or of a batch's rows. */
typedef struct {
    size_t lo, n;
} DistRange;

/* Rank r's part of n items split as evenly as possible over size ranks, in rank order (the first n % size
 * ranks get one more). The same split everywhere: batch rows, ZeRO-1 slices, evaluation work. */
static inline DistRange dist_split(size_t n, int r, int size) {
    size_t q = n / (size_t)size, rem = n % (size_t)size, ur = (size_t)r;
    return (DistRange){ur * q + (ur < rem ? ur : rem), q + (ur < rem ? 1 : 0)};
}

#if IS_ENABLED(CONFIG_DIST_MPI)

/* The size of the buckets the gradient sum is cut into (train/grad_sync.h); 0: one sum after the backward pass */
#define DIST_BUCKET_BYTES ((size_t)CONFIG_DIST_BUCKET_KIB * 1024)

/* Joins the job (MPI_Init) when the process was started by mpirun or srun, and sets this process's label on
 * fatal errors ("rank 1 of 2 on node7"). Ranks other than 0 send their stdout to /dev/null: only rank 0
 * reports. Started alone, the program is a job of one. Call once, before anything else of the training. */
void dist_init(void);
/* Leaves the job (MPI_Finalize); the normal end of a training run. */
void dist_finalize(void);
int dist_rank(void);
int dist_size(void);
/* Ranks on this machine (to share its cores). */
int dist_local_size(void);
/* This machine's name, as the launcher reports it. */
const char *dist_host(void);
/* "mpi", "mpi + nccl" (the CUDA target) or "none". */
const char *dist_transport(void);
/* Ends every rank of the job at once with exit status `status` (a fatal error on one rank). */
void dist_abort(int status) KV_NORETURN;

/* host collectives: in place, every rank gets the result */
void dist_sum(double *v, int n);
void dist_max(double *v, int n);
/* rank 0's bytes to every rank */
void dist_bcast(void *buf, size_t bytes);

/* device collectives on float buffers of dev_alloc */
/* buf (n floats) = its sum over the ranks, on every rank */
void dist_allreduce_dev(float *buf, size_t n);
/* The sum over the ranks of buf (n floats) for this rank's slice dist_split(n, rank, size) only, written to
 * buf + slice.lo; the rest of buf is left as it was (the first half of an all-reduce). */
void dist_reduce_scatter_dev(float *buf, size_t n);
/* Every rank's slice dist_split(n, r, size) of buf, from that rank to all (the second half). */
void dist_allgather_dev(float *buf, size_t n);
/* rank 0's n floats to every rank */
void dist_bcast_dev(float *buf, size_t n);
/* v (n doubles of device memory, dev_alloc) = its sum over the ranks, on every rank: device-made statistics summed
 * without a host wait on NCCL (ZeRO-1's squared gradient norm); the MPI transport stages them through the host */
void dist_sum_dev(double *v, int n);
/* The overlapped gradient sum (train/grad_sync.h): dist_sum_start_dev queues the sum over the ranks of the part
 * buf[lo, lo + n) of a buffer of total floats and returns without waiting for it; dist_sum_wait_dev completes
 * every queued one. With scatter, only this rank's slice dist_split(total, rank, size) of the part gets the sum
 * (a reduce-scatter in parts, ZeRO-1) and the rest of it is left as it was; without, the whole part (an
 * all-reduce in parts). Between the start and the wait the part must not be written (the CPU target copies it
 * at the start; NCCL reads it on a stream of its own, after the kernels queued before the start). Every rank
 * queues the same parts in the same order. */
void dist_sum_start_dev(float *buf, size_t total, size_t lo, size_t n, int scatter);
void dist_sum_wait_dev(void);
/* Every rank's slice (dist_split(n, r, size).n floats at slice, device memory) into host_full (n floats) on
 * rank 0; host_full may be NULL elsewhere. */
void dist_gather_dev(float *host_full, const float *slice, size_t n);
/* The reverse: rank 0's host_full (n floats) split into every rank's slice (device memory). */
void dist_scatter_dev(float *slice, const float *host_full, size_t n);

#else /* CONFIG_DIST_NONE: a job of one process; nothing is linked */

#define DIST_BUCKET_BYTES ((size_t)0)

static inline void dist_init(void) {}
static inline void dist_finalize(void) {}
static inline int dist_rank(void) { return 0; }
static inline int dist_size(void) { return 1; }
static inline int dist_local_size(void) { return 1; }
const char *dist_host(void); /* train/dist_none.c: gethostname */
static inline const char *dist_transport(void) { return "none"; }
static inline KV_NORETURN void dist_abort(int status) { _exit(status); }
static inline void dist_sum(double *v, int n) { (void)v, (void)n; }
static inline void dist_max(double *v, int n) { (void)v, (void)n; }
static inline void dist_bcast(void *buf, size_t bytes) { (void)buf, (void)bytes; }
static inline void dist_allreduce_dev(float *buf, size_t n) { (void)buf, (void)n; }
static inline void dist_reduce_scatter_dev(float *buf, size_t n) { (void)buf, (void)n; }
static inline void dist_allgather_dev(float *buf, size_t n) { (void)buf, (void)n; }
static inline void dist_bcast_dev(float *buf, size_t n) { (void)buf, (void)n; }
static inline void dist_sum_dev(double *v, int n) { (void)v, (void)n; }
static inline void dist_sum_start_dev(float *buf, size_t total, size_t lo, size_t n, int scatter) {
    (void)buf, (void)total, (void)lo, (void)n, (void)scatter;
}
static inline void dist_sum_wait_dev(void) {}
void dist_gather_dev(float *host_full, const float *slice, size_t n);  /* a download */
void dist_scatter_dev(float *slice, const float *host_full, size_t n); /* an upload */

#endif

/* Threads for this rank's backend: the configured number, or with 0 (one per core) OMP_NUM_THREADS when the
 * launcher set it, else this machine's cores shared equally by its ranks. A job of one: `configured` as it is. */
int dist_threads(int configured);

#endif
