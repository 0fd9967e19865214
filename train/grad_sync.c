/* Bucketed, overlapped gradient sums (train/grad_sync.h). */
#include "grad_sync.h"

#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "dist.h"

void grad_sync_init(GradSync *g, Params *w, size_t bucket_bytes, int scatter) {
    memset(g, 0, sizeof *g);
    g->w = w;
    g->scatter = scatter;
    const ParamTable *t = &w->table;
    /* a job of one process cuts them too: on GPUs NCCL then runs the same code path as on many */
    if (!bucket_bytes || t->n == 0) return;
    size_t want = (bucket_bytes + sizeof(float) - 1) / sizeof(float), acc = 0;
    g->lo = xmalloc((size_t)t->n * sizeof(size_t));
    /* from the last tensor down (the backward pass finishes the top of the buffer first); a bucket closes at
     * the first tensor boundary where it holds `want` values; the last one reaches offset 0 */
    for (int i = t->n - 1; i >= 0; i--) {
        acc += t->specs[i].numel;
        if (acc >= want && i > 0) {
            g->lo[g->nb++] = t->specs[i].offset;
            acc = 0;
        }
    }
    g->lo[g->nb++] = 0;
}

void grad_sync_free(GradSync *g) {
    free(g->lo);
    memset(g, 0, sizeof *g);
}

static void start(GradSync *g, int k) {
    size_t total = g->w->table.total, hi = k ? g->lo[k - 1] : total;
    dist_sum_start_dev(g->w->grads, total, g->lo[k], hi - g->lo[k], g->scatter);
}

/* params_grads_final_from: every gradient at offset >= `offset` is final; start the buckets above it */
static void on_final(void *ctx, size_t offset) {
    GradSync *g = ctx;
    while (g->next < g->nb && g->lo[g->next] >= offset) {
        start(g, g->next++);
        g->early++;
    }
}

void grad_sync_arm(GradSync *g) {
    if (!g->nb) return;
    g->next = g->early = 0;
    g->w->grads_final = on_final;
    g->w->grads_final_ctx = g;
}

void grad_sync_finish(GradSync *g) {
    Params *w = g->w;
    w->grads_final = NULL;
    w->grads_final_ctx = NULL;
    if (!g->nb) { /* one sum of the whole buffer */
        if (g->scatter)
            dist_reduce_scatter_dev(w->grads, w->table.total);
        else
            dist_allreduce_dev(w->grads, w->table.total);
        return;
    }
    while (g->next < g->nb) start(g, g->next++);
    dist_sum_wait_dev();
    g->early_last = g->early;
    g->next = g->early = 0;
}
