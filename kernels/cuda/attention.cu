/* CUDA attention: every variant through one set of fused kernels, as the CPU
 * backend (kernels/cpu/attention.c, the reference) runs them through one code
 * path. docs/cuda.md describes the kernels.
 *
 *  1. roles: the kernels read the query, key and value rows in the
 *     projection itself, at any row stride (AttnRows); under RoPE the roles
 *     are first copied into head-major buffers (B, heads, T, hd), the query
 *     and key rotated, "pack" (place_roles). They read the roles, the output
 *     and its gradient in the activations' type (AttnIO).
 *  2. forward: one block per (batch, query head, 32 query rows) walks the keys
 *     in tiles of 32 held in shared memory with an online softmax (running
 *     max and sum), so the T x T scores never reach GPU memory; it writes the
 *     output and the row log-sum-exp.
 *  3. backward: the probabilities are recomputed from the log-sum-exp twice,
 *     once per query row block (dQ and the +Pos row sums), once per key
 *     column block (dK, dV and the +Pos column sums), so each gradient value
 *     has one writer and no floating-point atomics are needed: a run repeats
 *     bit for bit. A K/V head's block walks its query heads in order (grouped
 *     heads). The relative-bias gradient sums each diagonal in one warp.
 *  4. gradients: the backward kernels add each role's gradient into its rows
 *     of the projection's gradient, roles that share a block in turn (query,
 *     key, value). Under RoPE they write packed float32 instead, and
 *     "unpack_add" rotates it back and adds it.
 *
 * With a tensor-core precision steps 2 and 3 run as the tensor-core kernels,
 * the same per-score code around WMMA products: TF32 with CUDA_TF32, bf16
 * (operand tiles stored as bf16) with CUDA_BF16_MATMUL. bf16's forward and
 * backward keep the scores in registers instead (mma.sync, mma.cuh), the
 * symmetric backward too, unless attention_set_mma_path(0). Both sets of
 * kernels are in attention_kernels.cuh.
 *
 * Order of operations per score, as on the CPU: rotation, scale, +Pos,
 * position bias, masks, softmax, dropout (the same hash of the same global
 * index as the CPU backend, so the masks agree), times values. */
#include <cmath>
#include <cstring>

#include <cuda_bf16.h>
#include <mma.h>
#include <type_traits>

#include "cuda.cuh"
#include "attention_kernels.cuh"

/* The symmetric backward of KV and K (each pair's score once, attention_kernels.cuh dkv_kernel, tc_dkv_kernel and
 * mma_dkv_kernel with SYM) runs where attention_symmetric_path() (kernels/attention.c) says, on unless a test or
 * benchmark turns it off to compare with the general path. The forward pass has none: each block of query rows
 * keeps its rows' online softmax, which needs every score of those rows. bf16's kernels with the scores in
 * registers run where attention_mma_path() says, WMMA's otherwise (attention.h). */

/* ------------------------------------------------------------------ pack and unpack */

/* Pack and unpack move ACT_VEC values a thread (16 bytes of activations: eight bf16 or four floats) where the
 * head dim, the strides and the buffers allow, one otherwise; and index with 32 bits where the count fits (I),
 * since a 64-bit division costs a GPU dozens of instructions, and these kernels' work is a few per value. */
template <int W> using PackVec = ActVec<act_t, W>;

/* The head-major position of thread idx (values d .. d + W - 1 of packed row r), and row r's (b, hh, t). */
template <typename I> struct PackPos {
    I r;
    int d, t, hh, b;
};
template <int W, typename I> __device__ __forceinline__ PackPos<I> pack_pos(I idx, int T, int heads, int hd) {
    I per = (I)(hd / W), r = idx / per;
    I rt = r / (I)T;
    return {r, (int)(idx - r * per) * W, (int)(r - rt * (I)T), (int)(rt % (I)heads), (int)(rt / (I)heads)};
}

/* dst (B, heads, T, hd) = head-major copy of src rows (row stride ld, batch stride bstride), rotated by the RoPE
 * table (T rows of hd/2 (cos, sin) pairs) when rope is given (and then rounded to the activations' type); n: the
 * threads' count, (B heads T hd) / W. */
template <int W, typename I>
__global__ void pack_kernel(act_t *dst, const act_t *src, int ld, size_t bstride, I n, int T, int heads, int hd,
                            const float *rope) {
    I idx = (I)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n) return;
    PackPos<I> q = pack_pos<W>(idx, T, heads, hd);
    const act_t *x = src + (size_t)q.b * bstride + (size_t)q.t * ld + (size_t)q.hh * hd; /* the source row */
    PackVec<W> v = mem_as<PackVec<W>>(x + q.d);
    if (rope)
        for (int e = 0; e < W; e++) {
            int d = q.d + e, k = d / 2;
            float c = rope[(size_t)q.t * hd + 2 * k], s = rope[(size_t)q.t * hd + 2 * k + 1];
            float x0 = act_ld(x[2 * k]), x1 = act_ld(x[2 * k + 1]);
            v.v[e] = act_st(d % 2 == 0 ? c * x0 - s * x1 : s * x0 + c * x1);
        }
    mem_put<PackVec<W>>(dst + (size_t)q.r * hd + q.d, v);
}

/* dst rows += src (packed float), rotated back (R^T) when rope is given. */
template <int W, typename I>
__global__ void unpack_add_kernel(act_t *dst, int ld, size_t bstride, const float *src, I n, int T, int heads,
                                  int hd, const float *rope) {
    I idx = (I)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n) return;
    PackPos<I> q = pack_pos<W>(idx, T, heads, hd);
    act_t *y = dst + (size_t)q.b * bstride + (size_t)q.t * ld + (size_t)q.hh * hd + q.d;
    const float *x = src + (size_t)q.r * hd; /* the packed row */
    float g[W];
    if (rope) {
        for (int e = 0; e < W; e++) {
            int d = q.d + e, k = d / 2;
            float c = rope[(size_t)q.t * hd + 2 * k], s = rope[(size_t)q.t * hd + 2 * k + 1];
            float x0 = x[2 * k], x1 = x[2 * k + 1];
            g[e] = d % 2 == 0 ? c * x0 + s * x1 : -s * x0 + c * x1;
        }
    } else if constexpr (W % 4 == 0) { /* W floats 16-byte aligned: hd and q.d are multiples of W */
        for (int e = 0; e < W; e += 4) {
            float4 f = mem_as<float4>(x + q.d + e);
            g[e] = f.x, g[e + 1] = f.y, g[e + 2] = f.z, g[e + 3] = f.w;
        }
    } else {
        for (int e = 0; e < W; e++) g[e] = x[q.d + e];
    }
    PackVec<W> v = mem_as<PackVec<W>>(y);
    for (int e = 0; e < W; e++) v.v[e] = act_st(act_ld(v.v[e]) + g[e]);
    mem_put<PackVec<W>>(y, v);
}

/* Values a thread for rows of hd values at rows (row stride ld, batch stride bstride) and a packed buffer at
 * packed: ACT_VEC where every row starts on a 16-byte boundary (the strides multiples of it too), else 1. */
static int pack_width(const void *rows, int ld, size_t bstride, int hd, const void *packed) {
    int w = act_vec_width(hd, rows, packed);
    return ld % w == 0 && bstride % w == 0 ? w : 1;
}

/* KERNEL<w, I> over n threads of 256: I 32-bit where the grid's thread indices fit */
#define PACK_LAUNCH(KERNEL, w, n, ...)                                                                           \
    do {                                                                                                         \
        unsigned grid_ = cuda_blocks((n), 256);                                                                  \
        if ((size_t)grid_ * 256 <= UINT32_MAX) {                                                                 \
            if ((w) == 1)                                                                                        \
                KERNEL<1, unsigned><<<grid_, 256, 0, kv_stream>>>(__VA_ARGS__);                                  \
            else                                                                                                 \
                KERNEL<ACT_VEC, unsigned><<<grid_, 256, 0, kv_stream>>>(__VA_ARGS__);                           \
        } else if ((w) == 1) {                                                                                   \
            KERNEL<1, size_t><<<grid_, 256, 0, kv_stream>>>(__VA_ARGS__);                                        \
        } else {                                                                                                 \
            KERNEL<ACT_VEC, size_t><<<grid_, 256, 0, kv_stream>>>(__VA_ARGS__);                                 \
        }                                                                                                        \
    } while (0)

static void pack(act_t *dst, const act_t *src, int ld, size_t bstride, int B, int T, int heads, int hd,
                 const float *rope) {
    int w = pack_width(src, ld, bstride, hd, dst);
    size_t n = (size_t)B * heads * T * (hd / w);
    PACK_LAUNCH(pack_kernel, w, n, dst, src, ld, bstride, n, T, heads, hd, rope);
    CUDA_LAUNCHED(pack);
}

static void unpack_add(act_t *dst, int ld, size_t bstride, const float *src, int B, int T, int heads, int hd,
                       const float *rope) {
    int w = pack_width(dst, ld, bstride, hd, src);
    size_t n = (size_t)B * heads * T * (hd / w);
    PACK_LAUNCH(unpack_add_kernel, w, n, dst, ld, bstride, src, n, T, heads, hd, rope);
    CUDA_LAUNCHED(unpack_add);
}

/* racc[bh, d + Tq - 1] = sum over the diagonal j - i = d of G'_ij (relative bias), one warp per diagonal */
__global__ void diag_kernel(AttnIO<act_t> p, const act_t *dout, int o_ld, size_t o_bstride, const float *lse,
                            const float *D, float *racc) {
    size_t w = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x % 32;
    if (w >= (size_t)p.B * p.H * p.pe_nd) return;
    int dd = (int)(w % p.pe_nd), bh = (int)(w / p.pe_nd), b = bh / p.H, h = bh % p.H, g = h / p.group;
    int d = dd - (p.Tq - 1), hd = p.hd;
    float sum = 0.0f;
    for (int i = lane; i < p.Tq; i += 32) {
        int j = i + d;
        if (j < 0 || !visible(p, b, i, j)) continue;
        float li = lse[(size_t)bh * p.Tq + i];
        if (li == -INFINITY) continue;
        const act_t *q = attn_rows(p.Q, p.q, b, h) + (size_t)i * p.q.ld;
        const act_t *k = attn_rows(p.K, p.kv, b, g) + (size_t)j * p.kv.ld;
        const act_t *v = attn_rows(p.V, p.kv, b, g) + (size_t)j * p.kv.ld;
        const act_t *o = dout + (size_t)b * o_bstride + (size_t)i * o_ld + (size_t)h * hd;
        float s = 0.0f, dA = 0.0f;
        for (int c = 0; c < hd; c++) {
            s += act_ld(q[c]) * act_ld(k[c]);
            dA += act_ld(o[c]) * act_ld(v[c]);
        }
        s *= p.scale;
        sum += score_grad(p, b, h, i, j, s, dA, li, D[(size_t)bh * p.Tq + i]).gp;
    }
    sum = warp_sum(sum);
    if (lane == 0) racc[w] = sum;
}

/* drel[h, k] += the diagonals' sums over the batch, for every offset in bucket k (fixed order) */
__global__ void rel_reduce_kernel(float *drel, const float *racc, const int *bucket, int B, int H, int nd,
                                  int buckets) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= H * buckets) return;
    int h = idx / buckets, k = idx % buckets;
    float acc = drel[idx];
    for (int dd = 0; dd < nd; dd++) {
        if (bucket[dd] != k) continue;
        double s = 0.0;
        for (int b = 0; b < B; b++) s += racc[((size_t)b * H + h) * nd + dd];
        acc += (float)s;
    }
    drel[idx] = acc;
}

/* ------------------------------------------------------------------ +Pos */

/* f (groups, T), g (groups, T), alpha (groups), bias (groups) from the weights and the basis */
__global__ void pos_prepare_kernel(float *f, float *g, float *alpha, float *bias, const float *w, const float *b,
                                   const float *feat, int groups, int m, int c, int ci, int T) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= groups * T) return;
    int gi = idx / T, t = idx % T;
    const float *wg = w + (size_t)gi * m, *ft = feat + (size_t)t * c;
    float fi = 0.0f, gj = 0.0f;
    for (int k = 0; k < ci; k++) fi += wg[k] * ft[k];
    for (int k = ci; k < m; k++) gj += wg[k] * ft[k - ci];
    f[idx] = fi;
    g[idx] = gj;
    if (t == 0) {
        float a = 0.0f;
        for (int k = 0; k < m; k++) a += wg[k];
        alpha[gi] = a;
        bias[gi] = b[gi];
    }
}

/* per group: the row sums, G'S sums and column sums over its (batch, head) pairs, in order */
__global__ void pos_gather_kernel(float *rowagg, float *gsagg, float *colagg, const float *rowacc,
                                  const float *colacc, int B, int H, int groups, int Tq, int Tk) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    int Tm = Tq > Tk ? Tq : Tk;
    if (idx >= groups * Tm) return;
    int gi = idx / Tm, t = idx % Tm;
    float r = 0.0f, s = 0.0f, c = 0.0f;
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++) {
            if ((groups == 1 ? 0 : h) != gi) continue;
            size_t bh = (size_t)b * H + h;
            if (t < Tq) {
                s += rowacc[(bh * Tq + t) * 2];
                r += rowacc[(bh * Tq + t) * 2 + 1];
            }
            if (t < Tk) c += colacc[bh * Tk + t];
        }
    if (t < Tq) {
        rowagg[(size_t)gi * Tq + t] = r;
        gsagg[(size_t)gi * Tq + t] = s;
    }
    if (t < Tk) colagg[(size_t)gi * Tk + t] = c;
}

/* dw_k = sum G'S + sum_i feat_k(i) rowsum_i (query channels) or sum_j feat_k(j) colsum_j (key channels);
 * db = sum G'. One block per group. */
__global__ void pos_reduce_kernel(float *dw, float *db, const float *rowagg, const float *gsagg, const float *colagg,
                                  const float *feat, int m, int c, int ci, int Tq, int Tk) {
    int gi = blockIdx.x;
    const float *ra = rowagg + (size_t)gi * Tq, *ga = gsagg + (size_t)gi * Tq, *ca = colagg + (size_t)gi * Tk;
    double gsum = 0.0, rsum = 0.0;
    for (int i = 0; i < Tq; i++) {
        gsum += ga[i];
        rsum += ra[i];
    }
    for (int k = threadIdx.x; k < m; k += blockDim.x) {
        double s = gsum;
        if (k < ci)
            for (int i = 0; i < Tq; i++) s += (double)feat[(size_t)i * c + k] * ra[i];
        else
            for (int j = 0; j < Tk; j++) s += (double)feat[(size_t)j * c + (k - ci)] * ca[j];
        dw[(size_t)gi * m + k] += (float)s;
    }
    if (threadIdx.x == 0) db[gi] += (float)rsum;
}

/* ------------------------------------------------------------------ position bias table */

/* tab (H, 2T-1) at d + T - 1: ALiBi -slope_h |d| (slopes given), or the learned rel[h, bucket(d)] */
__global__ void bias_table_kernel(float *tab, const double *slopes, const float *rel, const int *bucket, int H, int T,
                                  int buckets) {
    int nd = 2 * T - 1;
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= H * nd) return;
    int h = idx / nd, dd = idx % nd, d = dd - (T - 1);
    tab[idx] = slopes ? (float)(-slopes[h] * (d < 0 ? -d : d)) : rel[(size_t)h * buckets + bucket[dd]];
}

/* The host-computed inputs of the table: the ALiBi slopes, or the bucket of each offset d = -(T-1) .. T-1 for the
 * longest sequence T asked for so far. A bucket depends on the offset alone, so a shorter call reads the middle
 * of the same table; the inputs are uploaded again only for a longer sequence or other settings, not for each
 * length a decoder steps through. Causal and bidirectional calls (an encoder-decoder's self-attentions) keep
 * one table each. */
struct BiasInputs {
    int scheme, H, T, buckets, maxd;
    double *slopes;
    int *bucket;
};

static const BiasInputs *bias_inputs(const AttnPos *P, int H, int T, int causal) {
    static BiasInputs cache[2];
    BiasInputs *c = &cache[causal ? 1 : 0];
    int alibi = P->scheme == ATTN_POSITION_ALIBI;
    if (c->slopes || c->bucket) {
        if (c->scheme == P->scheme && c->H == H &&
            (alibi || (c->T >= T && c->buckets == P->rel_buckets && c->maxd == P->rel_max_distance)))
            return c;
        dev_free(c->slopes);
        dev_free(c->bucket);
        c->slopes = NULL;
        c->bucket = NULL;
    }
    c->scheme = P->scheme;
    c->H = H;
    c->T = T;
    c->buckets = P->rel_buckets;
    c->maxd = P->rel_max_distance;
    if (alibi) {
        double *s = (double *)xmalloc((size_t)H * sizeof(double));
        for (int h = 0; h < H; h++) s[h] = attn_alibi_slope(h, H);
        c->slopes = (double *)dev_alloc((size_t)H * sizeof(double));
        dev_upload(c->slopes, s, (size_t)H * sizeof(double));
        free(s);
    } else {
        int nd = 2 * T - 1;
        int *k = (int *)xmalloc((size_t)nd * sizeof(int));
        for (int dd = 0; dd < nd; dd++) k[dd] = attn_rel_bucket(dd - (T - 1), causal, P->rel_buckets, P->rel_max_distance);
        c->bucket = (int *)dev_alloc((size_t)nd * sizeof(int));
        dev_upload(c->bucket, k, (size_t)nd * sizeof(int));
        free(k);
    }
    return c;
}

/* The buckets of offsets d = -(T-1) .. T-1 of a call of length T <= in->T: the middle of the inputs' table, where
 * offset d is entry d + (in->T - 1). NULL for ALiBi. */
static const int *bias_buckets(const BiasInputs *in, int T) {
    return in->bucket ? in->bucket + (in->T - T) : NULL;
}

/* The (H, 2T-1) table of a call of length T; reserve (>= T): the longest length the caller will ask for (a
 * decoder's cache), so that its inputs are made once. */
static float *bias_table(const AttnPos *P, int H, int T, int reserve, int causal) {
    static float *buf;
    static size_t cap;
    const BiasInputs *in = bias_inputs(P, H, reserve > T ? reserve : T, causal);
    /* sized for reserve: a decoder stepping through lengths T grows it once, not at each new length */
    float *tab = cuda_scratch(&buf, &cap, (size_t)H * (2 * (reserve > T ? reserve : T) - 1));
    int n = H * (2 * T - 1);
    bias_table_kernel<<<cuda_blocks(n, 256), 256, 0, kv_stream>>>(tab, in->slopes, P->rel, bias_buckets(in, T), H, T,
                                                                  P->rel_buckets);
    CUDA_LAUNCHED(bias_table);
    return tab;
}

/* ------------------------------------------------------------------ problems */

/* A call: the device description plus where its roles come from and where their gradients go. */
typedef struct {
    AttnIO<act_t> d;
    const float *rope;
    /* sources of the roles: base pointer, row stride, batch stride */
    const act_t *src[3];
    int ld[3];
    size_t bstride[3];
    act_t *grad[3]; /* the backward's: where each role's gradient is added, laid out as its source */
    act_t *out;     /* the output (read only by the backward) */
    int o_ld;
    size_t o_bstride;
    float *lse;
} Call;

enum { ROLE_Q, ROLE_K, ROLE_V };

static float *g_pack, *g_grad, *g_misc;
static size_t g_pack_cap, g_grad_cap, g_misc_cap;

/* Does role r read the same rows as role s (same block, strides and shape), so that one rotated copy serves both? */
static int same_source(const Call *c, int r, int s) {
    const AttnDev *d = &c->d;
    int rows_r = r == ROLE_Q ? d->Tq : d->Tk, rows_s = s == ROLE_Q ? d->Tq : d->Tk;
    int heads_r = r == ROLE_Q ? d->H : d->G, heads_s = s == ROLE_Q ? d->H : d->G;
    return c->src[r] == c->src[s] && c->ld[r] == c->ld[s] && c->bstride[r] == c->bstride[s] && rows_r == rows_s &&
           heads_r == heads_s;
}

/* Where the kernels read the roles: in the projection itself (rows of W values, a head's hd of them at h hd), the
 * kernels taking any row stride (AttnRows), so that copying the rows head-major first would only move them once
 * more (B T W values of the activations' type each call, forward and backward). Roles reading one block alike are
 * then one pointer (KV's query and key, KV tying's key and value, all three of K's), which symmetric_backward reads.
 * Under RoPE the roles are packed into head-major scratch instead, the query and key rotated (one copy for KV's
 * and K's shared block), the value as it is: the kernels read K and V through one layout (AttnIO kv). */
static void place_roles(Call *c) {
    AttnIO<act_t> *d = &c->d;
    if (!c->rope) {
        d->Q = c->src[ROLE_Q], d->K = c->src[ROLE_K], d->V = c->src[ROLE_V];
        d->q = AttnRows{c->bstride[ROLE_Q], (size_t)d->hd, c->ld[ROLE_Q]};
        d->kv = AttnRows{c->bstride[ROLE_K], (size_t)d->hd, c->ld[ROLE_K]};
        if (c->bstride[ROLE_V] != c->bstride[ROLE_K] || c->ld[ROLE_V] != c->ld[ROLE_K])
            FATAL("attention: the key and value rows are laid out differently (a bug in kernels/cuda/attention.cu)");
        return;
    }
    size_t nq = (size_t)d->B * d->H * d->Tq * d->hd, nk = (size_t)d->B * d->G * d->Tk * d->hd;
    size_t floats = ((nq + 2 * nk) * sizeof(act_t) + sizeof(float) - 1) / sizeof(float); /* scratch counts floats */
    act_t *q = (act_t *)cuda_scratch(&g_pack, &g_pack_cap, floats), *k = q + nq, *v = k + nk;
    pack(q, c->src[ROLE_Q], c->ld[ROLE_Q], c->bstride[ROLE_Q], d->B, d->Tq, d->H, d->hd, c->rope);
    if (same_source(c, ROLE_K, ROLE_Q))
        k = q;
    else
        pack(k, c->src[ROLE_K], c->ld[ROLE_K], c->bstride[ROLE_K], d->B, d->Tk, d->G, d->hd, c->rope);
    pack(v, c->src[ROLE_V], c->ld[ROLE_V], c->bstride[ROLE_V], d->B, d->Tk, d->G, d->hd, NULL);
    d->Q = q, d->K = k, d->V = v;
    d->q = AttnRows{(size_t)d->H * d->Tq * d->hd, (size_t)d->Tq * d->hd, d->hd};
    d->kv = AttnRows{(size_t)d->G * d->Tk * d->hd, (size_t)d->Tk * d->hd, d->hd};
}

static void common_setup(AttnDev *d, int B, int Tq, int Tk, int H, int G, int hd, float dropout, uint64_t seed) {
    memset(d, 0, sizeof *d);
    d->B = B;
    d->Tq = Tq;
    d->Tk = Tk;
    d->H = H;
    d->G = G;
    d->group = H / G;
    d->hd = hd;
    d->scale = 1.0f / sqrtf((float)hd);
    d->dropout = dropout;
    d->dscale = 1.0f / (1.0f - dropout);
    d->thr = (uint32_t)(dropout * 16777216.0f);
    d->seed = seed;
    d->batch_first = dropout_batch_first();
}

static void self_call(Call *c, const char *op, act_t *out, float *lse, const act_t *proj, const AttnPos *pos,
                      const AttnArgs *a) {
    attn_check_args(op, a->B, a->T, a->T, a->H, a->hd, a->dropout);
    if (!proj || !out || !lse) FATAL("%s: NULL buffer", op);
    int scheme = attn_check_pos(op, pos, a->H, a->hd, a->T);
    int G = attn_check_kv_heads(op, a->H, a->kv_heads);
    if (a->hd > 256) FATAL("%s: head dim %d, the CUDA kernels take at most 256 (hint: more heads)", op, a->hd);
    cuda_ready();
    memset(c, 0, sizeof *c);
    common_setup(&c->d, a->B, a->T, a->T, a->H, G, a->hd, a->dropout, a->seed);
    AttnDev *d = &c->d;
    d->causal = a->causal;
    d->pad = a->key_pad;
    int C = a->H * a->hd, kvC = G * a->hd, W = attn_proj_width(ATTN_VARIANT, C, kvC);
    const int blocks[3] = {attn_query_block(ATTN_VARIANT), attn_key_block(ATTN_VARIANT), attn_value_block(ATTN_VARIANT)};
    for (int r = 0; r < 3; r++) {
        c->src[r] = proj + attn_block_offset(ATTN_VARIANT, blocks[r], C, kvC);
        c->ld[r] = W;
        c->bstride[r] = (size_t)a->T * W;
    }
    if (attn_positions[scheme].where == ATTN_PE_ROTARY) c->rope = pos->rope;
    if (attn_positions[scheme].where == ATTN_PE_BIAS) {
        d->pe_bias = bias_table(pos, a->H, a->T, a->T, a->causal);
        d->pe_nd = 2 * a->T - 1;
    }
    if (ATTN_POS) {
        static float *buf;
        static size_t cap;
        int Gp = pos->groups, T = a->T;
        float *f = cuda_scratch(&buf, &cap, (size_t)Gp * (2 * T + 2));
        pos_prepare_kernel<<<cuda_blocks((size_t)Gp * T, 256), 256, 0, kv_stream>>>(
            f, f + (size_t)Gp * T, f + (size_t)2 * Gp * T, f + (size_t)2 * Gp * T + Gp, pos->w, pos->b, pos->feat, Gp,
            pos->m, attn_pos_channels(pos->m), attn_pos_query_channels(pos->m), T);
        CUDA_LAUNCHED(pos_prepare);
        d->pos = 1;
        d->pos_groups = Gp;
        d->f = f;
        d->g = f + (size_t)Gp * T;
        d->alpha = f + (size_t)2 * Gp * T;
        d->bias = d->alpha + Gp;
    }
    c->out = out;
    c->o_ld = C;
    c->o_bstride = (size_t)a->T * C;
    c->lse = lse;
    place_roles(c);
}

static void cross_call(Call *c, const char *op, act_t *out, float *lse, const act_t *q, const act_t *kv,
                       const CrossAttnArgs *a) {
    attn_check_args(op, a->B, a->Tq, a->Tk, a->H, a->hd, a->dropout);
    if (!q || !kv || !out || !lse) FATAL("%s: NULL buffer", op);
    if (a->hd > 256) FATAL("%s: head dim %d, the CUDA kernels take at most 256 (hint: more heads)", op, a->hd);
    cuda_ready();
    memset(c, 0, sizeof *c);
    common_setup(&c->d, a->B, a->Tq, a->Tk, a->H, a->H, a->hd, a->dropout, a->seed);
    c->d.pad = a->key_pad;
    int C = a->H * a->hd;
    c->src[ROLE_Q] = q;
    c->ld[ROLE_Q] = C;
    c->bstride[ROLE_Q] = (size_t)a->Tq * C;
    c->src[ROLE_K] = kv;
    c->src[ROLE_V] = kv + C;
    c->ld[ROLE_K] = c->ld[ROLE_V] = 2 * C;
    c->bstride[ROLE_K] = c->bstride[ROLE_V] = (size_t)a->Tk * 2 * C;
    c->out = out;
    c->o_ld = C;
    c->o_bstride = (size_t)a->Tq * C;
    c->lse = lse;
    place_roles(c);
}

/* Launches one of the attention kernels, named in a profile (kernels.h) by name. */
template <typename... KArgs, typename... Args>
static void launch(const char *name, void (*kernel)(KArgs...), unsigned grid, unsigned threads, size_t smem,
                   Args... args) {
    cuda_check_smem("attention", smem, "a smaller head dim: more heads for the same width");
    if (smem > 48 * 1024)
        CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    kernel<<<grid, threads, smem, kv_stream>>>(args...);
    CUDA_LAUNCHED_AS(name);
}

/* The tensor-core kernels' NT (head dim padded to 16 NT) for a call, or 0 for the fp32 kernels: a tensor-core
 * precision, a head dim up to 128 and the shared memory for it on this GPU. Forward and backward choose alike. */
#define TC_ATTN (!IS_ENABLED(CONFIG_CUDA_FP32))
/* the operand tiles' element type: bf16 products with CUDA_BF16_MATMUL and CUDA_BF16, TF32 otherwise */
typedef std::conditional<IS_ENABLED(CONFIG_CUDA_BF16_MATMUL) || IS_ENABLED(CONFIG_CUDA_BF16), __nv_bfloat16,
                         float>::type TcElem;
static int tc_tiles(int hd) {
    int nt = tc_nt(hd);
    if (!TC_ATTN || !nt) return 0;
    size_t fwd = tc_smem_forward<TcElem>(nt), bwd = tc_smem_backward<TcElem>(nt), most = fwd > bwd ? fwd : bwd;
    return most <= kv_smem_max ? nt : 0; /* the WMMA kernels' needs: the mma kernels need less with one buffer */
}

/* The tile buffers of an mma kernel at NT on this GPU: 2 where its shared memory per block allows, else 1 (at
 * head dim 128 on sm_86 and sm_89, 99 KiB a block), else 0: no room, and the WMMA kernels run. */
static int mma_bufs(MmaKernel k, int nt) {
    return mma_smem(k, nt, 2) <= kv_smem_max ? 2 : mma_smem(k, nt, 1) <= kv_smem_max ? 1 : 0;
}

/* ---- the known-answer check of the register layouts the bf16 kernels assume (attention_mma_check, attention.h).
 * One warp runs the kernels' own helpers on a 16-row A, a 64-row tile R1 and a 64-row tile R2 (16 columns each,
 * loaded by mma_load_rows from X: float through registers, or bf16 by cp.async with its commit and wait): S = A .
 * R1^T (mma_abt: ldmatrix and mma.sync) and X = bf16(S) . R2 (mma_a_acc and mma_xr: the accumulators as the next A
 * operand, ldmatrix .trans), both written by mma_write_rows. The values are small integers, so every product and
 * sum is exact and any element out of place shows. */
enum { MMA_CHECK_A = 16 * 16, MMA_CHECK_R = MMA_KT * 16 };
template <typename X> __global__ void mma_check_kernel(float *S, float *Xo, const X *in) {
    extern __shared__ __align__(128) float tsm[];
    typedef MmaShape<1> Sh;
    __nv_bfloat16 *As = (__nv_bfloat16 *)tsm, *R1 = As + Sh::ELEMS, *R2 = R1 + Sh::ELEMS;
    mma_load_rows<Sh::hdp>(As, Sh::ld, in, 16, 0, 16, 16, 16);
    mma_load_rows<Sh::hdp>(R1, Sh::ld, in + MMA_CHECK_A, 16, 0, MMA_KT, 16, MMA_KT);
    mma_load_rows<Sh::hdp>(R2, Sh::ld, in + MMA_CHECK_A + MMA_CHECK_R, 16, 0, MMA_KT, 16, MMA_KT);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x, r[2] = {lane / 4, lane / 4 + 8};
    float s[MMA_KT / 8][4], x[2][4];
    mma_zero(s);
    mma_zero(x);
    mma_abt<1>(s, As, R1, Sh::ld, lane);
    mma_xr<1>(x, s, R2, Sh::ld, lane);
    mma_write_rows<MMA_KT / 16>(S, MMA_KT, r, 16, MMA_KT, s, 1.0f, lane);
    mma_write_rows<1>(Xo, 16, r, 16, 16, x, 1.0f, lane);
}

/* The check's inputs as X, run; out: S (16 x MMA_KT) then X (16 x 16). */
template <typename X> static void mma_check_run(float *out, size_t out_bytes, const float *in, int nin) {
    X *hx = (X *)xmalloc((size_t)nin * sizeof(X));
    for (int i = 0; i < nin; i++) hx[i] = act_as<X>(in[i]);
    X *din = (X *)dev_alloc((size_t)nin * sizeof(X));
    float *dout = (float *)dev_alloc(out_bytes);
    dev_upload(din, hx, (size_t)nin * sizeof(X));
    mma_check_kernel<X><<<1, TC_THREADS, 3 * MmaShape<1>::TILE, kv_stream>>>(dout, dout + 16 * MMA_KT, din);
    CUDA_LAUNCHED(mma_check);
    dev_download(out, dout, out_bytes);
    dev_free(din);
    dev_free(dout);
    free(hx);
}

int attention_mma_check(void) {
    if constexpr (!std::is_same<TcElem, __nv_bfloat16>::value) {
        return -1;
    } else {
        cuda_ready();
        enum { NIN = MMA_CHECK_A + 2 * MMA_CHECK_R, NS = 16 * MMA_KT, NX = 16 * 16 };
        static float in[NIN], out[NS + NX];
        uint32_t h = 12345u;
        for (int i = 0; i < NIN; i++) { /* -2 .. 2 from a hash, so that no element repeats its neighbours' pattern */
            h = h * 1664525u + 1013904223u;
            in[i] = (float)((int)(h >> 24) % 5 - 2);
        }
        const float *A = in, *R1 = in + MMA_CHECK_A, *R2 = R1 + MMA_CHECK_R;
        int bad = 0;
        for (int bf16_in = 0; bf16_in < 2; bf16_in++) {
            if (bf16_in)
                mma_check_run<__nv_bfloat16>(out, sizeof out, in, NIN);
            else
                mma_check_run<float>(out, sizeof out, in, NIN);
            for (int i = 0; i < 16; i++)
                for (int j = 0; j < MMA_KT + 16; j++) {
                    double want = 0.0;
                    if (j < MMA_KT) {
                        for (int k = 0; k < 16; k++) want += (double)A[i * 16 + k] * R1[j * 16 + k];
                    } else {
                        for (int k = 0; k < MMA_KT; k++) {
                            double sk = 0.0;
                            for (int c = 0; c < 16; c++) sk += (double)A[i * 16 + c] * R1[k * 16 + c];
                            want += sk * R2[k * 16 + (j - MMA_KT)];
                        }
                    }
                    float got = j < MMA_KT ? out[i * MMA_KT + j] : out[NS + i * 16 + (j - MMA_KT)];
                    if ((double)got != want && bad++ == 0)
                        fprintf(stderr, "attention_mma_check: %s[%d][%d] is %g, expected %g, from %s inputs: "
                                "mma.sync, ldmatrix or cp.async places elements where kernels/cuda/mma.cuh does not "
                                "say (hint: attention_set_mma_path(0) runs the WMMA kernels)\n",
                                j < MMA_KT ? "A.R1^T" : "S.R2", i, j < MMA_KT ? j : j - MMA_KT, got, want,
                                bf16_in ? "bf16" : "float");
                }
        }
        return bad;
    }
}

/* The tensor-core forward: bf16's keeps the scores in registers (mma.sync) unless attention_set_mma_path(0),
 * TF32's is WMMA's. The backward likewise (tc_backward, mma_backward). */
template <typename E> static void tc_forward(Call *c, int nt) {
    const AttnIO<act_t> *d = &c->d;
    unsigned grid = (unsigned)((size_t)d->B * d->H * ((d->Tq + TC_ROWS - 1) / TC_ROWS));
    if constexpr (std::is_same<E, __nv_bfloat16>::value)
        if (int bufs = attention_mma_path() ? mma_bufs(MMA_FWD, nt) : 0) {
            AttnIO<act_t> dm = *d;
            dm.bufs = bufs;
            launch("mma_forward_kernel", ATT_PICK(mma_forward_kernel, nt, act_t), grid, TC_THREADS,
                   mma_smem(MMA_FWD, nt, bufs), dm, c->out, c->o_ld, c->o_bstride, c->lse);
            return;
        }
    launch("tc_forward_kernel", TC_PICK(tc_forward_kernel, nt, E, act_t), grid, TC_THREADS, tc_smem_forward<E>(nt), *d,
           c->out, c->o_ld, c->o_bstride, c->lse);
}

static void run_forward(Call *c) {
    AttnIO<act_t> *d = &c->d;
    int nt = tc_tiles(d->hd);
    if (nt) {
        tc_forward<TcElem>(c, nt);
        return;
    }
    unsigned grid = (unsigned)((size_t)d->B * d->H * ((d->Tq + BR - 1) / BR));
    launch("forward_kernel", ATT_PICK(forward_kernel, att_npl(d->hd), act_t), grid, ATT_THREADS, att_smem_forward(d->hd),
           *d, c->out, c->o_ld, c->o_bstride, c->lse);
}

/* Whether the backward at NT runs bf16's kernels with the scores in registers (both general kernels fit this GPU's
 * shared memory), and then the symmetric path's too, where it is taken (its dK/dV kernel's three tiles of each
 * kind fit, symmetric_backward). */
static bool mma_backward(int nt) {
    return std::is_same<TcElem, __nv_bfloat16>::value && attention_mma_path() && mma_bufs(MMA_DQ, nt) &&
           mma_bufs(MMA_DKV, nt);
}

/* The tensor-core backward's kernels: with sym the symmetric key-side kernel alone, else the query-side and the
 * key-side kernel; bf16's with the scores in registers where mma_backward. */
template <typename E>
static void tc_backward(Call *c, int nt, bool sym, const act_t *dout, const float *D, RoleGrad<act_t> dq,
                        RoleGrad<act_t> dk, RoleGrad<act_t> dv, float *rowacc, float *colacc) {
    const AttnIO<act_t> *d = &c->d;
    const float *lse = c->lse;
    unsigned gq = (unsigned)((size_t)d->B * d->H * ((d->Tq + TC_ROWS - 1) / TC_ROWS));
    unsigned gk = (unsigned)((size_t)d->B * d->G * ((d->Tk + TC_ROWS - 1) / TC_ROWS));
    if (mma_backward(nt)) {
        if constexpr (std::is_same<E, __nv_bfloat16>::value) {
            AttnIO<act_t> dq_call = *d, dkv_call = *d;
            dq_call.bufs = mma_bufs(MMA_DQ, nt);
            dkv_call.bufs = mma_bufs(sym ? MMA_DKV_SYM : MMA_DKV, nt);
            if (!sym)
                launch("mma_dq_kernel", ATT_PICK(mma_dq_kernel, nt, act_t), gq, TC_THREADS,
                       mma_smem(MMA_DQ, nt, dq_call.bufs), dq_call, dout, c->o_ld, c->o_bstride, lse, D, dq, rowacc);
            launch("mma_dkv_kernel", ATT_PICK_SYM(mma_dkv_kernel, nt, act_t, sym), gk, TC_THREADS,
                   mma_smem(sym ? MMA_DKV_SYM : MMA_DKV, nt, dkv_call.bufs), dkv_call, dout, c->o_ld, c->o_bstride,
                   lse, D, dk, dv, colacc, rowacc);
        }
    } else if (sym) {
        launch("tc_dkv_kernel", TC_PICK_SYM(tc_dkv_kernel, nt, E, act_t, true), gk, TC_THREADS, tc_smem_backward_sym<E>(nt),
               *d, dout, c->o_ld, c->o_bstride, lse, D, dk, dv, colacc, rowacc);
    } else {
        launch("tc_dq_kernel", TC_PICK(tc_dq_kernel, nt, E, act_t), gq, TC_THREADS, tc_smem_backward<E>(nt), *d, dout,
               c->o_ld, c->o_bstride, lse, D, dq, rowacc);
        launch("tc_dkv_kernel", TC_PICK_SYM(tc_dkv_kernel, nt, E, act_t, false), gk, TC_THREADS, tc_smem_backward<E>(nt), *d,
               dout, c->o_ld, c->o_bstride, lse, D, dk, dv, colacc, rowacc);
    }
}

/* Whether a backward call takes the symmetric path: the query and key the same rows (KV and K, so the raw
 * scores are symmetric: the same address and layout; a cross-attention whose q is kv's buffer has the address
 * only), bidirectional, self-attention, one K/V head per query head, and the larger shared memory it needs
 * available on this GPU (smem: its bytes). */
static bool symmetric_backward(const AttnIO<act_t> *d, size_t smem) {
    bool same_rows = d->Q == d->K && d->q.ld == d->kv.ld && d->q.bstride == d->kv.bstride &&
                     d->q.hstride == d->kv.hstride && d->Tq == d->Tk && d->G == d->H;
    return attention_symmetric_path() && same_rows && !d->causal && smem <= kv_smem_max;
}

/* The gradients of the three roles and, for +Pos and the relative bias, their sums. Each role's gradient is added
 * into its rows at c->grad, or, where the roles were packed (RoPE), written packed to float32 *dq, *dk and *dv
 * (else NULL), which the caller turns back and adds. On the symmetric path the key's rows (or *dk) take the
 * gradient of both roles, and *dq is NULL. */
static void run_backward(Call *c, const act_t *dout, float **dq, float **dk, float **dv, const AttnPos *pos,
                         AttnPosGrad *dpos) {
    AttnIO<act_t> *d = &c->d;
    RoleGrad<act_t> rq = {NULL, c->grad[ROLE_Q]}, rk = {NULL, c->grad[ROLE_K]}, rv = {NULL, c->grad[ROLE_V]};
    *dq = *dk = *dv = NULL;
    if (c->rope) {
        size_t nq = (size_t)d->B * d->H * d->Tq * d->hd, nk = (size_t)d->B * d->G * d->Tk * d->hd;
        *dq = cuda_scratch(&g_grad, &g_grad_cap, nq + 2 * nk);
        *dk = *dq + nq;
        *dv = *dk + nk;
        rq = {*dq, NULL}, rk = {*dk, NULL}, rv = {*dv, NULL};
    }
    size_t nrow = (size_t)d->B * d->H * d->Tq, ncol = (size_t)d->B * d->H * d->Tk;
    int rel = d->pe_bias && pos->scheme == ATTN_POSITION_REL_BIAS;
    size_t nmisc = nrow + (d->pos ? 2 * nrow + ncol : 0) + (rel ? (size_t)d->B * d->H * d->pe_nd : 0);
    float *D = cuda_scratch(&g_misc, &g_misc_cap, nmisc);
    float *rowacc = d->pos ? D + nrow : NULL, *colacc = d->pos ? rowacc + 2 * nrow : NULL;
    float *racc = rel ? D + nrow + (d->pos ? 2 * nrow + ncol : 0) : NULL;
    rowdot_kernel<act_t><<<cuda_blocks(nrow * 32, 256), 256, 0, kv_stream>>>(D, dout, c->out, c->o_ld, c->o_bstride, d->B,
                                                                      d->H, d->Tq, d->hd);
    CUDA_LAUNCHED(rowdot);
    int hd = d->hd, nt = tc_tiles(hd);
    bool sym = symmetric_backward(d, !nt                ? att_smem_dkv(hd, 1)
                                     : mma_backward(nt) ? mma_smem(MMA_DKV_SYM, nt, 1)
                                                        : tc_smem_backward_sym<TcElem>(nt));
    if (sym) *dq = NULL;
    if (nt) {
        tc_backward<TcElem>(c, nt, sym, dout, D, rq, rk, rv, rowacc, colacc);
    } else {
        unsigned gq = (unsigned)((size_t)d->B * d->H * ((d->Tq + BR - 1) / BR));
        if (!sym)
            launch("dq_kernel", ATT_PICK(dq_kernel, att_npl(hd), act_t), gq, ATT_THREADS, att_smem_dq(hd), *d, dout,
                   c->o_ld, c->o_bstride, (const float *)c->lse, (const float *)D, rq, rowacc);
        unsigned gk = (unsigned)((size_t)d->B * d->G * ((d->Tk + BC - 1) / BC));
        launch("dkv_kernel", ATT_PICK_SYM(dkv_kernel, att_npl(hd), act_t, sym), gk, ATT_THREADS, att_smem_dkv(hd, sym), *d,
               dout, c->o_ld, c->o_bstride, (const float *)c->lse, (const float *)D, rk, rv, colacc, rowacc);
    }
    if (d->pos) {
        static float *buf;
        static size_t cap;
        int Gp = d->pos_groups, m = pos->m;
        float *agg = cuda_scratch(&buf, &cap, (size_t)Gp * (2 * d->Tq + d->Tk));
        float *rowagg = agg, *gsagg = agg + (size_t)Gp * d->Tq, *colagg = gsagg + (size_t)Gp * d->Tq;
        int Tm = d->Tq > d->Tk ? d->Tq : d->Tk;
        pos_gather_kernel<<<cuda_blocks((size_t)Gp * Tm, 256), 256, 0, kv_stream>>>(rowagg, gsagg, colagg, rowacc,
                                                                                    colacc, d->B, d->H, Gp, d->Tq,
                                                                                    d->Tk);
        CUDA_LAUNCHED(pos_gather);
        pos_reduce_kernel<<<Gp, 256, 0, kv_stream>>>(dpos->dw, dpos->db, rowagg, gsagg, colagg, pos->feat, m,
                                                     attn_pos_channels(m), attn_pos_query_channels(m), d->Tq, d->Tk);
        CUDA_LAUNCHED(pos_reduce);
    }
    if (rel) {
        size_t warps = (size_t)d->B * d->H * d->pe_nd;
        diag_kernel<<<cuda_blocks(warps * 32, 256), 256, 0, kv_stream>>>(*d, dout, c->o_ld, c->o_bstride, c->lse, D,
                                                                         racc);
        CUDA_LAUNCHED(diag);
        const BiasInputs *in = bias_inputs(pos, d->H, d->Tq, d->causal);
        rel_reduce_kernel<<<cuda_blocks((size_t)d->H * pos->rel_buckets, 128), 128, 0, kv_stream>>>(
            dpos->drel, racc, bias_buckets(in, d->Tq), d->B, d->H, d->pe_nd, pos->rel_buckets);
        CUDA_LAUNCHED(rel_reduce);
    }
}

/* ------------------------------------------------------------------ entry points */

void attention_forward(act_t *out, float *lse, const act_t *proj, const AttnPos *pos, const AttnArgs *a) {
    KPROF_OP();
    Call c;
    self_call(&c, "attention_forward", out, lse, proj, pos, a);
    run_forward(&c);
}

void attention_backward(act_t *dproj, AttnPosGrad *dpos, const act_t *dout, const act_t *proj,
                        const act_t *out, const float *lse, const AttnPos *pos, const AttnArgs *a) {
    KPROF_OP();
    if (!dproj || !dout) FATAL("attention_backward: NULL gradient buffer");
    if (ATTN_POS && (!dpos || !dpos->dw || !dpos->db))
        FATAL("attention_backward: +Pos is configured but no positional gradient buffers given");
    if (pos && pos->scheme == ATTN_POSITION_REL_BIAS && (!dpos || !dpos->drel))
        FATAL("attention_backward: relative bias without its gradient buffer");
    Call c;
    self_call(&c, "attention_backward", (act_t *)out, (float *)lse, proj, pos, a);
    for (int r = 0; r < 3; r++) c.grad[r] = dproj + (c.src[r] - proj); /* the roles' own blocks */
    float *dq, *dk, *dv;
    run_backward(&c, dout, &dq, &dk, &dv, pos, dpos);
    if (!dk) return; /* added in place */
    /* RoPE: each role's gradient rotated back into its block; roles sharing a block add in turn (the query's in the
     * key's on the symmetric path) */
    if (dq)
        unpack_add(c.grad[ROLE_Q], c.ld[ROLE_Q], c.bstride[ROLE_Q], dq, a->B, a->T, a->H, a->hd, c.rope);
    unpack_add(c.grad[ROLE_K], c.ld[ROLE_K], c.bstride[ROLE_K], dk, a->B, a->T, c.d.G, a->hd, c.rope);
    unpack_add(c.grad[ROLE_V], c.ld[ROLE_V], c.bstride[ROLE_V], dv, a->B, a->T, c.d.G, a->hd, NULL);
}

void cross_attention_forward(act_t *out, float *lse, const act_t *q, const act_t *kv, const CrossAttnArgs *a) {
    KPROF_OP();
    Call c;
    cross_call(&c, "cross_attention_forward", out, lse, q, kv, a);
    run_forward(&c);
}

void cross_attention_backward(act_t *dq, act_t *dkv, const act_t *dout, const act_t *q, const act_t *kv,
                              const act_t *out, const float *lse, const CrossAttnArgs *a) {
    KPROF_OP();
    if (!dq || !dkv || !dout) FATAL("cross_attention_backward: NULL gradient buffer");
    Call c;
    cross_call(&c, "cross_attention_backward", (act_t *)out, (float *)lse, q, kv, a);
    c.grad[ROLE_Q] = dq, c.grad[ROLE_K] = dkv, c.grad[ROLE_V] = dkv + a->H * a->hd; /* laid out as q and kv */
    float *gq, *gk, *gv;
    run_backward(&c, dout, &gq, &gk, &gv, NULL, NULL); /* no RoPE across: added in place */
}

/* ------------------------------------------------------------------ decoding */

/* One warp per (sequence, query head): scores of the cached rows 0..t in shared memory, softmax, weighted sum. */
__global__ void decode_kernel(act_t *out, const act_t *q, int q_ld, const act_t *keys, const act_t *values, int T,
                              int t, int H, int hd, int G, const float *rope, AttnDev p, const float *w,
                              const float *pb, const float *feat, int m) {
    extern __shared__ float sm[];
    int n = t + 1, r = blockIdx.x / H, h = blockIdx.x % H, lane = threadIdx.x;
    float *s = sm, *qr = sm + n;
    int kvC = G * hd, group = H / G;
    const act_t *qh = q + (size_t)r * q_ld + (size_t)h * hd;
    size_t kvo = (size_t)r * T * kvC + (size_t)(h / group) * hd;
    const act_t *kh = keys + kvo, *vh = values + kvo;
    for (int d = lane; d < hd; d += 32) {
        if (rope) {
            int k = d / 2;
            float c = rope[(size_t)t * hd + 2 * k], sn = rope[(size_t)t * hd + 2 * k + 1];
            float q0 = act_ld(qh[2 * k]), q1 = act_ld(qh[2 * k + 1]);
            qr[d] = d % 2 == 0 ? c * q0 - sn * q1 : sn * q0 + c * q1;
        } else {
            qr[d] = act_ld(qh[d]);
        }
    }
    __syncwarp();
    float alpha = 1.0f, ft = 0.0f, pbias = 0.0f;
    int c = 0, ci = 0, gi = 0;
    if (ATTN_POS && w) {
        gi = p.pos_groups == 1 ? 0 : h;
        c = (m + 3) / 4 * 2;
        ci = c < m ? c : m;
        const float *wg = w + (size_t)gi * m;
        alpha = 0.0f;
        for (int k = 0; k < m; k++) alpha += wg[k];
        for (int k = 0; k < ci; k++) ft += wg[k] * feat[(size_t)t * c + k];
        pbias = pb[gi];
    }
    float mx = -INFINITY;
    for (int j = lane; j < n; j += 32) {
        const act_t *kj = kh + (size_t)j * kvC;
        float acc = 0.0f;
        if (rope) {
            for (int k = 0; k < hd / 2; k++) {
                float cc = rope[(size_t)j * hd + 2 * k], sn = rope[(size_t)j * hd + 2 * k + 1];
                float x0 = act_ld(kj[2 * k]), x1 = act_ld(kj[2 * k + 1]);
                float k0 = cc * x0 - sn * x1, k1 = sn * x0 + cc * x1;
                acc += qr[2 * k] * k0 + qr[2 * k + 1] * k1;
            }
        } else {
            for (int d = 0; d < hd; d++) acc += qr[d] * act_ld(kj[d]);
        }
        float x = p.scale * acc;
        if (ATTN_POS && w) {
            const float *wg = w + (size_t)gi * m;
            float g = 0.0f;
            for (int k = ci; k < m; k++) g += wg[k] * feat[(size_t)j * c + (k - ci)];
            x = alpha * x + g + ft + pbias;
        }
        if (p.pe_bias) x += p.pe_bias[(size_t)h * p.pe_nd + (n - 1 - t) + j];
        s[j] = x;
        mx = fmaxf(mx, x);
    }
    mx = warp_max(mx);
    float sum = 0.0f;
    for (int j = lane; j < n; j += 32) {
        float e = expf(s[j] - mx);
        s[j] = e;
        sum += e;
    }
    sum = warp_sum(sum);
    __syncwarp();
    float inv = 1.0f / sum;
    for (int d = lane; d < hd; d += 32) {
        float acc = 0.0f;
        for (int j = 0; j < n; j++) acc += s[j] * act_ld(vh[(size_t)j * kvC + d]);
        out[(size_t)r * H * hd + (size_t)h * hd + d] = act_st(acc * inv);
    }
}

void attention_decode(act_t *out, const act_t *q, int q_ld, const act_t *keys, const act_t *values, int T, int t,
                      int N, int H, int hd, int kv_heads, const AttnPos *pos) {
    KPROF_OP();
    int scheme = attn_check_decode(pos, q_ld, T, t, N, H, hd, kv_heads);
    int G = attn_kv_count(H, kv_heads), n = t + 1;
    cuda_ready();
    AttnDev p;
    common_setup(&p, N, 1, n, H, G, hd, 0.0f, 0);
    if (attn_positions[scheme].where == ATTN_PE_BIAS) {
        p.pe_bias = bias_table(pos, H, n, T, 1);
        p.pe_nd = 2 * n - 1;
    }
    if (ATTN_POS) p.pos_groups = pos->groups;
    const float *rope = attn_positions[scheme].where == ATTN_PE_ROTARY ? pos->rope : NULL;
    size_t smem = (size_t)(n + hd) * sizeof(float);
    cuda_check_smem("attention_decode", smem, "a shorter context: decoding keeps the scores of every cached position "
                    "in shared memory");
    if (smem > 48 * 1024)
        CUDA_CHECK(cudaFuncSetAttribute(decode_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    decode_kernel<<<N * H, 32, smem, kv_stream>>>(out, q, q_ld, keys, values, T, t, H, hd, G, rope, p,
                                                  ATTN_POS ? pos->w : NULL, ATTN_POS ? pos->b : NULL,
                                                  ATTN_POS ? pos->feat : NULL, ATTN_POS ? pos->m : 0);
    CUDA_LAUNCHED(decode);
}

/* ------------------------------------------------------------------ dense views */

/* S[i, j] of one (b, h), before masks */
__global__ void dense_scores_kernel(float *S, AttnIO<act_t> p, int b, int h) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= p.Tq * p.Tk) return;
    int i = idx / p.Tk, j = idx % p.Tk, hd = p.hd;
    const act_t *q = attn_rows(p.Q, p.q, b, h) + (size_t)i * p.q.ld;
    const act_t *k = attn_rows(p.K, p.kv, b, h / p.group) + (size_t)j * p.kv.ld;
    float s = 0.0f;
    for (int c = 0; c < hd; c++) s += act_ld(q[c]) * act_ld(k[c]);
    S[idx] = score_x(p, h, i, j, p.scale * s);
}

/* rows of S turned into probabilities with the masks (one block of 32 threads per row) */
__global__ void dense_softmax_kernel(float *A, AttnDev p, int b) {
    int i = blockIdx.x, lane = threadIdx.x;
    float *row = A + (size_t)i * p.Tk;
    float mx = -INFINITY;
    for (int j = lane; j < p.Tk; j += 32)
        if (visible(p, b, i, j)) mx = fmaxf(mx, row[j]);
    mx = warp_max(mx);
    float sum = 0.0f;
    for (int j = lane; j < p.Tk; j += 32) {
        float e = mx != -INFINITY && visible(p, b, i, j) ? expf(row[j] - mx) : 0.0f;
        row[j] = e;
        sum += e;
    }
    sum = warp_sum(sum);
    for (int j = lane; j < p.Tk; j += 32) row[j] = sum > 0.0f ? row[j] / sum : 0.0f;
}

void attention_scores(float *S, const act_t *proj, const AttnPos *pos, const AttnArgs *a, int b, int h) {
    KPROF_OP();
    Call c;
    float *dummy = (float *)&c; /* out and lse are not used */
    self_call(&c, "attention_scores", (act_t *)dummy, dummy, proj, pos, a);
    if (b < 0 || b >= a->B || h < 0 || h >= a->H) FATAL("attention_scores: (b, h) = (%d, %d) out of range", b, h);
    int n = a->T * a->T;
    dense_scores_kernel<<<cuda_blocks(n, 256), 256, 0, kv_stream>>>(S, c.d, b, h);
    CUDA_LAUNCHED(dense_scores);
}

void attention_probs(float *A, const act_t *proj, const AttnPos *pos, const AttnArgs *a, int b, int h) {
    KPROF_OP();
    attention_scores(A, proj, pos, a, b, h);
    Call c;
    self_call(&c, "attention_probs", (act_t *)A, A, proj, pos, a);
    dense_softmax_kernel<<<a->T, 32, 0, kv_stream>>>(A, c.d, b);
    CUDA_LAUNCHED(dense_softmax);
}
