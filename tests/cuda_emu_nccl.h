/* NCCL on the CPU for the emulated CUDA backend (make CUDA_EMU=1 on a CUDA
 * configuration with MPI data parallel): as much of NCCL as
 * kernels/cuda/nccl.cu calls, carried by MPI between the job's processes,
 * each of which emulates a GPU of its own (tests/cuda_emu_runtime.h), so
 * that the NCCL transport's code runs in CI where no GPU is.
 *
 * What it models:
 * - a communicator is an MPI communicator of the ranks that joined with one
 *   id (ncclCommInitRank is collective over MPI_COMM_WORLD, as kvlab calls
 *   it: every process of the job joins one communicator);
 * - ncclAllReduce, ncclReduce and ncclBroadcast of float32 or float64 sums,
 *   in place or not, on device memory only: a buffer that is not (wholly)
 *   inside one cudaMalloc allocation is refused with ncclInvalidArgument, as
 *   a host pointer would fail on a GPU;
 * - a group (ncclGroupStart ... ncclGroupEnd) runs as one unit at its end;
 * - when the collectives run: at once (the default), or, with
 *   KVLAB_CUDA_EMU_NCCL=late in the environment, as late as the stream's
 *   order allows (emu::stream_defer): when the stream is next used,
 *   synchronised or queried, or another stream waits for an event recorded
 *   after it. A GPU may run a collective anywhere between those two points,
 *   concurrently with the other stream's work, so code that reads a buffer
 *   a collective writes, or writes one it reads, without waiting for it,
 *   reads or sends a different value in one of the two orders; the tests run
 *   both. The host's blocking MPI calls run the deferred collectives first
 *   (cuda_emu_nccl.cpp defines them over MPI's profiling interface), as a GPU
 *   runs its queue while its host waits in MPI: otherwise a host waiting in
 *   MPI for a peer that waits on its GPU for this host's deferred collective
 *   would wait for good, where GPUs would not.
 *
 * What it cannot show: NCCL's speed, its own summation order (MPI's is
 * another; sums agree to rounding), network failures inside a collective
 * (MPI's are fatal to the job), and whether real GPUs keep a collective on
 * one stream from overlapping one on another (kernels/cuda/nccl.cu orders
 * them itself). The GPU tests (-k cuda-nccl) remain the judge. */
#ifndef KVLAB_CUDA_EMU_NCCL_H
#define KVLAB_CUDA_EMU_NCCL_H

#include <cstddef>

#include "cuda_emu_runtime.h"

#define NCCL_UNIQUE_ID_BYTES 128
typedef struct {
    char internal[NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;
typedef struct ncclComm *ncclComm_t;
typedef enum {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
    ncclInProgress = 7
} ncclResult_t;
typedef enum { ncclFloat32 = 7, ncclFloat = 7, ncclFloat64 = 8, ncclDouble = 8 } ncclDataType_t;
typedef enum { ncclSum = 0 } ncclRedOp_t;

const char *ncclGetErrorString(ncclResult_t result);
const char *ncclGetLastError(ncclComm_t comm);
ncclResult_t ncclGetUniqueId(ncclUniqueId *id);
ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank);
ncclResult_t ncclCommDestroy(ncclComm_t comm);
ncclResult_t ncclCommAbort(ncclComm_t comm);
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *async_error);
ncclResult_t ncclGroupStart(void);
ncclResult_t ncclGroupEnd(void);
ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t type, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t type, ncclRedOp_t op,
                        int root, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t type, int root,
                           ncclComm_t comm, cudaStream_t stream);

#endif
