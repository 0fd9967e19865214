/* mechint runner for GPT-2 checkpoints: the model of gpt2/model.c on the
 * validation windows of its own data set (gpt2/data.c). */
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "gpt2/data.h"
#include "gpt2/model.h"
#include "kernels.h"
#include "runner.h"

typedef struct {
    GPT2 model;
    Dataset data;
    int B, T, max_batches;
    int *x, *y;
    char *model_json;
} G2;

static double g2_run(Runner *r, const int *x, const int *y, int B, int T, const BlockHook *hook) {
    G2 *g = r->impl;
    g->model.hook = hook;
    double loss = gpt2_forward(&g->model, x, y, B, T, 0, 0);
    g->model.hook = NULL;
    r->dev_logits = g->model.acts.logits;
    r->rows = B * T;
    r->V = g->model.cfg.V;
    if (y) memcpy(r->targets, y, (size_t)B * T * sizeof(int));
    return loss;
}

static double g2_forward(Runner *r, int k, const BlockHook *hook) {
    G2 *g = r->impl;
    Err e;
    if (dataset_val_batch(&g->data, k, g->B, g->max_batches, g->x, g->y, &e) != 0) FATAL("%s", e.msg);
    return g2_run(r, g->x, g->y, g->B, g->T, hook);
}

static double g2_forward_tokens(Runner *r, const int *x, const int *y, int B, int T, const BlockHook *hook) {
    G2 *g = r->impl;
    if (B > g->B || T > g->T) FATAL("mechint: token batch %dx%d larger than %dx%d", B, T, g->B, g->T);
    return g2_run(r, x, y, B, T, hook);
}

static void g2_backward(Runner *r) {
    G2 *g = r->impl;
    params_zero_grad(&g->model.w);
    g->model.external_dlogits = 1;
    gpt2_backward(&g->model, 1.0f);
    g->model.external_dlogits = 0;
}

static void g2_close(Runner *r) {
    G2 *g = r->impl;
    gpt2_free(&g->model);
    dataset_free(&g->data);
    free(g->x), free(g->y), free(g->model_json), free(r->targets);
    free(g);
}

int runner_open_gpt2(Runner *r, const char *ckpt, int batch_size, int max_batches, uint64_t seed, Err *e) {
    G2 *g = xcalloc(1, sizeof *g);
    g->T = CONFIG_GPT2_BLOCK_SIZE;
    if (dataset_load(&g->data, CONFIG_DATA_DIR, g->T, e) != 0) {
        free(g);
        return -1;
    }
    GPT2Config cfg = gpt2_config_from_kconfig(g->data.V);
    cfg.dropout = 0.0f; /* eval mode everywhere (the checkpoint's model text still says what it trained with) */
    GPT2Config as_trained = gpt2_config_from_kconfig(g->data.V);
    gpt2_init(&g->model, &cfg, seed);
    g->model_json = gpt2_config_json(&as_trained);
    if (checkpoint_load_model(ckpt, "gpt2", attn_variant_id(ATTN_VARIANT, ATTN_POS), MECHINT_VARIANT_HINT,
                              g->model_json, "the checkpoint has another model shape or vocabulary",
                              NULL, NULL, /* built from the checkpoint's own configuration: its data by construction */
                              &g->model.w, e) != 0) {
        gpt2_free(&g->model), dataset_free(&g->data), free(g->model_json), free(g);
        return -1;
    }
    g->B = batch_size;
    g->max_batches = max_batches;
    g->x = xmalloc((size_t)g->B * g->T * sizeof(int));
    g->y = xmalloc((size_t)g->B * g->T * sizeof(int));
    r->impl = g;
    r->family = "gpt2";
    r->unit = "tokens";
    r->targets = xmalloc((size_t)g->B * g->T * sizeof(int));
    r->nbatches = dataset_val_batches(&g->data, g->B, max_batches);
    snprintf(r->data_desc, sizeof r->data_desc, "%s validation split: %d batches of %d windows of %d tokens",
             g->data.name, r->nbatches, g->B, g->T);
    /* the learned absolute positions entering layer 0 */
    runner_setup(r, &g->model.w, gpt2_positions(&g->model), cfg.T, cfg.C, block_position_kind("learned"));
    int L = cfg.L;
    for (int l = 0; l < L; l++) runner_layer(r, l, "h", l, 1);
    r->src = (ModelSource){.params = r->host_params, .bp = g->model.layer, .L = L, .H = cfg.H, .C = cfg.C,
                           .variant = cfg.variant, .pos = cfg.pos, .pos_m = cfg.pos_m, .pos_groups = cfg.pos_groups,
                           .kv_heads = cfg.kv_heads,
                           .bias = cfg.bias, .attn_bias = cfg.attn_bias, .post_ln = 0, .causal = r->layer_causal,
                           .names = r->layer_names};
    r->pos_feat = g->model.pos_feat, r->pos_T = cfg.T, r->max_T = cfg.T;
    r->forward = g2_forward;
    r->backward = g2_backward;
    r->forward_tokens = g2_forward_tokens;
    r->vocab = gpt2_data_vocab(&cfg), r->ctx = cfg.T;
    r->close = g2_close;
    return 0;
}
