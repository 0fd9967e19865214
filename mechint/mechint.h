/* mechint: analyses of the attention circuits in a kvlab checkpoint
 * (../shared/reference/mechint-analyses.md; docs/mechint.md explains each).
 *
 * A checkpoint becomes a Model: its self-attention heads as matrices in the
 * row-vector convention of the catalogue (q = x W_Q + b_Q, W_Q d x r; head
 * output z W_O, W_O r x d), with the reading LayerNorm folded in where the
 * blocks are pre-LN. Weight-only analyses read these; data-driven ones run
 * the family's own forward pass (the training code, through nn/block.h's
 * hooks) on held-out data, see runner.h. Every analysis writes a cJSON
 * object: "applies" (false with "why" when the variant makes it
 * meaningless), "per_head" [L][H] records, "summary", "params". */
#ifndef KVLAB_MECHINT_H
#define KVLAB_MECHINT_H

#include <cjson/cJSON.h>
#include <stdint.h>

#include "block.h"

/* One head. Matrices carry a bias row: W_Q, W_K, W_V are (d+1) x r with
 * the bias as row d (zeros without bias), so x~ = [x, 1] covers both. The
 * same pointer appears twice when the variant ties two roles. */
typedef struct {
    const double *Wq, *Wk, *Wv; /* (d+1) x r */
    const double *Wo;           /* r x d */
} Head;

typedef struct {
    char name[32];     /* "h.0", "blocks.1", "enc.0", "dec.2" */
    int causal;        /* decoder self-attention */
    int folded;        /* LayerNorm gamma/beta folded into W_Q/W_K/W_V (pre-LN) */
    Head *head;        /* H heads */
    double *store;     /* owns the matrices */
    /* +Pos: groups x m weights and groups biases (1 group or one per head) */
    double *pos_w, *pos_b;
} Layer;

typedef struct {
    const char *family;     /* "gpt2", "vit", "seq2seq" */
    int variant, pos, pos_m, pos_groups;
    int L, H, d, r;
    int kv_heads;           /* K/V heads per layer (H unless grouped): head h's Wk, Wv are those of K/V head
                             * h / (H / kv_heads), copied into every head of the group */
    Layer *layer;
    /* absolute positions entering layer 0 (learned tables, or the fixed
     * sinusoids of seq2seq), npos x d, centred per row like LayerNorm would;
     * NULL when the model has none */
    double *pos_table;
    int npos;
    const char *pos_kind;   /* "learned", "sinusoidal" */
    int grid_w, grid_h, cls; /* ViT: patch grid and a CLS token at position 0 */
} Model;

/* Weights of L self-attention blocks from a parameter buffer. ln_gamma /
 * ln_beta per layer are the LayerNorm reading into attention (NULL when
 * post-LN: raw weights). */
typedef struct {
    const float *params;
    const BlockParams *bp;
    int L, H, C, variant, pos, pos_m, pos_groups;
    int kv_heads;            /* K/V heads G (0 = H): the K/V blocks are G*r rows (kernels/attention.h) */
    int bias, attn_bias;     /* output projection bias, Q/K/V biases */
    int post_ln;             /* blocks read the raw residual stream */
    const int *causal;       /* per layer */
    const char *const *names;
} ModelSource;

void model_build(Model *m, const char *family, const ModelSource *src);
void model_free(Model *m);

/* Weight-only analyses (mechint/weights.c). */
cJSON *analysis_circuits(const Model *m);
cJSON *analysis_qk_symmetry(const Model *m);
cJSON *analysis_kv_alignment(const Model *m);
cJSON *analysis_pos_kernel(const Model *m);
cJSON *analysis_pos_bias(const Model *m, int n);
/* {"applies": false, "why": why}: the result of an analysis the variant or the model makes meaningless. */
cJSON *not_applicable(const char *why);
/* A9 (mechint/composition.c): Q-, K- and V-composition of every head into the heads of later layers of its stack,
 * with z against random heads of the same shapes and tying (drawn from seed). */
cJSON *analysis_composition(const Model *m, uint64_t seed);

/* ---- known-answer building blocks (also used by tests/test_mechint.c) --- */

typedef struct {
    double sigma_sym, sym_ratio, positivity, framework_positivity, psd_residual;
} QKSymmetry;
/* W_QK = Wq Wk^T with Wq, Wk (n x r) (n = d or d+1), computed factored. */
QKSymmetry qk_symmetry(const double *Wq, const double *Wk, int n, int r);

typedef struct {
    double pk, pk_random, tau_qk, tau_ov, cos_max, cos_min;
} KVAlignment;
/* Subspace overlap of col(Wk) and col(Wv) (n x r), and the tieability
 * residuals of W_QK = Wq Wk^T when K is replaced by V and of W_OV = Wv Wo
 * when V is replaced by K (Wo r x d). */
KVAlignment kv_alignment(const double *Wq, const double *Wk, const double *Wv, const double *Wo, int n, int r, int d);

/* Singular values of A B^T (A: n x r, B: m x r) from the r x r middle of
 * their QR factors; s gets r values. */
int factored_svals(const double *A, int n, const double *B, int m, int r, double *s);

/* Positional kernel metrics of an n x n logit map K (row i = query).
 * causal: only j <= i counts. profile gets 2n-1 values t(delta), delta =
 * i - j from -(n-1) to n-1 (index delta + n - 1; NAN where no pair). */
typedef struct {
    double toeplitz, mu_prev, min_eig;
    int argmax_offset;
} PosKernel;
PosKernel pos_kernel_metrics(const double *K, int n, int causal, double *profile);

/* Hodge decomposition of an n x n logit matrix (catalogue A7). */
typedef struct {
    double antisym_share, kappa, curl_share;
} Hodge;
Hodge hodge(const double *Lg, int n);
/* Reversibility of a row-stochastic A: ||Pi A - (Pi A)^T|| / ||Pi A||, Pi the
 * stationary distribution (power iteration). */
double reversibility(const double *A, int n);

/* Two-way decomposition of a bias map B (n x n, causal: j <= i only):
 * energy shares of row, column and interaction parts of B - mean, the
 * Toeplitz fraction of B - mean, and the curl fraction. */
typedef struct {
    double e_row, e_col, e_int, toeplitz, curl;
} BiasParts;
BiasParts bias_parts(const double *Bm, int n, int causal);

#endif
