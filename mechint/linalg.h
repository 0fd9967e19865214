/* Small dense linear algebra in double precision for the analyses, on
 * row-major matrices: products through OpenBLAS, factorisations through the
 * LAPACK routines OpenBLAS ships (QR, SVD, symmetric and general
 * eigenvalues). Sizes here are head dims and sequence lengths (<= a few
 * thousand), so the wrappers copy into LAPACK's column-major layout. */
#ifndef KVLAB_MECHINT_LINALG_H
#define KVLAB_MECHINT_LINALG_H

/* C (m x n) = op(A) op(B); op(A) is m x k. */
void la_gemm(double *C, const double *A, int ta, const double *B, int tb, int m, int k, int n);
/* Frobenius norm squared, Frobenius inner product. */
double la_frob2(const double *A, int n);
double la_dot(const double *A, const double *B, int n);

/* Thin QR of A (m x n, m >= n): Q (m x n, orthonormal columns) and R (n x n,
 * upper triangular); either output may be NULL. Returns 0 or a LAPACK error. */
int la_qr(const double *A, int m, int n, double *Q, double *R);
/* Thin SVD A (m x n) = U diag(s) Vt with k = min(m, n): U (m x k), s (k,
 * descending), Vt (k x n); U and Vt may be NULL. */
int la_svd(const double *A, int m, int n, double *U, double *s, double *Vt);
/* Symmetric eigendecomposition: w ascending, V (n x n, columns = vectors) or NULL. */
int la_syev(const double *S, int n, double *w, double *V);
/* Eigenvalues of a general square matrix (real and imaginary parts). */
int la_geev(const double *A, int n, double *wr, double *wi);
/* Moore-Penrose pseudo-inverse of A (m x n) into P (n x m); singular values
 * below rcond * s_max count as zero. */
int la_pinv(const double *A, int m, int n, double rcond, double *P);

/* Orthonormal basis of col(W) (n x r) into Q (n x rank, the left singular vectors above 1e-10 of the largest);
 * returns the numerical rank, 0 when the SVD fails (NaN weights). */
int la_orth(const double *W, int n, int r, double *Q);

/* Effective rank exp(-sum p ln p), p = s / sum s, of non-negative values. */
double la_erank(const double *s, int n);

#endif
