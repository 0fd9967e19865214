/* CUDA backend: device memory, transfers, the stream and the cuBLAS handle.
 * Everything runs in order on one stream; host calls return before the GPU is
 * done except those that hand back a host value (a norm, a count) or copy to
 * the host, which wait for it (the counted host waits, kernels.h). */
#include <climits>
#include <cstdlib>
#include <cstring>

#include <unistd.h>

#include "cuda.cuh"

cudaStream_t kv_stream;
cublasHandle_t kv_cublas;
size_t kv_smem_max;
int kv_device = CONFIG_CUDA_DEVICE;
static int g_ready;

__global__ void rows_gather_kernel(act_t *dst, size_t dst_ld, const act_t *src, size_t src_ld, const int *idx, int n,
                                   size_t cols);
static size_t g_alloc_total; /* dev_alloc_total() */

/* Live buffers and their sizes (open addressing on the pointer), for dev_mem_peak. */
static struct Live {
    void *p;
    size_t bytes;
} *g_live;
static size_t g_live_cap, g_live_n, g_live_bytes, g_live_peak;

static size_t live_slot(void *p) {
    size_t i = (size_t)mix64((uint64_t)(uintptr_t)p) & (g_live_cap - 1); /* all the pointer's bits mixed */
    for (;; i = (i + 1) & (g_live_cap - 1))
        if (g_live[i].p == p || !g_live[i].p) return i;
}

static void live_add(void *p, size_t bytes) {
    if (2 * (g_live_n + 1) > g_live_cap) { /* grow and rehash */
        struct Live *old = g_live;
        size_t oc = g_live_cap;
        g_live_cap = oc ? 2 * oc : 1024;
        g_live = (struct Live *)xcalloc(g_live_cap, sizeof *g_live);
        for (size_t i = 0; i < oc; i++)
            if (old[i].p) g_live[live_slot(old[i].p)] = old[i];
        free(old);
    }
    g_live[live_slot(p)] = (struct Live){p, bytes};
    g_live_n++;
    g_live_bytes += bytes;
    if (g_live_bytes > g_live_peak) g_live_peak = g_live_bytes;
}

/* the bytes of live buffer p (0 if unknown) */
static size_t live_bytes(void *p) {
    if (!g_live_cap) return 0;
    size_t i = live_slot(p);
    return g_live[i].p == p ? g_live[i].bytes : 0;
}

/* removes p and re-inserts the rest of its cluster (deletion in linear probing) */
static void live_remove(void *p) {
    if (!g_live_cap) return;
    size_t i = live_slot(p);
    if (g_live[i].p != p) return;
    g_live_bytes -= g_live[i].bytes;
    g_live[i].p = NULL;
    g_live_n--;
    for (size_t j = (i + 1) & (g_live_cap - 1); g_live[j].p; j = (j + 1) & (g_live_cap - 1)) {
        struct Live e = g_live[j];
        g_live[j].p = NULL;
        g_live[live_slot(e.p)] = e;
    }
}

size_t dev_mem_peak(void) { return g_live_peak; }

void dev_mem_peak_reset(void) { g_live_peak = g_live_bytes; }

size_t dev_mem_capacity(void) {
    cuda_ready();
    size_t free_b = 0, total_b = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    return total_b;
}

void cuda_fail(const char *file, int line, const char *call, const char *what) {
    fatal_at(file, line, "CUDA: %s failed: %s (hint: nvidia-smi shows whether the GPU is visible and busy; "
             "CUDA_LAUNCH_BLOCKING=1 pins an asynchronous error to its launch)", call, what);
}

int cuda_started(void) { return g_ready; }

void (*kv_sync_check)(void);
void (*kv_side_join)(void);

/* Waits until the stream's work queued before event ev (NULL: all of it) is done. */
static void wait_for(cudaEvent_t ev);

/* After a query answered cudaErrorNotReady: "not ready" is an answer, not a fault, but a runtime may keep it as
 * the last error (HIP does; PyTorch and Paddle clear it after every such query), and CUDA_LAUNCHED's
 * cudaGetLastError would then stop the next launch with "device not ready". Nothing else can be pending here:
 * every launch is checked as it is queued. */
static void not_ready_clear(void) { (void)cudaGetLastError(); }

/* The copy's own cuda_sync after it ends the host-wait part: one round trip, one part (as without NCCL), the time
 * of both waits in it. */
void cuda_sync_before_copy(void) {
    if (kv_sync_check) wait_for(NULL);
}

static void wait_for(cudaEvent_t ev) {
    if (!kv_sync_check) {
        CUDA_CHECK(ev ? cudaEventSynchronize(ev) : cudaStreamSynchronize(kv_stream));
        return;
    }
    /* poll, asking the check between polls; after the first ~20 ms, every 100 us (a long wait burns no core) */
    for (long polls = 0;; polls++) {
        cudaError_t err = ev ? cudaEventQuery(ev) : cudaStreamQuery(kv_stream);
        if (err == cudaSuccess) return;
        if (err != cudaErrorNotReady) CUDA_CHECK(err);
        not_ready_clear();
        kv_sync_check();
        if (polls > 10000) usleep(100);
    }
}

void cuda_sync(void) {
    wait_for(NULL);
    kprof_part(KPROF_HOST_WAIT); /* inside an op of a profile: one part a wait (kernels.h) */
    cuda_checks_settle();        /* the stream is idle: the answers of the queued checks are in (ops.cu) */
}

void cuda_ready(void) {
    if (g_ready) return;
    int n = 0;
    cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess || n == 0)
        FATAL("CUDA target: no usable GPU (%s) (hint: this binary was built for the GPU target; run it where "
              "nvidia-smi lists a GPU, or build for the CPU target in make menuconfig)",
              err != cudaSuccess ? cudaGetErrorString(err) : "no devices");
    if (kv_device >= n)
        FATAL("CUDA target: GPU index %d configured, this machine has %d (hint: set CUDA_DEVICE in make "
              "menuconfig, Compute target)", kv_device, n);
    CUDA_CHECK(cudaSetDevice(kv_device));
    /* code for this GPU's generation in the binary (a build for another -gencode fails at the first launch) */
    cudaFuncAttributes fa;
    err = cudaFuncGetAttributes(&fa, rows_gather_kernel);
    if (err != cudaSuccess) {
        cudaDeviceProp prop;
        CUDA_CHECK(cudaGetDeviceProperties(&prop, kv_device));
        FATAL("CUDA target: this binary has no code for the %s (compute capability %d.%d): %s (hint: choose its "
              "architecture, or native, in make menuconfig, Compute target, and rebuild)", prop.name, prop.major,
              prop.minor, cudaGetErrorString(err));
    }
    int smem = 0;
    CUDA_CHECK(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, kv_device));
    kv_smem_max = (size_t)smem;
    CUDA_CHECK(cudaStreamCreateWithFlags(&kv_stream, cudaStreamNonBlocking));
    CUBLAS_CHECK(cublasCreate(&kv_cublas));
    CUBLAS_CHECK(cublasSetStream(kv_cublas, kv_stream));
    /* fp32: pedantic (no reduced precision anywhere); TF32: allowed on the tensor cores; bf16: the products ask
     * for it themselves (ops.cu, gemm: bf16 inputs, or FAST_16BF), the default mode lets them */
    CUBLAS_CHECK(cublasSetMathMode(kv_cublas, IS_ENABLED(CONFIG_CUDA_TF32) ? CUBLAS_TF32_TENSOR_OP_MATH
                                              : IS_ENABLED(CONFIG_CUDA_BF16_MATMUL) || IS_ENABLED(CONFIG_CUDA_BF16)
                                                  ? CUBLAS_DEFAULT_MATH
                                                  : CUBLAS_PEDANTIC_MATH));
    g_ready = 1;
}

void backend_init(int nthreads) {
    if (nthreads < 0) FATAL("backend_init: nthreads must be >= 0, got %d", nthreads);
    cuda_ready();
}

const char *backend_name(void) {
    static char name[320];
    if (!name[0]) {
        cuda_ready();
        cudaDeviceProp prop;
        CUDA_CHECK(cudaGetDeviceProperties(&prop, kv_device));
        snprintf(name, sizeof name, "cuda (%s, sm_%d%d, %s, cuBLAS)", prop.name, prop.major, prop.minor,
                 IS_ENABLED(CONFIG_CUDA_TF32)          ? "tf32 matmuls"
                 : IS_ENABLED(CONFIG_CUDA_BF16_MATMUL) ? "bf16 matmuls"
                 : IS_ENABLED(CONFIG_CUDA_BF16)        ? "bf16 activations and matmuls"
                                                       : "fp32");
    }
    return name;
}

/* Host threads that drive the GPU: one. */
int backend_threads(void) { return 1; }

void *dev_alloc(size_t bytes) {
    KPROF_OP();
    cuda_ready();
    g_alloc_total += bytes;
    void *p = NULL;
    cudaError_t err = cudaMalloc(&p, bytes ? bytes : 1);
    if (err != cudaSuccess) {
        size_t free_b = 0, total_b = 0;
        cudaMemGetInfo(&free_b, &total_b);
        FATAL("dev_alloc: out of GPU memory allocating %zu bytes (%zu of %zu MiB free) (hint: a smaller batch or "
              "model, or a GPU with more memory)", bytes, free_b >> 20, total_b >> 20);
    }
    CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, kv_stream));
    live_add(p, bytes);
    return p;
}

size_t dev_alloc_total(void) { return g_alloc_total; }

void dev_free(void *p) {
    KPROF_OP();
    if (!p) return;
    /* the stream may still use it: frees wait for the work queued before them. cudaFree waits for the whole
     * device, the transport's side stream included: join that to the stream first, so the poll covers it. */
    cuda_float_freed(p, live_bytes(p));
    if (kv_side_join) kv_side_join();
    cuda_sync();
    CUDA_CHECK(cudaFree(p));
    live_remove(p);
}

void dev_zero(void *p, size_t bytes) {
    KPROF_OP();
    cuda_float_written(p, bytes);
    if (bytes) CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, kv_stream));
}

/* Uploads of up to UPLOAD_STAGE_MAX bytes (a batch: its ids, images, masks) go through a ring of page-locked
 * buffers, so that the host queues them and runs on: its bytes are copied into the next slot, the slot's copy to
 * the device queued on the stream and an event after it. The host waits only where it comes round to a slot whose
 * copy has not run yet, the GPU a whole ring of uploads behind. A copy from pageable memory, the fallback for
 * larger uploads (parameters, a checkpoint's tensors), may wait for the stream inside the driver, and waits after
 * it as well, so that the host may reuse its buffer at once. */
#define UPLOAD_SLOTS 8
#define UPLOAD_STAGE_MIN ((size_t)1 << 20)
#define UPLOAD_STAGE_MAX ((size_t)16 << 20)
static struct UploadSlot {
    void *buf;
    size_t cap;
    cudaEvent_t copied; /* recorded after the slot's last copy */
} g_up[UPLOAD_SLOTS];
static int g_up_next;

static void upload_staged(void *dst, const void *src, size_t bytes) {
    struct UploadSlot *u = &g_up[g_up_next];
    g_up_next = (g_up_next + 1) % UPLOAD_SLOTS;
    if (!u->copied) CUDA_CHECK(cudaEventCreateWithFlags(&u->copied, cudaEventDisableTiming));
    cudaError_t q = cudaEventQuery(u->copied); /* complete if never recorded */
    if (q == cudaErrorNotReady) {
        not_ready_clear();
        wait_for(u->copied);
        kprof_part(KPROF_HOST_WAIT);
    } else {
        CUDA_CHECK(q);
    }
    if (u->cap < bytes) { /* grown once, to the largest upload of its size class */
        if (u->buf) { /* cudaFreeHost waits for the whole device inside the driver: first the poll, as dev_free's */
            if (kv_side_join) kv_side_join();
            cuda_sync();
            CUDA_CHECK(cudaFreeHost(u->buf));
        }
        u->cap = bytes > UPLOAD_STAGE_MIN ? bytes : UPLOAD_STAGE_MIN;
        CUDA_CHECK(cudaHostAlloc(&u->buf, u->cap, cudaHostAllocDefault));
    }
    memcpy(u->buf, src, bytes);
    CUDA_CHECK(cudaMemcpyAsync(dst, u->buf, bytes, cudaMemcpyHostToDevice, kv_stream));
    CUDA_CHECK(cudaEventRecord(u->copied, kv_stream));
}

void dev_upload(void *dst, const void *src, size_t bytes) {
    KPROF_OP();
    if (!bytes) return;
    cuda_float_written(dst, bytes);
    cuda_ready();
    if (bytes <= UPLOAD_STAGE_MAX) {
        upload_staged(dst, src, bytes);
        return;
    }
    cuda_sync_before_copy();
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, kv_stream));
    cuda_sync(); /* the host buffer may be reused at once */
}

void dev_download(void *dst, const void *src, size_t bytes) {
    KPROF_OP();
    if (!bytes) return;
    cuda_sync_before_copy();
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, kv_stream));
    cuda_sync();
}

void dev_copy(void *dst, const void *src, size_t bytes) {
    KPROF_OP();
    cuda_float_written(dst, bytes);
    if (bytes) CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, kv_stream));
}

/* Activations cross as float on the host side: as their bytes where act_t is float, converted on the host
 * (bf16 rounded to nearest even, as the kernels store) where it is bf16. */
void act_upload(act_t *dst, const float *host_src, size_t n) {
    if (KVLAB_ACT_BYTES == sizeof(float)) {
        dev_upload(dst, host_src, n * sizeof(float));
        return;
    }
    act_t *h = (act_t *)xmalloc(n * sizeof(act_t) + 1);
    for (size_t i = 0; i < n; i++) h[i] = act_st(host_src[i]);
    dev_upload(dst, h, n * sizeof(act_t));
    free(h);
}

void act_download(float *host_dst, const act_t *src, size_t n) {
    if (KVLAB_ACT_BYTES == sizeof(float)) {
        dev_download(host_dst, src, n * sizeof(float));
        return;
    }
    act_t *h = (act_t *)xmalloc(n * sizeof(act_t) + 1);
    dev_download(h, src, n * sizeof(act_t));
    for (size_t i = 0; i < n; i++) host_dst[i] = act_ld(h[i]);
    free(h);
}

void dev_copy_rows(act_t *dst, size_t dst_ld, const act_t *src, size_t src_ld, int rows, size_t cols) {
    KPROF_OP();
    if (rows < 0 || cols > dst_ld || cols > src_ld)
        FATAL("dev_copy_rows: %d rows of %zu values with strides %zu and %zu", rows, cols, dst_ld, src_ld);
    if (rows == 0 || cols == 0) return;
    CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_ld * sizeof(act_t), src, src_ld * sizeof(act_t), cols * sizeof(act_t),
                                 (size_t)rows, cudaMemcpyDeviceToDevice, kv_stream));
}

__global__ void rows_gather_kernel(act_t *dst, size_t dst_ld, const act_t *src, size_t src_ld, const int *idx, int n,
                                   size_t cols) {
    int i = blockIdx.x;
    if (i >= n) return;
    const act_t *s = src + (size_t)idx[i] * src_ld;
    act_t *d = dst + (size_t)i * dst_ld;
    for (size_t c = threadIdx.x; c < cols; c += blockDim.x) d[c] = s[c];
}

void rows_gather(act_t *dst, size_t dst_ld, const act_t *src, size_t src_ld, const int *idx, int n, size_t cols) {
    KPROF_OP();
    if (n < 0 || cols > dst_ld || cols > src_ld)
        FATAL("rows_gather: %d rows of %zu values with strides %zu and %zu", n, cols, dst_ld, src_ld);
    if (n == 0 || cols == 0) return;
    rows_gather_kernel<<<n, 256, 0, kv_stream>>>(dst, dst_ld, src, src_ld, idx, n, cols);
    CUDA_LAUNCHED(rows_gather);
}

/* ------------------------------------------------------------------ helpers for the other sources */

__global__ void to_act_kernel(act_t *dst, const float *src, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = act_st(src[i]);
}

void cuda_to_act(act_t *dst, const float *src, size_t n) {
    if (!n) return;
    to_act_kernel<<<cuda_blocks(n, 256), 256, 0, kv_stream>>>(dst, src, n);
    CUDA_LAUNCHED(to_act);
}

float *cuda_scratch(float **buf, size_t *cap, size_t floats) {
    if (floats > *cap) {
        dev_free(*buf);
        *buf = (float *)dev_alloc(floats * sizeof(float));
        *cap = floats;
    }
    return *buf;
}

void cuda_check_smem(const char *op, size_t bytes, const char *hint) {
    if (bytes > kv_smem_max)
        FATAL("%s: needs %zu bytes of shared memory per block, this GPU allows %zu (hint: %s)", op, bytes, kv_smem_max,
              hint);
}

/* The profile's clock (backend.h): a mark is an event queued on the stream, so the time between two marks is the
 * GPU's, between the work queued before the one and before the other. The events are made as the marks first need
 * them and kept for the next profile. */
static cudaEvent_t *g_events;
static int g_nmarks, g_nevents;

int kprof_mark(void) {
    cuda_ready();
    if (g_nmarks == g_nevents) {
        int n = g_nevents ? 2 * g_nevents : 4096;
        g_events = (cudaEvent_t *)xrealloc(g_events, (size_t)n * sizeof *g_events);
        for (int i = g_nevents; i < n; i++) CUDA_CHECK(cudaEventCreate(&g_events[i]));
        g_nevents = n;
    }
    CUDA_CHECK(cudaEventRecord(g_events[g_nmarks], kv_stream));
    return g_nmarks++;
}

void kprof_marks_wait(void) {
    if (g_nmarks) wait_for(NULL); /* the profile's own wait, not one of the ops' */
}

double kprof_mark_ms(int from, int to) {
    float ms = 0.0f;
    CUDA_CHECK(cudaEventElapsedTime(&ms, g_events[from], g_events[to]));
    return ms;
}

void kprof_marks_reset(void) { g_nmarks = 0; }
