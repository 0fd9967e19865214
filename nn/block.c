#include "block.h"

#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "kernels.h"

/* dropout sites inside a block */
enum { SITE_ATTN_PROBS, SITE_ATTN_OUT, SITE_MLP_OUT, SITE_MLP_INNER };

static size_t bt(const BlockShape *s) { return (size_t)s->B * s->T; }

int block_proj_width(const BlockShape *s) {
    return attn_proj_width(ATTN_VARIANT, s->C, attn_kv_width(s->C, s->H, s->kv_heads));
}

void *carve(Carve *c, size_t bytes) {
    void *at = c->p ? c->p + c->bytes : NULL;
    c->bytes += (bytes + 63) / 64 * 64;
    return at;
}

#define TAKE(field, count, type) ((field) = carve(c, (count) * sizeof(type)))

void block_acts_carve(BlockActs *a, Carve *c, const BlockShape *s) {
    size_t n = bt(s) * s->C, np = bt(s) * (size_t)block_proj_width(s), nl = (size_t)s->B * s->H * s->T;
    TAKE(a->ln1, n, act_t);
    TAKE(a->ln1_mean, bt(s), float);
    TAKE(a->ln1_rstd, bt(s), float);
    TAKE(a->proj, np, act_t);
    TAKE(a->atty, n, act_t);
    TAKE(a->att_lse, nl, float);
    TAKE(a->res2, n, act_t);
    TAKE(a->ln2, n, act_t);
    TAKE(a->ln2_mean, bt(s), float);
    TAKE(a->ln2_rstd, bt(s), float);
    TAKE(a->fch, bt(s) * s->mlp, act_t);
    TAKE(a->fch_act, bt(s) * s->mlp, act_t);
    TAKE(a->out, n, act_t);
}

/* Whether the MLP's backward runs GELU's gradient inside the second product (gelu_linear_backward, one op): with
 * GELU and no dropout between the two products. Then the gradient of the GELU's output is never stored, and the
 * scratch has no room for it (dfch_act NULL; a shape with the inner dropout keeps it, whatever its rate). */
static int mlp_backward_fused(const BlockShape *s) { return s->gelu && !(s->mlp_dropout && s->dropout > 0.0f); }
static int mlp_keeps_dact(const BlockShape *s) { return !s->gelu || s->mlp_dropout; }

void block_scratch_carve(BlockScratch *sc, Carve *c, const BlockShape *s) {
    size_t n = bt(s) * s->C, np = bt(s) * (size_t)block_proj_width(s);
    TAKE(sc->dbranch, n, act_t);
    TAKE(sc->dln, n, act_t);
    TAKE(sc->datty, n, act_t);
    TAKE(sc->dsum, n, act_t);
    TAKE(sc->branch, n, act_t);
    TAKE(sc->dproj, np, act_t);
    if (mlp_keeps_dact(s))
        TAKE(sc->dfch_act, bt(s) * s->mlp, act_t);
    else
        sc->dfch_act = NULL;
    TAKE(sc->dfch, bt(s) * s->mlp, act_t);
}

static AttnArgs attn_args(const BlockShape *s) {
    AttnArgs a = {.B = s->B, .T = s->T, .H = s->H, .hd = s->C / s->H, .kv_heads = s->kv_heads, .causal = s->causal,
                  .key_pad = s->key_pad, .dropout = s->dropout, .seed = dropout_seed(s->seed, 0, SITE_ATTN_PROBS)};
    return a;
}

/* The layer's positional inputs: +Pos and the configured position scheme (kernels/attention.h). */
static AttnPos attn_pos(const float *params, const BlockParams *p, const BlockShape *s) {
    int rel = ATTN_POSITION == ATTN_POSITION_REL_BIAS;
    AttnPos pos = {.m = s->pos_m, .groups = s->pos_groups, .w = s->pos ? params + p->posw : NULL,
                   .b = s->pos ? params + p->posb : NULL, .feat = s->pos_feat, .T = s->pos_T,
                   .scheme = ATTN_POSITION, .rope = s->rope, .rope_hd = s->C / s->H,
                   .rel = rel ? params + p->relw : NULL, .rel_buckets = CONFIG_POSITION_REL_BUCKETS,
                   .rel_max_distance = CONFIG_POSITION_REL_MAX_DISTANCE};
    return pos;
}

/* What the kernels get: NULL when the layer has neither +Pos nor a scheme acting inside attention. */
static const AttnPos *pos_arg(const AttnPos *pos, const BlockShape *s) {
    return s->pos || ATTN_POSITION_IN_ATTENTION ? pos : NULL;
}

#define W(off) (params + (off))
#define WB(flag, off) ((flag) ? params + (off) : NULL)

/* The attention sublayer's output, before its residual add: branch. */
static void attention_sublayer(BlockActs *a, const act_t *in, const float *params, const BlockParams *p,
                               const BlockShape *s, BlockScratch *sc) {
    int N = (int)bt(s), C = s->C, PW = block_proj_width(s);
    linear_forward(a->proj, in, W(p->attnw), WB(s->attn_bias, p->attnb), N, C, PW);
    if (s->hook && s->hook->after_proj) s->hook->after_proj(s->hook, s->layer, in, a->proj, s);
    AttnArgs args = attn_args(s);
    AttnPos pos = attn_pos(params, p, s);
    attention_forward(a->atty, a->att_lse, a->proj, pos_arg(&pos, s), &args);
    if (s->hook && s->hook->after_attn) s->hook->after_attn(s->hook, s->layer, a->atty, s);
    linear_forward(sc->branch, a->atty, W(p->projw), WB(s->bias, p->projb), N, C, C);
    if (s->dropout > 0.0f)
        dropout_forward(sc->branch, sc->branch, bt(s) * C, s->dropout, dropout_seed(s->seed, 0, SITE_ATTN_OUT));
}

/* The MLP's first product and its activation: pre = in W^T + b, act = gelu(pre) or relu(pre), for N rows. GELU in
 * one op: on a GPU it runs in the product's epilogue. */
static void mlp_first_product(act_t *pre, act_t *act, const act_t *in, const float *params, const BlockParams *p,
                              const BlockShape *s, int N) {
    if (s->gelu) {
        linear_gelu_forward(pre, act, in, W(p->fcw), WB(s->bias, p->fcb), N, s->C, s->mlp);
    } else {
        linear_forward(pre, in, W(p->fcw), WB(s->bias, p->fcb), N, s->C, s->mlp);
        relu_forward(act, pre, (size_t)N * s->mlp);
    }
}

/* The MLP sublayer's output, before its residual add: branch. */
static void mlp_sublayer(BlockActs *a, const act_t *in, const float *params, const BlockParams *p,
                         const BlockShape *s, BlockScratch *sc) {
    int N = (int)bt(s), C = s->C;
    size_t nm = bt(s) * s->mlp;
    mlp_first_product(a->fch, a->fch_act, in, params, p, s, N);
    if (s->mlp_dropout && s->dropout > 0.0f)
        dropout_forward(a->fch_act, a->fch_act, nm, s->dropout, dropout_seed(s->seed, 0, SITE_MLP_INNER));
    linear_forward(sc->branch, a->fch_act, W(p->fcpw), WB(s->bias, p->fcpb), N, s->mlp, C);
    if (s->dropout > 0.0f)
        dropout_forward(sc->branch, sc->branch, bt(s) * C, s->dropout, dropout_seed(s->seed, 0, SITE_MLP_OUT));
}

void block_forward(BlockActs *a, const act_t *x, const float *params, const BlockParams *p, const BlockShape *s,
                   BlockScratch *sc) {
    int N = (int)bt(s), C = s->C;
    size_t n = bt(s) * C;
    if (s->post_ln) {
        attention_sublayer(a, x, params, p, s, sc);
        /* the sum before ln1, then ln1 */
        residual_layernorm_forward(a->res2, a->ln1, a->ln1_mean, a->ln1_rstd, x, sc->branch, W(p->ln1w),
                                   WB(s->bias, p->ln1b), N, C);
        mlp_sublayer(a, a->ln1, params, p, s, sc);
        /* the sum before ln2, then ln2 */
        residual_layernorm_forward(a->ln2, a->out, a->ln2_mean, a->ln2_rstd, a->ln1, sc->branch, W(p->ln2w),
                                   WB(s->bias, p->ln2b), N, C);
        return;
    }
    layernorm_forward(a->ln1, a->ln1_mean, a->ln1_rstd, x, W(p->ln1w), WB(s->bias, p->ln1b), N, C);
    attention_sublayer(a, a->ln1, params, p, s, sc);
    residual_layernorm_forward(a->res2, a->ln2, a->ln2_mean, a->ln2_rstd, x, sc->branch, W(p->ln2w),
                               WB(s->bias, p->ln2b), N, C);
    mlp_sublayer(a, a->ln2, params, p, s, sc);
    residual_forward(a->out, a->res2, sc->branch, n);
}

/* Gradient through a dropout site: mask * dres / (1-p), or dres itself. */
static const act_t *through_dropout(const BlockShape *s, BlockScratch *sc, const act_t *dres, size_t n, int site) {
    if (s->dropout <= 0.0f) return dres;
    dev_zero(sc->dbranch, n * sizeof(act_t));
    dropout_backward(sc->dbranch, dres, n, s->dropout, dropout_seed(s->seed, 0, (uint64_t)site));
    return sc->dbranch;
}

#define G(off) (grads + (off))
#define GB(flag, off) ((flag) ? grads + (off) : NULL)
/* the weight and bias gradients of a product other than the self-attention projections (attn_grads_only) */
#define GW(off) (s->attn_grads_only ? NULL : G(off))
#define GWB(flag, off) (s->attn_grads_only ? NULL : GB(flag, off))

/* MLP sublayer backward: d(branch) in dout; adds d(input) into din. */
static void mlp_backward(act_t *din, const act_t *dout, float *grads, const BlockActs *a, const act_t *in,
                         const float *params, const BlockParams *p, const BlockShape *s, BlockScratch *sc) {
    int N = (int)bt(s), C = s->C;
    size_t n = bt(s) * C, nm = bt(s) * s->mlp;
    const act_t *dbranch = through_dropout(s, sc, dout, n, SITE_MLP_OUT);
    if (mlp_backward_fused(s)) { /* GELU's gradient in the product (one op) */
        gelu_linear_backward(sc->dfch, GW(p->fcpw), GWB(s->bias, p->fcpb), dbranch, a->fch_act, a->fch, W(p->fcpw), N,
                             s->mlp, C);
        linear_backward(din, GW(p->fcw), GWB(s->bias, p->fcb), sc->dfch, in, W(p->fcw), N, C, s->mlp);
        return;
    }
    dev_zero(sc->dfch_act, nm * sizeof(act_t));
    linear_backward(sc->dfch_act, GW(p->fcpw), GWB(s->bias, p->fcpb), dbranch, a->fch_act, W(p->fcpw), N, s->mlp, C);
    act_t *dact = sc->dfch_act, *dpre = sc->dfch;
    if (s->mlp_dropout && s->dropout > 0.0f) { /* back through the inner dropout into dfch, then swap */
        dev_zero(sc->dfch, nm * sizeof(act_t));
        dropout_backward(sc->dfch, sc->dfch_act, nm, s->dropout, dropout_seed(s->seed, 0, SITE_MLP_INNER));
        dact = sc->dfch;
        dpre = sc->dfch_act;
    }
    dev_zero(dpre, nm * sizeof(act_t));
    if (s->gelu)
        gelu_backward(dpre, a->fch, dact, nm);
    else
        relu_backward(dpre, a->fch, dact, nm);
    linear_backward(din, GW(p->fcw), GWB(s->bias, p->fcb), dpre, in, W(p->fcw), N, C, s->mlp);
}

/* Attention sublayer backward: d(branch) in dout; adds d(input) into din. */
static void attention_backward_sublayer(act_t *din, const act_t *dout, float *grads, const BlockActs *a,
                                        const act_t *in, const float *params, const BlockParams *p,
                                        const BlockShape *s, BlockScratch *sc) {
    int N = (int)bt(s), C = s->C, PW = block_proj_width(s);
    size_t n = bt(s) * C;
    const act_t *dbranch = through_dropout(s, sc, dout, n, SITE_ATTN_OUT);
    dev_zero(sc->datty, n * sizeof(act_t));
    linear_backward(sc->datty, GW(p->projw), GWB(s->bias, p->projb), dbranch, a->atty, W(p->projw), N, C, C);
    dev_zero(sc->dproj, bt(s) * (size_t)PW * sizeof(act_t));
    AttnArgs args = attn_args(s);
    AttnPos pos = attn_pos(params, p, s);
    AttnPosGrad dpos = {.dw = s->pos ? G(p->posw) : NULL, .db = s->pos ? G(p->posb) : NULL,
                        .drel = ATTN_POSITION == ATTN_POSITION_REL_BIAS ? G(p->relw) : NULL};
    attention_backward(sc->dproj, pos_arg(&pos, s) ? &dpos : NULL, sc->datty, a->proj, a->atty, a->att_lse,
                       pos_arg(&pos, s), &args);
    linear_backward(din, G(p->attnw), GB(s->attn_bias, p->attnb), sc->dproj, in, W(p->attnw), N, C, PW);
}

void block_backward(act_t *dres, float *grads, const BlockActs *a, const act_t *x, const float *params,
                    const BlockParams *p, const BlockShape *s, BlockScratch *sc) {
    int N = (int)bt(s), C = s->C;
    size_t n = bt(s) * C;
    if (s->post_ln) {
        /* out = ln2(sum2), sum2 = ln1 + mlp(ln1), ln1 = ln1(sum1), sum1 = x + attn(x) */
        dev_zero(sc->dsum, n * sizeof(act_t));
        layernorm_backward(sc->dsum, G(p->ln2w), GB(s->bias, p->ln2b), dres, a->ln2, W(p->ln2w), a->ln2_mean,
                           a->ln2_rstd, N, C);
        dev_zero(sc->dln, n * sizeof(act_t));
        mlp_backward(sc->dln, sc->dsum, grads, a, a->ln1, params, p, s, sc);
        residual_forward(sc->dln, sc->dln, sc->dsum, n); /* the residual path into ln1 */
        dev_zero(dres, n * sizeof(act_t));
        layernorm_backward(dres, G(p->ln1w), GB(s->bias, p->ln1b), sc->dln, a->res2, W(p->ln1w), a->ln1_mean,
                           a->ln1_rstd, N, C);
        /* dres = d(sum1): the residual path to x, plus the attention branch */
        attention_backward_sublayer(dres, dres, grads, a, x, params, p, s, sc);
        return;
    }
    dev_zero(sc->dln, n * sizeof(act_t));
    mlp_backward(sc->dln, dres, grads, a, a->ln2, params, p, s, sc);
    layernorm_backward(dres, G(p->ln2w), GB(s->bias, p->ln2b), sc->dln, a->res2, W(p->ln2w), a->ln2_mean,
                       a->ln2_rstd, N, C);
    dev_zero(sc->dln, n * sizeof(act_t));
    attention_backward_sublayer(sc->dln, dres, grads, a, a->ln1, params, p, s, sc);
    layernorm_backward(dres, G(p->ln1w), GB(s->bias, p->ln1b), sc->dln, x, W(p->ln1w), a->ln1_mean, a->ln1_rstd, N,
                       C);
}

/* ------------------------------------------------------------------ decoder block */

enum { SITE_CROSS_PROBS = 8, SITE_CROSS_OUT };

void decblock_acts_carve(DecBlockActs *a, Carve *c, const BlockShape *s, int S) {
    size_t n = bt(s) * s->C;
    block_acts_carve(&a->b, c, s);
    TAKE(a->lnx, n, act_t);
    TAKE(a->lnx_mean, bt(s), float);
    TAKE(a->lnx_rstd, bt(s), float);
    TAKE(a->xq, n, act_t);
    TAKE(a->xkv, (size_t)s->B * S * 2 * s->C, act_t);
    TAKE(a->xatty, n, act_t);
    TAKE(a->xlse, (size_t)s->B * s->H * s->T, float);
    TAKE(a->h2, n, act_t);
}

void decblock_scratch_carve(DecBlockScratch *sc, Carve *c, const BlockShape *s, int S) {
    block_scratch_carve(&sc->b, c, s);
    TAKE(sc->dxq, bt(s) * s->C, act_t);
    TAKE(sc->dxkv, (size_t)s->B * S * 2 * s->C, act_t);
}
#undef TAKE

static CrossAttnArgs cross_args(const BlockShape *s, int S, const unsigned char *src_pad) {
    CrossAttnArgs a = {.B = s->B, .Tq = s->T, .Tk = S, .H = s->H, .hd = s->C / s->H, .key_pad = src_pad,
                       .dropout = s->dropout, .seed = dropout_seed(s->seed, 0, SITE_CROSS_PROBS)};
    return a;
}

void decblock_forward(DecBlockActs *a, const act_t *x, const act_t *mem, int S, const unsigned char *src_pad,
                      const float *params, const DecBlockParams *p, const BlockShape *s, DecBlockScratch *sc) {
    int N = (int)bt(s), C = s->C;
    size_t n = bt(s) * C;
    BlockActs *b = &a->b;
    /* self-attention (causal, the configured variant) */
    layernorm_forward(b->ln1, b->ln1_mean, b->ln1_rstd, x, W(p->b.ln1w), WB(s->bias, p->b.ln1b), N, C);
    attention_sublayer(b, b->ln1, params, &p->b, s, &sc->b);
    /* cross-attention to the encoder output (QKV), after the residual sum and its layernorm */
    residual_layernorm_forward(b->res2, a->lnx, a->lnx_mean, a->lnx_rstd, x, sc->b.branch, W(p->lnxw),
                               WB(s->bias, p->lnxb), N, C);
    linear_forward(a->xq, a->lnx, W(p->xqw), WB(s->bias, p->xqb), N, C, C);
    linear_forward(a->xkv, mem, W(p->xkvw), WB(s->bias, p->xkvb), s->B * S, C, 2 * C);
    CrossAttnArgs xa = cross_args(s, S, src_pad);
    cross_attention_forward(a->xatty, a->xlse, a->xq, a->xkv, &xa);
    linear_forward(sc->b.branch, a->xatty, W(p->xprojw), WB(s->bias, p->xprojb), N, C, C);
    if (s->dropout > 0.0f)
        dropout_forward(sc->b.branch, sc->b.branch, n, s->dropout, dropout_seed(s->seed, 0, SITE_CROSS_OUT));
    /* MLP, after the residual sum and its layernorm */
    residual_layernorm_forward(a->h2, b->ln2, b->ln2_mean, b->ln2_rstd, b->res2, sc->b.branch, W(p->b.ln2w),
                               WB(s->bias, p->b.ln2b), N, C);
    mlp_sublayer(b, b->ln2, params, &p->b, s, &sc->b);
    residual_forward(b->out, a->h2, sc->b.branch, n);
}

void decblock_backward(act_t *dres, act_t *dmem, float *grads, const DecBlockActs *a, const act_t *x, const act_t *mem,
                       int S, const unsigned char *src_pad, const float *params, const DecBlockParams *p,
                       const BlockShape *s, DecBlockScratch *sc) {
    int N = (int)bt(s), C = s->C;
    size_t n = bt(s) * C;
    const BlockActs *b = &a->b;
    BlockScratch *bs = &sc->b;
    /* MLP: dres = d(out) -> d(h2) */
    dev_zero(bs->dln, n * sizeof(act_t));
    mlp_backward(bs->dln, dres, grads, b, b->ln2, params, &p->b, s, bs);
    layernorm_backward(dres, G(p->b.ln2w), GB(s->bias, p->b.ln2b), bs->dln, a->h2, W(p->b.ln2w), b->ln2_mean,
                       b->ln2_rstd, N, C);
    /* cross-attention: d(h2) -> d(h1), and into the encoder output */
    const act_t *dbranch = through_dropout(s, bs, dres, n, SITE_CROSS_OUT);
    dev_zero(bs->datty, n * sizeof(act_t));
    linear_backward(bs->datty, GW(p->xprojw), GWB(s->bias, p->xprojb), dbranch, a->xatty, W(p->xprojw), N, C, C);
    dev_zero(sc->dxq, n * sizeof(act_t));
    dev_zero(sc->dxkv, (size_t)s->B * S * 2 * C * sizeof(act_t));
    CrossAttnArgs xa = cross_args(s, S, src_pad);
    cross_attention_backward(sc->dxq, sc->dxkv, bs->datty, a->xq, a->xkv, a->xatty, a->xlse, &xa);
    linear_backward(dmem, GW(p->xkvw), GWB(s->bias, p->xkvb), sc->dxkv, mem, W(p->xkvw), s->B * S, C, 2 * C);
    dev_zero(bs->dln, n * sizeof(act_t));
    linear_backward(bs->dln, GW(p->xqw), GWB(s->bias, p->xqb), sc->dxq, a->lnx, W(p->xqw), N, C, C);
    layernorm_backward(dres, G(p->lnxw), GB(s->bias, p->lnxb), bs->dln, b->res2, W(p->lnxw), a->lnx_mean,
                       a->lnx_rstd, N, C);
    /* self-attention: d(h1) -> d(x) */
    dev_zero(bs->dln, n * sizeof(act_t));
    attention_backward_sublayer(bs->dln, dres, grads, b, b->ln1, params, &p->b, s, bs);
    layernorm_backward(dres, G(p->b.ln1w), GB(s->bias, p->b.ln1b), bs->dln, x, W(p->b.ln1w), b->ln1_mean,
                       b->ln1_rstd, N, C);
}

/* ------------------------------------------------------------------ parameters */

void block_attention_params(ParamTable *t, BlockParams *lp, const char *prefix, int variant, int C, int kvC,
                            int bias) {
    char name[PARAM_NAME_MAX];
    int P = attn_num_proj(variant);
    for (int wb = 0; wb < (bias ? 2 : 1); wb++)
        for (int p = 0; p < P; p++) {
            int rows = attn_block_width(variant, p, C, kvC);
            snprintf(name, sizeof name, "%sattn.%s.%s", prefix, attn_block_name(variant, p), wb ? "bias" : "weight");
            size_t (*add)(ParamTable *, const char *, int, int, ...) = p ? param_add_next : param_add;
            size_t off = wb ? add(t, name, 0, 1, rows) : add(t, name, 1, 2, rows, C); /* biases: no decay */
            if (p == 0) *(wb ? &lp->attnb : &lp->attnw) = off;
        }
}

/* ------------------------------------------------------------------ positions */

void block_position_params(ParamTable *t, BlockParams *lp, const char *prefix, int pos, int pos_m, int pos_groups,
                           int H) {
    char name[PARAM_NAME_MAX];
#define NAME(what) (snprintf(name, sizeof name, "%s%s", prefix, what), name)
    if (pos) {
        lp->posw = pos_groups == 1 ? param_add(t, NAME("attn.pos.w"), 0, 1, pos_m)
                                   : param_add(t, NAME("attn.pos.w"), 0, 2, pos_groups, pos_m);
        lp->posb = param_add(t, NAME("attn.pos.b"), 0, 1, pos_groups);
    }
    if (ATTN_POSITION == ATTN_POSITION_REL_BIAS)
        lp->relw = param_add(t, NAME("attn.rel_bias"), 0, 2, H, CONFIG_POSITION_REL_BUCKETS);
#undef NAME
}

float *block_sinusoid_table_dev(int T, int C) {
    size_t n = (size_t)T * C;
    float *pe = xmalloc(n * sizeof(float));
    for (int t = 0; t < T; t++)
        for (int i = 0; i < C; i += 2) {
            double f = pow(10000.0, -(double)i / C);
            pe[(size_t)t * C + i] = (float)sin(t * f);
            if (i + 1 < C) pe[(size_t)t * C + i + 1] = (float)cos(t * f);
        }
    float *dev = dev_alloc(n * sizeof(float));
    dev_upload(dev, pe, n * sizeof(float));
    free(pe);
    return dev;
}

float *block_rope_table_dev(int T, int hd) {
    return ATTN_POSITION == ATTN_POSITION_ROPE ? attn_rope_table_dev(T, hd, (double)CONFIG_POSITION_ROPE_BASE) : NULL;
}

/* The scheme's Kconfig symbol (the table row's kconfig column) after its second underscore, in lower case:
 * "rope", "alibi", "rel_bias", "sinusoidal". */
const char *block_position_kind(const char *learned_kind) {
    static char kind[32];
    if (ATTN_POSITION == ATTN_POSITION_ABSOLUTE) return learned_kind;
    if (!kind[0]) {
        const char *sym = strchr(strchr(attn_positions[ATTN_POSITION].kconfig, '_') + 1, '_') + 1;
        for (size_t i = 0; sym[i] && i + 1 < sizeof kind; i++) kind[i] = (char)tolower((unsigned char)sym[i]);
    }
    return kind;
}

/* ------------------------------------------------------------------ descriptions */

cJSON *attention_json(int variant, int pos, int pos_m, int pos_groups, int heads, int kv_heads) {
    cJSON *a = cJSON_CreateObject();
    cJSON_AddStringToObject(a, "variant", attn_variant_id(variant, pos));
    cJSON_AddStringToObject(a, "label", attn_variant_label(variant, pos));
    cJSON_AddNumberToObject(a, "projections", attn_num_proj(variant));
    cJSON_AddBoolToObject(a, "pos", pos);
    cJSON_AddNumberToObject(a, "pos_dim", pos_m);
    cJSON_AddNumberToObject(a, "pos_groups", pos_groups);
    cJSON_AddStringToObject(a, "scale", "1/sqrt(head_dim)");
    if (attn_kv_count(heads, kv_heads) != heads) cJSON_AddNumberToObject(a, "kv_heads", kv_heads);
    /* the position scheme, when it is not the family's own absolute one (descriptions of such models stay as
     * they were): a checkpoint of another scheme or setting is refused by name */
    if (ATTN_POSITION != ATTN_POSITION_ABSOLUTE) {
        cJSON_AddStringToObject(a, "positions", block_position_kind(""));
        if (ATTN_POSITION == ATTN_POSITION_ROPE) cJSON_AddNumberToObject(a, "rope_base", CONFIG_POSITION_ROPE_BASE);
        if (ATTN_POSITION == ATTN_POSITION_REL_BIAS) {
            cJSON_AddNumberToObject(a, "rel_buckets", CONFIG_POSITION_REL_BUCKETS);
            cJSON_AddNumberToObject(a, "rel_max_distance", CONFIG_POSITION_REL_MAX_DISTANCE);
        }
    }
    return a;
}

double json_float(float x) {
    char s[32];
    snprintf(s, sizeof s, "%g", (double)x);
    return strtod(s, NULL);
}

/* ------------------------------------------------------------------ decoding */

size_t kv_cache_bytes_per_token(int L, int kv_dim, int variant) {
    return (size_t)L * (size_t)attn_cache_tensors(variant) * (size_t)kv_dim * sizeof(act_t);
}

void kv_cache_init(KVCache *c, int L, int N, int T, int kv_dim, int variant) {
    int C = kv_dim; /* the row width of the cache */
    c->L = L, c->N = N, c->T = T, c->C = C, c->len = 0;
    c->tensors = attn_cache_tensors(variant);
    size_t n = (size_t)L * N * T * C;
    c->keys = dev_alloc(n * sizeof(act_t));
    c->values = c->tensors == 2 ? dev_alloc(n * sizeof(act_t)) : c->keys;
    c->tmp = N > 1 ? dev_alloc((size_t)N * T * C * sizeof(act_t)) : NULL; /* one sequence never reorders */
    c->idx = dev_alloc((size_t)N * sizeof(int));
}

void kv_cache_free(KVCache *c) {
    if (c->values != c->keys) dev_free(c->values);
    dev_free(c->keys), dev_free(c->tmp), dev_free(c->idx);
    c->keys = c->values = c->tmp = NULL, c->idx = NULL;
}

void kv_cache_reorder(KVCache *c, const int *parent) {
    if (!c->len) return;
    if (!c->tmp) FATAL("kv_cache_reorder: a cache of one sequence has nothing to reorder");
    dev_upload(c->idx, parent, (size_t)c->N * sizeof(int));
    size_t row = (size_t)c->T * c->C, used = (size_t)c->len * c->C;
    for (int tensor = 0; tensor < c->tensors; tensor++)
        for (int l = 0; l < c->L; l++) {
            act_t *cache = (tensor == 0 ? c->keys : c->values) + (size_t)l * c->N * row;
            rows_gather(c->tmp, used, cache, row, c->idx, c->N, used);
            dev_copy_rows(cache, row, c->tmp, used, c->N, used);
        }
}

void decode_scratch_init(DecodeScratch *sc, int N, int C, int H, int mlp, int proj_width) {
    size_t nc = (size_t)N * C * sizeof(act_t), nm = (size_t)N * mlp * sizeof(act_t);
    sc->ln = dev_alloc(nc), sc->att = dev_alloc(nc), sc->branch = dev_alloc(nc);
    sc->xq = dev_alloc(nc), sc->xatt = dev_alloc(nc);
    sc->mean = dev_alloc((size_t)N * sizeof(float)), sc->rstd = dev_alloc((size_t)N * sizeof(float));
    sc->proj = dev_alloc((size_t)N * proj_width * sizeof(act_t));
    sc->fc = dev_alloc(nm), sc->fc_act = dev_alloc(nm);
    sc->xlse = dev_alloc((size_t)N * H * sizeof(float));
}

void decode_scratch_free(DecodeScratch *sc) {
    dev_free(sc->ln), dev_free(sc->att), dev_free(sc->branch), dev_free(sc->xq), dev_free(sc->xatt);
    dev_free(sc->mean), dev_free(sc->rstd), dev_free(sc->proj), dev_free(sc->fc), dev_free(sc->fc_act);
    dev_free(sc->xlse);
    memset(sc, 0, sizeof *sc);
}

void block_decode(act_t *x, int t, KVCache *cache, int layer, const float *params, const BlockParams *p,
                  const DecodeCross *cross, const BlockShape *s, DecodeScratch *sc) {
    int N = s->B, C = s->C, H = s->H, PW = block_proj_width(s), kvC = attn_kv_width(C, H, s->kv_heads);
    if (N != cache->N || kvC != cache->C || t < 0 || t >= cache->T || layer < 0 || layer >= cache->L)
        FATAL("block_decode: %d rows with K/V width %d at position %d of layer %d, the cache holds %d x %d x %d of "
              "%d layers", N, kvC, t, layer, cache->N, cache->T, cache->C, cache->L);
    size_t nc = (size_t)N * C, row = (size_t)cache->T * kvC;
    int qo = attn_block_offset(ATTN_VARIANT, attn_query_block(ATTN_VARIANT), C, kvC);
    int ko = attn_block_offset(ATTN_VARIANT, attn_key_block(ATTN_VARIANT), C, kvC);
    int vo = attn_block_offset(ATTN_VARIANT, attn_value_block(ATTN_VARIANT), C, kvC);
    act_t *keys = cache->keys + (size_t)layer * N * row, *values = cache->values + (size_t)layer * N * row;
    /* self-attention over positions 0..t, this position's key-role and value-role rows cached first */
    layernorm_forward(sc->ln, sc->mean, sc->rstd, x, W(p->ln1w), WB(s->bias, p->ln1b), N, C);
    linear_forward(sc->proj, sc->ln, W(p->attnw), WB(s->attn_bias, p->attnb), N, C, PW);
    dev_copy_rows(keys + (size_t)t * kvC, row, sc->proj + ko, (size_t)PW, N, (size_t)kvC);
    if (cache->tensors == 2) dev_copy_rows(values + (size_t)t * kvC, row, sc->proj + vo, (size_t)PW, N, (size_t)kvC);
    AttnPos pos = attn_pos(params, p, s);
    attention_decode(sc->att, sc->proj + qo, PW, keys, values, cache->T, t, N, H, C / H, s->kv_heads,
                     pos_arg(&pos, s));
    linear_forward(sc->branch, sc->att, W(p->projw), WB(s->bias, p->projb), N, C, C);
    /* each residual add below is fused with the layernorm after it (one op, the same values: a launch less per
     * sum on a GPU, where decoding a token is many small launches) */
    if (cross) { /* cross-attention to the encoder output (QKV) */
        const DecBlockParams *d = cross->p;
        residual_layernorm_forward(x, sc->ln, sc->mean, sc->rstd, x, sc->branch, W(d->lnxw), WB(s->bias, d->lnxb),
                                   N, C);
        linear_forward(sc->xq, sc->ln, W(d->xqw), WB(s->bias, d->xqb), N, C, C);
        CrossAttnArgs xa = {.B = N, .Tq = 1, .Tk = cross->S, .H = H, .hd = C / H, .key_pad = cross->src_pad};
        cross_attention_forward(sc->xatt, sc->xlse, sc->xq, cross->xkv, &xa);
        linear_forward(sc->branch, sc->xatt, W(d->xprojw), WB(s->bias, d->xprojb), N, C, C);
    }
    /* MLP */
    residual_layernorm_forward(x, sc->ln, sc->mean, sc->rstd, x, sc->branch, W(p->ln2w), WB(s->bias, p->ln2b), N,
                               C);
    mlp_first_product(sc->fc, sc->fc_act, sc->ln, params, p, s, N);
    linear_forward(sc->branch, sc->fc_act, W(p->fcpw), WB(s->bias, p->fcpb), N, s->mlp, C);
    residual_forward(x, x, sc->branch, nc);
}
