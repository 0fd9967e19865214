/* The CUDA attention kernels of training (kernels/cuda/attention_kernels.cuh)
 * and the ops kernels of kernels/cuda/ops_kernels.cuh run on the CPU under
 * tests/cuda_emu.h, so that every build, with or without a GPU, checks them.
 * The attention kernels:
 *  - the fp32 kernels' forward against a float64 reference (output and
 *    log-sum-exp within 2e-5 of the largest): the emulation runs kernels
 *    that an H100 run verified, so this checks the emulation too;
 *  - the tensor-core (TF32 WMMA) kernels against the fp32 kernels on the
 *    same inputs, once with TF32 rounding turned off (then the two paths
 *    differ only in the order of float32 sums: output 2e-5, gradients
 *    and +Pos sums 1e-4 of the largest) and once rounding as the hardware
 *    does (the TF32 bounds of tc_bounds.h: forward against the float64
 *    reference, gradients against the fp32 kernels);
 *  - the bf16 tensor-core kernels (bf16 operand tiles, m16n16k16) at the
 *    bf16 bounds of tc_bounds.h;
 * over head dims 8 to 128 (padded tiles), causal and bidirectional masks,
 * key padding with fully masked rows, dropout, grouped K/V heads, cross
 * attention (Tq != Tk), +Pos (shared and per head) and the relative
 * position bias table. Then the emulated runtime and cuBLAS on which the whole
 * CUDA backend runs under make CUDA_EMU=1 (tests/cuda_emu_runtime.h): the
 * launches a GPU refuses, two-dimensional grids, __syncthreads_count and
 * atomics, the order of threads and blocks (forward, or reversed to show
 * races), cudaMalloc's unwritten memory, and the products (every transpose,
 * beta 0 over NaN, TF32 and bf16 rounding of the inputs) against float64.
 * One configuration builds and runs it (tests/Makefile): what it runs does
 * not depend on the configuration. */
#include "cuda_emu_runtime.h"

extern "C" {
#include "adamw.h"
#include "attention.h"
#include "hash.h"
#include "kernels.h"
#include "tc_bounds.h"
#include "test.h"
}
/* The kernels read +Pos through ATTN_POS, a constant of the build; here it is on, so that one program checks
 * both the calls with +Pos (p.pos = 1) and those without (p.pos = 0) whatever the configuration. */
#undef ATTN_POS
#define ATTN_POS 1
#include "../kernels/cuda/warp.cuh"
#include "../kernels/cuda/attention_kernels.cuh"
#include "../kernels/cuda/ops_kernels.cuh"

extern float sm[], tsm[]; /* the kernels' dynamic shared memory (tests/cuda_emu_runtime.cpp) */

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static float urand(void) { /* uniform in [-1, 1) */
    rng ^= rng >> 12, rng ^= rng << 25, rng ^= rng >> 27;
    return (float)((double)((rng * 0x2545F4914F6CDD1Dull) >> 11) * (2.0 / 9007199254740992.0) - 1.0);
}
static std::vector<float> rand_vec(size_t n, float scale) {
    std::vector<float> v(n);
    for (float &x : v) x = scale * urand();
    return v;
}

struct Case {
    const char *name;
    int B, H, G, Tq, Tk, hd, causal, pad, pos, pos_groups, pe;
    float dropout;
    int sym; /* K is Q (KV, K: G = H, Tq = Tk): the symmetric backward too (check_symmetric) */
};

/* The inputs of one case (the roles as float; run_path gives them to the kernels in the activations' type) and the
 * outputs of one path. */
struct Problem {
    Case c;
    AttnDev p;
    std::vector<float> Q, K, V, dout, f, g, alpha, bias, pe;
    std::vector<unsigned char> pad;
};
struct Result {
    std::vector<float> out, lse, dQ, dK, dV, rowacc, colacc;
};

static Problem make_problem(const Case &c) {
    Problem pr;
    pr.c = c;
    int C = c.H * c.hd;
    pr.Q = rand_vec((size_t)c.B * c.H * c.Tq * c.hd, 1.5f);
    pr.K = c.sym ? pr.Q : rand_vec((size_t)c.B * c.G * c.Tk * c.hd, 1.5f);
    pr.V = rand_vec((size_t)c.B * c.G * c.Tk * c.hd, 1.0f);
    pr.dout = rand_vec((size_t)c.B * c.Tq * C, 1.0f);
    AttnDev &p = pr.p;
    memset(&p, 0, sizeof p);
    p.B = c.B, p.Tq = c.Tq, p.Tk = c.Tk, p.H = c.H, p.G = c.G, p.group = c.H / c.G, p.hd = c.hd;
    p.causal = c.causal;
    p.scale = 1.0f / sqrtf((float)c.hd);
    p.dropout = c.dropout;
    p.dscale = 1.0f / (1.0f - c.dropout);
    p.thr = (uint32_t)(c.dropout * 16777216.0f);
    p.seed = 0x1234567ull + (uint64_t)c.hd;
    p.batch_first = 1; /* as rank 1 of a split batch: the global row index reaches the dropout hash */
    p.bufs = 2;        /* the mma kernels' tile buffers, as on a GPU with the shared memory for two */
    if (c.pad) { /* batch b pads its last 3 (b + 1) keys; the last batch of a 'pad = 2' case pads them all */
        pr.pad.assign((size_t)c.B * c.Tk, 0);
        for (int b = 0; b < c.B; b++)
            for (int j = 0; j < c.Tk; j++)
                pr.pad[(size_t)b * c.Tk + j] = (c.pad == 2 && b == c.B - 1) || j >= c.Tk - 3 * (b + 1);
        p.pad = pr.pad.data();
    }
    if (c.pos) {
        int Gp = c.pos_groups;
        pr.f = rand_vec((size_t)Gp * c.Tq, 0.5f);
        pr.g = rand_vec((size_t)Gp * c.Tk, 0.5f);
        pr.alpha = rand_vec((size_t)Gp, 1.0f);
        pr.bias = rand_vec((size_t)Gp, 0.3f);
        p.pos = 1, p.pos_groups = Gp;
        p.f = pr.f.data(), p.g = pr.g.data(), p.alpha = pr.alpha.data(), p.bias = pr.bias.data();
    }
    if (c.pe) {
        p.pe_nd = c.Tq + c.Tk - 1;
        pr.pe = rand_vec((size_t)c.H * p.pe_nd, 0.8f);
        p.pe_bias = pr.pe.data();
    }
    return pr;
}

/* float64 forward: out (B, Tq, H hd) and lse (B, H, Tq) */
static void reference_forward(const Problem &pr, std::vector<double> &out, std::vector<double> &lse) {
    const Case &c = pr.c;
    const AttnDev &p = pr.p;
    int C = c.H * c.hd;
    out.assign((size_t)c.B * c.Tq * C, 0.0);
    lse.assign((size_t)c.B * c.H * c.Tq, 0.0);
    std::vector<double> x((size_t)c.Tk);
    for (int b = 0; b < c.B; b++)
        for (int h = 0; h < c.H; h++) {
            int g = h / p.group;
            for (int i = 0; i < c.Tq; i++) {
                const float *q = &pr.Q[(((size_t)b * c.H + h) * c.Tq + i) * c.hd];
                double m = -INFINITY;
                for (int j = 0; j < c.Tk; j++) {
                    bool vis = (!c.causal || j <= i) && (!c.pad || !pr.pad[(size_t)b * c.Tk + j]);
                    const float *k = &pr.K[(((size_t)b * c.G + g) * c.Tk + j) * c.hd];
                    double s = 0.0;
                    for (int d = 0; d < c.hd; d++) s += (double)q[d] * k[d];
                    s *= p.scale;
                    if (c.pos) {
                        int gi = c.pos_groups == 1 ? 0 : h;
                        s = pr.alpha[gi] * s + pr.g[(size_t)gi * c.Tk + j] + pr.f[(size_t)gi * c.Tq + i] + pr.bias[gi];
                    }
                    if (c.pe) s += pr.pe[(size_t)h * p.pe_nd + (j - i) + c.Tq - 1];
                    x[j] = vis ? s : -INFINITY;
                    m = std::max(m, x[j]);
                }
                size_t orow = ((size_t)b * c.Tq + i) * C + (size_t)h * c.hd;
                if (m == -INFINITY) { /* every key masked: zeros, lse -inf */
                    lse[((size_t)b * c.H + h) * c.Tq + i] = -INFINITY;
                    continue;
                }
                double l = 0.0;
                for (int j = 0; j < c.Tk; j++) l += x[j] == -INFINITY ? 0.0 : exp(x[j] - m);
                for (int j = 0; j < c.Tk; j++) {
                    if (x[j] == -INFINITY) continue;
                    size_t idx = (((size_t)(p.batch_first + b) * c.H + h) * c.Tq + i) * c.Tk + j;
                    double keep = c.dropout > 0 ? (dropout_keep(p.seed, idx, p.thr) ? p.dscale : 0.0) : 1.0;
                    double a = exp(x[j] - m) / l * keep;
                    const float *v = &pr.V[(((size_t)b * c.G + g) * c.Tk + j) * c.hd];
                    for (int d = 0; d < c.hd; d++) out[orow + d] += a * v[d];
                }
                lse[((size_t)b * c.H + h) * c.Tq + i] = m + log(l);
            }
        }
}

/* The tensor-core kernels with operand tiles of E (float: TF32, __nv_bfloat16: bf16) on activations of X, the
 * forward as kernels/cuda/attention.cu launches it: bf16's with the scores in registers (mma_forward_kernel)
 * unless wmma. */
template <typename E, typename X>
static void tc_forward(const Case &c, const AttnIO<X> &p, X *out, int o_ld, size_t o_bs, float *lse, bool wmma) {
    int nt = tc_nt(c.hd);
    unsigned grid = (unsigned)(c.B * c.H * ((c.Tq + TC_ROWS - 1) / TC_ROWS));
    if constexpr (std::is_same<E, __nv_bfloat16>::value)
        if (!wmma) {
            auto k = ATT_PICK(mma_forward_kernel, nt, X);
            emu::launch(grid, TC_THREADS, mma_smem(MMA_FWD, nt, p.bufs), tsm, [&] { k(p, out, o_ld, o_bs, lse); });
            return;
        }
    auto k = TC_PICK(tc_forward_kernel, nt, E, X);
    emu::launch(grid, TC_THREADS, tc_smem_forward<E>(nt), tsm, [&] { k(p, out, o_ld, o_bs, lse); });
}
/* The backward as kernels/cuda/attention.cu launches it: with sym no dQ kernel, dK of both roles; bf16's with the
 * scores in registers unless wmma. */
template <typename E, typename X>
static void tc_backward(const Case &c, const AttnIO<X> &p, bool sym, const X *dout, int o_ld, size_t o_bs,
                        const float *L, const float *Dp, RoleGrad<X> dQ, RoleGrad<X> dK, RoleGrad<X> dV,
                        float *rowacc, float *colacc, bool wmma) {
    int nt = tc_nt(c.hd);
    unsigned gq = (unsigned)(c.B * c.H * ((c.Tq + TC_ROWS - 1) / TC_ROWS));
    unsigned gk = (unsigned)(c.B * c.G * ((c.Tk + TC_ROWS - 1) / TC_ROWS));
    if constexpr (std::is_same<E, __nv_bfloat16>::value)
        if (!wmma) {
            auto kq = ATT_PICK(mma_dq_kernel, nt, X);
            auto kk = ATT_PICK_SYM(mma_dkv_kernel, nt, X, sym);
            if (!sym)
                emu::launch(gq, TC_THREADS, mma_smem(MMA_DQ, nt, p.bufs), tsm,
                            [&] { kq(p, dout, o_ld, o_bs, L, Dp, dQ, rowacc); });
            emu::launch(gk, TC_THREADS, mma_smem(sym ? MMA_DKV_SYM : MMA_DKV, nt, p.bufs), tsm,
                        [&] { kk(p, dout, o_ld, o_bs, L, Dp, dK, dV, colacc, rowacc); });
            return;
        }
    auto kq = TC_PICK(tc_dq_kernel, nt, E, X);
    auto kk = TC_PICK_SYM(tc_dkv_kernel, nt, E, X, sym);
    if (!sym)
        emu::launch(gq, TC_THREADS, tc_smem_backward<E>(nt), tsm, [&] { kq(p, dout, o_ld, o_bs, L, Dp, dQ, rowacc); });
    emu::launch(gk, TC_THREADS, sym ? tc_smem_backward_sym<E>(nt) : tc_smem_backward<E>(nt), tsm,
                [&] { kk(p, dout, o_ld, o_bs, L, Dp, dK, dV, colacc, rowacc); });
}

/* BF16_WMMA: bf16's WMMA kernels (tc_forward_kernel, tc_dq_kernel, tc_dkv_kernel), which attention.cu runs with
 * attention_set_mma_path(0), held to the same bounds as the kernels with the scores in registers. */
enum Path { FP32, TF32, BF16, BF16_WMMA };

/* v in the activations' type X (rounded to bf16, or as it is) */
template <typename X> static std::vector<X> as_act(const std::vector<float> &v) {
    std::vector<X> x(v.size());
    for (size_t i = 0; i < v.size(); i++) x[i] = act_as<X>(v[i]);
    return x;
}

/* v's values moved shift places up (the first shift NaN), and where they now start: a buffer that starts shift
 * values past its allocation's 16-byte aligned start (std::vector's, as malloc's) */
template <typename X> static X *shifted(std::vector<X> &v, int shift) {
    v.insert(v.begin(), (size_t)shift, act_as<X>(NAN));
    return v.data() + shift;
}

/* A role's rows (packed (B, heads, T, hd)) in the activations' type X, laid out as the kernels read them: packed
 * as they are, or (in_place) as attention.cu reads a projection in place, rows of heads hd values and 8 more apart
 * (a wider projection's other blocks), those 8 NaN so that a read past the head's columns shows. */
template <typename X>
static std::vector<X> role_rows(const std::vector<float> &packed, int B, int heads, int T, int hd, bool in_place,
                                AttnRows *lay) {
    if (!in_place) {
        *lay = AttnRows{(size_t)heads * T * hd, (size_t)T * hd, hd};
        return as_act<X>(packed);
    }
    int ld = heads * hd + 8;
    *lay = AttnRows{(size_t)T * ld, (size_t)hd, ld};
    std::vector<X> rows((size_t)B * T * ld, act_as<X>(NAN));
    for (int b = 0; b < B; b++)
        for (int h = 0; h < heads; h++)
            for (int t = 0; t < T; t++)
                for (int d = 0; d < hd; d++)
                    rows[(size_t)b * lay->bstride + (size_t)t * ld + (size_t)h * hd + d] =
                        act_as<X>(packed[(((size_t)b * heads + h) * T + t) * hd + d]);
    return rows;
}

/* Where a path's backward puts a role's gradient (RoleGrad), as attention.cu gives it: packed float32 (packed, of
 * the problem's shape), or with in_place the rows of a wider matrix laid out as the role's (lay, role_rows), of
 * the activations' type X, added to. Those rows start as small values (grad_start) in the role's columns, so that
 * a write in place of an add shows, and GRAD_SENTINEL in the others, so that a write outside them shows; with
 * shift, the rows start that many values (also GRAD_SENTINEL) past the allocation's start. */
static const float GRAD_SENTINEL = 1024.0f; /* exact in bf16 */
static float grad_start(size_t k) { return (float)((int)(k * 37 % 7) - 3) / 128.0f; }
template <typename X> struct GradDest {
    std::vector<X> rows;
    RoleGrad<X> rg;
};
template <typename X>
static void grad_dest(GradDest<X> &g, std::vector<float> &packed, const AttnRows &lay, int B, int heads, int T,
                      int hd, bool in_place, int shift) {
    if (!in_place) {
        g.rg = RoleGrad<X>{packed.data(), nullptr};
        return;
    }
    g.rows.assign((size_t)shift + (size_t)B * lay.bstride, act_as<X>(GRAD_SENTINEL));
    for (int b = 0; b < B; b++)
        for (int h = 0; h < heads; h++)
            for (int t = 0; t < T; t++)
                for (int d = 0; d < hd; d++) {
                    size_t k = (((size_t)b * heads + h) * T + t) * hd + d;
                    size_t at = (size_t)shift + (size_t)b * lay.bstride + (size_t)h * lay.hstride +
                                (size_t)t * lay.ld + d;
                    g.rows[at] = act_as<X>(grad_start(k));
                }
    g.rg = RoleGrad<X>{nullptr, g.rows.data() + shift};
}
/* ... in place: what the backward added, into packed (as the packed form holds it); returns how many values outside
 * the role's columns changed */
template <typename X>
static size_t grad_added(const GradDest<X> &g, std::vector<float> &packed, const AttnRows &lay, int B, int heads,
                         int T, int hd) {
    if (g.rows.empty()) return 0;
    size_t shift = (size_t)(g.rg.rows - g.rows.data()); /* grad_dest's */
    std::vector<char> role(g.rows.size(), 0);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < heads; h++)
            for (int t = 0; t < T; t++)
                for (int d = 0; d < hd; d++) {
                    size_t k = (((size_t)b * heads + h) * T + t) * hd + d;
                    size_t at = shift + (size_t)b * lay.bstride + (size_t)h * lay.hstride +
                                (size_t)t * lay.ld + d;
                    role[at] = 1;
                    packed[k] = act_ld(g.rows[at]) - act_ld(act_as<X>(grad_start(k)));
                }
    size_t changed = 0;
    for (size_t i = 0; i < g.rows.size(); i++) changed += !role[i] && act_ld(g.rows[i]) != GRAD_SENTINEL;
    return changed;
}

/* One path's forward, then its backward on the common inputs (the fp32 path's out and lse, D from them), the
 * roles, the output and its gradient in the activations' type X (float, or bf16 as CUDA_BF16 builds give them);
 * sym: the symmetric backward (no dQ kernel: dQ stays NaN, dK holds both roles); bufs: the mma kernels' tile
 * buffers (1 as where shared memory is short); in_place: the roles in rows of a wider matrix (role_rows), and their
 * gradients added into such rows (grad_dest), as attention.cu runs the kernels without RoPE; shift: every buffer
 * of X (the roles, the output and its gradient, the gradients' rows) starts that many values past its allocation's
 * start (shifted). */
template <typename X = float>
static Result run_path(const Problem &pr, Path path, const Result *fwd_of, bool sym = false, int bufs = 2,
                       bool in_place = false, int shift = 0) {
    const Case &c = pr.c;
    AttnIO<X> p;
    static_cast<AttnDev &>(p) = pr.p;
    p.bufs = bufs;
    std::vector<X> Q = role_rows<X>(pr.Q, c.B, c.H, c.Tq, c.hd, in_place, &p.q);
    std::vector<X> K = role_rows<X>(pr.K, c.B, c.G, c.Tk, c.hd, in_place, &p.kv); /* V's layout is K's */
    std::vector<X> V = role_rows<X>(pr.V, c.B, c.G, c.Tk, c.hd, in_place, &p.kv), dO = as_act<X>(pr.dout);
    p.Q = shifted(Q, shift), p.K = shifted(K, shift), p.V = shifted(V, shift);
    int C = c.H * c.hd, hd = c.hd, o_ld = C;
    size_t o_bs = (size_t)c.Tq * C;
    Result r;
    std::vector<X> outx((size_t)c.B * c.Tq * C, act_as<X>(NAN));
    r.lse.assign((size_t)c.B * c.H * c.Tq, NAN);
    X *out = shifted(outx, shift);
    float *lse = r.lse.data();
    if (path == TF32) {
        tc_forward<float>(c, p, out, o_ld, o_bs, lse, false);
    } else if (path == BF16 || path == BF16_WMMA) {
        tc_forward<__nv_bfloat16>(c, p, out, o_ld, o_bs, lse, path == BF16_WMMA);
    } else {
        unsigned grid = (unsigned)(c.B * c.H * ((c.Tq + BR - 1) / BR));
        auto k = ATT_PICK(forward_kernel, att_npl(hd), X);
        emu::launch(grid, ATT_THREADS, att_smem_forward(hd), sm, [&] { k(p, out, o_ld, o_bs, lse); });
    }
    r.out.resize(outx.size() - (size_t)shift);
    for (size_t i = 0; i < r.out.size(); i++) r.out[i] = act_ld(out[i]);
    if (!fwd_of) fwd_of = &r;
    const X *dout = shifted(dO, shift);
    /* D = dO . O per row, from the common forward */
    std::vector<float> D((size_t)c.B * c.H * c.Tq);
    for (int b = 0; b < c.B; b++)
        for (int h = 0; h < c.H; h++)
            for (int i = 0; i < c.Tq; i++) {
                size_t off = (size_t)b * o_bs + (size_t)i * o_ld + (size_t)h * hd;
                double s = 0.0;
                for (int d = 0; d < hd; d++) s += (double)act_ld(dout[off + d]) * fwd_of->out[off + d];
                D[((size_t)b * c.H + h) * c.Tq + i] = (float)s;
            }
    r.dQ.assign(pr.Q.size(), NAN);
    r.dK.assign(pr.K.size(), NAN);
    r.dV.assign(pr.V.size(), NAN);
    if (c.pos) {
        r.rowacc.assign((size_t)c.B * c.H * c.Tq * 2, NAN);
        r.colacc.assign((size_t)c.B * c.H * c.Tk, NAN);
    }
    const float *L = fwd_of->lse.data(), *Dp = D.data();
    GradDest<X> gq, gk, gv;
    grad_dest(gq, r.dQ, p.q, c.B, c.H, c.Tq, hd, in_place, shift);
    grad_dest(gk, r.dK, p.kv, c.B, c.G, c.Tk, hd, in_place, shift);
    grad_dest(gv, r.dV, p.kv, c.B, c.G, c.Tk, hd, in_place, shift);
    RoleGrad<X> dQ = gq.rg, dK = gk.rg, dV = gv.rg;
    float *rowacc = c.pos ? r.rowacc.data() : nullptr, *colacc = c.pos ? r.colacc.data() : nullptr;
    if (path == TF32) {
        tc_backward<float>(c, p, sym, dout, o_ld, o_bs, L, Dp, dQ, dK, dV, rowacc, colacc, false);
    } else if (path == BF16 || path == BF16_WMMA) {
        tc_backward<__nv_bfloat16>(c, p, sym, dout, o_ld, o_bs, L, Dp, dQ, dK, dV, rowacc, colacc, path == BF16_WMMA);
    } else {
        unsigned gq = (unsigned)(c.B * c.H * ((c.Tq + BR - 1) / BR));
        unsigned gk = (unsigned)(c.B * c.G * ((c.Tk + BC - 1) / BC));
        auto kq = ATT_PICK(dq_kernel, att_npl(hd), X);
        auto kk = ATT_PICK_SYM(dkv_kernel, att_npl(hd), X, sym);
        if (!sym)
            emu::launch(gq, ATT_THREADS, att_smem_dq(hd), sm, [&] { kq(p, dout, o_ld, o_bs, L, Dp, dQ, rowacc); });
        emu::launch(gk, ATT_THREADS, att_smem_dkv(hd, sym), sm,
                    [&] { kk(p, dout, o_ld, o_bs, L, Dp, dK, dV, colacc, rowacc); });
    }
    if (in_place) {
        size_t outside = grad_added(gq, r.dQ, p.q, c.B, c.H, c.Tq, hd);
        outside += grad_added(gk, r.dK, p.kv, c.B, c.G, c.Tk, hd) + grad_added(gv, r.dV, p.kv, c.B, c.G, c.Tk, hd);
        CHECK(outside == 0, "%s: the backward changed %zu values outside the roles' columns of the gradient's rows",
              c.name, outside);
        if (sym) { /* no dQ kernel: the query's rows as they were, and NaN as the packed form leaves them */
            size_t touched = 0;
            for (float v : r.dQ) touched += v != 0.0f;
            CHECK(touched == 0, "%s: the symmetric backward changed %zu values of the query's gradient rows", c.name,
                  touched);
            std::fill(r.dQ.begin(), r.dQ.end(), NAN);
        }
    }
    return r;
}

/* How many values of a and b differ in their bits (NaN where both have the same NaN counts as equal) */
static size_t bits_differ(const Result &a, const Result &b) {
    const std::vector<float> *av[] = {&a.out, &a.lse, &a.dQ, &a.dK, &a.dV, &a.rowacc, &a.colacc};
    const std::vector<float> *bv[] = {&b.out, &b.lse, &b.dQ, &b.dK, &b.dV, &b.rowacc, &b.colacc};
    size_t n = 0;
    for (int k = 0; k < 7; k++) {
        if (av[k]->size() != bv[k]->size()) return SIZE_MAX;
        for (size_t i = 0; i < av[k]->size(); i++) n += memcmp(&(*av[k])[i], &(*bv[k])[i], sizeof(float)) != 0;
    }
    return n;
}

/* max |a - b| over max |b| (finite entries of b; an entry where one is finite and the other not counts as 1) */
template <typename T> static double rel_err(const std::vector<float> &a, const std::vector<T> &b) {
    double m = 0.0, e = 0.0;
    for (size_t i = 0; i < b.size(); i++)
        if (std::isfinite((double)b[i])) m = std::max(m, fabs((double)b[i]));
    for (size_t i = 0; i < b.size(); i++) {
        bool fa = std::isfinite((double)a[i]), fb = std::isfinite((double)b[i]);
        if (fa != fb || (!fb && (double)a[i] != (double)b[i])) return 1.0;
        if (fb) e = std::max(e, fabs((double)a[i] - (double)b[i]));
    }
    return m > 0 ? e / m : e;
}

/* The symmetric backward of a case whose K is Q against the general path of the same kernels (gen, from the
 * forward fwd): dK of both roles = the general dQ + dK within tol (the same scores, summed in another order; with
 * tensor-core rounding each role's score gradient rounded apart or summed first), the +Pos row sums within tol,
 * dV and the column sums bit for bit (the same code and order). That no dQ kernel runs on the symmetric path is
 * kernels/cuda/attention.cu's choice, checked by test_kernels (check_backward_kernels). X: the activations' type;
 * bufs, in_place: as run_path's. */
template <typename X = float>
static void check_symmetric(const Problem &pr, Path path, const Result &gen, const Result *fwd, double tol,
                            const char *mode, int bufs = 2, bool in_place = false) {
    const Case &c = pr.c;
    bool valid = c.G == c.H && c.Tq == c.Tk && !c.causal;
    CHECK(valid, "%s: a symmetric case has G = H, Tq = Tk and no causal mask", c.name);
    if (!valid) return;
    Result s = run_path<X>(pr, path, fwd, true, bufs, in_place);
    std::vector<float> both(gen.dK.size());
    for (size_t k = 0; k < both.size(); k++) both[k] = gen.dQ[k] + gen.dK[k];
    double ek = rel_err(s.dK, both), er = c.pos ? rel_err(s.rowacc, gen.rowacc) : 0.0;
    CHECK(ek <= tol, "%s, %s: symmetric backward's dK against the general dQ + dK: %.3g (bound %g)", c.name, mode, ek,
          tol);
    CHECK(er <= tol, "%s, %s: symmetric backward's +Pos row sums against the general path's: %.3g (bound %g)", c.name,
          mode, er, tol);
    size_t differ = 0;
    for (size_t k = 0; k < gen.dV.size(); k++) differ += memcmp(&s.dV[k], &gen.dV[k], sizeof(float)) != 0;
    for (size_t k = 0; k < gen.colacc.size(); k++) differ += memcmp(&s.colacc[k], &gen.colacc[k], sizeof(float)) != 0;
    CHECK(differ == 0, "%s, %s: symmetric backward: %zu values of dV and the column sums differ from the general "
          "path's", c.name, mode, differ);
}

static void check_case(const Case &c) {
    Problem pr = make_problem(c);
    std::vector<double> ref_out, ref_lse;
    reference_forward(pr, ref_out, ref_lse);
    emu::tf32_exact = true;
    Result f32 = run_path(pr, FP32, nullptr);
    double e = rel_err(f32.out, ref_out), el = rel_err(f32.lse, ref_lse);
    CHECK(e <= 2e-5 && el <= 2e-5, "%s: fp32 kernels' forward against float64: output %.3g, lse %.3g", c.name, e, el);
    if (c.sym) check_symmetric(pr, FP32, f32, &f32, 2e-5, "fp32");
    /* TF32 with its rounding off (the same sums as the fp32 kernels), TF32, and bf16 (7 mantissa bits: the
     * bounds of test_kernels' bf16 builds), with the scores in registers and with WMMA's kernels; then with bf16
     * activations as CUDA_BF16 builds run them (the roles, the output and its gradient stored as bf16): those two
     * and the fp32 kernels, which such builds run past head dim 128, within the same bf16 bounds; and the kernels
     * with the scores in registers with one tile buffer, as where a GPU's shared memory is short */
    static const Path paths[] = {TF32, TF32, BF16, BF16_WMMA, BF16, BF16_WMMA, FP32, BF16};
    /* the roles read in place (role_rows), as attention.cu reads them without RoPE, in half the modes: each set of
     * kernels both ways (the fp32 kernels' packed run is the reference's) */
    static const bool in_place[] = {false, true, false, true, true, false, true, false};
    static const char *const modes[] = {"TF32 rounding off",
                                        "TF32, roles in place",
                                        "bf16",
                                        "bf16, WMMA, roles in place",
                                        "bf16 activations, roles in place",
                                        "bf16 activations, WMMA",
                                        "fp32 kernels, bf16 activations, roles in place",
                                        "bf16 activations, one buffer"};
    Result aligned[2]; /* modes 2 and 4: the mma kernels, on float and on bf16 activations */
    for (int mode_k = 0; mode_k < 8; mode_k++) {
        emu::tf32_exact = mode_k == 0;
        Path path = paths[mode_k];
        bool bf16_act = mode_k >= 4;
        int bufs = mode_k == 7 ? 1 : 2;
        Result tc = bf16_act ? run_path<__nv_bfloat16>(pr, path, &f32, false, bufs, in_place[mode_k])
                             : run_path(pr, path, &f32, false, 2, in_place[mode_k]);
        const char *mode = modes[mode_k];
        if (mode_k == 2 || mode_k == 4) aligned[mode_k / 4] = tc;
        double fwd_tol = mode_k == 0 ? 2e-5 : mode_k == 1 ? TF32_FWD_TOL : BF16_FWD_TOL;
        double grad_tol = mode_k == 0 ? 1e-4 : mode_k == 1 ? TF32_GRAD_TOL : BF16_GRAD_TOL;
        e = rel_err(tc.out, ref_out), el = rel_err(tc.lse, ref_lse);
        CHECK(e <= fwd_tol && el <= fwd_tol, "%s, %s: tensor-core forward against float64: output %.3g, lse %.3g "
              "(bound %g)", c.name, mode, e, el, fwd_tol);
        const std::vector<float> *got[] = {&tc.dQ, &tc.dK, &tc.dV, &tc.rowacc, &tc.colacc};
        const std::vector<float> *want[] = {&f32.dQ, &f32.dK, &f32.dV, &f32.rowacc, &f32.colacc};
        const char *what[] = {"dQ", "dK", "dV", "+Pos row sums", "+Pos column sums"};
        for (int k = 0; k < 5; k++) {
            if (want[k]->empty()) continue;
            double ek = rel_err(*got[k], *want[k]);
            CHECK(ek <= grad_tol, "%s, %s: tensor-core %s against the fp32 kernels: %.3g (bound %g)", c.name, mode,
                  what[k], ek, grad_tol);
        }
        if (c.sym) { /* against the general path of the same kernels: the fp32 kernels' float sums alike to 2e-5,
                      * but in bf16 rows (in place, bf16 activations) the gradient of both roles is rounded once on
                      * the symmetric path and once per role on the general one: 3 roundings of 2^-9 of values up
                      * to max |dK| plus grad_start's */
            double tol = mode_k == 0 || path == FP32 ? (bf16_act && in_place[mode_k] ? 1e-2 : 2e-5) : grad_tol;
            if (bf16_act)
                check_symmetric<__nv_bfloat16>(pr, path, tc, &f32, tol, mode, bufs, in_place[mode_k]);
            else
                check_symmetric(pr, path, tc, &f32, tol, mode, 2, in_place[mode_k]);
        }
    }
    emu::tf32_exact = false;
    /* Every buffer of activations one value past a 16-byte boundary, as no caller of attention.cu gives them
     * today (the blocks carve activations at 64-byte boundaries): where the width allows whole 16-byte loads, the
     * mma kernels must find the base misaligned and load one value at a time, and bf16's queries must not be read
     * as pairs (the emulation stops at a misaligned vector access, as a GPU faults): the same results bit for bit,
     * on float (packed) and on bf16 activations (in place). */
    if (c.hd % 4 == 0) {
        Result off = run_path(pr, BF16, &f32, false, 2, false, 1);
        size_t n = bits_differ(off, aligned[0]);
        CHECK(n == 0, "%s, bf16 kernels on float, buffers off 16-byte alignment: %zu values differ from aligned",
              c.name, n);
        off = run_path<__nv_bfloat16>(pr, BF16, &f32, false, 2, true, 1);
        n = bits_differ(off, aligned[1]);
        CHECK(n == 0, "%s, bf16 activations in place, buffers off 16-byte alignment: %zu values differ from "
              "aligned", c.name, n);
    }
}

/* The embedding's token-table gradient (ops_kernels.cuh): every row of dwte must get its positions' rows in
 * increasing position order, the CPU backend's loop, so the kernel equals that loop bit for bit: over several
 * chunks of positions (the last one partial), more channels than threads, a token that takes a third of the
 * positions, buckets holding several tokens (few buckets) and one each (more buckets than tokens). */
/* Tokens outside [0, V) (one position in 16: V + 3, or -2) add to no row: their check, queued by the forward pass,
 * stops the program at the next host wait, and nothing waits for it before. */
static void check_embedding_backward(int BT, int C, int V, int buckets) {
    std::vector<int> tokens((size_t)BT);
    for (int &t : tokens) t = urand() < -0.33f ? 0 : std::min(V - 1, (int)((urand() + 1.0f) * 0.5f * (float)V));
    for (int i = 5; i < BT; i += 16) tokens[(size_t)i] = i % 32 == 5 ? V + 3 : -2;
    /* four rows past the table, so that a write for V + 3 lands in the buffer and is seen */
    std::vector<float> dout = rand_vec((size_t)BT * C, 1.0f), want = rand_vec((size_t)(V + 4) * C, 0.5f), got = want;
    const float scale = 1.5f;
    for (int i = 0; i < BT; i++)
        if (tokens[(size_t)i] >= 0 && tokens[(size_t)i] < V)
            for (int c = 0; c < C; c++) want[(size_t)tokens[(size_t)i] * C + c] += scale * dout[(size_t)i * C + c];
    emu::launch((unsigned)buckets, EMB_THREADS, emb_smem_bytes(), sm, [&] {
        embedding_backward_wte_kernel(got.data(), dout.data(), tokens.data(), BT, C, V, scale, buckets);
    });
    size_t differ = 0;
    for (size_t k = 0; k < want.size(); k++) differ += got[k] != want[k];
    CHECK(differ == 0, "embedding backward (B*T %d, C %d, V %d, %d buckets): %zu of %zu values of dwte differ from "
          "the CPU loop's", BT, C, V, buckets, differ, want.size());
}

/* AdamW over many tensors (ops_kernels.cuh): more spans than one launch takes (two launches), empty spans,
 * spans of less than one block and of several, moments at other offsets than the parameters (a ZeRO-1 slice)
 * and two weight decays: every value must be adamw_value's, as one loop over each span computes it. */
static void check_adamw_spans(void) {
    const int nspans = ADAMW_BATCH + 20; /* 17 empty, not the last: 99 to update */
    std::vector<AdamwSpan> spans((size_t)nspans);
    size_t total = 0, state = 0;
    for (int k = 0; k < nspans; k++) {
        size_t n = k % 7 == 2 ? 0 : (size_t)((urand() + 1.0f) * 0.5f * (k % 5 == 0 ? 3 * ADAMW_CHUNK : 300));
        total += 5; /* a gap the update must leave alone */
        spans[(size_t)k] = AdamwSpan{total, state, n, k % 2 ? 0.1f : 0.0f};
        total += n;
        state += n;
    }
    std::vector<float> p = rand_vec(total, 1.0f), g = rand_vec(total, 0.1f), m = rand_vec(state, 0.01f);
    std::vector<float> v = rand_vec(state, 0.001f);
    for (float &x : v) x = fabsf(x);
    std::vector<float> pw = p, mw = m, vw = v;
    const float lr = 1e-2f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f;
    const int t = 3;
    float bc1 = 1.0f - powf(b1, (float)t), bc2 = 1.0f - powf(b2, (float)t);
    for (const AdamwSpan &s : spans)
        for (size_t i = 0; i < s.n; i++)
            adamw_value(&pw[s.offset + i], &mw[s.state_offset + i], &vw[s.state_offset + i], g[s.offset + i], lr, b1,
                        b2, eps, s.weight_decay, bc1, bc2);
    AdamwBatch batch;
    int next = 0, launches = 0;
    for (unsigned blocks; (blocks = adamw_next_batch(&batch, spans.data(), nspans, &next)) > 0; launches++)
        emu::launch(blocks, ADAMW_THREADS, 0, sm, [&] {
            adamw_spans_kernel(p.data(), g.data(), m.data(), v.data(), batch, lr, b1, b2, eps, bc1, bc2);
        });
    size_t differ = 0;
    for (size_t i = 0; i < total; i++) differ += p[i] != pw[i];
    for (size_t i = 0; i < state; i++) differ += (m[i] != mw[i]) + (v[i] != vw[i]);
    CHECK(launches == 2 && differ == 0, "AdamW over %d spans in %d launches: %zu values differ from adamw_value's",
          nspans, launches, differ);
}

/* The layernorm forward kernel (ops_kernels.cuh) against float64 (1e-5 of the largest output), and its fused
 * residual form against the plain form on the CPU-made sum, bit for bit: rows over several blocks, a width
 * that is not a multiple of 32, with and without bias; W values a lane at a time (1, or 4: 16 bytes). */
template <int W> static void check_layernorm(int N, int C, bool bias) {
    std::vector<float> a = rand_vec((size_t)N * C, 2.0f), b = rand_vec((size_t)N * C, 1.0f);
    std::vector<float> w = rand_vec((size_t)C, 1.0f), bb = rand_vec((size_t)C, 0.5f), sum((size_t)N * C);
    for (size_t i = 0; i < sum.size(); i++) sum[i] = a[i] + b[i];
    std::vector<float> out((size_t)N * C, NAN), mean((size_t)N, NAN), rstd((size_t)N, NAN);
    std::vector<float> out2 = out, mean2 = mean, rstd2 = rstd, res((size_t)N * C, NAN);
    const float *bp = bias ? bb.data() : nullptr;
    unsigned grid = (unsigned)((N * 32 + 255) / 256);
    emu::launch(grid, 256, 0, sm, [&] {
        layernorm_forward_kernel<float, W>(out.data(), mean.data(), rstd.data(), nullptr, sum.data(), nullptr,
                                           w.data(), bp, N, C);
    });
    emu::launch(grid, 256, 0, sm, [&] {
        layernorm_forward_kernel<float, W>(out2.data(), mean2.data(), rstd2.data(), res.data(), a.data(),
                                           b.data(), w.data(), bp, N, C);
    });
    std::vector<double> want((size_t)N * C);
    for (int r = 0; r < N; r++) {
        double m = 0.0, v = 0.0;
        for (int c = 0; c < C; c++) m += sum[(size_t)r * C + c];
        m /= C;
        for (int c = 0; c < C; c++) v += (sum[(size_t)r * C + c] - m) * (sum[(size_t)r * C + c] - m);
        double s = 1.0 / sqrt(v / C + 1e-5);
        for (int c = 0; c < C; c++) want[(size_t)r * C + c] = (sum[(size_t)r * C + c] - m) * s * w[c] + (bias ? bb[c] : 0.0);
    }
    double e = rel_err(out, want);
    bool same = res == sum && out2 == out && mean2 == mean && rstd2 == rstd;
    CHECK(e <= 1e-5 && same, "layernorm forward (N %d, C %d%s, %d a load): %.3g of the largest against float64; the "
          "fused residual form %s", N, C, bias ? ", bias" : "", W, e, same ? "gives the same bits" : "DIFFERS");
}


/* ---- the emulated runtime (tests/cuda_emu_runtime.h) */

__global__ void count_kernel(int *hits, int *total, int gx) {
    int pred = threadIdx.x % 3 == 0;
    int n = __syncthreads_count(pred); /* twice in a row: the two generations' counts must not mix */
    int m = __syncthreads_count(!pred);
    if (threadIdx.x == 0) hits[blockIdx.y * gx + blockIdx.x] += 1;
    atomicAdd(total, n + 1000 * m);
}

/* A race on purpose: thread 0 writes, every thread reads, no barrier between; each block also takes a ticket. */
__global__ void race_kernel(float *seen, int *ticket, int *next) {
    static float v; /* __shared__ float v, as tests/cuda_emu_src.py rewrites it: NaN before every block */
    static bool registered = emu::shared_array(&v, sizeof v);
    (void)registered;
    if (threadIdx.x == 0) v = 1.0f;
    seen[blockIdx.x * blockDim.x + threadIdx.x] = v;
    if (threadIdx.x == 0) ticket[blockIdx.x] = (*next)++;
}

/* The emulation's order (KVLAB_CUDA_EMU_ORDER, tests/cuda_emu.h): forward, the race above goes unseen (thread 0
 * runs first); reversed, the last lane of the last warp runs first and reads the unwritten (NaN) value while
 * thread 0 reads its own write, and blocks run last first. run_tests.py runs this program in both orders. */
static void check_order(void) {
    const unsigned threads = 256, blocks = 2;
    float seen[blocks * threads];
    int ticket[blocks] = {-1, -1}, next = 0;
    emu::kernel_launch([&] { race_kernel(seen, ticket, &next); }, (const void *)race_kernel, dim3(blocks), threads);
    int unseen = 0;
    for (float x : seen) unseen += x != 1.0f;
    const bool rev = emu::reverse_order();
    if (rev)
        CHECK(std::isnan(seen[threads - 1]) && std::isnan(seen[1]) && seen[0] == 1.0f && std::isnan(seen[threads + 32])
              && ticket[1] == 0 && ticket[0] == 1, "reversed order: a read before the write it races with sees NaN "
              "(threads 255, 1 (lanes too), 0: %g %g %g), the last block first (tickets %d %d)", seen[threads - 1],
              seen[1], seen[0], ticket[0], ticket[1]);
    else
        CHECK(unseen == 0 && ticket[0] == 0 && ticket[1] == 1, "forward order: thread 0 first (%d reads before the "
              "write), block 0 first (tickets %d %d)", unseen, ticket[0], ticket[1]);
    printf("# emulation order: %s\n", rev ? "reverse" : "forward");
}

static void check_launches(void) {
    const unsigned gx = 3, gy = 4, threads = 96; /* 32 of 96 have pred */
    int hits[12] = {0}, total = 0;
    emu::kernel_launch([&] { count_kernel(hits, &total, (int)gx); }, (const void *)count_kernel, dim3(gx, gy), threads);
    CHECK(cudaGetLastError() == cudaSuccess, "a 3x4 grid launches");
    bool once = true;
    for (int h : hits) once = once && h == 1;
    CHECK(once, "a two-dimensional grid runs each block once");
    CHECK(total == 12 * 96 * (32 + 1000 * 64), "__syncthreads_count and atomicAdd: %d", total);
    struct Bad {
        dim3 grid;
        unsigned threads;
        size_t smem;
        cudaError_t err;
    } bad[] = {{dim3(0), 32, 0, cudaErrorInvalidConfiguration},        {dim3(1), 0, 0, cudaErrorInvalidConfiguration},
               {dim3(1), 1056, 0, cudaErrorInvalidConfiguration},      {dim3(1, 65536), 32, 0, cudaErrorInvalidConfiguration},
               {dim3(1), 32, 48 * 1024 + 4, cudaErrorInvalidValue}};
    for (const Bad &b : bad) {
        int ran = 0;
        emu::kernel_launch([&] { ran = 1; }, (const void *)count_kernel, b.grid, b.threads, b.smem);
        cudaError_t err = cudaGetLastError();
        CHECK(err == b.err && !ran && cudaGetLastError() == cudaSuccess,
              "a launch of %ux%u blocks of %u threads with %zu bytes of shared memory is refused as a GPU does (%s), "
              "once", b.grid.x, b.grid.y, b.threads, b.smem, cudaGetErrorString(err));
    }
    CHECK(cudaFuncSetAttribute(count_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 228 * 1024) ==
              cudaErrorInvalidValue && cudaGetLastError() == cudaErrorInvalidValue,
          "more shared memory than an H100's 227 KiB is refused");
    CHECK(cudaFuncSetAttribute(count_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 * 1024) == cudaSuccess,
          "100 KiB of shared memory asked for");
    int ran = 0;
    emu::kernel_launch([&] { ran++; }, (const void *)count_kernel, dim3(2), 64, 100 * 1024);
    CHECK(cudaGetLastError() == cudaSuccess && ran == 128, "then a launch with 100 KiB runs (%d threads)", ran);
    emu::kernel_launch([&] { ran++; }, (const void *)check_launches, dim3(1), 32, 100 * 1024);
    CHECK(cudaGetLastError() == cudaErrorInvalidValue, "but only for that kernel");
    float *p = nullptr;
    size_t free0, free1, total_b;
    cudaMemGetInfo(&free0, &total_b);
    CHECK(cudaMalloc((void **)&p, 1000 * sizeof(float)) == cudaSuccess && std::isnan(p[0]) && std::isnan(p[999]),
          "cudaMalloc's memory is NaN until written");
    cudaMemGetInfo(&free1, &total_b);
    CHECK(free0 - free1 == 4000 && cudaFree(p) == cudaSuccess && cudaFree(p) == cudaErrorInvalidValue,
          "allocations count in cudaMemGetInfo; a second cudaFree is an error");
    cudaGetLastError();
}

/* emu::stream_defer (the emulated NCCL's late collectives): deferred work waits until its stream is next used,
 * synchronised or queried, a stream waits for an event recorded after it, or the device is synchronised; an event
 * recorded between two deferred items releases the first alone. And device_range, the emulated NCCL's check that
 * a buffer is device memory. */
static void check_deferred(void) {
    cudaStream_t a, b;
    cudaEvent_t ev;
    CHECK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking) == cudaSuccess &&
              cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking) == cudaSuccess &&
              cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) == cudaSuccess,
          "streams and an event are made");
    std::vector<int> ran;
    emu::stream_defer(a, [&] { ran.push_back(1); });
    cudaEventRecord(ev, a);
    emu::stream_defer(a, [&] { ran.push_back(2); });
    int launched = 0;
    emu::kernel_launch([&] { launched++; }, (const void *)count_kernel, dim3(1), 32, 0, b);
    CHECK(ran.empty() && launched == 32, "deferred work waits while another stream runs a kernel (%zu ran)",
          ran.size());
    emu::stream_defer(b, [&] { ran.push_back(10); });
    cudaStreamWaitEvent(b, ev, 0);
    CHECK(ran == std::vector<int>{1}, "a wait for an event releases the work before it alone, not the waiting "
          "stream's (%zu ran)", ran.size());
    cudaStreamSynchronize(b);
    CHECK(ran == (std::vector<int>{1, 10}), "which its synchronisation runs");
    ran.pop_back();
    float *p = nullptr;
    cudaMalloc((void **)&p, 64);
    cudaMemsetAsync(p, 0, 64, a);
    CHECK(ran == (std::vector<int>{1, 2}), "new work on the stream runs what was deferred on it first");
    emu::stream_defer(a, [&] { ran.push_back(3); });
    cudaStreamSynchronize(b);
    CHECK(ran.size() == 2, "synchronising another stream leaves it deferred");
    cudaGetLastError();
    CHECK(cudaStreamQuery(a) == cudaErrorNotReady && ran.size() == 3, "a query of its stream runs it, answering "
          "not ready");
    CHECK(cudaGetLastError() == cudaErrorNotReady && cudaGetLastError() == cudaSuccess,
          "which it leaves as the last error, as HIP does (%zu ran)", ran.size());
    CHECK(cudaStreamQuery(a) == cudaSuccess, "the next query finds the stream idle");
    emu::stream_defer(a, [&] { ran.push_back(4); });
    emu::stream_defer(nullptr, [&] { ran.push_back(5); });
    cudaDeviceSynchronize();
    std::sort(ran.begin() + 3, ran.end()); /* the streams' order among themselves is unspecified */
    CHECK(ran == (std::vector<int>{1, 2, 3, 4, 5}), "cudaDeviceSynchronize runs every stream's deferred work");
    emu::stream_defer(b, [&] { ran.push_back(6); });
    cudaEventRecord(ev, b);
    cudaStreamDestroy(b);
    CHECK(ran.size() == 6, "a destroyed stream finishes its deferred work");
    /* the event outlives its stream; a new stream (likely at the old one's address) is not the one it names */
    cudaStream_t c;
    cudaStreamCreateWithFlags(&c, cudaStreamNonBlocking);
    emu::stream_defer(c, [&] { ran.push_back(60); });
    CHECK(cudaStreamWaitEvent(a, ev, 0) == cudaSuccess && ran.size() == 6,
          "a wait for an event recorded on a destroyed stream waits for nothing (%zu ran)", ran.size());
    cudaStreamDestroy(c);
    ran.pop_back();
    emu::stream_defer(a, [&] { ran.push_back(7); });
    cudaFree(p);
    CHECK(ran.size() == 7, "cudaFree waits for the whole device");
    cudaMalloc((void **)&p, 64);
    float host[16];
    CHECK(emu::device_range(p, 64) && emu::device_range(p + 8, 32) && !emu::device_range(p + 8, 36) &&
              !emu::device_range(host, 4) && emu::device_range(p + 16, 0),
          "device_range: inside one allocation only");
    cudaFree(p);
    cudaEventDestroy(ev);
    cudaStreamDestroy(a);
    cudaGetLastError();
}

/* Page-locked host memory (cudaHostAlloc): a copy between it and the device is deferred as a GPU runs it, after
 * the host has gone on, reading its source when it runs; an event recorded after it, a synchronisation or the
 * stream's next work completes it. A copy with pageable memory on the host side is done on return. */
static void check_pinned(void) {
    cudaStream_t s;
    cudaEvent_t ev;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    int *pin = nullptr, *dev = nullptr, pageable[2] = {7, 8};
    CHECK(cudaHostAlloc((void **)&pin, 2 * sizeof(int), cudaHostAllocDefault) == cudaSuccess &&
              cudaMalloc((void **)&dev, 2 * sizeof(int)) == cudaSuccess,
          "cudaHostAlloc and cudaMalloc");
    CHECK(cudaEventQuery(ev) == cudaSuccess, "an event never recorded is complete");
    pin[0] = 1, pin[1] = 2;
    cudaMemcpyAsync(dev, pin, 2 * sizeof(int), cudaMemcpyHostToDevice, s);
    pin[0] = 3; /* before the copy runs: the copy reads it */
    cudaEventRecord(ev, s);
    CHECK(dev[0] != 3, "a copy from pinned memory has not run when cudaMemcpyAsync returns");
    CHECK(cudaEventQuery(ev) == cudaErrorNotReady && dev[0] == 3 && dev[1] == 2,
          "it runs, with the source as it is then, once an event after it is queried (%d %d)", dev[0], dev[1]);
    CHECK(cudaEventQuery(ev) == cudaSuccess, "the event is complete at the next query");
    cudaGetLastError();
    pin[1] = 4;
    cudaMemcpyAsync(dev + 1, pin + 1, sizeof(int), cudaMemcpyHostToDevice, s);
    cudaEventRecord(ev, s);
    CHECK(cudaEventSynchronize(ev) == cudaSuccess && cudaGetLastError() == cudaSuccess && dev[1] == 4,
          "cudaEventSynchronize runs the work before the event and answers cudaSuccess");
    dev[0] = 5;
    cudaMemcpyAsync(pin, dev, sizeof(int), cudaMemcpyDeviceToHost, s);
    CHECK(pin[0] == 3, "a copy into pinned memory has not run on return either");
    cudaStreamSynchronize(s);
    CHECK(pin[0] == 5, "the stream's synchronisation runs it");
    cudaMemcpyAsync(dev, pageable, 2 * sizeof(int), cudaMemcpyHostToDevice, s);
    pageable[0] = 9;
    CHECK(dev[0] == 7 && dev[1] == 8, "a copy from pageable memory is done on return");
    CHECK(cudaFreeHost(pin) == cudaSuccess && cudaFreeHost(pin) == cudaErrorInvalidValue &&
              cudaFreeHost(pageable) == cudaErrorInvalidValue,
          "cudaFreeHost frees cudaHostAlloc's memory only, once");
    cudaFree(dev);
    cudaEventDestroy(ev);
    cudaStreamDestroy(s);
    cudaGetLastError();
}

/* v to keep mantissa bits, to nearest: ties to even (bf16), or away from zero (TF32, as the hardware's
 * cvt.rna.tf32.f32 and tests/cuda_emu.h's __float_to_tf32) */
static float bits_round(float v, int keep, bool ties_even) {
    if (keep >= 23) return v;
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    uint32_t drop = 23 - keep, half = 1u << (drop - 1);
    u = (u + (ties_even ? half - 1 + ((u >> drop) & 1u) : half)) & ~((1u << drop) - 1);
    memcpy(&v, &u, sizeof v);
    return v;
}

static void check_gemm(void) {
    cublasHandle_t h;
    cublasCreate(&h);
    const int m = 13, n = 7, k = 37;
    for (int mode = 0; mode < 3; mode++) /* fp32, TF32 math mode, bf16 inputs */
        for (int ta = 0; ta < 2; ta++)
            for (int tb = 0; tb < 2; tb++) {
                int lda = (ta ? k : m) + 2, ldb = (tb ? n : k) + 1, ldc = m + 3;
                std::vector<float> A = rand_vec((size_t)lda * (ta ? m : k), 1.0f);
                std::vector<float> B = rand_vec((size_t)ldb * (tb ? k : n), 1.0f);
                std::vector<float> C((size_t)ldc * n, std::numeric_limits<float>::quiet_NaN()), C0 = rand_vec(C.size(), 1.0f);
                float one = 1.0f, zero = 0.0f, half = 0.5f;
                cublasSetMathMode(h, mode == 1 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_PEDANTIC_MATH);
                auto call = [&](float *Cm, const float *beta) {
                    if (mode == 2)
                        return cublasGemmEx(h, (cublasOperation_t)ta, (cublasOperation_t)tb, m, n, k, &one, A.data(),
                                            CUDA_R_32F, lda, B.data(), CUDA_R_32F, ldb, beta, Cm, CUDA_R_32F, ldc,
                                            CUBLAS_COMPUTE_32F_FAST_16BF, CUBLAS_GEMM_DEFAULT);
                    return cublasSgemm(h, (cublasOperation_t)ta, (cublasOperation_t)tb, m, n, k, &one, A.data(), lda,
                                       B.data(), ldb, beta, Cm, ldc);
                };
                std::vector<float> C1 = C0;
                bool ok = call(C.data(), &zero) == CUBLAS_STATUS_SUCCESS && call(C1.data(), &half) == CUBLAS_STATUS_SUCCESS;
                double err = 0.0, err1 = 0.0, scale = 0.0;
                int keep = mode == 0 ? 23 : mode == 1 ? 10 : 7;
                for (int i = 0; i < m; i++)
                    for (int j = 0; j < n; j++) {
                        double ref = 0.0;
                        for (int l = 0; l < k; l++)
                            ref += (double)bits_round(ta ? A[l + (size_t)i * lda] : A[i + (size_t)l * lda], keep,
                                                      mode != 1) *
                                   bits_round(tb ? B[j + (size_t)l * ldb] : B[l + (size_t)j * ldb], keep, mode != 1);
                        size_t c = i + (size_t)j * ldc;
                        err = fmax(err, fabs(C[c] - ref));
                        if (!(fabs(C[c] - ref) <= 1e9)) err = INFINITY; /* NaN */
                        err1 = fmax(err1, fabs(C1[c] - (ref + 0.5 * C0[c])));
                        scale = fmax(scale, fabs(ref));
                    }
                CHECK(ok && err <= 1e-5 * scale && err1 <= 1e-5 * scale,
                      "%s product, op(A) %c, op(B) %c: against float64 on %s inputs, error %.3g (beta 0 over NaN), "
                      "%.3g (beta 0.5)", mode == 2 ? "cublasGemmEx" : "cublasSgemm", ta ? 'T' : 'N', tb ? 'T' : 'N',
                      mode == 0 ? "fp32" : mode == 1 ? "TF32-rounded" : "bf16-rounded", err, err1);
            }
    /* bf16 rounding at a tie and just above it: 1 + 2^-8 rounds to 1 (even), 1 + 3 2^-9 to 1 + 2^-7 */
    float one = 1.0f, zero = 0.0f, out[2];
    float a[2] = {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-9f}, b = 1.0f;
    for (int i = 0; i < 2; i++)
        cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, 1, 1, 1, &one, &a[i], CUDA_R_32F, 1, &b, CUDA_R_32F, 1, &zero, &out[i],
                     CUDA_R_32F, 1, CUBLAS_COMPUTE_32F_FAST_16BF, CUBLAS_GEMM_DEFAULT);
    CHECK(out[0] == 1.0f && out[1] == 1.0f + 0x1p-7f, "bf16 inputs round to nearest, ties to even: %.9g %.9g",
          out[0], out[1]);
    CHECK(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, 4, 1, 1, &one, a, 2, &b, 1, &zero, out, 4) ==
              CUBLAS_STATUS_INVALID_VALUE, "a leading dimension shorter than the matrix is refused");
    /* bf16 buffers (CUDA_BF16: activations stored as bf16): bf16 inputs with a float32 accumulator, into a bf16
     * output (read as float for beta, stored rounded to nearest even) or a float32 one */
    for (int out16 = 0; out16 < 2; out16++)
        for (int ta = 0; ta < 2; ta++)
            for (int tb = 0; tb < 2; tb++) {
                int lda = (ta ? k : m) + 1, ldb = (tb ? n : k) + 2, ldc = m + 1;
                std::vector<__nv_bfloat16> A((size_t)lda * (ta ? m : k)), B((size_t)ldb * (tb ? k : n));
                for (auto &x : A) x = __float2bfloat16(rand_vec(1, 1.0f)[0]);
                for (auto &x : B) x = __float2bfloat16(rand_vec(1, 1.0f)[0]);
                std::vector<float> C0 = rand_vec((size_t)ldc * n, 1.0f), Cf = C0;
                std::vector<__nv_bfloat16> Cb(C0.size());
                for (size_t i = 0; i < C0.size(); i++) Cb[i] = __float2bfloat16(C0[i]);
                float half = 0.5f;
                void *Cm = out16 ? (void *)Cb.data() : (void *)Cf.data();
                cublasStatus_t st = cublasGemmEx(h, (cublasOperation_t)ta, (cublasOperation_t)tb, m, n, k, &one,
                                                  A.data(), CUDA_R_16BF, lda, B.data(), CUDA_R_16BF, ldb, &half, Cm,
                                                  out16 ? CUDA_R_16BF : CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F,
                                                  CUBLAS_GEMM_DEFAULT);
                double err = 0.0, scale = 0.0;
                for (int i = 0; i < m; i++)
                    for (int j = 0; j < n; j++) {
                        double ref = 0.0;
                        for (int l = 0; l < k; l++)
                            ref += (double)__bfloat162float(ta ? A[l + (size_t)i * lda] : A[i + (size_t)l * lda]) *
                                   __bfloat162float(tb ? B[j + (size_t)l * ldb] : B[l + (size_t)j * ldb]);
                        size_t c = i + (size_t)j * ldc;
                        /* beta reads C as stored: bf16-rounded in a bf16 output */
                        ref += 0.5 * (out16 ? (double)__bfloat162float(__float2bfloat16(C0[c])) : (double)C0[c]);
                        double got = out16 ? __bfloat162float(Cb[c]) : Cf[c];
                        /* a bf16 output keeps 8 significant bits: half an ulp, 2^-8 relative, on top */
                        err = fmax(err, fabs(got - ref) - (out16 ? 0x1p-8 * fabs(ref) : 0.0));
                        scale = fmax(scale, fabs(ref));
                    }
                CHECK(st == CUBLAS_STATUS_SUCCESS && err <= 1e-5 * scale,
                      "cublasGemmEx on bf16 inputs into %s, op(A) %c, op(B) %c: against float64, error %.3g "
                      "(beta 0.5)", out16 ? "bf16" : "float32", ta ? 'T' : 'N', tb ? 'T' : 'N', err);
            }
    __nv_bfloat16 x16 = __float2bfloat16(1.0f);
    CHECK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, 1, 1, 1, &one, &x16, CUDA_R_16BF, 1, &b, CUDA_R_32F, 1, &zero,
                       out, CUDA_R_32F, 1, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_INVALID_VALUE &&
              cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, 1, 1, 1, &one, &x16, CUDA_R_16BF, 1, &x16, CUDA_R_16BF, 1,
                           &zero, out, CUDA_R_32F, 1, CUBLAS_COMPUTE_32F_FAST_16BF, CUBLAS_GEMM_DEFAULT) ==
                  CUBLAS_STATUS_INVALID_VALUE,
          "cublasGemmEx refuses what kvlab never asks for: mixed input types, FAST_16BF on bf16 inputs");
    cublasDestroy(h);
}

/* The emulated cuBLASLt matmul with each epilogue kvlab uses, against float64: D = epilogue(op(A) op(B) + beta C)
 * with BIAS (a vector of the output's type down the rows), GELU_AUX (with and without the bias: D = GELU of the sum, the sum
 * kept in the aux matrix) and DGELU (the product times GELU's derivative at the aux matrix), on float32 inputs
 * (fp32 and TF32 compute) and bf16 buffers; then what it refuses. */
static double gelu64(double x) { return 0.5 * x * (1.0 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))); }
static double dgelu64(double x) {
    double th = tanh(0.7978845608028654 * (x + 0.044715 * x * x * x));
    return 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x);
}

struct LtCall {
    cublasLtHandle_t h;
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a, b, c;
    cublasLtMatmulPreference_t pref;
    LtCall(cublasComputeType_t compute, cudaDataType in, cudaDataType out, int ta, int m, int n, int k, int lda,
           int ldb, int ldc) {
        cublasLtCreate(&h);
        cublasLtMatmulDescCreate(&op, compute, CUDA_R_32F);
        int32_t t = ta, nt = CUBLAS_OP_N;
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t);
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &nt, sizeof nt);
        cublasLtMatrixLayoutCreate(&a, in, ta ? k : m, ta ? m : k, lda);
        cublasLtMatrixLayoutCreate(&b, in, k, n, ldb);
        cublasLtMatrixLayoutCreate(&c, out, m, n, ldc);
        cublasLtMatmulPreferenceCreate(&pref);
        uint32_t four = 4;
        for (auto at : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
            cublasLtMatmulPreferenceSetAttribute(pref, at, &four, sizeof four);
    }
    ~LtCall() {
        cublasLtMatmulPreferenceDestroy(pref);
        cublasLtMatrixLayoutDestroy(a), cublasLtMatrixLayoutDestroy(b), cublasLtMatrixLayoutDestroy(c);
        cublasLtMatmulDescDestroy(op);
        cublasLtDestroy(h);
    }
    void epilogue(uint32_t e, const void *bias, void *aux, int64_t aux_ld) {
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &e, sizeof e);
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias);
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux);
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof aux_ld);
    }
    /* the heuristic's answer (0: no algorithm), then the product when there is one */
    int run(const void *A, const void *B, float beta, void *C, cublasStatus_t *st) {
        cublasLtMatmulHeuristicResult_t r;
        int got = 0;
        cublasLtMatmulAlgoGetHeuristic(h, op, a, b, c, c, pref, 1, &r, &got);
        float one = 1.0f;
        *st = got ? cublasLtMatmul(h, op, &one, A, a, B, b, &beta, C, c, C, c, &r.algo, nullptr, 0, nullptr)
                  : CUBLAS_STATUS_NOT_SUPPORTED;
        return got;
    }
};

static void check_lt(void) {
    const int m = 16, n = 5, k = 37, ldc = m + 8; /* aux ld = ldc: a multiple of 8 */
    const uint32_t epis[] = {CUBLASLT_EPILOGUE_DEFAULT, CUBLASLT_EPILOGUE_BIAS, CUBLASLT_EPILOGUE_GELU_AUX,
                             CUBLASLT_EPILOGUE_GELU_AUX_BIAS, CUBLASLT_EPILOGUE_DGELU};
    const char *names[] = {"DEFAULT", "BIAS", "GELU_AUX", "GELU_AUX_BIAS", "DGELU"};
    for (int mode = 0; mode < 3; mode++) /* fp32, TF32 compute, bf16 buffers */
        for (int ta = 0; ta < 2; ta++)
            for (int e = 0; e < 5; e++) {
                int lda = (ta ? k : m) + 1, ldb = k + 2;
                bool b16 = mode == 2;
                std::vector<float> A = rand_vec((size_t)lda * (ta ? m : k), 1.0f), B = rand_vec((size_t)ldb * n, 1.0f);
                std::vector<float> bias = rand_vec(m, 1.0f), C0 = rand_vec((size_t)ldc * n, 1.0f);
                std::vector<float> aux0 = rand_vec((size_t)ldc * n, 2.0f);
                /* the buffers as the call sees them: float, or bf16 copies (whose values the reference reads) */
                std::vector<__nv_bfloat16> A16(A.size()), B16(B.size()), C16(C0.size()), X16(aux0.size());
                std::vector<__nv_bfloat16> bias16(bias.size()); /* the bias has the output's type */
                if (b16) {
                    for (size_t i = 0; i < bias.size(); i++)
                        bias[i] = __bfloat162float(bias16[i] = __float2bfloat16(bias[i]));
                    for (size_t i = 0; i < A.size(); i++) A[i] = __bfloat162float(A16[i] = __float2bfloat16(A[i]));
                    for (size_t i = 0; i < B.size(); i++) B[i] = __bfloat162float(B16[i] = __float2bfloat16(B[i]));
                    for (size_t i = 0; i < C0.size(); i++) C0[i] = __bfloat162float(C16[i] = __float2bfloat16(C0[i]));
                    for (size_t i = 0; i < aux0.size(); i++)
                        aux0[i] = __bfloat162float(X16[i] = __float2bfloat16(aux0[i]));
                }
                std::vector<float> C = C0, aux = aux0;
                LtCall lt(mode == 1 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F, b16 ? CUDA_R_16BF : CUDA_R_32F,
                          b16 ? CUDA_R_16BF : CUDA_R_32F, ta, m, n, k, lda, ldb, ldc);
                lt.epilogue(epis[e], b16 ? (const void *)bias16.data() : bias.data(),
                            b16 ? (void *)X16.data() : (void *)aux.data(), ldc);
                float beta = epis[e] == CUBLASLT_EPILOGUE_DGELU ? 0.0f : 0.5f;
                cublasStatus_t st;
                int got = lt.run(b16 ? (const void *)A16.data() : A.data(), b16 ? (const void *)B16.data() : B.data(),
                                 beta, b16 ? (void *)C16.data() : C.data(), &st);
                int keep = mode == 1 ? 10 : 23;
                double err = 0.0, errx = 0.0, scale = 0.0;
                for (int i = 0; i < m; i++)
                    for (int j = 0; j < n; j++) {
                        double s = 0.0;
                        for (int l = 0; l < k; l++)
                            s += (double)bits_round(ta ? A[l + (size_t)i * lda] : A[i + (size_t)l * lda], keep, false) *
                                 bits_round(B[l + (size_t)j * ldb], keep, false);
                        size_t c = i + (size_t)j * ldc;
                        s += beta * C0[c];
                        if (epis[e] & CUBLASLT_EPILOGUE_BIAS) s += bias[i];
                        double ref = s, refx = 0.0;
                        if (epis[e] == CUBLASLT_EPILOGUE_DGELU) ref = s * dgelu64(aux0[c]);
                        else if (epis[e] & CUBLASLT_EPILOGUE_GELU) ref = gelu64(s), refx = s;
                        double got_d = b16 ? __bfloat162float(C16[c]) : C[c];
                        double got_x = b16 ? __bfloat162float(X16[c]) : aux[c];
                        double tol16 = b16 ? 0x1p-8 : 0.0; /* a bf16 output: half an ulp on top */
                        err = fmax(err, fabs(got_d - ref) - tol16 * fabs(ref));
                        if (epis[e] == CUBLASLT_EPILOGUE_GELU_AUX || epis[e] == CUBLASLT_EPILOGUE_GELU_AUX_BIAS)
                            errx = fmax(errx, fabs(got_x - refx) - tol16 * fabs(refx));
                        else
                            errx = fmax(errx, fabs(got_x - aux0[c])); /* the aux matrix is only read */
                        scale = fmax(scale, fabs(s));
                    }
                CHECK(got == 1 && st == CUBLAS_STATUS_SUCCESS && err <= 1e-5 * scale && errx <= 1e-5 * scale,
                      "cublasLtMatmul, %s, op(A) %c, epilogue %s: against float64, output %.3g, aux %.3g",
                      mode == 0 ? "fp32" : mode == 1 ? "TF32" : "bf16", ta ? 'T' : 'N', names[e], err, errx);
            }
    /* refusals: an aux leading dimension not a multiple of 8, a buffer less aligned than promised, an unknown
     * epilogue; and every epilogue but DEFAULT with KVLAB_CUDA_EMU_NO_EPILOGUE set */
    std::vector<float> A = rand_vec(64 * 64, 1.0f), B = rand_vec(64 * 64, 1.0f), C(64 * 64), aux(64 * 64);
    std::vector<float> bias = rand_vec(64, 1.0f);
    cublasStatus_t st;
    {
        LtCall lt(CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_32F, 1, 12, 3, 8, 8, 8, 12);
        lt.epilogue(CUBLASLT_EPILOGUE_GELU_AUX_BIAS, bias.data(), aux.data(), 12);
        CHECK(lt.run(A.data(), B.data(), 0.0f, C.data(), &st) == 0, "an aux leading dimension of 12 is refused");
        lt.epilogue(CUBLASLT_EPILOGUE_GELU_AUX_BIAS, bias.data(), aux.data(), 16);
        CHECK(lt.run(A.data(), B.data(), 0.0f, C.data(), &st) == 1 && st == CUBLAS_STATUS_SUCCESS, "16 is taken");
        CHECK(lt.run(A.data() + 1, B.data(), 0.0f, C.data(), &st) == 1 && st == CUBLAS_STATUS_SUCCESS,
              "A 4-byte aligned where 4 bytes were promised: taken");
        uint32_t a16 = 16;
        cublasLtMatmulPreferenceSetAttribute(lt.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &a16, sizeof a16);
        CHECK(lt.run(A.data() + 1, B.data(), 0.0f, C.data(), &st) == 1 && st == CUBLAS_STATUS_NOT_SUPPORTED,
              "A 4-byte aligned where 16 bytes were promised: refused by the matmul");
        lt.epilogue(CUBLASLT_EPILOGUE_GELU, bias.data(), aux.data(), 16);
        CHECK(lt.run(A.data(), B.data(), 0.0f, C.data(), &st) == 0, "an epilogue kvlab does not use is refused");
        lt.epilogue(CUBLASLT_EPILOGUE_BIAS, bias.data(), aux.data(), 16);
        int32_t bt = CUDA_R_16BF;
        cublasLtMatmulDescSetAttribute(lt.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof bt);
        CHECK(lt.run(A.data(), B.data(), 0.0f, C.data(), &st) == 0,
              "a bias type other than the output's (the documented default) is refused");
        bt = -1;
        cublasLtMatmulDescSetAttribute(lt.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof bt);
        setenv("KVLAB_CUDA_EMU_NO_EPILOGUE", "1", 1);
        int refused = 0;
        for (uint32_t e : epis) {
            lt.epilogue(e, bias.data(), aux.data(), 16);
            refused += lt.run(A.data(), B.data(), 0.0f, C.data(), &st) == 0;
        }
        unsetenv("KVLAB_CUDA_EMU_NO_EPILOGUE");
        CHECK(refused == 4, "KVLAB_CUDA_EMU_NO_EPILOGUE: no algorithm for the 4 epilogues, one for DEFAULT (%d)",
              refused);
    }
}

int main(void) {
    const int P = 1;
    const Case cases[] = {
        /* name                          B  H  G  Tq  Tk  hd  causal pad pos groups pe dropout sym */
        {"hd 16, causal", 2, 2, 2, 70, 70, 16, 1, 0, 0, 1, 0, 0.0f, 0},
        {"hd 64, causal, GQA, pad, +Pos, bias, dropout", 1, 4, 2, 70, 70, 64, 1, 1, P, 1, 1, 0.2f, 0},
        {"hd 24, bidirectional, MQA, pad, +Pos per head", 2, 2, 1, 33, 33, 24, 0, 1, P, 2, 0, 0.1f, 0},
        {"hd 32, cross, masked batch, dropout", 2, 2, 2, 40, 70, 32, 0, 2, 0, 1, 0, 0.1f, 0},
        {"hd 128, bidirectional, bias", 1, 2, 2, 40, 40, 128, 0, 0, 0, 1, 1, 0.0f, 0},
        {"hd 8, causal, pad, +Pos", 3, 1, 1, 65, 65, 8, 1, 1, P, 1, 0, 0.0f, 0},
        {"hd 24, symmetric, pad, +Pos per head, dropout", 2, 2, 2, 45, 45, 24, 0, 1, P, 2, 0, 0.1f, 1},
        {"hd 64, symmetric, bias", 1, 2, 2, 70, 70, 64, 0, 0, 0, 1, 1, 0.0f, 1},
        {"hd 128, symmetric, masked batch, +Pos", 2, 1, 1, 40, 40, 128, 0, 2, P, 1, 0, 0.0f, 1},
        {"hd 8, symmetric", 1, 3, 3, 65, 65, 8, 0, 0, 0, 1, 0, 0.0f, 1},
        {"hd 32, symmetric, 2 whole blocks", 1, 2, 2, 130, 130, 32, 0, 0, 0, 1, 0, 0.0f, 1},
        {"hd 64, symmetric, 2 whole blocks", 1, 1, 1, 130, 130, 64, 0, 0, 0, 1, 0, 0.0f, 1},
        {"hd 128, symmetric, 2 whole blocks", 1, 1, 1, 130, 130, 128, 0, 0, 0, 1, 0, 0.0f, 1},
        /* whole blocks of rows and tiles of keys with nothing to mask (mma_forward_kernel's plain tiles) beside
         * the diagonal's and the last partial tile's; a head dim of 6 loads one value at a time */
        {"hd 64, causal, 3 whole blocks", 1, 2, 2, 192, 192, 64, 1, 0, 0, 1, 0, 0.0f, 0},
        {"hd 32, bidirectional, GQA", 2, 2, 1, 130, 130, 32, 0, 0, 0, 1, 0, 0.0f, 0},
        {"hd 128, causal", 1, 1, 1, 140, 140, 128, 1, 0, 0, 1, 0, 0.0f, 0},
        {"hd 6, causal, dropout", 2, 1, 1, 70, 70, 6, 1, 0, 0, 1, 0, 0.1f, 0},
        /* +Pos alone: its whole tiles take the +Pos-only per-score code (mma_tile_kind), the rest the masked one */
        {"hd 64, causal, +Pos, 3 whole blocks", 1, 2, 2, 192, 192, 64, 1, 0, P, 1, 0, 0.0f, 0},
        {"hd 16, causal, GQA, +Pos per head, 2 whole blocks", 1, 4, 2, 130, 130, 16, 1, 0, P, 4, 0, 0.0f, 0},
        {"hd 32, symmetric, +Pos per head, 2 whole blocks", 1, 2, 2, 130, 130, 32, 0, 0, P, 2, 0, 0.0f, 1},
    };
    for (const Case &c : cases) check_case(c);
    check_embedding_backward(700, 300, 23, 5);
    check_embedding_backward(300, 70, 11, 16);
    check_embedding_backward(EMB_THREADS, 32, 7, 3);
    check_adamw_spans();
    check_layernorm<1>(37, 100, true);
    check_layernorm<1>(9, 31, false);
    check_layernorm<4>(37, 100, true); /* 25 loads a row: a lane takes one or none in the last pass */
    check_layernorm<4>(9, 416, false);
    check_launches();
    check_deferred();
    check_pinned();
    check_order();
    check_gemm();
    check_lt();
    return TEST_SUMMARY("test_cuda_emu");
}
