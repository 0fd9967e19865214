/* The MPI transport of train/dist.h (CONFIG_DIST_MPI): OpenMPI starts the
 * ranks and carries the host collectives. The device collectives:
 *  - CPU target: staged through one host buffer with dev_download /
 *    dev_upload, so the device-memory guard holds; that costs two memcpys
 *    of the buffer, small beside MPI's own copies;
 *  - CUDA target (CONFIG_DIST_NCCL): NCCL on the GPU buffers themselves
 *    (kernels/comm.h), bootstrapped here: every rank takes its GPU by its
 *    rank on the machine, rank 0 makes NCCL's id and MPI sends it to all.
 *    Only gather/scatter (whole state files, rank 0's host memory) stay
 *    staged through MPI.
 *
 * Errors: MPI_COMM_WORLD keeps MPI_ERRORS_ARE_FATAL, so a failed collective
 * ends the job; a rank that dies is noticed by mpirun (or srun), which
 * stops the others within seconds (docs/distributed.md, "Faults"). A fatal
 * error of this process (FATAL, run_die) calls MPI_Abort through
 * set_process_identity, which ends every rank at once. */
#define _GNU_SOURCE
#include <limits.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "comm.h"
#include "dist.h"
#include "kernels.h"

static int g_rank, g_size = 1, g_local = 1, g_local_rank, g_on, g_nccl;
/* NCCL carries the device collectives (a constant 0 on the CPU target: its calls are not compiled in) */
#define NCCL_ON (IS_ENABLED(CONFIG_DIST_NCCL) && g_nccl)
static char g_host[MPI_MAX_PROCESSOR_NAME + 1] = "localhost";
static float *g_stage, *g_part; /* host staging: a whole buffer, and one rank's slice */
static size_t g_stage_cap, g_part_cap;

static float *stage(size_t n) {
    if (n > g_stage_cap || !g_stage) { /* never NULL, even for 0 values (memcpy's arguments) */
        free(g_stage);
        g_stage = xmalloc((n ? n : 1) * sizeof(float));
        g_stage_cap = n;
    }
    return g_stage;
}

static float *part(size_t n) {
    if (n > g_part_cap || !g_part) {
        free(g_part);
        g_part = xmalloc((n ? n : 1) * sizeof(float));
        g_part_cap = n;
    }
    return g_part;
}

/* The overlapped sums (dist_sum_start_dev): one slot per queued part, kept from step to step (the same parts
 * every step, so the host buffers are allocated once): the staged part, this rank's piece of the result
 * (scatter), the piece's counts per rank (MPI reads them until the request completes) and the request. */
typedef struct {
    float *dev;            /* where the result goes: the part, or (scatter) this rank's piece of it */
    float *h, *piece;      /* host: the part (summed in place without scatter), this rank's summed piece */
    size_t n, piece_n, h_cap, piece_cap;
    int *counts, scatter;
    MPI_Request req;
} Pending;
static Pending *g_pend;
static int g_npend, g_pend_cap;

static float *grow(float *p, size_t *cap, size_t n) {
    if (p && n <= *cap) return p;
    free(p);
    *cap = n;
    return xmalloc((n ? n : 1) * sizeof(float));
}

static void free_pending(void) {
    for (int i = 0; i < g_pend_cap; i++) free(g_pend[i].h), free(g_pend[i].piece), free(g_pend[i].counts);
    free(g_pend);
    g_pend = NULL;
    g_npend = g_pend_cap = 0;
}

static KV_NORETURN void abort_job(int status) {
    fflush(NULL);
    if (g_on && g_size > 1) MPI_Abort(MPI_COMM_WORLD, status);
    _exit(status);
}

void dist_init(void) {
    if (g_on) return;
    int provided = 0;
    if (MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS)
        FATAL("MPI_Init failed (hint: start the step with mpirun, or check the OpenMPI installation)");
    g_on = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_size);
    MPI_Comm local;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &local);
    MPI_Comm_size(local, &g_local);
    MPI_Comm_rank(local, &g_local_rank);
    int len = 0;
    MPI_Get_processor_name(g_host, &len);
    g_host[len] = 0;
    if (g_size > 1) {
        char label[sizeof g_host + 64];
        snprintf(label, sizeof label, "rank %d of %d on %s", g_rank, g_size, g_host);
        set_process_identity(label, abort_job);
        /* only rank 0 reports; the others' errors still go to stderr */
        if (g_rank != 0 && !freopen("/dev/null", "w", stdout)) FATAL("cannot send stdout to /dev/null");
    }
    if (IS_ENABLED(CONFIG_DIST_NCCL)) { /* even as a job of one: the same code path on any number of GPUs */
        unsigned char id[DEV_COMM_ID_BYTES], mine[DEV_COMM_UUID_BYTES];
        dev_comm_select_gpu(g_local_rank, g_local);
        /* one GPU per rank (NCCL cannot share one): compare the GPUs of this machine's ranks; the later rank of
         * a pair reports, and its abort ends the job */
        unsigned char *all = xmalloc((size_t)g_local * DEV_COMM_UUID_BYTES);
        dev_comm_gpu_uuid(mine);
        MPI_Allgather(mine, DEV_COMM_UUID_BYTES, MPI_BYTE, all, DEV_COMM_UUID_BYTES, MPI_BYTE, local);
        for (int r = 0; r < g_local_rank; r++)
            if (memcmp(all + (size_t)r * DEV_COMM_UUID_BYTES, mine, DEV_COMM_UUID_BYTES) == 0)
                FATAL("ranks %d and %d of this machine (%s) drive the same GPU (hint: NCCL needs one GPU per rank: "
                      "at most as many ranks per machine as it has GPUs, Processes per machine in make menuconfig, "
                      "Distributed; or give each rank its own GPU with CUDA_VISIBLE_DEVICES)", r, g_local_rank,
                      g_host);
        free(all);
        if (g_rank == 0) dev_comm_make_id(id);
        MPI_Bcast(id, DEV_COMM_ID_BYTES, MPI_BYTE, 0, MPI_COMM_WORLD);
        dev_comm_join(id, g_rank, g_size);
        g_nccl = 1;
    }
    MPI_Comm_free(&local);
}

void dist_finalize(void) {
    if (!g_on) return;
    if (g_npend) FATAL("dist_finalize: %d gradient sums started and not waited for (dist_sum_wait_dev)", g_npend);
    if (NCCL_ON) dev_comm_leave(), g_nccl = 0;
    MPI_Finalize();
    g_on = 0;
    free(g_stage), free(g_part);
    free_pending();
    g_stage = g_part = NULL;
    g_stage_cap = g_part_cap = 0;
}

int dist_rank(void) { return g_rank; }
int dist_size(void) { return g_size; }
int dist_local_size(void) { return g_local; }
const char *dist_host(void) {
    if (!g_on && strcmp(g_host, "localhost") == 0 && gethostname(g_host, sizeof g_host - 1) != 0)
        strcpy(g_host, "localhost");
    return g_host;
}
const char *dist_transport(void) { return NCCL_ON ? "mpi + nccl" : "mpi"; }
void dist_abort(int status) { abort_job(status); }

/* MPI counts are ints: kvlab's buffers stay far below 2^31 floats (8 GiB); say so rather than overflow. */
static int count_of(size_t n, const char *op) {
    if (n > (size_t)INT_MAX) FATAL("%s: %zu values is more than one MPI call carries (2^31 - 1)", op, n);
    return (int)n;
}

static int active(void) { return g_on && g_size > 1; }

void dist_sum(double *v, int n) {
    if (active()) MPI_Allreduce(MPI_IN_PLACE, v, n, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
}

void dist_max(double *v, int n) {
    if (active()) MPI_Allreduce(MPI_IN_PLACE, v, n, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
}

void dist_bcast(void *buf, size_t bytes) {
    if (active()) MPI_Bcast(buf, count_of(bytes, "dist_bcast"), MPI_BYTE, 0, MPI_COMM_WORLD);
}

/* An NCCL slice collective (reduce-scatter, all-gather) over dist_split's slices of buf's n values, given as
 * per-rank offsets and counts. */
static void nccl_on_slices(void (*op)(float *, const size_t *, const size_t *), float *buf, size_t n) {
    size_t *lo = xmalloc((size_t)g_size * sizeof(size_t)), *cnt = xmalloc((size_t)g_size * sizeof(size_t));
    for (int r = 0; r < g_size; r++) {
        DistRange s = dist_split(n, r, g_size);
        lo[r] = s.lo, cnt[r] = s.n;
    }
    op(buf, lo, cnt);
    free(lo), free(cnt);
}

void dist_allreduce_dev(float *buf, size_t n) {
    if (NCCL_ON) {
        dev_comm_allreduce(buf, n);
        return;
    }
    if (!active()) return;
    float *h = stage(n);
    dev_download(h, buf, n * sizeof(float));
    MPI_Allreduce(MPI_IN_PLACE, h, count_of(n, "dist_allreduce_dev"), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    dev_upload(buf, h, n * sizeof(float));
}

void dist_sum_dev(double *v, int n) {
    if (n < 0) FATAL("dist_sum_dev: %d values", n);
    if (NCCL_ON) {
        dev_comm_sum_doubles(v, (size_t)n);
        return;
    }
    if (!active() || !n) return;
    double *h = xmalloc((size_t)n * sizeof(double));
    dev_download(h, v, (size_t)n * sizeof(double));
    MPI_Allreduce(MPI_IN_PLACE, h, n, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    dev_upload(v, h, (size_t)n * sizeof(double));
    free(h);
}

/* counts and displacements of the slices of n values */
static void slices(size_t n, int *counts, int *displs) {
    for (int r = 0; r < g_size; r++) {
        DistRange s = dist_split(n, r, g_size);
        counts[r] = (int)s.n;
        displs[r] = (int)s.lo;
    }
}

void dist_reduce_scatter_dev(float *buf, size_t n) {
    if (NCCL_ON) {
        nccl_on_slices(dev_comm_reduce_scatter, buf, n);
        return;
    }
    if (!active()) return;
    count_of(n, "dist_reduce_scatter_dev");
    DistRange mine = dist_split(n, g_rank, g_size);
    int *counts = xmalloc((size_t)g_size * sizeof(int)), *displs = xmalloc((size_t)g_size * sizeof(int));
    slices(n, counts, displs);
    float *h = stage(n), *out = part(mine.n);
    dev_download(h, buf, n * sizeof(float));
    MPI_Reduce_scatter(h, out, counts, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    dev_upload(buf + mine.lo, out, mine.n * sizeof(float));
    free(counts), free(displs);
}

void dist_allgather_dev(float *buf, size_t n) {
    if (NCCL_ON) {
        nccl_on_slices(dev_comm_allgather, buf, n);
        return;
    }
    if (!active()) return;
    count_of(n, "dist_allgather_dev");
    DistRange mine = dist_split(n, g_rank, g_size);
    int *counts = xmalloc((size_t)g_size * sizeof(int)), *displs = xmalloc((size_t)g_size * sizeof(int));
    slices(n, counts, displs);
    float *h = stage(n);
    dev_download(h + mine.lo, buf + mine.lo, mine.n * sizeof(float));
    MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, h, counts, displs, MPI_FLOAT, MPI_COMM_WORLD);
    dev_upload(buf, h, n * sizeof(float));
    free(counts), free(displs);
}

void dist_bcast_dev(float *buf, size_t n) {
    if (NCCL_ON) {
        dev_comm_bcast(buf, n);
        return;
    }
    if (!active()) return;
    float *h = stage(n);
    if (g_rank == 0) dev_download(h, buf, n * sizeof(float));
    MPI_Bcast(h, count_of(n, "dist_bcast_dev"), MPI_FLOAT, 0, MPI_COMM_WORLD);
    if (g_rank != 0) dev_upload(buf, h, n * sizeof(float));
}

/* rank r's piece [lo, lo + n) of a part of a buffer of total values: its part of r's slice (empty: n 0) */
static DistRange piece_of(size_t total, size_t lo, size_t n, int r) {
    DistRange s = dist_split(total, r, g_size);
    size_t a = lo > s.lo ? lo : s.lo, b = lo + n < s.lo + s.n ? lo + n : s.lo + s.n;
    return (DistRange){b > a ? a : lo, b > a ? b - a : 0};
}

void dist_sum_start_dev(float *buf, size_t total, size_t lo, size_t n, int scatter) {
    if (lo > total || n > total - lo) FATAL("dist_sum_start_dev: part [%zu, %zu) of %zu values", lo, lo + n, total);
    if (NCCL_ON) {
        if (!scatter) {
            dev_comm_allreduce_async(buf + lo, n);
            return;
        }
        size_t *plo = xmalloc((size_t)g_size * sizeof(size_t)), *cnt = xmalloc((size_t)g_size * sizeof(size_t));
        for (int r = 0; r < g_size; r++) {
            DistRange pr = piece_of(total, lo, n, r);
            plo[r] = pr.lo, cnt[r] = pr.n;
        }
        dev_comm_reduce_scatter_async(buf, plo, cnt);
        free(plo), free(cnt);
        return;
    }
    if (!active()) return;
    count_of(n, "dist_sum_start_dev");
    if (g_npend == g_pend_cap) {
        int cap = g_pend_cap ? 2 * g_pend_cap : 64;
        g_pend = xrealloc(g_pend, (size_t)cap * sizeof *g_pend);
        memset(g_pend + g_pend_cap, 0, (size_t)(cap - g_pend_cap) * sizeof *g_pend);
        g_pend_cap = cap;
    }
    Pending *p = &g_pend[g_npend++];
    p->h = grow(p->h, &p->h_cap, n);
    p->n = n;
    p->scatter = scatter;
    if (n) dev_download(p->h, buf + lo, n * sizeof(float));
    if (!scatter) {
        p->dev = buf + lo;
        MPI_Iallreduce(MPI_IN_PLACE, p->h, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, &p->req);
    } else {
        if (!p->counts) p->counts = xmalloc((size_t)g_size * sizeof(int));
        for (int r = 0; r < g_size; r++) p->counts[r] = (int)piece_of(total, lo, n, r).n; /* consecutive, rank order */
        DistRange mine = piece_of(total, lo, n, g_rank);
        p->dev = buf + mine.lo;
        p->piece_n = mine.n;
        p->piece = grow(p->piece, &p->piece_cap, mine.n);
        MPI_Ireduce_scatter(p->h, p->piece, p->counts, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, &p->req);
    }
    /* MPI moves the queued parts inside MPI calls: give it one now, while the caller goes on computing */
    for (int i = 0; i < g_npend; i++) {
        int done = 0;
        MPI_Test(&g_pend[i].req, &done, MPI_STATUS_IGNORE); /* a completed request becomes MPI_REQUEST_NULL */
    }
}

void dist_sum_wait_dev(void) {
    if (NCCL_ON) {
        dev_comm_async_wait();
        return;
    }
    for (int i = 0; i < g_npend; i++) {
        Pending *p = &g_pend[i];
        MPI_Wait(&p->req, MPI_STATUS_IGNORE);
        if (!p->scatter && p->n) dev_upload(p->dev, p->h, p->n * sizeof(float));
        if (p->scatter && p->piece_n) dev_upload(p->dev, p->piece, p->piece_n * sizeof(float));
    }
    g_npend = 0;
}


void dist_gather_dev(float *host_full, const float *slice, size_t n) {
    DistRange mine = dist_split(n, g_rank, g_size);
    if (!active()) {
        dev_download(host_full, slice, n * sizeof(float));
        return;
    }
    count_of(n, "dist_gather_dev");
    int *counts = xmalloc((size_t)g_size * sizeof(int)), *displs = xmalloc((size_t)g_size * sizeof(int));
    slices(n, counts, displs);
    float *out = part(mine.n);
    dev_download(out, slice, mine.n * sizeof(float));
    MPI_Gatherv(out, (int)mine.n, MPI_FLOAT, host_full, counts, displs, MPI_FLOAT, 0, MPI_COMM_WORLD);
    free(counts), free(displs);
}

void dist_scatter_dev(float *slice, const float *host_full, size_t n) {
    DistRange mine = dist_split(n, g_rank, g_size);
    if (!active()) {
        dev_upload(slice, host_full, n * sizeof(float));
        return;
    }
    count_of(n, "dist_scatter_dev");
    int *counts = xmalloc((size_t)g_size * sizeof(int)), *displs = xmalloc((size_t)g_size * sizeof(int));
    slices(n, counts, displs);
    float *in = part(mine.n);
    MPI_Scatterv(host_full, counts, displs, MPI_FLOAT, in, (int)mine.n, MPI_FLOAT, 0, MPI_COMM_WORLD);
    dev_upload(slice, in, mine.n * sizeof(float));
    free(counts), free(displs);
}
