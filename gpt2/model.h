/* GPT-2 in C: token + learned position embeddings, pre-LayerNorm blocks
 * (attention in the configured variant, then a 4x MLP), final LayerNorm,
 * output head tied to the token embedding unless configured otherwise.
 * Parameters live in one contiguous buffer, gradients in another (llm.c
 * style); tensor names and layouts are in docs/checkpoints.md. */
#ifndef KVLAB_GPT2_MODEL_H
#define KVLAB_GPT2_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "block.h"
#include "params.h"

typedef struct {
    int V;          /* vocabulary size: the data set's, rounded up by CONFIG_GPT2_VOCAB_MULTIPLE */
    int pad_tokens; /* the last pad_tokens of the V never occur in the data: sampling never draws them */
    int T;          /* context length = rows of the position table */
    int L, H, C;    /* layers, heads, channels */
    int bias;       /* biases in linear layers and LayerNorms */
    int attn_bias;  /* biases on the Q/K/V projections */
    int tie;        /* output head = token embedding */
    int head_bias;  /* bias on an untied head */
    int gelu;       /* 1 GELU, 0 ReLU */
    float dropout;
    /* attention, fixed at compile time (kernels/attention.h) */
    int variant, pos, pos_m, pos_groups;
    int kv_heads;   /* K/V heads G (attn_kv_heads(H)): H standard, 1 MQA, else GQA */
} GPT2Config;

/* The tokens the data set can hold: the vocabulary less its padding (what sampling and probes may draw). */
static inline int gpt2_data_vocab(const GPT2Config *c) { return c->V - c->pad_tokens; }

/* The configuration this binary was built for, with the data set's vocabulary (rounded up to a multiple of
 * CONFIG_GPT2_VOCAB_MULTIPLE, the rest pad_tokens). */
GPT2Config gpt2_config_from_kconfig(int vocab);
/* JSON description of the model (stored in checkpoint metadata). */
char *gpt2_config_json(const GPT2Config *c);

typedef struct {
    act_t *encoded;                   /* (B,T,C) embeddings after dropout */
    BlockActs *block;                 /* per layer (nn/block.h); block[l].out feeds layer l+1 */
    act_t *lnf;                       /* (B,T,C) */
    float *lnf_mean, *lnf_rstd;       /* (B,T) */
    act_t *logits;                    /* (B,T,V), overwritten by its gradient in backward */
    float *losses, *ce_lse;           /* (B,T) */
    act_t *dres, *dlnf;               /* backward: gradient of the residual stream, of the final LayerNorm output */
    BlockScratch scratch;
} GPT2Acts;

typedef struct {
    GPT2Config cfg;
    Params w;                      /* parameters, gradients, AdamW moments (nn/params.h) */
    size_t wte, wpe, lnfw, lnfb, headw, headb;
    BlockParams *layer;
    float *pos_feat;               /* +Pos sinusoidal features, (T, c) */
    float *pe;                     /* fixed sinusoidal positions (T, C) with POSITION_SINUSOIDAL, else NULL */
    float *rope;                   /* RoPE table with POSITION_ROPE, else NULL */
    /* activations of the last forward pass (any batch up to the capacity) */
    GPT2Acts acts;
    void *act_memory;
    size_t act_capacity;           /* bytes in act_memory */
    int *inputs, *targets;
    /* last forward pass */
    int fwd_B, fwd_T, fwd_training, counted;
    uint64_t dropout_seed_base;
    /* analysis (mechint): hooks on every block, and a backward that starts
     * from d(loss)/d(logits) the caller wrote into acts.logits */
    const BlockHook *hook;
    int external_dlogits;
} GPT2;

/* The shape of block l for a batch of B x T tokens (dropout on when
 * training, with the step's seed); sampling decodes with B = T = 1. */
BlockShape gpt2_block_shape(const GPT2 *m, int B, int T, int training, uint64_t seed, int l);

/* The absolute position rows added to the token embeddings (T, C): the
 * learned wpe, the fixed sinusoidal table, or NULL when the configured
 * position scheme acts inside attention (device memory). */
const float *gpt2_positions(const GPT2 *m);

/* Builds the parameter table and initialises the parameters from seed
 * (GPT-2 init: N(0, 0.02), residual projections scaled by 1/sqrt(2L)). */
void gpt2_init(GPT2 *m, const GPT2Config *cfg, uint64_t seed);
void gpt2_free(GPT2 *m);
/* Parameter count of a configuration, without allocating the model. */
size_t gpt2_num_params(const GPT2Config *c);
/* Parameters that take part in matrix multiplies (for the FLOP count). */
size_t gpt2_matmul_params(const GPT2Config *c);
/* Training FLOPs per token (forward + backward), the formula in docs. */
double gpt2_flops_per_token(const GPT2Config *c, int T);

/* Forward pass over B sequences of T tokens; with targets, each target's
 * loss stays on the device (targets of -1 are ignored; m->counted is how
 * many count; NULL targets: no loss). training = 1 applies dropout with
 * seeds derived from dropout_seed. A training step adds the losses to its
 * record with gpt2_loss_into, and nothing waits for a GPU. */
void gpt2_forward_pass(GPT2 *m, const int *inputs, const int *targets, int B, int T, int training,
                       uint64_t dropout_seed);
/* *acc (a double in device memory) += scale * the sum of the last pass's losses. */
void gpt2_loss_into(GPT2 *m, double *acc, double scale);
/* The mean loss over the counted targets of the last pass (reads it back). */
double gpt2_loss(GPT2 *m);
/* gpt2_forward_pass, then its gpt2_loss (NAN without targets). */
double gpt2_forward(GPT2 *m, const int *inputs, const int *targets, int B, int T, int training,
                    uint64_t dropout_seed);
/* Number of targets that counted in the last forward pass and, of those,
 * how many the model ranked first. */
int gpt2_correct(GPT2 *m);
/* Backward pass of the last forward; the loss gradient is scaled by
 * loss_scale / counted (loss_scale = 1 / gradient-accumulation steps). */
void gpt2_backward(GPT2 *m, float loss_scale);

#endif
