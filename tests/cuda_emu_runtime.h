/* The CUDA runtime and cuBLAS, as much of them as the CUDA backend
 * (kernels/cuda/) calls, on the CPU: with it and tests/cuda_emu.h the whole
 * backend, host code and kernels, builds for the CPU (make CUDA_EMU=1 on a
 * CUDA configuration; tests/cuda_emu_src.py turns each launch into
 * emu::launch_config(grid, block, smem, stream).run(kernel, args...)) and the
 * test programs run on it where no GPU is.
 *
 * Device memory is host memory; every call runs at once, in order, so the
 * stream is always idle and an event's time is the host's clock when it was
 * recorded. The one exception is work queued with emu::stream_defer (the
 * emulated NCCL's collectives, tests/cuda_emu_nccl.h, when asked to run
 * them late): it waits until the stream is next used, synchronised or
 * queried, or an event recorded after it is waited for; a query that finds
 * it answers cudaErrorNotReady (left as the last error too, as HIP leaves
 * it) and runs it, so the next query answers cudaSuccess. A launch checks what a GPU would refuse, and the next
 * cudaGetLastError reports it as the GPU would: an empty grid or block, more
 * than 1024 threads, a grid's y or z over 65535, and dynamic shared memory
 * over 48 KiB that the kernel was not given with cudaFuncSetAttribute, or
 * over the device's opt-in limit. The device it describes is an H100
 * (sm_90, 132 multiprocessors, 227 KiB of shared memory per block, 80 GiB);
 * KVLAB_CUDA_EMU_SMEM_KIB=99 gives it the shared memory of sm_86 and sm_89.
 * cuBLAS's products are float loops in the order of the sum index; TF32 math
 * mode and the FAST_16BF compute type round the inputs to 10 and 7 mantissa
 * bits first, as the tensor cores see them; cublasGemmEx also takes bf16
 * inputs with a bf16 or float output (read as float, stored rounded). */
#ifndef KVLAB_CUDA_EMU_RUNTIME_H
#define KVLAB_CUDA_EMU_RUNTIME_H

#include <cstddef>
#include <cstdint>
#include <functional>
#include <type_traits>

#include "cuda_emu.h"

typedef enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorInvalidDevice = 101,
    cudaErrorNotReady = 600,
} cudaError_t;

struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

typedef struct CUstream_st *cudaStream_t;
typedef struct CUevent_st *cudaEvent_t;
enum cudaMemcpyKind {
    cudaMemcpyHostToHost,
    cudaMemcpyHostToDevice,
    cudaMemcpyDeviceToHost,
    cudaMemcpyDeviceToDevice,
    cudaMemcpyDefault
};
#define cudaStreamNonBlocking 0x01u
#define cudaEventDisableTiming 0x02u
#define cudaHostAllocDefault 0x00u
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
enum cudaDeviceAttr { cudaDevAttrMaxSharedMemoryPerBlockOptin = 97 };
struct cudaUUID_t {
    char bytes[16];
};
struct cudaDeviceProp {
    char name[256];
    cudaUUID_t uuid;
    size_t totalGlobalMem;
    int multiProcessorCount, major, minor;
};
struct cudaFuncAttributes {
    size_t sharedSizeBytes;
    int maxThreadsPerBlock, numRegs, maxDynamicSharedSizeBytes;
};

const char *cudaGetErrorString(cudaError_t err);
cudaError_t cudaGetLastError(void);
cudaError_t cudaGetDeviceCount(int *n);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *prop, int device);
cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int device);
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes);
cudaError_t cudaMalloc(void **p, size_t bytes);
cudaError_t cudaFree(void *p);
cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind);
/* Page-locked host memory. A cudaMemcpyAsync between it and the device is the one copy a GPU runs
 * asynchronously to the host: here it is deferred as emu::stream_defer's work is, so a host that touches the
 * pinned side before the copy is known done (an event or a synchronisation) sees what a GPU would let it see. */
cudaError_t cudaHostAlloc(void **p, size_t bytes, unsigned flags);
cudaError_t cudaFreeHost(void *p);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind, cudaStream_t stream);
cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t height,
                              cudaMemcpyKind kind, cudaStream_t stream);
cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t stream);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *stream, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaStreamQuery(cudaStream_t stream);
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned flags);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaEventCreate(cudaEvent_t *event);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned flags);
cudaError_t cudaEventDestroy(cudaEvent_t event);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream);
cudaError_t cudaEventQuery(cudaEvent_t event);
cudaError_t cudaEventSynchronize(cudaEvent_t event);
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end);

namespace emu {
/* Queues fn as the stream's next work, to run as late as CUDA's ordering allows: before the next work on that
 * stream, or when it is synchronised or queried, or when another stream waits for an event recorded on it after
 * fn, or at cudaFree or cudaDeviceSynchronize (all of which a GPU would have finished by then). The emulated
 * NCCL defers its collectives so (tests/cuda_emu_nccl.h); everything else runs at once. */
void stream_defer(cudaStream_t stream, std::function<void()> fn);
/* How many calls have queued work (a launch, a copy, a product) on any stream so far. */
uint64_t device_work(void);
/* Whether [p, p + bytes) lies inside one cudaMalloc allocation. */
bool device_range(const void *p, size_t bytes);
cudaError_t func_set_attribute(const void *fn, cudaFuncAttribute attr, int value);
/* Runs fn, one thread's share of a kernel launched as kernel<<<grid, block, smem, stream>>>, over the grid,
 * after the checks a GPU makes (above); a refused launch runs nothing and sets the last error. */
void kernel_launch(const std::function<void()> &fn, const void *kernel, dim3 grid, dim3 block, size_t smem = 0,
                   cudaStream_t stream = nullptr);
/* kernel<<<grid, block, smem, stream>>>(args...) as tests/cuda_emu_src.py writes it:
 * emu::launch_config(grid, block, smem, stream).run(kernel, args...), the arguments evaluated once and passed
 * by value, as a launch does. */
struct launch_config {
    dim3 grid, block;
    size_t smem;
    cudaStream_t stream;
    launch_config(dim3 g, dim3 b, size_t s = 0, cudaStream_t st = nullptr) : grid(g), block(b), smem(s), stream(st) {}
    /* the parameter types come from the kernel alone, so each argument converts to its parameter's type at the
     * launch (NULL to a pointer) as in CUDA */
    template <typename... P> void run(void (*kernel)(P...), std::type_identity_t<P>... args) const {
        kernel_launch([&] { kernel(args...); }, (const void *)kernel, grid, block, smem, stream);
    }
};
} /* namespace emu */

template <typename F> cudaError_t cudaFuncSetAttribute(F *fn, cudaFuncAttribute attr, int value) {
    return emu::func_set_attribute((const void *)fn, attr, value);
}
template <typename F> cudaError_t cudaFuncGetAttributes(cudaFuncAttributes *a, F *fn) {
    (void)fn;
    *a = cudaFuncAttributes{0, 1024, 32, 48 * 1024};
    return cudaSuccess;
}

/* cuBLAS */
typedef enum {
    CUBLAS_STATUS_SUCCESS = 0,
    CUBLAS_STATUS_INVALID_VALUE = 7,
    CUBLAS_STATUS_NOT_SUPPORTED = 15
} cublasStatus_t;
typedef struct cublasContext *cublasHandle_t;
typedef enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 } cublasOperation_t;
typedef enum {
    CUBLAS_DEFAULT_MATH = 0,
    CUBLAS_PEDANTIC_MATH = 2,
    CUBLAS_TF32_TENSOR_OP_MATH = 3
} cublasMath_t;
typedef enum { CUDA_R_32F = 0, CUDA_R_16BF = 14 } cudaDataType;
typedef enum {
    CUBLAS_COMPUTE_32F = 68,
    CUBLAS_COMPUTE_32F_FAST_16BF = 75,
    CUBLAS_COMPUTE_32F_FAST_TF32 = 77
} cublasComputeType_t;
typedef enum { CUBLAS_GEMM_DEFAULT = -1 } cublasGemmAlgo_t;

const char *cublasGetStatusString(cublasStatus_t st);
cublasStatus_t cublasCreate(cublasHandle_t *h);
cublasStatus_t cublasDestroy(cublasHandle_t h);
cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t stream);
cublasStatus_t cublasSetMathMode(cublasHandle_t h, cublasMath_t mode);
cublasStatus_t cublasSgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                           const float *alpha, const float *A, int lda, const float *B, int ldb, const float *beta,
                           float *C, int ldc);
cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                            const void *alpha, const void *A, cudaDataType at, int lda, const void *B, cudaDataType bt,
                            int ldb, const void *beta, void *C, cudaDataType ct, int ldc, cublasComputeType_t compute,
                            cublasGemmAlgo_t algo);

/* cuBLASLt, as much as kvlab calls: one matmul D = epilogue(alpha op(A) op(B) + beta C) with the epilogues DEFAULT,
 * BIAS (a vector of the output's type, the documented default bias type, added to each column), GELU_AUX (GELU of
 * the result, the result itself kept in the aux matrix) with or without BIAS, and DGELU (the result times GELU's
 * derivative at the aux matrix). The compute types are those of cublasGemmEx plus FAST_TF32 (inputs rounded to
 * TF32). What it refuses: what the library documents refusing (an aux leading dimension that is not a multiple of 8
 * or under the rows of D, a missing bias or aux pointer), a buffer less aligned than the heuristic's preferences
 * said (default 256 bytes), which a GPU's kernels may assume; and, stricter than the library, any other epilogue,
 * attribute, type or bias type (kvlab asks for none of them). Its GELU is kvlab's tanh form, taken to be the
 * library's: a GPU run checks that. With KVLAB_CUDA_EMU_NO_EPILOGUE=1 in the environment the heuristic offers no
 * algorithm for any epilogue but DEFAULT, as a library without the fused kernels would, so that the callers'
 * fallbacks run. */
typedef struct cublasLtContext *cublasLtHandle_t;
typedef struct cublasLtMatmulDescEmu *cublasLtMatmulDesc_t;
typedef struct cublasLtMatrixLayoutEmu *cublasLtMatrixLayout_t;
typedef struct cublasLtMatmulPreferenceEmu *cublasLtMatmulPreference_t;
typedef struct {
    uint64_t data[8];
} cublasLtMatmulAlgo_t;
typedef struct {
    cublasLtMatmulAlgo_t algo;
    size_t workspaceSize;
    cublasStatus_t state;
    float wavesCount;
    int reserved[4];
} cublasLtMatmulHeuristicResult_t;
typedef enum {
    CUBLASLT_MATMUL_DESC_TRANSA = 3,
    CUBLASLT_MATMUL_DESC_TRANSB = 4,
    CUBLASLT_MATMUL_DESC_EPILOGUE = 7,
    CUBLASLT_MATMUL_DESC_BIAS_POINTER = 8,
    CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER = 11,
    CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD = 12,
    CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE = 26
} cublasLtMatmulDescAttributes_t;
typedef enum {
    CUBLASLT_EPILOGUE_DEFAULT = 1,
    CUBLASLT_EPILOGUE_BIAS = 4,
    CUBLASLT_EPILOGUE_GELU = 32,
    CUBLASLT_EPILOGUE_GELU_AUX = 32 | 128,
    CUBLASLT_EPILOGUE_GELU_AUX_BIAS = 32 | 128 | 4,
    CUBLASLT_EPILOGUE_DGELU = 64 | 128
} cublasLtEpilogue_t;
typedef enum {
    CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES = 5,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES = 6,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES = 7,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES = 8
} cublasLtMatmulPreferenceAttributes_t;

cublasStatus_t cublasLtCreate(cublasLtHandle_t *h);
cublasStatus_t cublasLtDestroy(cublasLtHandle_t h);
cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *d, cublasComputeType_t compute, cudaDataType scale);
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d);
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr,
                                              const void *buf, size_t size);
cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *l, cudaDataType type, uint64_t rows, uint64_t cols,
                                          int64_t ld);
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l);
cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *p);
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p);
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void *buf,
                                                    size_t size);
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t h, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a,
                                              cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c,
                                              cublasLtMatrixLayout_t d, cublasLtMatmulPreference_t pref,
                                              int requested, cublasLtMatmulHeuristicResult_t *results,
                                              int *returned);
cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t op, const void *alpha, const void *A,
                              cublasLtMatrixLayout_t adesc, const void *B, cublasLtMatrixLayout_t bdesc,
                              const void *beta, const void *C, cublasLtMatrixLayout_t cdesc, void *D,
                              cublasLtMatrixLayout_t ddesc, const cublasLtMatmulAlgo_t *algo, void *workspace,
                              size_t workspace_bytes, cudaStream_t stream);

#endif
