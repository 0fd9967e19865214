/* The collectives of train/dist.h against values every rank can compute:
 * rank r's buffer holds f(r, i) = 2^21 r + i (distinct over the ranks and
 * exact in float at every sum here, N <= 3), so the sum over N ranks is
 * N i + 2^21 N(N-1)/2. Each input is filled by a device copy queued just
 * before the collective, and each result copied out by one queued just after
 * it, so a collective that does not keep the stream's order fails too.
 * Run as a job of one (the DIST_NONE stubs, or mpirun -np 1) and under
 * mpirun -np 2 and 3 (tests/run_tests.py -k mpi): the MPI transport on the
 * CPU target, NCCL on the CUDA target (-k cuda, where a GPU is). Lengths
 * include 0, fewer values than ranks and a length no rank count divides, so
 * ZeRO-1's uneven slices are covered. Every rank checks its own results and
 * the counts are summed, so one summary line covers the job. */
#include <math.h>
#include <stdlib.h>

#include "dist.h"
#include "kernels.h"
#include "test.h"

#define RANK_STRIDE 2097152.0 /* 2^21, above the longest buffer */

static float f(int r, size_t i) { return (float)(RANK_STRIDE * r + (double)i); }

static double sum_f(int size, size_t i) { return (double)size * (double)i + RANK_STRIDE * size * (size - 1) / 2.0; }

static float *filled(size_t n, int r) {
    float *h = xmalloc((n ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++) h[i] = f(r, i);
    return h;
}

static float *to_dev(const float *h, size_t n) {
    float *d = dev_alloc((n ? n : 1) * sizeof(float));
    if (n) dev_upload(d, h, n * sizeof(float));
    return d;
}

/* d's values, copied on the device first (queued behind the collective that wrote d), then downloaded */
static float *to_host(const float *d, size_t n) {
    float *h = xmalloc((n ? n : 1) * sizeof(float)), *out = dev_alloc((n ? n : 1) * sizeof(float));
    dev_copy(out, d, n * sizeof(float));
    if (n) dev_download(h, out, n * sizeof(float));
    dev_free(out);
    return h;
}

/* The number of i in [0, n) where got[i] != want[i]; the first one printed to stderr (every rank's stderr
 * reaches the terminal, only rank 0's stdout does). */
static size_t count_wrong(const float *got, const float *want, size_t n, const char *what) {
    size_t bad = 0;
    for (size_t i = 0; i < n; i++)
        if (got[i] != want[i] && !bad++)
            fprintf(stderr, "  rank %d of %d, %s, %zu values: [%zu] = %.9g, want %.9g\n", dist_rank(), dist_size(),
                    what, n, i, (double)got[i], (double)want[i]);
    return bad;
}

static void test_split(void) {
    /* the slices partition [0, n) in rank order, sizes differ by at most one, the larger ones first */
    for (int size = 1; size <= 9; size++)
        for (size_t n = 0; n <= 40; n++) {
            size_t next = 0;
            int ok = 1;
            for (int r = 0; r < size; r++) {
                DistRange s = dist_split(n, r, size);
                ok &= s.lo == next && (s.n == n / size || s.n == n / size + 1) &&
                      (r == 0 || s.n <= dist_split(n, r - 1, size).n);
                next = s.lo + s.n;
            }
            CHECK(ok && next == n, "dist_split(%zu, r, %d) partitions the range evenly in rank order", n, size);
        }
}

static void test_collectives(size_t n) {
    int rank = dist_rank(), size = dist_size();
    DistRange mine = dist_split(n, rank, size);

    /* host: sum, max, bcast */
    double v[3] = {rank + 1.0, -rank, 0.5 * rank};
    dist_sum(v, 3);
    CHECK(v[0] == size * (size + 1) / 2.0 && v[1] == -size * (size - 1) / 2.0 && v[2] == size * (size - 1) / 4.0,
          "dist_sum over %d ranks: %g %g %g", size, v[0], v[1], v[2]);
    double mx[2] = {rank, -rank};
    dist_max(mx, 2);
    CHECK(mx[0] == size - 1 && mx[1] == 0, "dist_max over %d ranks: %g %g", size, mx[0], mx[1]);
    char msg[16];
    snprintf(msg, sizeof msg, "from rank %d", rank);
    dist_bcast(msg, sizeof msg);
    CHECK(strcmp(msg, "from rank 0") == 0, "dist_bcast: rank %d got \"%s\"", rank, msg);

    /* device: all-reduce */
    float *h = filled(n, rank), *want = xmalloc((n ? n : 1) * sizeof(float)), *src = to_dev(h, n), *g;
    float *d = dev_alloc((n ? n : 1) * sizeof(float));
    dev_copy(d, src, n * sizeof(float)); /* queued: the collective must wait for it */
    for (size_t i = 0; i < n; i++) want[i] = (float)sum_f(size, i);
    dist_allreduce_dev(d, n);
    g = to_host(d, n);
    CHECK(count_wrong(g, want, n, "allreduce") == 0, "dist_allreduce_dev, n=%zu, %d ranks", n, size);
    free(g);

    /* reduce-scatter: this rank's slice summed, the rest as it was */
    for (size_t i = 0; i < n; i++) want[i] = i >= mine.lo && i < mine.lo + mine.n ? (float)sum_f(size, i) : h[i];
    dev_copy(d, src, n * sizeof(float));
    dist_reduce_scatter_dev(d, n);
    g = to_host(d, n);
    CHECK(count_wrong(g, want, n, "reduce-scatter") == 0,
          "dist_reduce_scatter_dev, n=%zu, %d ranks: slice [%zu, %zu) summed, the rest untouched", n, size, mine.lo,
          mine.lo + mine.n);
    free(g);

    /* all-gather: rank r's slice holds f(r, i), from rank r; bcast: rank 0's values */
    for (int r = 0; r < size; r++) {
        DistRange s = dist_split(n, r, size);
        for (size_t i = s.lo; i < s.lo + s.n; i++) want[i] = f(r, i);
    }
    dev_copy(d, src, n * sizeof(float));
    dist_allgather_dev(d, n);
    g = to_host(d, n);
    CHECK(count_wrong(g, want, n, "allgather") == 0, "dist_allgather_dev, n=%zu, %d ranks: every slice from its "
          "owner", n, size);
    free(g);
    for (size_t i = 0; i < n; i++) want[i] = f(0, i);
    dev_copy(d, src, n * sizeof(float));
    dist_bcast_dev(d, n);
    g = to_host(d, n);
    CHECK(count_wrong(g, want, n, "bcast") == 0, "dist_bcast_dev, n=%zu, %d ranks", n, size);
    free(g);

    /* gather each rank's slice of a buffer of f(r, i) into rank 0's host memory; scatter another one back */
    float *slice = to_dev(h + mine.lo, mine.n);
    float *full = rank == 0 ? xmalloc((n ? n : 1) * sizeof(float)) : NULL;
    dist_gather_dev(full, slice, n);
    if (rank == 0) {
        for (int r = 0; r < size; r++) {
            DistRange s = dist_split(n, r, size);
            for (size_t i = s.lo; i < s.lo + s.n; i++) want[i] = f(r, i);
        }
        CHECK(count_wrong(full, want, n, "gather") == 0, "dist_gather_dev, n=%zu, %d ranks: every rank's slice in "
              "place on rank 0", n, size);
        for (size_t i = 0; i < n; i++) full[i] = -(float)i; /* what rank 0 scatters */
    }
    for (size_t i = 0; i < mine.n; i++) want[i] = -(float)(mine.lo + i);
    dist_scatter_dev(slice, full, n);
    g = to_host(slice, mine.n);
    CHECK(count_wrong(g, want, mine.n, "scatter") == 0, "dist_scatter_dev, n=%zu, %d ranks: this rank's slice of "
          "rank 0's buffer", n, size);
    free(g), free(full), free(h), free(want);
    dev_free(slice), dev_free(d), dev_free(src);
}

/* dist_sum_dev: doubles of device memory summed in double: 1 + r 2^-40 is exact in double and not in float, and
 * so is the sum over N ranks, N + 2^-40 N(N-1)/2. Filled by a queued copy and read through one, as above. */
static void test_sum_dev(void) {
    int rank = dist_rank(), size = dist_size();
    double h[3] = {1.0 + ldexp(rank, -40), -rank, 0.5 * rank}, got[3];
    double *src = dev_alloc(sizeof h), *d = dev_alloc(sizeof h), *out = dev_alloc(sizeof h);
    dev_upload(src, h, sizeof h);
    dev_copy(d, src, sizeof h);
    dist_sum_dev(d, 3);
    dev_copy(out, d, sizeof h);
    dev_download(got, out, sizeof got);
    double n = size, want[3] = {n + ldexp(n * (n - 1) / 2.0, -40), -n * (n - 1) / 2.0, n * (n - 1) / 4.0};
    CHECK(got[0] == want[0] && got[1] == want[1] && got[2] == want[2],
          "dist_sum_dev over %d ranks, in double on the device: %.17g %g %g (want %.17g %g %g)", size, got[0], got[1],
          got[2], want[0], want[1], want[2]);
    dist_sum_dev(d, 0); /* nothing to sum: nothing changes */
    dev_download(got, d, sizeof got);
    CHECK(got[0] == want[0], "dist_sum_dev of 0 values leaves the buffer: %.17g", got[0]);
    dev_free(src), dev_free(d), dev_free(out);
}

/* The overlapped sum in parts (dist_sum_start_dev / dist_sum_wait_dev), started top down as train/grad_sync.c
 * does, with an empty part among them: the single calls' results, all-reduced or (scatter) reduce-scattered.
 * While the parts are under way the buffer below them is rewritten (as the backward pass goes on writing the
 * lower layers' gradients): those values must reach the parts started after the write. */
static void test_parts(size_t n, int scatter) {
    int rank = dist_rank(), size = dist_size();
    DistRange mine = dist_split(n, rank, size);
    float *h = filled(n, rank), *want = xmalloc((n ? n : 1) * sizeof(float)), *g;
    float *zero = xcalloc(n ? n : 1, sizeof(float)), *src = to_dev(h, n), *d = to_dev(zero, n);
    size_t cut[] = {n, (2 * n) / 3, (2 * n) / 3, n / 5, 0}; /* parts [cut[k+1], cut[k]), one empty */
    int parts = (int)(sizeof cut / sizeof *cut) - 1;
    for (int k = 0; k < parts; k++) {
        size_t lo = cut[k + 1], len = cut[k] - cut[k + 1];
        dev_copy(d + lo, src + lo, len * sizeof(float)); /* the part's final values, queued just before its start */
        dist_sum_start_dev(d, n, lo, len, scatter);
    }
    dist_sum_wait_dev();
    g = to_host(d, n);
    for (size_t i = 0; i < n; i++)
        want[i] = !scatter || (i >= mine.lo && i < mine.lo + mine.n) ? (float)sum_f(size, i) : h[i];
    CHECK(count_wrong(g, want, n, scatter ? "parts, reduce-scatter" : "parts, all-reduce") == 0,
          "dist_sum_start_dev in %d parts top down%s, n=%zu, %d ranks: the sums of the single call", parts,
          scatter ? " (scatter: this rank's slice summed, the rest untouched)" : "", n, size);
    free(g), free(h), free(want), free(zero);
    dev_free(d), dev_free(src);
}

int main(void) {
    dist_init();
    backend_init(1);
    test_split();
    test_sum_dev();
    /* 0 values, fewer than the ranks, odd, and one large enough for NCCL to take its bulk path */
    const size_t lengths[] = {0, 1, 2, 5, 1001, 1 << 20};
    for (size_t k = 0; k < sizeof lengths / sizeof *lengths; k++) {
        test_collectives(lengths[k]);
        test_parts(lengths[k], 0);
        test_parts(lengths[k], 1);
    }
    /* one line for the job: every rank's counts summed on rank 0 (the others' stdout is /dev/null) */
    double counts[2] = {test_passed_, test_failed_};
    dist_sum(counts, 2);
    test_passed_ = (int)counts[0], test_failed_ = (int)counts[1];
    printf("test_dist: %d process(es), transport %s, backend %s\n", dist_size(), dist_transport(), backend_name());
    int rc = TEST_SUMMARY("test_dist");
    dist_finalize();
    return rc;
}
