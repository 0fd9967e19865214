/* Data-parallel training-step benchmark (make bench, scripts/bench.py):
 * one GPT-2 training step of a global batch of B sequences, each rank of
 * the MPI job (train/dist.h) computing its rows, then the gradient sum over
 * the ranks and AdamW, as train/trainer.c does it (train/grad_sync.h: in
 * one call, or with bucket_kib > 0 in buckets started during the backward
 * pass). Timed per step, on rank 0: the whole step; the compute (forward
 * and backward of its rows, bucket starts included); the wait for the
 * slowest rank (a one-value all-reduce, i.e. imbalance plus one latency);
 * the gradient sum, or what is left of it after the backward pass (the
 * communication cost proper). Each time ends with a wait for the device
 * (bench.h), so on a GPU it is when the work ended, not when the host had
 * queued it: the compute ends with the backend's stream idle (buckets sent
 * to NCCL's stream may still run), the gradient sum with that stream idle
 * after it has waited for NCCL's. Prints one JSON object from rank 0.
 *
 * usage: mpirun -np N bench_dp L H C T B V steps threads [bucket_kib]
 * (started alone it is a job of one) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "bench.h"
#include "common.h"
#include "dist.h"
#include "gpt2/model.h"
#include "grad_sync.h"
#include "kernels.h"
#include "rng.h"

static void print_list(const char *key, const double *v, int n) {
    printf(", \"%s\": [", key);
    for (int i = 0; i < n; i++) printf("%s%.3f", i ? ", " : "", v[i]);
    printf("]");
}

int main(int argc, char **argv) {
    if (argc != 9 && argc != 10) {
        fprintf(stderr, "usage: %s L H C T B V steps threads [bucket_kib]\n", argv[0]);
        return 2;
    }
    int L = atoi(argv[1]), H = atoi(argv[2]), C = atoi(argv[3]), T = atoi(argv[4]), B = atoi(argv[5]);
    int V = atoi(argv[6]), steps = atoi(argv[7]), threads = atoi(argv[8]), bucket_kib = argc == 10 ? atoi(argv[9]) : 0;
    if (L < 1 || H < 1 || C < H || T < 1 || B < 1 || V < 2 || steps < 1 || threads < 1 || bucket_kib < 0) {
        fprintf(stderr, "bench_dp: bad shape or counts\n");
        return 2;
    }
    dist_init();
    int rank = dist_rank(), size = dist_size();
    backend_init(threads);
    GPT2Config cfg = {.V = V, .T = T, .L = L, .H = H, .C = C, .bias = 1, .attn_bias = 1, .tie = 1, .gelu = 1,
                      .variant = ATTN_VARIANT, .pos = ATTN_POS, .pos_m = ATTN_POS_DIM,
                      .pos_groups = ATTN_POS ? (ATTN_POS_PER_HEAD ? H : 1) : 0};
    GPT2 m;
    gpt2_init(&m, &cfg, 1);
    size_t total = m.w.table.total;
    GradSync sync;
    grad_sync_init(&sync, &m.w, (size_t)bucket_kib * 1024, 0);
    /* every rank draws the whole batch, keeps its rows */
    int *in = xmalloc((size_t)B * T * sizeof(int)), *tg = xmalloc((size_t)B * T * sizeof(int));
    Rng rng = rng_seeded(1, 2);
    for (int i = 0; i < B * T; i++) in[i] = (int)rng_below(&rng, V), tg[i] = (int)rng_below(&rng, V);
    DistRange rows = dist_split((size_t)B, rank, size);
    if (!rows.n) FATAL("bench_dp: a batch of %d rows leaves rank %d of %d none", B, rank, size);
    dropout_batch_rows((int)rows.lo, (int)rows.n);
    const int *x = in + rows.lo * (size_t)T, *y = tg + rows.lo * (size_t)T;
    double *step = xmalloc((size_t)steps * sizeof(double)), *comp = xmalloc((size_t)steps * sizeof(double));
    double *wait = xmalloc((size_t)steps * sizeof(double)), *comm = xmalloc((size_t)steps * sizeof(double));
    for (int s = -2; s < steps; s++) {
        double t0 = wall_seconds();
        params_zero_grad(&m.w);
        grad_sync_arm(&sync);
        gpt2_forward_pass(&m, x, y, (int)rows.n, T, 1, (uint64_t)(s + 2));
        gpt2_backward(&m, (float)((double)rows.n / B)); /* the global mean over B rows */
        device_wait(m.w.params); /* any buffer: not the gradients, which NCCL's stream may still be summing */
        double t1 = wall_seconds(), one = 1.0;
        dist_sum(&one, 1);
        double t2 = wall_seconds();
        grad_sync_finish(&sync);
        device_wait(m.w.params);
        double t3 = wall_seconds();
        params_adamw(&m.w, 1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, s + 3);
        device_wait(m.w.params);
        double t4 = wall_seconds();
        if (s < 0) continue;
        step[s] = 1e3 * (t4 - t0), comp[s] = 1e3 * (t1 - t0), wait[s] = 1e3 * (t2 - t1), comm[s] = 1e3 * (t3 - t2);
    }
    if (rank == 0) {
        printf("{\"processes\": %d, \"threads\": %d, \"transport\": \"%s\", \"parameters\": %zu, "
               "\"gradient_bytes\": %zu, \"shape\": {\"L\": %d, \"H\": %d, \"C\": %d, \"T\": %d, \"B\": %d, \"V\": %d}, "
               "\"tokens_per_step\": %d, \"bucket_kib\": %d, \"buckets\": %d, \"buckets_overlapped\": %d",
               size, backend_threads(), dist_transport(), m.w.table.count, total * sizeof(float), L, H, C, T, B, V, B * T,
               bucket_kib, sync.nb, sync.early_last);
        print_list("step_ms", step, steps);
        print_list("compute_ms", comp, steps);
        print_list("wait_ms", wait, steps);
        print_list("allreduce_ms", comm, steps);
        printf("}\n");
        fflush(stdout);
    }
    grad_sync_free(&sync);
    gpt2_free(&m);
    free(in), free(tg), free(step), free(comp), free(wait), free(comm);
    dist_finalize();
    return 0;
}
