/* Warp-level bf16 matrix products with a known register layout (PTX mma.sync.m16n8k16, sm_80 and later), for the
 * attention kernels that keep their scores in registers (attention_kernels.cuh, mma_*_kernel), and ldmatrix, which
 * loads their operands from shared memory in that layout. WMMA hides
 * which lane holds which element; mma.sync documents it (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating
 * point type"), so a lane knows the query row and key of each of its scores and applies masks, +Pos and softmax
 * where the product left them. With lane l, gid = l / 4 and tq = l % 4:
 *  A (16 x 16, row-major), four registers of two bf16 (low half first): a[0] = (row gid, cols 2tq, 2tq+1),
 *    a[1] = (row gid+8, the same cols), a[2] = (row gid, cols 2tq+8, 2tq+9), a[3] = (row gid+8, cols 2tq+8, 2tq+9);
 *  B (16 x 8), two registers: b[0] = (rows 2tq, 2tq+1; col gid), b[1] = (rows 2tq+8, 2tq+9; col gid);
 *  C and D (16 x 8, float): d[0], d[1] = (row gid, cols 2tq, 2tq+1), d[2], d[3] = (row gid+8, the same cols).
 * So the accumulators of two adjacent 8-column tiles are, packed to bf16, the A operand of the next product: what
 * keeps the probabilities in registers between Q.K^T and P.V.
 *
 * Under the CPU emulation of the CUDA built-ins (tests/cuda_emu.h) the emulator provides these functions with the
 * same layout; there mem_as and mem_put copy through memcpy and check the alignment a GPU faults on,
 * exp2_approx is exp2f, and a cp.async copy lands when its thread waits for it. */
#ifndef KVLAB_MMA_CUH
#define KVLAB_MMA_CUH

#include <stdint.h>

#include "act.cuh"

/* before a loop over registers (fragments, accumulators): unrolled, so that they stay registers; MMA_ROLLED before a
 * loop of loads that should not be (unrolled, the compiler keeps every iteration's addresses in registers) */
#ifdef KVLAB_CUDA_EMU_H
#define MMA_UNROLL
#define MMA_ROLLED
#else
#define MMA_UNROLL _Pragma("unroll")
#define MMA_ROLLED _Pragma("unroll 1")
#endif

#ifndef KVLAB_CUDA_EMU_H
/* d += a . b, float accumulators */
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
/* lo and hi rounded to bf16 (to nearest even), lo in the low half */
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}
/* ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: four 8 x 8 bf16 matrices from shared memory, lanes 8 i ..
 * 8 i + 7 giving the addresses of matrix i's rows (16-byte aligned); r[i] gets matrix i's (row l / 4, columns
 * 2 (l % 4) and 2 (l % 4) + 1) in lane l, or with trans its (rows 2 (l % 4) and 2 (l % 4) + 1, column l / 4): the
 * layout of an mma_bf16_16816 operand register, from rows or from columns. */
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void *row) {
    unsigned a = (unsigned)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const void *row) {
    unsigned a = (unsigned)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
/* 2^x from the special function unit in one instruction (ex2.approx.ftz: about 2^-22 relative, results below
 * float's normal range flushed to 0), where exp2f and expf take several: the softmax's exponentials */
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
/* cp.async (sm_80 and later): 16 bytes from global src to shared dst without passing through registers (.cg: cached
 * in L2, not L1), or 16 zeros where !in (a source size of 0; src must still be a global address). A thread's
 * copies form a group at cp_async_commit; cp_async_wait<N> returns when at most its N newest groups are still in
 * flight; a barrier after it makes every thread's landed copies visible to the block. */
__device__ __forceinline__ void cp_async16(void *dst, const void *src, bool in) {
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(in ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
#endif

/* Operands of mma_bf16_16816 from bf16 tiles in shared memory (row-major, rows ld elements apart, ld a multiple
 * of 8, tiles 16-byte aligned), each one ldmatrix, and from accumulators, for lane `lane`:
 *  mma_a_rows: A = rows 0..15 of `rows`, columns 16 ks .. 16 ks + 15;
 *  mma_b_rows: b[c] for c < 2: B(k, col) = rows[8 (n + c) + col][16 ks + k], the rows as B's columns (the B of
 *              X . rows^T), for two 8-column tiles n and n + 1;
 *  mma_b_cols: b[c]: B(k, col) = rows[16 kk + k][8 (n + c) + col], the rows as B's rows (the B of X . rows);
 *  mma_a_acc:  A(r, k) = the accumulators acc[2 kk] (k < 8) and acc[2 kk + 1] (k >= 8), rounded to bf16: a
 *              product's 16 x 16 result block kk as the A operand of the next product. */
__device__ __forceinline__ void mma_a_rows(uint32_t (&a)[4], const __nv_bfloat16 *rows, int ld, int ks, int lane) {
    int m = lane / 8; /* matrix m: rows 8 (m % 2) .., columns 16 ks + 8 (m / 2) .. */
    ldsm_x4(a, rows + (lane % 8 + 8 * (m % 2)) * ld + 16 * ks + 8 * (m / 2));
}
__device__ __forceinline__ void mma_b_rows(uint32_t (&b)[2][2], const __nv_bfloat16 *rows, int ld, int n, int ks,
                                           int lane) {
    int m = lane / 8; /* matrix m: rows 8 (n + m / 2) .., columns 16 ks + 8 (m % 2) .. */
    uint32_t r[4];
    ldsm_x4(r, rows + (8 * (n + m / 2) + lane % 8) * ld + 16 * ks + 8 * (m % 2));
    b[0][0] = r[0], b[0][1] = r[1], b[1][0] = r[2], b[1][1] = r[3];
}
__device__ __forceinline__ void mma_b_cols(uint32_t (&b)[2][2], const __nv_bfloat16 *rows, int ld, int kk, int n,
                                           int lane) {
    int m = lane / 8; /* matrix m: rows 16 kk + 8 (m % 2) .., columns 8 (n + m / 2) .., transposed */
    uint32_t r[4];
    ldsm_x4_trans(r, rows + (16 * kk + 8 * (m % 2) + lane % 8) * ld + 8 * (n + m / 2));
    b[0][0] = r[0], b[0][1] = r[1], b[1][0] = r[2], b[1][1] = r[3];
}
template <int N> __device__ __forceinline__ void mma_a_acc(uint32_t (&a)[4], const float (&acc)[N][4], int kk) {
    a[0] = pack_bf16x2(acc[2 * kk][0], acc[2 * kk][1]);
    a[1] = pack_bf16x2(acc[2 * kk][2], acc[2 * kk][3]);
    a[2] = pack_bf16x2(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
    a[3] = pack_bf16x2(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
}

#endif
