/* Shared by the family model tests (test_gpt2, test_vit, test_seq2seq):
 * parameters that exercise every path, and the check of a model's gradients
 * against central differences of its float64 reference (tests/ref.h). The
 * model's buffers are the backend's: everything goes through host copies. */
#ifndef KVLAB_MODEL_CHECK_H
#define KVLAB_MODEL_CHECK_H

#include "block.h"
#include "params.h"
#include "ref.h"

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

/* An analysis's backward pass (Params.attn_grads_only, nn/params.h) against training's: runs `pass` (a forward
 * and backward pass of the model, gradients zeroed first) without and then with the flag. The self-attention
 * projections' gradients (the attn_num_proj weight tensors from each block's attnw, and the bias tensors from
 * attnb where the model has them) must be bit-identical; the output projection's and the MLP's weight gradients
 * zero with the flag and not without it. blocks: the model's nblocks self-attention blocks. Prints what is off;
 * returns how many. */
int attn_grads_only_errors(const char *name, Params *w, void (*pass)(void *ctx), void *ctx,
                           const BlockParams *const *blocks, int nblocks);

/* The layout of a model's parameter table (nn/params.h), printing what is wrong; returns how many things are:
 * tensors in order without overlap; each starting at a multiple of PARAM_ALIGN floats, except the later blocks
 * of a fused attention weight or bias ("...attn.k.weight" right after "...attn.q.weight"), which follow their
 * first with no gap; count the tensors' sizes summed; and zero in every gap of the parameters and of the
 * gradients (call it after a backward pass: nothing may write there). */
int param_layout_errors(const char *name, const Params *w);

/* A family's initialisation rule for one tensor: every value exactly x (INIT_CONST), or drawn from N(0, x^2)
 * (INIT_NORMAL) or U(-x, x) (INIT_UNIFORM). */
typedef enum { INIT_CONST, INIT_NORMAL, INIT_UNIFORM } InitRule;
/* Whether tensor s of the host buffer p (params_to_host) holds values its rule gives: INIT_CONST, every value x;
 * the random rules, every value finite (and for the uniform within [-x, x]), two or more values not all equal,
 * and in a tensor of 1,000 values or more the sample's standard deviation within 10% of the rule's (x, or x/sqrt 3
 * for the uniform; 4.5 standard errors at 1,000), its mean within 5 standard errors of 0 and, for the uniform, its
 * largest |value| above 0.9 x. Prints what is off, naming `what` and the tensor. */
int init_matches(const char *what, const float *p, const ParamSpec *s, InitRule rule, double x);
/* A family's rule for tensor s: returns the rule and sets *x (ctx: what the rule needs, such as the config) */
typedef InitRule (*InitRuleOf)(const ParamSpec *s, const void *ctx, double *x);
/* How many tensors of w's table hold values other than rule_of gives them (init_matches, after one download) */
int init_errors(const char *what, const Params *w, InitRuleOf rule_of, const void *ctx);

/* The float64 references' positions under the configured scheme: the absolute position value added to
 * channel k at position t (the learned table at P + learned, which the family has only with the default
 * scheme; the sinusoidal table computed here; 0 when the scheme acts inside attention), and the
 * RefPositions of one self-attention layer (its relative-bias weights in P). */
double ref_abs_position(const double *P, size_t learned, int t, int k, int C);
RefPositions ref_layer_positions(const double *P, const BlockParams *lp);

/* Parameters the configured position scheme (kernels/Kconfig "Positions") adds to a model of L
 * self-attention layers of H heads whose own absolute positions are a learned T x C table (T = 0: fixed
 * ones): minus that table unless the scheme is the family's own, plus H x buckets relative-bias weights per
 * layer. The parameter-count oracles are stated for the family's own positions; the tests subtract this. */
long position_param_delta(int L, int H, int T, int C);

#endif
