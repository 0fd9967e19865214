#define _GNU_SOURCE
#include "common.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static char g_label[320];
static void (*g_exit_fn)(int);

void set_process_identity(const char *label, void (*exit_fn)(int status)) {
    snprintf(g_label, sizeof g_label, "%s%s", label && *label ? label : "", label && *label ? ": " : "");
    g_exit_fn = exit_fn;
}

const char *process_label(void) { return g_label; }

void process_exit(int status) {
    fflush(NULL);
    if (g_exit_fn) g_exit_fn(status);
    /* _exit, not exit: atexit handlers of threaded libraries (OpenBLAS, OpenMP)
     * can hang or crash when the failure happens in a forked child or while
     * other threads run; our own files are always written atomically. */
    _exit(status);
}

void fatal_at(const char *file, int line, const char *fmt, ...) {
    va_list ap;
    fflush(stdout);
    fprintf(stderr, "error: %s", g_label);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, " [%s:%d]\n", file, line);
    process_exit(1);
}

void *xmalloc_at(size_t n, const char *file, int line) {
    void *p = malloc(n ? n : 1);
    if (!p) fatal_at(file, line, "out of memory allocating %zu bytes", n);
    return p;
}

void *xcalloc_at(size_t n, size_t size, const char *file, int line) {
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p) fatal_at(file, line, "out of memory allocating %zu x %zu bytes", n, size);
    return p;
}

void *xrealloc_at(void *p, size_t n, const char *file, int line) {
    void *q = realloc(p, n ? n : 1);
    if (!q) fatal_at(file, line, "out of memory reallocating %zu bytes", n);
    return q;
}

char *xstrdup_at(const char *s, const char *file, int line) {
    size_t n = strlen(s) + 1;
    char *p = xmalloc_at(n, file, line);
    memcpy(p, s, n);
    return p;
}

int err_set(Err *e, const char *fmt, ...) {
    if (e) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(e->msg, sizeof e->msg, fmt, ap);
        va_end(ap);
    }
    return -1;
}

int err_with_hint(Err *e, const Err *inner, const char *hint) {
    if (!e) return -1;
    Err in = *inner;
    size_t n = strlen(in.msg);
    const char *own = strstr(in.msg, "(hint: ");
    while (own && strstr(own + 1, "(hint: ")) own = strstr(own + 1, "(hint: ");
    if (own && n && in.msg[n - 1] == ')') {
        in.msg[n - 1] = '\0';
        return err_set(e, "%s; %s)", in.msg, hint);
    }
    return err_set(e, "%s (hint: %s)", in.msg, hint);
}

void usage_refuse(const char *arg) {
    fprintf(stderr, "error: '%s' is not an option here, or lacks its value (hint: the usage follows)\n", arg);
}

int atomic_open(AtomicFile *af, const char *path, Err *e) {
    size_t len = strlen(path);
    af->path = xstrdup(path);
    af->tmp = xmalloc(len + 32);
    snprintf(af->tmp, len + 32, "%s.tmp.%ld", path, (long)getpid());
    af->f = fopen(af->tmp, "wb");
    if (!af->f) {
        err_set(e, "%s: cannot create temporary file: %s (hint: check that the folder exists and is writable)",
                af->tmp, strerror(errno));
        free(af->path);
        free(af->tmp);
        af->path = af->tmp = NULL;
        return -1;
    }
    return 0;
}

int atomic_write(AtomicFile *af, const void *data, size_t n, Err *e) {
    if (n && fwrite(data, 1, n, af->f) != n) {
        err_set(e, "%s: write failed: %s (hint: is the disk full?)", af->tmp, strerror(errno));
        return -1;
    }
    return 0;
}

void atomic_abort(AtomicFile *af) {
    if (af->f) fclose(af->f);
    if (af->tmp) unlink(af->tmp);
    free(af->path);
    free(af->tmp);
    af->f = NULL;
    af->path = af->tmp = NULL;
}

int atomic_sync(AtomicFile *af, Err *e) {
    if (!af->f) return 0; /* synced before */
    int bad = fflush(af->f) != 0 || fsync(fileno(af->f)) != 0;
    bad |= fclose(af->f) != 0;
    af->f = NULL;
    if (bad) {
        err_set(e, "%s: flush failed: %s (hint: is the disk full?)", af->tmp, strerror(errno));
        atomic_abort(af);
        return -1;
    }
    return 0;
}

int atomic_commit(AtomicFile *af, Err *e) {
    if (atomic_sync(af, e) != 0) return -1;
    if (rename(af->tmp, af->path) != 0) {
        err_set(e, "%s: cannot rename temporary file into place: %s", af->path, strerror(errno));
        atomic_abort(af);
        return -1;
    }
    free(af->path);
    free(af->tmp);
    af->path = af->tmp = NULL;
    return 0;
}

int write_file_atomic(const char *path, const void *data, size_t n, Err *e) {
    AtomicFile af;
    if (atomic_open(&af, path, e) != 0) return -1;
    if (atomic_write(&af, data, n, e) != 0) {
        atomic_abort(&af);
        return -1;
    }
    return atomic_commit(&af, e);
}

char *read_file(const char *path, size_t *n, Err *e) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        err_set(e, "%s: cannot open: %s", path, strerror(errno));
        return NULL;
    }
    size_t cap = 1 << 16, len = 0;
    char *buf = xmalloc(cap + 1);
    for (;;) {
        size_t r = fread(buf + len, 1, cap - len, f);
        len += r;
        if (len < cap) break;
        cap *= 2;
        buf = xrealloc(buf, cap + 1);
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) {
        free(buf);
        err_set(e, "%s: read error", path);
        return NULL;
    }
    buf[len] = 0;
    if (n) *n = len;
    return buf;
}

int make_dirs(const char *path, Err *e) {
    char *p = xstrdup(path);
    for (char *s = p + 1; *s; s++) {
        if (*s != '/') continue;
        *s = 0;
        if (mkdir(p, 0755) != 0 && errno != EEXIST) {
            err_set(e, "%s: cannot create folder: %s", p, strerror(errno));
            free(p);
            return -1;
        }
        *s = '/';
    }
    if (mkdir(p, 0755) != 0 && errno != EEXIST) {
        err_set(e, "%s: cannot create folder: %s", p, strerror(errno));
        free(p);
        return -1;
    }
    free(p);
    return 0;
}

int file_exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0;
}

int str_ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && strcmp(s + n - k, suffix) == 0;
}

double wall_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

double unix_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

double peak_rss_mib(void) {
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0) return 0.0;
    return (double)ru.ru_maxrss / 1024.0; /* Linux reports KiB */
}

double option_number(const char *cmd, const char *opt, const char *s, double lo, double hi, int integer,
                     const char *hint) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || *end || errno || !isfinite(v) || v < lo || v > hi || (integer && v != floor(v)))
        FATAL("%s: %s '%s' is not %s from %g to %g (hint: %s)", cmd, opt, s,
              integer ? "a whole number" : "a finite number", lo, hi, hint);
    return v;
}

int targets_counted(const int *targets, size_t n, int ignore_index) {
    int c = 0;
    for (size_t i = 0; i < n; i++) c += targets[i] != ignore_index;
    return c;
}
