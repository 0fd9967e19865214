/* The CUDA runtime and cuBLAS on the CPU for the emulated CUDA backend (what
 * it models and checks: tests/cuda_emu_runtime.h). */
#include "cuda_emu_runtime.h"

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <deque>
#include <map>
#include <vector>

/* the kernels' dynamic shared memory (extern __shared__ float sm[] and tsm[]) */
alignas(128) float sm[emu::SMEM_FLOATS];
alignas(128) float tsm[emu::SMEM_FLOATS];

namespace {

constexpr size_t SMEM_DEFAULT = 48 * 1024;  /* dynamic shared memory a kernel gets without asking */
constexpr size_t SMEM_OPTIN = 227 * 1024;   /* the most it may ask for on an H100 */

/* The opt-in limit the device reports and enforces: an H100's, or KVLAB_CUDA_EMU_SMEM_KIB (48 to 227; 99 is
 * sm_86's and sm_89's), so that the fallbacks a smaller GPU takes run here too. Read once. */
size_t smem_optin(void) {
    static size_t kib;
    if (!kib) {
        const char *e = getenv("KVLAB_CUDA_EMU_SMEM_KIB");
        if (e && !*e) e = NULL; /* set empty: as unset */
        char *end = NULL;
        long v = e ? strtol(e, &end, 10) : (long)(SMEM_OPTIN / 1024);
        if (e && (end == e || *end || v < 48 || v > (long)(SMEM_OPTIN / 1024))) {
            fprintf(stderr, "cuda_emu: KVLAB_CUDA_EMU_SMEM_KIB=%s (hint: an integer from 48 to 227, e.g. 99 as on "
                    "sm_86 and sm_89)\n", e);
            exit(2);
        }
        kib = (size_t)v;
    }
    return kib * 1024;
}
constexpr size_t MEM_TOTAL = (size_t)80 << 30;

cudaError_t g_last = cudaSuccess;
std::map<const void *, int> g_smem_attr; /* cudaFuncAttributeMaxDynamicSharedMemorySize per kernel */
std::map<void *, size_t> g_allocs;
std::map<void *, size_t> g_pinned; /* cudaHostAlloc's */
size_t g_allocated;
cublasMath_t g_math = CUBLAS_DEFAULT_MATH;

/* whether [p, p + bytes) lies inside one allocation of allocs (address to size) */
bool inside(const std::map<void *, size_t> &allocs, const void *p, size_t bytes) {
    auto it = allocs.upper_bound((void *)p); /* the first allocation after p: the one before may hold it */
    if (it == allocs.begin()) return false;
    --it;
    size_t off = (size_t)((const char *)p - (const char *)it->first);
    return off <= it->second && bytes <= it->second - off;
}

/* A stream's deferred work (emu::stream_defer): run, in order, when the stream is next used, synchronised or waited
 * for through an event recorded after it. seq numbers what was ever deferred on the stream; id names the stream
 * for the events recorded on it, never reused, so an event outlives its stream safely. */
struct Stream {
    unsigned flags;
    std::deque<std::pair<uint64_t, std::function<void()>>> deferred;
    uint64_t seq;
    uint64_t id;
};
Stream g_default_stream{0, {}, 0, 1}; /* stream 0 */
std::vector<Stream *> g_streams{&g_default_stream};
uint64_t g_stream_ids = 1; /* the last id given */

Stream *stream_of(cudaStream_t s) { return s ? (Stream *)s : &g_default_stream; }

/* the live stream of this id, or null: destroyed (its work ran then) or never recorded on (id 0) */
Stream *stream_by_id(uint64_t id) {
    for (Stream *s : g_streams)
        if (s->id == id) return s;
    return nullptr;
}

/* runs s's deferred work numbered below upto; whether there was any */
bool run_deferred(Stream *s, uint64_t upto = UINT64_MAX) {
    bool ran = false;
    while (!s->deferred.empty() && s->deferred.front().first < upto) {
        auto fn = std::move(s->deferred.front().second);
        s->deferred.pop_front();
        fn();
        ran = true;
    }
    return ran;
}

uint64_t g_device_work; /* calls that queued work on a stream: emu::device_work */

/* before new work on stream s: what was deferred on it comes first, as a stream runs in order */
void stream_use(cudaStream_t s) { run_deferred(stream_of(s)); }

void new_work(cudaStream_t s) {
    stream_use(s);
    g_device_work++;
}

void device_sync(void) {
    for (Stream *s : g_streams) run_deferred(s);
}

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

/* an event: its host time, and the stream (by id, 0 for none) and place in it where it was last recorded */
struct CUevent_st {
    double ms;
    bool recorded;
    uint64_t stream;
    uint64_t seq;
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
    /* each process emulates a GPU of its own (so NCCL's ranks, tests/cuda_emu_nccl.h, have one each) */
    char uuid[17];
    snprintf(uuid, sizeof uuid, "cuda_emu%08x", (unsigned)getpid());
    memcpy(prop->uuid.bytes, uuid, 16);
    prop->totalGlobalMem = MEM_TOTAL;
    prop->multiProcessorCount = 132;
    prop->major = 9, prop->minor = 0;
    return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int device) {
    if (device != 0) return fail(cudaErrorInvalidDevice);
    if (attr != cudaDevAttrMaxSharedMemoryPerBlockOptin) return fail(cudaErrorInvalidValue);
    *value = (int)smem_optin();
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
    device_sync(); /* cudaFree waits for the whole device */
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

cudaError_t cudaHostAlloc(void **p, size_t bytes, unsigned flags) {
    if (flags != cudaHostAllocDefault || !bytes) return fail(cudaErrorInvalidValue);
    *p = malloc(bytes);
    if (!*p) return fail(cudaErrorMemoryAllocation);
    memset(*p, 0xff, bytes);
    g_pinned[*p] = bytes;
    return cudaSuccess;
}

cudaError_t cudaFreeHost(void *p) {
    if (!p) return cudaSuccess;
    auto it = g_pinned.find(p);
    if (it == g_pinned.end()) return fail(cudaErrorInvalidValue);
    device_sync(); /* as cudaFree: the copies that use it finish first */
    g_pinned.erase(it);
    free(p);
    return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind, cudaStream_t stream) {
    new_work(stream);
    /* a copy to or from pinned host memory is the GPU's to run later: it reads its source when it runs */
    if (bytes && (inside(g_pinned, src, bytes) || inside(g_pinned, dst, bytes))) {
        emu::stream_defer(stream, [=] { memcpy(dst, src, bytes); });
        return cudaSuccess;
    }
    return cudaMemcpy(dst, src, bytes, kind);
}

cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t height,
                              cudaMemcpyKind kind, cudaStream_t stream) {
    (void)kind;
    new_work(stream);
    if (width > dpitch || width > spitch) return fail(cudaErrorInvalidValue);
    for (size_t r = 0; r < height; r++) memcpy((char *)dst + r * dpitch, (const char *)src + r * spitch, width);
    return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t stream) {
    new_work(stream);
    memset(p, value, bytes);
    return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *stream, unsigned flags) {
    Stream *s = new Stream{flags, {}, 0, ++g_stream_ids};
    g_streams.push_back(s);
    *stream = (cudaStream_t)s;
    return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
    if (!stream) return fail(cudaErrorInvalidValue);
    Stream *s = stream_of(stream);
    run_deferred(s); /* a destroyed stream still finishes its work */
    g_streams.erase(std::find(g_streams.begin(), g_streams.end(), s));
    delete s;
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
    stream_use(stream);
    return cudaSuccess;
}

/* A query that finds deferred work before it answers "not ready" once, as a GPU still busy would, and runs the
 * work, so that the next query finds it done. The answer is left as the last error too, as some runtimes leave it
 * (HIP does): code that polls must clear it before its next cudaGetLastError. */
static cudaError_t not_ready(bool pending) { return pending ? fail(cudaErrorNotReady) : cudaSuccess; }

cudaError_t cudaStreamQuery(cudaStream_t stream) { return not_ready(run_deferred(stream_of(stream))); }

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned flags) {
    if (flags) return fail(cudaErrorInvalidValue);
    (void)stream; /* a wait is no work: what was deferred on the waiting stream may stay so */
    if (Stream *s = stream_by_id(event->stream)) run_deferred(s, event->seq); /* the work the event follows first */
    return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void) {
    device_sync();
    return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned flags) {
    if (flags & ~cudaEventDisableTiming) return fail(cudaErrorInvalidValue);
    *event = new CUevent_st{0.0, false, 0, 0};
    return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t *event) { return cudaEventCreateWithFlags(event, 0); }

cudaError_t cudaEventDestroy(cudaEvent_t event) {
    delete event;
    return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
    Stream *s = stream_of(stream);
    auto now = std::chrono::steady_clock::now().time_since_epoch();
    event->ms = std::chrono::duration<double, std::milli>(now).count(); /* deferred work is not timed */
    event->recorded = true;
    event->stream = s->id, event->seq = s->seq;
    return cudaSuccess;
}

/* the work recorded before the event: done once asked about, as a stream's is (not ready the first time) */
cudaError_t cudaEventQuery(cudaEvent_t event) {
    if (!event->recorded) return cudaSuccess; /* as CUDA: an event never recorded is complete */
    Stream *s = stream_by_id(event->stream);
    return not_ready(s && run_deferred(s, event->seq));
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
    if (Stream *s = event->recorded ? stream_by_id(event->stream) : nullptr) run_deferred(s, event->seq);
    return cudaSuccess;
}

cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end) {
    if (!start->recorded || !end->recorded) return fail(cudaErrorInvalidValue);
    *ms = (float)(end->ms - start->ms);
    return cudaSuccess;
}

namespace emu {

cudaError_t func_set_attribute(const void *fn, cudaFuncAttribute attr, int value) {
    if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 || (size_t)value > smem_optin())
        return fail(cudaErrorInvalidValue);
    g_smem_attr[fn] = value;
    return cudaSuccess;
}

void kernel_launch(const std::function<void()> &fn, const void *kernel, dim3 grid, dim3 block, size_t smem,
                   cudaStream_t stream) {
    new_work(stream);
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

uint64_t device_work(void) { return g_device_work; }

bool device_range(const void *p, size_t bytes) { return inside(g_allocs, p, bytes); }

void stream_defer(cudaStream_t stream, std::function<void()> fn) {
    Stream *s = stream_of(stream);
    s->deferred.emplace_back(s->seq++, std::move(fn));
}

} /* namespace emu */

struct cublasContext {
    cudaStream_t stream;
};

const char *cublasGetStatusString(cublasStatus_t st) {
    switch (st) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    }
    return "CUBLAS_STATUS_UNKNOWN";
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
    new_work(h->stream);
    if (!gemm_args_ok(m, n, k, lda, ldb, ldc, ta, tb)) return CUBLAS_STATUS_INVALID_VALUE;
    gemm(ta, tb, m, n, k, *alpha, A, lda, B, ldb, *beta, C, ldc, g_math == CUBLAS_TF32_TENSOR_OP_MATH ? round_tf32 : keep);
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                            const void *alpha, const void *A, cudaDataType at, int lda, const void *B, cudaDataType bt,
                            int ldb, const void *beta, void *C, cudaDataType ct, int ldc, cublasComputeType_t compute,
                            cublasGemmAlgo_t algo) {
    (void)algo;
    new_work(h->stream);
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

/* ------------------------------------------------------------------ cuBLASLt */

struct cublasLtContext {
    int unused;
};
struct cublasLtMatmulDescEmu {
    cublasComputeType_t compute;
    cublasOperation_t ta, tb;
    uint32_t epilogue;
    const void *bias;
    void *aux;
    int64_t aux_ld;
    int bias_type; /* -1: the output's type */
};
struct cublasLtMatrixLayoutEmu {
    cudaDataType type;
    uint64_t rows, cols;
    int64_t ld;
};
struct cublasLtMatmulPreferenceEmu {
    uint32_t align[4]; /* A, B, C, D: the alignment the caller promises (bytes) */
};

namespace {

bool lt_type_ok(int t) { return t == CUDA_R_32F || t == CUDA_R_16BF; }
float lt_load(const void *p, int t, size_t i) {
    return t == CUDA_R_16BF ? __bfloat162float(((const __nv_bfloat16 *)p)[i]) : ((const float *)p)[i];
}
void lt_store(void *p, int t, size_t i, float v) {
    if (t == CUDA_R_16BF)
        ((__nv_bfloat16 *)p)[i] = __float2bfloat16(v);
    else
        ((float *)p)[i] = v;
}

/* GELU (tanh form) and its derivative, in float */
float lt_gelu(float x) { return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x))); }
float lt_dgelu(float x) {
    float th = tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x));
    return 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * 0.7978845608028654f * (1.0f + 3.0f * 0.044715f * x * x);
}

/* Whether the descriptor and layouts make a product the emulation computes: the shapes of op(A) (m x k), op(B)
 * (k x n), C and D (m x n), the types (A and B alike, C and D alike) and the compute type, the epilogue and its
 * inputs. */
bool lt_problem_ok(const cublasLtMatmulDescEmu *op, const cublasLtMatrixLayoutEmu *a, const cublasLtMatrixLayoutEmu *b,
                   const cublasLtMatrixLayoutEmu *c, const cublasLtMatrixLayoutEmu *d) {
    uint64_t m = d->rows, n = d->cols, k = op->ta == CUBLAS_OP_N ? a->cols : a->rows;
    if ((op->ta == CUBLAS_OP_N ? a->rows : a->cols) != m) return false;
    if ((op->tb == CUBLAS_OP_N ? b->rows : b->cols) != k || (op->tb == CUBLAS_OP_N ? b->cols : b->rows) != n)
        return false;
    if (c->rows != m || c->cols != n || c->type != d->type || a->type != b->type) return false;
    for (const cublasLtMatrixLayoutEmu *l : {a, b, c, d})
        if (!lt_type_ok(l->type) || l->ld < (int64_t)std::max<uint64_t>(1, l->rows)) return false;
    bool bf16_in = a->type == CUDA_R_16BF;
    if (!(op->compute == CUBLAS_COMPUTE_32F ||
          (!bf16_in && (op->compute == CUBLAS_COMPUTE_32F_FAST_TF32 || op->compute == CUBLAS_COMPUTE_32F_FAST_16BF))))
        return false;
    switch (op->epilogue) {
    case CUBLASLT_EPILOGUE_DEFAULT: return true;
    case CUBLASLT_EPILOGUE_BIAS: break;
    case CUBLASLT_EPILOGUE_GELU_AUX:
    case CUBLASLT_EPILOGUE_GELU_AUX_BIAS:
    case CUBLASLT_EPILOGUE_DGELU:
        if (!op->aux || op->aux_ld < (int64_t)m || op->aux_ld % 8) return false;
        break;
    default: return false;
    }
    if (op->epilogue & CUBLASLT_EPILOGUE_BIAS)
        if (!op->bias || !(op->bias_type == -1 || op->bias_type == (int)d->type)) return false;
    return true;
}

uint32_t alignment_of(const void *p) {
    uintptr_t a = (uintptr_t)p;
    uint32_t al = 256;
    while (al > 1 && a % al) al /= 2;
    return al;
}

} /* namespace */

cublasStatus_t cublasLtCreate(cublasLtHandle_t *h) {
    *h = new cublasLtContext{0};
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtDestroy(cublasLtHandle_t h) {
    delete h;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *d, cublasComputeType_t compute, cudaDataType scale) {
    if (scale != CUDA_R_32F) return CUBLAS_STATUS_INVALID_VALUE;
    *d = new cublasLtMatmulDescEmu{compute, CUBLAS_OP_N, CUBLAS_OP_N, CUBLASLT_EPILOGUE_DEFAULT, nullptr, nullptr, 0,
                                   -1};
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) {
    delete d;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr,
                                              const void *buf, size_t size) {
    switch (attr) {
    case CUBLASLT_MATMUL_DESC_TRANSA:
    case CUBLASLT_MATMUL_DESC_TRANSB: {
        if (size != sizeof(int32_t)) return CUBLAS_STATUS_INVALID_VALUE;
        int32_t v = *(const int32_t *)buf;
        if (v != CUBLAS_OP_N && v != CUBLAS_OP_T) return CUBLAS_STATUS_INVALID_VALUE;
        (attr == CUBLASLT_MATMUL_DESC_TRANSA ? d->ta : d->tb) = (cublasOperation_t)v;
        return CUBLAS_STATUS_SUCCESS;
    }
    case CUBLASLT_MATMUL_DESC_EPILOGUE:
        if (size != sizeof(uint32_t)) return CUBLAS_STATUS_INVALID_VALUE;
        d->epilogue = *(const uint32_t *)buf;
        return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER:
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER:
        if (size != sizeof(void *)) return CUBLAS_STATUS_INVALID_VALUE;
        if (attr == CUBLASLT_MATMUL_DESC_BIAS_POINTER)
            d->bias = *(const void *const *)buf;
        else
            d->aux = *(void *const *)buf;
        return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD:
        if (size != sizeof(int64_t)) return CUBLAS_STATUS_INVALID_VALUE;
        d->aux_ld = *(const int64_t *)buf;
        return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE:
        if (size != sizeof(int32_t)) return CUBLAS_STATUS_INVALID_VALUE;
        d->bias_type = *(const int32_t *)buf;
        return CUBLAS_STATUS_SUCCESS;
    }
    return CUBLAS_STATUS_INVALID_VALUE;
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *l, cudaDataType type, uint64_t rows, uint64_t cols,
                                          int64_t ld) {
    *l = new cublasLtMatrixLayoutEmu{type, rows, cols, ld};
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) {
    delete l;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *p) {
    *p = new cublasLtMatmulPreferenceEmu{{256, 256, 256, 256}};
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) {
    delete p;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void *buf,
                                                    size_t size) {
    if (attr == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES)
        return size == sizeof(uint64_t) ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_INVALID_VALUE;
    if (attr < CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES || attr > CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES ||
        size != sizeof(uint32_t))
        return CUBLAS_STATUS_INVALID_VALUE;
    p->align[attr - CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES] = *(const uint32_t *)buf;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t h, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a,
                                              cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c,
                                              cublasLtMatrixLayout_t d, cublasLtMatmulPreference_t pref,
                                              int requested, cublasLtMatmulHeuristicResult_t *results,
                                              int *returned) {
    (void)h;
    *returned = 0;
    if (requested < 1) return CUBLAS_STATUS_INVALID_VALUE;
    const char *no = getenv("KVLAB_CUDA_EMU_NO_EPILOGUE");
    bool refuse = no && *no && strcmp(no, "0") && op->epilogue != CUBLASLT_EPILOGUE_DEFAULT;
    if (refuse || !lt_problem_ok(op, a, b, c, d)) return CUBLAS_STATUS_NOT_SUPPORTED;
    memset(&results[0], 0, sizeof results[0]);
    for (int i = 0; i < 4; i++) results[0].algo.data[i] = pref->align[i]; /* what the algorithm may assume */
    results[0].state = CUBLAS_STATUS_SUCCESS;
    results[0].wavesCount = 1.0f;
    *returned = 1;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t op, const void *alpha, const void *A,
                              cublasLtMatrixLayout_t adesc, const void *B, cublasLtMatrixLayout_t bdesc,
                              const void *beta, const void *C, cublasLtMatrixLayout_t cdesc, void *D,
                              cublasLtMatrixLayout_t ddesc, const cublasLtMatmulAlgo_t *algo, void *workspace,
                              size_t workspace_bytes, cudaStream_t stream) {
    (void)h, (void)workspace, (void)workspace_bytes;
    new_work(stream);
    if (!algo || !lt_problem_ok(op, adesc, bdesc, cdesc, ddesc)) return CUBLAS_STATUS_INVALID_VALUE;
    const void *bufs[4] = {A, B, C, D};
    for (int i = 0; i < 4; i++) /* a buffer less aligned than the algorithm was told it may assume */
        if (alignment_of(bufs[i]) < algo->data[i]) return CUBLAS_STATUS_NOT_SUPPORTED;
    int m = (int)ddesc->rows, n = (int)ddesc->cols, k = (int)(op->ta == CUBLAS_OP_N ? adesc->cols : adesc->rows);
    float al = *(const float *)alpha, be = *(const float *)beta;
    std::vector<float> acc((size_t)m * n); /* alpha op(A) op(B), column-major with ld m */
    float (*rnd)(float) = op->compute == CUBLAS_COMPUTE_32F_FAST_TF32   ? round_tf32
                          : op->compute == CUBLAS_COMPUTE_32F_FAST_16BF ? emu::round_bf16
                                                                        : keep;
    if (adesc->type == CUDA_R_16BF)
        gemm(op->ta, op->tb, m, n, k, al, (const __nv_bfloat16 *)A, (int)adesc->ld, (const __nv_bfloat16 *)B,
             (int)bdesc->ld, 0.0f, acc.data(), m, rnd);
    else
        gemm(op->ta, op->tb, m, n, k, al, (const float *)A, (int)adesc->ld, (const float *)B, (int)bdesc->ld, 0.0f,
             acc.data(), m, rnd);
    int ot = ddesc->type, bt = op->bias_type == -1 ? ot : op->bias_type;
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            float v = acc[i + (size_t)j * m];
            if (be != 0.0f) v += be * lt_load(C, cdesc->type, i + (size_t)j * cdesc->ld); /* beta 0: C not read */
            if (op->epilogue & CUBLASLT_EPILOGUE_BIAS) v += lt_load(op->bias, bt, i);
            if (op->epilogue == CUBLASLT_EPILOGUE_DGELU)
                v *= lt_dgelu(lt_load(op->aux, ot, i + (size_t)j * op->aux_ld));
            else if (op->epilogue & CUBLASLT_EPILOGUE_GELU) {
                lt_store(op->aux, ot, i + (size_t)j * op->aux_ld, v);
                v = lt_gelu(v);
            }
            lt_store(D, ot, i + (size_t)j * ddesc->ld, v);
        }
    return CUBLAS_STATUS_SUCCESS;
}
