/* Data-driven analyses (mechint/probes.c, mechint/masks.c) and the
 * known-answer building blocks the tests call directly. */
#ifndef KVLAB_MECHINT_DATA_H
#define KVLAB_MECHINT_DATA_H

#include <cjson/cJSON.h>
#include <stdint.h>

#include "mechint.h"
#include "runner.h"

/* ---- A8 detectors on one attention pattern A (n x n, rows sum to 1) ---- */
typedef struct {
    double prev, self, self_argmax, sink, local, mean_distance, entropy, next;
} HeadScores;
/* Means over query rows (valid[i] != 0, or all when NULL); prev and sink over i >= 1. */
HeadScores head_scores(const double *A, int n, int causal, const unsigned char *valid);
/* Mean of A[p, p-N+1] over the second copy p = N..2N-1 of a repeated sequence. */
double induction_score(const double *A, int n, int N);
const char *head_label(double prev, double induction, double self, double sink);

/* A7 + A8 over held-out batches (and repeated random sequences for token
 * models); *maps gets the first sequence's attention maps for the plots.
 * Returns {"attn_asymmetry": ..., "head_types": ...}. */
cJSON *analysis_patterns(Runner *r, const Model *m, int batches, int max_seqs, int induction_len, uint64_t seed,
                         cJSON **maps);
/* A10: zero and mean ablation of every head. */
cJSON *analysis_ablation(Runner *r, const Model *m, int batches);

/* ---- A11 masks ---- */
typedef struct {
    int L, H, r, C, P, nroles, attn_bias;
    int role_block[2];
    const char *role_name[2];
    double *A, *Bm, *sv;      /* per (layer, head, role): r x r factors of T(m), singular values */
    float *dev_params;        /* the runner's parameters (device), which the masks rewrite */
    const float *dev_grads;   /* and their gradients */
    const BlockParams *bp;
    float *raw_w, *raw_b;     /* unmasked projections, per layer (host) */
    float *work_w, *work_b;   /* one layer's masked projections or their gradients (host) */
} MaskPlan;
typedef struct {
    double loss, kl;
} MaskEval;
void mask_plan(MaskPlan *p, const Model *m, const Runner *r);
void mask_plan_free(MaskPlan *p);
/* Writes the masked projections into the parameters (mask NULL: restores). */
void mask_apply(const MaskPlan *p, const double *mask);
void *mask_ref_new(Runner *r, int batches);
void mask_ref_free(void *ref);
double mask_ref_loss(const void *ref);
MaskEval mask_evaluate(Runner *r, const MaskPlan *p, const double *mask, const void *ref);
/* KL(p_full || p_masked) on one of ref's batches with the masks applied (left applied), and its gradient with
 * respect to every mask value into dm (L x H x roles x r), as mask_train descends it */
double mask_kl_grad(Runner *r, const MaskPlan *p, const void *ref, int batch, const double *mask, double *dm);
/* Deterministic given the batches. hard: the round(target * n) kept directions; theta_out (optional): the
 * final mask logits */
void mask_train(Runner *r, const MaskPlan *p, const void *ref, double target, int steps, double lr, double *hard,
                double *theta_out);
cJSON *analysis_masks(Runner *r, const Model *m, int batches, const double *targets, int ntargets, int steps,
                      double lr, uint64_t seed);

#endif
