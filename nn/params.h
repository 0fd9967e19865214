/* The parameters of a model, as in llm.c: every tensor lives in ONE
 * contiguous buffer of device memory (the gradients, and AdamW's two moments
 * in three more buffers of the same layout), described by a table of names,
 * shapes and offsets. The families build the table; allocation, seeded
 * initialisation, zeroing the gradients, AdamW and host copies live here
 * once. Checkpoint files store each tensor under its table name
 * (train/checkpoint.h, docs/checkpoints.md). */
#ifndef KVLAB_PARAMS_H
#define KVLAB_PARAMS_H

#include <stddef.h>
#include <stdint.h>

#include "rng.h"

#define PARAM_NAME_MAX 96
#define PARAM_MAX_DIMS 4

typedef struct {
    char name[PARAM_NAME_MAX];
    int ndim;
    int64_t shape[PARAM_MAX_DIMS];
    size_t offset, numel;
    int decay; /* AdamW weight decay applies (matrices) */
} ParamSpec;

typedef struct {
    ParamSpec *specs;
    int n, cap;
    size_t total; /* floats in each buffer: the tensors and the gaps that align them */
    size_t count; /* the model's parameters: the tensors' sizes summed (what metrics report) */
} ParamTable;

/* Each tensor starts at a multiple of PARAM_ALIGN floats (64 bytes) of the buffers, whatever the sizes before
 * it: the biases cuBLASLt's epilogues take straight from the table must be 16-byte aligned, and the GPU's
 * products run faster kernels for aligned matrices (an odd-sized tensor such as +Pos's m + 1 floats a layer
 * used to shift every tensor after it: docs/cuda.md). The gaps are zero, never read as parameters, not in
 * `count`, and no gradient or AdamW update touches them; checkpoints store tensors by name, so the layout is not
 * in any file. */
#define PARAM_ALIGN 16

/* Appends a tensor of the given shape (ndim values follow) at the next aligned offset; returns its offset. */
size_t param_add(ParamTable *t, const char *name, int decay, int ndim, ...);
/* The same, right after the previous tensor with no gap: the second and later blocks of a fused matrix or bias
 * (q, k and v back to back are one (3C, C) weight), which the products read as one. */
size_t param_add_next(ParamTable *t, const char *name, int decay, int ndim, ...);
const ParamSpec *param_find(const ParamTable *t, const char *name);
void param_table_free(ParamTable *t);

/* A model's table and its four device buffers (table.total floats each; in a ZeRO-1 run, train/trainer.h,
 * m and v hold only the rank's slice of the values). */
/* Told that the gradients from a given offset up are final (params_grads_final_from). */
typedef void (*ParamsGradsFinal)(void *ctx, size_t offset);

typedef struct {
    ParamTable table;
    float *params, *grads, *m, *v;
    /* set by data-parallel training (train/grad_sync.h) for the last backward pass of an optimizer step, so
     * that it can sum the finished gradients while the pass goes on; NULL otherwise */
    ParamsGradsFinal grads_final;
    void *grads_final_ctx;
    /* set by an analysis that differentiates through the self-attention projections only (mechint's masks,
     * mechint/runner.h): the families' backward passes then skip the weight gradients of every other matrix
     * product (the output projection, the MLP, cross-attention, heads, patch and input layers), which stay as
     * they were (zero after params_zero_grad), saving a quarter of the pass's work. Input gradients, and the
     * LayerNorm, embedding and position gradients, are computed as always. 0 in training. */
    int attn_grads_only;
} Params;

/* The gradient at `offset` of a matrix product's weight or bias other than the self-attention projections, for
 * linear_backward: NULL (skip it) when attn_grads_only is set. */
static inline float *params_product_grad(const Params *p, size_t offset) {
    return p->attn_grads_only ? NULL : p->grads + offset;
}

/* Allocates the four buffers for the table built in p->table (zeroed). */
void params_alloc(Params *p);
/* Frees the buffers and the table. */
void params_free(Params *p);

/* Fills tensor s (s->numel floats at host) with its initial values, drawing
 * from rng; tensors the rule leaves alone stay 0. */
typedef void (*ParamInit)(const ParamSpec *s, float *host, Rng *rng, void *ctx);
/* Initialises every tensor in table order from one seeded stream, on the
 * host, then uploads: the same seed gives the same model on every target. */
void params_init(Params *p, uint64_t seed, ParamInit rule, void *ctx);

void params_zero_grad(Params *p);
/* A backward pass says that every gradient at offset >= `offset` of the flat buffer has its final value for
 * this pass (nothing later in the pass adds to it): the families call it after each block's backward with
 * the block's first offset (BlockParams.first), their tensors being registered input side first. Saying it
 * too early sums a gradient before it is complete (2 processes then differ from 1: tests/run_tests.py -k mpi);
 * never saying it only loses the overlap. */
static inline void params_grads_final_from(Params *p, size_t offset) {
    if (p->grads_final) p->grads_final(p->grads_final_ctx, offset);
}
/* AdamW on every tensor; weight decay only where the table says so. */
void params_adamw(Params *p, float lr, float beta1, float beta2, float eps, float weight_decay, int t);
/* The same on the values [lo, lo + n) of the flat buffers only (ZeRO-1: one rank's slice, which may cut
 * tensors anywhere): m and v hold the moments of those n values (m[0] is value lo's). */
void params_adamw_slice(Params *p, float *m, float *v, size_t lo, size_t n, float lr, float beta1, float beta2,
                        float eps, float weight_decay, int t);

/* Host copy of one of p's buffers (params, grads, m or v): xmalloc'ed,
 * table.total floats, the caller frees it. */
float *params_to_host(const Params *p, const float *buf);
/* Replaces one of p's buffers with table.total host floats. */
void params_from_host(Params *p, float *buf, const float *host);

#endif
