/* A checkpoint loaded into its family's own model code, with held-out data.
 *
 * Each family (gpt2, vit, seq2seq) provides runner_open_<family>: it checks
 * the checkpoint against this build (strictly, as the trainers do: the
 * variant and the whole model description must match), loads the
 * parameters, describes the self-attention blocks for model_build, and loads
 * held-out data of the model's own data set. Forward passes run without
 * dropout through the code the trainer uses; the block hooks (nn/block.h)
 * let analyses read projections and change head outputs.
 *
 * The model's buffers are device memory (kernels/kernels.h): analyses read
 * the weights from a host copy taken at opening (src.params), the logits
 * through runner_logits() and give gradients back through runner_backward();
 * the hooks see device pointers and copy what they read. */
#ifndef KVLAB_MECHINT_RUNNER_H
#define KVLAB_MECHINT_RUNNER_H

#include <stddef.h>
#include <stdint.h>

#include "block.h"
#include "checkpoint.h"
#include "common.h"
#include "mechint.h"

#define RUNNER_MAX_LAYERS 256
/* why a checkpoint of another variant does not open */
#define MECHINT_VARIANT_HINT "mechint is built per checkpoint configuration; run it through make mechint"

typedef struct Runner Runner;
struct Runner {
    const char *family;
    char data_desc[256];     /* the held-out data, for the report */
    const char *unit;        /* what a row is: "tokens", "images", "target tokens" */
    Params *w;               /* the model's device buffers (masks change w->params in place) */
    float *host_params;      /* w->params as loaded, host copy */
    ModelSource src;         /* self-attention blocks of host_params, for model_build and the hooks */
    const char *layer_names[RUNNER_MAX_LAYERS];
    int layer_causal[RUNNER_MAX_LAYERS];
    char name_store[RUNNER_MAX_LAYERS][16];
    /* per self-attention layer: sequence length and +Pos basis the hooks see */
    const float *pos_feat;
    int pos_T;
    int max_T;               /* longest sequence a forward pass sees */
    /* held-out batches: nbatches of rows logits rows each */
    int nbatches, V;
    act_t *dev_logits;       /* the model's (rows, V) logits after forward (device memory) */
    int *targets;            /* host copy of the last batch's targets (rows); < 0: does not count */
    int rows;
    double (*forward)(Runner *r, int k, const BlockHook *hook);   /* mean loss over counted rows */
    /* the model's backward from the d(objective)/d(logits) in dev_logits, into w->grads (zeroed first): the
     * self-attention projections' gradients, what the analyses read; the other products' weight gradients are
     * skipped (w->attn_grads_only, nn/params.h), and stay zero */
    void (*backward)(Runner *r);
    /* token models (gpt2): forward on given tokens (B x T); NULL otherwise */
    double (*forward_tokens)(Runner *r, const int *x, const int *y, int B, int T, const BlockHook *hook);
    int vocab, ctx; /* the tokens the data holds (gpt2: without the padding of GPT2_VOCAB_MULTIPLE; else 0), context */
    /* positions entering layer 0, for the positional kernel (A5): npos x d, NULL if none */
    double *pos_table;
    int npos;
    const char *pos_kind;    /* "learned", "sinusoidal" */
    int grid_w, grid_h, cls; /* ViT: patch grid, CLS token at position 0 */
    void (*close)(Runner *r);
    void *impl;
    float *host_logits;      /* runner_logits() */
    size_t host_logits_cap;
};

/* Opens ckpt for analysis; 0, or -1 with an error naming the file. */
int runner_open(Runner *r, const char *ckpt, int batch_size, int max_batches, uint64_t seed, Err *e);
void runner_close(Runner *r);

int runner_open_gpt2(Runner *r, const char *ckpt, int batch_size, int max_batches, uint64_t seed, Err *e);
int runner_open_vit(Runner *r, const char *ckpt, int batch_size, int max_batches, uint64_t seed, Err *e);
int runner_open_seq2seq(Runner *r, const char *ckpt, int batch_size, int max_batches, uint64_t seed, Err *e);

/* The logits of the last forward pass in host memory (rows x V floats,
 * valid until the next call). */
float *runner_logits(Runner *r);
/* Backward from d(objective)/d(logits) given in host memory (rows x V):
 * the self-attention projections' gradients in r->w->grads (Runner.backward). */
void runner_backward(Runner *r, const float *dlogits);

/* For the family runners, once the checkpoint is in w: the host copy of the
 * parameters and the positions entering layer 0 (npos x C floats at
 * dev_pos, device memory; NULL: none). */
void runner_setup(Runner *r, Params *w, const float *dev_pos, int npos, int C, const char *pos_kind);
/* Names self-attention layer l "<prefix>.<index>" and says whether it is causal. */
void runner_layer(Runner *r, int l, const char *prefix, int index, int causal);

#endif
