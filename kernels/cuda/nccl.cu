/* Device collectives over NCCL (kernels/comm.h): the gradient sum of
 * data-parallel training on the CUDA target, and ZeRO-1's reduce-scatter and
 * all-gather, on the device buffers themselves, queued on the backend's
 * stream. The communicator is made once per process from an id that the
 * caller (train/dist_mpi.c) sends over MPI.
 *
 * ZeRO-1's slices are those of dist_split: as even as possible, so not equal
 * when the buffer's length is not a multiple of the ranks, while
 * ncclReduceScatter and ncclAllGather want equal parts. Both are therefore
 * one group of per-rank calls, each rank the root of its own slice: a
 * reduce (to its owner) or a broadcast (from its owner) per slice; NCCL runs
 * a group as one launch. */
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <nccl.h>

#include "cuda.cuh"

extern "C" {
#include "comm.h"
}

static_assert(DEV_COMM_ID_BYTES == NCCL_UNIQUE_ID_BYTES, "kernels/comm.h: DEV_COMM_ID_BYTES is NCCL's id size");

/* "error: NCCL: <call> failed: <NCCL's message> [file:line] (hint: ...)" */
#define NCCL_CHECK(call)                                                                                    \
    do {                                                                                                    \
        ncclResult_t r_ = (call);                                                                           \
        if (r_ != ncclSuccess) nccl_fail(__FILE__, __LINE__, #call, r_);                                  \
    } while (0)

static ncclComm_t g_comm;
static int g_size; /* the ranks of the communicator */
/* the overlapped collectives' stream, and the events that order it against the backend's stream */
static cudaStream_t g_side;
static cudaEvent_t g_to_side, g_from_side;
static int g_side_busy; /* collectives queued on g_side since the last dev_comm_async_wait */

[[noreturn]] static void nccl_fail(const char *file, int line, const char *call, ncclResult_t r) {
    const char *last = g_comm ? ncclGetLastError(g_comm) : ncclGetLastError(NULL);
    fatal_at(file, line, "NCCL: %s failed: %s%s%s (hint: NCCL_DEBUG=WARN in the environment says more; every "
             "rank needs a GPU of its own, and the machines of a job must reach each other over the network "
             "NCCL picks, NCCL_SOCKET_IFNAME names it)", call, ncclGetErrorString(r), last && *last ? ": " : "",
             last ? last : "");
}

void dev_comm_select_gpu(int local_rank, int local_size) {
    if (local_rank < 0 || local_rank >= local_size)
        FATAL("dev_comm_select_gpu: local rank %d of %d", local_rank, local_size);
    if (cuda_started())
        FATAL("dev_comm_select_gpu: the CUDA backend already runs on GPU %d (hint: dist_init comes before "
              "anything else of the training)", kv_device);
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) return; /* cuda_ready says why */
    if (local_size == 1 || CONFIG_CUDA_DEVICE + local_size <= n)
        kv_device = CONFIG_CUDA_DEVICE + local_rank;
    else if (n == 1)
        kv_device = 0; /* the one GPU this process sees: its own, or shared, which dist_init's check names */
    else
        FATAL("rank %d of the %d on this machine would drive GPU %d (GPU index %d + its rank), this process sees "
              "%d GPUs (hint: NCCL needs one GPU per rank: at most %d ranks per machine from GPU index %d, "
              "Processes per machine in make menuconfig, Distributed; or give each rank one GPU of its own with "
              "CUDA_VISIBLE_DEVICES)", local_rank, local_size, CONFIG_CUDA_DEVICE + local_rank,
              CONFIG_CUDA_DEVICE, n, n - CONFIG_CUDA_DEVICE > 0 ? n - CONFIG_CUDA_DEVICE : 0, CONFIG_CUDA_DEVICE);
}

void dev_comm_gpu_uuid(unsigned char uuid[DEV_COMM_UUID_BYTES]) {
    cuda_ready();
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, kv_device));
    static_assert(sizeof prop.uuid.bytes == DEV_COMM_UUID_BYTES, "a CUDA UUID is 16 bytes");
    memcpy(uuid, prop.uuid.bytes, DEV_COMM_UUID_BYTES);
}

/* kv_sync_check while the communicator is up: a collective that failed without ending stops the process. */
static void check_async(void) {
    ncclResult_t st = ncclSuccess;
    NCCL_CHECK(ncclCommGetAsyncError(g_comm, &st));
    if (st == ncclSuccess || st == ncclInProgress) return;
    const char *last = ncclGetLastError(g_comm);
    kv_sync_check = NULL;
    kv_side_join = NULL;
    ncclCommAbort(g_comm); /* frees the GPU work that waits for the failed peer */
    g_comm = NULL;
    FATAL("NCCL: a collective failed while the GPU waited for it: %s%s%s (hint: another rank or its network "
          "failed; NCCL_DEBUG=WARN in the environment says more; the next make resumes the step from its last "
          "checkpoint)",
          ncclGetErrorString(st), last && *last ? ": " : "", last ? last : "");
}

void dev_comm_make_id(unsigned char id[DEV_COMM_ID_BYTES]) {
    ncclUniqueId u;
    NCCL_CHECK(ncclGetUniqueId(&u));
    memcpy(id, u.internal, DEV_COMM_ID_BYTES);
}

void dev_comm_join(const unsigned char id[DEV_COMM_ID_BYTES], int rank, int size) {
    if (g_comm) FATAL("dev_comm_join: this process already joined a communicator");
    if (size < 1 || rank < 0 || rank >= size) FATAL("dev_comm_join: rank %d of %d", rank, size);
    cuda_ready(); /* the GPU (kv_device) and the stream */
    ncclUniqueId u;
    memcpy(u.internal, id, DEV_COMM_ID_BYTES);
    NCCL_CHECK(ncclCommInitRank(&g_comm, size, u, rank));
    g_size = size;
    CUDA_CHECK(cudaStreamCreateWithFlags(&g_side, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&g_to_side, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&g_from_side, cudaEventDisableTiming));
    kv_sync_check = check_async;
    kv_side_join = dev_comm_async_wait;
}

void dev_comm_leave(void) {
    if (!g_comm) return;
    dev_comm_async_wait();
    cuda_sync();
    kv_sync_check = NULL;
    kv_side_join = NULL;
    NCCL_CHECK(ncclCommDestroy(g_comm));
    g_comm = NULL;
    CUDA_CHECK(cudaEventDestroy(g_to_side));
    CUDA_CHECK(cudaEventDestroy(g_from_side));
    CUDA_CHECK(cudaStreamDestroy(g_side));
}

/* A collective on the backend's stream waits for the side stream's first (dev_comm_async_wait): two collectives
 * of one communicator never run at once on two streams, which NCCL does not promise to progress. */
static void need_comm(const char *op) {
    if (!g_comm) FATAL("%s: no NCCL communicator (hint: dist_init joins one before training)", op);
    dev_comm_async_wait();
}

void dev_comm_allreduce(float *buf, size_t n) {
    need_comm("dev_comm_allreduce");
    cuda_float_written(buf, n * sizeof(float));
    if (n) NCCL_CHECK(ncclAllReduce(buf, buf, n, ncclFloat, ncclSum, g_comm, kv_stream));
}

void dev_comm_reduce_scatter(float *buf, const size_t *lo, const size_t *cnt) {
    need_comm("dev_comm_reduce_scatter");
    for (int r = 0; r < g_size; r++) cuda_float_written(buf + lo[r], cnt[r] * sizeof(float));
    NCCL_CHECK(ncclGroupStart());
    for (int r = 0; r < g_size; r++)
        if (cnt[r]) NCCL_CHECK(ncclReduce(buf + lo[r], buf + lo[r], cnt[r], ncclFloat, ncclSum, r, g_comm, kv_stream));
    NCCL_CHECK(ncclGroupEnd());
}

void dev_comm_allgather(float *buf, const size_t *lo, const size_t *cnt) {
    need_comm("dev_comm_allgather");
    for (int r = 0; r < g_size; r++) cuda_float_written(buf + lo[r], cnt[r] * sizeof(float));
    NCCL_CHECK(ncclGroupStart());
    for (int r = 0; r < g_size; r++)
        if (cnt[r]) NCCL_CHECK(ncclBroadcast(buf + lo[r], buf + lo[r], cnt[r], ncclFloat, r, g_comm, kv_stream));
    NCCL_CHECK(ncclGroupEnd());
}

void dev_comm_bcast(float *buf, size_t n) {
    need_comm("dev_comm_bcast");
    cuda_float_written(buf, n * sizeof(float));
    if (n) NCCL_CHECK(ncclBroadcast(buf, buf, n, ncclFloat, 0, g_comm, kv_stream));
}

void dev_comm_sum_doubles(double *v, size_t n) {
    need_comm("dev_comm_sum_doubles");
    if (n) NCCL_CHECK(ncclAllReduce(v, v, n, ncclDouble, ncclSum, g_comm, kv_stream));
}

/* the side stream waits for everything queued on the backend's stream so far */
static void side_after_main(void) {
    CUDA_CHECK(cudaEventRecord(g_to_side, kv_stream));
    CUDA_CHECK(cudaStreamWaitEvent(g_side, g_to_side, 0));
    g_side_busy = 1;
}

static void need_side(const char *op) {
    if (!g_comm) FATAL("%s: no NCCL communicator (hint: dist_init joins one before training)", op);
}

void dev_comm_allreduce_async(float *buf, size_t n) {
    need_side("dev_comm_allreduce_async");
    if (!n) return;
    cuda_float_written(buf, n * sizeof(float));
    side_after_main();
    NCCL_CHECK(ncclAllReduce(buf, buf, n, ncclFloat, ncclSum, g_comm, g_side));
}

void dev_comm_reduce_scatter_async(float *buf, const size_t *lo, const size_t *cnt) {
    need_side("dev_comm_reduce_scatter_async");
    for (int r = 0; r < g_size; r++) cuda_float_written(buf + lo[r], cnt[r] * sizeof(float));
    side_after_main();
    NCCL_CHECK(ncclGroupStart());
    for (int r = 0; r < g_size; r++)
        if (cnt[r]) NCCL_CHECK(ncclReduce(buf + lo[r], buf + lo[r], cnt[r], ncclFloat, ncclSum, r, g_comm, g_side));
    NCCL_CHECK(ncclGroupEnd());
}

void dev_comm_async_wait(void) {
    if (!g_comm || !g_side_busy) return;
    CUDA_CHECK(cudaEventRecord(g_from_side, g_side));
    CUDA_CHECK(cudaStreamWaitEvent(kv_stream, g_from_side, 0));
    g_side_busy = 0;
}
