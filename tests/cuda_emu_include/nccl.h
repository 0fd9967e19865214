/* The emulated NCCL (tests/cuda_emu_nccl.h) under the name the CUDA backend includes. */
#include "../cuda_emu_nccl.h"
