/* The emulated cuBLASLt (tests/cuda_emu_runtime.h) under the name the CUDA backend includes. */
#include "../cuda_emu_runtime.h"
