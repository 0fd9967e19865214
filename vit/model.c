#include "model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "buildinfo.h"
#include "common.h"
#include "kernels.h"
#include "rng.h"

/* ------------------------------------------------------------------ configuration */

_Static_assert(IS_ENABLED(CONFIG_VIT_POOL_CLS) + IS_ENABLED(CONFIG_VIT_POOL_MEAN) == 1,
               "the ViT pooling is a Kconfig choice: exactly one of CLS and mean");

ViTConfig vit_config_from_kconfig(int h, int w, int c, int classes) {
    int P = CONFIG_VIT_PATCH;
    if (h % P || w % P)
        FATAL("CONFIG_VIT_PATCH=%d does not divide the %dx%d images (hint: 7 or 4 for 28x28, 8 or 4 for 32x32)", P, h,
              w);
    ViTConfig v = {
        .img_h = h,
        .img_w = w,
        .img_c = c,
        .classes = classes,
        .P = P,
        .N = (h / P) * (w / P),
        .C = CONFIG_VIT_DIM,
        .L = CONFIG_VIT_LAYERS,
        .H = CONFIG_VIT_HEADS,
        .mlp = CONFIG_VIT_MLP,
        .cls = IS_ENABLED(CONFIG_VIT_POOL_CLS),
        .head_mlp = IS_ENABLED(CONFIG_VIT_HEAD_MLP),
        .final_ln = IS_ENABLED(CONFIG_VIT_FINAL_LN),
        .attn_bias = IS_ENABLED(CONFIG_VIT_ATTN_BIAS),
        .dropout = (float)KCONFIG_NUMBER(CONFIG_VIT_DROPOUT, 0.0, 0.999),
        .variant = ATTN_VARIANT,
        .pos = ATTN_POS,
        .pos_m = ATTN_POS_DIM,
        .pos_groups = ATTN_POS ? (ATTN_POS_PER_HEAD ? CONFIG_VIT_HEADS : 1) : 0,
        .kv_heads = attn_kv_heads(CONFIG_VIT_HEADS),
    };
    v.T = v.N + v.cls;
    if (v.C % v.H != 0)
        FATAL("CONFIG_VIT_DIM=%d is not a multiple of CONFIG_VIT_HEADS=%d (hint: the head dim is channels / heads)",
              v.C, v.H);
    if (v.H % v.kv_heads != 0)
        FATAL("CONFIG_ATTN_KV_HEADS=%d does not divide CONFIG_VIT_HEADS=%d (hint: 0 or a divisor of the heads)",
              v.kv_heads, v.H);
    return v;
}

char *vit_config_json(const ViTConfig *c) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "family", "vit");
    const int image[3] = {c->img_h, c->img_w, c->img_c};
    cJSON_AddItemToObject(o, "image", cJSON_CreateIntArray(image, 3));
    cJSON_AddNumberToObject(o, "classes", c->classes);
    cJSON_AddNumberToObject(o, "patch", c->P);
    cJSON_AddNumberToObject(o, "patches", c->N);
    cJSON_AddNumberToObject(o, "tokens", c->T);
    cJSON_AddNumberToObject(o, "n_layer", c->L);
    cJSON_AddNumberToObject(o, "n_head", c->H);
    cJSON_AddNumberToObject(o, "n_embd", c->C);
    cJSON_AddNumberToObject(o, "head_dim", c->C / c->H);
    cJSON_AddNumberToObject(o, "mlp_hidden", c->mlp);
    cJSON_AddStringToObject(o, "activation", "gelu_tanh");
    cJSON_AddStringToObject(o, "pooling", c->cls ? "cls" : "mean");
    cJSON_AddStringToObject(o, "head", c->head_mlp ? "linear-gelu-linear" : "linear");
    cJSON_AddBoolToObject(o, "final_ln", c->final_ln);
    cJSON_AddBoolToObject(o, "attn_bias", c->attn_bias);
    cJSON_AddNumberToObject(o, "dropout", json_float(c->dropout));
    cJSON_AddStringToObject(o, "ln_placement", "pre");
    cJSON *a = attention_json(c->variant, c->pos, c->pos_m, c->pos_groups, c->H, c->kv_heads);
    cJSON_AddFalseToObject(a, "causal");
    cJSON_AddItemToObject(o, "attention", a);
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return s;
}

/* K/V width: kv_heads * head_dim (C without grouped K/V heads). */
static int kv_dim(const ViTConfig *c) { return attn_kv_width(c->C, c->H, c->kv_heads); }

size_t vit_matmul_params(const ViTConfig *c) {
    size_t C = (size_t)c->C, W = (size_t)attn_proj_width(c->variant, c->C, kv_dim(c)),
           pd = (size_t)c->P * c->P * c->img_c;
    size_t head = c->head_mlp ? C * c->mlp + (size_t)c->mlp * c->classes : C * c->classes;
    return pd * C + (size_t)c->L * (W * C + C * C + 2 * C * c->mlp) + head;
}

double vit_flops_per_image(const ViTConfig *c) {
    size_t C = (size_t)c->C, W = (size_t)attn_proj_width(c->variant, c->C, kv_dim(c)),
           pd = (size_t)c->P * c->P * c->img_c;
    double blocks = (double)c->L * (W * C + C * C + 2 * C * c->mlp); /* per token */
    double patch = (double)pd * C;                                       /* per patch */
    double head = (double)vit_matmul_params(c) - blocks - patch;          /* per image */
    return (6.0 * blocks + 12.0 * c->L * c->T * (double)C) * c->T + 6.0 * patch * c->N + 6.0 * head;
}

/* ------------------------------------------------------------------ parameters */

static void build_table(ViT *m) {
    const ViTConfig *c = &m->cfg;
    ParamTable *t = &m->w.table;
    int C = c->C, pd = c->P * c->P * c->img_c, kvC = kv_dim(c);
    char name[PARAM_NAME_MAX];
    m->patchw = param_add(t, "patch.weight", 1, 2, C, pd);
    m->patchb = param_add(t, "patch.bias", 0, 1, C);
    if (c->cls) m->clstok = param_add(t, "cls", 0, 1, C);
    if (ATTN_POSITION == ATTN_POSITION_ABSOLUTE) m->posemb = param_add(t, "pos_emb", 0, 2, c->T, C);
    m->layer = xcalloc((size_t)c->L, sizeof(BlockParams));
    for (int l = 0; l < c->L; l++) {
        BlockParams *lp = &m->layer[l];
        lp->first = t->total;
#define NAME(fmt, ...) (snprintf(name, sizeof name, "blocks.%d." fmt, l, ##__VA_ARGS__), name)
        lp->ln1w = param_add(t, NAME("ln1.weight"), 0, 1, C);
        lp->ln1b = param_add(t, NAME("ln1.bias"), 0, 1, C);
        block_attention_params(t, lp, NAME(""), c->variant, C, kvC, c->attn_bias);
        block_position_params(t, lp, NAME(""), c->pos, c->pos_m, c->pos_groups, c->H);
        lp->projw = param_add(t, NAME("attn.proj.weight"), 1, 2, C, C);
        lp->projb = param_add(t, NAME("attn.proj.bias"), 0, 1, C);
        lp->ln2w = param_add(t, NAME("ln2.weight"), 0, 1, C);
        lp->ln2b = param_add(t, NAME("ln2.bias"), 0, 1, C);
        lp->fcw = param_add(t, NAME("mlp.fc.weight"), 1, 2, c->mlp, C);
        lp->fcb = param_add(t, NAME("mlp.fc.bias"), 0, 1, c->mlp);
        lp->fcpw = param_add(t, NAME("mlp.proj.weight"), 1, 2, C, c->mlp);
        lp->fcpb = param_add(t, NAME("mlp.proj.bias"), 0, 1, C);
#undef NAME
    }
    if (c->final_ln) {
        m->lnfw = param_add(t, "lnf.weight", 0, 1, C);
        m->lnfb = param_add(t, "lnf.bias", 0, 1, C);
    }
    if (c->head_mlp) {
        m->headfcw = param_add(t, "head.fc.weight", 1, 2, c->mlp, C);
        m->headfcb = param_add(t, "head.fc.bias", 0, 1, c->mlp);
        m->headw = param_add(t, "head.out.weight", 1, 2, c->classes, c->mlp);
    } else {
        m->headw = param_add(t, "head.out.weight", 1, 2, c->classes, C);
    }
    m->headb = param_add(t, "head.out.bias", 0, 1, c->classes);
}

size_t vit_num_params(const ViTConfig *c) {
    ViT m;
    memset(&m, 0, sizeof m);
    m.cfg = *c;
    build_table(&m);
    size_t n = m.w.table.count;
    free(m.layer);
    param_table_free(&m.w.table);
    return n;
}

/* PyTorch's defaults, as the reference ViT: Linear weights and biases
 * U(-1/sqrt(in), 1/sqrt(in)); CLS token and position embedding N(0, 1);
 * LayerNorm 1 and 0; +Pos U(-1/sqrt(m), 1/sqrt(m)). */
static void init_rule(const ParamSpec *s, float *p, Rng *rng, void *ctx) {
    const ViT *m = ctx;
    if (strstr(s->name, ".rel_bias")) {
        return; /* relative-position bias starts at zero */
    } else if (!strcmp(s->name, "cls") || !strcmp(s->name, "pos_emb")) {
        for (size_t k = 0; k < s->numel; k++) p[k] = (float)rng_normal(rng);
    } else if (strstr(s->name, "ln") && str_ends_with(s->name, ".weight")) {
        for (size_t k = 0; k < s->numel; k++) p[k] = 1.0f;
    } else if (strstr(s->name, "ln") && str_ends_with(s->name, ".bias")) {
        return;
    } else {
        /* fan-in: the weight's second dim; a bias shares its weight's (the tensor before it); +Pos: m */
        const ParamSpec *w = str_ends_with(s->name, ".bias") ? s - 1 : s;
        int fan_in = strstr(s->name, ".pos.") ? m->cfg.pos_m : (int)w->shape[w->ndim - 1];
        if (strstr(s->name, "attn.") && str_ends_with(s->name, ".bias") && !strstr(s->name, "proj"))
            fan_in = m->cfg.C; /* fused projection biases follow their own weights */
        double bound = 1.0 / sqrt((double)fan_in);
        for (size_t k = 0; k < s->numel; k++) p[k] = (float)((2.0 * rng_uniform(rng) - 1.0) * bound);
    }
}

void vit_init(ViT *m, const ViTConfig *cfg, uint64_t seed) {
    memset(m, 0, sizeof *m);
    m->cfg = *cfg;
    build_table(m);
    params_alloc(&m->w);
    params_init(&m->w, seed, init_rule, m);
    if (cfg->pos) m->pos_feat = attn_pos_features_dev(cfg->T, cfg->pos_m);
    if (ATTN_POSITION == ATTN_POSITION_SINUSOIDAL) m->pe = block_sinusoid_table_dev(cfg->T, cfg->C);
    m->rope = block_rope_table_dev(cfg->T, cfg->C / cfg->H);
}

const float *vit_positions(const ViT *m) {
    return ATTN_POSITION == ATTN_POSITION_ABSOLUTE ? m->w.params + m->posemb : m->pe;
}

void vit_free(ViT *m) {
    params_free(&m->w);
    dev_free(m->pos_feat), dev_free(m->pe), dev_free(m->rope), dev_free(m->act_memory), dev_free(m->targets);
    free(m->acts.block);
    free(m->layer);
    memset(m, 0, sizeof *m);
}

/* ------------------------------------------------------------------ activations */

static BlockShape block_shape(const ViT *m, int B, int training, uint64_t seed, int l) {
    const ViTConfig *c = &m->cfg;
    BlockShape s = {.B = B, .T = c->T, .C = c->C, .H = c->H, .kv_heads = c->kv_heads, .mlp = c->mlp, .causal = 0, .gelu = 1, .bias = 1,
                    .attn_bias = c->attn_bias, .pos = c->pos, .pos_m = c->pos_m, .pos_groups = c->pos_groups,
                    .pos_feat = m->pos_feat, .rope = m->rope, .pos_T = c->T, .dropout = training ? c->dropout : 0.0f,
                    .seed = dropout_seed(seed, 0, 1 + (uint64_t)l), .hook = m->hook, .layer = l,
                    .attn_grads_only = m->w.attn_grads_only};
    return s;
}

/* The activation arrays for a batch of B images carved out of cv (nn/block.h): with cv->p NULL only counted. */
static void acts_layout(ViT *m, Carve *cv, int B) {
    const ViTConfig *c = &m->cfg;
    size_t BT = (size_t)B * c->T, BN = (size_t)B * c->N, C = (size_t)c->C, pd = (size_t)c->P * c->P * c->img_c;
    size_t A = sizeof(act_t), Bm = (size_t)B * c->mlp;
    BlockShape s = block_shape(m, B, 0, 0, 0);
    ViTActs *a = &m->acts;
    a->patches = carve(cv, BN * pd * A);
    a->pemb = carve(cv, BN * C * A);
    a->dpemb = carve(cv, BN * C * A);
    a->encoded = carve(cv, BT * C * A);
    for (int l = 0; l < c->L; l++) block_acts_carve(&a->block[l], cv, &s);
    block_scratch_carve(&a->scratch, cv, &s);
    a->lnf = carve(cv, BT * C * A);
    a->lnf_mean = carve(cv, BT * sizeof(float));
    a->lnf_rstd = carve(cv, BT * sizeof(float));
    a->dres = carve(cv, BT * C * A);
    a->dtmp = carve(cv, BT * C * A);
    a->pooled = carve(cv, (size_t)B * C * A);
    a->dpooled = carve(cv, (size_t)B * C * A);
    a->hfc = carve(cv, Bm * A);
    a->hact = carve(cv, Bm * A);
    a->dhfc = carve(cv, Bm * A);
    a->logits = carve(cv, (size_t)B * c->classes * A);
    a->losses = carve(cv, (size_t)B * sizeof(float));
    a->ce_lse = carve(cv, (size_t)B * sizeof(float));
}

static void layout_acts(ViT *m, int B) {
    if (!m->acts.block) m->acts.block = xcalloc((size_t)m->cfg.L, sizeof(BlockActs));
    Carve count = {NULL, 0};
    acts_layout(m, &count, B);
    if (!m->act_memory || count.bytes > m->act_capacity) {
        dev_free(m->act_memory);
        dev_free(m->targets);
        m->act_memory = dev_alloc(count.bytes);
        m->act_capacity = count.bytes;
        m->targets = dev_alloc((size_t)B * sizeof(int));
    }
    Carve cv = {m->act_memory, 0};
    acts_layout(m, &cv, B);
}

/* ------------------------------------------------------------------ forward */

#define PARAM(off) (m->w.params + (off))
#define GRAD(off) (m->w.grads + (off))
#define GRAD_W(off) params_product_grad(&m->w, off) /* a product's weight or bias (nn/params.h) */
#define SITE_EMB 0

/* the output of the encoder the pooling reads */
static const act_t *encoder_out(const ViT *m) {
    return m->cfg.final_ln ? m->acts.lnf : m->acts.block[m->cfg.L - 1].out;
}

void vit_forward_pass(ViT *m, const float *patches, const int *labels, int B, int training, uint64_t dropout_seed_base) {
    const ViTConfig *c = &m->cfg;
    if (B < 1) FATAL("vit_forward: batch size %d", B);
    layout_acts(m, B);
    m->fwd_B = B;
    m->fwd_training = training;
    m->dropout_seed_base = dropout_seed_base;
    ViTActs *a = &m->acts;
    int C = c->C, pd = c->P * c->P * c->img_c;
    size_t BT = (size_t)B * c->T;
    act_upload(a->patches, patches, (size_t)B * c->N * pd);

    linear_forward(a->pemb, a->patches, PARAM(m->patchw), PARAM(m->patchb), B * c->N, pd, C);
    tokens_embed_forward(a->encoded, a->pemb, c->cls ? PARAM(m->clstok) : NULL, vit_positions(m), B, c->T, C);
    if (training && c->dropout > 0.0f)
        dropout_forward(a->encoded, a->encoded, BT * C, c->dropout, dropout_seed(dropout_seed_base, 0, SITE_EMB));
    const act_t *x = a->encoded;
    for (int l = 0; l < c->L; l++) {
        BlockShape s = block_shape(m, B, training, dropout_seed_base, l);
        block_forward(&a->block[l], x, m->w.params, &m->layer[l], &s, &a->scratch);
        x = a->block[l].out;
    }
    if (c->final_ln)
        layernorm_forward(a->lnf, a->lnf_mean, a->lnf_rstd, x, PARAM(m->lnfw), PARAM(m->lnfb), (int)BT, C);
    pool_tokens_forward(a->pooled, encoder_out(m), B, c->T, C, 0, c->cls ? 1 : c->N);
    if (c->head_mlp) {
        linear_gelu_forward(a->hfc, a->hact, a->pooled, PARAM(m->headfcw), PARAM(m->headfcb), B, C, c->mlp);
        linear_forward(a->logits, a->hact, PARAM(m->headw), PARAM(m->headb), B, c->mlp, c->classes);
    } else {
        linear_forward(a->logits, a->pooled, PARAM(m->headw), PARAM(m->headb), B, C, c->classes);
    }
    m->counted = 0;
    if (!labels) return;
    dev_upload(m->targets, labels, (size_t)B * sizeof(int));
    crossentropy_forward(a->losses, a->ce_lse, a->logits, m->targets, B, c->classes, -1, 0.0f);
    m->counted = targets_counted(labels, (size_t)B, -1);
}

void vit_loss_into(ViT *m, double *acc, double scale) { sum_into(acc, m->acts.losses, (size_t)m->fwd_B, scale); }

double vit_loss(ViT *m) { return m->counted ? sum_of(m->acts.losses, (size_t)m->fwd_B) / m->counted : 0.0; }

double vit_forward(ViT *m, const float *patches, const int *labels, int B, int training, uint64_t dropout_seed_base) {
    vit_forward_pass(m, patches, labels, B, training, dropout_seed_base);
    return labels ? vit_loss(m) : NAN;
}

void vit_correct_into(ViT *m, double *acc) {
    if (m->counted) argmax_correct_into(acc, m->acts.logits, m->targets, m->fwd_B, m->cfg.classes, -1);
}

int vit_correct(ViT *m, int *pred) {
    const ViTConfig *c = &m->cfg;
    int B = m->fwd_B, correct = 0;
    float *logits = xmalloc((size_t)B * c->classes * sizeof(float));
    int *labels = xmalloc((size_t)B * sizeof(int));
    act_download(logits, m->acts.logits, (size_t)B * c->classes);
    dev_download(labels, m->targets, (size_t)B * sizeof(int));
    for (int b = 0; b < B; b++) {
        int best = 0;
        for (int k = 1; k < c->classes; k++)
            if (logits[(size_t)b * c->classes + k] > logits[(size_t)b * c->classes + best]) best = k;
        if (pred) pred[b] = best;
        correct += m->counted && best == labels[b];
    }
    free(logits);
    free(labels);
    return correct;
}

/* ------------------------------------------------------------------ backward */

void vit_backward(ViT *m, float loss_scale) {
    const ViTConfig *c = &m->cfg;
    if (!m->fwd_B || !m->counted) FATAL("vit_backward: no forward pass with labels to differentiate");
    ViTActs *a = &m->acts;
    int B = m->fwd_B, C = c->C, pd = c->P * c->P * c->img_c;
    size_t BT = (size_t)B * c->T;

    if (!m->external_dlogits)
        crossentropy_backward(a->logits, a->logits, a->ce_lse, m->targets, B, c->classes, -1, 0.0f,
                              loss_scale / (float)m->counted);
    dev_zero(a->dpooled, (size_t)B * C * sizeof(act_t));
    if (c->head_mlp) {
        gelu_linear_backward(a->dhfc, GRAD_W(m->headw), GRAD_W(m->headb), a->logits, a->hact, a->hfc, PARAM(m->headw),
                             B, c->mlp, c->classes);
        linear_backward(a->dpooled, GRAD_W(m->headfcw), GRAD_W(m->headfcb), a->dhfc, a->pooled, PARAM(m->headfcw), B, C,
                        c->mlp);
    } else {
        linear_backward(a->dpooled, GRAD_W(m->headw), GRAD_W(m->headb), a->logits, a->pooled, PARAM(m->headw), B, C,
                        c->classes);
    }
    /* pooling -> encoder output (through the final LayerNorm when there is one) */
    act_t *denc = c->final_ln ? a->dtmp : a->dres;
    dev_zero(denc, BT * C * sizeof(act_t));
    pool_tokens_backward(denc, a->dpooled, B, c->T, C, 0, c->cls ? 1 : c->N);
    const act_t *last = a->block[c->L - 1].out;
    if (c->final_ln) {
        dev_zero(a->dres, BT * C * sizeof(act_t));
        layernorm_backward(a->dres, GRAD(m->lnfw), GRAD(m->lnfb), a->dtmp, last, PARAM(m->lnfw), a->lnf_mean,
                           a->lnf_rstd, (int)BT, C);
    }
    for (int l = c->L - 1; l >= 0; l--) {
        BlockShape s = block_shape(m, B, m->fwd_training, m->dropout_seed_base, l);
        const act_t *x = l == 0 ? a->encoded : a->block[l - 1].out;
        block_backward(a->dres, m->w.grads, &a->block[l], x, m->w.params, &m->layer[l], &s, &a->scratch);
        params_grads_final_from(&m->w, m->layer[l].first);
    }
    const act_t *demb = a->dres;
    if (m->fwd_training && c->dropout > 0.0f) {
        dev_zero(a->dtmp, BT * C * sizeof(act_t));
        dropout_backward(a->dtmp, a->dres, BT * C, c->dropout, dropout_seed(m->dropout_seed_base, 0, SITE_EMB));
        demb = a->dtmp;
    }
    dev_zero(a->dpemb, (size_t)B * c->N * C * sizeof(act_t));
    tokens_embed_backward(a->dpemb, c->cls ? GRAD(m->clstok) : NULL,
                          ATTN_POSITION == ATTN_POSITION_ABSOLUTE ? GRAD(m->posemb) : NULL, demb, B, c->T, C);
    /* the patches are data: no input gradient */
    linear_backward(NULL, GRAD_W(m->patchw), GRAD_W(m->patchb), a->dpemb, a->patches, PARAM(m->patchw), B * c->N, pd,
                    C);
}

