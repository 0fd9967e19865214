/* CPU backend: memory is ordinary host memory; threads are one OpenMP pool
 * shared with OpenBLAS (we link the OpenMP build of OpenBLAS, which runs
 * single-threaded inside our parallel regions and uses the same pool
 * outside them, so the two never oversubscribe the cores). */
#include "kernels.h"

#include <cblas.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "common.h"
#include "guard.h"

/* Not declared by every cblas.h; provided by OpenBLAS. */
void openblas_set_num_threads(int num_threads);

static int g_threads = 1;
static size_t g_alloc_total; /* dev_alloc_total() */

void backend_init(int nthreads) {
    if (nthreads < 0) FATAL("backend_init: nthreads must be >= 0, got %d", nthreads);
    if (nthreads == 0) nthreads = omp_get_num_procs();
    g_threads = nthreads;
    omp_set_num_threads(nthreads);
    openblas_set_num_threads(nthreads);
}

const char *backend_name(void) { return "cpu (OpenBLAS sgemm + OpenMP)"; }

int backend_threads(void) { return g_threads; }

void *dev_alloc(size_t bytes) {
    KPROF_OP();
    g_alloc_total += bytes;
    if (IS_ENABLED(CONFIG_CPU_DEVICE_GUARD)) return guard_alloc(bytes); /* zero-filled pages */
    /* 64-byte alignment for full-width vector loads */
    size_t rounded = (bytes + 63) / 64 * 64;
    void *p = aligned_alloc(64, rounded ? rounded : 64);
    if (!p) FATAL("dev_alloc: out of memory allocating %zu bytes", bytes);
    memset(p, 0, rounded);
    return p;
}

size_t dev_alloc_total(void) { return g_alloc_total; }

size_t dev_mem_peak(void) { return 0; }

void dev_mem_peak_reset(void) {}

size_t dev_mem_capacity(void) { return 0; }

void dev_free(void *p) {
    KPROF_OP();
    if (IS_ENABLED(CONFIG_CPU_DEVICE_GUARD))
        guard_free(p);
    else
        free(p);
}

void dev_zero(void *p, size_t bytes) {
    KPROF_OP();
    memset(p, 0, bytes);
}

void dev_upload(void *dst, const void *src, size_t bytes) {
    KPROF_OP();
    memcpy(dst, src, bytes);
}

void dev_download(void *dst, const void *src, size_t bytes) {
    KPROF_OP();
    memcpy(dst, src, bytes);
}

void dev_copy(void *dst, const void *src, size_t bytes) {
    KPROF_OP();
    memcpy(dst, src, bytes);
}

/* The CPU's activations are float: they cross as their bytes. */
_Static_assert(sizeof(act_t) == sizeof(float), "the CPU backend computes on float activations");

void act_upload(act_t *dst, const float *host_src, size_t n) { dev_upload(dst, host_src, n * sizeof(float)); }

void act_download(float *host_dst, const act_t *src, size_t n) { dev_download(host_dst, src, n * sizeof(float)); }

void dev_copy_rows(float *dst, size_t dst_ld, const float *src, size_t src_ld, int rows, size_t cols) {
    KPROF_OP();
    if (rows < 0 || cols > dst_ld || cols > src_ld)
        FATAL("dev_copy_rows: %d rows of %zu values with strides %zu and %zu", rows, cols, dst_ld, src_ld);
    for (int i = 0; i < rows; i++) memcpy(dst + (size_t)i * dst_ld, src + (size_t)i * src_ld, cols * sizeof(float));
}

void rows_gather(float *dst, size_t dst_ld, const float *src, size_t src_ld, const int *idx, int n, size_t cols) {
    KPROF_OP();
    if (n < 0 || cols > dst_ld || cols > src_ld)
        FATAL("rows_gather: %d rows of %zu values with strides %zu and %zu", n, cols, dst_ld, src_ld);
#pragma omp parallel for schedule(static)
    for (int i = 0; i < n; i++)
        memcpy(dst + (size_t)i * dst_ld, src + (size_t)idx[i] * src_ld, cols * sizeof(float));
}

/* The profile's clock (backend.h): the CPU computes as it is called, so a mark is the time now. */
static double *g_marks;
static int g_nmarks, g_cap_marks;

int kprof_mark(void) {
    if (g_nmarks == g_cap_marks) {
        g_cap_marks = g_cap_marks ? 2 * g_cap_marks : 4096;
        g_marks = xrealloc(g_marks, (size_t)g_cap_marks * sizeof *g_marks);
    }
    g_marks[g_nmarks] = wall_seconds();
    return g_nmarks++;
}

void kprof_marks_wait(void) {}

double kprof_mark_ms(int from, int to) { return 1e3 * (g_marks[to] - g_marks[from]); }

void kprof_marks_reset(void) { g_nmarks = 0; }
