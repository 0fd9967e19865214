/* Shared by the family model tests (test_gpt2, test_vit, test_seq2seq):
 * parameters that exercise every path, and the check of a model's gradients
 * against central differences of its float64 reference (tests/ref.h). The
 * model's buffers are the backend's: everything goes through host copies. */
#ifndef KVLAB_MODEL_CHECK_H
#define KVLAB_MODEL_CHECK_H

#include "params.h"

/* Gives every LayerNorm weight a non-trivial value and every bias and +Pos
 * weight a non-zero one, then scales all parameters by `scale` (sharper
 * attention than at initialisation). Returns the host copy of the result
 * (xmalloc'ed, the caller frees it). */
float *perturb_params(Params *w, float scale);

/* Compares w->grads (after the model's backward pass) with central
 * differences of loss(ctx) in the float64 parameters P (table layout; each
 * entry is changed and restored in place), at `samples` entries per tensor.
 * Prints the tensors that are off; returns how many. *worst_rel gets the
 * largest error relative to the largest |difference| of a tensor. */
int gradcheck(const char *name, const Params *w, double *P, double (*loss)(void *ctx), void *ctx, int samples,
              double *worst_rel);

#endif
