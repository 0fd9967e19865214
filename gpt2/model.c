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
    GPT2Config c = {
        .V = vocab,
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
    };
    if (c.C % c.H != 0)
        FATAL("CONFIG_GPT2_N_EMBD=%d is not a multiple of CONFIG_GPT2_N_HEAD=%d (hint: the head dim is channels / "
              "heads)", c.C, c.H);
    return c;
}

char *gpt2_config_json(const GPT2Config *c) {
    char *s = xmalloc(1024);
    snprintf(s, 1024,
             "{\"family\":\"gpt2\",\"vocab_size\":%d,\"block_size\":%d,\"n_layer\":%d,\"n_head\":%d,\"n_embd\":%d,"
             "\"head_dim\":%d,\"mlp_hidden\":%d,\"activation\":\"%s\",\"bias\":%s,\"attn_bias\":%s,"
             "\"tied_head\":%s,\"head_bias\":%s,\"dropout\":%g,\"ln_placement\":\"pre\",\"attention\":{"
             "\"variant\":\"%s\",\"label\":\"%s\",\"projections\":%d,\"pos\":%s,\"pos_dim\":%d,"
             "\"pos_groups\":%d,\"scale\":\"1/sqrt(head_dim)\",\"causal\":true}}",
             c->V, c->T, c->L, c->H, c->C, c->C / c->H, 4 * c->C, c->gelu ? "gelu_tanh" : "relu",
             c->bias ? "true" : "false", c->attn_bias ? "true" : "false", c->tie ? "true" : "false",
             c->head_bias ? "true" : "false", (double)c->dropout, attn_variant_id(c->variant, c->pos),
             attn_variant_label(c->variant, c->pos), attn_num_proj(c->variant), c->pos ? "true" : "false", c->pos_m,
             c->pos_groups);
    return s;
}

size_t gpt2_matmul_params(const GPT2Config *c) {
    size_t C = (size_t)c->C, P = (size_t)attn_num_proj(c->variant);
    return (size_t)c->L * (P * C * C + C * C + 8 * C * C) + (size_t)c->V * C;
}

double gpt2_flops_per_token(const GPT2Config *c, int T) {
    /* 6 per matmul parameter (2 forward, 4 backward) plus the attention
     * products: scores and values, 2*T*C each forward per layer, counted
     * over the full T x T square (the PaLM/nanoGPT convention). */
    return 6.0 * (double)gpt2_matmul_params(c) + 12.0 * c->L * (double)T * c->C;
}

/* ------------------------------------------------------------------ parameters */

static void build_table(GPT2 *m) {
    const GPT2Config *c = &m->cfg;
    ParamTable *t = &m->table;
    int C = c->C, P = attn_num_proj(c->variant);
    char name[PARAM_NAME_MAX];
    m->wte = param_add(t, "wte.weight", 1, 2, c->V, C);
    m->wpe = param_add(t, "wpe.weight", 1, 2, c->T, C);
    m->layer = xcalloc((size_t)c->L, sizeof(GPT2LayerParams));
    for (int l = 0; l < c->L; l++) {
        GPT2LayerParams *lp = &m->layer[l];
#define NAME(fmt, ...) (snprintf(name, sizeof name, "blocks.%d." fmt, l, ##__VA_ARGS__), name)
        lp->ln1w = param_add(t, NAME("ln1.weight"), 0, 1, C);
        if (c->bias) lp->ln1b = param_add(t, NAME("ln1.bias"), 0, 1, C);
        /* the P projection matrices back to back form the fused (P*C, C) weight */
        for (int p = 0; p < P; p++) {
            size_t off = param_add(t, NAME("attn.%s.weight", attn_block_name(c->variant, p)), 1, 2, C, C);
            if (p == 0) lp->attnw = off;
        }
        if (c->attn_bias)
            for (int p = 0; p < P; p++) {
                size_t off = param_add(t, NAME("attn.%s.bias", attn_block_name(c->variant, p)), 0, 1, C);
                if (p == 0) lp->attnb = off;
            }
        if (c->pos) {
            lp->posw = c->pos_groups == 1 ? param_add(t, NAME("attn.pos.w"), 0, 1, c->pos_m)
                                          : param_add(t, NAME("attn.pos.w"), 0, 2, c->pos_groups, c->pos_m);
            lp->posb = param_add(t, NAME("attn.pos.b"), 0, 1, c->pos_groups);
        }
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
    size_t n = m.table.total;
    free(m.layer);
    param_table_free(&m.table);
    return n;
}

static int is_suffix(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && strcmp(s + n - k, suffix) == 0;
}

static void init_params(GPT2 *m, uint64_t seed) {
    const GPT2Config *c = &m->cfg;
    float *host = xcalloc(m->table.total, sizeof(float));
    Rng rng = rng_seeded(seed, 1);
    double resid_std = 0.02 / sqrt(2.0 * c->L);
    double pos_bound = c->pos ? 1.0 / sqrt((double)c->pos_m) : 0.0;
    for (int i = 0; i < m->table.n; i++) {
        const ParamSpec *s = &m->table.specs[i];
        float *p = host + s->offset;
        if (strstr(s->name, ".pos.")) { /* PyTorch Linear(m, 1) default: U(-1/sqrt(m), 1/sqrt(m)) */
            for (size_t k = 0; k < s->numel; k++) p[k] = (float)((2.0 * rng_uniform(&rng) - 1.0) * pos_bound);
        } else if (strstr(s->name, "ln") && is_suffix(s->name, ".weight")) {
            for (size_t k = 0; k < s->numel; k++) p[k] = 1.0f;
        } else if (is_suffix(s->name, ".weight")) {
            int residual = is_suffix(s->name, "attn.proj.weight") || is_suffix(s->name, "mlp.proj.weight");
            double std = residual ? resid_std : 0.02;
            for (size_t k = 0; k < s->numel; k++) p[k] = (float)(std * rng_normal(&rng));
        } /* biases stay 0 */
    }
    dev_upload(m->params, host, m->table.total * sizeof(float));
    free(host);
}

void gpt2_init(GPT2 *m, const GPT2Config *cfg, uint64_t seed) {
    memset(m, 0, sizeof *m);
    m->cfg = *cfg;
    build_table(m);
    size_t bytes = m->table.total * sizeof(float);
    m->params = dev_alloc(bytes);
    m->grads = dev_alloc(bytes);
    m->m = dev_alloc(bytes);
    m->v = dev_alloc(bytes);
    init_params(m, seed);
    if (cfg->pos) {
        size_t n = (size_t)cfg->T * attn_pos_channels(cfg->pos_m);
        float *feat = xmalloc(n * sizeof(float));
        attn_pos_features(feat, cfg->T, cfg->pos_m);
        m->pos_feat = dev_alloc(n * sizeof(float));
        dev_upload(m->pos_feat, feat, n * sizeof(float));
        free(feat);
    }
}

void gpt2_free(GPT2 *m) {
    dev_free(m->params);
    dev_free(m->grads);
    dev_free(m->m);
    dev_free(m->v);
    dev_free(m->pos_feat);
    dev_free(m->act_memory);
    dev_free(m->scratch_memory);
    dev_free(m->inputs);
    dev_free(m->targets);
    free(m->layer);
    param_table_free(&m->table);
    memset(m, 0, sizeof *m);
}

/* ------------------------------------------------------------------ activations */

/* Activations for B x T tokens; every array is laid out for the current
 * B x T, so any smaller batch fits in an earlier allocation. */
static void alloc_acts(GPT2 *m, int B, int T) {
    if (m->act_memory && (size_t)B * T <= (size_t)m->B * m->T) return;
    dev_free(m->act_memory);
    dev_free(m->scratch_memory);
    dev_free(m->inputs);
    dev_free(m->targets);
    const GPT2Config *c = &m->cfg;
    size_t BT = (size_t)B * T, C = (size_t)c->C, L = (size_t)c->L, P = (size_t)attn_num_proj(c->variant);
    struct {
        float **ptr;
        size_t n;
    } a[] = {
        {&m->acts.encoded, BT * C},
        {&m->acts.ln1, L * BT * C}, {&m->acts.ln1_mean, L * BT}, {&m->acts.ln1_rstd, L * BT},
        {&m->acts.proj, L * BT * P * C},
        {&m->acts.atty, L * BT * C}, {&m->acts.att_lse, L * (size_t)B * c->H * T},
        {&m->acts.res2, L * BT * C},
        {&m->acts.ln2, L * BT * C}, {&m->acts.ln2_mean, L * BT}, {&m->acts.ln2_rstd, L * BT},
        {&m->acts.fch, L * BT * 4 * C}, {&m->acts.fch_act, L * BT * 4 * C},
        {&m->acts.res3, L * BT * C},
        {&m->acts.lnf, BT * C}, {&m->acts.lnf_mean, BT}, {&m->acts.lnf_rstd, BT},
        {&m->acts.logits, BT * (size_t)c->V},
        {&m->acts.losses, BT}, {&m->acts.ce_lse, BT},
        {&m->acts.branch, BT * C},
    };
    size_t total = 0, n = sizeof a / sizeof a[0];
    for (size_t i = 0; i < n; i++) total += (a[i].n + 15) / 16 * 16; /* keep every array 64-byte aligned */
    m->act_memory = dev_alloc(total * sizeof(float));
    float *p = m->act_memory;
    for (size_t i = 0; i < n; i++) {
        *a[i].ptr = p;
        p += (a[i].n + 15) / 16 * 16;
    }
    struct {
        float **ptr;
        size_t n;
    } s[] = {
        {&m->scratch.dres, BT * C}, {&m->scratch.dbranch, BT * C}, {&m->scratch.dln, BT * C},
        {&m->scratch.datty, BT * C}, {&m->scratch.dproj, BT * P * C}, {&m->scratch.dfch_act, BT * 4 * C},
        {&m->scratch.dfch, BT * 4 * C},
    };
    total = 0;
    n = sizeof s / sizeof s[0];
    for (size_t i = 0; i < n; i++) total += (s[i].n + 15) / 16 * 16;
    m->scratch_memory = dev_alloc(total * sizeof(float));
    p = m->scratch_memory;
    for (size_t i = 0; i < n; i++) {
        *s[i].ptr = p;
        p += (s[i].n + 15) / 16 * 16;
    }
    m->inputs = dev_alloc(BT * sizeof(int));
    m->targets = dev_alloc(BT * sizeof(int));
    m->B = B;
    m->T = T;
}

/* ------------------------------------------------------------------ forward */

#define PARAM(off) (m->params + (off))
#define HEAD_BIAS(c) (!(c)->tie && (c)->head_bias)
#define GRAD(off) (m->grads + (off))
/* dropout call sites: 0 = embeddings, then per layer attention probs, attention output, MLP output */
#define SITE_EMB 0
#define SITE(l, k) (1 + 3 * (uint64_t)(l) + (k))

static AttnPos layer_pos(const GPT2 *m, int l) {
    const GPT2LayerParams *lp = &m->layer[l];
    AttnPos p = {.m = m->cfg.pos_m, .groups = m->cfg.pos_groups, .w = m->params + lp->posw,
                 .b = m->params + lp->posb, .feat = m->pos_feat, .T = m->cfg.T};
    return p;
}

static AttnArgs layer_args(const GPT2 *m, int l) {
    AttnArgs a = {.B = m->fwd_B, .T = m->fwd_T, .H = m->cfg.H, .hd = m->cfg.C / m->cfg.H, .causal = 1,
                  .dropout = m->fwd_training ? m->cfg.dropout : 0.0f,
                  .seed = dropout_seed(m->dropout_seed_base, 0, SITE(l, 0))};
    return a;
}

static int use_dropout(const GPT2 *m) { return m->fwd_training && m->cfg.dropout > 0.0f; }

double gpt2_forward(GPT2 *m, const int *inputs, const int *targets, int B, int T, int training,
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
    int C = c->C, P = attn_num_proj(c->variant), H = c->H;
    size_t BT = (size_t)B * T, n = BT * C;
    dev_upload(m->inputs, inputs, BT * sizeof(int));
    float p = c->dropout;

    embedding_forward(a->encoded, m->inputs, PARAM(m->wte), PARAM(m->wpe), B, T, C, c->V);
    if (use_dropout(m)) dropout_forward(a->encoded, a->encoded, n, p, dropout_seed(dropout_seed_base, 0, SITE_EMB));
    for (int l = 0; l < c->L; l++) {
        const GPT2LayerParams *lp = &m->layer[l];
        const float *x = l == 0 ? a->encoded : a->res3 + (size_t)(l - 1) * n;
        float *ln1 = a->ln1 + l * n, *proj = a->proj + l * n * P, *atty = a->atty + l * n;
        float *lse = a->att_lse + (size_t)l * B * H * T, *res2 = a->res2 + l * n, *ln2 = a->ln2 + l * n;
        float *fch = a->fch + l * n * 4, *fch_act = a->fch_act + l * n * 4, *res3 = a->res3 + l * n;

        layernorm_forward(ln1, a->ln1_mean + l * BT, a->ln1_rstd + l * BT, x, PARAM(lp->ln1w),
                          c->bias ? PARAM(lp->ln1b) : NULL, (int)BT, C);
        linear_forward(proj, ln1, PARAM(lp->attnw), c->attn_bias ? PARAM(lp->attnb) : NULL, (int)BT, C, P * C);
        AttnArgs args = layer_args(m, l);
        AttnPos pos = layer_pos(m, l);
        attention_forward(atty, lse, proj, c->pos ? &pos : NULL, &args);
        linear_forward(a->branch, atty, PARAM(lp->projw), c->bias ? PARAM(lp->projb) : NULL, (int)BT, C, C);
        if (use_dropout(m)) dropout_forward(a->branch, a->branch, n, p, dropout_seed(dropout_seed_base, 0, SITE(l, 1)));
        residual_forward(res2, x, a->branch, n);

        layernorm_forward(ln2, a->ln2_mean + l * BT, a->ln2_rstd + l * BT, res2, PARAM(lp->ln2w),
                          c->bias ? PARAM(lp->ln2b) : NULL, (int)BT, C);
        linear_forward(fch, ln2, PARAM(lp->fcw), c->bias ? PARAM(lp->fcb) : NULL, (int)BT, C, 4 * C);
        if (c->gelu)
            gelu_forward(fch_act, fch, 4 * n);
        else
            relu_forward(fch_act, fch, 4 * n);
        linear_forward(a->branch, fch_act, PARAM(lp->fcpw), c->bias ? PARAM(lp->fcpb) : NULL, (int)BT, 4 * C, C);
        if (use_dropout(m)) dropout_forward(a->branch, a->branch, n, p, dropout_seed(dropout_seed_base, 0, SITE(l, 2)));
        residual_forward(res3, res2, a->branch, n);
    }
    layernorm_forward(a->lnf, a->lnf_mean, a->lnf_rstd, a->res3 + (size_t)(c->L - 1) * n, PARAM(m->lnfw),
                      c->bias ? PARAM(m->lnfb) : NULL, (int)BT, C);
    linear_forward(a->logits, a->lnf, PARAM(m->headw), HEAD_BIAS(c) ? PARAM(m->headb) : NULL, (int)BT, C, c->V);
    m->counted = 0;
    m->loss = NAN;
    if (!targets) return m->loss;
    dev_upload(m->targets, targets, BT * sizeof(int));
    m->counted = crossentropy_forward(a->losses, a->ce_lse, a->logits, m->targets, (int)BT, c->V, -1, 0.0f);
    float *losses = xmalloc(BT * sizeof(float));
    dev_download(losses, a->losses, BT * sizeof(float));
    double sum = 0.0;
    for (size_t i = 0; i < BT; i++) sum += losses[i];
    free(losses);
    m->loss = m->counted ? sum / m->counted : 0.0;
    return m->loss;
}

int gpt2_correct(GPT2 *m) {
    return argmax_correct(m->acts.logits, m->targets, m->fwd_B * m->fwd_T, m->cfg.V, -1);
}

/* ------------------------------------------------------------------ backward */

void gpt2_zero_grad(GPT2 *m) { dev_zero(m->grads, m->table.total * sizeof(float)); }

/* Gradient through a dropout site: dbranch = mask * dres / (1-p), or dres itself. */
static const float *through_dropout(GPT2 *m, const float *dres, size_t n, uint64_t site) {
    if (!use_dropout(m)) return dres;
    dev_zero(m->scratch.dbranch, n * sizeof(float));
    dropout_backward(m->scratch.dbranch, dres, n, m->cfg.dropout, dropout_seed(m->dropout_seed_base, 0, site));
    return m->scratch.dbranch;
}

void gpt2_backward(GPT2 *m, float loss_scale) {
    const GPT2Config *c = &m->cfg;
    if (!m->fwd_B || !m->counted) FATAL("gpt2_backward: no forward pass with targets to differentiate");
    GPT2Acts *a = &m->acts;
    GPT2Scratch *s = &m->scratch;
    int B = m->fwd_B, T = m->fwd_T, C = c->C, P = attn_num_proj(c->variant), H = c->H;
    size_t BT = (size_t)B * T, n = BT * C;

    /* loss -> logits (in place) -> final LayerNorm */
    crossentropy_backward(a->logits, a->logits, a->ce_lse, m->targets, (int)BT, c->V, -1, 0.0f,
                          loss_scale / (float)m->counted);
    dev_zero(s->dln, n * sizeof(float));
    linear_backward(s->dln, GRAD(m->headw), HEAD_BIAS(c) ? GRAD(m->headb) : NULL, a->logits, a->lnf, PARAM(m->headw),
                    (int)BT, C, c->V);
    dev_zero(s->dres, n * sizeof(float));
    layernorm_backward(s->dres, GRAD(m->lnfw), c->bias ? GRAD(m->lnfb) : NULL, s->dln,
                       a->res3 + (size_t)(c->L - 1) * n, PARAM(m->lnfw), a->lnf_mean, a->lnf_rstd, (int)BT, C);

    for (int l = c->L - 1; l >= 0; l--) {
        const GPT2LayerParams *lp = &m->layer[l];
        const float *x = l == 0 ? a->encoded : a->res3 + (size_t)(l - 1) * n;
        float *ln1 = a->ln1 + l * n, *proj = a->proj + l * n * P, *atty = a->atty + l * n;
        float *lse = a->att_lse + (size_t)l * B * H * T, *res2 = a->res2 + l * n, *ln2 = a->ln2 + l * n;
        float *fch = a->fch + l * n * 4, *fch_act = a->fch_act + l * n * 4;

        /* MLP sublayer: res3 = res2 + drop(fcproj(act(fc(ln2(res2))))) */
        const float *dbranch = through_dropout(m, s->dres, n, SITE(l, 2));
        dev_zero(s->dfch_act, 4 * n * sizeof(float));
        linear_backward(s->dfch_act, GRAD(lp->fcpw), c->bias ? GRAD(lp->fcpb) : NULL, dbranch, fch_act,
                        PARAM(lp->fcpw), (int)BT, 4 * C, C);
        dev_zero(s->dfch, 4 * n * sizeof(float));
        if (c->gelu)
            gelu_backward(s->dfch, fch, s->dfch_act, 4 * n);
        else
            relu_backward(s->dfch, fch, s->dfch_act, 4 * n);
        dev_zero(s->dln, n * sizeof(float));
        linear_backward(s->dln, GRAD(lp->fcw), c->bias ? GRAD(lp->fcb) : NULL, s->dfch, ln2, PARAM(lp->fcw), (int)BT,
                        C, 4 * C);
        layernorm_backward(s->dres, GRAD(lp->ln2w), c->bias ? GRAD(lp->ln2b) : NULL, s->dln, res2, PARAM(lp->ln2w),
                           a->ln2_mean + l * BT, a->ln2_rstd + l * BT, (int)BT, C);

        /* attention sublayer: res2 = x + drop(proj(attn(qkv(ln1(x))))) */
        dbranch = through_dropout(m, s->dres, n, SITE(l, 1));
        dev_zero(s->datty, n * sizeof(float));
        linear_backward(s->datty, GRAD(lp->projw), c->bias ? GRAD(lp->projb) : NULL, dbranch, atty, PARAM(lp->projw),
                        (int)BT, C, C);
        dev_zero(s->dproj, n * P * sizeof(float));
        AttnArgs args = layer_args(m, l);
        AttnPos pos = layer_pos(m, l);
        AttnPosGrad dpos = {.dw = GRAD(lp->posw), .db = GRAD(lp->posb)};
        attention_backward(s->dproj, c->pos ? &dpos : NULL, s->datty, proj, atty, lse, c->pos ? &pos : NULL, &args);
        dev_zero(s->dln, n * sizeof(float));
        linear_backward(s->dln, GRAD(lp->attnw), c->attn_bias ? GRAD(lp->attnb) : NULL, s->dproj, ln1,
                        PARAM(lp->attnw), (int)BT, C, P * C);
        layernorm_backward(s->dres, GRAD(lp->ln1w), c->bias ? GRAD(lp->ln1b) : NULL, s->dln, x, PARAM(lp->ln1w),
                           a->ln1_mean + l * BT, a->ln1_rstd + l * BT, (int)BT, C);
    }
    const float *demb = through_dropout(m, s->dres, n, SITE_EMB);
    embedding_backward(GRAD(m->wte), GRAD(m->wpe), demb, m->inputs, B, T, C);
}

void gpt2_adamw(GPT2 *m, float lr, float beta1, float beta2, float eps, float weight_decay, int t) {
    for (int i = 0; i < m->table.n; i++) {
        const ParamSpec *s = &m->table.specs[i];
        adamw_update(m->params + s->offset, m->grads + s->offset, m->m + s->offset, m->v + s->offset, s->numel, lr,
                     beta1, beta2, eps, s->decay ? weight_decay : 0.0f, t);
    }
}
