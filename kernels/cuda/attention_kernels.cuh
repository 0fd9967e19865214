/* The CUDA attention kernels of training (forward and backward, the fp32 and the tensor-core path) and the
 * per-score code they share; kernels/cuda/attention.cu packs the roles, launches them and owns everything else.
 * A header of its own so that tests/test_cuda_emu.cpp can run the very same kernels on the CPU under an
 * emulation of the CUDA built-ins (tests/cuda_emu.h) where no GPU is. What it needs from its includer:
 * the CUDA built-ins, nvcuda::wmma (<mma.h>) and __nv_bfloat16 (<cuda_bf16.h>), warp_sum / warp_max (warp.cuh),
 * dropout_keep (hash.h) and ATTN_POS (attention.h). */
#ifndef KVLAB_ATTENTION_KERNELS_CUH
#define KVLAB_ATTENTION_KERNELS_CUH

#include "act.cuh"
#include "mma.cuh"

#define BR 32          /* query rows per block */
#define BC 32          /* keys per tile (= lanes) */
#define RPW 4          /* rows (or key columns) per warp: 8 warps x 4 = 32 */
#define ATT_THREADS 256

/* KERNEL<n, X> for n = 1, 2, 4 or 8: the fp32 kernels' values per lane (att_npl), X the activations' type
 * (AttnIO); ATT_PICK_SYM for the key-side backward kernel, KERNEL<n, X, sym> for a runtime flag sym (the symmetric
 * backward); TC_PICK below for the tensor-core kernels. */
#define ATT_PICK(KERNEL, n, X) \
    ((n) == 1 ? KERNEL<1, X> : (n) == 2 ? KERNEL<2, X> : (n) == 4 ? KERNEL<4, X> : KERNEL<8, X>)
#define ATT_PICK_S(KERNEL, n, X, S) \
    ((n) == 1 ? KERNEL<1, X, S> : (n) == 2 ? KERNEL<2, X, S> : (n) == 4 ? KERNEL<4, X, S> : KERNEL<8, X, S>)
#define ATT_PICK_SYM(KERNEL, n, X, sym) ((sym) ? ATT_PICK_S(KERNEL, n, X, true) : ATT_PICK_S(KERNEL, n, X, false))

/* Launch shapes of the fp32 kernels: values per lane (NPL, hd <= 32 NPL) and dynamic shared memory in bytes. */
static inline int att_npl(int hd) {
    int npl = (hd + 31) / 32;
    return npl <= 1 ? 1 : npl <= 2 ? 2 : npl <= 4 ? 4 : 8;
}
static inline size_t att_smem_forward(int hd) { return (size_t)(BR * hd + BC * (hd + 1) + BC * hd) * sizeof(float); }
static inline size_t att_smem_dq(int hd) { return (size_t)(2 * BR * hd + 2 * BC * (hd + 1)) * sizeof(float); }
static inline size_t att_smem_dkv(int hd, int sym) {
    return (size_t)(2 * BC * hd + 2 * BR * (hd + 1) + 2 * BR + (sym ? BC * hd + BR * (hd + 1) : 0)) * sizeof(float);
}

/* One attention call: its shapes, masks and position terms (what the per-score code reads)... */
struct AttnDev {
    int B, Tq, Tk, H, G, group, hd, causal;
    float scale;
    const unsigned char *pad;     /* (B, Tk) nonzero = padding key, or NULL */
    float dropout, dscale;
    uint32_t thr;
    uint64_t seed;
    int batch_first;
    int pos, pos_groups;          /* +Pos */
    const float *f, *g, *alpha, *bias;
    const float *pe_bias;         /* (H, pe_nd) at d + Tq - 1, or NULL */
    int pe_nd;
    int bufs;                     /* the mma kernels' tile buffers: 2, or 1 where shared memory is short */
};

/* Where a role's rows are: row t of (batch b, head h) at base + b bstride + h hstride + t ld. A packed copy
 * (B, heads, T, hd) has ld hd and hstride T hd; the projection read in place, ld its row width and hstride hd. */
struct AttnRows {
    size_t bstride, hstride;
    int ld;
};

/* ... and its roles, of the activations' type X, as are the output and its gradient that the kernels take: float,
 * or __nv_bfloat16 with bf16 activations (half the bytes of every tile load, and no conversion passes around the
 * kernels). The kernels compute in float what they read (act_ld) and round what they store (act_as). */
template <typename X> struct AttnIO : AttnDev {
    const X *Q, *K, *V; /* (B, H, Tq, hd), (B, G, Tk, hd) x 2, where q and kv say (K and V alike: one address
                         * computation serves both tiles) */
    AttnRows q, kv;
};

/* The rows of (batch b, head h) of a role at base laid out as l. */
template <typename X> __device__ __forceinline__ const X *attn_rows(const X *base, const AttnRows &l, int b, int h) {
    return base + (size_t)b * l.bstride + (size_t)h * l.hstride;
}

/* Where the backward kernels put a role's gradient: added to the role's rows of the projection's gradient (rows,
 * of the activations' type, laid out as the role: AttnIO q or kv), as the kernels read the roles in place; or,
 * where the roles were packed (RoPE), written to packed float32 (B, heads, T, hd), which attention.cu turns back
 * and adds (unpack_add). Roles sharing a block add in the order unpack_add takes them (query, key, value), with the
 * same rounding, so both ways give the same values. */
template <typename X> struct RoleGrad {
    float *packed;
    X *rows;
};
/* ... and its rows of (batch b, head h): at x (ld apart, added to) or at f (hd apart, written) */
template <typename X> struct GradRows {
    float *f;
    X *x;
    size_t ld;
};
template <typename X>
__device__ __forceinline__ GradRows<X> grad_rows(const RoleGrad<X> &g, const AttnRows &l, int b, int h, int heads,
                                                 int T, int hd) {
    if (g.rows) return GradRows<X>{nullptr, g.rows + (size_t)b * l.bstride + (size_t)h * l.hstride, (size_t)l.ld};
    return GradRows<X>{g.packed + ((size_t)b * heads + h) * T * hd, nullptr, (size_t)hd};
}
/* value v of row i, column d */
template <typename X> __device__ __forceinline__ void grad_put(const GradRows<X> &g, int i, int d, float v) {
    if (g.x) {
        X *y = g.x + (size_t)i * g.ld + d;
        *y = act_as<X>(act_ld(*y) + v);
    } else {
        g.f[(size_t)i * g.ld + d] = v;
    }
}

__device__ __forceinline__ float score_x(const AttnDev &p, int h, int i, int j, float s) {
    float x = s;
    if (ATTN_POS && p.pos) {
        int gi = p.pos_groups == 1 ? 0 : h;
        x = p.alpha[gi] * s + p.g[(size_t)gi * p.Tk + j] + (p.f[(size_t)gi * p.Tq + i] + p.bias[gi]);
    }
    if (p.pe_bias) x += p.pe_bias[(size_t)h * p.pe_nd + (j - i) + p.Tq - 1];
    return x;
}

/* The row tile of a query-side block (blockIdx.x is (batch, head) major): with the causal mask the last tiles,
 * whose rows see the most keys, first, so that the last blocks of the grid to start are the shortest, as
 * FlashAttention-2 orders its blocks. The key-side kernels' first tiles are already their longest. */
__device__ __forceinline__ int query_tile(const AttnDev &p, int tiles) {
    int t = (int)(blockIdx.x % tiles);
    return p.causal ? tiles - 1 - t : t;
}

__device__ __forceinline__ bool visible(const AttnDev &p, int b, int i, int j) {
    return j < p.Tk && i < p.Tq && (!p.causal || j <= i) && (!p.pad || !p.pad[(size_t)b * p.Tk + j]);
}

/* The inverted-dropout factor of probability (i, j) of batch b, head h (1 without dropout). */
__device__ __forceinline__ float keep_factor(const AttnDev &p, int b, int h, int i, int j) {
    if (p.dropout <= 0.0f) return 1.0f;
    size_t idx = (((size_t)(p.batch_first + b) * p.H + h) * p.Tq + i) * p.Tk + j;
    return dropout_keep(p.seed, idx, p.thr) ? p.dscale : 0.0f;
}

/* The backward of score (i, j) of batch b, head h, from its scaled score s, dA = dO_i . V_j, the row's
 * log-sum-exp li and D_i = dO_i . O_i: the probability a, recomputed; its dropout factor kf; and
 * G'_ij = a (dA kf - D_i), the gradient of the score before +Pos. All zero where (i, j) is masked or the row is
 * fully masked (li = -inf: no gradient). */
struct ScoreGrad {
    float a, kf, gp;
};
__device__ __forceinline__ ScoreGrad score_grad(const AttnDev &p, int b, int h, int i, int j, float s, float dA,
                                                float li, float Di) {
    if (!visible(p, b, i, j) || li == -INFINITY) return {0.0f, 0.0f, 0.0f};
    float a = expf(score_x(p, h, i, j, s) - li), kf = keep_factor(p, b, h, i, j);
    return {a, kf, a * (dA * kf - Di)};
}

/* ------------------------------------------------------------------ forward */

/* Keys and values j0 .. j0+BC-1 of one K/V head (rows p.kv.ld apart) into shared memory (rows ldk and ldv apart),
 * zeros past Tk. */
template <typename X>
__device__ __forceinline__ void load_kv_tile(float *Ks, int ldk, float *Vs, int ldv, const AttnIO<X> &p, const X *K,
                                             const X *V, int j0) {
    const int hd = p.hd;
    for (int e = threadIdx.x; e < BC * hd; e += ATT_THREADS) {
        int c = e / hd, d = e % hd;
        bool in = j0 + c < p.Tk;
        Ks[c * ldk + d] = in ? act_ld(K[(size_t)(j0 + c) * p.kv.ld + d]) : 0.0f;
        Vs[c * ldv + d] = in ? act_ld(V[(size_t)(j0 + c) * p.kv.ld + d]) : 0.0f;
    }
}

template <int NPL, typename X>
__global__ void __launch_bounds__(ATT_THREADS) forward_kernel(AttnIO<X> p, X *out, int o_ld, size_t o_bstride,
                                                              float *lse) {
    extern __shared__ float sm[];
    const int hd = p.hd, ldk = hd + 1;
    float *Qs = sm, *Ks = Qs + BR * hd, *Vs = Ks + BC * ldk;
    int tiles = (p.Tq + BR - 1) / BR;
    int bh = blockIdx.x / tiles, i0 = query_tile(p, tiles) * BR;
    int b = bh / p.H, h = bh % p.H, g = h / p.group;
    const X *Q = attn_rows(p.Q, p.q, b, h), *K = attn_rows(p.K, p.kv, b, g), *V = attn_rows(p.V, p.kv, b, g);
    for (int e = threadIdx.x; e < BR * hd; e += ATT_THREADS)
        Qs[e] = i0 + e / hd < p.Tq ? act_ld(Q[(size_t)(i0 + e / hd) * p.q.ld + e % hd]) : 0.0f;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float m[RPW], l[RPW], o[RPW][NPL];
    for (int r = 0; r < RPW; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
        for (int k = 0; k < NPL; k++) o[r][k] = 0.0f;
    }
    int kend = p.causal ? min(p.Tk, i0 + BR) : p.Tk;
    for (int j0 = 0; j0 < kend; j0 += BC) {
        __syncthreads();
        load_kv_tile(Ks, ldk, Vs, hd, p, K, V, j0);
        __syncthreads();
        int j = j0 + lane;
        for (int rr = 0; rr < RPW; rr++) {
            int r = warp * RPW + rr, i = i0 + r;
            if (i >= p.Tq) continue; /* the same for the whole warp */
            float s = 0.0f;
            for (int d = 0; d < hd; d++) s += Qs[r * hd + d] * Ks[lane * ldk + d];
            s *= p.scale;
            bool vis = visible(p, b, i, j);
            float x = vis ? score_x(p, h, i, j, s) : -INFINITY;
            float mnew = fmaxf(m[rr], warp_max(x));
            if (mnew == -INFINITY) continue; /* every key so far masked */
            float corr = expf(m[rr] - mnew);
            float e = vis ? expf(x - mnew) : 0.0f;
            l[rr] = l[rr] * corr + warp_sum(e);
            float pe = vis ? e * keep_factor(p, b, h, i, j) : 0.0f;
            for (int k = 0; k < NPL; k++) o[rr][k] *= corr;
            for (int jj = 0; jj < BC; jj++) {
                float pj = __shfl_sync(0xffffffffu, pe, jj);
                for (int k = 0; k < NPL; k++) {
                    int d = lane + 32 * k;
                    if (d < hd) o[rr][k] += pj * Vs[jj * hd + d];
                }
            }
            m[rr] = mnew;
        }
    }
    for (int rr = 0; rr < RPW; rr++) {
        int i = i0 + warp * RPW + rr;
        if (i >= p.Tq) continue;
        float inv = l[rr] > 0.0f ? 1.0f / l[rr] : 0.0f;
        X *orow = out + (size_t)b * o_bstride + (size_t)i * o_ld + (size_t)h * hd;
        for (int k = 0; k < NPL; k++) {
            int d = lane + 32 * k;
            if (d < hd) orow[d] = act_as<X>(o[rr][k] * inv);
        }
        if (lane == 0) lse[(size_t)bh * p.Tq + i] = l[rr] > 0.0f ? m[rr] + logf(l[rr]) : -INFINITY;
    }
}

/* ------------------------------------------------------------------ backward */

/* D[b, h, i] = dO_i . O_i, one warp per row */
template <typename X>
__global__ void rowdot_kernel(float *D, const X *dout, const X *out, int o_ld, size_t o_bstride, int B, int H, int Tq,
                              int hd) {
    size_t row = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x % 32;
    if (row >= (size_t)B * H * Tq) return;
    int i = (int)(row % Tq), h = (int)(row / Tq % H), b = (int)(row / Tq / H);
    size_t off = (size_t)b * o_bstride + (size_t)i * o_ld + (size_t)h * hd;
    float s = 0.0f;
    for (int d = lane; d < hd; d += 32) s += act_ld(dout[off + d]) * act_ld(out[off + d]);
    s = warp_sum(s);
    if (lane == 0) D[row] = s;
}

/* dQ (RoleGrad: added in place, or packed and written) per block of query rows; rowacc (B*H*Tq, 2): sum_j G'_ij
 * S_ij and sum_j G'_ij (+Pos). */
template <int NPL, typename X>
__global__ void __launch_bounds__(ATT_THREADS) dq_kernel(AttnIO<X> p, const X *dout, int o_ld, size_t o_bstride,
                                                         const float *lse, const float *D, RoleGrad<X> dQ,
                                                         float *rowacc) {
    extern __shared__ float sm[];
    const int hd = p.hd, ldk = hd + 1;
    float *Qs = sm, *dOs = Qs + BR * hd, *Ks = dOs + BR * hd, *Vs = Ks + BC * ldk;
    int tiles = (p.Tq + BR - 1) / BR;
    int bh = blockIdx.x / tiles, i0 = query_tile(p, tiles) * BR;
    int b = bh / p.H, h = bh % p.H, g = h / p.group;
    const X *Q = attn_rows(p.Q, p.q, b, h), *K = attn_rows(p.K, p.kv, b, g), *V = attn_rows(p.V, p.kv, b, g);
    for (int e = threadIdx.x; e < BR * hd; e += ATT_THREADS) {
        int r = e / hd, d = e % hd;
        bool in = i0 + r < p.Tq;
        Qs[e] = in ? act_ld(Q[(size_t)(i0 + r) * p.q.ld + d]) : 0.0f;
        dOs[e] = in ? act_ld(dout[(size_t)b * o_bstride + (size_t)(i0 + r) * o_ld + (size_t)h * hd + d]) : 0.0f;
    }
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float alpha = ATTN_POS && p.pos ? p.alpha[p.pos_groups == 1 ? 0 : h] : 1.0f;
    float li[RPW], Di[RPW], dq[RPW][NPL], gs[RPW], rs[RPW];
    for (int rr = 0; rr < RPW; rr++) {
        int i = i0 + warp * RPW + rr;
        li[rr] = i < p.Tq ? lse[(size_t)bh * p.Tq + i] : -INFINITY;
        Di[rr] = i < p.Tq ? D[(size_t)bh * p.Tq + i] : 0.0f;
        gs[rr] = rs[rr] = 0.0f;
        for (int k = 0; k < NPL; k++) dq[rr][k] = 0.0f;
    }
    int kend = p.causal ? min(p.Tk, i0 + BR) : p.Tk;
    for (int j0 = 0; j0 < kend; j0 += BC) {
        __syncthreads();
        load_kv_tile(Ks, ldk, Vs, ldk, p, K, V, j0);
        __syncthreads();
        int j = j0 + lane;
        for (int rr = 0; rr < RPW; rr++) {
            int r = warp * RPW + rr, i = i0 + r;
            if (i >= p.Tq || li[rr] == -INFINITY) continue; /* a fully masked row has no gradient */
            float s = 0.0f, dA = 0.0f;
            for (int d = 0; d < hd; d++) {
                s += Qs[r * hd + d] * Ks[lane * ldk + d];
                dA += dOs[r * hd + d] * Vs[lane * ldk + d];
            }
            s *= p.scale;
            float gp = score_grad(p, b, h, i, j, s, dA, li[rr], Di[rr]).gp;
            gs[rr] += gp * s;
            rs[rr] += gp;
            float dS = alpha * gp;
            for (int jj = 0; jj < BC; jj++) {
                float gj = __shfl_sync(0xffffffffu, dS, jj);
                for (int k = 0; k < NPL; k++) {
                    int d = lane + 32 * k;
                    if (d < hd) dq[rr][k] += gj * Ks[jj * ldk + d];
                }
            }
        }
    }
    const GradRows<X> gq = grad_rows(dQ, p.q, b, h, p.H, p.Tq, hd);
    for (int rr = 0; rr < RPW; rr++) {
        int i = i0 + warp * RPW + rr;
        if (i >= p.Tq) continue;
        for (int k = 0; k < NPL; k++) {
            int d = lane + 32 * k;
            if (d < hd) grad_put(gq, i, d, p.scale * dq[rr][k]);
        }
        if (rowacc) {
            float a = warp_sum(gs[rr]), c = warp_sum(rs[rr]);
            if (lane == 0) {
                rowacc[((size_t)bh * p.Tq + i) * 2] = a;
                rowacc[((size_t)bh * p.Tq + i) * 2 + 1] = c;
            }
        }
    }
}

/* dK, dV (RoleGrad) per block of 32 keys of one K/V head, over its query heads in order; colacc
 * (B*H*Tk): sum_i G'_ij per query head (+Pos).
 * With SYM (KV and K bidirectional: the packed Q is K, S_ij = S_ji; a template argument, so that the general
 * kernel is compiled without its registers) the block's keys are queries too, and the
 * score it forms for the pair (key j, query i) is also the score of (query j, key i): from it, dO_j . V_i and row
 * j's lse and D it takes G'_ji as well, so dK_j gets both roles, s sum_i (G_ij + G_ji) K_i, in one product, and
 * rowacc (as dq_kernel's) the row sums of its keys. No dq_kernel runs: each pair's score is computed once in the
 * backward pass, where the general path computes it in both kernels. */
template <int NPL, typename X, bool SYM>
__global__ void __launch_bounds__(ATT_THREADS) dkv_kernel(AttnIO<X> p, const X *dout, int o_ld, size_t o_bstride,
                                                          const float *lse, const float *D, RoleGrad<X> dK,
                                                          RoleGrad<X> dV, float *colacc, float *rowacc) {
    extern __shared__ float sm[];
    const int hd = p.hd, ldq = hd + 1;
    float *Ks = sm, *Vs = Ks + BC * hd, *Qs = Vs + BC * hd, *dOs = Qs + BR * ldq, *ls = dOs + BR * ldq, *Ds = ls + BR;
    float *dOk = Ds + BR, *Vq = dOk + BC * hd; /* SYM: the keys' own dO rows, the query tile's values */
    int tiles = (p.Tk + BC - 1) / BC;
    int bg = blockIdx.x / tiles, j0 = (blockIdx.x % tiles) * BC;
    int b = bg / p.G, g = bg % p.G;
    const X *K = attn_rows(p.K, p.kv, b, g), *V = attn_rows(p.V, p.kv, b, g);
    for (int e = threadIdx.x; e < BC * hd; e += ATT_THREADS) {
        bool in = j0 + e / hd < p.Tk;
        Ks[e] = in ? act_ld(K[(size_t)(j0 + e / hd) * p.kv.ld + e % hd]) : 0.0f;
        Vs[e] = in ? act_ld(V[(size_t)(j0 + e / hd) * p.kv.ld + e % hd]) : 0.0f;
        if (SYM) /* G = H: head g */
            dOk[e] = in ? act_ld(dout[(size_t)b * o_bstride + (size_t)(j0 + e / hd) * o_ld + (size_t)g * hd + e % hd])
                        : 0.0f;
    }
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float dk[RPW][NPL], dv[RPW][NPL];
    for (int cc = 0; cc < RPW; cc++)
        for (int k = 0; k < NPL; k++) dk[cc][k] = dv[cc][k] = 0.0f;
    for (int h = g * p.group; h < (g + 1) * p.group; h++) {
        int bh = b * p.H + h;
        float alpha = ATTN_POS && p.pos ? p.alpha[p.pos_groups == 1 ? 0 : h] : 1.0f;
        const X *Q = attn_rows(p.Q, p.q, b, h);
        float cs[RPW], lk[RPW], Dk[RPW], gr[RPW], rq[RPW]; /* rq, gr: row j's sums of G'_ji and G'_ji S_ji */
        for (int cc = 0; cc < RPW; cc++) {
            int j = j0 + warp * RPW + cc;
            cs[cc] = gr[cc] = rq[cc] = 0.0f;
            lk[cc] = SYM && j < p.Tq ? lse[(size_t)bh * p.Tq + j] : -INFINITY;
            Dk[cc] = SYM && j < p.Tq ? D[(size_t)bh * p.Tq + j] : 0.0f;
        }
        for (int i0 = p.causal ? j0 / BR * BR : 0; i0 < p.Tq; i0 += BR) {
            __syncthreads();
            for (int e = threadIdx.x; e < BR * hd; e += ATT_THREADS) {
                int r = e / hd, d = e % hd;
                bool in = i0 + r < p.Tq;
                Qs[r * ldq + d] = in ? act_ld(Q[(size_t)(i0 + r) * p.q.ld + d]) : 0.0f;
                dOs[r * ldq + d] =
                    in ? act_ld(dout[(size_t)b * o_bstride + (size_t)(i0 + r) * o_ld + (size_t)h * hd + d]) : 0.0f;
                if (SYM) Vq[r * ldq + d] = in ? act_ld(V[(size_t)(i0 + r) * p.kv.ld + d]) : 0.0f;
            }
            for (int r = threadIdx.x; r < BR; r += ATT_THREADS) {
                bool in = i0 + r < p.Tq;
                ls[r] = in ? lse[(size_t)bh * p.Tq + i0 + r] : -INFINITY;
                Ds[r] = in ? D[(size_t)bh * p.Tq + i0 + r] : 0.0f;
            }
            __syncthreads();
            int i = i0 + lane;
            for (int cc = 0; cc < RPW; cc++) {
                int c = warp * RPW + cc, j = j0 + c;
                if (j >= p.Tk) continue; /* the same for the whole warp */
                float s = 0.0f, dA = 0.0f;
                for (int d = 0; d < hd; d++) {
                    s += Qs[lane * ldq + d] * Ks[c * hd + d];
                    dA += dOs[lane * ldq + d] * Vs[c * hd + d];
                }
                s *= p.scale;
                ScoreGrad sg = score_grad(p, b, h, i, j, s, dA, ls[lane], Ds[lane]);
                float pa = sg.a * sg.kf, gk = alpha * sg.gp;
                cs[cc] += sg.gp;
                if (SYM) { /* the pair as (query j, key i) */
                    float dAq = 0.0f;
                    for (int d = 0; d < hd; d++) dAq += dOk[c * hd + d] * Vq[lane * ldq + d];
                    float gq = score_grad(p, b, h, j, i, s, dAq, lk[cc], Dk[cc]).gp;
                    gk += alpha * gq;
                    gr[cc] += gq * s;
                    rq[cc] += gq;
                }
                for (int ii = 0; ii < BR; ii++) {
                    float pi = __shfl_sync(0xffffffffu, pa, ii), gi = __shfl_sync(0xffffffffu, gk, ii);
                    for (int k = 0; k < NPL; k++) {
                        int d = lane + 32 * k;
                        if (d < hd) {
                            dv[cc][k] += pi * dOs[ii * ldq + d];
                            dk[cc][k] += gi * Qs[ii * ldq + d];
                        }
                    }
                }
            }
        }
        if (colacc)
            for (int cc = 0; cc < RPW; cc++) {
                int j = j0 + warp * RPW + cc;
                float t = warp_sum(cs[cc]);
                if (lane == 0 && j < p.Tk) colacc[(size_t)bh * p.Tk + j] = t;
            }
        if (SYM && rowacc)
            for (int cc = 0; cc < RPW; cc++) {
                int j = j0 + warp * RPW + cc;
                float a = warp_sum(gr[cc]), t = warp_sum(rq[cc]);
                if (lane == 0 && j < p.Tq) {
                    rowacc[((size_t)bh * p.Tq + j) * 2] = a;
                    rowacc[((size_t)bh * p.Tq + j) * 2 + 1] = t;
                }
            }
    }
    const GradRows<X> gk = grad_rows(dK, p.kv, b, g, p.G, p.Tk, hd), gv = grad_rows(dV, p.kv, b, g, p.G, p.Tk, hd);
    for (int cc = 0; cc < RPW; cc++) {
        int j = j0 + warp * RPW + cc;
        if (j >= p.Tk) continue;
        for (int k = 0; k < NPL; k++) {
            int d = lane + 32 * k;
            if (d < hd) { /* the key's first, then the value's: KV tying's and K's share their rows */
                grad_put(gk, j, d, p.scale * dk[cc][k]);
                grad_put(gv, j, d, dv[cc][k]);
            }
        }
    }
}

/* ------------------------------------------------------------------ tensor-core path (TF32, bf16) */

/* With a tensor-core precision the score products Q.K^T and dO.V^T and the value, key and query products P.V,
 * G^T.Q, P^T.dO and G.K run on the tensor cores through the WMMA API, with float32 accumulation: with CUDA_TF32
 * in TF32 (m16n16k8 tiles of float, each operand rounded to 10 mantissa bits as it is loaded), with
 * CUDA_BF16_MATMUL in bf16 (m16n16k16 tiles, twice the products per instruction; the operand tiles are stored
 * in shared memory as bf16, rounded to 7 mantissa bits on the way in, half the bytes, and the probabilities
 * and score gradients go to bf16 tiles of their own for the second products). The element type E of the
 * operand tiles (float or __nv_bfloat16) is the kernels' template argument. Everything per score is the fp32
 * kernels' own code on a float tile in shared memory: the products' 16 x 16 tiles are stored there, then
 * score_x, visible, keep_factor and score_grad see one score at a time exactly as above, so the paths differ
 * only in the products' rounding. The head dim is padded with zeros to TC_HD(NT) = 16 NT columns (NT 1, 2, 4
 * or 8: head dims up to 128; a wider head, or a GPU with too little shared memory, takes the fp32 kernels).
 *
 * Layout: 4 warps a block, each warp 16 rows of the tile (query rows in forward and dQ, key rows in dK/dV);
 * the other side walks in tiles of 32. Per score, two lanes share a row, 16 scores each, so a row's max and
 * sum take one shuffle and a lane keeps one row's softmax state. Each gradient value still has one writer
 * (dQ per query block, dK and dV per key block over the group's query heads in order), so a run repeats bit
 * for bit. */

#define TC_ROWS 64    /* rows per block: 4 warps x 16 */
#define TC_COLS 32    /* the other side's tile */
#define TC_THREADS 128
#define TC_HD(NT) (16 * (NT))

/* KERNEL<n, E, X> for n = 1, 2, 4 or 8 (tc_nt); TC_PICK_SYM: KERNEL<n, E, X, sym> for a runtime flag sym */
#define TC_PICK(KERNEL, n, E, X) \
    ((n) == 1 ? KERNEL<1, E, X> : (n) == 2 ? KERNEL<2, E, X> : (n) == 4 ? KERNEL<4, E, X> : KERNEL<8, E, X>)
#define TC_PICK_S(KERNEL, n, E, X, S)                                                                   \
    ((n) == 1 ? KERNEL<1, E, X, S> : (n) == 2 ? KERNEL<2, E, X, S> : (n) == 4 ? KERNEL<4, E, X, S> \
                                                                    : KERNEL<8, E, X, S>)
#define TC_PICK_SYM(KERNEL, n, E, X, sym) \
    ((sym) ? TC_PICK_S(KERNEL, n, E, X, true) : TC_PICK_S(KERNEL, n, E, X, false))

namespace wmma = nvcuda::wmma;

/* The WMMA types of an operand element type: fragments, the k of a product step, the padding of a tile row
 * (16 bytes: rows start on different banks), and put(), a float as it is stored in an operand tile. */
template <typename E> struct Tc;
template <> struct Tc<float> {
    static constexpr int K = 8, PAD = 4;
    typedef wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major> A;
    typedef wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::row_major> B;
    typedef wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::col_major> Bt;
    typedef wmma::fragment<wmma::accumulator, 16, 16, 8, float> C;
    static __device__ __forceinline__ float put(float v) { return v; } /* rounded as it is loaded (round) */
    template <typename F> static __device__ __forceinline__ void round(F &f) {
        for (int t = 0; t < f.num_elements; t++) f.x[t] = wmma::__float_to_tf32(f.x[t]);
    }
};
template <> struct Tc<__nv_bfloat16> {
    static constexpr int K = 16, PAD = 8;
    typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> A;
    typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> B;
    typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> Bt;
    typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> C;
    static __device__ __forceinline__ __nv_bfloat16 put(float v) { return __float2bfloat16(v); }
    template <typename F> static __device__ __forceinline__ void round(F &) {}
};

/* The kernels' dynamic shared memory, byte offsets of each tile (all multiples of 32, as WMMA needs), from one
 * description that the kernels and the launches (tc_smem_forward, tc_smem_backward) share.
 *  forward: the query rows (E, TC_ROWS x ld), a key and a value tile (E, TC_COLS x ld), the scores (float,
 *    TC_ROWS x lds_f, also taking P.V), and with bf16 the probabilities (E, TC_ROWS x ldp_f); with TF32 the
 *    probabilities overwrite the scores (ldp_f = lds_f).
 *  backward (dQ and dK/dV alike): two row tiles and two column tiles (E), the scores and dO.V^T (float,
 *    TC_ROWS x lds_b), with bf16 the probabilities and score gradients (E, TC_ROWS x ldp_b) and then the rows'
 *    lse and D (float, TC_ROWS each). At the end the gradients leave through the score tiles, 32 columns at a
 *    time (tc_write_rows).
 *  symmetric backward (tc_dkv_kernel with SYM), after those: the key rows' own dO (E, TC_ROWS x ld), the
 *    query tile's values (E, TC_COLS x ld) and dO_j.V_i^T (float, TC_ROWS x lds_b). */
template <typename E, int NT> struct TcShape {
    static constexpr bool SEP = sizeof(E) != sizeof(float); /* probabilities in tiles of their own */
    static constexpr int hdp = TC_HD(NT), ld = hdp + Tc<E>::PAD;
    static constexpr int lds_f = (hdp > TC_COLS ? hdp : TC_COLS) + 4, lds_b = TC_COLS + 4;
    static constexpr int ldp_f = SEP ? TC_COLS + Tc<E>::PAD : lds_f, ldp_b = SEP ? TC_COLS + Tc<E>::PAD : lds_b;
    static constexpr size_t ROWS = (size_t)TC_ROWS * ld * sizeof(E), COLS = (size_t)TC_COLS * ld * sizeof(E);
    /* forward */
    static constexpr size_t F_Q = 0, F_K = ROWS, F_V = F_K + COLS, F_S = F_V + COLS;
    static constexpr size_t F_SEND = F_S + (size_t)TC_ROWS * lds_f * sizeof(float);
    static constexpr size_t F_P = SEP ? F_SEND : F_S;
    static constexpr size_t F_BYTES = SEP ? F_P + (size_t)TC_ROWS * ldp_f * sizeof(E) : F_SEND;
    /* backward: row tiles R0, R1, column tiles C0, C1 */
    static constexpr size_t B_R0 = 0, B_R1 = ROWS, B_C0 = 2 * ROWS, B_C1 = B_C0 + COLS, B_S = B_C1 + COLS;
    static constexpr size_t B_A = B_S + (size_t)TC_ROWS * lds_b * sizeof(float);
    static constexpr size_t B_AEND = B_A + (size_t)TC_ROWS * lds_b * sizeof(float);
    static constexpr size_t B_P = SEP ? B_AEND : B_S, B_G = SEP ? B_P + (size_t)TC_ROWS * ldp_b * sizeof(E) : B_A;
    static constexpr size_t B_L = SEP ? B_G + (size_t)TC_ROWS * ldp_b * sizeof(E) : B_AEND;
    static constexpr size_t B_D = B_L + TC_ROWS * sizeof(float), B_BYTES = B_D + TC_ROWS * sizeof(float);
    static constexpr size_t B_SO = B_BYTES, B_SV = B_SO + ROWS, B_SA = B_SV + COLS;
    static constexpr size_t B_SBYTES = B_SA + (size_t)TC_ROWS * lds_b * sizeof(float);
    /* WMMA: tiles, a warp's 16 rows and each k step start 32-byte aligned; leading dims are multiples of 16 bytes */
    static_assert(ROWS % 32 == 0 && COLS % 32 == 0 && F_S % 32 == 0 && F_P % 32 == 0 && B_S % 32 == 0 &&
                      B_A % 32 == 0 && B_P % 32 == 0 && B_G % 32 == 0 && B_L % 32 == 0 && B_SO % 32 == 0 &&
                      B_SV % 32 == 0 && B_SA % 32 == 0,
                  "WMMA tiles start 32-byte aligned");
    static_assert(ld * sizeof(E) % 16 == 0 && ldp_f * sizeof(E) % 16 == 0 && ldp_b * sizeof(E) % 16 == 0 &&
                      lds_f * sizeof(float) % 16 == 0 && lds_b * sizeof(float) % 16 == 0,
                  "WMMA leading dims are multiples of 16 bytes");
    static_assert(16 * ld * sizeof(E) % 32 == 0 && 16 * ldp_f * sizeof(E) % 32 == 0 &&
                      16 * ldp_b * sizeof(E) % 32 == 0 && 16 * lds_f * sizeof(float) % 32 == 0 &&
                      16 * lds_b * sizeof(float) % 32 == 0 && Tc<E>::K * sizeof(E) % 32 == 0,
                  "a warp's 16 rows and each k step start 32-byte aligned");
};

template <typename E, int N> __device__ __forceinline__ void tc_zero(typename Tc<E>::C (&c)[N]) {
    for (int n = 0; n < N; n++) wmma::fill_fragment(c[n], 0.0f);
}

/* c[n] += A . X^T for the 16 x 16 tiles n < N: A 16 rows x kdim (row-major, lda), X 16 N rows x kdim (row-major,
 * ldx). kdim a multiple of Tc<E>::K; pointers 32-byte aligned, leading dims multiples of 16 bytes. */
template <typename E, int N>
__device__ __forceinline__ void tc_mma_abt(typename Tc<E>::C (&c)[N], const E *A, int lda, const E *X, int ldx,
                                           int kdim) {
    for (int k = 0; k < kdim; k += Tc<E>::K) {
        typename Tc<E>::A a;
        wmma::load_matrix_sync(a, A + k, lda);
        Tc<E>::round(a);
        for (int n = 0; n < N; n++) {
            typename Tc<E>::Bt bt;
            wmma::load_matrix_sync(bt, X + (size_t)n * 16 * ldx + k, ldx);
            Tc<E>::round(bt);
            wmma::mma_sync(c[n], a, bt, c[n]);
        }
    }
}

/* c[n] += A . Y for the 16 x 16 tiles n < N: A 16 rows x kdim (row-major, lda), Y kdim rows x 16 N (row-major,
 * ldy). */
template <typename E, int N>
__device__ __forceinline__ void tc_mma_ab(typename Tc<E>::C (&c)[N], const E *A, int lda, const E *Y, int ldy,
                                          int kdim) {
    for (int k = 0; k < kdim; k += Tc<E>::K) {
        typename Tc<E>::A a;
        wmma::load_matrix_sync(a, A + k, lda);
        Tc<E>::round(a);
        for (int n = 0; n < N; n++) {
            typename Tc<E>::B bm;
            wmma::load_matrix_sync(bm, Y + (size_t)k * ldy + n * 16, ldy);
            Tc<E>::round(bm);
            wmma::mma_sync(c[n], a, bm, c[n]);
        }
    }
}

template <typename Acc, int N> __device__ __forceinline__ void tc_store(float *dst, int ld, Acc (&c)[N]) {
    for (int n = 0; n < N; n++) wmma::store_matrix_sync(dst + n * 16, c[n], ld, wmma::mem_row_major);
}

/* A warp's 16 gradient rows (fragments c, 16 x 16 NT) to rows r0 .. of g (grad_put; its first `rows` rows: fewer
 * past the end), 32 columns at a time through the warp's 16 rows of a float tile (ld >= 32) */
template <typename X, typename Acc, int N>
__device__ __forceinline__ void tc_write_rows(const GradRows<X> &g, int r0, int hd, int rows, Acc (&c)[N], float *tile,
                                              int ld) {
    const int lane = threadIdx.x % 32;
    for (int n0 = 0; n0 < N; n0 += 2) {
        const int nn = N - n0 < 2 ? N - n0 : 2, d = 16 * n0 + lane;
        for (int n = 0; n < nn; n++) wmma::store_matrix_sync(tile + n * 16, c[n0 + n], ld, wmma::mem_row_major);
        __syncwarp();
        if (lane < 16 * nn && d < hd)
            for (int r = 0; r < rows; r++) grad_put(g, r0 + r, d, tile[r * ld + lane]);
        __syncwarp();
    }
}

/* rows r0 .. r0+rows-1 of an (n, hd) matrix with row stride src_ld (hd for the packed roles, the output's row
 * stride for dO) into shared memory (row stride ld), zeros past n and in columns hd .. hdp-1 */
template <typename E, typename X>
__device__ __forceinline__ void tc_load_rows(E *dst, int ld, const X *src, size_t src_ld, int r0, int n, int hd,
                                             int hdp, int rows) {
    for (int e = threadIdx.x; e < rows * hdp; e += TC_THREADS) {
        int r = e / hdp, d = e % hdp;
        dst[r * ld + d] = Tc<E>::put(r0 + r < n && d < hd ? act_ld(src[(size_t)(r0 + r) * src_ld + d]) : 0.0f);
    }
}

/* The tile count NT of a head dim (padded to 16 NT), 0 past 128. */
static inline int tc_nt(int hd) { return hd <= 16 ? 1 : hd <= 32 ? 2 : hd <= 64 ? 4 : hd <= 128 ? 8 : 0; }

/* Shared memory (bytes) of the forward kernel and of the two backward kernels for NT = tc_nt(hd). */
template <typename E> static inline size_t tc_smem_forward(int nt) {
    return nt == 1 ? TcShape<E, 1>::F_BYTES : nt == 2 ? TcShape<E, 2>::F_BYTES : nt == 4 ? TcShape<E, 4>::F_BYTES
                                                                                           : TcShape<E, 8>::F_BYTES;
}
template <typename E> static inline size_t tc_smem_backward(int nt) {
    return nt == 1 ? TcShape<E, 1>::B_BYTES : nt == 2 ? TcShape<E, 2>::B_BYTES : nt == 4 ? TcShape<E, 4>::B_BYTES
                                                                                           : TcShape<E, 8>::B_BYTES;
}
template <typename E> static inline size_t tc_smem_backward_sym(int nt) {
    return nt == 1 ? TcShape<E, 1>::B_SBYTES : nt == 2 ? TcShape<E, 2>::B_SBYTES : nt == 4 ? TcShape<E, 4>::B_SBYTES
                                                                                            : TcShape<E, 8>::B_SBYTES;
}

template <int NT, typename E, typename X>
__global__ void __launch_bounds__(TC_THREADS) tc_forward_kernel(AttnIO<X> p, X *out, int o_ld, size_t o_bstride,
                                                                float *lse) {
    extern __shared__ __align__(128) float tsm[];
    typedef TcShape<E, NT> S;
    typedef typename Tc<E>::C Acc;
    constexpr int hdp = S::hdp, ld = S::ld, lds = S::lds_f, ldp = S::ldp_f, HALF = hdp / 2;
    const int hd = p.hd;
    unsigned char *base = (unsigned char *)tsm;
    E *Qs = (E *)(base + S::F_Q), *Ks = (E *)(base + S::F_K), *Vs = (E *)(base + S::F_V);
    float *Ss = (float *)(base + S::F_S);
    E *Ps = (E *)(base + S::F_P);
    int tiles = (p.Tq + TC_ROWS - 1) / TC_ROWS;
    int bh = blockIdx.x / tiles, i0 = query_tile(p, tiles) * TC_ROWS;
    int b = bh / p.H, h = bh % p.H, g = h / p.group;
    const X *Q = attn_rows(p.Q, p.q, b, h), *K = attn_rows(p.K, p.kv, b, g), *V = attn_rows(p.V, p.kv, b, g);
    tc_load_rows(Qs, ld, Q, p.q.ld, i0, p.Tq, hd, hdp, TC_ROWS);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r0 = warp * 16;
    float *Sw = Ss + r0 * lds; /* this warp's 16 rows: scores, then P.V */
    E *Pw = Ps + r0 * ldp;     /* and their probabilities (with TF32 the same tile as the scores) */
    /* two lanes a row: row rr, its keys c0 .. c0+15 of a tile and its output columns d0 .. d0+HALF-1 */
    const int rr = lane >> 1, c0 = (lane & 1) * (TC_COLS / 2), d0 = (lane & 1) * HALF, i = i0 + r0 + rr;
    float *srow = Sw + rr * lds;
    E *prow = Pw + rr * ldp;
    float m = -INFINITY, l = 0.0f, o[HALF];
    for (int k = 0; k < HALF; k++) o[k] = 0.0f;
    int kend = p.causal ? min(p.Tk, i0 + TC_ROWS) : p.Tk;
    for (int j0 = 0; j0 < kend; j0 += TC_COLS) {
        __syncthreads();
        tc_load_rows(Ks, ld, K, p.kv.ld, j0, p.Tk, hd, hdp, TC_COLS);
        tc_load_rows(Vs, ld, V, p.kv.ld, j0, p.Tk, hd, hdp, TC_COLS);
        __syncthreads();
        Acc s[TC_COLS / 16];
        tc_zero<E>(s);
        tc_mma_abt<E>(s, Qs + r0 * ld, ld, Ks, ld, hdp);
        tc_store(Sw, lds, s);
        __syncwarp();
        float x[TC_COLS / 2], mt = -INFINITY;
        for (int c = 0; c < TC_COLS / 2; c++) {
            int j = j0 + c0 + c;
            x[c] = visible(p, b, i, j) ? score_x(p, h, i, j, srow[c0 + c] * p.scale) : -INFINITY;
            mt = fmaxf(mt, x[c]);
        }
        float mnew = fmaxf(m, fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 1))), st = 0.0f;
        for (int c = 0; c < TC_COLS / 2; c++) { /* masked scores (and all, while every key so far is) give 0 */
            float e = x[c] == -INFINITY ? 0.0f : expf(x[c] - mnew);
            st += e;
            prow[c0 + c] = Tc<E>::put(x[c] == -INFINITY ? 0.0f : e * keep_factor(p, b, h, i, j0 + c0 + c));
        }
        st += __shfl_xor_sync(0xffffffffu, st, 1);
        if (mnew != -INFINITY) {
            float corr = expf(m - mnew);
            l = l * corr + st;
            for (int k = 0; k < HALF; k++) o[k] *= corr;
            m = mnew;
        }
        __syncwarp();
        Acc pv[NT];
        tc_zero<E>(pv);
        tc_mma_ab<E>(pv, Pw, ldp, Vs, ld, TC_COLS);
        __syncwarp();
        tc_store(Sw, lds, pv);
        __syncwarp();
        for (int k = 0; k < HALF; k++) o[k] += srow[d0 + k];
    }
    if (i < p.Tq) {
        float inv = l > 0.0f ? 1.0f / l : 0.0f;
        X *orow = out + (size_t)b * o_bstride + (size_t)i * o_ld + (size_t)h * hd;
        for (int k = 0; k < HALF; k++)
            if (d0 + k < hd) orow[d0 + k] = act_as<X>(o[k] * inv);
        if (d0 == 0) lse[(size_t)bh * p.Tq + i] = l > 0.0f ? m + logf(l) : -INFINITY;
    }
}

/* dQ (RoleGrad) per block of 64 query rows; rowacc as dq_kernel's. */
template <int NT, typename E, typename X>
__global__ void __launch_bounds__(TC_THREADS) tc_dq_kernel(AttnIO<X> p, const X *dout, int o_ld, size_t o_bstride,
                                                           const float *lse, const float *D, RoleGrad<X> dQ,
                                                           float *rowacc) {
    extern __shared__ __align__(128) float tsm[];
    typedef TcShape<E, NT> S;
    typedef typename Tc<E>::C Acc;
    constexpr int hdp = S::hdp, ld = S::ld, lds = S::lds_b, ldp = S::ldp_b;
    const int hd = p.hd;
    unsigned char *base = (unsigned char *)tsm;
    E *Qs = (E *)(base + S::B_R0), *dOs = (E *)(base + S::B_R1), *Ks = (E *)(base + S::B_C0);
    E *Vs = (E *)(base + S::B_C1), *Ps = (E *)(base + S::B_P);
    float *Ss = (float *)(base + S::B_S), *As = (float *)(base + S::B_A);
    float *ls = (float *)(base + S::B_L), *Ds = (float *)(base + S::B_D);
    int tiles = (p.Tq + TC_ROWS - 1) / TC_ROWS;
    int bh = blockIdx.x / tiles, i0 = query_tile(p, tiles) * TC_ROWS;
    int b = bh / p.H, h = bh % p.H, g = h / p.group;
    const X *Q = attn_rows(p.Q, p.q, b, h), *K = attn_rows(p.K, p.kv, b, g), *V = attn_rows(p.V, p.kv, b, g);
    tc_load_rows(Qs, ld, Q, p.q.ld, i0, p.Tq, hd, hdp, TC_ROWS);
    tc_load_rows(dOs, ld, dout + (size_t)b * o_bstride + (size_t)h * hd, o_ld, i0, p.Tq, hd, hdp, TC_ROWS);
    for (int r = threadIdx.x; r < TC_ROWS; r += TC_THREADS) {
        bool in = i0 + r < p.Tq;
        ls[r] = in ? lse[(size_t)bh * p.Tq + i0 + r] : -INFINITY;
        Ds[r] = in ? D[(size_t)bh * p.Tq + i0 + r] : 0.0f;
    }
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r0 = warp * 16;
    float *Sw = Ss + r0 * lds, *Aw = As + r0 * lds;
    E *Pw = Ps + r0 * ldp; /* the score gradients (with TF32 the scores' tile) */
    float alpha = ATTN_POS && p.pos ? p.alpha[p.pos_groups == 1 ? 0 : h] : 1.0f;
    /* two lanes a row: row rr, its keys c0 .. c0+15 of a tile */
    const int rr = lane >> 1, c0 = (lane & 1) * (TC_COLS / 2), i = i0 + r0 + rr;
    float gs = 0.0f, rs = 0.0f;
    Acc dq[NT];
    tc_zero<E>(dq);
    int kend = p.causal ? min(p.Tk, i0 + TC_ROWS) : p.Tk;
    for (int j0 = 0; j0 < kend; j0 += TC_COLS) {
        __syncthreads();
        tc_load_rows(Ks, ld, K, p.kv.ld, j0, p.Tk, hd, hdp, TC_COLS);
        tc_load_rows(Vs, ld, V, p.kv.ld, j0, p.Tk, hd, hdp, TC_COLS);
        __syncthreads();
        Acc s[TC_COLS / 16], a[TC_COLS / 16];
        tc_zero<E>(s);
        tc_zero<E>(a);
        tc_mma_abt<E>(s, Qs + r0 * ld, ld, Ks, ld, hdp);
        tc_mma_abt<E>(a, dOs + r0 * ld, ld, Vs, ld, hdp);
        tc_store(Sw, lds, s);
        tc_store(Aw, lds, a);
        __syncwarp();
        float li = ls[r0 + rr], Di = Ds[r0 + rr];
        for (int c = c0; c < c0 + TC_COLS / 2; c++) {
            int j = j0 + c;
            float sv = Sw[rr * lds + c] * p.scale;
            float gp = score_grad(p, b, h, i, j, sv, Aw[rr * lds + c], li, Di).gp;
            gs += gp * sv;
            rs += gp;
            Pw[rr * ldp + c] = Tc<E>::put(alpha * gp);
        }
        __syncwarp();
        tc_mma_ab<E>(dq, Pw, ldp, Ks, ld, TC_COLS);
    }
    __syncwarp();
    for (int n = 0; n < NT; n++)
        for (int t = 0; t < dq[n].num_elements; t++) dq[n].x[t] *= p.scale;
    tc_write_rows(grad_rows(dQ, p.q, b, h, p.H, p.Tq, hd), i0 + r0, hd, min(16, p.Tq - i0 - r0), dq, Sw, lds);
    if (rowacc) {
        gs += __shfl_xor_sync(0xffffffffu, gs, 1);
        rs += __shfl_xor_sync(0xffffffffu, rs, 1);
        if (c0 == 0 && i < p.Tq) {
            rowacc[((size_t)bh * p.Tq + i) * 2] = gs;
            rowacc[((size_t)bh * p.Tq + i) * 2 + 1] = rs;
        }
    }
}

/* dK, dV (RoleGrad) per block of 64 keys of one K/V head, over its query heads in order; colacc as
 * dkv_kernel's, and with SYM dK of both roles and rowacc as dkv_kernel's. The scores are formed transposed
 * (keys as rows: K.Q^T, V.dO^T) so that P^T and G^T are the A operands of dV += P^T.dO and dK += G^T.Q; with
 * SYM dO_j.V_i^T is a third product, and G^T + G'' (G''_ji, the pair as query j, key i) the A operand of dK's. */
template <int NT, typename E, typename X, bool SYM>
__global__ void __launch_bounds__(TC_THREADS) tc_dkv_kernel(AttnIO<X> p, const X *dout, int o_ld, size_t o_bstride,
                                                            const float *lse, const float *D, RoleGrad<X> dK,
                                                            RoleGrad<X> dV, float *colacc, float *rowacc) {
    extern __shared__ __align__(128) float tsm[];
    typedef TcShape<E, NT> S;
    typedef typename Tc<E>::C Acc;
    constexpr int hdp = S::hdp, ld = S::ld, lds = S::lds_b, ldp = S::ldp_b;
    const int hd = p.hd;
    unsigned char *base = (unsigned char *)tsm;
    E *Ks = (E *)(base + S::B_R0), *Vs = (E *)(base + S::B_R1), *Qs = (E *)(base + S::B_C0);
    E *dOs = (E *)(base + S::B_C1), *Ps = (E *)(base + S::B_P), *Gs = (E *)(base + S::B_G);
    float *Ss = (float *)(base + S::B_S), *As = (float *)(base + S::B_A);
    float *ls = (float *)(base + S::B_L), *Ds = (float *)(base + S::B_D);
    int tiles = (p.Tk + TC_ROWS - 1) / TC_ROWS;
    int bg = blockIdx.x / tiles, j0 = (blockIdx.x % tiles) * TC_ROWS;
    int b = bg / p.G, g = bg % p.G;
    /* SYM: the keys' own dO rows, the query tile's values and dO_j.V_i^T */
    E *dOk = (E *)(base + S::B_SO), *Vq = (E *)(base + S::B_SV);
    float *Aq = (float *)(base + S::B_SA);
    const X *K = attn_rows(p.K, p.kv, b, g), *V = attn_rows(p.V, p.kv, b, g);
    tc_load_rows(Ks, ld, K, p.kv.ld, j0, p.Tk, hd, hdp, TC_ROWS);
    tc_load_rows(Vs, ld, V, p.kv.ld, j0, p.Tk, hd, hdp, TC_ROWS);
    if (SYM) /* G = H: head g */
        tc_load_rows(dOk, ld, dout + (size_t)b * o_bstride + (size_t)g * hd, o_ld, j0, p.Tq, hd, hdp, TC_ROWS);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r0 = warp * 16;
    float *Sw = Ss + r0 * lds, *Aw = As + r0 * lds, *Aqw = Aq + r0 * lds;
    E *Pw = Ps + r0 * ldp, *Gw = Gs + r0 * ldp; /* P^T and G^T (with TF32 the score tiles themselves) */
    /* two lanes a key: key row cc, its queries c0 .. c0+15 of a tile */
    const int cc = lane >> 1, c0 = (lane & 1) * (TC_COLS / 2), j = j0 + r0 + cc;
    Acc dk[NT], dv[NT];
    tc_zero<E>(dk);
    tc_zero<E>(dv);
    for (int h = g * p.group; h < (g + 1) * p.group; h++) {
        int bh = b * p.H + h;
        float alpha = ATTN_POS && p.pos ? p.alpha[p.pos_groups == 1 ? 0 : h] : 1.0f;
        const X *Q = attn_rows(p.Q, p.q, b, h);
        float cs = 0.0f, gr = 0.0f, rq = 0.0f; /* rq, gr (SYM): row j's sums of G'_ji and G'_ji S_ji */
        float lk = SYM && j < p.Tq ? lse[(size_t)bh * p.Tq + j] : -INFINITY;
        float Dk = SYM && j < p.Tq ? D[(size_t)bh * p.Tq + j] : 0.0f;
        for (int i0 = p.causal ? j0 / TC_COLS * TC_COLS : 0; i0 < p.Tq; i0 += TC_COLS) {
            __syncthreads();
            tc_load_rows(Qs, ld, Q, p.q.ld, i0, p.Tq, hd, hdp, TC_COLS);
            tc_load_rows(dOs, ld, dout + (size_t)b * o_bstride + (size_t)h * hd, o_ld, i0, p.Tq, hd, hdp, TC_COLS);
            if (SYM) tc_load_rows(Vq, ld, V, p.kv.ld, i0, p.Tk, hd, hdp, TC_COLS);
            for (int r = threadIdx.x; r < TC_COLS; r += TC_THREADS) {
                bool in = i0 + r < p.Tq;
                ls[r] = in ? lse[(size_t)bh * p.Tq + i0 + r] : -INFINITY;
                Ds[r] = in ? D[(size_t)bh * p.Tq + i0 + r] : 0.0f;
            }
            __syncthreads();
            Acc st[TC_COLS / 16], at[TC_COLS / 16];
            tc_zero<E>(st);
            tc_zero<E>(at);
            tc_mma_abt<E>(st, Ks + r0 * ld, ld, Qs, ld, hdp);
            tc_mma_abt<E>(at, Vs + r0 * ld, ld, dOs, ld, hdp);
            tc_store(Sw, lds, st);
            tc_store(Aw, lds, at);
            if (SYM) { /* the same fragments again, now dO_j.V_i^T */
                tc_zero<E>(at);
                tc_mma_abt<E>(at, dOk + r0 * ld, ld, Vq, ld, hdp);
                tc_store(Aqw, lds, at);
            }
            __syncwarp();
            for (int c = c0; c < c0 + TC_COLS / 2; c++) {
                int i = i0 + c;
                float sv = Sw[cc * lds + c] * p.scale;
                ScoreGrad sg = score_grad(p, b, h, i, j, sv, Aw[cc * lds + c], ls[c], Ds[c]);
                float gk = sg.gp;
                cs += sg.gp;
                if (SYM) { /* the pair as (query j, key i) */
                    float gq = score_grad(p, b, h, j, i, sv, Aqw[cc * lds + c], lk, Dk).gp;
                    gk += gq;
                    gr += gq * sv;
                    rq += gq;
                }
                Pw[cc * ldp + c] = Tc<E>::put(sg.a * sg.kf);
                Gw[cc * ldp + c] = Tc<E>::put(alpha * gk);
            }
            __syncwarp();
            tc_mma_ab<E>(dv, Pw, ldp, dOs, ld, TC_COLS);
            tc_mma_ab<E>(dk, Gw, ldp, Qs, ld, TC_COLS);
        }
        if (colacc) {
            cs += __shfl_xor_sync(0xffffffffu, cs, 1);
            if (c0 == 0 && j < p.Tk) colacc[(size_t)bh * p.Tk + j] = cs;
        }
        if (SYM && rowacc) {
            gr += __shfl_xor_sync(0xffffffffu, gr, 1);
            rq += __shfl_xor_sync(0xffffffffu, rq, 1);
            if (c0 == 0 && j < p.Tq) {
                rowacc[((size_t)bh * p.Tq + j) * 2] = gr;
                rowacc[((size_t)bh * p.Tq + j) * 2 + 1] = rq;
            }
        }
    }
    __syncwarp();
    for (int n = 0; n < NT; n++)
        for (int t = 0; t < dk[n].num_elements; t++) dk[n].x[t] *= p.scale;
    /* the key's rows first, then the value's: KV tying's and K's share them, and a lane writes the same elements of
     * both */
    const int nr = min(16, p.Tk - j0 - r0);
    tc_write_rows(grad_rows(dK, p.kv, b, g, p.G, p.Tk, hd), j0 + r0, hd, nr, dk, Sw, lds);
    tc_write_rows(grad_rows(dV, p.kv, b, g, p.G, p.Tk, hd), j0 + r0, hd, nr, dv, Aw, lds);
}

/* ------------------------------------------------------------------ bf16 kernels with scores in registers */

/* The bf16 kernels as FlashAttention-2 arranges them (mma.cuh): the scores of a warp's 16 rows against a tile of
 * 64 come out of mma.sync into registers whose row and column each lane knows, the per-score code (masks, +Pos,
 * bias, softmax, dropout, the score gradients) works on them there, and the results, packed to bf16, are at once
 * the A operand of the next product. Only bf16 tiles of rows pass through shared memory (MmaShape), read by every
 * warp of the block. Whole tiles that need no mask (every pair visible, no bias, padding or dropout) skip the
 * per-score code but for +Pos's term, if any (mma_tile_kind). The same values as the WMMA kernels up to the order
 * of the float sums (and the forward's running maximum taken over 64 keys at a time instead of 32), so the bf16
 * bounds hold; the same blocks, so each gradient still has one writer. The symmetric backward is mma_dkv_kernel's
 * with SYM. */
#define MMA_KT 64 /* rows of a tile of the other side */
/* The exponentials of the tiles with nothing to mask (and all of the forward's) are taken base 2 (exp2_approx,
 * one instruction): exp(x) = 2^(x log2 e), the log2 e folded into the scores' scale. */
#define MMA_LOG2E 1.4426950408889634f
#define MMA_LN2 0.6931471805599453f

/* A tile: MMA_KT rows of the head dim padded to hdp, rows ld bf16 apart (hdp + 8: the 8 row addresses of one
 * ldmatrix matrix fall on different banks). The tiles a kernel walks come in p.bufs buffers: two, the next one
 * loading while the block works on the other (mma_next_tile), or one where a GPU's shared memory per block is
 * short (head dim 128 on sm_86 and sm_89). forward: the K, V pairs; dQ: the block's Q and dO rows, then the K, V
 * pairs; dK/dV: the block's K and V rows, then the Q, dO pairs, then the query tiles' lse and D (float, bufs of
 * each); the symmetric dK/dV (MMA_DKV_SYM) three tiles of each kind: the block's dO rows and each step's values
 * too. ELEMS: a tile's bf16 count. */
template <int NT> struct MmaShape {
    static constexpr int hdp = TC_HD(NT), ld = hdp + 8, ELEMS = MMA_KT * ld;
    static constexpr size_t TILE = (size_t)ELEMS * sizeof(__nv_bfloat16);
    static_assert(TILE % 16 == 0 && TC_ROWS == MMA_KT, "tiles start 16-byte aligned; blocks of 64 rows");
};
enum MmaKernel { MMA_FWD, MMA_DQ, MMA_DKV, MMA_DKV_SYM };
static inline size_t mma_smem(MmaKernel k, int nt, int bufs) {
    size_t tile = (size_t)MMA_KT * (TC_HD(nt) + 8) * sizeof(__nv_bfloat16), n = k == MMA_DKV_SYM ? 3 : 2;
    return k == MMA_FWD ? 2 * bufs * tile
           : k == MMA_DQ ? (2 + 2 * (size_t)bufs) * tile
                         : (n + n * (size_t)bufs) * tile + 2 * (size_t)bufs * MMA_KT * sizeof(float);
}

/* Starts loading rows r0 .. r0+rows-1 of an (n, hd) matrix of X (row stride src_ld) into a bf16 tile (row stride
 * ld, HDP columns), zeros past n and in columns hd .. HDP-1, 16 bytes a thread where hd and src_ld are multiples of
 * that many values and src is 16-byte aligned (the packed roles, and dO's rows where the width allows): 8 bf16
 * with cp.async, which land when the thread waits for the group its next cp_async_commit closes, or 4 floats
 * through registers, rounded on the way; one value a load otherwise. The latter two land at once. */
template <int HDP, typename X>
__device__ __forceinline__ void mma_load_rows(__nv_bfloat16 *dst, int ld, const X *src, size_t src_ld, int r0,
                                              int n, int hd, int rows) {
    constexpr int W = 16 / sizeof(X), VECS = HDP / W; /* values of one load; loads of a tile row */
    static_assert(HDP % W == 0, "whole loads per tile row");
    if (hd % W == 0 && src_ld % W == 0 && (uintptr_t)src % 16 == 0) {
        MMA_ROLLED
        for (int e = threadIdx.x; e < rows * VECS; e += TC_THREADS) {
            int r = e / VECS, d = e % VECS * W;
            const X *at = src + (size_t)(r0 + r) * src_ld + d;
            bool in = r0 + r < n && d < hd;
            if constexpr (sizeof(X) == sizeof(float)) {
                float4 v = {0.0f, 0.0f, 0.0f, 0.0f};
                if (in) v = mem_as<float4>(at);
                mem_put<uint64_t>(dst + r * ld + d,
                                  (uint64_t)pack_bf16x2(v.x, v.y) | (uint64_t)pack_bf16x2(v.z, v.w) << 32);
            } else {
                cp_async16(dst + r * ld + d, in ? at : src, in);
            }
        }
    } else {
        tc_load_rows(dst, ld, src, src_ld, r0, n, hd, HDP, rows);
    }
}

/* Step t's buffer of tiles kept in two buffers, step apart from base (step 0 with one buffer: every step in it) */
template <typename T> __device__ __forceinline__ T *mma_buf(T *base, int step, int t) { return base + (t & 1) * step; }

/* Starts loading keys and values j0 .. j0 + MMA_KT - 1 of a K/V head (K, V: its rows, laid out as p.kv says)
 * into a pair of tiles (K's at pair, V's a tile after it), as one group. */
template <int HDP, typename X>
__device__ __forceinline__ void mma_fetch_kv(__nv_bfloat16 *pair, int ld, const AttnIO<X> &p, const X *K, const X *V,
                                             int j0) {
    mma_load_rows<HDP>(pair, ld, K, p.kv.ld, j0, p.Tk, p.hd, MMA_KT);
    mma_load_rows<HDP>(pair + MMA_KT * ld, ld, V, p.kv.ld, j0, p.Tk, p.hd, MMA_KT);
    cp_async_commit();
}

/* Step t of n over tiles in bufs buffers (step t in buffer t % bufs; fetch(t) starts it, one group each, and the
 * caller starts step 0 before the loop): with two, starts step t + 1 into the other buffer, then waits for step
 * t's copies; with one, starts step t only now (t > 0), the buffer's readers being done, and waits for it. Then a
 * barrier makes the tile the block's. The caller ends the step with a barrier, so that every warp is done with
 * its buffer before a later fetch refills it. */
template <typename F> __device__ __forceinline__ void mma_next_tile(int t, int n, int bufs, F fetch) {
    if (bufs == 1) {
        if (t > 0) fetch(t);
        cp_async_wait<0>();
    } else if (t + 1 < n) {
        fetch(t + 1);
        cp_async_wait<1>();
    } else {
        cp_async_wait<0>();
    }
    __syncthreads();
}

/* acc[n][e] = 0 for every n < N */
template <int N> __device__ __forceinline__ void mma_zero(float (&acc)[N][4]) {
    MMA_UNROLL
    for (int n = 0; n < N; n++) {
        MMA_UNROLL
        for (int e = 0; e < 4; e++) acc[n][e] = 0.0f;
    }
}

/* acc[n] += A . rows^T for the N 8-row groups n of `rows`: A the 16 rows at `arows` (row-major, ld), over the
 * padded head dim (NT steps of 16). The scores Q.K^T, dO.V^T, and transposed K.Q^T, V.dO^T. */
template <int NT, int N>
__device__ __forceinline__ void mma_abt(float (&acc)[N][4], const __nv_bfloat16 *arows, const __nv_bfloat16 *rows,
                                        int ld, int lane) {
    static_assert(N % 2 == 0, "8-row groups in pairs");
    MMA_UNROLL
    for (int ks = 0; ks < NT; ks++) {
        uint32_t a[4];
        mma_a_rows(a, arows, ld, ks, lane);
        MMA_UNROLL
        for (int n = 0; n < N; n += 2) {
            uint32_t bb[2][2];
            mma_b_rows(bb, rows, ld, n, ks, lane);
            mma_bf16_16816(acc[n], a, bb[0]);
            mma_bf16_16816(acc[n + 1], a, bb[1]);
        }
    }
}

/* A backward tile's two products, s = A1 . R1^T and a = A2 . R2^T (from zero): the scores and dO . V^T, or on the
 * key side both transposed (K.Q^T, V.dO^T). */
template <int NT, int N>
__device__ __forceinline__ void mma_scores_dp(float (&s)[N][4], float (&a)[N][4], const __nv_bfloat16 *a1,
                                              const __nv_bfloat16 *r1, const __nv_bfloat16 *a2,
                                              const __nv_bfloat16 *r2, int ld, int lane) {
    mma_zero(s);
    mma_zero(a);
    mma_abt<NT>(s, a1, r1, ld, lane);
    mma_abt<NT>(a, a2, r2, ld, lane);
}

/* out[n] += X . rows for the 2 NT 8-column groups n of the head dim: X the warp's 16 x MMA_KT results in the
 * accumulators x (probabilities, score gradients), rows the tile's MMA_KT rows (row-major, ld). P.V, dS.K,
 * P^T.dO, G^T.Q. */
template <int NT>
__device__ __forceinline__ void mma_xr(float (&out)[2 * NT][4], const float (&x)[MMA_KT / 8][4],
                                       const __nv_bfloat16 *rows, int ld, int lane) {
    MMA_UNROLL
    for (int kk = 0; kk < MMA_KT / 16; kk++) {
        uint32_t a[4];
        mma_a_acc(a, x, kk);
        MMA_UNROLL
        for (int n = 0; n < 2 * NT; n += 2) {
            uint32_t bb[2][2];
            mma_b_cols(bb, rows, ld, kk, n, lane);
            mma_bf16_16816(out[n], a, bb[0]);
            mma_bf16_16816(out[n + 1], a, bb[1]);
        }
    }
}

/* A warp's 16 result rows (accumulators acc over the head dim, times `scale`), each value v of row i, column d
 * given to put(i, d, v) for the lane's rows r[0] and r[1] (rows at or past n left alone) and its columns 2 tq and
 * 2 tq + 1 of each 8 ... */
template <int NT, typename F>
__device__ __forceinline__ void mma_each_result(const int (&r)[2], int n, int hd, const float (&acc)[2 * NT][4],
                                                float scale, int lane, F put) {
    MMA_UNROLL
    for (int h2 = 0; h2 < 2; h2++) {
        if (r[h2] >= n) continue;
        MMA_UNROLL
        for (int c = 0; c < 2 * NT; c++) {
            MMA_UNROLL
            for (int e = 0; e < 2; e++) {
                int d = 8 * c + 2 * (lane % 4) + e;
                if (d < hd) put(r[h2], d, acc[c][2 * h2 + e] * scale);
            }
        }
    }
}
/* ... stored into dst (row stride dst_ld: the output in the activations' type, or floats) ... */
template <int NT, typename T>
__device__ __forceinline__ void mma_write_rows(T *dst, size_t dst_ld, const int (&r)[2], int n, int hd,
                                               const float (&acc)[2 * NT][4], float scale, int lane) {
    mma_each_result<NT>(r, n, hd, acc, scale, lane,
                        [&](int i, int d, float v) { dst[(size_t)i * dst_ld + d] = act_as<T>(v); });
}
/* ... or put as a role's gradient (grad_put) */
template <int NT, typename X>
__device__ __forceinline__ void mma_write_grad(const GradRows<X> &g, const int (&r)[2], int n, int hd,
                                               const float (&acc)[2 * NT][4], float scale, int lane) {
    mma_each_result<NT>(r, n, hd, acc, scale, lane, [&](int i, int d, float v) { grad_put(g, i, d, v); });
}

/* acc's rows times f: the lane's row r[0] (elements 0, 1) by f[0], its row r[1] (2, 3) by f[1] */
template <int N> __device__ __forceinline__ void mma_scale_rows(float (&acc)[N][4], const float (&f)[2]) {
    MMA_UNROLL
    for (int n = 0; n < N; n++) {
        acc[n][0] *= f[0];
        acc[n][1] *= f[0];
        acc[n][2] *= f[1];
        acc[n][3] *= f[1];
    }
}

/* v summed over the 4 lanes that share a row of accumulators */
__device__ __forceinline__ float mma_row_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

/* Whether a call has no per-score work beyond the softmax and +Pos's term (no bias, padding or dropout); of those,
 * mma_plain_call has no +Pos either, mma_pos_call has it. */
__device__ __forceinline__ bool mma_unmasked_call(const AttnDev &p) {
    return !p.pe_bias && !p.pad && p.dropout <= 0.0f;
}
__device__ __forceinline__ bool mma_plain_call(const AttnDev &p) {
    return mma_unmasked_call(p) && !(ATTN_POS && p.pos);
}
__device__ __forceinline__ bool mma_pos_call(const AttnDev &p) { return mma_unmasked_call(p) && ATTN_POS && p.pos; }
/* What a tile of query rows i0.. and keys j0.. (MMA_KT each) needs per score: MMA_PLAIN nothing but the softmax,
 * MMA_POS only +Pos's term (mma_pos_f, mma_pos_g: a row's and a column's part read once, not score_x's four reads
 * and visible's tests per score), MMA_MASKED the whole per-score code. The first two where the tile is whole and
 * every pair of it visible (queries and keys in range; with the causal mask every key at or before every query). */
enum { MMA_MASKED, MMA_POS, MMA_PLAIN };
__device__ __forceinline__ int mma_tile_kind(const AttnDev &p, int i0, int j0) {
    bool whole = i0 + MMA_KT <= p.Tq && j0 + MMA_KT <= p.Tk && (!p.causal || j0 + MMA_KT - 1 <= i0);
    return !whole ? MMA_MASKED : mma_plain_call(p) ? MMA_PLAIN : mma_pos_call(p) ? MMA_POS : MMA_MASKED;
}
/* +Pos's terms of head h as score_x adds them, alpha S + g_j + (f_i + b): query i's f_i + b and key j's g_j. The
 * kernels add them as fmaf(alpha, S, g_j) + (f_i + b), the fused multiply-add written out, so that the compiler's
 * choice of where to fuse cannot differ between the kernels (the symmetric backward's dV equals the general
 * one's bit for bit). */
__device__ __forceinline__ float mma_pos_f(const AttnDev &p, int h, int i) {
    int gi = p.pos_groups == 1 ? 0 : h;
    return p.f[(size_t)gi * p.Tq + i] + p.bias[gi];
}
__device__ __forceinline__ float mma_pos_g(const AttnDev &p, int h, int j) {
    return p.g[(size_t)(p.pos_groups == 1 ? 0 : h) * p.Tk + j];
}

/* forward: one block per (batch, head, 64 query rows), as tc_forward_kernel's */
template <int NT, typename X>
__global__ void __launch_bounds__(TC_THREADS) mma_forward_kernel(AttnIO<X> p, X *out, int o_ld, size_t o_bstride,
                                                                 float *lse) {
    extern __shared__ __align__(128) float tsm[];
    typedef MmaShape<NT> S;
    constexpr int hdp = S::hdp, ld = S::ld, NS = MMA_KT / 8;
    /* the K, V pairs (mma_buf), V a tile after K */
    __nv_bfloat16 *const kv = (__nv_bfloat16 *)tsm;
    const int nb = p.bufs, step = 2 * (nb - 1) * S::ELEMS;
    const int hd = p.hd;
    int tiles = (p.Tq + TC_ROWS - 1) / TC_ROWS;
    int bh = blockIdx.x / tiles, i0 = query_tile(p, tiles) * TC_ROWS;
    int b = bh / p.H, h = bh % p.H, g = h / p.group;
    const X *Q = attn_rows(p.Q, p.q, b, h), *K = attn_rows(p.K, p.kv, b, g), *V = attn_rows(p.V, p.kv, b, g);
    /* lane: rows ir[0] and ir[1] = ir[0] + 8 of the warp's 16, columns 2 tq and 2 tq + 1 of each 8-column tile */
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, tq = lane % 4;
    const int ir[2] = {i0 + warp * 16 + lane / 4, i0 + warp * 16 + lane / 4 + 8};
    uint32_t qa[NT][4]; /* the rows' queries as A operands, one per 16 of the head dim, read once */
    const bool pairs = hd % 2 == 0 && p.q.ld % 2 == 0 && (uintptr_t)Q % 4 == 0; /* every pair 4-byte aligned */
    MMA_UNROLL
    for (int ks = 0; ks < NT; ks++) {
        MMA_UNROLL
        for (int r = 0; r < 4; r++) {
            int i = ir[r & 1], d = 16 * ks + 2 * tq + (r & 2 ? 8 : 0);
            const X *q = Q + (size_t)i * p.q.ld + d;
            if (sizeof(X) == 2 && pairs) { /* bf16 pairs as they are (d even: 4-byte aligned) */
                qa[ks][r] = i < p.Tq && d < hd ? mem_as<uint32_t>(q) : 0u;
            } else {
                float x0 = i < p.Tq && d < hd ? act_ld(q[0]) : 0.0f;
                float x1 = i < p.Tq && d + 1 < hd ? act_ld(q[1]) : 0.0f;
                qa[ks][r] = pack_bf16x2(x0, x1);
            }
        }
    }
    /* m: the rows' running maxima in base 2 (scores times log2 e); l: this lane's share of the row sums */
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    const float sl = p.scale * MMA_LOG2E;
    /* +Pos alone (mma_pos_call): alpha, and the rows' f_i + b */
    float pa = 1.0f, pf[2] = {0.0f, 0.0f};
    if (mma_pos_call(p)) {
        pa = p.alpha[p.pos_groups == 1 ? 0 : h];
        MMA_UNROLL
        for (int r = 0; r < 2; r++) pf[r] = ir[r] < p.Tq ? mma_pos_f(p, h, ir[r]) : 0.0f;
    }
    float o[2 * NT][4];
    mma_zero(o);
    int kend = p.causal ? min(p.Tk, i0 + TC_ROWS) : p.Tk, nkt = (kend + MMA_KT - 1) / MMA_KT;
    auto fetch = [&](int t) { mma_fetch_kv<hdp>(mma_buf(kv, step, t), ld, p, K, V, t * MMA_KT); };
    fetch(0);
    for (int t = 0; t < nkt; t++) {
        const int j0 = t * MMA_KT;
        const __nv_bfloat16 *Ks = mma_buf(kv, step, t), *Vs = Ks + S::ELEMS;
        mma_next_tile(t, nkt, nb, fetch);
        float s[NS][4];
        mma_zero(s);
        MMA_UNROLL
        for (int ks = 0; ks < NT; ks++) {
            MMA_UNROLL
            for (int n = 0; n < NS; n += 2) {
                uint32_t kb[2][2];
                mma_b_rows(kb, Ks, ld, n, ks, lane);
                mma_bf16_16816(s[n], qa[ks], kb[0]);
                mma_bf16_16816(s[n + 1], qa[ks], kb[1]);
            }
        }
        const int kind = mma_tile_kind(p, i0, j0);
        float mt[2] = {-INFINITY, -INFINITY};
        MMA_UNROLL
        for (int n = 0; n < NS; n++) {
            MMA_UNROLL
            for (int e = 0; e < 4; e++) {
                int i = ir[e >> 1], j = j0 + 8 * n + 2 * tq + (e & 1);
                float x = s[n][e] * sl;
                if (kind == MMA_POS)
                    x = (fmaf(pa, s[n][e] * p.scale, mma_pos_g(p, h, j)) + pf[e >> 1]) * MMA_LOG2E;
                else if (kind == MMA_MASKED)
                    x = visible(p, b, i, j) ? score_x(p, h, i, j, s[n][e] * p.scale) * MMA_LOG2E : -INFINITY;
                s[n][e] = x;
                mt[e >> 1] = fmaxf(mt[e >> 1], x);
            }
        }
        float mnew[2], corr[2], st[2] = {0.0f, 0.0f};
        MMA_UNROLL
        for (int r = 0; r < 2; r++) { /* the row's 4 lanes share its maximum */
            mt[r] = fmaxf(mt[r], __shfl_xor_sync(0xffffffffu, mt[r], 1));
            mt[r] = fmaxf(mt[r], __shfl_xor_sync(0xffffffffu, mt[r], 2));
            mnew[r] = fmaxf(m[r], mt[r]);
            corr[r] = mnew[r] == -INFINITY ? 1.0f : exp2_approx(m[r] - mnew[r]); /* nothing seen yet: 0 from -inf */
        }
        MMA_UNROLL
        for (int n = 0; n < NS; n++) {
            MMA_UNROLL
            for (int e = 0; e < 4; e++) { /* masked scores give 0, and so does every score of a row masked so far */
                float x = s[n][e], ev = x == -INFINITY ? 0.0f : exp2_approx(x - mnew[e >> 1]);
                st[e >> 1] += ev;
                if (kind == MMA_MASKED && ev != 0.0f)
                    ev *= keep_factor(p, b, h, ir[e >> 1], j0 + 8 * n + 2 * tq + (e & 1));
                s[n][e] = ev;
            }
        }
        MMA_UNROLL
        for (int r = 0; r < 2; r++) {
            l[r] = l[r] * corr[r] + st[r];
            m[r] = mnew[r];
        }
        mma_scale_rows(o, corr);
        mma_xr<NT>(o, s, Vs, ld, lane);
        __syncthreads();
    }
    float inv[2];
    MMA_UNROLL
    for (int r = 0; r < 2; r++) {
        l[r] = mma_row_sum(l[r]);
        inv[r] = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        if (tq == 0 && ir[r] < p.Tq)
            lse[(size_t)bh * p.Tq + ir[r]] = l[r] > 0.0f ? (m[r] + log2f(l[r])) * MMA_LN2 : -INFINITY;
    }
    mma_scale_rows(o, inv);
    mma_write_rows<NT>(out + (size_t)b * o_bstride + (size_t)h * hd, (size_t)o_ld, ir, p.Tq, hd, o, 1.0f, lane);
}

/* dQ (RoleGrad) per block of 64 query rows; rowacc as dq_kernel's */
template <int NT, typename X>
__global__ void __launch_bounds__(TC_THREADS) mma_dq_kernel(AttnIO<X> p, const X *dout, int o_ld, size_t o_bstride,
                                                            const float *lse, const float *D, RoleGrad<X> dQ,
                                                            float *rowacc) {
    extern __shared__ __align__(128) float tsm[];
    typedef MmaShape<NT> S;
    constexpr int hdp = S::hdp, ld = S::ld, NS = MMA_KT / 8;
    /* the block's Q and dO rows, then the K, V pairs as the forward's */
    __nv_bfloat16 *Qs = (__nv_bfloat16 *)tsm, *dOs = Qs + S::ELEMS, *const kv = dOs + S::ELEMS;
    const int nb = p.bufs, step = 2 * (nb - 1) * S::ELEMS;
    const int hd = p.hd;
    int tiles = (p.Tq + TC_ROWS - 1) / TC_ROWS;
    int bh = blockIdx.x / tiles, i0 = query_tile(p, tiles) * TC_ROWS;
    int b = bh / p.H, h = bh % p.H, g = h / p.group;
    const X *K = attn_rows(p.K, p.kv, b, g), *V = attn_rows(p.V, p.kv, b, g);
    mma_load_rows<hdp>(Qs, ld, attn_rows(p.Q, p.q, b, h), p.q.ld, i0, p.Tq, hd, TC_ROWS);
    mma_load_rows<hdp>(dOs, ld, dout + (size_t)b * o_bstride + (size_t)h * hd, o_ld, i0, p.Tq, hd, TC_ROWS);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, tq = lane % 4;
    const int ir[2] = {i0 + warp * 16 + lane / 4, i0 + warp * 16 + lane / 4 + 8};
    float li[2], li2[2], Di[2], gs[2] = {0.0f, 0.0f}, rs[2] = {0.0f, 0.0f}; /* li2: the lse in base 2 */
    MMA_UNROLL
    for (int r = 0; r < 2; r++) {
        li[r] = ir[r] < p.Tq ? lse[(size_t)bh * p.Tq + ir[r]] : -INFINITY;
        li2[r] = li[r] * MMA_LOG2E;
        Di[r] = ir[r] < p.Tq ? D[(size_t)bh * p.Tq + ir[r]] : 0.0f;
    }
    const float sl = p.scale * MMA_LOG2E;
    float alpha = ATTN_POS && p.pos ? p.alpha[p.pos_groups == 1 ? 0 : h] : 1.0f;
    float pf[2] = {0.0f, 0.0f}; /* +Pos alone (mma_pos_call): the rows' f_i + b */
    if (mma_pos_call(p)) {
        MMA_UNROLL
        for (int r = 0; r < 2; r++) pf[r] = ir[r] < p.Tq ? mma_pos_f(p, h, ir[r]) : 0.0f;
    }
    float dq[2 * NT][4];
    mma_zero(dq);
    int kend = p.causal ? min(p.Tk, i0 + TC_ROWS) : p.Tk, nkt = (kend + MMA_KT - 1) / MMA_KT;
    auto fetch = [&](int t) { mma_fetch_kv<hdp>(mma_buf(kv, step, t), ld, p, K, V, t * MMA_KT); };
    fetch(0); /* with the block's Q and dO rows in its group */
    for (int t = 0; t < nkt; t++) {
        const int j0 = t * MMA_KT;
        const __nv_bfloat16 *Ks = mma_buf(kv, step, t), *Vs = Ks + S::ELEMS;
        mma_next_tile(t, nkt, nb, fetch);
        float s[NS][4], a[NS][4]; /* the scores and dO . V^T */
        mma_scores_dp<NT>(s, a, Qs + warp * 16 * ld, Ks, dOs + warp * 16 * ld, Vs, ld, lane);
        const int kind = mma_tile_kind(p, i0, j0);
        MMA_UNROLL
        for (int n = 0; n < NS; n++) {
            MMA_UNROLL
            for (int e = 0; e < 4; e++) {
                int r = e >> 1, i = ir[r], j = j0 + 8 * n + 2 * tq + (e & 1);
                float sv = s[n][e] * p.scale, gp;
                if (kind == MMA_PLAIN)
                    gp = exp2_approx(fmaf(s[n][e], sl, -li2[r])) * (a[n][e] - Di[r]);
                else if (kind == MMA_POS)
                    gp = exp2_approx(fmaf(fmaf(alpha, sv, mma_pos_g(p, h, j)) + pf[r], MMA_LOG2E, -li2[r])) *
                         (a[n][e] - Di[r]);
                else
                    gp = score_grad(p, b, h, i, j, sv, a[n][e], li[r], Di[r]).gp;
                gs[r] += gp * sv;
                rs[r] += gp;
                s[n][e] = alpha * gp;
            }
        }
        mma_xr<NT>(dq, s, Ks, ld, lane);
        __syncthreads();
    }
    mma_write_grad<NT>(grad_rows(dQ, p.q, b, h, p.H, p.Tq, hd), ir, p.Tq, hd, dq, p.scale, lane);
    if (rowacc) {
        MMA_UNROLL
        for (int r = 0; r < 2; r++) {
            float gsum = mma_row_sum(gs[r]), rsum = mma_row_sum(rs[r]);
            if (tq == 0 && ir[r] < p.Tq) {
                rowacc[((size_t)bh * p.Tq + ir[r]) * 2] = gsum;
                rowacc[((size_t)bh * p.Tq + ir[r]) * 2 + 1] = rsum;
            }
        }
    }
}

/* dK, dV (RoleGrad) per block of 64 keys of one K/V head, over its query heads in order; colacc as
 * dkv_kernel's. The scores are formed transposed (keys as rows: K.Q^T, V.dO^T), so that P^T and G^T are A
 * operands of dV += P^T.dO and dK += G^T.Q.
 * SYM, the symmetric backward (as tc_dkv_kernel's; K is Q, G = H, Tq = Tk, no causal mask): each score S_ji of a
 * tile is also that of the pair (query j, key i), so the block adds that pair's score gradient G'_ji, from one more
 * product dO_j . V_i^T (the block's own dO rows against the query tile's values, a third tile of each step) and
 * row j's lse and D, to G'_ij before dK += G^T.Q, which is then the gradient of both roles, and writes the +Pos
 * row sums of its keys (rowacc as dq_kernel's); no dQ kernel runs. dO_j . V_i^T is formed MMA_SYM_N 8-column
 * groups at a time, so that its accumulators add 4 MMA_SYM_N registers a lane to the general kernel's, not 32. */
#define MMA_SYM_N 4
template <int NT, typename X, bool SYM>
__global__ void __launch_bounds__(TC_THREADS) mma_dkv_kernel(AttnIO<X> p, const X *dout, int o_ld,
                                                             size_t o_bstride, const float *lse, const float *D,
                                                             RoleGrad<X> dK, RoleGrad<X> dV, float *colacc,
                                                             float *rowacc) {
    extern __shared__ __align__(128) float tsm[];
    typedef MmaShape<NT> S;
    constexpr int hdp = S::hdp, ld = S::ld, NS = MMA_KT / 8, TILES = SYM ? 3 : 2, SN = SYM ? MMA_SYM_N : NS;
    static_assert(NS % SN == 0 && SN % 2 == 0, "whole pairs of 8-column groups");
    /* the block's K and V rows (SYM: and its dO rows), then the step tiles, TILES a buffer (mma_buf from qo): Q
     * and dO (SYM: and the query tile's V), then the query tiles' lse and D, nb of each (mma_buf from ld0; a
     * buffer's D nb * MMA_KT floats after its lse) */
    const int nb = p.bufs, step = TILES * (nb - 1) * S::ELEMS, lstep = (nb - 1) * MMA_KT;
    __nv_bfloat16 *Kk = (__nv_bfloat16 *)tsm, *Vk = Kk + S::ELEMS, *dOk = Vk + S::ELEMS;
    __nv_bfloat16 *const qo = Kk + TILES * S::ELEMS; /* the block's own rows are TILES tiles too */
    float *const ld0 = (float *)(qo + TILES * nb * S::ELEMS);
    const int hd = p.hd;
    int tiles = (p.Tk + TC_ROWS - 1) / TC_ROWS;
    int bg = blockIdx.x / tiles, j0 = (blockIdx.x % tiles) * TC_ROWS;
    int b = bg / p.G, g = bg % p.G;
    const X *K = attn_rows(p.K, p.kv, b, g), *V = attn_rows(p.V, p.kv, b, g);
    mma_load_rows<hdp>(Kk, ld, K, p.kv.ld, j0, p.Tk, hd, TC_ROWS);
    mma_load_rows<hdp>(Vk, ld, V, p.kv.ld, j0, p.Tk, hd, TC_ROWS);
    if (SYM) /* G = H: head g */
        mma_load_rows<hdp>(dOk, ld, dout + (size_t)b * o_bstride + (size_t)g * hd, o_ld, j0, p.Tq, hd, TC_ROWS);
    /* lane: keys jr[0] and jr[1] = jr[0] + 8 of the warp's 16, queries 2 tq and 2 tq + 1 of each 8 of a tile */
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, tq = lane % 4;
    const int jr[2] = {j0 + warp * 16 + lane / 4, j0 + warp * 16 + lane / 4 + 8};
    const float sl = p.scale * MMA_LOG2E;
    /* SYM: the keys' rows as queries of the one head (bg is its (batch, head)): their lse, in base 2 too, and D */
    float lk[2] = {-INFINITY, -INFINITY}, lk2[2] = {-INFINITY, -INFINITY}, Dk[2] = {0.0f, 0.0f};
    if (SYM) {
        MMA_UNROLL
        for (int r = 0; r < 2; r++)
            if (jr[r] < p.Tq) {
                lk[r] = lse[(size_t)bg * p.Tq + jr[r]];
                lk2[r] = lk[r] * MMA_LOG2E;
                Dk[r] = D[(size_t)bg * p.Tq + jr[r]];
            }
    }
    float dk[2 * NT][4], dv[2 * NT][4];
    mma_zero(dk);
    mma_zero(dv);
    /* the steps: the block's query heads in order, each over its query tiles from istart (causal: queries before
     * j0 see none; at least one tile, so that every head's column sums are written) */
    const int istart = p.causal ? j0 : 0, nqt = max(1, (p.Tq - istart + MMA_KT - 1) / MMA_KT), steps = p.group * nqt;
    auto fetch = [&](int t) {
        int h = g * p.group + t / nqt, i0 = istart + t % nqt * MMA_KT, bh = b * p.H + h;
        __nv_bfloat16 *q = mma_buf(qo, step, t);
        float *l = mma_buf(ld0, lstep, t);
        mma_load_rows<hdp>(q, ld, attn_rows(p.Q, p.q, b, h), p.q.ld, i0, p.Tq, hd, MMA_KT);
        mma_load_rows<hdp>(q + S::ELEMS, ld, dout + (size_t)b * o_bstride + (size_t)h * hd, o_ld, i0, p.Tq, hd, MMA_KT);
        if (SYM) mma_load_rows<hdp>(q + 2 * S::ELEMS, ld, V, p.kv.ld, i0, p.Tk, hd, MMA_KT);
        for (int r = threadIdx.x; r < MMA_KT; r += TC_THREADS) {
            bool in = i0 + r < p.Tq;
            l[r] = in ? lse[(size_t)bh * p.Tq + i0 + r] : -INFINITY;
            l[nb * MMA_KT + r] = in ? D[(size_t)bh * p.Tq + i0 + r] : 0.0f;
        }
        cp_async_commit();
    };
    fetch(0); /* with the block's own rows in its group */
    float cs[2] = {0.0f, 0.0f}, gr[2] = {0.0f, 0.0f}, rq[2] = {0.0f, 0.0f}; /* SYM: row sums of G'_ji S_ji, G'_ji */
    for (int t = 0; t < steps; t++) {
        const int qt = t % nqt, h = g * p.group + t / nqt, bh = b * p.H + h, i0 = istart + qt * MMA_KT;
        const float alpha = ATTN_POS && p.pos ? p.alpha[p.pos_groups == 1 ? 0 : h] : 1.0f;
        const __nv_bfloat16 *Qs = mma_buf(qo, step, t), *dOs = Qs + S::ELEMS, *Vq = dOs + S::ELEMS;
        const float *ls = mma_buf(ld0, lstep, t), *Ds = ls + nb * MMA_KT;
        if (qt == 0) cs[0] = cs[1] = gr[0] = gr[1] = rq[0] = rq[1] = 0.0f;
        float kg[2] = {0.0f, 0.0f}, kf[2] = {0.0f, 0.0f}; /* +Pos alone: the keys' g_j (SYM: and, as queries, f_j + b) */
        if (mma_pos_call(p)) {
            MMA_UNROLL
            for (int r = 0; r < 2; r++) {
                kg[r] = jr[r] < p.Tk ? mma_pos_g(p, h, jr[r]) : 0.0f;
                if (SYM) kf[r] = jr[r] < p.Tq ? mma_pos_f(p, h, jr[r]) : 0.0f;
            }
        }
        mma_next_tile(t, steps, nb, fetch);
        float st[NS][4], at[NS][4]; /* the scores and dO . V^T, transposed */
        mma_scores_dp<NT>(st, at, Kk + warp * 16 * ld, Qs, Vk + warp * 16 * ld, dOs, ld, lane);
        const int kind = mma_tile_kind(p, i0, j0); /* SYM: no causal mask and Tq = Tk, so (j0, i0)'s is the same */
        MMA_UNROLL
        for (int n0 = 0; n0 < NS; n0 += SN) {
            float aq[SN][4]; /* SYM: dO_j . V_i^T of the 8-column groups n0 .. n0 + SN - 1 */
            if (SYM) {
                mma_zero(aq);
                mma_abt<NT>(aq, dOk + warp * 16 * ld, Vq + n0 * 8 * ld, ld, lane);
            }
            MMA_UNROLL
            for (int n = n0; n < n0 + SN; n++) {
                MMA_UNROLL
                for (int e = 0; e < 4; e++) {
                    int r = e >> 1, c = 8 * n + 2 * tq + (e & 1), j = jr[r];
                    float sv = st[n][e] * p.scale, pt, gp;
                    if (kind == MMA_PLAIN) {
                        pt = exp2_approx(fmaf(st[n][e], sl, -ls[c] * MMA_LOG2E));
                        gp = pt * (at[n][e] - Ds[c]);
                    } else if (kind == MMA_POS) {
                        float x = fmaf(alpha, sv, kg[r]) + mma_pos_f(p, h, i0 + c);
                        pt = exp2_approx(fmaf(x, MMA_LOG2E, -ls[c] * MMA_LOG2E));
                        gp = pt * (at[n][e] - Ds[c]);
                    } else {
                        ScoreGrad sg = score_grad(p, b, h, i0 + c, j, sv, at[n][e], ls[c], Ds[c]);
                        pt = sg.a * sg.kf;
                        gp = sg.gp;
                    }
                    cs[r] += gp;
                    float gk = gp;
                    if (SYM) { /* the pair as (query j, key i0 + c) */
                        float gq;
                        if (kind == MMA_PLAIN)
                            gq = exp2_approx(fmaf(st[n][e], sl, -lk2[r])) * (aq[n - n0][e] - Dk[r]);
                        else if (kind == MMA_POS)
                            gq = exp2_approx(fmaf(fmaf(alpha, sv, mma_pos_g(p, h, i0 + c)) + kf[r], MMA_LOG2E,
                                                  -lk2[r])) *
                                 (aq[n - n0][e] - Dk[r]);
                        else
                            gq = score_grad(p, b, h, j, i0 + c, sv, aq[n - n0][e], lk[r], Dk[r]).gp;
                        gk += gq;
                        gr[r] += gq * sv;
                        rq[r] += gq;
                    }
                    st[n][e] = pt;
                    at[n][e] = alpha * gk;
                }
            }
        }
        mma_xr<NT>(dv, st, dOs, ld, lane);
        mma_xr<NT>(dk, at, Qs, ld, lane);
        __syncthreads();
        if (qt == nqt - 1) { /* the head's last tile: its column sums, and SYM's row sums */
            MMA_UNROLL
            for (int r = 0; r < 2; r++) {
                if (colacc) { /* uniform over the block: every lane takes the shuffles or none does */
                    float sum = mma_row_sum(cs[r]);
                    if (tq == 0 && jr[r] < p.Tk) colacc[(size_t)bh * p.Tk + jr[r]] = sum;
                }
                if (SYM && rowacc) {
                    float gsum = mma_row_sum(gr[r]), rsum = mma_row_sum(rq[r]);
                    if (tq == 0 && jr[r] < p.Tq) {
                        rowacc[((size_t)bh * p.Tq + jr[r]) * 2] = gsum;
                        rowacc[((size_t)bh * p.Tq + jr[r]) * 2 + 1] = rsum;
                    }
                }
            }
        }
    }
    /* the key's first, then the value's: KV tying's and K's share their rows, and a lane writes the same elements of
     * both */
    mma_write_grad<NT>(grad_rows(dK, p.kv, b, g, p.G, p.Tk, hd), jr, p.Tk, hd, dk, p.scale, lane);
    mma_write_grad<NT>(grad_rows(dV, p.kv, b, g, p.G, p.Tk, hd), jr, p.Tk, hd, dv, 1.0f, lane);
}

#endif
