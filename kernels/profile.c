/* The profile's books (kernels.h, kprof_start), the same for every backend:
 * which op is running, the marks around it and its parts, and the totals.
 * The backend supplies only its clock (kprof_mark and friends, backend.h).
 *
 * While an op runs, each of its parts spans the marks from the end of the
 * previous part (or the op's start) to its own end; the op spans its start
 * and end marks. Spans are resolved into totals when the device is idle: at
 * kprof_stop, or between ops once many marks are pending (a GPU's events are
 * then waited for in the middle of the profile, which the profile does not
 * see: the wait falls between two ops). The time the profile is on (from
 * kprof_start or kprof_resume to kprof_pause or kprof_stop) is a span too, of
 * no op, on the same clock: on a GPU the device's time for the work queued
 * then, idle gaps where it waited for the host included. */
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "common.h"
#include "kernels.h"

typedef struct {
    const char *op, *part;
    int from, to;
} Span;

static int g_active, g_on, g_depth; /* a profile started and not stopped; collecting (not paused) */
static const char *g_op;      /* the outermost op now running */
static int g_start, g_last;   /* its start mark, the end mark of its last part */
static Span *g_spans;
static size_t g_nspans, g_cap_spans;
static KprofRow *g_rows;
static int g_nrows, g_cap_rows;
static int g_on_from;  /* the mark where the profile was last switched on */
static double g_on_ms; /* the spans it was on, resolved */

enum { FLUSH_SPANS = 1 << 14 }; /* pending spans that make kprof_exit resolve them */

static int same(const char *a, const char *b) { return a == b || (a && b && !strcmp(a, b)); }

static void add_span(const char *op, const char *part, int from, int to) {
    if (g_nspans == g_cap_spans) {
        g_cap_spans = g_cap_spans ? 2 * g_cap_spans : 1024;
        g_spans = xrealloc(g_spans, g_cap_spans * sizeof *g_spans);
    }
    g_spans[g_nspans++] = (Span){op, part, from, to};
}

static KprofRow *row_of(const char *op, const char *part) {
    for (int i = 0; i < g_nrows; i++)
        if (same(g_rows[i].op, op) && same(g_rows[i].part, part)) return &g_rows[i];
    if (g_nrows == g_cap_rows) {
        g_cap_rows = g_cap_rows ? 2 * g_cap_rows : 64;
        g_rows = xrealloc(g_rows, (size_t)g_cap_rows * sizeof *g_rows);
    }
    g_rows[g_nrows] = (KprofRow){.op = op, .part = part};
    return &g_rows[g_nrows++];
}

/* Waits for the device and adds the pending spans to the totals (a span of no op: to the time on); the marks
 * start over. The profile's time on, if it is on, ends before the wait and starts again after it. */
static void resolve(void) {
    if (g_on) add_span(NULL, NULL, g_on_from, kprof_mark());
    kprof_marks_wait();
    for (size_t i = 0; i < g_nspans; i++) {
        double ms = kprof_mark_ms(g_spans[i].from, g_spans[i].to);
        if (!g_spans[i].op) {
            g_on_ms += ms;
            continue;
        }
        KprofRow *r = row_of(g_spans[i].op, g_spans[i].part);
        r->calls++;
        r->ms += ms;
    }
    g_nspans = 0;
    kprof_marks_reset();
    if (g_on) g_on_from = kprof_mark();
}

void kprof_start(void) {
    if (g_depth) FATAL("kprof_start: called inside a backend op");
    g_nrows = 0;
    g_nspans = 0;
    g_on_ms = 0.0;
    kprof_marks_reset();
    g_active = g_on = 1;
    g_on_from = kprof_mark();
}

void kprof_pause(void) {
    if (g_depth || !g_active) FATAL("kprof_pause: %s", g_depth ? "called inside a backend op" : "no profile started");
    if (g_on) add_span(NULL, NULL, g_on_from, kprof_mark());
    g_on = 0;
}

void kprof_resume(void) {
    if (g_depth || !g_active) FATAL("kprof_resume: %s", g_depth ? "called inside a backend op" : "no profile started");
    if (!g_on) g_on_from = kprof_mark();
    g_on = 1;
}

int kprof_stop(const KprofRow **rows) {
    if (g_depth) FATAL("kprof_stop: called inside a backend op");
    if (!g_active) { /* no profile running: nothing to report */
        *rows = NULL;
        return 0;
    }
    resolve();
    g_active = g_on = 0;
    *rows = g_rows;
    return g_nrows;
}

double kprof_on_ms(void) { return g_on_ms; }

void kprof_enter(const char *op) {
    if (!g_on || g_depth++) return; /* only the outermost op is timed */
    g_op = op;
    g_start = g_last = kprof_mark();
}

void kprof_part(const char *part) {
    if (!g_on || !g_depth) return;
    int m = kprof_mark();
    add_span(g_op, part, g_last, m);
    g_last = m;
}

void kprof_exit(void) {
    if (!g_on || !g_depth || --g_depth) return;
    add_span(g_op, NULL, g_start, kprof_mark());
    if (g_nspans >= FLUSH_SPANS) resolve();
}
