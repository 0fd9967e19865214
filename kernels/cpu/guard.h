/* Debug mode of the CPU backend (CONFIG_CPU_DEVICE_GUARD): device memory the
 * host cannot touch outside the backend's own calls. kernels/cpu/guard.c. */
#ifndef KVLAB_CPU_GUARD_H
#define KVLAB_CPU_GUARD_H

#include <stddef.h>

#if IS_ENABLED(CONFIG_CPU_DEVICE_GUARD)
void *guard_alloc(size_t bytes);
void guard_free(void *p);
#else
static inline void *guard_alloc(size_t bytes) { (void)bytes; return NULL; }
static inline void guard_free(void *p) { (void)p; }
#endif

#endif
