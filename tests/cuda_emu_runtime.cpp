/* The CUDA runtime and cuBLAS on the CPU for the emulated CUDA backend (what
 * it models and checks: tests/cuda_emu_runtime.h). */
#include "cuda_emu_runtime.h"

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <vector>

/* the kernels' dynamic shared memory (extern __shared__ float sm[] and tsm[]) */
alignas(128) float sm[emu::SMEM_FLOATS];
alignas(128) float tsm[emu::SMEM_FLOATS];

namespace {

constexpr size_t SMEM_DEFAULT = 48 * 1024;  /* dynamic shared memory a kernel gets without asking */
constexpr size_t SMEM_OPTIN = 227 * 1024;   /* the most it may ask for on an H100 */
constexpr size_t MEM_TOTAL = (size_t)80 << 30;

cudaError_t g_last = cudaSuccess;
std::map<const void *, int> g_smem_attr; /* cudaFuncAttributeMaxDynamicSharedMemorySize per kernel */
std::map<void *, size_t> g_allocs;
size_t g_allocated;
cublasMath_t g_math = CUBLAS_DEFAULT_MATH;

struct Stream {
    unsigned flags;
};

cudaError_t fail(cudaError_t err) {
    g_last = err;
    return err;
}


/* column-major C = alpha op(A) op(B) + beta C, each input element rounded by rnd first. The rounded operands are
 * packed so that each dot product reads two contiguous rows, summed in 8 interleaved float partial sums (cuBLAS
 * promises no order either). */
static float as_float(float v) { return v; }
static float as_float(__nv_bfloat16 v) { return __bfloat162float(v); }
static void store(float *c, float v) { *c = v; }
static void store(__nv_bfloat16 *c, float v) { *c = __float2bfloat16(v); }

/* Column-major C = alpha op(A) op(B) + beta C, inputs of type TI (float or bf16) rounded by rnd, C of type TO:
 * float sums, and C read as float and stored rounded to TO (bf16: to nearest even), as cuBLAS does. */
template <typename TI, typename TO>
void gemm(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, float alpha, const TI *A, int lda,
          const TI *B, int ldb, float beta, TO *C, int ldc, float (*rnd)(float)) {
    std::vector<float> a((size_t)m * k), b((size_t)n * k); /* op(A) row i, op(B) column j, each k long */
    for (int i = 0; i < m; i++)
        for (int l = 0; l < k; l++)
            a[(size_t)i * k + l] = rnd(as_float(ta == CUBLAS_OP_N ? A[i + (size_t)l * lda] : A[l + (size_t)i * lda]));
    for (int j = 0; j < n; j++)
        for (int l = 0; l < k; l++)
            b[(size_t)j * k + l] = rnd(as_float(tb == CUBLAS_OP_N ? B[l + (size_t)j * ldb] : B[j + (size_t)l * ldb]));
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            const float *x = &a[(size_t)i * k], *y = &b[(size_t)j * k];
            float part[8] = {0};
            int l = 0;
            for (; l + 8 <= k; l += 8)
                for (int u = 0; u < 8; u++) part[u] += x[l + u] * y[l + u];
            float s = 0.0f;
            for (; l < k; l++) s += x[l] * y[l];
            for (int u = 0; u < 8; u++) s += part[u];
            TO *c = &C[i + (size_t)j * ldc];
            /* beta 0: C is not read (it may hold NaN) */
            store(c, alpha * s + (beta == 0.0f ? 0.0f : beta * as_float(*c)));
        }
}

float keep(float v) { return v; }
float round_tf32(float v) { return nvcuda::wmma::__float_to_tf32(v); }

bool gemm_args_ok(int m, int n, int k, int lda, int ldb, int ldc, cublasOperation_t ta, cublasOperation_t tb) {
    return m >= 0 && n >= 0 && k >= 0 && lda >= std::max(1, ta == CUBLAS_OP_N ? m : k) &&
           ldb >= std::max(1, tb == CUBLAS_OP_N ? k : n) && ldc >= std::max(1, m);
}

} /* namespace */

struct CUevent_st {
    double ms;
    bool recorded;
};

const char *cudaGetErrorString(cudaError_t err) {
    switch (err) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorNotReady: return "device not ready";
    }
    return "unknown error";
}

cudaError_t cudaGetLastError(void) {
    cudaError_t e = g_last;
    g_last = cudaSuccess;
    return e;
}

cudaError_t cudaGetDeviceCount(int *n) {
    *n = 1;
    return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) { return device == 0 ? cudaSuccess : fail(cudaErrorInvalidDevice); }

cudaError_t cudaGetDeviceProperties(cudaDeviceProp *prop, int device) {
    if (device != 0) return fail(cudaErrorInvalidDevice);
    memset(prop, 0, sizeof *prop);
    snprintf(prop->name, sizeof prop->name, "cuda_emu H100");
    memcpy(prop->uuid.bytes, "cuda_emu-device0", 16);
    prop->totalGlobalMem = MEM_TOTAL;
    prop->multiProcessorCount = 132;
    prop->major = 9, prop->minor = 0;
    return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int device) {
    if (device != 0) return fail(cudaErrorInvalidDevice);
    if (attr != cudaDevAttrMaxSharedMemoryPerBlockOptin) return fail(cudaErrorInvalidValue);
    *value = (int)SMEM_OPTIN;
    return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes) {
    *free_bytes = MEM_TOTAL - g_allocated;
    *total_bytes = MEM_TOTAL;
    return cudaSuccess;
}

cudaError_t cudaMalloc(void **p, size_t bytes) {
    if (bytes > MEM_TOTAL - g_allocated) return fail(cudaErrorMemoryAllocation);
    /* 256-byte aligned as cudaMalloc's, and exactly bytes long, so that AddressSanitizer sees the first byte
     * past the end */
    if (posix_memalign(p, 256, bytes)) return fail(cudaErrorMemoryAllocation);
    memset(*p, 0xff, bytes); /* cudaMalloc's memory is not zeroed: NaN until written */
    g_allocs[*p] = bytes;
    g_allocated += bytes;
    return cudaSuccess;
}

cudaError_t cudaFree(void *p) {
    if (!p) return cudaSuccess;
    auto it = g_allocs.find(p);
    if (it == g_allocs.end()) return fail(cudaErrorInvalidValue);
    g_allocated -= it->second;
    g_allocs.erase(it);
    free(p);
    return cudaSuccess;
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind) {
    (void)kind;
    if (bytes) memcpy(dst, src, bytes);
    return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind, cudaStream_t stream) {
    (void)stream;
    return cudaMemcpy(dst, src, bytes, kind);
}

cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t height,
                              cudaMemcpyKind kind, cudaStream_t stream) {
    (void)kind, (void)stream;
    if (width > dpitch || width > spitch) return fail(cudaErrorInvalidValue);
    for (size_t r = 0; r < height; r++) memcpy((char *)dst + r * dpitch, (const char *)src + r * spitch, width);
    return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t stream) {
    (void)stream;
    memset(p, value, bytes);
    return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *stream, unsigned flags) {
    *stream = (cudaStream_t) new Stream{flags};
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
    (void)stream;
    return cudaSuccess;
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
    (void)stream;
    return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t *event) {
    *event = new CUevent_st{0.0, false};
    return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
    (void)stream;
    auto now = std::chrono::steady_clock::now().time_since_epoch();
    event->ms = std::chrono::duration<double, std::milli>(now).count();
    event->recorded = true;
    return cudaSuccess;
}

cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end) {
    if (!start->recorded || !end->recorded) return fail(cudaErrorInvalidValue);
    *ms = (float)(end->ms - start->ms);
    return cudaSuccess;
}

namespace emu {

cudaError_t func_set_attribute(const void *fn, cudaFuncAttribute attr, int value) {
    if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 || (size_t)value > SMEM_OPTIN)
        return fail(cudaErrorInvalidValue);
    g_smem_attr[fn] = value;
    return cudaSuccess;
}

void kernel_launch(const std::function<void()> &fn, const void *kernel, dim3 grid, dim3 block, size_t smem,
                   cudaStream_t stream) {
    (void)stream;
    unsigned long threads = (unsigned long)block.x * block.y * block.z;
    if (!grid.x || !grid.y || !grid.z || !threads || threads > 1024 || grid.x > 0x7fffffffu || grid.y > 65535 ||
        grid.z > 65535) {
        fail(cudaErrorInvalidConfiguration);
        return;
    }
    auto it = g_smem_attr.find(kernel);
    if (smem > std::max(SMEM_DEFAULT, it == g_smem_attr.end() ? (size_t)0 : (size_t)it->second)) {
        fail(cudaErrorInvalidValue);
        return;
    }
    if (block.y != 1 || block.z != 1 || threads % 32) {
        fprintf(stderr, "cuda_emu: a block of %ux%ux%u threads (the emulation runs one-dimensional blocks of whole "
                "warps)\n", block.x, block.y, block.z);
        exit(2);
    }
    /* a launch with dynamic shared memory gets it NaN before every block; one without may not read it: NaN
     * too (filled again only after a launch that had some) */
    static bool smem_written = true;
    float *shared[2] = {sm, tsm};
    if (!smem && smem_written) {
        memset(sm, 0xff, sizeof sm); /* NaN as float and as bf16, as launch_grid fills them */
        memset(tsm, 0xff, sizeof tsm);
    }
    smem_written = smem != 0;
    launch_grid({grid.x, grid.y, grid.z}, block.x, smem, shared, smem ? 2 : 0, fn);
}

} /* namespace emu */

struct cublasContext {
    cudaStream_t stream;
};

const char *cublasGetStatusString(cublasStatus_t st) {
    return st == CUBLAS_STATUS_SUCCESS ? "CUBLAS_STATUS_SUCCESS" : "CUBLAS_STATUS_INVALID_VALUE";
}

cublasStatus_t cublasCreate(cublasHandle_t *h) {
    *h = new cublasContext{nullptr};
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy(cublasHandle_t h) {
    delete h;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t stream) {
    h->stream = stream;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetMathMode(cublasHandle_t h, cublasMath_t mode) {
    (void)h;
    g_math = mode;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                           const float *alpha, const float *A, int lda, const float *B, int ldb, const float *beta,
                           float *C, int ldc) {
    (void)h;
    if (!gemm_args_ok(m, n, k, lda, ldb, ldc, ta, tb)) return CUBLAS_STATUS_INVALID_VALUE;
    gemm(ta, tb, m, n, k, *alpha, A, lda, B, ldb, *beta, C, ldc, g_math == CUBLAS_TF32_TENSOR_OP_MATH ? round_tf32 : keep);
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                            const void *alpha, const void *A, cudaDataType at, int lda, const void *B, cudaDataType bt,
                            int ldb, const void *beta, void *C, cudaDataType ct, int ldc, cublasComputeType_t compute,
                            cublasGemmAlgo_t algo) {
    (void)h, (void)algo;
    /* what kvlab asks for: float32 buffers (FAST_16BF rounds their inputs to bf16), or bf16 inputs with a bf16 or
     * float32 output and a float32 accumulator */
    float a = *(const float *)alpha, b = *(const float *)beta;
    if (!gemm_args_ok(m, n, k, lda, ldb, ldc, ta, tb) || at != bt) return CUBLAS_STATUS_INVALID_VALUE;
    if (at == CUDA_R_32F && ct == CUDA_R_32F)
        gemm(ta, tb, m, n, k, a, (const float *)A, lda, (const float *)B, ldb, b, (float *)C, ldc,
             compute == CUBLAS_COMPUTE_32F_FAST_16BF ? emu::round_bf16 : keep);
    else if (at == CUDA_R_16BF && compute == CUBLAS_COMPUTE_32F && ct == CUDA_R_16BF)
        gemm(ta, tb, m, n, k, a, (const __nv_bfloat16 *)A, lda, (const __nv_bfloat16 *)B, ldb, b, (__nv_bfloat16 *)C,
             ldc, keep);
    else if (at == CUDA_R_16BF && compute == CUBLAS_COMPUTE_32F && ct == CUDA_R_32F)
        gemm(ta, tb, m, n, k, a, (const __nv_bfloat16 *)A, lda, (const __nv_bfloat16 *)B, ldb, b, (float *)C, ldc,
             keep);
    else
        return CUBLAS_STATUS_INVALID_VALUE;
    return CUBLAS_STATUS_SUCCESS;
}
