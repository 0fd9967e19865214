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

_Static_assert(IS_ENABLED(CONFIG_GPT2_GELU) + IS_ENABLED(CONFIG_GPT2_RELU) == 1,
               "the MLP activation is a Kconfig choice: exactly one of GELU and ReLU");

GPT2Config gpt2_config_from_kconfig(int vocab) {
    int padded = (vocab + CONFIG_GPT2_VOCAB_MULTIPLE - 1) / CONFIG_GPT2_VOCAB_MULTIPLE * CONFIG_GPT2_VOCAB_MULTIPLE;
    GPT2Config c = {
        .V = padded,
        .pad_tokens = padded - vocab,
        .T = CONFIG_GPT2_BLOCK_SIZE,
        .L = CONFIG_GPT2_N_LAYER,
        .H = CONFIG_GPT2_N_HEAD,
        .C = CONFIG_GPT2_N_EMBD,
        .bias = IS_ENABLED(CONFIG_GPT2_BIAS),
        .attn_bias = IS_ENABLED(CONFIG_GPT2_ATTN_BIAS),
        .tie = IS_ENABLED(CONFIG_GPT2_TIE_WEIGHTS),
        .head_bias = IS_ENABLED(CONFIG_GPT2_HEAD_BIAS),
        .gelu = IS_ENABLED(CONFIG_GPT2_GELU),
        .dropout = (float)KCONFIG_NUMBER(CONFIG_GPT2_DROPOUT, 0.0, 0.999),
        .variant = ATTN_VARIANT,
        .pos = ATTN_POS,
        .pos_m = ATTN_POS_DIM,
        .pos_groups = ATTN_POS ? (ATTN_POS_PER_HEAD ? CONFIG_GPT2_N_HEAD : 1) : 0,
        .kv_heads = attn_kv_heads(CONFIG_GPT2_N_HEAD),
    };
    if (c.C % c.H != 0)
        FATAL("CONFIG_GPT2_N_EMBD=%d is not a multiple of CONFIG_GPT2_N_HEAD=%d (hint: the head dim is channels / "
              "heads)", c.C, c.H);
    if (c.H % c.kv_heads != 0)
        FATAL("CONFIG_ATTN_KV_HEADS=%d does not divide CONFIG_GPT2_N_HEAD=%d (hint: 0 or a divisor of the heads)",
              c.kv_heads, c.H);
    return c;
}

char *gpt2_config_json(const GPT2Config *c) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "family", "gpt2");
    cJSON_AddNumberToObject(o, "vocab_size", c->V);
    if (c->pad_tokens) /* only then: a model description without padding reads as before */
        cJSON_AddNumberToObject(o, "vocab_padding", c->pad_tokens);
    cJSON_AddNumberToObject(o, "block_size", c->T);
    cJSON_AddNumberToObject(o, "n_layer", c->L);
    cJSON_AddNumberToObject(o, "n_head", c->H);
    cJSON_AddNumberToObject(o, "n_embd", c->C);
    cJSON_AddNumberToObject(o, "head_dim", c->C / c->H);
    cJSON_AddNumberToObject(o, "mlp_hidden", 4 * c->C);
    cJSON_AddStringToObject(o, "activation", c->gelu ? "gelu_tanh" : "relu");
    cJSON_AddBoolToObject(o, "bias", c->bias);
    cJSON_AddBoolToObject(o, "attn_bias", c->attn_bias);
    cJSON_AddBoolToObject(o, "tied_head", c->tie);
    cJSON_AddBoolToObject(o, "head_bias", c->head_bias);
    cJSON_AddNumberToObject(o, "dropout", json_float(c->dropout));
    cJSON_AddStringToObject(o, "ln_placement", "pre");
    cJSON *a = attention_json(c->variant, c->pos, c->pos_m, c->pos_groups, c->H, c->kv_heads);
    cJSON_AddTrueToObject(a, "causal");
    cJSON_AddItemToObject(o, "attention", a);
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return s;
}

/* K/V width: kv_heads * head_dim (C without grouped K/V heads). */
static int kv_dim(const GPT2Config *c) { return attn_kv_width(c->C, c->H, c->kv_heads); }

size_t gpt2_matmul_params(const GPT2Config *c) {
    size_t C = (size_t)c->C, W = (size_t)attn_proj_width(c->variant, c->C, kv_dim(c));
    return (size_t)c->L * (W * C + C * C + 8 * C * C) + (size_t)c->V * C;
}

double gpt2_flops_per_token(const GPT2Config *c, int T) {
    /* 6 per matmul parameter (2 forward, 4 backward) plus the attention
     * products: scores and values, 2*T*C each forward per layer, counted
     * over the full T x T square (the PaLM/nanoGPT convention). Grouped K/V
     * heads shrink the projection (fewer matmul parameters), not these
     * products: every query head still scores and mixes T keys. */
    return 6.0 * (double)gpt2_matmul_params(c) + 12.0 * c->L * (double)T * c->C;
}

/* ------------------------------------------------------------------ parameters */

static void build_table(GPT2 *m) {
    const GPT2Config *c = &m->cfg;
    ParamTable *t = &m->w.table;
    int C = c->C, kvC = kv_dim(c);
    char name[PARAM_NAME_MAX];
    m->wte = param_add(t, "wte.weight", 1, 2, c->V, C);
    if (ATTN_POSITION == ATTN_POSITION_ABSOLUTE) m->wpe = param_add(t, "wpe.weight", 1, 2, c->T, C);
    m->layer = xcalloc((size_t)c->L, sizeof(BlockParams));
    for (int l = 0; l < c->L; l++) {
        BlockParams *lp = &m->layer[l];
        lp->first = t->total;
#define NAME(fmt, ...) (snprintf(name, sizeof name, "blocks.%d." fmt, l, ##__VA_ARGS__), name)
        lp->ln1w = param_add(t, NAME("ln1.weight"), 0, 1, C);
        if (c->bias) lp->ln1b = param_add(t, NAME("ln1.bias"), 0, 1, C);
        block_attention_params(t, lp, NAME(""), c->variant, C, kvC, c->attn_bias);
        block_position_params(t, lp, NAME(""), c->pos, c->pos_m, c->pos_groups, c->H);
        lp->projw = param_add(t, NAME("attn.proj.weight"), 1, 2, C, C);
        if (c->bias) lp->projb = param_add(t, NAME("attn.proj.bias"), 0, 1, C);
        lp->ln2w = param_add(t, NAME("ln2.weight"), 0, 1, C);
        if (c->bias) lp->ln2b = param_add(t, NAME("ln2.bias"), 0, 1, C);
        lp->fcw = param_add(t, NAME("mlp.fc.weight"), 1, 2, 4 * C, C);
        if (c->bias) lp->fcb = param_add(t, NAME("mlp.fc.bias"), 0, 1, 4 * C);
        lp->fcpw = param_add(t, NAME("mlp.proj.weight"), 1, 2, C, 4 * C);
        if (c->bias) lp->fcpb = param_add(t, NAME("mlp.proj.bias"), 0, 1, C);
#undef NAME
    }
    m->lnfw = param_add(t, "lnf.weight", 0, 1, C);
    if (c->bias) m->lnfb = param_add(t, "lnf.bias", 0, 1, C);
    m->headw = c->tie ? m->wte : param_add(t, "lm_head.weight", 1, 2, c->V, C);
    if (!c->tie && c->head_bias) m->headb = param_add(t, "lm_head.bias", 0, 1, c->V);
}

size_t gpt2_num_params(const GPT2Config *c) {
    GPT2 m;
    memset(&m, 0, sizeof m);
    m.cfg = *c;
    build_table(&m);
    size_t n = m.w.table.count;
    free(m.layer);
    param_table_free(&m.w.table);
    return n;
}

/* GPT-2 init: N(0, 0.02), residual projections N(0, 0.02/sqrt(2L)), LayerNorm
 * weights 1, biases 0; +Pos as PyTorch's Linear(m, 1): U(-1/sqrt(m), 1/sqrt(m)). */
static void init_rule(const ParamSpec *s, float *p, Rng *rng, void *ctx) {
    const GPT2Config *c = ctx;
    if (strstr(s->name, ".rel_bias")) {
        return; /* relative-position bias starts at zero */
    } else if (strstr(s->name, ".pos.")) {
        double bound = 1.0 / sqrt((double)c->pos_m);
        for (size_t k = 0; k < s->numel; k++) p[k] = (float)((2.0 * rng_uniform(rng) - 1.0) * bound);
    } else if (strstr(s->name, "ln") && str_ends_with(s->name, ".weight")) {
        for (size_t k = 0; k < s->numel; k++) p[k] = 1.0f;
    } else if (str_ends_with(s->name, ".weight")) {
        int residual = str_ends_with(s->name, "attn.proj.weight") || str_ends_with(s->name, "mlp.proj.weight");
        double std = residual ? 0.02 / sqrt(2.0 * c->L) : 0.02;
        for (size_t k = 0; k < s->numel; k++) p[k] = (float)(std * rng_normal(rng));
    } /* biases stay 0 */
}

void gpt2_init(GPT2 *m, const GPT2Config *cfg, uint64_t seed) {
    memset(m, 0, sizeof *m);
    m->cfg = *cfg;
    build_table(m);
    params_alloc(&m->w);
    params_init(&m->w, seed, init_rule, &m->cfg);
    if (cfg->pos) m->pos_feat = attn_pos_features_dev(cfg->T, cfg->pos_m);
    if (ATTN_POSITION == ATTN_POSITION_SINUSOIDAL) m->pe = block_sinusoid_table_dev(cfg->T, cfg->C);
    m->rope = block_rope_table_dev(cfg->T, cfg->C / cfg->H);
}

const float *gpt2_positions(const GPT2 *m) {
    return ATTN_POSITION == ATTN_POSITION_ABSOLUTE ? m->w.params + m->wpe : m->pe;
}

void gpt2_free(GPT2 *m) {
    params_free(&m->w);
    dev_free(m->pos_feat), dev_free(m->pe), dev_free(m->rope);
    dev_free(m->act_memory);
    dev_free(m->inputs);
    dev_free(m->targets);
    free(m->acts.block);
    free(m->layer);
    memset(m, 0, sizeof *m);
}

/* ------------------------------------------------------------------ activations */

/* Shape of every block for a batch of B x T tokens. */
BlockShape gpt2_block_shape(const GPT2 *m, int B, int T, int training, uint64_t seed, int l) {
    const GPT2Config *c = &m->cfg;
    BlockShape s = {.B = B, .T = T, .C = c->C, .H = c->H, .kv_heads = c->kv_heads, .mlp = 4 * c->C, .causal = 1, .gelu = c->gelu,
                    .bias = c->bias, .attn_bias = c->attn_bias, .pos = c->pos, .pos_m = c->pos_m,
                    .pos_groups = c->pos_groups, .pos_feat = m->pos_feat, .rope = m->rope, .pos_T = c->T,
                    .dropout = training ? c->dropout : 0.0f, .seed = dropout_seed(seed, 0, 1 + (uint64_t)l), .hook = m->hook, .layer = l,
                    .attn_grads_only = m->w.attn_grads_only};
    return s;
}

/* The activation arrays for B x T tokens carved out of cv (nn/block.h): with cv->p NULL only counted. */
static void acts_layout(GPT2 *m, Carve *cv, int B, int T) {
    const GPT2Config *c = &m->cfg;
    size_t BT = (size_t)B * T, C = (size_t)c->C;
    BlockShape s = gpt2_block_shape(m, B, T, 0, 0, 0);
    GPT2Acts *a = &m->acts;
    a->encoded = carve(cv, BT * C * sizeof(act_t));
    for (int l = 0; l < c->L; l++) block_acts_carve(&a->block[l], cv, &s);
    block_scratch_carve(&a->scratch, cv, &s);
    a->lnf = carve(cv, BT * C * sizeof(act_t));
    a->lnf_mean = carve(cv, BT * sizeof(float));
    a->lnf_rstd = carve(cv, BT * sizeof(float));
    a->logits = carve(cv, BT * (size_t)c->V * sizeof(act_t));
    a->losses = carve(cv, BT * sizeof(float));
    a->ce_lse = carve(cv, BT * sizeof(float));
    a->dres = carve(cv, BT * C * sizeof(act_t));
    a->dlnf = carve(cv, BT * C * sizeof(act_t));
}

/* Activations for B x T tokens, every array laid out for the current B x T: a smaller batch than an earlier one
 * fits in its allocation. */
static void alloc_acts(GPT2 *m, int B, int T) {
    size_t BT = (size_t)B * T;
    if (!m->acts.block) m->acts.block = xcalloc((size_t)m->cfg.L, sizeof(BlockActs));
    Carve count = {NULL, 0};
    acts_layout(m, &count, B, T);
    if (!m->act_memory || count.bytes > m->act_capacity) {
        dev_free(m->act_memory);
        dev_free(m->inputs);
        dev_free(m->targets);
        m->act_memory = dev_alloc(count.bytes);
        m->act_capacity = count.bytes;
        m->inputs = dev_alloc(BT * sizeof(int));
        m->targets = dev_alloc(BT * sizeof(int));
    }
    Carve cv = {m->act_memory, 0};
    acts_layout(m, &cv, B, T);
}

/* ------------------------------------------------------------------ forward */

#define PARAM(off) (m->w.params + (off))
#define GRAD(off) (m->w.grads + (off))
#define GRAD_W(off) params_product_grad(&m->w, off) /* a product's weight or bias (nn/params.h) */
#define HEAD_BIAS(c) (!(c)->tie && (c)->head_bias)
#define SITE_EMB 0 /* dropout site of the embeddings; blocks use 1 + layer */

void gpt2_forward_pass(GPT2 *m, const int *inputs, const int *targets, int B, int T, int training,
                       uint64_t dropout_seed_base) {
    const GPT2Config *c = &m->cfg;
    if (T < 1 || T > c->T) FATAL("gpt2_forward: sequence length %d outside [1, %d]", T, c->T);
    if (B < 1) FATAL("gpt2_forward: batch size %d", B);
    alloc_acts(m, B, T);
    m->fwd_B = B;
    m->fwd_T = T;
    m->fwd_training = training;
    m->dropout_seed_base = dropout_seed_base;
    GPT2Acts *a = &m->acts;
    int C = c->C;
    size_t BT = (size_t)B * T, n = BT * C;
    dev_upload(m->inputs, inputs, BT * sizeof(int));

    embedding_forward(a->encoded, m->inputs, PARAM(m->wte), gpt2_positions(m), B, T, C, c->V, 1.0f);
    if (training && c->dropout > 0.0f)
        dropout_forward(a->encoded, a->encoded, n, c->dropout, dropout_seed(dropout_seed_base, 0, SITE_EMB));
    const act_t *x = a->encoded;
    for (int l = 0; l < c->L; l++) {
        BlockShape s = gpt2_block_shape(m, B, T, training, dropout_seed_base, l);
        block_forward(&a->block[l], x, m->w.params, &m->layer[l], &s, &a->scratch);
        x = a->block[l].out;
    }
    layernorm_forward(a->lnf, a->lnf_mean, a->lnf_rstd, x, PARAM(m->lnfw), c->bias ? PARAM(m->lnfb) : NULL, (int)BT,
                      C);
    linear_forward(a->logits, a->lnf, PARAM(m->headw), HEAD_BIAS(c) ? PARAM(m->headb) : NULL, (int)BT, C, c->V);
    m->counted = 0;
    if (!targets) return;
    dev_upload(m->targets, targets, BT * sizeof(int));
    crossentropy_forward(a->losses, a->ce_lse, a->logits, m->targets, (int)BT, c->V, -1, 0.0f);
    m->counted = targets_counted(targets, BT, -1);
}

void gpt2_loss_into(GPT2 *m, double *acc, double scale) {
    sum_into(acc, m->acts.losses, (size_t)m->fwd_B * m->fwd_T, scale);
}

double gpt2_loss(GPT2 *m) {
    return m->counted ? sum_of(m->acts.losses, (size_t)m->fwd_B * m->fwd_T) / m->counted : 0.0;
}

double gpt2_forward(GPT2 *m, const int *inputs, const int *targets, int B, int T, int training,
                    uint64_t dropout_seed_base) {
    gpt2_forward_pass(m, inputs, targets, B, T, training, dropout_seed_base);
    return targets ? gpt2_loss(m) : NAN;
}

int gpt2_correct(GPT2 *m) {
    return argmax_correct(m->acts.logits, m->targets, m->fwd_B * m->fwd_T, m->cfg.V, -1);
}

/* ------------------------------------------------------------------ backward */

void gpt2_backward(GPT2 *m, float loss_scale) {
    const GPT2Config *c = &m->cfg;
    if (!m->fwd_B || !m->counted) FATAL("gpt2_backward: no forward pass with targets to differentiate");
    GPT2Acts *a = &m->acts;
    int B = m->fwd_B, T = m->fwd_T, C = c->C;
    size_t BT = (size_t)B * T, n = BT * C;
    const act_t *last = a->block[c->L - 1].out;

    /* loss -> logits (in place) -> head -> final LayerNorm */
    if (!m->external_dlogits)
        crossentropy_backward(a->logits, a->logits, a->ce_lse, m->targets, (int)BT, c->V, -1, 0.0f,
                              loss_scale / (float)m->counted);
    dev_zero(a->dlnf, n * sizeof(act_t));
    linear_backward(a->dlnf, GRAD_W(m->headw), HEAD_BIAS(c) ? GRAD_W(m->headb) : NULL, a->logits, a->lnf,
                    PARAM(m->headw), (int)BT, C, c->V);
    dev_zero(a->dres, n * sizeof(act_t));
    layernorm_backward(a->dres, GRAD(m->lnfw), c->bias ? GRAD(m->lnfb) : NULL, a->dlnf, last, PARAM(m->lnfw),
                       a->lnf_mean, a->lnf_rstd, (int)BT, C);
    for (int l = c->L - 1; l >= 0; l--) {
        BlockShape s = gpt2_block_shape(m, B, T, m->fwd_training, m->dropout_seed_base, l);
        const act_t *x = l == 0 ? a->encoded : a->block[l - 1].out;
        block_backward(a->dres, m->w.grads, &a->block[l], x, m->w.params, &m->layer[l], &s, &a->scratch);
        params_grads_final_from(&m->w, m->layer[l].first); /* a tied head adds to wte, below every block */
    }
    const act_t *demb = a->dres;
    if (m->fwd_training && c->dropout > 0.0f) {
        dev_zero(a->dlnf, n * sizeof(act_t));
        dropout_backward(a->dlnf, a->dres, n, c->dropout, dropout_seed(m->dropout_seed_base, 0, SITE_EMB));
        demb = a->dlnf;
    }
    embedding_backward(GRAD(m->wte), ATTN_POSITION == ATTN_POSITION_ABSOLUTE ? GRAD(m->wpe) : NULL, demb, m->inputs,
                       B, T, C, c->V, 1.0f);
}

