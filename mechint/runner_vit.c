/* mechint runner for ViT checkpoints: the model of vit/model.c on the
 * validation images of its own data set (vit/data.c: the seeded split of the
 * training images the trainer validates on, never trained on). */
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "kernels.h"
#include "runner.h"
#include "vit/data.h"
#include "vit/model.h"

typedef struct {
    ViT model;
    VitData data;
    int B, nbatches;
    float *patches;
    int *labels;
    char *model_json;
} VR;

static double vr_forward(Runner *r, int k, const BlockHook *hook) {
    VR *v = r->impl;
    if (k < 0 || k >= v->nbatches) FATAL("mechint: ViT batch %d of %d", k, v->nbatches);
    int start = k * v->B, count = v->data.nval - start < v->B ? v->data.nval - start : v->B;
    /* as the trainer's evaluate(): no augmentation */
    vit_batch(&v->data, &v->data.train, v->data.val_idx + start, count, v->model.cfg.P, 0, 0, v->patches, v->labels);
    v->model.hook = hook;
    double loss = vit_forward(&v->model, v->patches, v->labels, count, 0, 0);
    v->model.hook = NULL;
    r->dev_logits = v->model.acts.logits;
    r->rows = count;
    r->V = v->model.cfg.classes;
    memcpy(r->targets, v->labels, (size_t)count * sizeof(int));
    return loss;
}

static void vr_backward(Runner *r) {
    VR *v = r->impl;
    params_zero_grad(&v->model.w);
    v->model.external_dlogits = 1;
    vit_backward(&v->model, 1.0f);
    v->model.external_dlogits = 0;
}

static void vr_close(Runner *r) {
    VR *v = r->impl;
    vit_free(&v->model);
    vit_data_free(&v->data);
    free(v->patches), free(v->labels), free(v->model_json), free(r->targets);
    free(v);
}

int runner_open_vit(Runner *r, const char *ckpt, int batch_size, int max_batches, uint64_t seed, Err *e) {
    VR *v = xcalloc(1, sizeof *v);
    /* the trainer's split: CONFIG_VIT_VAL_IMAGES drawn with CONFIG_SEED (not the analysis seed) */
    if (vit_data_load(&v->data, CONFIG_DATA_DIR, CONFIG_VIT_VAL_IMAGES, CONFIG_SEED, e) != 0) {
        free(v);
        return -1;
    }
    const ImageSet *tr = &v->data.train;
    ViTConfig cfg = vit_config_from_kconfig(tr->h, tr->w, tr->c, tr->classes);
    ViTConfig as_trained = cfg;
    cfg.dropout = 0.0f; /* eval mode everywhere (the checkpoint's model text still says what it trained with) */
    vit_init(&v->model, &cfg, seed);
    v->model_json = vit_config_json(&as_trained);
    if (checkpoint_load_model(ckpt, "vit", attn_variant_id(ATTN_VARIANT, ATTN_POS), MECHINT_VARIANT_HINT,
                              v->model_json, "the checkpoint has another model shape or data set",
                              NULL, NULL, /* built from the checkpoint's own configuration: its data by construction */
                              &v->model.w, e) != 0) {
        vit_free(&v->model), vit_data_free(&v->data), free(v->model_json), free(v);
        return -1;
    }
    if (batch_size < 1) batch_size = 1;
    v->B = batch_size;
    int all = (v->data.nval + v->B - 1) / v->B;
    v->nbatches = max_batches > 0 && max_batches < all ? max_batches : all;
    size_t per = (size_t)cfg.N * cfg.P * cfg.P * cfg.img_c;
    v->patches = xmalloc((size_t)v->B * per * sizeof(float));
    v->labels = xmalloc((size_t)v->B * sizeof(int));
    r->impl = v;
    r->family = "vit";
    r->unit = "images";
    r->targets = xmalloc((size_t)v->B * sizeof(int));
    r->nbatches = v->nbatches;
    int used = v->nbatches * v->B < v->data.nval ? v->nbatches * v->B : v->data.nval;
    snprintf(r->data_desc, sizeof r->data_desc,
             "%s validation split (%d of the training images, seeded): %d batches of up to %d images (%d images)",
             v->data.name, v->data.nval, r->nbatches, v->B, used);
    /* learned position embeddings entering layer 0 (row 0: the CLS token's when there is one) */
    runner_setup(r, &v->model.w, vit_positions(&v->model), cfg.T, cfg.C, block_position_kind("learned"));
    int L = cfg.L;
    for (int l = 0; l < L; l++) runner_layer(r, l, "blocks", l, 0);
    r->src = (ModelSource){.params = r->host_params, .bp = v->model.layer, .L = L, .H = cfg.H, .C = cfg.C,
                           .variant = cfg.variant, .pos = cfg.pos, .pos_m = cfg.pos_m, .pos_groups = cfg.pos_groups,
                           .kv_heads = cfg.kv_heads,
                           .bias = 1, .attn_bias = cfg.attn_bias, .post_ln = 0, .causal = r->layer_causal,
                           .names = r->layer_names};
    r->pos_feat = v->model.pos_feat, r->pos_T = cfg.T, r->max_T = cfg.T;
    r->forward = vr_forward;
    r->backward = vr_backward;
    r->forward_tokens = NULL;
    r->vocab = 0, r->ctx = 0;
    r->grid_w = cfg.img_w / cfg.P, r->grid_h = cfg.img_h / cfg.P, r->cls = cfg.cls;
    r->close = vr_close;
    return 0;
}
