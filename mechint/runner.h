/* A checkpoint loaded into its family's own model code, with held-out data.
 *
 * Each family (gpt2, vit, seq2seq) provides runner_open_<family>: it checks
 * the checkpoint against this build (strictly, as the trainers do: the
 * variant and the whole model description must match), loads the
 * parameters, describes the self-attention blocks for model_build, and loads
 * held-out data of the model's own data set. Forward passes run without
 * dropout through the code the trainer uses; the block hooks (lib/block.h)
 * let analyses read projections and change head outputs. */
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
    /* parameters and gradients in the family's buffer (masks change params in place) */
    float *params, *grads;
    const ParamTable *table;
    ModelSource src;         /* self-attention blocks, for model_build and the hooks */
    const char *layer_names[RUNNER_MAX_LAYERS];
    int layer_causal[RUNNER_MAX_LAYERS];
    char name_store[RUNNER_MAX_LAYERS][16];
    /* per self-attention layer: sequence length and +Pos basis the hooks see */
    const float *pos_feat;
    int pos_T;
    int max_T;               /* longest sequence a forward pass sees */
    /* held-out batches: nbatches of rows logits rows each */
    int nbatches, V;
    float *logits;           /* (rows, V) after forward; backward reads d(objective)/d(logits) from here */
    int *targets;            /* host copy of the last batch's targets (rows); < 0: does not count */
    int rows;
    double (*forward)(Runner *r, int k, const BlockHook *hook);   /* mean loss over counted rows */
    void (*backward)(Runner *r);                                   /* into grads (zeroed first) */
    /* token models (gpt2): forward on given tokens (B x T); NULL otherwise */
    double (*forward_tokens)(Runner *r, const int *x, const int *y, int B, int T, const BlockHook *hook);
    int vocab, ctx;
    /* positions entering layer 0, for the positional kernel (A5): npos x d, NULL if none */
    double *pos_table;
    int npos;
    const char *pos_kind;    /* "learned", "sinusoidal" */
    int grid_w, grid_h, cls; /* ViT: patch grid, CLS token at position 0 */
    void (*close)(Runner *r);
    void *impl;
};

/* Opens ckpt for analysis; 0, or -1 with an error naming the file. */
int runner_open(Runner *r, const char *ckpt, int batch_size, int max_batches, uint64_t seed, Err *e);
void runner_close(Runner *r);

int runner_open_gpt2(Runner *r, const char *ckpt, int batch_size, int max_batches, uint64_t seed, Err *e);
int runner_open_vit(Runner *r, const char *ckpt, int batch_size, int max_batches, uint64_t seed, Err *e);
int runner_open_seq2seq(Runner *r, const char *ckpt, int batch_size, int max_batches, uint64_t seed, Err *e);

/* Shared by the family runners: counts rows with a target >= 0. */
int runner_counted(const int *targets, int rows);

#endif
