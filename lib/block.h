/* The pre-LayerNorm transformer block shared by the model families:
 *
 *   res2 = x + drop(proj(attention(qkv(ln1(x)))))        attention in the configured variant
 *   out  = res2 + drop(fc2(act(fc1(ln2(res2)))))           act = GELU or ReLU
 *
 * GPT-2 runs it causal, ViT bidirectional, a seq2seq encoder with key
 * padding. Forward and backward sit side by side; the backward pass
 * accumulates into the parameter gradients like every kernel does. */
#ifndef KVLAB_BLOCK_H
#define KVLAB_BLOCK_H

#include <stddef.h>
#include <stdint.h>

#include "attention.h"

/* Offsets of one block's tensors in the model's parameter buffer (the same
 * offsets index the gradient buffer). Absent biases are flagged in BlockShape. */
typedef struct {
    size_t ln1w, ln1b, attnw, attnb, posw, posb, projw, projb, ln2w, ln2b, fcw, fcb, fcpw, fcpb;
} BlockParams;

typedef struct {
    int B, T, C, H, mlp;           /* mlp = hidden width of the MLP */
    int causal, gelu;
    int bias, attn_bias;           /* biases on linear layers and LayerNorms / on the projections */
    int pos, pos_m, pos_groups;    /* +Pos (compile-time in the kernels) */
    const float *pos_feat;         /* +Pos basis, pos_T rows */
    int pos_T;
    const unsigned char *key_pad;  /* (B, T) or NULL */
    float dropout;                 /* 0 outside training */
    uint64_t seed;                 /* dropout seed of this block for this step */
} BlockShape;

/* Activations of one block for B x T tokens, kept for the backward pass. */
typedef struct {
    float *ln1, *ln1_mean, *ln1_rstd, *proj, *atty, *att_lse, *res2, *ln2, *ln2_mean, *ln2_rstd, *fch, *fch_act,
        *out;
} BlockActs;

/* Scratch shared by all blocks of a model during the backward pass. */
typedef struct {
    float *dbranch, *dln, *datty, *dproj, *dfch_act, *dfch; /* (B,T,C) x3, (B,T,P*C), (B,T,mlp) x2 */
    float *branch;                                          /* forward: (B,T,C) sublayer output */
} BlockScratch;

/* Floats of each activation array per block, for allocation. */
size_t block_act_floats(const BlockShape *s);
/* Carves one block's activations out of mem (block_act_floats(s) floats). */
BlockActs block_acts_at(float *mem, const BlockShape *s);
size_t block_scratch_floats(const BlockShape *s);
BlockScratch block_scratch_at(float *mem, const BlockShape *s);

void block_forward(BlockActs *a, const float *x, const float *params, const BlockParams *p, const BlockShape *s,
                   BlockScratch *sc);
/* dres holds d(out) on entry and d(x) on exit. */
void block_backward(float *dres, float *grads, const BlockActs *a, const float *x, const float *params,
                    const BlockParams *p, const BlockShape *s, BlockScratch *sc);

#endif
