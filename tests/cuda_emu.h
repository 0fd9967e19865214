/* A CPU emulation of the CUDA built-ins that the CUDA backend's kernels use
 * (kernels/cuda/), so that tests/test_cuda_emu.cpp can run the attention
 * kernels (attention_kernels.cuh) and the ops kernels of ops_kernels.cuh
 * where no GPU is, and, with the emulated runtime and cuBLAS
 * (cuda_emu_runtime.h), the whole backend runs under the GPU's test programs
 * (make CUDA_EMU=1): in CI and on every CPU build.
 *
 * What it models: a grid (up to three dimensions) runs block after block; a
 * block's threads are fibers on one host thread, switched only at
 * __syncthreads (and __syncthreads_count), __syncwarp, the warp shuffles and
 * votes, which are barriers of the block or of the warp, so the result is
 * deterministic (and an atomic is a plain update). Dynamic shared memory is one
 * buffer, filled with NaN before every block, so a read of shared memory
 * that no thread wrote shows in the results. A WMMA fragment holds its
 * whole tile in every lane (the real layout is unspecified, and kernels may
 * only touch fragment elements uniformly); loads read the tile, mma_sync
 * multiplies it, a store writes it from lane 0. __float_to_tf32 rounds to
 * 10 mantissa bits as the hardware's cvt.rna.tf32.f32 does, or leaves the
 * value alone with emu::tf32_exact set, so the tensor-core path can be
 * checked against the fp32 one to float32 rounding. __nv_bfloat16 is two
 * bytes as on a GPU; __float2bfloat16 rounds to 7 mantissa bits, to nearest
 * even (a NaN to the canonical one), and bf16 fragments load from bf16
 * memory only. Shared memory is filled with 0xff bytes, NaN as float and as
 * bf16.
 *
 * Lanes run in turn between barriers, so a fragment load that is not
 * separated by __syncwarp from the per-lane writes it reads (lane 0 would
 * load a tile the other lanes have not written yet) shows too, unless a
 * shuffle stands between them: here a shuffle is a barrier after which
 * every write is visible, where the hardware promises no memory order.
 *
 * With KVLAB_CUDA_EMU_ORDER=reverse in the environment, blocks, warps and
 * the lanes of a warp run in the opposite order (the last first). A GPU
 * promises no order at all, so a kernel's results may differ only by the
 * rounding of its atomics: a missing __syncthreads or __syncwarp, where one
 * thread reads what another writes in the same interval between barriers,
 * reads the right value in one order and NaN or a stale value in the
 * other, and the tests run in both.
 *
 * What it cannot show: timing, occupancy, register or shared memory limits
 * of a real GPU, bank conflicts, and races that only true concurrency
 * exposes (two writes of one interval, say, that happen to agree). The GPU
 * tests (-k cuda) remain the judge; this catches indexing, masking and
 * bookkeeping errors without one. */
#ifndef KVLAB_CUDA_EMU_H
#define KVLAB_CUDA_EMU_H

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__
#define __restrict__ __restrict
#define __align__(n) __attribute__((aligned(n)))

using std::max;
using std::min;

struct EmuDim3 {
    unsigned x, y, z;
};

namespace emu {

constexpr size_t SMEM_FLOATS = 64 * 1024; /* 256 KiB: more than any GPU gives one block */
constexpr size_t STACK_BYTES = 128 * 1024;

/* Switching fibers: on x86-64 (without AddressSanitizer, which must see every stack switch) a switch of the
 * stack pointer and the callee-saved registers, as a call; elsewhere ucontext, whose switches also save and
 * restore the signal mask, a system call each (five times slower for the whole emulation). */
#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__)
#define EMU_FAST_SWITCH 1
/* Saves the caller's registers on its stack and its stack pointer in *save, then continues on the stack to
 * (a stack this function saved, or a new fiber's, made by start_fiber), at the address on its top: popped and
 * jumped to, not returned to. A ret there would always return somewhere other than the call the CPU's
 * return-stack predictor pairs it with (the other side's call), and the missed prediction cost more than half
 * of an emulated run's time: a tiny seq2seq training step took 225 ms with ret, 98 ms with the jump. */
__attribute__((naked, noinline)) inline void switch_stack(void ** /* save: rdi */, void * /* to: rsi */) {
    __asm__ volatile("pushq %rbp\n\tpushq %rbx\n\tpushq %r12\n\tpushq %r13\n\tpushq %r14\n\tpushq %r15\n\t"
                     "movq %rsp, (%rdi)\n\tmovq %rsi, %rsp\n\t"
                     "popq %r15\n\tpopq %r14\n\tpopq %r13\n\tpopq %r12\n\tpopq %rbx\n\tpopq %rbp\n\t"
                     "popq %r8\n\tjmp *%r8"); /* r8: free at a call */
}
#else
#define EMU_FAST_SWITCH 0
#endif

/* A cp.async copy in flight: its 16 bytes (read from global memory when issued, which no kernel writes while
 * it reads) and where they land. */
struct AsyncCopy {
    void *dst;
    unsigned char bytes[16];
};

struct Fiber {
    ucontext_t ctx;
    void *sp; /* EMU_FAST_SWITCH: its stack pointer while switched out */
    char *stack; /* STACK_BYTES, above a page the thread cannot touch (stack_of) */
    EmuDim3 tid;
    bool done;
    bool at_block;  /* waiting at __syncthreads, generation wait_gen */
    unsigned wait_gen;
    unsigned parity; /* of its next shuffle (two slots, one barrier per shuffle) */
    std::vector<AsyncCopy> open;                 /* cp.async copies since its last commit */
    std::vector<std::vector<AsyncCopy>> groups;  /* committed groups not yet waited for, oldest first */
};

struct Barrier {
    int need, arrived;
    unsigned gen;
};

inline std::vector<Fiber> fibers;
inline ucontext_t sched;
inline void *sched_sp;
inline int cur;
inline EmuDim3 block_idx, block_dim, grid_dim;
inline Barrier block_bar;
inline std::vector<Barrier> warp_bar;
inline std::vector<uint64_t> lanes; /* two shuffle slots per thread */
inline std::function<void()> body;
inline bool tf32_exact;
inline size_t smem_bytes;
inline int sync_counts[2]; /* __syncthreads_count, by the parity of the barrier's generation */
/* The static __shared__ arrays of the kernels (tests/cuda_emu_src.py registers each once): NaN before every
 * block, as the dynamic shared memory is, so a read of an element no thread of the block wrote shows. */
struct SharedArray {
    void *p;
    size_t bytes;
};
inline std::vector<SharedArray> shared_arrays;
inline bool shared_array(void *p, size_t bytes) {
    shared_arrays.push_back({p, bytes});
    memset(p, 0xff, bytes); /* its first block is under way: no thread has written it yet */
    return true;
}

inline void yield() {
#if EMU_FAST_SWITCH
    switch_stack(&fibers[(size_t)cur].sp, sched_sp);
#else
    swapcontext(&fibers[(size_t)cur].ctx, &sched);
#endif
}

inline void wait(Barrier &b) {
    unsigned g = b.gen;
    if (++b.arrived == b.need) {
        b.arrived = 0;
        b.gen++;
        return;
    }
    bool whole_block = &b == &block_bar;
    fibers[(size_t)cur].at_block = whole_block;
    fibers[(size_t)cur].wait_gen = g;
    while (b.gen == g) yield();
    fibers[(size_t)cur].at_block = false;
}

inline void trampoline() {
    body();
    fibers[(size_t)cur].done = true;
#if EMU_FAST_SWITCH
    void *unused;
    switch_stack(&unused, sched_sp); /* never resumed */
    __builtin_unreachable();
#endif
}

/* Thread t's stack, made on first use and kept: STACK_BYTES above a guard page, so that an overflow stops the
 * program (SIGSEGV) instead of writing over another thread's stack or the heap. */
inline char *stack_of(unsigned t) {
    static std::vector<char *> stacks;
    if (stacks.size() <= t) stacks.resize(t + 1, nullptr);
    if (!stacks[t]) {
        size_t page = (size_t)sysconf(_SC_PAGESIZE);
        void *m = mmap(nullptr, STACK_BYTES + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED || mprotect(m, page, PROT_NONE)) {
            fprintf(stderr, "cuda_emu: no memory for thread %u's stack\n", t);
            exit(2);
        }
        stacks[t] = (char *)m + page;
    }
    return stacks[t];
}

/* A fresh fiber for thread t at the start of body (getcontext returns twice: kept out of launch's frame). */
__attribute__((noinline)) inline void start_fiber(Fiber &f, unsigned t) {
    f.stack = stack_of(t);
    f.tid = {t, 0, 0};
    f.done = f.at_block = false;
    f.parity = 0;
    f.open.clear();
    f.groups.clear();
#if EMU_FAST_SWITCH
    /* the stack as switch_stack leaves one: six registers (zero), then trampoline as the address it continues at,
     * then a fake return address of trampoline's own, so that it starts with the stack aligned as after a call */
    uintptr_t top = ((uintptr_t)f.stack + STACK_BYTES) & ~(uintptr_t)15;
    void **sp = (void **)top - 8;
    for (int i = 0; i < 6; i++) sp[i] = nullptr;
    sp[6] = (void *)trampoline;
    sp[7] = nullptr;
    f.sp = sp;
#else
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = STACK_BYTES;
    f.ctx.uc_link = &sched;
    makecontext(&f.ctx, trampoline, 0);
#endif
}

/* KVLAB_CUDA_EMU_ORDER=reverse: blocks, warps and lanes last first (read once; anything else is an error). */
inline bool reverse_order() {
    static const int rev = [] {
        const char *e = getenv("KVLAB_CUDA_EMU_ORDER");
        if (!e || !*e || !strcmp(e, "forward")) return 0;
        if (!strcmp(e, "reverse")) return 1;
        fprintf(stderr, "cuda_emu: KVLAB_CUDA_EMU_ORDER=%s (hint: forward or reverse)\n", e);
        exit(2);
    }();
    return rev;
}

/* Bytes past a launch's dynamic shared memory that are filled before and checked after every block: a kernel that
 * writes past the size its launch asked for (a layout bigger than its size function says) stops the emulation,
 * one that reads there reads NaN. */
constexpr size_t SMEM_CANARY = 16 * 1024;

/* Runs body as grid x threads CUDA threads, block after block (x fastest, then y, then z; the other way round
 * under reverse_order, as are the warps and lanes), with smem bytes of
 * dynamic shared memory; each buffer of shared (nshared of them) is filled with NaN (0xff bytes) before every
 * block, SMEM_CANARY bytes past smem included, and those are checked after it. */
inline void launch_grid(EmuDim3 grid, unsigned threads, size_t smem, float *const *shared, int nshared,
                        const std::function<void()> &fn) {
    if (smem > SMEM_FLOATS * sizeof(float) || threads % 32) {
        fprintf(stderr, "cuda_emu: a launch of %u threads with %zu bytes of shared memory\n", threads, smem);
        exit(2);
    }
    smem_bytes = smem;
    body = fn;
    block_dim = {threads, 1, 1};
    grid_dim = grid;
    if (fibers.size() != threads) fibers = std::vector<Fiber>(threads);
    lanes.assign(2 * (size_t)threads, 0);
    const size_t fill = std::min(SMEM_FLOATS * sizeof(float), smem + SMEM_CANARY);
    const bool rev = reverse_order();
    const unsigned long nblocks = (unsigned long)grid.x * grid.y * grid.z, nwarps = threads / 32;
    for (unsigned long bi = 0; bi < nblocks; bi++) {
        unsigned long b = rev ? nblocks - 1 - bi : bi;
        block_idx = {(unsigned)(b % grid.x), (unsigned)(b / grid.x % grid.y), (unsigned)(b / grid.x / grid.y)};
        for (int i = 0; i < nshared; i++) memset(shared[i], 0xff, fill); /* NaN as float and as bf16 */
        for (const SharedArray &a : shared_arrays) memset(a.p, 0xff, a.bytes); /* NaN floats, -1 ints */
        block_bar = {(int)threads, 0, 0};
        warp_bar.assign(threads / 32, Barrier{32, 0, 0});
        for (unsigned t = 0; t < threads; t++) start_fiber(fibers[t], t);
        /* one warp at a time until its lanes are done or at __syncthreads (its warp barriers and shuffles cycle
         * through 32 fibers only), then the next warp; then again, until every thread is done */
        for (bool busy = true; busy;) {
            busy = false;
            for (unsigned wi = 0; wi < nwarps; wi++) {
                unsigned w = rev ? (unsigned)nwarps - 1 - wi : wi;
                for (long rounds = 0;; rounds++) {
                    bool ran = false;
                    for (unsigned li = 0; li < 32; li++) {
                        unsigned t = w * 32 + (rev ? 31 - li : li);
                        Fiber &f = fibers[t];
                        if (f.done || (f.at_block && block_bar.gen == f.wait_gen)) continue;
                        cur = (int)t;
#if EMU_FAST_SWITCH
                        switch_stack(&sched_sp, f.sp);
#else
                        swapcontext(&sched, &f.ctx);
#endif
                        ran = true;
                    }
                    if (!ran) break;
                    if (rounds > 100000000L) {
                        fprintf(stderr, "cuda_emu: warp %u of block %lu never reaches __syncthreads (a barrier only "
                                "some of its lanes call?)\n", w, b);
                        exit(2);
                    }
                }
            }
            for (unsigned t = 0; t < threads; t++) busy = busy || !fibers[t].done;
        }
        if (block_bar.arrived) {
            fprintf(stderr, "cuda_emu: block %lu ended with threads waiting at __syncthreads\n", b);
            exit(2);
        }
        for (unsigned t = 0; t < threads; t++)
            if (!fibers[t].open.empty() || !fibers[t].groups.empty()) {
                fprintf(stderr, "cuda_emu: thread %u of block %lu ended with cp.async copies it never waited for\n",
                        t, b);
                exit(2);
            }
        for (int i = 0; i < nshared; i++) {
            const unsigned char *c = (const unsigned char *)shared[i];
            for (size_t k = smem; k < fill; k++)
                if (c[k] != 0xff) {
                    fprintf(stderr, "cuda_emu: block %lu wrote shared memory at byte %zu, past the %zu bytes its "
                            "launch asked for\n", b, k, smem);
                    exit(2);
                }
        }
    }
}

/* A one-dimensional grid with one shared-memory buffer. */
inline void launch(unsigned grid, unsigned threads, size_t smem, float *shared, const std::function<void()> &fn) {
    launch_grid({grid, 1, 1}, threads, smem, &shared, 1, fn);
}

template <typename T> inline T shfl(T v, int src) {
    static_assert(sizeof(T) <= sizeof(uint64_t), "shuffles of up to 8 bytes");
    int w = cur / 32;
    size_t slot = (size_t)fibers[(size_t)cur].parity * fibers.size();
    fibers[(size_t)cur].parity ^= 1u;
    memcpy(&lanes[slot + (size_t)cur], &v, sizeof v);
    wait(warp_bar[(size_t)w]); /* a lane can be one shuffle ahead only, writing the other slot */
    T r;
    memcpy(&r, &lanes[slot + (size_t)(w * 32 + (src & 31))], sizeof r);
    return r;
}

/* Every lane's predicate, bit l from lane l: like a shuffle, a barrier of the warp. */
inline unsigned ballot(bool pred) {
    int w = cur / 32;
    size_t slot = (size_t)fibers[(size_t)cur].parity * fibers.size();
    fibers[(size_t)cur].parity ^= 1u;
    lanes[slot + (size_t)cur] = pred;
    wait(warp_bar[(size_t)w]);
    unsigned r = 0;
    for (int l = 0; l < 32; l++) r |= (lanes[slot + (size_t)(w * 32 + l)] ? 1u : 0u) << l;
    return r;
}

} /* namespace emu */

#define threadIdx (emu::fibers[(size_t)emu::cur].tid)
#define blockIdx (emu::block_idx)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)

inline void __syncthreads() { emu::wait(emu::block_bar); }
/* The number of the block's threads whose pred is nonzero, to every thread: a barrier. The first thread to
 * arrive starts the count of this barrier's generation; the other generation's count may still be read. */
inline int __syncthreads_count(int pred) {
    int slot = (int)(emu::block_bar.gen & 1u);
    if (emu::block_bar.arrived == 0) emu::sync_counts[slot] = 0;
    emu::sync_counts[slot] += pred != 0;
    emu::wait(emu::block_bar);
    return emu::sync_counts[slot];
}
/* Atomics: the threads are fibers of one host thread, switched only at barriers, so a plain update is atomic. */
template <typename T> inline T atomicAdd(T *p, T v) {
    T old = *p;
    *p = old + v;
    return old;
}
inline int atomicMin(int *p, int v) {
    int old = *p;
    *p = std::min(old, v);
    return old;
}
inline void __syncwarp(unsigned mask = 0xffffffffu) {
    (void)mask;
    emu::wait(emu::warp_bar[(size_t)(emu::cur / 32)]);
}
template <typename T> inline T __shfl_sync(unsigned mask, T v, int src) {
    (void)mask;
    return emu::shfl(v, src);
}
template <typename T> inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
    (void)mask;
    return emu::shfl(v, (emu::cur % 32) ^ lane_mask);
}

inline unsigned __ballot_sync(unsigned mask, int pred) {
    (void)mask;
    return emu::ballot(pred != 0);
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }

namespace emu {
/* to nearest, ties to even, 7 mantissa bits (cvt.rn.bf16.f32); NaN and infinities unchanged */
inline float round_bf16(float v) {
    if (!std::isfinite(v)) return v;
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&v, &u, sizeof v);
    return v;
}
} /* namespace emu */

/* <cuda_bf16.h>: the two conversions the backend uses, on the 16 high bits of a float; a NaN becomes the
 * canonical 0x7fff, as cvt.rn.bf16.f32 makes it */
struct __nv_bfloat16 {
    uint16_t bits;
};
inline __nv_bfloat16 __float2bfloat16(float v) {
    if (std::isnan(v)) return __nv_bfloat16{0x7fff};
    v = emu::round_bf16(v);
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    return __nv_bfloat16{(uint16_t)(u >> 16)};
}
inline float __bfloat162float(__nv_bfloat16 h) {
    uint32_t u = (uint32_t)h.bits << 16;
    float v;
    memcpy(&v, &u, sizeof v);
    return v;
}

/* CUDA's 16-byte vector type, aligned as on a GPU */
struct alignas(16) float4 {
    float x, y, z, w;
};

/* kernels/cuda/mma.cuh's primitives. mem_as and mem_put: a load and a store of a T, which a GPU faults on unless
 * p is aligned to the T's size: so here too. */
namespace emu {
inline void check_aligned(const void *p, size_t n) {
    if ((uintptr_t)p % n) {
        fprintf(stderr, "cuda_emu: %zu-byte access at an address not aligned to %zu bytes\n", n, n);
        exit(2);
    }
}
} /* namespace emu */
template <typename T> inline T mem_as(const void *p) {
    emu::check_aligned(p, sizeof(T));
    T v;
    memcpy(&v, p, sizeof v);
    return v;
}
template <typename T> inline void mem_put(void *p, T v) {
    emu::check_aligned(p, sizeof(T));
    memcpy(p, &v, sizeof v);
}
inline float exp2_approx(float x) { return exp2f(x); }

/* cp.async.cg.shared.global of 16 bytes (zeros where !in), cp.async.commit_group and cp.async.wait_group N: the
 * destination turns NaN (0xff bytes) when the copy is issued and gets its bytes only when the thread waits for the
 * copy's group, so a read of the tile before the wait and the barrier after it sees NaN, and so does a warp still
 * reading a buffer that another warp already refills (a missing barrier), where a GPU may give either value. */
inline void cp_async16(void *dst, const void *src, bool in) {
    emu::check_aligned(dst, 16);
    emu::AsyncCopy c{dst, {}};
    if (in) {
        emu::check_aligned(src, 16);
        memcpy(c.bytes, src, 16);
    }
    memset(dst, 0xff, 16);
    emu::fibers[(size_t)emu::cur].open.push_back(c);
}
inline void cp_async_commit() {
    emu::Fiber &f = emu::fibers[(size_t)emu::cur];
    f.groups.push_back(std::move(f.open));
    f.open.clear();
}
template <int N> inline void cp_async_wait() {
    emu::Fiber &f = emu::fibers[(size_t)emu::cur];
    while (f.groups.size() > (size_t)N) {
        for (const emu::AsyncCopy &c : f.groups.front()) memcpy(c.dst, c.bytes, 16);
        f.groups.erase(f.groups.begin());
    }
}
inline uint32_t pack_bf16x2(float lo, float hi) {
    return (uint32_t)__float2bfloat16(lo).bits | (uint32_t)__float2bfloat16(hi).bits << 16;
}

/* ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16 (kernels/cuda/mma.cuh states its layout): a collective of the
 * warp; every lane leaves the address of its row (lanes 8 i .. 8 i + 7: matrix i's rows, 16-byte aligned), and
 * after the warp's barrier reads its two elements of each matrix from the rows the others named. */
namespace emu {
inline std::vector<const void *> ldsm_rows; /* two slots per thread, as the shuffles' */
inline void ldsm(uint32_t (&r)[4], const void *row, bool trans) {
    check_aligned(row, 16);
    if (ldsm_rows.size() < 2 * fibers.size()) ldsm_rows.resize(2 * fibers.size());
    int w = cur / 32, lane = cur % 32, gid = lane / 4, tq = lane % 4;
    size_t slot = (size_t)fibers[(size_t)cur].parity * fibers.size();
    fibers[(size_t)cur].parity ^= 1u;
    ldsm_rows[slot + (size_t)cur] = row;
    wait(warp_bar[(size_t)w]);
    for (int i = 0; i < 4; i++) {
        auto at = [&](int rr, int c) {
            return ((const __nv_bfloat16 *)ldsm_rows[slot + (size_t)(w * 32 + 8 * i + rr)])[c].bits;
        };
        uint16_t lo = trans ? at(2 * tq, gid) : at(gid, 2 * tq), hi = trans ? at(2 * tq + 1, gid) : at(gid, 2 * tq + 1);
        r[i] = (uint32_t)lo | (uint32_t)hi << 16;
    }
}
} /* namespace emu */
inline void ldsm_x4(uint32_t (&r)[4], const void *row) { emu::ldsm(r, row, false); }
inline void ldsm_x4_trans(uint32_t (&r)[4], const void *row) { emu::ldsm(r, row, true); }

/* mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 with the register layout of the PTX ISA (kernels/cuda/mma.cuh
 * states it): d += a . b. A collective of the warp, as a shuffle is: every lane leaves its A and B registers in its
 * slot, and after the warp's barrier each lane sums its four results in float, k in order, from the lanes that hold
 * its row of A and its column of B. */
namespace emu {
struct MmaRegs {
    uint32_t a[4], b[2];
};
inline std::vector<MmaRegs> mma_regs; /* two slots per thread, as the shuffles' */
inline float bf16_half(uint32_t r, int hi) { return __bfloat162float(__nv_bfloat16{(uint16_t)(hi ? r >> 16 : r)}); }
} /* namespace emu */
inline void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    using namespace emu;
    if (mma_regs.size() < 2 * fibers.size()) mma_regs.resize(2 * fibers.size());
    int w = cur / 32, lane = cur % 32, gid = lane / 4, tq = lane % 4;
    size_t slot = (size_t)fibers[(size_t)cur].parity * fibers.size();
    fibers[(size_t)cur].parity ^= 1u;
    MmaRegs &mine = mma_regs[slot + (size_t)cur];
    memcpy(mine.a, a, sizeof mine.a);
    memcpy(mine.b, b, sizeof mine.b);
    wait(warp_bar[(size_t)w]);
    const MmaRegs *warp = &mma_regs[slot + (size_t)w * 32];
    float out[4];
    for (int e = 0; e < 4; e++) {
        int row = gid + (e >= 2 ? 8 : 0), col = 2 * tq + (e & 1);
        float s = d[e];
        for (int k = 0; k < 16; k++) {
            const MmaRegs &ra = warp[(row % 8) * 4 + (k % 8) / 2], &rb = warp[col * 4 + (k % 8) / 2];
            s += bf16_half(ra.a[(row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)], k & 1) * bf16_half(rb.b[k >= 8], k & 1);
        }
        out[e] = s;
    }
    memcpy(d, out, sizeof out);
}

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
namespace precision {
struct tf32 {};
}
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K> struct shape;
template <int M, int N, int K> struct shape<matrix_a, M, N, K> { static constexpr int rows = M, cols = K; };
template <int M, int N, int K> struct shape<matrix_b, M, N, K> { static constexpr int rows = K, cols = N; };
template <int M, int N, int K> struct shape<accumulator, M, N, K> { static constexpr int rows = M, cols = N; };

/* the whole tile, row-major, in every lane */
template <typename Use, int M, int N, int K, typename T, typename Layout = void> struct fragment {
    static constexpr int rows = shape<Use, M, N, K>::rows, cols = shape<Use, M, N, K>::cols;
    static constexpr int num_elements = rows * cols;
    float x[num_elements];
};

inline float __float_to_tf32(float v) {
    if (emu::tf32_exact || !std::isfinite(v)) return v;
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    u = (u + 0x1000u) & 0xffffe000u; /* to nearest, ties away from zero, 10 mantissa bits */
    memcpy(&v, &u, sizeof v);
    return v;
}

/* An operand tile from memory: TF32 fragments from float, bf16 ones from bf16 (as the real overloads); the
 * pointer 32-byte aligned, the stride a multiple of 16 bytes. */
template <typename Use, int M, int N, int K, typename T, typename L, typename P>
inline void load_matrix_sync(fragment<Use, M, N, K, T, L> &f, const P *p, unsigned ld) {
    static_assert(!std::is_same<L, void>::value, "operand fragments name their layout");
    static_assert(std::is_same<T, precision::tf32>::value ? std::is_same<P, float>::value
                                                          : std::is_same<T, P>::value && std::is_same<P, __nv_bfloat16>::value,
                  "a TF32 fragment loads float, a bf16 fragment bf16");
    constexpr int R = fragment<Use, M, N, K, T, L>::rows, C = fragment<Use, M, N, K, T, L>::cols;
    if ((uintptr_t)p % 32 || ld * sizeof(P) % 16) {
        fprintf(stderr, "cuda_emu: load_matrix_sync of a pointer not 32-byte aligned or a stride of %u\n", ld);
        exit(2);
    }
    auto at = [&](size_t i) {
        if constexpr (std::is_same<P, float>::value) return p[i];
        else return __bfloat162float(p[i]);
    };
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            f.x[r * C + c] = std::is_same<L, row_major>::value ? at((size_t)r * ld + c) : at((size_t)c * ld + r);
}

template <int M, int N, int K>
inline void fill_fragment(fragment<accumulator, M, N, K, float> &f, float v) {
    for (float &e : f.x) e = v;
}

template <int M, int N, int K, typename T, typename LA, typename LB>
inline void mma_sync(fragment<accumulator, M, N, K, float> &d, const fragment<matrix_a, M, N, K, T, LA> &a,
                     const fragment<matrix_b, M, N, K, T, LB> &b, const fragment<accumulator, M, N, K, float> &c) {
    float out[M * N];
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            float s = c.x[m * N + n];
            for (int k = 0; k < K; k++) s += a.x[m * K + k] * b.x[k * N + n];
            out[m * N + n] = s;
        }
    memcpy(d.x, out, sizeof out);
}

template <int M, int N, int K>
inline void store_matrix_sync(float *p, const fragment<accumulator, M, N, K, float> &f, unsigned ld, layout_t l) {
    if ((uintptr_t)p % 32 || ld % 4) {
        fprintf(stderr, "cuda_emu: store_matrix_sync to a pointer not 32-byte aligned or a stride of %u\n", ld);
        exit(2);
    }
    if (emu::cur % 32) return; /* lane 0 writes the warp's tile */
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) (l == mem_row_major ? p[(size_t)m * ld + n] : p[(size_t)n * ld + m]) = f.x[m * N + n];
}

} /* namespace wmma */
} /* namespace nvcuda */

#endif
