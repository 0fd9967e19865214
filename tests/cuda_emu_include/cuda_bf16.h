/* The emulated bf16 type and conversions (tests/cuda_emu.h) under the name the CUDA backend includes. */
#include "../cuda_emu.h"
