/* The emulated WMMA (tests/cuda_emu.h) under the name the CUDA backend includes. */
#include "../cuda_emu.h"
