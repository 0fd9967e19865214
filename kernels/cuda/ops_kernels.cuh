/* Kernels of the non-attention ops (ops.cu launches them) that are kept in a
 * header so that tests/test_cuda_emu.cpp runs these very kernels on the CPU
 * under tests/cuda_emu.h. They use only what the emulation models: dynamic
 * shared memory (extern __shared__), __syncthreads, warp shuffles and votes. (The
 * other kernels of ops.cu use static __shared__ arrays in device functions,
 * which the emulation does not model; the GPU tests cover them.) */
#ifndef KVLAB_OPS_KERNELS_CUH
#define KVLAB_OPS_KERNELS_CUH

#include "act.cuh"
#include "warp.cuh"

/* ------------------------------------------------------------------ layernorm forward */

/* One warp per row: out = (x - mean) rstd w + b, mean and rstd saved. x is the row of inp, or with res given
 * the residual add inp + inp2, written to res on the way (each lane reads back only what it wrote), so that
 * residual_layernorm_forward is this kernel and gives layernorm_forward's values bit for bit, where both take the
 * same width: a lane takes W consecutive values at a time (act_vec_width, cuda.cuh), and W sets the order of the row's sums (the
 * blocks carve every activation 16-byte aligned, nn/block.c, so both take 16 bytes where C allows). */
template <typename A, int W>
__global__ void layernorm_forward_kernel(A *out, float *mean, float *rstd, A *res, const A *inp, const A *inp2,
                                         const float *w, const float *b, int N, int C) {
    typedef ActVec<A, W> Vec;
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= N) return;
    const A *x = inp + (size_t)row * C;
    float s = 0.0f;
    if (res) { /* the sum as stored (rounded to A), which is what the layernorm of it reads */
        const A *y = inp2 + (size_t)row * C;
        A *r = res + (size_t)row * C;
        for (int c = lane * W; c < C; c += 32 * W) {
            Vec xv = mem_as<Vec>(x + c), yv = mem_as<Vec>(y + c), rv;
            for (int e = 0; e < W; e++) {
                rv.v[e] = act_as<A>(act_ld(xv.v[e]) + act_ld(yv.v[e]));
                s += act_ld(rv.v[e]);
            }
            mem_put<Vec>(r + c, rv);
        }
        x = r;
    } else {
        for (int c = lane * W; c < C; c += 32 * W) {
            Vec xv = mem_as<Vec>(x + c);
            for (int e = 0; e < W; e++) s += act_ld(xv.v[e]);
        }
    }
    float m = warp_sum(s) / C;
    float v = 0.0f;
    for (int c = lane * W; c < C; c += 32 * W) {
        Vec xv = mem_as<Vec>(x + c);
        for (int e = 0; e < W; e++) v += (act_ld(xv.v[e]) - m) * (act_ld(xv.v[e]) - m);
    }
    v = warp_sum(v) / C;
    float rs = 1.0f / sqrtf(v + 1e-5f);
    A *o = out + (size_t)row * C;
    for (int c = lane * W; c < C; c += 32 * W) {
        Vec xv = mem_as<Vec>(x + c), ov;
        for (int e = 0; e < W; e++)
            ov.v[e] = act_as<A>((act_ld(xv.v[e]) - m) * rs * w[c + e] + (b ? b[c + e] : 0.0f));
        mem_put<Vec>(o + c, ov);
    }
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = rs;
    }
}

/* ------------------------------------------------------------------ embedding backward (token table) */

#define EMB_THREADS 256   /* positions per chunk, channels per pass */
#define EMB_BUCKETS 1024  /* blocks: block b owns the tokens t with t % buckets == b */

/* Shared memory of embedding_backward_wte_kernel: a chunk's own positions and tokens, the per-warp counts. */
static inline size_t emb_smem_bytes(void) { return (2 * EMB_THREADS + EMB_THREADS / 32) * sizeof(int); }

/* dwte[t] += scale * dout[i] for every position i with token t in [0, V) (others add nothing). Tokens repeat, so rows of dwte get several
 * updates; floating-point atomics would make the sum's order (and its last bits) change from run to run. Here
 * each block owns the rows of the tokens in its bucket, so no two blocks touch one row, and walks the positions
 * in chunks of EMB_THREADS: a warp vote lists the chunk's positions whose token is the block's, in increasing
 * order, and the block adds their rows one after the other, a thread per channel. Every row of dwte so gets its
 * updates in increasing position order, the order of the CPU backend's loop. The cost is one read of the token
 * ids per block (from L2) against the old kernel's one thread per channel walking all B*T positions in turn. */
template <typename A>
__global__ void __launch_bounds__(EMB_THREADS)
    embedding_backward_wte_kernel(float *__restrict__ dwte, const A *__restrict__ dout,
                                  const int *__restrict__ tokens, int BT, int C, int V, float scale, int buckets) {
    extern __shared__ float sm[];
    int *own = (int *)sm;                      /* the chunk's positions in this block's bucket, in order */
    int *own_tok = own + EMB_THREADS;          /* and their tokens */
    int *warp_count = own_tok + EMB_THREADS;   /* how many each warp found */
    int lane = threadIdx.x % 32, w = threadIdx.x / 32;
    for (int start = 0; start < BT; start += EMB_THREADS) {
        int i = start + (int)threadIdx.x;
        int t = i < BT ? tokens[i] : -1;
        bool mine = t >= 0 && t < V && t % buckets == (int)blockIdx.x;
        unsigned vote = __ballot_sync(0xffffffffu, mine);
        if (lane == 0) warp_count[w] = __popc(vote);
        __syncthreads();
        int before = 0, n = 0;
        for (int k = 0; k < EMB_THREADS / 32; k++) {
            if (k < w) before += warp_count[k];
            n += warp_count[k];
        }
        if (mine) {
            int at = before + __popc(vote & ((1u << lane) - 1u));
            own[at] = i;
            own_tok[at] = t;
        }
        __syncthreads();
        for (int k = 0; k < n; k++) {
            float *e = dwte + (size_t)own_tok[k] * C;
            const A *d = dout + (size_t)own[k] * C;
            for (int c = (int)threadIdx.x; c < C; c += EMB_THREADS) e[c] += scale * act_ld(d[c]);
        }
        /* no barrier here: the next chunk writes warp_count before its first __syncthreads, but every read of
         * it in this chunk came before the barrier above, which all threads have passed; own and own_tok it
         * writes only after that first __syncthreads, which every thread reaches after its reads of this
         * chunk's */
    }
}

/* ------------------------------------------------------------------ AdamW over many tensors */

#define ADAMW_BATCH 96      /* spans per launch: the table travels as a kernel parameter, under 4 KiB */
#define ADAMW_CHUNK 4096    /* values per block */
#define ADAMW_THREADS 256

/* One launch's spans: span k's values are blocks first_block[k] .. first_block[k + 1] - 1, ADAMW_CHUNK each. */
struct AdamwBatch {
    int n;
    unsigned first_block[ADAMW_BATCH + 1];
    AdamwSpan span[ADAMW_BATCH];
};
static_assert(sizeof(AdamwBatch) <= 4000, "a kernel's parameters must stay under 4 KiB: lower ADAMW_BATCH");

/* Fills b with the next non-empty spans from spans[*next] on, at most ADAMW_BATCH, and moves *next past them;
 * returns the blocks of the launch, 0 when no values are left. */
static inline unsigned adamw_next_batch(AdamwBatch *b, const AdamwSpan *spans, int nspans, int *next) {
    b->n = 0;
    b->first_block[0] = 0;
    for (; *next < nspans && b->n < ADAMW_BATCH; ++*next) {
        const AdamwSpan *s = &spans[*next];
        if (!s->n) continue;
        b->span[b->n] = *s;
        b->first_block[b->n + 1] = b->first_block[b->n] + (unsigned)((s->n + ADAMW_CHUNK - 1) / ADAMW_CHUNK);
        b->n++;
    }
    return b->first_block[b->n];
}

/* adamw_update_spans for one batch: each block finds its span (the last whose first block is at or before it)
 * and updates its chunk with adamw_value, the arithmetic of every backend. */
__global__ void __launch_bounds__(ADAMW_THREADS)
    adamw_spans_kernel(float *__restrict__ param, const float *__restrict__ grad, float *__restrict__ m,
                       float *__restrict__ v, const AdamwBatch batch, float lr, float beta1, float beta2, float eps,
                       float bc1, float bc2) {
    int lo = 0, hi = batch.n - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (batch.first_block[mid] <= blockIdx.x)
            lo = mid;
        else
            hi = mid - 1;
    }
    const AdamwSpan s = batch.span[lo];
    size_t begin = (size_t)(blockIdx.x - batch.first_block[lo]) * ADAMW_CHUNK;
    size_t end = begin + ADAMW_CHUNK < s.n ? begin + ADAMW_CHUNK : s.n;
    for (size_t i = begin + threadIdx.x; i < end; i += ADAMW_THREADS) {
        size_t p = s.offset + i, q = s.state_offset + i;
        adamw_value(&param[p], &m[q], &v[q], grad[p], lr, beta1, beta2, eps, s.weight_decay, bc1, bc2);
    }
}

#endif
