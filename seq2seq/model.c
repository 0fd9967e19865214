#include "model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "common.h"
#include "kernels.h"
#include "rng.h"

/* ------------------------------------------------------------------ configuration */

char *s2s_config_json(const S2SConfig *c) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "family", "seq2seq");
    cJSON_AddStringToObject(o, "architecture", c->decoder ? "encoder-decoder" : "encoder");
    cJSON_AddNumberToObject(o, "src_vocab", c->Vs);
    cJSON_AddNumberToObject(o, "tgt_vocab", c->Vt);
    cJSON_AddStringToObject(o, "input", c->onehot ? "one-hot linear" : "embedding");
    cJSON_AddNumberToObject(o, "max_len", c->Tmax);
    cJSON_AddNumberToObject(o, "n_embd", c->C);
    cJSON_AddNumberToObject(o, "n_head", c->H);
    cJSON_AddNumberToObject(o, "head_dim", c->C / c->H);
    cJSON_AddNumberToObject(o, "mlp_hidden", c->mlp);
    cJSON_AddNumberToObject(o, "enc_layers", c->L_enc);
    cJSON_AddNumberToObject(o, "dec_layers", c->decoder ? c->L_dec : 0);
    cJSON_AddStringToObject(o, "ln_placement", c->post_ln ? "post" : "pre");
    cJSON_AddStringToObject(o, "activation", c->gelu ? "gelu_tanh" : "relu");
    cJSON_AddBoolToObject(o, "mlp_dropout", c->mlp_dropout);
    cJSON_AddBoolToObject(o, "scale_emb", c->scale_emb);
    cJSON_AddBoolToObject(o, "shared_emb", c->shared_emb);
    cJSON_AddStringToObject(o, "head", c->decoder ? "generator" : c->head_mlp ? "linear-ln-relu-linear" : "linear");
    cJSON_AddNumberToObject(o, "pad", c->pad);
    cJSON_AddNumberToObject(o, "dropout", json_float(c->dropout));
    cJSON_AddNumberToObject(o, "label_smoothing", json_float(c->label_smoothing));
    cJSON_AddStringToObject(o, "positions", block_position_kind("sinusoidal"));
    cJSON *a = attention_json(c->variant, c->pos, c->pos_m, c->pos_groups, c->H, c->kv_heads);
    cJSON_AddStringToObject(a, "cross_attention", attn_variant_id(ATTN_QKV, 0)); /* standard attention always */
    cJSON_AddItemToObject(o, "attention", a);
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return s;
}

/* K/V width of self-attention: kv_heads * head_dim (C without grouped K/V heads). */
static int kv_dim(const S2SConfig *c) { return attn_kv_width(c->C, c->H, c->kv_heads); }

size_t s2s_matmul_params(const S2SConfig *c) {
    size_t C = (size_t)c->C, W = (size_t)attn_proj_width(c->variant, c->C, kv_dim(c));
    size_t enc = (size_t)c->L_enc * (W * C + C * C + 2 * C * c->mlp);
    /* the decoder's cross-attention (q, kv, proj: 4 C x C) never groups */
    size_t dec = c->decoder ? (size_t)c->L_dec * (W * C + C * C + 4 * C * C + 2 * C * c->mlp) : 0;
    size_t head = c->decoder ? C * c->Vt : (c->head_mlp ? C * C : 0) + C * c->Vt;
    return enc + dec + head;
}

/* ------------------------------------------------------------------ parameters */

static void add_block(ParamTable *t, BlockParams *lp, const char *prefix, int l, const S2SConfig *c) {
    char name[PARAM_NAME_MAX];
    int C = c->C, kvC = kv_dim(c);
#define NAME(fmt, ...) (snprintf(name, sizeof name, "%s.blocks.%d." fmt, prefix, l, ##__VA_ARGS__), name)
    lp->first = t->total;
    lp->ln1w = param_add(t, NAME("ln1.weight"), 0, 1, C);
    lp->ln1b = param_add(t, NAME("ln1.bias"), 0, 1, C);
    block_attention_params(t, lp, NAME(""), c->variant, C, kvC, 1);
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

static void add_cross(ParamTable *t, DecBlockParams *dp, int l, const S2SConfig *c) {
    char name[PARAM_NAME_MAX];
    int C = c->C;
#define NAME(fmt) (snprintf(name, sizeof name, "dec.blocks.%d." fmt, l), name)
    dp->lnxw = param_add(t, NAME("lnx.weight"), 0, 1, C);
    dp->lnxb = param_add(t, NAME("lnx.bias"), 0, 1, C);
    dp->xqw = param_add(t, NAME("xattn.q.weight"), 1, 2, C, C);
    dp->xqb = param_add(t, NAME("xattn.q.bias"), 0, 1, C);
    dp->xkvw = param_add(t, NAME("xattn.k.weight"), 1, 2, C, C); /* k and v back to back: the fused (2C, C) */
    param_add_next(t, NAME("xattn.v.weight"), 1, 2, C, C);
    dp->xkvb = param_add(t, NAME("xattn.k.bias"), 0, 1, C);
    param_add_next(t, NAME("xattn.v.bias"), 0, 1, C);
    dp->xprojw = param_add(t, NAME("xattn.proj.weight"), 1, 2, C, C);
    dp->xprojb = param_add(t, NAME("xattn.proj.bias"), 0, 1, C);
#undef NAME
}

static void build_table(S2S *m) {
    const S2SConfig *c = &m->cfg;
    ParamTable *t = &m->w.table;
    int C = c->C;
    if (c->onehot) {
        m->inw = param_add(t, "enc.in.weight", 1, 2, C, c->Vs);
        m->inb = param_add(t, "enc.in.bias", 0, 1, C);
    } else {
        m->src_emb = param_add(t, c->shared_emb ? "emb.weight" : "src_emb.weight", 1, 2, c->Vs, C);
    }
    m->enc = xcalloc((size_t)c->L_enc, sizeof(BlockParams));
    for (int l = 0; l < c->L_enc; l++) add_block(t, &m->enc[l], "enc", l, c);
    if (!c->post_ln) {
        m->enc_lnfw = param_add(t, "enc.lnf.weight", 0, 1, C);
        m->enc_lnfb = param_add(t, "enc.lnf.bias", 0, 1, C);
    }
    if (!c->decoder) {
        if (c->head_mlp) {
            m->hfcw = param_add(t, "head.fc.weight", 1, 2, C, C);
            m->hfcb = param_add(t, "head.fc.bias", 0, 1, C);
            m->hlnw = param_add(t, "head.ln.weight", 0, 1, C);
            m->hlnb = param_add(t, "head.ln.bias", 0, 1, C);
        }
        m->houtw = param_add(t, "head.out.weight", 1, 2, c->Vt, C);
        m->houtb = param_add(t, "head.out.bias", 0, 1, c->Vt);
        return;
    }
    m->tgt_emb = c->shared_emb ? m->src_emb : param_add(t, "tgt_emb.weight", 1, 2, c->Vt, C);
    m->dec = xcalloc((size_t)c->L_dec, sizeof(DecBlockParams));
    for (int l = 0; l < c->L_dec; l++) {
        add_block(t, &m->dec[l].b, "dec", l, c);
        add_cross(t, &m->dec[l], l, c);
    }
    m->dec_lnfw = param_add(t, "dec.lnf.weight", 0, 1, C);
    m->dec_lnfb = param_add(t, "dec.lnf.bias", 0, 1, C);
    if (c->shared_emb) {
        m->genw = m->src_emb; /* generator tied to the joint embedding */
    } else {
        m->genw = param_add(t, "generator.weight", 1, 2, c->Vt, C);
    }
    m->genb = param_add(t, "generator.bias", 0, 1, c->Vt);
}

size_t s2s_num_params(const S2SConfig *c) {
    S2S m;
    memset(&m, 0, sizeof m);
    m.cfg = *c;
    build_table(&m);
    size_t n = m.w.table.count;
    free(m.enc);
    free(m.dec);
    param_table_free(&m.w.table);
    return n;
}

/* As the reference models: xavier-uniform on every matrix, zero biases,
 * LayerNorm 1 and 0; +Pos weights xavier-uniform as Linear(m, 1), bias 0. */
static void init_rule(const ParamSpec *s, float *p, Rng *rng, void *ctx) {
    const S2SConfig *c = ctx;
    double bound = 0.0;
    if (strstr(s->name, ".rel_bias"))
        return; /* relative-position bias starts at zero */
    if (strstr(s->name, "ln") && str_ends_with(s->name, ".weight"))
        for (size_t k = 0; k < s->numel; k++) p[k] = 1.0f;
    else if (str_ends_with(s->name, ".pos.w"))
        bound = sqrt(6.0 / (c->pos_m + 1));
    else if (s->ndim == 2)
        bound = sqrt(6.0 / (double)(s->shape[0] + s->shape[1]));
    for (size_t k = 0; bound > 0.0 && k < s->numel; k++) p[k] = (float)((2.0 * rng_uniform(rng) - 1.0) * bound);
}

void s2s_init(S2S *m, const S2SConfig *cfg, uint64_t seed) {
    memset(m, 0, sizeof *m);
    m->cfg = *cfg;
    build_table(m);
    params_alloc(&m->w);
    params_init(&m->w, seed, init_rule, &m->cfg);
    /* the paper's fixed sinusoidal positions, unless the position scheme acts inside attention */
    if (!ATTN_POSITION_IN_ATTENTION) m->pe = block_sinusoid_table_dev(cfg->Tmax, cfg->C);
    m->rope = block_rope_table_dev(cfg->Tmax, cfg->C / cfg->H);
    if (cfg->pos) m->pos_feat = attn_pos_features_dev(cfg->Tmax, cfg->pos_m);
}

void s2s_free(S2S *m) {
    params_free(&m->w);
    dev_free(m->pe), dev_free(m->rope), dev_free(m->pos_feat), dev_free(m->act_memory);
    dev_free(m->src), dev_free(m->tgt_in), dev_free(m->tgt_out), dev_free(m->src_pad), dev_free(m->tgt_pad);
    free(m->acts.enc), free(m->acts.dec), free(m->enc), free(m->dec);
    memset(m, 0, sizeof *m);
}

/* ------------------------------------------------------------------ activations */

static BlockShape shape(const S2S *m, int B, int T, int causal, int post_ln, const unsigned char *key_pad,
                        int training, uint64_t seed, int layer) {
    const S2SConfig *c = &m->cfg;
    BlockShape s = {.B = B, .T = T, .C = c->C, .H = c->H, .kv_heads = c->kv_heads, .mlp = c->mlp, .causal = causal, .gelu = c->gelu,
                    .post_ln = post_ln, .mlp_dropout = c->mlp_dropout, .bias = 1, .attn_bias = 1, .pos = c->pos,
                    .pos_m = c->pos_m, .pos_groups = c->pos_groups, .pos_feat = m->pos_feat, .rope = m->rope, .pos_T = c->Tmax,
                    .key_pad = key_pad, .dropout = training ? c->dropout : 0.0f, .seed = seed, .hook = m->hook,
                    .layer = layer, .attn_grads_only = m->w.attn_grads_only};
    return s;
}

/* The activation arrays for B sources of S tokens and targets of T carved out of cv (nn/block.h): with cv->p NULL
 * only counted. */
static void acts_layout(S2S *m, Carve *cv, int B, int S, int T) {
    const S2SConfig *c = &m->cfg;
    size_t C = (size_t)c->C, BS = (size_t)B * S, BT = (size_t)B * T, Tout = c->decoder ? BT : BS;
    size_t V = (size_t)c->Vt, big = (BS > BT ? BS : BT) * C, A = sizeof(act_t), F = sizeof(float);
    BlockShape es = shape(m, B, S, 0, c->post_ln, NULL, 0, 0, 0), ds = shape(m, B, T, 1, 0, NULL, 0, 0, 0);
    S2SActs *a = &m->acts;
    a->x0 = carve(cv, BS * C * A);
    a->onehot = c->onehot ? carve(cv, BS * c->Vs * A) : NULL;
    for (int l = 0; l < c->L_enc; l++) block_acts_carve(&a->enc[l], cv, &es);
    a->mem = carve(cv, BS * C * A);
    a->mem_mean = carve(cv, BS * F);
    a->mem_rstd = carve(cv, BS * F);
    block_scratch_carve(&a->scratch, cv, &es);
    a->dres = carve(cv, big * A);
    a->dtmp = carve(cv, big * A);
    a->dtmp2 = carve(cv, big * A);
    a->yout = carve(cv, big * A);
    a->dtmp3 = carve(cv, big * A);
    a->dmem = carve(cv, BS * C * A);
    a->yout_mean = carve(cv, Tout * F);
    a->yout_rstd = carve(cv, Tout * F);
    a->losses = carve(cv, Tout * F);
    a->ce_lse = carve(cv, Tout * F);
    a->hln_mean = carve(cv, Tout * F);
    a->hln_rstd = carve(cv, Tout * F);
    a->logits = carve(cv, Tout * V * A);
    a->hfc = carve(cv, BS * C * A);
    a->hln = carve(cv, BS * C * A);
    a->hact = carve(cv, BS * C * A);
    if (c->decoder) {
        a->y0 = carve(cv, BT * C * A);
        for (int l = 0; l < c->L_dec; l++) decblock_acts_carve(&a->dec[l], cv, &ds, S);
        decblock_scratch_carve(&a->dscratch, cv, &ds, S);
    }
}

static void layout(S2S *m, int B, int S, int T) {
    const S2SConfig *c = &m->cfg;
    size_t BS = (size_t)B * S, BT = (size_t)B * T, Tout = c->decoder ? BT : BS;
    if (!m->acts.enc) m->acts.enc = xcalloc((size_t)c->L_enc, sizeof(BlockActs));
    if (c->decoder && !m->acts.dec) m->acts.dec = xcalloc((size_t)c->L_dec, sizeof(DecBlockActs));
    Carve count = {NULL, 0};
    acts_layout(m, &count, B, S, T);
    size_t need = count.bytes;
    /* A smaller arena does not imply fewer tokens (e.g. a longer batch of shorter sequences),
       so the token buffers have their own capacities. */
    size_t tgt_need = Tout > BT ? Tout : BT;
    if (!m->act_memory || need > m->act_capacity || BS > m->src_capacity || tgt_need > m->tgt_capacity) {
        if (need < m->act_capacity) need = m->act_capacity;
        if (BS < m->src_capacity) BS = m->src_capacity;
        if (tgt_need < m->tgt_capacity) tgt_need = m->tgt_capacity;
        dev_free(m->act_memory), dev_free(m->src), dev_free(m->tgt_in), dev_free(m->tgt_out);
        dev_free(m->src_pad), dev_free(m->tgt_pad);
        m->act_memory = dev_alloc(need);
        m->act_capacity = need;
        m->src_capacity = BS, m->tgt_capacity = tgt_need;
        m->src = dev_alloc(BS * sizeof(int) + 64);
        m->tgt_in = dev_alloc(tgt_need * sizeof(int) + 64);
        m->tgt_out = dev_alloc(tgt_need * sizeof(int) + 64);
        m->src_pad = dev_alloc(BS + 64);
        m->tgt_pad = dev_alloc(tgt_need + 64);
    }
    Carve cv = {m->act_memory, 0};
    acts_layout(m, &cv, B, S, T);
}

/* ------------------------------------------------------------------ forward */

#define PARAM(off) (m->w.params + (off))
#define GRAD(off) (m->w.grads + (off))
#define GRAD_W(off) params_product_grad(&m->w, off) /* a product's weight or bias (nn/params.h) */
enum { SITE_SRC = 0, SITE_TGT = 1, SITE_HEAD = 2, SITE_ENC = 16, SITE_DEC = 1024 };

static void pad_mask(unsigned char *mask, const int *tok, size_t n, int pad) {
    for (size_t i = 0; i < n; i++) mask[i] = pad >= 0 && tok[i] == pad;
}

/* Encoder: src (B, S), in host memory and already uploaded to m->src, -> a->mem (after the final LayerNorm of
 * pre-LN models). The one-hot input is built from the host's copy: reading m->src back would be a round trip. */
static const act_t *encode(S2S *m, const int *src, int B, int S, int training) {
    const S2SConfig *c = &m->cfg;
    S2SActs *a = &m->acts;
    size_t BS = (size_t)B * S, n = BS * c->C;
    if (c->onehot) {
        float *oh = xcalloc(BS * c->Vs, sizeof(float));
        for (size_t i = 0; i < BS; i++) {
            if (src[i] < 0 || src[i] >= c->Vs)
                FATAL("s2s_forward: source token %d at index %zu outside [0, %d) (hint: the batch's ids come from "
                      "the task generator, seq2seq/tasks.c, whose vocabulary must be the model's)", src[i], i, c->Vs);
            oh[i * c->Vs + src[i]] = 1.0f;
        }
        act_upload(a->onehot, oh, BS * c->Vs);
        free(oh);
        linear_forward(a->dtmp, a->onehot, PARAM(m->inw), PARAM(m->inb), (int)BS, c->Vs, c->C);
        tokens_embed_forward(a->x0, a->dtmp, NULL, m->pe, B, S, c->C);
    } else {
        embedding_forward(a->x0, m->src, PARAM(m->src_emb), m->pe, B, S, c->C, c->Vs,
                          c->scale_emb ? sqrtf((float)c->C) : 1.0f);
        if (training && c->dropout > 0.0f)
            dropout_forward(a->x0, a->x0, n, c->dropout, dropout_seed(m->dropout_seed_base, 0, SITE_SRC));
    }
    const act_t *x = a->x0;
    for (int l = 0; l < c->L_enc; l++) {
        BlockShape s = shape(m, B, S, 0, c->post_ln, m->src_pad, training,
                             dropout_seed(m->dropout_seed_base, 0, SITE_ENC + (uint64_t)l), l);
        block_forward(&a->enc[l], x, m->w.params, &m->enc[l], &s, &a->scratch);
        x = a->enc[l].out;
    }
    if (c->post_ln) return x;
    layernorm_forward(a->mem, a->mem_mean, a->mem_rstd, x, PARAM(m->enc_lnfw), PARAM(m->enc_lnfb), (int)BS, c->C);
    return a->mem;
}

void s2s_forward_pass(S2S *m, const int *src, int S, const int *tgt_in, const int *tgt_out, int T, int B,
                      int training, uint64_t dropout_seed_base) {
    const S2SConfig *c = &m->cfg;
    if (B < 1 || S < 1 || S > c->Tmax || (c->decoder && (T < 1 || T > c->Tmax)))
        FATAL("s2s_forward: bad batch B=%d S=%d T=%d (longest %d)", B, S, T, c->Tmax);
    if (!c->decoder) T = S;
    layout(m, B, S, T);
    m->fwd_B = B, m->fwd_S = S, m->fwd_T = T, m->fwd_training = training;
    m->dropout_seed_base = dropout_seed_base;
    S2SActs *a = &m->acts;
    size_t BS = (size_t)B * S, BT = (size_t)B * T;
    unsigned char *mask = xmalloc(BS > BT ? BS : BT);
    dev_upload(m->src, src, BS * sizeof(int));
    pad_mask(mask, src, BS, c->pad);
    dev_upload(m->src_pad, mask, BS);
    const act_t *mem = encode(m, src, B, S, training);
    const act_t *final;
    size_t Nout;
    if (!c->decoder) {
        Nout = BS;
        final = mem;
        if (c->head_mlp) {
            linear_forward(a->hfc, mem, PARAM(m->hfcw), PARAM(m->hfcb), (int)BS, c->C, c->C);
            layernorm_forward(a->hln, a->hln_mean, a->hln_rstd, a->hfc, PARAM(m->hlnw), PARAM(m->hlnb), (int)BS, c->C);
            relu_forward(a->hact, a->hln, BS * c->C);
            if (training && c->dropout > 0.0f)
                dropout_forward(a->hact, a->hact, BS * c->C, c->dropout,
                                dropout_seed(dropout_seed_base, 0, SITE_HEAD));
            final = a->hact;
        }
        linear_forward(a->logits, final, PARAM(m->houtw), PARAM(m->houtb), (int)BS, c->C, c->Vt);
        dev_upload(m->tgt_out, tgt_out, BS * sizeof(int));
    } else {
        Nout = BT;
        dev_upload(m->tgt_in, tgt_in, BT * sizeof(int));
        pad_mask(mask, tgt_in, BT, c->pad);
        dev_upload(m->tgt_pad, mask, BT);
        embedding_forward(a->y0, m->tgt_in, PARAM(m->tgt_emb), m->pe, B, T, c->C, c->Vt,
                          c->scale_emb ? sqrtf((float)c->C) : 1.0f);
        if (training && c->dropout > 0.0f)
            dropout_forward(a->y0, a->y0, BT * c->C, c->dropout, dropout_seed(dropout_seed_base, 0, SITE_TGT));
        const act_t *y = a->y0;
        for (int l = 0; l < c->L_dec; l++) {
            BlockShape s = shape(m, B, T, 1, 0, m->tgt_pad, training,
                                 dropout_seed(dropout_seed_base, 0, SITE_DEC + (uint64_t)l), c->L_enc + l);
            decblock_forward(&a->dec[l], y, mem, S, m->src_pad, m->w.params, &m->dec[l], &s, &a->dscratch);
            y = a->dec[l].b.out;
        }
        layernorm_forward(a->yout, a->yout_mean, a->yout_rstd, y, PARAM(m->dec_lnfw), PARAM(m->dec_lnfb), (int)BT,
                          c->C);
        linear_forward(a->logits, a->yout, PARAM(m->genw), PARAM(m->genb), (int)BT, c->C, c->Vt);
        dev_upload(m->tgt_out, tgt_out, BT * sizeof(int));
    }
    free(mask);
    crossentropy_forward(a->losses, a->ce_lse, a->logits, m->tgt_out, (int)Nout, c->Vt, c->pad, c->label_smoothing);
    m->counted = targets_counted(tgt_out, Nout, c->pad);
}

/* the rows of the last pass's logits and targets: (B, T) with a decoder, (B, S) without */
static int out_rows(const S2S *m) { return m->cfg.decoder ? m->fwd_B * m->fwd_T : m->fwd_B * m->fwd_S; }

void s2s_loss_into(S2S *m, double *acc, double scale) { sum_into(acc, m->acts.losses, (size_t)out_rows(m), scale); }

double s2s_loss(S2S *m) { return m->counted ? sum_of(m->acts.losses, (size_t)out_rows(m)) / m->counted : 0.0; }

double s2s_forward(S2S *m, const int *src, int S, const int *tgt_in, const int *tgt_out, int T, int B, int training,
                   uint64_t dropout_seed_base) {
    s2s_forward_pass(m, src, S, tgt_in, tgt_out, T, B, training, dropout_seed_base);
    return s2s_loss(m);
}

int s2s_correct(S2S *m) { return argmax_correct(m->acts.logits, m->tgt_out, out_rows(m), m->cfg.Vt, m->cfg.pad); }

void s2s_correct_into(S2S *m, double *acc) {
    argmax_correct_into(acc, m->acts.logits, m->tgt_out, out_rows(m), m->cfg.Vt, m->cfg.pad);
}

/* ------------------------------------------------------------------ backward */

/* dres = d(memory) -> encoder parameters. */
static void encode_backward(S2S *m, act_t *dres) {
    const S2SConfig *c = &m->cfg;
    S2SActs *a = &m->acts;
    int B = m->fwd_B, S = m->fwd_S;
    size_t BS = (size_t)B * S, n = BS * c->C;
    const act_t *last = a->enc[c->L_enc - 1].out;
    if (!c->post_ln) { /* through the final LayerNorm */
        dev_zero(a->dtmp, n * sizeof(act_t));
        layernorm_backward(a->dtmp, GRAD(m->enc_lnfw), GRAD(m->enc_lnfb), dres, last, PARAM(m->enc_lnfw),
                           a->mem_mean, a->mem_rstd, (int)BS, c->C);
        dev_copy(dres, a->dtmp, n * sizeof(act_t));
    }
    for (int l = c->L_enc - 1; l >= 0; l--) {
        BlockShape s = shape(m, B, S, 0, c->post_ln, m->src_pad, m->fwd_training,
                             dropout_seed(m->dropout_seed_base, 0, SITE_ENC + (uint64_t)l), l);
        const act_t *x = l == 0 ? a->x0 : a->enc[l - 1].out;
        block_backward(dres, m->w.grads, &a->enc[l], x, m->w.params, &m->enc[l], &s, &a->scratch);
        params_grads_final_from(&m->w, m->enc[l].first); /* the decoder, heads and later blocks are done */
    }
    if (c->onehot) {
        linear_backward(NULL, GRAD_W(m->inw), GRAD_W(m->inb), dres, a->onehot, PARAM(m->inw), (int)BS, c->Vs, c->C);
        return;
    }
    const act_t *demb = dres;
    if (m->fwd_training && c->dropout > 0.0f) {
        dev_zero(a->dtmp, n * sizeof(act_t));
        dropout_backward(a->dtmp, dres, n, c->dropout, dropout_seed(m->dropout_seed_base, 0, SITE_SRC));
        demb = a->dtmp;
    }
    embedding_backward(GRAD(m->src_emb), NULL, demb, m->src, B, S, c->C, c->Vs,
                       c->scale_emb ? sqrtf((float)c->C) : 1.0f);
}

void s2s_backward(S2S *m, float loss_scale) {
    const S2SConfig *c = &m->cfg;
    if (!m->fwd_B || !m->counted) FATAL("s2s_backward: no forward pass with targets to differentiate");
    S2SActs *a = &m->acts;
    int B = m->fwd_B, S = m->fwd_S, T = m->fwd_T;
    size_t BS = (size_t)B * S, BT = (size_t)B * T, C = (size_t)c->C;
    size_t Nout = c->decoder ? BT : BS;
    if (!m->external_dlogits)
        crossentropy_backward(a->logits, a->logits, a->ce_lse, m->tgt_out, (int)Nout, c->Vt, c->pad,
                              c->label_smoothing, loss_scale / (float)m->counted);
    if (!c->decoder) {
        const act_t *mem = c->post_ln ? a->enc[c->L_enc - 1].out : a->mem;
        dev_zero(a->dres, BS * C * sizeof(act_t));
        if (c->head_mlp) {
            dev_zero(a->dtmp, BS * C * sizeof(act_t));
            linear_backward(a->dtmp, GRAD_W(m->houtw), GRAD_W(m->houtb), a->logits, a->hact, PARAM(m->houtw), (int)BS,
                            c->C, c->Vt);
            const act_t *dact = a->dtmp;
            if (m->fwd_training && c->dropout > 0.0f) {
                dev_zero(a->dtmp2, BS * C * sizeof(act_t));
                dropout_backward(a->dtmp2, a->dtmp, BS * C, c->dropout,
                                 dropout_seed(m->dropout_seed_base, 0, SITE_HEAD));
                dact = a->dtmp2;
            }
            dev_zero(a->dtmp3, BS * C * sizeof(act_t));
            relu_backward(a->dtmp3, a->hln, dact, BS * C);
            dev_zero(a->dtmp, BS * C * sizeof(act_t));
            layernorm_backward(a->dtmp, GRAD(m->hlnw), GRAD(m->hlnb), a->dtmp3, a->hfc, PARAM(m->hlnw), a->hln_mean,
                               a->hln_rstd, (int)BS, c->C);
            linear_backward(a->dres, GRAD_W(m->hfcw), GRAD_W(m->hfcb), a->dtmp, mem, PARAM(m->hfcw), (int)BS, c->C,
                            c->C);
        } else {
            linear_backward(a->dres, GRAD_W(m->houtw), GRAD_W(m->houtb), a->logits, mem, PARAM(m->houtw), (int)BS, c->C,
                            c->Vt);
        }
        encode_backward(m, a->dres);
        return;
    }
    /* decoder: logits -> generator -> final LayerNorm -> blocks; memory gradients gather in dmem */
    dev_zero(a->dtmp, BT * C * sizeof(act_t));
    linear_backward(a->dtmp, GRAD_W(m->genw), GRAD_W(m->genb), a->logits, a->yout, PARAM(m->genw), (int)BT, c->C,
                    c->Vt);
    const act_t *last = a->dec[c->L_dec - 1].b.out;
    dev_zero(a->dres, BT * C * sizeof(act_t));
    layernorm_backward(a->dres, GRAD(m->dec_lnfw), GRAD(m->dec_lnfb), a->dtmp, last, PARAM(m->dec_lnfw),
                       a->yout_mean, a->yout_rstd, (int)BT, c->C);
    dev_zero(a->dmem, BS * C * sizeof(act_t));
    const act_t *mem = c->post_ln ? a->enc[c->L_enc - 1].out : a->mem;
    for (int l = c->L_dec - 1; l >= 0; l--) {
        BlockShape s = shape(m, B, T, 1, 0, m->tgt_pad, m->fwd_training,
                             dropout_seed(m->dropout_seed_base, 0, SITE_DEC + (uint64_t)l), c->L_enc + l);
        const act_t *y = l == 0 ? a->y0 : a->dec[l - 1].b.out;
        decblock_backward(a->dres, a->dmem, m->w.grads, &a->dec[l], y, mem, S, m->src_pad, m->w.params, &m->dec[l], &s,
                          &a->dscratch);
        params_grads_final_from(&m->w, m->dec[l].b.first);
    }
    const act_t *demb = a->dres;
    if (m->fwd_training && c->dropout > 0.0f) {
        dev_zero(a->dtmp, BT * C * sizeof(act_t));
        dropout_backward(a->dtmp, a->dres, BT * C, c->dropout, dropout_seed(m->dropout_seed_base, 0, SITE_TGT));
        demb = a->dtmp;
    }
    embedding_backward(GRAD(m->tgt_emb), NULL, demb, m->tgt_in, B, T, c->C, c->Vt,
                       c->scale_emb ? sqrtf((float)c->C) : 1.0f);
    dev_copy(a->dres, a->dmem, BS * C * sizeof(act_t));
    encode_backward(m, a->dres);
}

/* ------------------------------------------------------------------ decoding */

/* Decoding state of N = B x K rows: the self-attention cache, the source's
 * cross-attention keys and values per row, and the one-position buffers. */
typedef struct {
    int N;
    KVCache cache;
    DecodeScratch scratch;
    act_t **xkv;            /* per layer (N, S, 2C): cross-attention keys and values of each row's source */
    unsigned char *src_pad; /* (N, S) */
    act_t *x, *logits;      /* (N, C), (N, V) */
    int *tokens;            /* (N) */
} DecodeState;

/* One decoder step for all N rows at position t: logits (N, V) of the next token (device memory). */
static const act_t *decode_step(S2S *m, DecodeState *d, const int *tokens, int t, int S) {
    const S2SConfig *c = &m->cfg;
    const float *W = m->w.params;
    int N = d->N, C = c->C;
    dev_upload(d->tokens, tokens, (size_t)N * sizeof(int));
    embedding_forward(d->x, d->tokens, W + m->tgt_emb, m->pe ? m->pe + (size_t)t * C : NULL, N, 1, C, c->Vt,
                      c->scale_emb ? sqrtf((float)C) : 1.0f);
    for (int l = 0; l < c->L_dec; l++) {
        BlockShape s = shape(m, N, 1, 1, 0, NULL, 0, 0, c->L_enc + l);
        DecodeCross cross = {.p = &m->dec[l], .xkv = d->xkv[l], .S = S, .src_pad = d->src_pad};
        block_decode(d->x, t, &d->cache, l, W, &m->dec[l].b, &cross, &s, &d->scratch);
    }
    d->cache.len = t + 1;
    DecodeScratch *sc = &d->scratch;
    layernorm_forward(sc->ln, sc->mean, sc->rstd, d->x, W + m->dec_lnfw, W + m->dec_lnfb, N, C);
    linear_forward(d->logits, sc->ln, W + m->genw, W + m->genb, N, C, c->Vt);
    return d->logits;
}

typedef struct {
    double score;
    int beam, token;
} Cand;

static int by_score(const void *a, const void *b) {
    const Cand *x = a, *y = b;
    if (x->score != y->score) return x->score < y->score ? 1 : -1;
    if (x->beam != y->beam) return x->beam - y->beam;
    return x->token - y->token;
}

void s2s_decode(S2S *m, const int *src, int S, int B, int beam, double alpha, int max_len, int bos, int eos,
                int *out, int *lens) {
    const S2SConfig *c = &m->cfg;
    if (!c->decoder) FATAL("s2s_decode: the model has no decoder");
    if (beam < 1 || max_len < 1 || max_len > c->Tmax) FATAL("s2s_decode: beam %d, max_len %d (longest %d)", beam,
                                                             max_len, c->Tmax);
    int C = c->C, K = beam, N = B * K, V = c->Vt;
    /* encoder once */
    layout(m, B, S, 1);
    m->fwd_B = B, m->fwd_S = S, m->fwd_T = 1, m->fwd_training = 0, m->dropout_seed_base = 0;
    size_t BS = (size_t)B * S;
    unsigned char *mask = xmalloc(BS);
    dev_upload(m->src, src, BS * sizeof(int));
    pad_mask(mask, src, BS, c->pad);
    dev_upload(m->src_pad, mask, BS);
    const act_t *mem = encode(m, src, B, S, 0);
    DecodeState d = {.N = N};
    kv_cache_init(&d.cache, c->L_dec, N, max_len, kv_dim(c), c->variant);
    decode_scratch_init(&d.scratch, N, C, c->H, c->mlp, attn_proj_width(c->variant, C, kv_dim(c)));
    /* source keys and values, one copy per beam row (row n reads sentence n / K) */
    int *rowsrc = xmalloc((size_t)N * sizeof(int)), *rowsrc_dev = dev_alloc((size_t)N * sizeof(int));
    for (int n = 0; n < N; n++) rowsrc[n] = n / K;
    dev_upload(rowsrc_dev, rowsrc, (size_t)N * sizeof(int));
    size_t kvrow = (size_t)S * 2 * C;
    d.xkv = xmalloc((size_t)c->L_dec * sizeof(act_t *));
    act_t *xkv = dev_alloc(BS * 2 * C * sizeof(act_t));
    for (int l = 0; l < c->L_dec; l++) {
        linear_forward(xkv, mem, m->w.params + m->dec[l].xkvw, m->w.params + m->dec[l].xkvb, (int)BS, C, 2 * C);
        d.xkv[l] = dev_alloc((size_t)N * kvrow * sizeof(act_t));
        rows_gather(d.xkv[l], kvrow, xkv, kvrow, rowsrc_dev, N, kvrow);
    }
    dev_free(xkv), dev_free(rowsrc_dev);
    unsigned char *pad = xmalloc((size_t)N * S);
    for (int n = 0; n < N; n++) memcpy(pad + (size_t)n * S, mask + (size_t)rowsrc[n] * S, (size_t)S);
    d.src_pad = dev_alloc((size_t)N * S);
    dev_upload(d.src_pad, pad, (size_t)N * S);
    free(pad), free(mask), free(rowsrc);
    d.x = dev_alloc((size_t)N * C * sizeof(act_t));
    d.logits = dev_alloc((size_t)N * V * sizeof(act_t));
    d.tokens = dev_alloc((size_t)N * sizeof(int));

    /* hypotheses: tokens so far per row, log-probabilities, and the best finished one per sentence */
    int *tokens = xmalloc((size_t)N * sizeof(int)), *hist = xmalloc((size_t)N * max_len * sizeof(int));
    int *hist2 = xmalloc((size_t)N * max_len * sizeof(int)), *parent = xmalloc((size_t)N * sizeof(int));
    double *score = xmalloc((size_t)N * sizeof(double)), *nscore = xmalloc((size_t)N * sizeof(double));
    double *best = xmalloc((size_t)B * sizeof(double));
    int *done = xcalloc((size_t)B, sizeof(int));
    float *logits = xmalloc((size_t)N * V * sizeof(float));
    Cand *cand = xmalloc((size_t)K * V * sizeof(Cand));
    for (int n = 0; n < N; n++) tokens[n] = bos, score[n] = n % K == 0 ? 0.0 : -INFINITY;
    for (int b = 0; b < B; b++) {
        best[b] = -INFINITY;
        lens[b] = 0;
    }
    for (int t = 0; t < max_len; t++) {
        act_download(logits, decode_step(m, &d, tokens, t, S), (size_t)N * V);
        int all_done = 1;
        for (int b = 0; b < B; b++) {
            if (done[b]) { /* keep the rows busy with something harmless */
                for (int k = 0; k < K; k++) parent[b * K + k] = b * K + k, nscore[b * K + k] = -INFINITY;
                continue;
            }
            int nc2 = 0;
            for (int k = 0; k < K; k++) {
                int n = b * K + k;
                if (score[n] == -INFINITY) continue;
                const float *lg = logits + (size_t)n * V;
                float mx = lg[0];
                for (int v = 1; v < V; v++) mx = lg[v] > mx ? lg[v] : mx;
                double z = 0.0;
                for (int v = 0; v < V; v++) z += exp((double)(lg[v] - mx));
                double lse = mx + log(z);
                for (int v = 0; v < V; v++) /* padding and <bos> are never generated: a prefix holding them
                                                 would mean something else to the model (padding is masked) */
                    if (v != c->pad && v != bos) cand[nc2++] = (Cand){score[n] + lg[v] - lse, k, v};
            }
            /* the K best continuations; one that ends the sentence is a finished hypothesis */
            int keep = nc2 < 2 * K ? nc2 : 2 * K;
            for (int i = 0; i < keep; i++) { /* partial selection sort: K is small */
                int bi = i;
                for (int j = i + 1; j < nc2; j++)
                    if (by_score(&cand[j], &cand[bi]) < 0) bi = j;
                Cand tmp = cand[i];
                cand[i] = cand[bi];
                cand[bi] = tmp;
            }
            int alive = 0;
            for (int i = 0; i < keep && alive < K; i++) {
                int from = b * K + cand[i].beam;
                if (cand[i].token == eos || t == max_len - 1) {
                    int len = cand[i].token == eos ? t : t + 1; /* tokens before <eos> */
                    double norm = cand[i].score / pow((double)(len > 0 ? len : 1), alpha);
                    if (norm > best[b]) {
                        best[b] = norm;
                        lens[b] = len;
                        memcpy(out + (size_t)b * max_len, hist + (size_t)from * max_len, (size_t)t * sizeof(int));
                        if (cand[i].token != eos) out[(size_t)b * max_len + t] = cand[i].token;
                        if (len < max_len) out[(size_t)b * max_len + len] = eos;
                    }
                    if (K == 1) break; /* greedy: the first choice is final */
                    continue;
                }
                int n = b * K + alive++;
                parent[n] = from;
                nscore[n] = cand[i].score;
                hist2[(size_t)n * max_len + t] = cand[i].token;
                memcpy(hist2 + (size_t)n * max_len, hist + (size_t)from * max_len, (size_t)t * sizeof(int));
                tokens[n] = cand[i].token;
            }
            for (int k = alive; k < K; k++) parent[b * K + k] = b * K, nscore[b * K + k] = -INFINITY;
            /* done when no live hypothesis can still beat the best finished one: log-probabilities
             * only fall, so top / max_len^alpha bounds any continuation's normalised score */
            double top = -INFINITY;
            for (int k = 0; k < alive; k++) top = nscore[b * K + k] > top ? nscore[b * K + k] : top;
            done[b] = alive == 0 || (best[b] > -INFINITY && (K == 1 || top / pow(max_len, alpha) <= best[b]));
            if (!done[b]) all_done = 0;
        }
        if (all_done || t == max_len - 1) break;
        kv_cache_reorder(&d.cache, parent);
        memcpy(score, nscore, (size_t)N * sizeof(double));
        memcpy(hist, hist2, (size_t)N * max_len * sizeof(int));
    }
    free(tokens), free(hist), free(hist2), free(parent), free(score), free(nscore), free(best), free(done);
    free(logits), free(cand);
    for (int l = 0; l < c->L_dec; l++) dev_free(d.xkv[l]);
    free(d.xkv);
    kv_cache_free(&d.cache);
    decode_scratch_free(&d.scratch);
    dev_free(d.src_pad), dev_free(d.x), dev_free(d.logits), dev_free(d.tokens);
}
