/* Shared runtime helpers: fatal errors with source location, checked
 * allocation, recoverable error messages, atomic file writes, clocks.
 *
 * Two error styles, on purpose:
 *  - FATAL(...) for programming errors and for the top level of a binary:
 *    prints one line "error: ... [file.c:line]" and exits 1.
 *  - Err for library code that reads user files (checkpoints, data): the
 *    caller decides whether to stop (trainer) or go on (mechint with many files).
 */
#ifndef KVLAB_COMMON_H
#define KVLAB_COMMON_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define KV_NORETURN __attribute__((noreturn))
#define KV_PRINTF(a, b) __attribute__((format(printf, a, b)))

void fatal_at(const char *file, int line, const char *fmt, ...) KV_NORETURN KV_PRINTF(3, 4);
#define FATAL(...) fatal_at(__FILE__, __LINE__, __VA_ARGS__)

/* A process of a job of several (data-parallel training, train/dist.h) says which one it is in its fatal
 * errors ("error: rank 1 of 2 on node7: ..."), and ends the whole job instead of only itself. label is
 * copied; exit_fn must not return. Without a call: no label, _exit. */
void set_process_identity(const char *label, void (*exit_fn)(int status));
/* "rank 1 of 2 on node7: ", or "" for a process on its own. */
const char *process_label(void);
/* Ends the process (or the job, see set_process_identity) with status, after flushing stdio. */
void process_exit(int status) KV_NORETURN;

void *xmalloc_at(size_t n, const char *file, int line);
void *xcalloc_at(size_t n, size_t size, const char *file, int line);
void *xrealloc_at(void *p, size_t n, const char *file, int line);
char *xstrdup_at(const char *s, const char *file, int line);
#define xmalloc(n) xmalloc_at((n), __FILE__, __LINE__)
#define xcalloc(n, s) xcalloc_at((n), (s), __FILE__, __LINE__)
#define xrealloc(p, n) xrealloc_at((p), (n), __FILE__, __LINE__)
#define xstrdup(s) xstrdup_at((s), __FILE__, __LINE__)

/* A recoverable error: one line naming the file or field, the problem and a hint. Room for two paths of PATH_MAX
 * (an output folder may be that long) and the rest: a shorter buffer cut the hint off such lines. */
typedef struct {
    char msg[12288];
} Err;
/* Formats into e (if non-NULL) and returns -1 so callers can `return err_set(...)`. */
int err_set(Err *e, const char *fmt, ...) KV_PRINTF(2, 3);
/* e := inner's message with hint added: into inner's own "(hint: ...)" at its end as "(hint: ...; hint)", else as
 * " (hint: hint)", so a line never carries two hints. e may be inner. Returns -1. */
int err_with_hint(Err *e, const Err *inner, const char *hint);

/* One line for a command-line argument a program refuses (an unknown option, or one without its value), before
 * its usage text: the usage alone does not say which argument was wrong. */
void usage_refuse(const char *arg);

/* Writes data to path atomically: temp file in the same directory, fsync, rename. */
int write_file_atomic(const char *path, const void *data, size_t n, Err *e);
/* Streaming variant for large files (checkpoints): write into a temporary
 * file next to path; atomic_commit fsyncs and renames it into place,
 * atomic_abort removes it. A crash at any point leaves path untouched. */
typedef struct {
    FILE *f;
    char *path, *tmp;
} AtomicFile;
int atomic_open(AtomicFile *af, const char *path, Err *e);
int atomic_write(AtomicFile *af, const void *data, size_t n, Err *e);
/* Flushes, fsyncs and closes the temporary file, not yet renamed (atomic_commit then only renames): several files
 * are all on disk before the first of them replaces what it replaces. Aborts it on failure. */
int atomic_sync(AtomicFile *af, Err *e);
int atomic_commit(AtomicFile *af, Err *e);
void atomic_abort(AtomicFile *af);

/* Reads a whole file (NUL-terminated for convenience); *n gets the size. */
char *read_file(const char *path, size_t *n, Err *e);
/* mkdir -p */
int make_dirs(const char *path, Err *e);
int file_exists(const char *path);
/* whether s ends with suffix */
int str_ends_with(const char *s, const char *suffix);

/* A command-line option's value: the whole argument a finite number in [lo, hi], integral if integer; anything
 * else stops the program with one line naming the command, the option and its range, and the hint. */
double option_number(const char *cmd, const char *opt, const char *s, double lo, double hi, int integer,
                     const char *hint);

/* How many of n targets are not ignore_index: the rows a softmax cross-entropy counts, known on the host from
 * the targets it uploads (kernels.h, crossentropy_forward). */
int targets_counted(const int *targets, size_t n, int ignore_index);
double wall_seconds(void);   /* monotonic clock */
double unix_seconds(void);   /* wall-clock time since the epoch */
double peak_rss_mib(void);   /* peak resident set size of this process */

#endif
