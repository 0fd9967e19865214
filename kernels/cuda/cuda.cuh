/* Shared by the CUDA backend's sources (kernels/cuda/): the C headers with C
 * linkage, error-check macros that name the file, the line, the CUDA error and
 * a hint, and the backend's stream and cuBLAS handle. */
#ifndef KVLAB_CUDA_CUH
#define KVLAB_CUDA_CUH

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

extern "C" {
#include "adamw.h"
#include "attention.h"
#include "backend.h"
#include "common.h"
#include "hash.h"
#include "kernels.h"
}

/* Every CUDA runtime call goes through CUDA_CHECK; every launch is followed by CUDA_LAUNCHED(name) (or
 * CUDA_LAUNCHED_AS with the name as a string), which also ends the op's part of that name in a profile
 * (kernels.h, kprof_start). */
#define CUDA_CHECK(call)                                                                                    \
    do {                                                                                                    \
        cudaError_t err_ = (call);                                                                          \
        if (err_ != cudaSuccess) cuda_fail(__FILE__, __LINE__, #call, cudaGetErrorString(err_));           \
    } while (0)
#define CUDA_LAUNCHED_AS(name)                                                                              \
    do {                                                                                                    \
        CUDA_CHECK(cudaGetLastError());                                                                     \
        kprof_part(name);                                                                                   \
    } while (0)
#define CUDA_LAUNCHED(name) CUDA_LAUNCHED_AS(#name)
#define CUBLAS_CHECK(call)                                                                                  \
    do {                                                                                                    \
        cublasStatus_t st_ = (call);                                                                        \
        if (st_ != CUBLAS_STATUS_SUCCESS) cuda_fail(__FILE__, __LINE__, #call, cublasGetStatusString(st_)); \
    } while (0)

/* Stops the program: "error: CUDA: <call> failed: <error> [file:line] (hint: ...)". */
[[noreturn]] void cuda_fail(const char *file, int line, const char *call, const char *what);

/* The stream every kernel and copy of the backend runs on (in order), and the cuBLAS handle bound to it. */
extern cudaStream_t kv_stream;
extern cublasHandle_t kv_cublas;
/* The GPU this process drives: CUDA_DEVICE, plus the rank on this machine in a data-parallel job
 * (dev_comm_select_gpu, before cuda_ready). */
extern int kv_device;
/* Starts the backend on first use (backend_init may be skipped by tests that call ops directly). */
void cuda_ready(void);
/* Whether it has started (the GPU is chosen for good then). */
int cuda_started(void);
/* Waits until the stream has done everything queued on it; every host wait of the backend ends here (the poll
 * before a copy, cuda_sync_before_copy, is followed by the copy's own) but one, for a slot of the upload ring
 * (backend.cu, dev_upload). With kv_sync_check set (the NCCL transport,
 * while a communicator is up) the wait polls the stream and calls it between polls, so that a collective that
 * fails without ending (a peer's network gone) stops the process instead of blocking it for good. Then the
 * queued checks of ids are settled (cuda_checks_settle). */
void cuda_sync(void);
/* The checks of ids the ops queue without waiting (ops.cu, check_ids): their answers come back on the stream
 * into page-locked memory and are read at the next cuda_sync, which stops with args_bad_id's message (the CPU
 * backend's) at the first bad id. Until then no op reads or writes memory by such an id (the kernels skip ids
 * outside [0, V)), so none waits for the answer. */
void cuda_checks_settle(void);
extern void (*kv_sync_check)(void);
/* Set with kv_sync_check: makes the stream wait for the collectives queued on the transport's side stream
 * (dev_comm_async_wait), so that a poll of the stream covers them too. */
extern void (*kv_side_join)(void);
/* Before a copy between pageable host memory and the device: such a copy may block in the driver until the
 * stream has done everything before it, a failed collective included, where no poll runs; with kv_sync_check
 * set, a polling wait first, so that the copy starts on an idle stream. It ends no host-wait part of its own and
 * settles no checks: the copy's cuda_sync after it does both (one round trip, one part). */
void cuda_sync_before_copy(void);

/* Activations (act_t, kernels.h) loaded as float (act_ld, act.cuh) and stored rounded from float. */
#include "act.cuh"
__host__ __device__ inline act_t act_st(float x) { return act_as<act_t>(x); }
/* Activations one 16-byte access moves (ActVec, act.cuh): 8 bf16 or 4 floats. */
#define ACT_VEC (16 / (int)sizeof(act_t))
/* ACT_VEC where rows of n activations fit whole 16-byte accesses: n a multiple of ACT_VEC and every buffer given
 * 16-byte aligned (NULL, an absent buffer, is), so that every row of each starts aligned; 1 otherwise. */
static inline int act_vec_width(int n, const void *p0, const void *p1 = NULL, const void *p2 = NULL,
                                const void *p3 = NULL) {
    const void *ps[4] = {p0, p1, p2, p3};
    bool ok = n % ACT_VEC == 0;
    for (const void *p : ps) ok = ok && (uintptr_t)p % 16 == 0;
    return ok ? ACT_VEC : 1;
}
/* cuBLAS's name of act_t */
#define CUDA_R_ACT (KVLAB_ACT_BYTES == 2 ? CUDA_R_16BF : CUDA_R_32F)
/* n values converted on the stream, float to act_t (rounded). */
void cuda_to_act(act_t *dst, const float *src, size_t n);

/* The backend wrote bytes at p, or freed them: a kept bf16 copy of a weight matrix there is stale, or freed (the
 * copies of ops.cu, weights_as_act). Every op that may write parameters calls the first: the transfers, dev_zero,
 * dev_copy, AdamW, scale_inplace (and so clip_grad_norm) and the collectives; dev_free the second. */
void cuda_float_written(const void *p, size_t bytes);
void cuda_float_freed(const void *p, size_t bytes);

/* Scratch device memory that grows on demand, one per use site (calls come from one host thread). */
float *cuda_scratch(float **buf, size_t *cap, size_t floats);

/* Launch shapes. */
static inline unsigned cuda_blocks(size_t n, unsigned threads) { return (unsigned)((n + threads - 1) / threads); }

#include "warp.cuh"

/* The most dynamic shared memory a block may use on this GPU (the opt-in limit); cuda_ready reads it. */
extern size_t kv_smem_max;
/* Stops with one line naming op when a launch needs more shared memory than this GPU has. */
void cuda_check_smem(const char *op, size_t bytes, const char *hint);

#endif
