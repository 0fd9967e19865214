/* Loads and stores of activations (act_t, kernels/kernels.h: float, or __nv_bfloat16 with CUDA_BF16): every
 * kernel computes in float whatever it reads and rounds what it stores (to nearest even), so that one kernel
 * source serves both. A header of its own, as warp.cuh, for the kernels that tests/test_cuda_emu.cpp runs on the
 * CPU; its includer provides __nv_bfloat16 (<cuda_bf16.h>). */
#ifndef KVLAB_ACT_CUH
#define KVLAB_ACT_CUH

__host__ __device__ inline float act_ld(float x) { return x; }
__host__ __device__ inline float act_ld(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T>
__host__ __device__ inline T act_as(float x);
template <>
__host__ __device__ inline float act_as<float>(float x) { return x; }
template <>
__host__ __device__ inline __nv_bfloat16 act_as<__nv_bfloat16>(float x) { return __float2bfloat16(x); }

#endif
