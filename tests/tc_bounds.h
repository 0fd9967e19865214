/* The stated bounds of the tensor-core precisions, for the tests that run the attention and the products in them
 * (test_kernels.c on a TF32 or bf16 build, test_cuda_emu.cpp on the kernels themselves): relative to the largest
 * value, forward outputs (and two computations that should agree) and gradients. Each is about ten times the
 * rounding of the products' inputs (TF32: 10 mantissa bits, unit roundoff 2^-11 = 4.9e-4; bf16: 7 bits, 2^-8 =
 * 3.9e-3), stated before measuring (docs/cuda.md, "Tests and tolerances"). */
#ifndef KVLAB_TC_BOUNDS_H
#define KVLAB_TC_BOUNDS_H

#define TF32_FWD_TOL 5e-3
#define TF32_GRAD_TOL 1e-2
#define BF16_FWD_TOL 3e-2
#define BF16_GRAD_TOL 5e-2
/* With bf16 activations (CUDA_BF16) the attention's backward forms its row terms D = rowsum(dO . O) from the
 * output as stored, in bf16 (as FlashAttention-2 does): a rounding of up to 2^-8 that every score gradient of a
 * row shares. The +Pos weights and the relative bias sum score gradients over whole heads, so that shared error
 * adds up there (measured 5.9e-2 where D from the float32 output gives 2e-2): their bound in those builds. */
#define BF16_ACT_POS_GRAD_TOL 1e-1

#endif
