/* Vision Transformer in C: patches -> linear patch embedding -> CLS token
 * (or none, for mean pooling) and learned position embeddings -> pre-LN
 * encoder blocks with bidirectional attention in the configured variant
 * (nn/block.h) -> optional final LayerNorm -> CLS or mean pooling ->
 * classification head. Parameters in one buffer, gradients in another. */
#ifndef KVLAB_VIT_MODEL_H
#define KVLAB_VIT_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "block.h"
#include "params.h"

typedef struct {
    int img_h, img_w, img_c, classes;
    int P;          /* patch side */
    int N;          /* patches per image */
    int T;          /* tokens: N (+1 with a CLS token) */
    int C, L, H, mlp;
    int cls;        /* 1: CLS token and CLS pooling; 0: mean pooling */
    int head_mlp;   /* two-layer head */
    int final_ln;
    int attn_bias;
    float dropout;
    int variant, pos, pos_m, pos_groups;
    int kv_heads;   /* K/V heads G (attn_kv_heads(H)): H standard, 1 MQA, else GQA */
} ViTConfig;

/* The configured model for images of h x w x c and the given classes. */
ViTConfig vit_config_from_kconfig(int h, int w, int c, int classes);
char *vit_config_json(const ViTConfig *c);

typedef struct {
    act_t *patches;                  /* (B, N, P*P*c) input */
    act_t *pemb;                     /* (B, N, C) patch embeddings */
    act_t *encoded;                  /* (B, T, C) tokens + positions (after dropout) */
    BlockActs *block;                /* per layer */
    act_t *lnf;                      /* (B, T, C) */
    float *lnf_mean, *lnf_rstd;      /* (B, T) */
    act_t *pooled;                   /* (B, C) */
    act_t *hfc, *hact;               /* (B, mlp) head hidden layer */
    act_t *logits;                   /* (B, classes) */
    float *losses, *ce_lse;          /* (B), (B) */
    act_t *dres, *dtmp, *dpooled, *dhfc, *dpemb;
    BlockScratch scratch;
} ViTActs;

typedef struct {
    ViTConfig cfg;
    Params w; /* parameters, gradients, AdamW moments (nn/params.h) */
    size_t patchw, patchb, clstok, posemb, lnfw, lnfb, headfcw, headfcb, headw, headb;
    BlockParams *layer;
    float *pos_feat;
    float *pe;   /* fixed sinusoidal positions (T, C) with POSITION_SINUSOIDAL, else NULL */
    float *rope; /* RoPE table with POSITION_ROPE, else NULL */
    ViTActs acts;
    void *act_memory;
    size_t act_capacity; /* bytes */
    int *targets;
    int fwd_B, fwd_training, counted;
    uint64_t dropout_seed_base;
    /* analysis (mechint): hooks on every block, and a backward that starts
     * from d(loss)/d(logits) the caller wrote into acts.logits */
    const BlockHook *hook;
    int external_dlogits;
} ViT;

void vit_init(ViT *m, const ViTConfig *cfg, uint64_t seed);
/* The absolute position rows added to the tokens (T, C), CLS first: the
 * learned pos_emb, the fixed sinusoidal table, or NULL when the configured
 * position scheme acts inside attention (device memory). */
const float *vit_positions(const ViT *m);
void vit_free(ViT *m);
size_t vit_num_params(const ViTConfig *c);
size_t vit_matmul_params(const ViTConfig *c);
/* Training FLOPs per image (forward + backward): 6 per matmul parameter per
 * token plus 12 L T C for the attention products. */
double vit_flops_per_image(const ViTConfig *c);

/* Forward over B images whose patches (B, N, P*P*c) are given (NULL labels:
 * logits only); each image's loss stays on the device, vit_loss_into adds
 * them to a training step's record without waiting for a GPU. */
void vit_forward_pass(ViT *m, const float *patches, const int *labels, int B, int training, uint64_t dropout_seed);
/* *acc (a double in device memory) += scale * the sum of the last pass's losses. */
void vit_loss_into(ViT *m, double *acc, double scale);
/* The mean loss over the labels of the last pass (reads it back). */
double vit_loss(ViT *m);
/* vit_forward_pass, then its vit_loss (NAN without labels). */
double vit_forward(ViT *m, const float *patches, const int *labels, int B, int training, uint64_t dropout_seed);
/* Correct predictions of the last forward; predictions into pred (B) if non-NULL (reads the logits back). */
int vit_correct(ViT *m, int *pred);
/* *acc (a double in device memory) += the correct predictions of the last forward with labels. */
void vit_correct_into(ViT *m, double *acc);
void vit_backward(ViT *m, float loss_scale);

#endif
