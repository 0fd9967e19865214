/* What the benchmark programs share. */
#ifndef KVLAB_BENCH_H
#define KVLAB_BENCH_H

#include "kernels.h"

/* Waits until the device has done everything queued on the backend's stream (a one-byte download of any device
 * buffer waits for the queue; on the CPU it costs nothing), so that a host clock read after it times the work. */
static inline void device_wait(const void *any) {
    unsigned char x;
    dev_download(&x, any, 1);
}

#endif
