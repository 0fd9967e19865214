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

/* W activations of type A moved as one access (W sizeof(A) = 16 bytes: one 128-bit load or store), with mem_as
 * and mem_put: a load and a store of a T at p, which must be aligned to the T's size (a GPU faults otherwise; the
 * CPU emulation, tests/cuda_emu.h, provides both and checks it). */
template <typename A, int W> struct alignas(W * sizeof(A)) ActVec {
    A v[W];
};
#ifndef KVLAB_CUDA_EMU_H
template <typename T> __device__ __forceinline__ T mem_as(const void *p) { return *reinterpret_cast<const T *>(p); }
template <typename T> __device__ __forceinline__ void mem_put(void *p, T v) { *reinterpret_cast<T *>(p) = v; }
#endif

#endif
