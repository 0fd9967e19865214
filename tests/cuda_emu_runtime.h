/* The CUDA runtime and cuBLAS, as much of them as the CUDA backend
 * (kernels/cuda/) calls, on the CPU: with it and tests/cuda_emu.h the whole
 * backend, host code and kernels, builds for the CPU (make CUDA_EMU=1 on a
 * CUDA configuration; tests/cuda_emu_src.py turns each launch into
 * emu::launch_config(grid, block, smem, stream).run(kernel, args...)) and the
 * test programs run on it where no GPU is.
 *
 * Device memory is host memory; every call runs at once, in order, so the
 * stream is always idle and an event's time is the host's clock when it was
 * recorded. A launch checks what a GPU would refuse, and the next
 * cudaGetLastError reports it as the GPU would: an empty grid or block, more
 * than 1024 threads, a grid's y or z over 65535, and dynamic shared memory
 * over 48 KiB that the kernel was not given with cudaFuncSetAttribute, or
 * over the device's opt-in limit. The device it describes is an H100
 * (sm_90, 132 multiprocessors, 227 KiB of shared memory per block, 80 GiB).
 * cuBLAS's products are float loops in the order of the sum index; TF32 math
 * mode and the FAST_16BF compute type round the inputs to 10 and 7 mantissa
 * bits first, as the tensor cores see them; cublasGemmEx also takes bf16
 * inputs with a bf16 or float output (read as float, stored rounded). */
#ifndef KVLAB_CUDA_EMU_RUNTIME_H
#define KVLAB_CUDA_EMU_RUNTIME_H

#include <cstddef>
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
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind, cudaStream_t stream);
cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t height,
                              cudaMemcpyKind kind, cudaStream_t stream);
cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t stream);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *stream, unsigned flags);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaStreamQuery(cudaStream_t stream);
cudaError_t cudaEventCreate(cudaEvent_t *event);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream);
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end);

namespace emu {
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
typedef enum { CUBLAS_STATUS_SUCCESS = 0, CUBLAS_STATUS_INVALID_VALUE = 7 } cublasStatus_t;
typedef struct cublasContext *cublasHandle_t;
typedef enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 } cublasOperation_t;
typedef enum {
    CUBLAS_DEFAULT_MATH = 0,
    CUBLAS_PEDANTIC_MATH = 2,
    CUBLAS_TF32_TENSOR_OP_MATH = 3
} cublasMath_t;
typedef enum { CUDA_R_32F = 0, CUDA_R_16BF = 14 } cudaDataType;
typedef enum { CUBLAS_COMPUTE_32F = 68, CUBLAS_COMPUTE_32F_FAST_16BF = 75 } cublasComputeType_t;
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

#endif
