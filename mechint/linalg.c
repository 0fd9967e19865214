#include "linalg.h"

#include <cblas.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

/* LAPACK as OpenBLAS exports it (Fortran ABI: arguments by reference, column
 * major, hidden string lengths at the end). */
void dgeqrf_(const int *m, const int *n, double *a, const int *lda, double *tau, double *work, const int *lwork,
             int *info);
void dorgqr_(const int *m, const int *n, const int *k, double *a, const int *lda, const double *tau, double *work,
             const int *lwork, int *info);
void dgesdd_(const char *jobz, const int *m, const int *n, double *a, const int *lda, double *s, double *u,
             const int *ldu, double *vt, const int *ldvt, double *work, const int *lwork, int *iwork, int *info,
             size_t jobz_len);
void dsyev_(const char *jobz, const char *uplo, const int *n, double *a, const int *lda, double *w, double *work,
            const int *lwork, int *info, size_t jobz_len, size_t uplo_len);
void dgeev_(const char *jobvl, const char *jobvr, const int *n, double *a, const int *lda, double *wr, double *wi,
            double *vl, const int *ldvl, double *vr, const int *ldvr, double *work, const int *lwork, int *info,
            size_t jobvl_len, size_t jobvr_len);

void la_gemm(double *C, const double *A, int ta, const double *B, int tb, int m, int k, int n) {
    cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n, k, 1.0, A,
                ta ? m : k, B, tb ? k : n, 0.0, C, n);
}

double la_frob2(const double *A, int n) {
    double s = 0.0;
    for (int i = 0; i < n; i++) s += A[i] * A[i];
    return s;
}


double la_dot(const double *A, const double *B, int n) {
    double s = 0.0;
    for (int i = 0; i < n; i++) s += A[i] * B[i];
    return s;
}

/* row-major m x n <-> column-major */
static double *to_colmajor(const double *A, int m, int n) {
    double *c = xmalloc((size_t)m * n * sizeof(double));
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) c[(size_t)j * m + i] = A[(size_t)i * n + j];
    return c;
}

static void from_colmajor(double *A, const double *c, int m, int n, int ld) {
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) A[(size_t)i * n + j] = c[(size_t)j * ld + i];
}

int la_qr(const double *A, int m, int n, double *Q, double *R) {
    if (m < n) FATAL("la_qr: %d x %d has more columns than rows", m, n);
    double *a = to_colmajor(A, m, n), *tau = xmalloc((size_t)n * sizeof(double)), wq;
    int info = 0, lwork = -1;
    dgeqrf_(&m, &n, a, &m, tau, &wq, &lwork, &info);
    lwork = (int)wq;
    double *work = xmalloc((size_t)(lwork > 1 ? lwork : 1) * sizeof(double));
    dgeqrf_(&m, &n, a, &m, tau, work, &lwork, &info);
    if (info == 0 && R)
        for (int i = 0; i < n; i++)
            for (int j = 0; j < n; j++) R[(size_t)i * n + j] = j >= i ? a[(size_t)j * m + i] : 0.0;
    if (info == 0 && Q) {
        int lw2 = -1;
        dorgqr_(&m, &n, &n, a, &m, tau, &wq, &lw2, &info);
        if ((int)wq > lwork) {
            lwork = (int)wq;
            work = xrealloc(work, (size_t)lwork * sizeof(double));
        }
        dorgqr_(&m, &n, &n, a, &m, tau, work, &lwork, &info);
        if (info == 0) from_colmajor(Q, a, m, n, m);
    }
    free(a), free(tau), free(work);
    return info;
}

int la_svd(const double *A, int m, int n, double *U, double *s, double *Vt) {
    int k = m < n ? m : n, info = 0, lwork = -1;
    double *a = to_colmajor(A, m, n), *u = xmalloc((size_t)m * k * sizeof(double));
    double *vt = xmalloc((size_t)k * n * sizeof(double)), wq;
    int *iwork = xmalloc((size_t)8 * k * sizeof(int));
    const char *jobz = (U || Vt) ? "S" : "N";
    dgesdd_(jobz, &m, &n, a, &m, s, u, &m, vt, &k, &wq, &lwork, iwork, &info, 1);
    lwork = (int)wq;
    double *work = xmalloc((size_t)(lwork > 1 ? lwork : 1) * sizeof(double));
    dgesdd_(jobz, &m, &n, a, &m, s, u, &m, vt, &k, work, &lwork, iwork, &info, 1);
    if (info == 0 && U) from_colmajor(U, u, m, k, m);
    if (info == 0 && Vt) from_colmajor(Vt, vt, k, n, k);
    free(a), free(u), free(vt), free(iwork), free(work);
    return info;
}

int la_syev(const double *S, int n, double *w, double *V) {
    double *a = to_colmajor(S, n, n), wq;
    int info = 0, lwork = -1;
    const char *jobz = V ? "V" : "N";
    dsyev_(jobz, "U", &n, a, &n, w, &wq, &lwork, &info, 1, 1);
    lwork = (int)wq;
    double *work = xmalloc((size_t)(lwork > 1 ? lwork : 1) * sizeof(double));
    dsyev_(jobz, "U", &n, a, &n, w, work, &lwork, &info, 1, 1);
    if (info == 0 && V) from_colmajor(V, a, n, n, n);
    free(a), free(work);
    return info;
}

int la_geev(const double *A, int n, double *wr, double *wi) {
    double *a = to_colmajor(A, n, n), wq, dummy = 0.0;
    int info = 0, lwork = -1, one = 1;
    dgeev_("N", "N", &n, a, &n, wr, wi, &dummy, &one, &dummy, &one, &wq, &lwork, &info, 1, 1);
    lwork = (int)wq;
    double *work = xmalloc((size_t)(lwork > 1 ? lwork : 1) * sizeof(double));
    dgeev_("N", "N", &n, a, &n, wr, wi, &dummy, &one, &dummy, &one, work, &lwork, &info, 1, 1);
    free(a), free(work);
    return info;
}

int la_pinv(const double *A, int m, int n, double rcond, double *P) {
    int k = m < n ? m : n;
    double *U = xmalloc((size_t)m * k * sizeof(double)), *s = xmalloc((size_t)k * sizeof(double));
    double *Vt = xmalloc((size_t)k * n * sizeof(double));
    int info = la_svd(A, m, n, U, s, Vt);
    if (info == 0) {
        double cut = rcond * (k ? s[0] : 0.0);
        memset(P, 0, (size_t)n * m * sizeof(double));
        for (int c = 0; c < k; c++) {
            if (s[c] <= cut || s[c] == 0.0) continue;
            double inv = 1.0 / s[c];
            for (int i = 0; i < n; i++)
                for (int j = 0; j < m; j++) P[(size_t)i * m + j] += Vt[(size_t)c * n + i] * inv * U[(size_t)j * k + c];
        }
    }
    free(U), free(s), free(Vt);
    return info;
}

int la_orth(const double *W, int n, int r, double *Q) {
    int k = n < r ? n : r, rank = 0;
    double *U = xmalloc((size_t)n * k * sizeof(double)), *s = xmalloc((size_t)k * sizeof(double));
    if (la_svd(W, n, r, U, s, NULL) == 0)
        while (rank < k && s[rank] > 1e-10 * (s[0] > 0 ? s[0] : 1.0)) rank++;
    for (int i = 0; i < n; i++)
        for (int c = 0; c < rank; c++) Q[(size_t)i * rank + c] = U[(size_t)i * k + c];
    free(U), free(s);
    return rank;
}

double la_erank(const double *s, int n) {
    double total = 0.0, h = 0.0;
    for (int i = 0; i < n; i++) total += s[i] > 0 ? s[i] : 0.0;
    if (total <= 0.0) return 0.0;
    for (int i = 0; i < n; i++)
        if (s[i] > 0) {
            double p = s[i] / total;
            h -= p * log(p);
        }
    return exp(h);
}
