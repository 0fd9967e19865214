/* NCCL over MPI for the emulated CUDA backend (what it models and checks:
 * tests/cuda_emu_nccl.h). */
#include "cuda_emu_nccl.h"

/* the C API only: OpenMPI and MPICH otherwise add their C++ bindings, which do not build warning-free */
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#include <unistd.h>

#include <climits>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

struct ncclComm {
    MPI_Comm mpi;
    int rank, size;
    bool aborted;
};

namespace {

char g_last_error[512];

ncclResult_t refuse(ncclResult_t r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
ncclResult_t refuse(ncclResult_t r, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_last_error, sizeof g_last_error, fmt, ap);
    va_end(ap);
    return r;
}

/* KVLAB_CUDA_EMU_NCCL: unset, empty or "now" runs each collective when it is called, "late" defers it */
bool late(void) {
    static int mode = -1;
    if (mode < 0) {
        const char *e = getenv("KVLAB_CUDA_EMU_NCCL");
        if (!e || !*e || !strcmp(e, "now")) mode = 0;
        else if (!strcmp(e, "late")) mode = 1;
        else {
            fprintf(stderr, "cuda_emu: KVLAB_CUDA_EMU_NCCL=%s (hint: now, the default, or late)\n", e);
            exit(2);
        }
    }
    return mode == 1;
}

/* the open group: its collectives, and their stream (one per group, as kvlab queues them) */
int g_group_depth;
std::vector<std::function<void()>> g_group;
cudaStream_t g_group_stream;
bool g_group_has_stream;

/* the units of work submitted, and those of them that ran after device work queued later than they were */
long g_units, g_overtaken;

/* runs or defers one unit of work (a collective, or a group of them) on stream */
void submit(cudaStream_t stream, std::function<void()> fn) {
    g_units++;
    if (!late()) {
        fn();
        return;
    }
    uint64_t queued = emu::device_work();
    emu::stream_defer(stream, [fn = std::move(fn), queued] {
        if (emu::device_work() > queued) g_overtaken++;
        fn();
    });
}

ncclResult_t enqueue(cudaStream_t stream, std::function<void()> fn) {
    if (g_group_depth == 0) {
        submit(stream, std::move(fn));
        return ncclSuccess;
    }
    if (g_group_has_stream && g_group_stream != stream)
        return refuse(ncclInvalidUsage, "the emulated NCCL runs a group on one stream");
    g_group_stream = stream, g_group_has_stream = true;
    g_group.push_back(std::move(fn));
    return ncclSuccess;
}

ncclResult_t check(ncclComm_t comm, ncclDataType_t type, size_t count, int root, const char *call) {
    if (!comm) return refuse(ncclInvalidArgument, "%s: comm is NULL", call);
    if (comm->aborted) return refuse(ncclInvalidUsage, "%s: the communicator was aborted", call);
    if (type != ncclFloat32 && type != ncclFloat64)
        return refuse(ncclInvalidArgument, "%s: the emulated NCCL sums float32 and float64 only (type %d)", call,
                      (int)type);
    if (count > (size_t)INT_MAX)
        return refuse(ncclInvalidArgument, "%s: %zu values, more than one MPI call carries here", call, count);
    if (root < 0 || root >= comm->size)
        return refuse(ncclInvalidArgument, "%s: root %d of %d ranks", call, root, comm->size);
    return ncclSuccess;
}

/* the bytes of one value, and its MPI type (a type check passed) */
size_t bytes_of(ncclDataType_t type) { return type == ncclFloat64 ? sizeof(double) : sizeof(float); }
MPI_Datatype mpi_of(ncclDataType_t type) { return type == ncclFloat64 ? MPI_DOUBLE : MPI_FLOAT; }

ncclResult_t on_device(const void *p, size_t count, ncclDataType_t type, const char *what, const char *call) {
    if (count && !emu::device_range(p, count * bytes_of(type)))
        return refuse(ncclInvalidArgument, "%s: %s %p (%zu values of %zu bytes) is not device memory", call, what, p,
                      count, bytes_of(type));
    return ncclSuccess;
}

void mpi_ok(int err, const char *call) {
    if (err == MPI_SUCCESS) return;
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    PMPI_Error_string(err, msg, &len);
    fprintf(stderr, "cuda_emu: NCCL over MPI: %s failed: %s\n", call, msg);
    exit(2);
}

} /* namespace */

const char *ncclGetErrorString(ncclResult_t result) {
    switch (result) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    }
    return "unknown result code";
}

const char *ncclGetLastError(ncclComm_t comm) {
    (void)comm;
    return g_last_error;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
    static unsigned made;
    memset(id, 0, sizeof *id);
    snprintf(id->internal, sizeof id->internal, "cuda_emu nccl id %d.%u", (int)getpid(), made++);
    return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank) {
    int up = 0;
    PMPI_Initialized(&up);
    if (!up) return refuse(ncclInvalidUsage, "ncclCommInitRank: the emulated NCCL needs MPI_Init first");
    if (nranks < 1 || rank < 0 || rank >= nranks)
        return refuse(ncclInvalidArgument, "ncclCommInitRank: rank %d of %d", rank, nranks);
    uint32_t color = 2166136261u; /* FNV-1a of the id: the processes that joined with it */
    for (int i = 0; i < NCCL_UNIQUE_ID_BYTES; i++) color = (color ^ (unsigned char)id.internal[i]) * 16777619u;
    ncclComm *c = new ncclComm{MPI_COMM_NULL, rank, nranks, false};
    mpi_ok(PMPI_Comm_split(MPI_COMM_WORLD, (int)(color & 0x7fffffff), rank, &c->mpi), "MPI_Comm_split");
    int size = 0, me = -1;
    PMPI_Comm_size(c->mpi, &size);
    PMPI_Comm_rank(c->mpi, &me);
    if (size != nranks || me != rank) {
        PMPI_Comm_free(&c->mpi);
        delete c;
        return refuse(ncclInvalidUsage, "ncclCommInitRank: %d processes joined as rank %d of %d, this one as %d",
                      size, me, nranks, rank);
    }
    *comm = c;
    return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    if (!comm) return refuse(ncclInvalidArgument, "ncclCommDestroy: comm is NULL");
    cudaDeviceSynchronize(); /* its deferred collectives end first */
    PMPI_Comm_free(&comm->mpi);
    delete comm;
    return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
    if (!comm) return ncclSuccess;
    comm->aborted = true; /* its deferred collectives do nothing; the communicator is left to the job's end */
    return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *async_error) {
    if (!comm) return refuse(ncclInvalidArgument, "ncclCommGetAsyncError: comm is NULL");
    *async_error = ncclSuccess; /* a failed MPI collective ends the job instead */
    return ncclSuccess;
}

ncclResult_t ncclGroupStart(void) {
    g_group_depth++;
    return ncclSuccess;
}

ncclResult_t ncclGroupEnd(void) {
    if (g_group_depth == 0) return refuse(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
    if (--g_group_depth > 0) return ncclSuccess;
    if (!g_group.empty()) {
        auto group = std::move(g_group);
        submit(g_group_stream, [group] {
            for (const auto &fn : group) fn();
        });
    }
    g_group.clear();
    g_group_has_stream = false;
    return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t type, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream) {
    ncclResult_t r = check(comm, type, count, 0, "ncclAllReduce");
    if (r == ncclSuccess && op != ncclSum) r = refuse(ncclInvalidArgument, "ncclAllReduce: sums only");
    if (r == ncclSuccess) r = on_device(sendbuff, count, type, "sendbuff", "ncclAllReduce");
    if (r == ncclSuccess) r = on_device(recvbuff, count, type, "recvbuff", "ncclAllReduce");
    if (r != ncclSuccess) return r;
    return enqueue(stream, [=] {
        if (comm->aborted || !count) return;
        mpi_ok(PMPI_Allreduce(sendbuff == recvbuff ? MPI_IN_PLACE : sendbuff, recvbuff, (int)count, mpi_of(type),
                             MPI_SUM, comm->mpi), "MPI_Allreduce");
    });
}

ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t type, ncclRedOp_t op,
                        int root, ncclComm_t comm, cudaStream_t stream) {
    ncclResult_t r = check(comm, type, count, root, "ncclReduce");
    if (r == ncclSuccess && op != ncclSum) r = refuse(ncclInvalidArgument, "ncclReduce: sums only");
    if (r == ncclSuccess) r = on_device(sendbuff, count, type, "sendbuff", "ncclReduce");
    if (r == ncclSuccess && comm->rank == root) r = on_device(recvbuff, count, type, "recvbuff", "ncclReduce");
    if (r != ncclSuccess) return r;
    return enqueue(stream, [=] {
        if (comm->aborted || !count) return;
        bool me = comm->rank == root;
        mpi_ok(PMPI_Reduce(me && sendbuff == recvbuff ? MPI_IN_PLACE : sendbuff, me ? recvbuff : NULL, (int)count,
                          mpi_of(type), MPI_SUM, root, comm->mpi), "MPI_Reduce");
    });
}

ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t type, int root,
                           ncclComm_t comm, cudaStream_t stream) {
    ncclResult_t r = check(comm, type, count, root, "ncclBroadcast");
    if (r == ncclSuccess && comm->rank == root) r = on_device(sendbuff, count, type, "sendbuff", "ncclBroadcast");
    if (r == ncclSuccess) r = on_device(recvbuff, count, type, "recvbuff", "ncclBroadcast");
    if (r != ncclSuccess) return r;
    return enqueue(stream, [=] {
        if (comm->aborted || !count) return;
        if (comm->rank == root && sendbuff != recvbuff) memcpy(recvbuff, sendbuff, count * bytes_of(type));
        mpi_ok(PMPI_Bcast(recvbuff, (int)count, mpi_of(type), root, comm->mpi), "MPI_Bcast");
    });
}

/* The host's blocking MPI calls (train/dist_mpi.c's, through MPI's profiling interface: these definitions take the
 * place of the library's, which they call as PMPI_*): a GPU runs its queued work on its own while the host waits in
 * MPI, so the deferred collectives run first. Without this, a rank whose host waits in MPI_Allreduce for a peer
 * that waits on the GPU for a deferred collective of the first rank would wait for good, where GPUs would not. */
extern "C" {
int MPI_Allreduce(const void *sendbuf, void *recvbuf, int count, MPI_Datatype type, MPI_Op op, MPI_Comm comm) {
    cudaDeviceSynchronize();
    return PMPI_Allreduce(sendbuf, recvbuf, count, type, op, comm);
}
int MPI_Bcast(void *buf, int count, MPI_Datatype type, int root, MPI_Comm comm) {
    cudaDeviceSynchronize();
    return PMPI_Bcast(buf, count, type, root, comm);
}
int MPI_Allgather(const void *sendbuf, int sendcount, MPI_Datatype sendtype, void *recvbuf, int recvcount,
                  MPI_Datatype recvtype, MPI_Comm comm) {
    cudaDeviceSynchronize();
    return PMPI_Allgather(sendbuf, sendcount, sendtype, recvbuf, recvcount, recvtype, comm);
}
int MPI_Allgatherv(const void *sendbuf, int sendcount, MPI_Datatype sendtype, void *recvbuf, const int recvcounts[],
                   const int displs[], MPI_Datatype recvtype, MPI_Comm comm) {
    cudaDeviceSynchronize();
    return PMPI_Allgatherv(sendbuf, sendcount, sendtype, recvbuf, recvcounts, displs, recvtype, comm);
}
int MPI_Gatherv(const void *sendbuf, int sendcount, MPI_Datatype sendtype, void *recvbuf, const int recvcounts[],
                const int displs[], MPI_Datatype recvtype, int root, MPI_Comm comm) {
    cudaDeviceSynchronize();
    return PMPI_Gatherv(sendbuf, sendcount, sendtype, recvbuf, recvcounts, displs, recvtype, root, comm);
}
int MPI_Scatterv(const void *sendbuf, const int sendcounts[], const int displs[], MPI_Datatype sendtype,
                 void *recvbuf, int recvcount, MPI_Datatype recvtype, int root, MPI_Comm comm) {
    cudaDeviceSynchronize();
    return PMPI_Scatterv(sendbuf, sendcounts, displs, sendtype, recvbuf, recvcount, recvtype, root, comm);
}
int MPI_Reduce_scatter(const void *sendbuf, void *recvbuf, const int recvcounts[], MPI_Datatype type, MPI_Op op,
                       MPI_Comm comm) {
    cudaDeviceSynchronize();
    return PMPI_Reduce_scatter(sendbuf, recvbuf, recvcounts, type, op, comm);
}
int MPI_Barrier(MPI_Comm comm) {
    cudaDeviceSynchronize();
    return PMPI_Barrier(comm);
}
int MPI_Wait(MPI_Request *request, MPI_Status *status) {
    cudaDeviceSynchronize();
    return PMPI_Wait(request, status);
}
int MPI_Finalize(void) {
    cudaDeviceSynchronize();
    if (late()) /* that the order was the late one: tests/run_tests.py reads it */
        fprintf(stderr, "cuda_emu: NCCL collectives run late: %ld of %ld after device work queued later\n",
                g_overtaken, g_units);
    return PMPI_Finalize();
}
}
