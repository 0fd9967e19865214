/* CUDA implementations of the non-attention ops in kernels/kernels.h, forward
 * and backward side by side, as in kernels/cpu/ops.c (the reference they are
 * tested against). Every reduction runs in a fixed order (per-thread loops,
 * fixed-size partial sums, warp shuffles), never through floating-point
 * atomics, so a run repeats bit for bit. */
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstring>

#include <cublasLt.h>

#include "cuda.cuh"
#include "ops_kernels.cuh"

#define THREADS 256

/* Sum of one value per thread over a block of whole warps (THREADS at most), in a fixed order; every thread gets
 * it. Warps that hold only zeros change no sum, so a block cut down to the warps its data fills (row_threads) sums
 * bit for bit as a block of THREADS does. */
template <typename F>
__device__ F block_sum(F x) {
    __shared__ F part[THREADS / 32];
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    int w = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) part[w] = x;
    __syncthreads();
    F s = 0;
    for (unsigned i = 0; i < blockDim.x / 32; i++) s += part[i];
    return s;
}

__device__ float block_max(float x) {
    __shared__ float part[THREADS / 32];
    x = warp_max(x);
    int w = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) part[w] = x;
    __syncthreads();
    float m = -INFINITY;
    for (unsigned i = 0; i < blockDim.x / 32; i++) m = fmaxf(m, part[i]);
    return m;
}

/* The block of a kernel that gives each row of V values a block, W values a thread: THREADS, or for a row shorter
 * than THREADS x W the power of two of whole warps that covers it once (a row of 12 classes: one warp, not eight
 * of which seven would only add zeros). Each thread then reads the same values as in a block of THREADS, so the
 * results are the same bit for bit. */
static unsigned row_threads(int V, int W) {
    unsigned t = 32;
    while (t < THREADS && (size_t)t * (size_t)W < (size_t)V) t *= 2;
    return t;
}

/* ------------------------------------------------------------------ device-side checks of ids */

/* One block walks the n ids: ans[0] the smallest index whose id is outside [0, V) (ids equal to skip pass when
 * has_skip), INT_MAX if none; ans[1] the id found there. The
 * slot is its op's since the last host wait: a fresh slot takes this call's answer, a used one keeps the first bad
 * answer of the calls before (the stream runs them in order, so no atomics). One block keeps it free of a buffer
 * to reset; a batch's ids are a few thousand reads. */
#define CHECK_THREADS 1024
__global__ void __launch_bounds__(CHECK_THREADS)
    check_ids_kernel(int *ans, const int *ids, int n, int V, int has_skip, int skip, int fresh) {
    __shared__ int first[CHECK_THREADS / 32];
    int bad = INT_MAX;
    for (int i = (int)threadIdx.x; i < n && bad == INT_MAX; i += CHECK_THREADS) {
        int t = ids[i];
        if (!(has_skip && t == skip) && (t < 0 || t >= V)) bad = i;
    }
    for (int o = 16; o > 0; o >>= 1) bad = min(bad, __shfl_xor_sync(0xffffffffu, bad, o));
    int w = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) first[w] = bad;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int k = 1; k < CHECK_THREADS / 32; k++) bad = min(bad, first[k]);
        if (fresh || (ans[0] == INT_MAX && bad != INT_MAX)) {
            ans[0] = bad;
            ans[1] = bad == INT_MAX ? 0 : ids[bad];
        }
    }
}

/* The checks not yet answered (cuda.cuh, cuda_checks_settle): one slot of two ints for each (op, kind, V) checked
 * since the last host wait, on the device and in page-locked host memory, which the stream copies its answer into
 * after each check. However many steps pass between two waits, a training run uses two or three slots; more than
 * CHECKS_MAX different ones between two waits would cost a wait. */
#define CHECKS_MAX 16
static struct IdsCheck {
    const char *op;
    IdsKind kind;
    int V, used;
} g_checks[CHECKS_MAX];
static int g_nchecks, *g_check_dev, *g_check_host;

void cuda_checks_settle(void) {
    int n = g_nchecks, used[CHECKS_MAX];
    for (int k = 0; k < n; k++) used[k] = g_checks[k].used, g_checks[k].used = 0; /* before a stop, whose exit may
                                                                                      * wait for the stream again */
    for (int k = 0; k < n; k++) {
        const int *a = g_check_host + 2 * k;
        if (used[k] && a[0] != INT_MAX) args_bad_id(g_checks[k].op, g_checks[k].kind, a[1], a[0], g_checks[k].V);
    }
}

/* Queues a check of n ids on the device into its op's slot. The answer is read at the next host wait, which stops
 * with args_bad_id's message (the CPU backend's) if one is outside [0, V): the first bad id of the op's first call
 * with one since the wait before. */
static void check_ids(const char *op, IdsKind kind, const int *ids, int n, int V, int has_skip, int skip) {
    if (!g_check_dev) {
        g_check_dev = (int *)dev_alloc(2 * CHECKS_MAX * sizeof(int));
        CUDA_CHECK(cudaHostAlloc((void **)&g_check_host, 2 * CHECKS_MAX * sizeof(int), cudaHostAllocDefault));
    }
    int k = 0;
    while (k < g_nchecks && !(!strcmp(g_checks[k].op, op) && g_checks[k].kind == kind && g_checks[k].V == V)) k++;
    if (k == g_nchecks) {
        if (g_nchecks == CHECKS_MAX) {
            cuda_sync(); /* answers every slot: none is used after it */
            g_nchecks = k = 0;
        }
        g_checks[g_nchecks++] = (struct IdsCheck){op, kind, V, 0};
    }
    int fresh = !g_checks[k].used;
    g_checks[k].used = 1;
    check_ids_kernel<<<1, CHECK_THREADS, 0, kv_stream>>>(g_check_dev + 2 * k, ids, n, V, has_skip, skip, fresh);
    CUDA_LAUNCHED(check_ids);
    CUDA_CHECK(cudaMemcpyAsync(g_check_host + 2 * k, g_check_dev + 2 * k, 2 * sizeof(int), cudaMemcpyDeviceToHost,
                               kv_stream));
}

/* ------------------------------------------------------------------ embedding */

/* a token outside [0, V) reads nothing (its row is the position's alone): the queued check stops the program */
__global__ void embedding_forward_kernel(act_t *out, const int *tokens, const float *wte, const float *wpe, int BT,
                                         int T, int C, int V, float scale) {
    size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)BT * C) return;
    int i = (int)(idx / C), c = (int)(idx % C), t = tokens[i];
    float v = t >= 0 && t < V ? scale * wte[(size_t)t * C + c] : 0.0f;
    if (wpe) v += wpe[(size_t)(i % T) * C + c];
    out[idx] = act_st(v);
}

void embedding_forward(act_t *out, const int *tokens, const float *wte, const float *wpe,
                       int B, int T, int C, int V, float scale) {
    KPROF_OP();
    args_embedding(B, T, C, V);
    check_ids("embedding_forward", IDS_TOKENS, tokens, B * T, V, 0, 0);
    size_t n = (size_t)B * T * C;
    embedding_forward_kernel<<<cuda_blocks(n, THREADS), THREADS, 0, kv_stream>>>(out, tokens, wte, wpe, B * T, T, C,
                                                                                 V, scale);
    CUDA_LAUNCHED(embedding_forward);
}

/* dwte: embedding_backward_wte_kernel (ops_kernels.cuh); dwpe: one thread per (position, channel) sums over the
 * batch. */
__global__ void embedding_backward_wpe_kernel(float *dwpe, const act_t *dout, int B, int T, int C) {
    size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)T * C) return;
    float s = 0.0f;
    for (int b = 0; b < B; b++) s += act_ld(dout[(size_t)b * T * C + idx]);
    dwpe[idx] += s;
}

void embedding_backward(float *dwte, float *dwpe, const act_t *dout, const int *tokens,
                        int B, int T, int C, int V, float scale) {
    KPROF_OP();
    args_btc("embedding_backward", B, T, C, 1);
    /* a token outside [0, V) adds to no row: the forward's queued check stops the program at the next wait */
    embedding_backward_wte_kernel<act_t><<<EMB_BUCKETS, EMB_THREADS, emb_smem_bytes(), kv_stream>>>(
        dwte, dout, tokens, B * T, C, V, scale, EMB_BUCKETS);
    CUDA_LAUNCHED(embedding_backward_wte);
    if (dwpe) {
        embedding_backward_wpe_kernel<<<cuda_blocks((size_t)T * C, THREADS), THREADS, 0, kv_stream>>>(dwpe, dout, B,
                                                                                                      T, C);
        CUDA_LAUNCHED(embedding_backward_wpe);
    }
}

/* ------------------------------------------------------------------ token assembly */

__global__ void tokens_embed_forward_kernel(act_t *out, const act_t *x, const float *cls, const float *pos, int B,
                                            int T, int C, int off) {
    size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)B * T * C) return;
    int c = (int)(idx % C);
    int bt = (int)(idx / C), b = bt / T, t = bt % T;
    float v = t < off ? cls[c] : act_ld(x[((size_t)b * (T - off) + (size_t)(t - off)) * C + c]);
    if (pos) v += pos[(size_t)t * C + c];
    out[idx] = act_st(v);
}

void tokens_embed_forward(act_t *out, const act_t *x, const float *cls, const float *pos, int B, int T, int C) {
    KPROF_OP();
    args_btc("tokens_embed_forward", B, T, C, cls ? 2 : 1);
    size_t n = (size_t)B * T * C;
    tokens_embed_forward_kernel<<<cuda_blocks(n, THREADS), THREADS, 0, kv_stream>>>(out, x, cls, pos, B, T, C,
                                                                                    cls ? 1 : 0);
    CUDA_LAUNCHED(tokens_embed_forward);
}

/* one thread per (token row, channel): its batch sum in order */
__global__ void tokens_embed_backward_kernel(act_t *dx, float *dcls, float *dpos, const act_t *dout, int B, int T,
                                             int C, int off) {
    size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)T * C) return;
    int t = (int)(idx / C), c = (int)(idx % C);
    float sum = 0.0f;
    for (int b = 0; b < B; b++) {
        float d = act_ld(dout[((size_t)b * T + t) * C + c]);
        if (t >= off) {
            act_t *o = &dx[((size_t)b * (T - off) + (size_t)(t - off)) * C + c];
            *o = act_st(act_ld(*o) + d);
        }
        sum += d;
    }
    if (t < off) dcls[c] += sum;
    if (dpos) dpos[idx] += sum;
}

void tokens_embed_backward(act_t *dx, float *dcls, float *dpos, const act_t *dout, int B, int T, int C) {
    KPROF_OP();
    args_btc("tokens_embed_backward", B, T, C, dcls ? 2 : 1);
    tokens_embed_backward_kernel<<<cuda_blocks((size_t)T * C, THREADS), THREADS, 0, kv_stream>>>(
        dx, dcls, dpos, dout, B, T, C, dcls ? 1 : 0);
    CUDA_LAUNCHED(tokens_embed_backward);
}

/* ------------------------------------------------------------------ pooling */

__global__ void pool_forward_kernel(act_t *out, const act_t *inp, int B, int T, int C, int first, int count) {
    size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)B * C) return;
    int b = (int)(idx / C), c = (int)(idx % C);
    float s = 0.0f;
    for (int t = first; t < first + count; t++) s += act_ld(inp[((size_t)b * T + t) * C + c]);
    out[idx] = act_st(s * (1.0f / count));
}

__global__ void pool_backward_kernel(act_t *dinp, const act_t *dout, int B, int T, int C, int first, int count) {
    size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)B * count * C) return;
    int c = (int)(idx % C);
    int bt = (int)(idx / C), b = bt / count, t = first + bt % count;
    act_t *d = &dinp[((size_t)b * T + t) * C + c];
    *d = act_st(act_ld(*d) + act_ld(dout[(size_t)b * C + c]) * (1.0f / count));
}

void pool_tokens_forward(act_t *out, const act_t *inp, int B, int T, int C, int first, int count) {
    KPROF_OP();
    args_pool("pool_tokens_forward", B, T, C, first, count);
    pool_forward_kernel<<<cuda_blocks((size_t)B * C, THREADS), THREADS, 0, kv_stream>>>(out, inp, B, T, C, first,
                                                                                        count);
    CUDA_LAUNCHED(pool_forward);
}

void pool_tokens_backward(act_t *dinp, const act_t *dout, int B, int T, int C, int first, int count) {
    KPROF_OP();
    args_pool("pool_tokens_backward", B, T, C, first, count);
    pool_backward_kernel<<<cuda_blocks((size_t)B * count * C, THREADS), THREADS, 0, kv_stream>>>(dinp, dout, B, T,
                                                                                                 C, first, count);
    CUDA_LAUNCHED(pool_backward);
}

/* ------------------------------------------------------------------ layernorm */


void layernorm_forward(act_t *out, float *mean, float *rstd, const act_t *inp,
                       const float *w, const float *b, int N, int C) {
    KPROF_OP();
    args_rows("layernorm_forward", N, C);
    unsigned grid = cuda_blocks((size_t)N * 32, THREADS);
    if (act_vec_width(C, out, inp) > 1)
        layernorm_forward_kernel<act_t, ACT_VEC><<<grid, THREADS, 0, kv_stream>>>(out, mean, rstd, NULL, inp, NULL, w,
                                                                                 b, N, C);
    else
        layernorm_forward_kernel<act_t, 1><<<grid, THREADS, 0, kv_stream>>>(out, mean, rstd, NULL, inp, NULL, w, b,
                                                                            N, C);
    CUDA_LAUNCHED(layernorm_forward);
}

void residual_layernorm_forward(act_t *res, act_t *out, float *mean, float *rstd, const act_t *a, const act_t *b,
                                const float *w, const float *bias, int N, int C) {
    KPROF_OP();
    args_rows("residual_layernorm_forward", N, C);
    unsigned grid = cuda_blocks((size_t)N * 32, THREADS);
    if (act_vec_width(C, out, res, a, b) > 1)
        layernorm_forward_kernel<act_t, ACT_VEC><<<grid, THREADS, 0, kv_stream>>>(out, mean, rstd, res, a, b, w, bias,
                                                                                 N, C);
    else
        layernorm_forward_kernel<act_t, 1><<<grid, THREADS, 0, kv_stream>>>(out, mean, rstd, res, a, b, w, bias, N,
                                                                            C);
    CUDA_LAUNCHED(residual_layernorm_forward);
}

/* One warp per row, W values a lane at a time (act_vec_width) */
template <int W>
__global__ void layernorm_backward_dx_kernel(act_t *dinp, const act_t *dout, const act_t *inp, const float *w,
                                             const float *mean, const float *rstd, int N, int C) {
    typedef ActVec<act_t, W> Vec;
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= N) return;
    const act_t *x = inp + (size_t)row * C, *d = dout + (size_t)row * C;
    act_t *dx = dinp + (size_t)row * C;
    float m = mean[row], s = rstd[row];
    float sum_d = 0.0f, sum_dx = 0.0f;
    for (int c = lane * W; c < C; c += 32 * W) {
        Vec xv = mem_as<Vec>(x + c), dv = mem_as<Vec>(d + c);
        for (int e = 0; e < W; e++) {
            float xh = (act_ld(xv.v[e]) - m) * s, dxh = act_ld(dv.v[e]) * w[c + e];
            sum_d += dxh;
            sum_dx += dxh * xh;
        }
    }
    sum_d = warp_sum(sum_d) / C;
    sum_dx = warp_sum(sum_dx) / C;
    for (int c = lane * W; c < C; c += 32 * W) {
        Vec xv = mem_as<Vec>(x + c), dv = mem_as<Vec>(d + c), gv = mem_as<Vec>(dx + c);
        for (int e = 0; e < W; e++) {
            float xh = (act_ld(xv.v[e]) - m) * s;
            gv.v[e] = act_st(act_ld(gv.v[e]) + s * (act_ld(dv.v[e]) * w[c + e] - sum_d - xh * sum_dx));
        }
        mem_put<Vec>(dx + c, gv);
    }
}

#define COLSUM_ROWS 64 /* rows per partial sum of the column reductions */

/* partial[chunk][c] (and partial[chunk][C + c]) over the chunk's rows: sum of dout * xhat and of dout */
__global__ void layernorm_backward_dw_kernel(float *partial, const act_t *dout, const act_t *inp, const float *mean,
                                             const float *rstd, int N, int C) {
    int c = blockIdx.x * blockDim.x + threadIdx.x, chunk = blockIdx.y;
    if (c >= C) return;
    float sw = 0.0f, sb = 0.0f;
    int r1 = min(N, (chunk + 1) * COLSUM_ROWS);
    for (int r = chunk * COLSUM_ROWS; r < r1; r++) {
        float d = act_ld(dout[(size_t)r * C + c]);
        sw += d * (act_ld(inp[(size_t)r * C + c]) - mean[r]) * rstd[r];
        sb += d;
    }
    partial[(size_t)chunk * 2 * C + c] = sw;
    partial[(size_t)chunk * 2 * C + C + c] = sb;
}

/* a[c] += sum over chunks of partial[chunk][off + c] (a may be NULL) */
__global__ void colsum_finish_kernel(float *a, const float *partial, int chunks, size_t stride, int off, int C) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C || !a) return;
    float s = 0.0f;
    for (int k = 0; k < chunks; k++) s += partial[(size_t)k * stride + off + c];
    a[c] += s;
}

static float *g_partial;
static size_t g_partial_cap;

void layernorm_backward(act_t *dinp, float *dw, float *db, const act_t *dout, const act_t *inp,
                        const float *w, const float *mean, const float *rstd, int N, int C) {
    KPROF_OP();
    args_rows("layernorm_backward", N, C);
    unsigned grid = cuda_blocks((size_t)N * 32, THREADS);
    if (act_vec_width(C, dinp, dout, inp) > 1)
        layernorm_backward_dx_kernel<ACT_VEC><<<grid, THREADS, 0, kv_stream>>>(dinp, dout, inp, w, mean, rstd, N, C);
    else
        layernorm_backward_dx_kernel<1><<<grid, THREADS, 0, kv_stream>>>(dinp, dout, inp, w, mean, rstd, N, C);
    CUDA_LAUNCHED(layernorm_backward_dx);
    int chunks = (N + COLSUM_ROWS - 1) / COLSUM_ROWS;
    float *part = cuda_scratch(&g_partial, &g_partial_cap, (size_t)chunks * 2 * C);
    layernorm_backward_dw_kernel<<<dim3(cuda_blocks(C, 128), chunks), 128, 0, kv_stream>>>(part, dout, inp, mean,
                                                                                           rstd, N, C);
    CUDA_LAUNCHED(layernorm_backward_dw);
    colsum_finish_kernel<<<cuda_blocks(C, 128), 128, 0, kv_stream>>>(dw, part, chunks, (size_t)2 * C, 0, C);
    CUDA_LAUNCHED(colsum_finish);
    if (db) {
        colsum_finish_kernel<<<cuda_blocks(C, 128), 128, 0, kv_stream>>>(db, part, chunks, (size_t)2 * C, C, C);
        CUDA_LAUNCHED(colsum_finish);
    }
}

/* ------------------------------------------------------------------ linear */

__global__ void add_bias_kernel(act_t *out, const float *b, size_t N, int OC) {
    size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < N * OC) out[idx] = act_st(act_ld(out[idx]) + b[idx % OC]);
}

/* ---- weight matrices (and the biases of cuBLASLt's epilogues) as the products' input type: w itself where act_t
 * is float; with bf16 activations a copy rounded to bf16 (to nearest even), made at the matrix's first use and
 * kept, so that a step's forward and backward passes, the micro-steps of an accumulated batch and every token of
 * cached decoding read one copy instead of rounding the matrix again for each product (until 2026-11-27 each
 * product did: a whole pass over the weights per token of decoding). A copy goes stale when the backend writes
 * any byte of its float32 matrix through an op that may write parameters, cuda_float_written: the transfers,
 * dev_zero and dev_copy, AdamW, scale_inplace, clip_grad_norm and the collectives call it; the next product
 * rounds the matrix again into the same copy. The ops whose float32 outputs are gradients, statistics or losses
 * do not call it: those are never weights. dev_free of a matrix frees its copies (cuda_float_freed). The copies
 * count in the GPU memory the metrics report: half the bytes of the weight matrices. */
struct WeightCopy {
    const float *src;
    size_t n;
    act_t *copy;
    int fresh;
};
static WeightCopy *g_wcopy;
static size_t g_wcopy_n, g_wcopy_cap;

static bool overlaps(const WeightCopy &c, const void *p, size_t bytes) {
    uintptr_t lo = (uintptr_t)p, s = (uintptr_t)c.src;
    return s < lo + bytes && lo < s + c.n * sizeof(float);
}

void cuda_float_written(const void *p, size_t bytes) {
    for (size_t i = 0; i < g_wcopy_n; i++)
        if (overlaps(g_wcopy[i], p, bytes)) g_wcopy[i].fresh = 0;
}

void cuda_float_freed(const void *p, size_t bytes) {
    for (size_t i = 0; i < g_wcopy_n;) {
        if (!overlaps(g_wcopy[i], p, bytes)) {
            i++;
            continue;
        }
        act_t *copy = g_wcopy[i].copy;
        g_wcopy[i] = g_wcopy[--g_wcopy_n]; /* before dev_free, which comes back here with the copy's range */
        dev_free(copy);
    }
}

static const act_t *weights_as_act(const float *w, size_t n) {
    if (KVLAB_ACT_BYTES == sizeof(float)) return (const act_t *)w;
    WeightCopy *c = NULL;
    for (size_t i = 0; i < g_wcopy_n && !c; i++)
        if (g_wcopy[i].src == w && g_wcopy[i].n == n) c = &g_wcopy[i];
    if (!c) {
        if (g_wcopy_n == g_wcopy_cap) {
            g_wcopy_cap = g_wcopy_cap ? 2 * g_wcopy_cap : 64;
            g_wcopy = (WeightCopy *)xrealloc(g_wcopy, g_wcopy_cap * sizeof *g_wcopy);
        }
        c = &g_wcopy[g_wcopy_n++];
        *c = WeightCopy{w, n, (act_t *)dev_alloc(n * sizeof(act_t)), 0};
    }
    if (!c->fresh) {
        cuda_to_act(c->copy, w, n);
        c->fresh = 1;
    }
    return c->copy;
}

/* Column-major C = op(A) op(B) + beta C with a float32 accumulator, A and B of the activations' type (act_t), C
 * of the activations' type or (ct_float: a weight gradient) float32. cublasSgemm where everything is float32
 * (fp32, or TF32 by the handle's math mode); cublasGemmEx otherwise: bf16 inputs with CUDA_BF16, float32 buffers
 * whose inputs the tensor cores round to bf16 with CUDA_BF16_MATMUL (cuBLAS's FAST_16BF compute type). */
static void gemm(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const act_t *A, int lda,
                 const act_t *B, int ldb, float beta, void *Cm, int ct_float, int ldc) {
    const float one = 1.0f;
    cudaDataType ct = ct_float ? CUDA_R_32F : CUDA_R_ACT;
    cublasComputeType_t compute =
        IS_ENABLED(CONFIG_CUDA_BF16_MATMUL) ? CUBLAS_COMPUTE_32F_FAST_16BF : CUBLAS_COMPUTE_32F;
    if (KVLAB_ACT_BYTES == 2 || IS_ENABLED(CONFIG_CUDA_BF16_MATMUL))
        CUBLAS_CHECK(cublasGemmEx(kv_cublas, ta, tb, m, n, k, &one, A, CUDA_R_ACT, lda, B, CUDA_R_ACT, ldb, &beta, Cm,
                                  ct, ldc, compute, CUBLAS_GEMM_DEFAULT));
    else
        CUBLAS_CHECK(cublasSgemm(kv_cublas, ta, tb, m, n, k, &one, (const float *)A, lda, (const float *)B, ldb, &beta,
                                 (float *)Cm, ldc));
    kprof_part("cublas_gemm");
}

/* ---- cuBLASLt epilogues (CONFIG_CUDA_LT_EPILOGUE): the bias, the GELU and GELU's derivative applied by the
 * matmul as it writes its result, instead of a kernel that reads the result back and writes it again. */

enum { LT_BIAS, LT_GELU, LT_DGELU, LT_KINDS };
static const char *const lt_name[LT_KINDS] = {"cublaslt_bias", "cublaslt_gelu", "cublaslt_dgelu"};
#define LT_WORKSPACE ((size_t)32 << 20) /* bytes the library may use (cuBLAS's own default on Hopper) */

/* The largest power of two up to 256 that divides p's address: the alignment the heuristic may assume. */
static uint32_t alignment_of(const void *p) {
    uint32_t al = 256;
    while (al > 1 && (uintptr_t)p % al) al /= 2;
    return al;
}

/* The heuristic's answer for each problem, asked once: the query is host work (a search over the library's
 * kernels) that a small product can take longer to ask than to run, and cached decoding runs four epilogue
 * products per layer per token (with biases) with the same shapes. A problem is the epilogue, the transposition,
 * the shape, the leading dimensions, whether there is a bias and the alignment of A, B and D (what the algorithm
 * was chosen to assume). offered = false: cuBLASLt had no algorithm, and the plain product runs without asking
 * again. Past LT_PLANS problems the heuristic is asked each time (correct, only slower). */
struct LtPlan {
    int kind, ta, m, n, k, lda, ldb, ldd, has_bias;
    uint32_t align[3];
    bool offered;
    cublasLtMatmulAlgo_t algo;
};
#define LT_PLANS 256
static LtPlan g_lt_plans[LT_PLANS];
static int g_lt_plans_n;

static bool same_problem(const LtPlan &a, const LtPlan &b) {
    return a.kind == b.kind && a.ta == b.ta && a.m == b.m && a.n == b.n && a.k == b.k && a.lda == b.lda &&
           a.ldb == b.ldb && a.ldd == b.ldd && a.has_bias == b.has_bias && a.align[0] == b.align[0] &&
           a.align[1] == b.align[1] && a.align[2] == b.align[2];
}

/* Column-major D (m x n) = epilogue(op(A) B), op(A) m x k and B k x n of the activations' type, with the epilogue
 * of kind: LT_BIAS adds the bias (m values, of D's type: the library's default bias type; a bf16 build passes a
 * bf16 copy of its float32 bias, as llm.c's bf16 trainer does) down every column; LT_GELU adds the bias where there
 * is one, keeps that sum in aux and writes its GELU to D; LT_DGELU multiplies the product by GELU's derivative at
 * aux. aux has the shape and leading dimension of D. Returns false, having done nothing, where the library offers
 * no such product (the caller then runs the plain product and its own kernels): the option off, an aux leading
 * dimension that is not a multiple of 8 (cuBLASLt's rule), a bias or aux buffer under 16-byte alignment (which
 * some library versions mishandle; said once per kind on stderr, since it should not happen: the parameter table
 * aligns every bias, nn/params.h, and the blocks carve activations at 64-byte boundaries, nn/block.c), or no
 * algorithm from the heuristic for this GPU, precision and shape (said once per kind on stderr). The heuristic is
 * asked once per problem (LtPlan; its query is the profile's part cublaslt_heuristic). A product the heuristic
 * offered and the matmul then refuses is a bug here: it stops the program. */
static bool lt_matmul(int kind, cublasOperation_t ta, int m, int n, int k, const act_t *A, int lda, const act_t *B,
                      int ldb, act_t *D, int ldd, const act_t *bias, act_t *aux) {
    if constexpr (!IS_ENABLED(CONFIG_CUDA_LT_EPILOGUE)) {
        return false;
    } else {
        static cublasLtHandle_t lt;
        static void *workspace;
        static int noted[LT_KINDS];
        if (kind != LT_BIAS && ldd % 8) return false;
        if (alignment_of(bias) < 16 || alignment_of(aux) < 16) { /* the parameter table aligns every bias: a bug */
            if (!noted[kind]) {
                noted[kind] = 1;
                fprintf(stderr, "note: cuBLASLt %s epilogue skipped: its %s is only %u-byte aligned (it wants 16): "
                        "separate kernels do it instead\n", lt_name[kind] + 9, alignment_of(bias) < 16 ? "bias" : "aux",
                        alignment_of(bias) < 16 ? alignment_of(bias) : alignment_of(aux));
            }
            return false;
        }
        LtPlan want = {kind, (int)ta, m, n, k, lda, ldb, ldd, bias != NULL,
                       {alignment_of(A), alignment_of(B), alignment_of(D)}, false, {}};
        const LtPlan *plan = NULL;
        for (int i = 0; i < g_lt_plans_n && !plan; i++)
            if (same_problem(g_lt_plans[i], want)) plan = &g_lt_plans[i];
        if (plan && !plan->offered) return false;
        if (!lt) {
            CUBLAS_CHECK(cublasLtCreate(&lt));
            workspace = dev_alloc(LT_WORKSPACE);
        }
        cublasComputeType_t compute = IS_ENABLED(CONFIG_CUDA_TF32)           ? CUBLAS_COMPUTE_32F_FAST_TF32
                                      : IS_ENABLED(CONFIG_CUDA_BF16_MATMUL) ? CUBLAS_COMPUTE_32F_FAST_16BF
                                                                            : CUBLAS_COMPUTE_32F;
        uint32_t epi = kind == LT_BIAS ? CUBLASLT_EPILOGUE_BIAS
                       : kind == LT_DGELU ? CUBLASLT_EPILOGUE_DGELU
                       : bias             ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS
                                          : CUBLASLT_EPILOGUE_GELU_AUX;
        int32_t op_a = ta, op_b = CUBLAS_OP_N;
        int64_t aux_ld = ldd;
        uint64_t ws = LT_WORKSPACE;
        cublasLtMatmulDesc_t op;
        cublasLtMatrixLayout_t la, lb, ld;
        cublasLtMatmulPreference_t pref;
        CUBLAS_CHECK(cublasLtMatmulDescCreate(&op, compute, CUDA_R_32F));
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof op_a));
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof op_b));
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
        if (bias)
            CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
        if (aux) {
            CUBLAS_CHECK(
                cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux));
            CUBLAS_CHECK(
                cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof aux_ld));
        }
        CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&la, CUDA_R_ACT, ta == CUBLAS_OP_N ? m : k,
                                                ta == CUBLAS_OP_N ? k : m, lda));
        CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_ACT, k, n, ldb));
        CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&ld, CUDA_R_ACT, m, n, ldd));
        if (!plan) { /* a new problem: ask the heuristic, telling it each buffer's alignment (C is D) */
            CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
            CUBLAS_CHECK(
                cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
            const uint32_t al[4] = {want.align[0], want.align[1], want.align[2], want.align[2]};
            for (int i = 0; i < 4; i++)
                CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
                    pref, (cublasLtMatmulPreferenceAttributes_t)(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES + i),
                    &al[i], sizeof al[i]));
            cublasLtMatmulHeuristicResult_t heur;
            int found = 0;
            cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, ld, ld, pref, 1, &heur, &found);
            kprof_part("cublaslt_heuristic");
            cublasLtMatmulPreferenceDestroy(pref);
            want.offered = st == CUBLAS_STATUS_SUCCESS && found == 1 && heur.state == CUBLAS_STATUS_SUCCESS;
            if (want.offered) want.algo = heur.algo;
            if (!want.offered && !noted[kind]) {
                noted[kind] = 1;
                fprintf(stderr, "note: cuBLASLt offers no %s epilogue here (%s, %d x %d x %d): separate kernels do "
                        "it instead\n", lt_name[kind] + 9, st == CUBLAS_STATUS_SUCCESS ? "no algorithm"
                        : cublasGetStatusString(st), m, n, k);
            }
            if (g_lt_plans_n < LT_PLANS) g_lt_plans[g_lt_plans_n++] = want;
            plan = &want;
        }
        if (plan->offered) {
            const float one = 1.0f, zero = 0.0f;
            CUBLAS_CHECK(cublasLtMatmul(lt, op, &one, A, la, B, lb, &zero, D, ld, D, ld, &plan->algo, workspace,
                                        LT_WORKSPACE, kv_stream));
            kprof_part(lt_name[kind]);
        }
        cublasLtMatrixLayoutDestroy(la), cublasLtMatrixLayoutDestroy(lb), cublasLtMatrixLayoutDestroy(ld);
        cublasLtMatmulDescDestroy(op);
        return plan->offered;
    }
}

void linear_forward(act_t *out, const act_t *inp, const float *w, const float *b,
                    int N, int C, int OC) {
    KPROF_OP();
    args_linear("linear_forward", N, C, OC);
    args_distinct("linear_forward", "out and inp", out, inp, NULL);
    cuda_ready();
    /* row-major out (N, OC) = inp W^T is column-major out^T = W^T' inp' with W' the (C, OC) view of W */
    const act_t *wa = weights_as_act(w, (size_t)OC * C);
    if (b && lt_matmul(LT_BIAS, CUBLAS_OP_T, OC, N, C, wa, C, inp, C, out, OC, weights_as_act(b, OC), NULL)) return;
    gemm(CUBLAS_OP_T, CUBLAS_OP_N, OC, N, C, wa, C, inp, C, 0.0f, out, 0, OC);
    if (b) {
        add_bias_kernel<<<cuda_blocks((size_t)N * OC, THREADS), THREADS, 0, kv_stream>>>(out, b, (size_t)N, OC);
        CUDA_LAUNCHED(add_bias);
    }
}

__global__ void bias_grad_partial_kernel(float *partial, const act_t *dout, int N, int OC) {
    int c = blockIdx.x * blockDim.x + threadIdx.x, chunk = blockIdx.y;
    if (c >= OC) return;
    float s = 0.0f;
    int r1 = min(N, (chunk + 1) * COLSUM_ROWS);
    for (int r = chunk * COLSUM_ROWS; r < r1; r++) s += act_ld(dout[(size_t)r * OC + c]);
    partial[(size_t)chunk * OC + c] = s;
}

void linear_backward(act_t *dinp, float *dw, float *db, const act_t *dout, const act_t *inp,
                     const float *w, int N, int C, int OC) {
    KPROF_OP();
    args_linear("linear_backward", N, C, OC);
    cuda_ready();
    /* dinp (N, C) += dout W: column-major dinp' = W' dout' */
    if (dinp)
        gemm(CUBLAS_OP_N, CUBLAS_OP_N, C, N, OC, weights_as_act(w, (size_t)OC * C), C, dout, OC, 1.0f, dinp, 0, C);
    /* dW (OC, C) += dout^T inp: column-major dW' = inp' dout'^T, into the float32 gradient */
    if (dw) gemm(CUBLAS_OP_N, CUBLAS_OP_T, C, OC, N, inp, C, dout, OC, 1.0f, dw, 1, C);
    if (db) {
        int chunks = (N + COLSUM_ROWS - 1) / COLSUM_ROWS;
        float *part = cuda_scratch(&g_partial, &g_partial_cap, (size_t)chunks * OC);
        bias_grad_partial_kernel<<<dim3(cuda_blocks(OC, 128), chunks), 128, 0, kv_stream>>>(part, dout, N, OC);
        CUDA_LAUNCHED(bias_grad_partial);
        colsum_finish_kernel<<<cuda_blocks(OC, 128), 128, 0, kv_stream>>>(db, part, chunks, (size_t)OC, 0, OC);
        CUDA_LAUNCHED(colsum_finish);
    }
}

/* ------------------------------------------------------------------ activations */

#define GELU_K 0.7978845608028654f /* sqrt(2/pi) */

__global__ void gelu_forward_kernel(act_t *out, const act_t *inp, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float x = act_ld(inp[i]);
    float u = GELU_K * (x + 0.044715f * x * x * x);
    out[i] = act_st(0.5f * x * (1.0f + tanhf(u)));
}

/* GELU's derivative at x */
__device__ float gelu_grad(float x) {
    float u = GELU_K * (x + 0.044715f * x * x * x);
    float th = tanhf(u);
    float du = GELU_K * (1.0f + 3.0f * 0.044715f * x * x);
    return 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * du;
}

__global__ void gelu_backward_kernel(act_t *dinp, const act_t *inp, const act_t *dout, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dinp[i] = act_st(act_ld(dinp[i]) + gelu_grad(act_ld(inp[i])) * act_ld(dout[i]));
}

/* d = gelu'(pre) * d, in place */
__global__ void gelu_grad_scale_kernel(act_t *d, const act_t *pre, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) d[i] = act_st(0.0f + gelu_grad(act_ld(pre[i])) * act_ld(d[i]));
}

__global__ void relu_forward_kernel(act_t *out, const act_t *inp, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = act_st(act_ld(inp[i]) > 0.0f ? act_ld(inp[i]) : 0.0f);
}

__global__ void relu_backward_kernel(act_t *dinp, const act_t *inp, const act_t *dout, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dinp[i] = act_st(act_ld(dinp[i]) + (act_ld(inp[i]) > 0.0f ? act_ld(dout[i]) : 0.0f));
}

__global__ void residual_kernel(act_t *out, const act_t *a, const act_t *b, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = act_st(act_ld(a[i]) + act_ld(b[i]));
}

#define ELEMENTWISE(kernel, n, ...)                                                          \
    do {                                                                                     \
        if ((n) == 0) break;                                                                 \
        kernel<<<cuda_blocks((n), THREADS), THREADS, 0, kv_stream>>>(__VA_ARGS__, (n));      \
        CUDA_LAUNCHED(kernel);                                                               \
    } while (0)

void gelu_forward(act_t *out, const act_t *inp, size_t n) {
    KPROF_OP();
    ELEMENTWISE(gelu_forward_kernel, n, out, inp);
}
void gelu_backward(act_t *dinp, const act_t *inp, const act_t *dout, size_t n) {
    KPROF_OP();
    ELEMENTWISE(gelu_backward_kernel, n, dinp, inp, dout);
}
void relu_forward(act_t *out, const act_t *inp, size_t n) {
    KPROF_OP();
    ELEMENTWISE(relu_forward_kernel, n, out, inp);
}

void relu_backward(act_t *dinp, const act_t *inp, const act_t *dout, size_t n) {
    KPROF_OP();
    ELEMENTWISE(relu_backward_kernel, n, dinp, inp, dout);
}
/* The bias and the GELU in the product's epilogue (cuBLASLt: GELU_AUX_BIAS writes the pre-activation to aux and
 * its GELU to the output); otherwise linear_forward then the GELU kernel. */
void linear_gelu_forward(act_t *pre, act_t *out, const act_t *inp, const float *w, const float *b, int N, int C,
                         int OC) {
    KPROF_OP();
    args_linear("linear_gelu_forward", N, C, OC);
    args_distinct("linear_gelu_forward", "pre, out and inp", pre, out, inp);
    cuda_ready();
    if (lt_matmul(LT_GELU, CUBLAS_OP_T, OC, N, C, weights_as_act(w, (size_t)OC * C), C, inp, C, out, OC,
                  b ? weights_as_act(b, OC) : NULL, pre))
        return;
    linear_forward(pre, inp, w, b, N, C, OC);
    ELEMENTWISE(gelu_forward_kernel, (size_t)N * OC, out, pre);
}

/* dpre = gelu'(pre) * (dout W) in the product's epilogue (cuBLASLt: DGELU reads pre as its aux matrix); otherwise
 * the product into dpre, then a kernel scaling it in place. The weight and bias gradients as in linear_backward. */
void gelu_linear_backward(act_t *dpre, float *dw, float *db, const act_t *dout, const act_t *act, const act_t *pre,
                          const float *w, int N, int C, int OC) {
    KPROF_OP();
    args_gelu_linear(dpre, act, dout, pre, N, C, OC);
    cuda_ready();
    linear_backward(NULL, dw, db, dout, act, w, N, C, OC);
    /* column-major dpre' (C x N) = W' dout', W' the (C, OC) view of W */
    const act_t *wa = weights_as_act(w, (size_t)OC * C);
    if (lt_matmul(LT_DGELU, CUBLAS_OP_N, C, N, OC, wa, C, dout, OC, dpre, C, NULL, (act_t *)pre)) return;
    gemm(CUBLAS_OP_N, CUBLAS_OP_N, C, N, OC, wa, C, dout, OC, 0.0f, dpre, 0, C);
    ELEMENTWISE(gelu_grad_scale_kernel, (size_t)N * C, dpre, pre);
}

void residual_forward(act_t *out, const act_t *a, const act_t *b, size_t n) {
    KPROF_OP();
    ELEMENTWISE(residual_kernel, n, out, a, b);
}

/* ------------------------------------------------------------------ dropout */

__global__ void dropout_kernel(act_t *out, const act_t *inp, size_t off, uint32_t thr, float scale, uint64_t seed,
                               int accumulate, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = dropout_keep(seed, off + i, thr) ? act_ld(inp[i]) * scale : 0.0f;
    out[i] = act_st(accumulate ? act_ld(out[i]) + v : v);
}

void dropout_forward(act_t *out, const act_t *inp, size_t n, float p, uint64_t seed) {
    KPROF_OP();
    uint32_t thr = dropout_threshold(p, "dropout_forward");
    size_t off = dropout_batch_offset(n, "dropout_forward");
    ELEMENTWISE(dropout_kernel, n, out, inp, off, thr, 1.0f / (1.0f - p), seed, 0);
}

void dropout_backward(act_t *dinp, const act_t *dout, size_t n, float p, uint64_t seed) {
    KPROF_OP();
    uint32_t thr = dropout_threshold(p, "dropout_backward");
    size_t off = dropout_batch_offset(n, "dropout_backward");
    ELEMENTWISE(dropout_kernel, n, dinp, dout, off, thr, 1.0f / (1.0f - p), seed, 1);
}

/* ------------------------------------------------------------------ cross-entropy */

/* The cross-entropy kernels read and write a row's logits W at a time: ACT_VEC where the rows allow
 * (act_vec_width: a vocabulary padded to a multiple of 8 or more, as GPT2_VOCAB_MULTIPLE gives), one otherwise. */

/* one block per row; the logits (the largest activation, B T x V) are read once: each thread keeps an online
 * softmax (its max m and sum s of exp(x - m), rescaled when the max grows), then the block combines them at its
 * max. With the backward's read and write, the loss costs two reads and a write of the logits, as a classifier
 * fusing forward and backward would. */
template <int W>
__global__ void crossentropy_forward_kernel(float *losses, float *lse, const act_t *logits, const int *targets,
                                            int V, int ignore_index, float smoothing) {
    int i = blockIdx.x;
    const act_t *x = logits + (size_t)i * V;
    float m = -INFINITY, s = 0.0f, sx = 0.0f;
    for (int j = threadIdx.x * W; j < V; j += blockDim.x * W) {
        ActVec<act_t, W> xv = mem_as<ActVec<act_t, W>>(x + j);
        for (int e = 0; e < W; e++) {
            float v = act_ld(xv.v[e]);
            sx += v;
            if (v > m) {
                s = s * expf(m - v) + 1.0f;
                m = v;
            } else if (m != -INFINITY) {
                s += expf(v - m);
            }
        }
    }
    float mx = block_max(m);
    s = block_sum(m == -INFINITY ? 0.0f : s * expf(m - mx));
    sx = block_sum(sx);
    if (threadIdx.x == 0) {
        float l = mx + logf(s);
        lse[i] = l;
        int t = targets[i]; /* outside [0, V): read nothing, the queued check stops the program */
        float xt = t >= 0 && t < V ? act_ld(x[t]) : NAN;
        losses[i] = t == ignore_index ? 0.0f : l - (1.0f - smoothing) * xt - smoothing * sx / V;
    }
}

void crossentropy_forward(float *losses, float *lse, const act_t *logits, const int *targets,
                          int N, int V, int ignore_index, float smoothing) {
    KPROF_OP();
    args_classes("crossentropy_forward", N, V, smoothing);
    check_ids("crossentropy_forward", IDS_TARGETS, targets, N, V, 1, ignore_index);
    if (act_vec_width(V, logits) > 1)
        crossentropy_forward_kernel<ACT_VEC><<<N, row_threads(V, ACT_VEC), 0, kv_stream>>>(
            losses, lse, logits, targets, V, ignore_index, smoothing);
    else
        crossentropy_forward_kernel<1><<<N, row_threads(V, 1), 0, kv_stream>>>(losses, lse, logits, targets, V,
                                                                               ignore_index, smoothing);
    CUDA_LAUNCHED(crossentropy_forward);
}

template <int W>
__global__ void crossentropy_backward_kernel(act_t *dlogits, const act_t *logits, const float *lse,
                                             const int *targets, int V, int ignore_index, float smoothing,
                                             float scale) {
    typedef ActVec<act_t, W> Vec;
    int i = blockIdx.x;
    const act_t *x = logits + (size_t)i * V;
    act_t *d = dlogits + (size_t)i * V;
    int t = targets[i];
    int inplace = d == x;
    if (t == ignore_index) {
        if (inplace) {
            Vec z;
            for (int e = 0; e < W; e++) z.v[e] = act_st(0.0f);
            for (int j = threadIdx.x * W; j < V; j += blockDim.x * W) mem_put<Vec>(d + j, z);
        }
        return;
    }
    float l = lse[i], off = smoothing / V;
    for (int j = threadIdx.x * W; j < V; j += blockDim.x * W) {
        Vec xv = mem_as<Vec>(x + j), dv = inplace ? xv : mem_as<Vec>(d + j);
        for (int e = 0; e < W; e++) {
            float g = (expf(act_ld(xv.v[e]) - l) - off) * scale - (j + e == t ? (1.0f - smoothing) * scale : 0.0f);
            dv.v[e] = act_st(inplace ? g : act_ld(dv.v[e]) + g);
        }
        mem_put<Vec>(d + j, dv);
    }
}

void crossentropy_backward(act_t *dlogits, const act_t *logits, const float *lse,
                           const int *targets, int N, int V, int ignore_index,
                           float smoothing, float scale) {
    KPROF_OP();
    args_classes("crossentropy_backward", N, V, smoothing);
    if (act_vec_width(V, logits, dlogits) > 1)
        crossentropy_backward_kernel<ACT_VEC><<<N, row_threads(V, ACT_VEC), 0, kv_stream>>>(
            dlogits, logits, lse, targets, V, ignore_index, smoothing, scale);
    else
        crossentropy_backward_kernel<1><<<N, row_threads(V, 1), 0, kv_stream>>>(dlogits, logits, lse, targets, V,
                                                                                ignore_index, smoothing, scale);
    CUDA_LAUNCHED(crossentropy_backward);
}

/* one block per row: the first index of the maximum, as the CPU loop finds it */
__global__ void argmax_kernel(double *correct, const act_t *logits, const int *targets, int V, int ignore_index) {
    int i = blockIdx.x;
    int t = targets[i];
    if (t == ignore_index) return;
    const act_t *x = logits + (size_t)i * V;
    float best = -INFINITY;
    int bi = INT_MAX;
    for (int j = threadIdx.x; j < V; j += blockDim.x)
        if (act_ld(x[j]) > best || bi == INT_MAX) {
            best = act_ld(x[j]);
            bi = j;
        }
    __shared__ float sv[THREADS];
    __shared__ int si[THREADS];
    sv[threadIdx.x] = best;
    si[threadIdx.x] = bi;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) { /* a power of two (row_threads) */
        if (threadIdx.x < s) {
            float v2 = sv[threadIdx.x + s];
            int i2 = si[threadIdx.x + s];
            if (i2 != INT_MAX && (v2 > sv[threadIdx.x] || (v2 == sv[threadIdx.x] && i2 < si[threadIdx.x]) ||
                                  si[threadIdx.x] == INT_MAX)) {
                sv[threadIdx.x] = v2;
                si[threadIdx.x] = i2;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0 && si[0] == t) atomicAdd(correct, 1.0); /* whole numbers: exact in any order */
}

void argmax_correct_into(double *acc, const act_t *logits, const int *targets, int N, int V, int ignore_index) {
    KPROF_OP();
    args_classes("argmax_correct", N, V, 0.0f);
    argmax_kernel<<<N, row_threads(V, 1), 0, kv_stream>>>(acc, logits, targets, V, ignore_index);
    CUDA_LAUNCHED(argmax);
}

/* one block, in a fixed order: a step's losses (B T values) are few */
__global__ void sum_into_kernel(double *acc, const float *x, size_t n, double scale) {
    double s = 0.0;
    for (size_t i = threadIdx.x; i < n; i += THREADS) s += x[i];
    s = block_sum(s);
    if (threadIdx.x == 0) *acc += scale * s;
}

void sum_into(double *acc, const float *x, size_t n, double scale) {
    KPROF_OP();
    if (!n) return;
    sum_into_kernel<<<1, THREADS, 0, kv_stream>>>(acc, x, n, scale);
    CUDA_LAUNCHED(sum_into);
}

/* ------------------------------------------------------------------ optimiser */

/* adamw_spans_kernel (ops_kernels.cuh): one launch per ADAMW_BATCH tensors, the table a kernel parameter */
void adamw_update_spans(float *param, const float *grad, float *m, float *v, const AdamwSpan *spans, int nspans,
                        float lr, float beta1, float beta2, float eps, int t) {
    KPROF_OP();
    args_adamw(t);
    float bc1 = 1.0f - powf(beta1, (float)t), bc2 = 1.0f - powf(beta2, (float)t);
    for (int k = 0; k < nspans; k++) cuda_float_written(param + spans[k].offset, spans[k].n * sizeof(float));
    AdamwBatch batch;
    int next = 0;
    for (unsigned blocks; (blocks = adamw_next_batch(&batch, spans, nspans, &next)) > 0;) {
        adamw_spans_kernel<<<blocks, ADAMW_THREADS, 0, kv_stream>>>(param, grad, m, v, batch, lr, beta1, beta2, eps,
                                                                    bc1, bc2);
        CUDA_LAUNCHED(adamw_spans);
    }
}

#define NORM_BLOCKS 1024

/* sum of squares in double: a grid of partial sums (as many blocks as the data fills, NORM_BLOCKS at most; the grid
 * depends on n alone, so a run repeats bit for bit), then one block adds them in order */
__global__ void sumsq_partial_kernel(double *partial, const float *x, size_t n) {
    double s = 0.0;
    for (size_t i = (size_t)blockIdx.x * THREADS + threadIdx.x; i < n; i += (size_t)gridDim.x * THREADS)
        s += (double)x[i] * x[i];
    s = block_sum(s);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

/* the partials in order: their sum, or (root) its square root */
__global__ void sum_of_partials_kernel(double *out, const double *partial, unsigned nblocks, int root) {
    double s = 0.0;
    for (unsigned i = threadIdx.x; i < nblocks; i += THREADS) s += partial[i];
    s = block_sum(s);
    if (threadIdx.x == 0) *out = root ? sqrt(s) : s;
}

/* a norm from a sum of squares summed elsewhere (over the ranks); in place where norm is sumsq */
__global__ void root_kernel(double *norm, const double *sumsq) {
    if (threadIdx.x == 0) *norm = sqrt(*sumsq);
}

/* the clipping decision read from the device: the host never sees the norm */
__global__ void clip_kernel(float *x, size_t n, const double *norm, double max_norm) {
    double nv = *norm;
    if (!(nv > max_norm)) return;
    float s = (float)(max_norm / (nv + 1e-6));
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        x[i] *= s;
}

__global__ void scale_kernel(float *x, float s, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= s;
}

void scale_inplace(float *x, size_t n, float s) {
    KPROF_OP();
    cuda_float_written(x, n * sizeof(float));
    ELEMENTWISE(scale_kernel, n, x, s);
}

/* *out := the sum of the squares of grad's n values, or (root) its square root: partial sums per block, then the
 * partials in one block, in a fixed order (the same result every run) */
static void sumsq_launch(double *out, const float *grad, size_t n, int root) {
    static double *partial;
    if (!partial) partial = (double *)dev_alloc(NORM_BLOCKS * sizeof(double));
    unsigned blocks = (unsigned)std::min<size_t>(NORM_BLOCKS, std::max<size_t>(1, (n + THREADS - 1) / THREADS));
    sumsq_partial_kernel<<<blocks, THREADS, 0, kv_stream>>>(partial, grad, n);
    CUDA_LAUNCHED(sumsq_partial);
    sum_of_partials_kernel<<<1, THREADS, 0, kv_stream>>>(out, partial, blocks, root);
    CUDA_LAUNCHED(sum_of_partials);
}

/* grad scaled by max_norm / (*norm + 1e-6) where *norm > max_norm; nothing with max_norm 0 */
static void clip_launch(float *grad, size_t n, double max_norm, const double *norm) {
    if (!(max_norm > 0)) return;
    cuda_float_written(grad, n * sizeof(float));
    unsigned cb = (unsigned)std::min<size_t>(4096, std::max<size_t>(1, (n + THREADS - 1) / THREADS));
    clip_kernel<<<cb, THREADS, 0, kv_stream>>>(grad, n, norm, max_norm);
    CUDA_LAUNCHED(clip);
}

void clip_grad_norm_into(float *grad, size_t n, double max_norm, double *norm) {
    KPROF_OP();
    args_clip("clip_grad_norm_into", max_norm);
    sumsq_launch(norm, grad, n, 1);
    clip_launch(grad, n, max_norm, norm);
}

void grad_sumsq_into(const float *grad, size_t n, double *sumsq) {
    KPROF_OP();
    sumsq_launch(sumsq, grad, n, 0);
}

void clip_grad_sumsq_into(float *grad, size_t n, double max_norm, const double *sumsq, double *norm) {
    KPROF_OP();
    args_clip("clip_grad_sumsq_into", max_norm);
    root_kernel<<<1, 32, 0, kv_stream>>>(norm, sumsq);
    CUDA_LAUNCHED(root);
    clip_launch(grad, n, max_norm, norm);
}
