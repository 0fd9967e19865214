/* For backends only (kernels/cpu/, kernels/cuda/): the argument checks and
 * dropout bookkeeping every backend shares, so that each fact lives once. (The attention checks
 * they share are in attention.h: this header stays free of the attention
 * configuration, so the non-attention ops do not recompile when it changes.)
 * Model code uses kernels.h and attention.h, never this header. */
#ifndef KVLAB_BACKEND_H
#define KVLAB_BACKEND_H

#include <stddef.h>
#include <stdint.h>

/* Dropout with probability p keeps element i when the hash of (seed, i) is at or above this threshold
 * (hash.h); stops with a message naming op unless 0 <= p < 1. */
uint32_t dropout_threshold(float p, const char *op);
/* The global index of element 0 of an n-value buffer of this process's batch rows (dropout_batch_rows). */
size_t dropout_batch_offset(size_t n, const char *op);

/* ---- argument checks ----------------------------------------------------------
 * The contracts of the ops of kernels.h that do not depend on where their data is (shapes, ranges, aliasing),
 * written once: every backend's op makes its checks before any work. Each stops the program with one line
 * naming op and what is wrong. (Checks of values in device memory, such as token ids, are the backends'.) */
void args_btc(const char *op, int B, int T, int C, int min_T); /* (B, T, C), B and C > 0, T >= min_T */
void args_pool(const char *op, int B, int T, int C, int first, int count);
void args_rows(const char *op, int N, int C);           /* N rows of C values */
void args_linear(const char *op, int N, int C, int OC); /* (N, C) in, (N, OC) out */
/* a, b and c (c may be NULL) are different buffers; names says which they are, for the message */
void args_distinct(const char *op, const char *names, const void *a, const void *b, const void *c);
void args_classes(const char *op, int N, int V, float smoothing); /* N rows of V classes, smoothing in [0, 1) */
void args_adamw(int t);
void args_clip(const char *op, double max_norm);
void args_embedding(int B, int T, int C, int V); /* (B, T) token ids into (B, T, C), V > 0 */
/* gelu_linear_backward: the shape, dpre apart from pre, and dpre, act and dout three buffers */
void args_gelu_linear(const void *dpre, const void *act, const void *dout, const void *pre, int N, int C, int OC);
/* Ids outside [0, V): the tokens of embedding_forward, the targets of crossentropy_forward (which skips
 * ignore_index). args_ids checks ids in host memory and returns how many count (not skipped); a backend that
 * finds the first bad id elsewhere stops with args_bad_id, so both say the same line. */
typedef enum { IDS_TOKENS, IDS_TARGETS } IdsKind;
int args_ids(const char *op, IdsKind kind, const int *ids, int n, int V, int has_skip, int skip);
void args_bad_id(const char *op, IdsKind kind, int id, int index, int V) __attribute__((noreturn));

/* ---- profile (kernels.h, kprof_start) ----------------------------------------
 * KPROF_OP() opens every public op of a backend: a scope named after the
 * function that times the call while profiling is on (kernels/profile.c keeps
 * the books); kprof_part(name) ends a part of the op (a kernel launch, a
 * cuBLAS call) on a GPU. */
void kprof_enter(const char *op);
void kprof_exit(void);
void kprof_part(const char *part);
#ifdef __cplusplus
struct KprofScope {
    explicit KprofScope(const char *op) { kprof_enter(op); }
    ~KprofScope() { kprof_exit(); }
    KprofScope(const KprofScope &) = delete;
    KprofScope &operator=(const KprofScope &) = delete;
};
#define KPROF_OP() KprofScope kprof_scope_(__func__)
#else
static inline void kprof_scope_end_(const int *unused) {
    (void)unused;
    kprof_exit();
}
#define KPROF_OP() __attribute__((cleanup(kprof_scope_end_))) const int kprof_scope_ = (kprof_enter(__func__), 0)
#endif

/* The clock of the profile, one per backend: kprof_mark records a point in the
 * device's queue of work (the CPU: the time now; a GPU: an event on its
 * stream) and returns its number; kprof_mark_ms is the time between two marks
 * once kprof_marks_wait has waited for the device; kprof_marks_reset forgets
 * them all (their numbers start at 0 again). */
int kprof_mark(void);
void kprof_marks_wait(void);
double kprof_mark_ms(int from, int to);
void kprof_marks_reset(void);

#endif
