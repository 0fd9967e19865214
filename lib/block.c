#include "block.h"

#include "common.h"
#include "kernels.h"

#define ALIGN16(n) (((n) + 15) / 16 * 16) /* every array starts 64-byte aligned */

/* dropout sites inside a block */
enum { SITE_ATTN_PROBS, SITE_ATTN_OUT, SITE_MLP_OUT };

static size_t bt(const BlockShape *s) { return (size_t)s->B * s->T; }

size_t block_act_floats(const BlockShape *s) {
    size_t n = bt(s) * s->C, P = (size_t)attn_num_proj(ATTN_VARIANT);
    /* ln1 atty res2 ln2 out | means and rstds | proj | lse | fch fch_act */
    return ALIGN16(n) * 5 + ALIGN16(bt(s)) * 4 + ALIGN16(n * P) + ALIGN16((size_t)s->B * s->H * s->T) +
           ALIGN16(bt(s) * s->mlp) * 2;
}

BlockActs block_acts_at(float *mem, const BlockShape *s) {
    size_t n = bt(s) * s->C, P = (size_t)attn_num_proj(ATTN_VARIANT);
    BlockActs a;
    float *p = mem;
#define TAKE(field, count) (a.field = p, p += ALIGN16(count))
    TAKE(ln1, n);
    TAKE(ln1_mean, bt(s));
    TAKE(ln1_rstd, bt(s));
    TAKE(proj, n * P);
    TAKE(atty, n);
    TAKE(att_lse, (size_t)s->B * s->H * s->T);
    TAKE(res2, n);
    TAKE(ln2, n);
    TAKE(ln2_mean, bt(s));
    TAKE(ln2_rstd, bt(s));
    TAKE(fch, bt(s) * s->mlp);
    TAKE(fch_act, bt(s) * s->mlp);
    TAKE(out, n);
#undef TAKE
    return a;
}

size_t block_scratch_floats(const BlockShape *s) {
    size_t n = bt(s) * s->C, P = (size_t)attn_num_proj(ATTN_VARIANT);
    return ALIGN16(n) * 4 + ALIGN16(n * P) + ALIGN16(bt(s) * s->mlp) * 2;
}

BlockScratch block_scratch_at(float *mem, const BlockShape *s) {
    size_t n = bt(s) * s->C, P = (size_t)attn_num_proj(ATTN_VARIANT);
    BlockScratch sc;
    float *p = mem;
#define TAKE(field, count) (sc.field = p, p += ALIGN16(count))
    TAKE(dbranch, n);
    TAKE(dln, n);
    TAKE(datty, n);
    TAKE(branch, n);
    TAKE(dproj, n * P);
    TAKE(dfch_act, bt(s) * s->mlp);
    TAKE(dfch, bt(s) * s->mlp);
#undef TAKE
    return sc;
}

static AttnArgs attn_args(const BlockShape *s) {
    AttnArgs a = {.B = s->B, .T = s->T, .H = s->H, .hd = s->C / s->H, .causal = s->causal, .key_pad = s->key_pad,
                  .dropout = s->dropout, .seed = dropout_seed(s->seed, 0, SITE_ATTN_PROBS)};
    return a;
}

static AttnPos attn_pos(const float *params, const BlockParams *p, const BlockShape *s) {
    AttnPos pos = {.m = s->pos_m, .groups = s->pos_groups, .w = params + p->posw, .b = params + p->posb,
                   .feat = s->pos_feat, .T = s->pos_T};
    return pos;
}

#define W(off) (params + (off))
#define WB(flag, off) ((flag) ? params + (off) : NULL)

void block_forward(BlockActs *a, const float *x, const float *params, const BlockParams *p, const BlockShape *s,
                   BlockScratch *sc) {
    int N = (int)bt(s), C = s->C, P = attn_num_proj(ATTN_VARIANT);
    size_t n = bt(s) * C;
    layernorm_forward(a->ln1, a->ln1_mean, a->ln1_rstd, x, W(p->ln1w), WB(s->bias, p->ln1b), N, C);
    linear_forward(a->proj, a->ln1, W(p->attnw), WB(s->attn_bias, p->attnb), N, C, P * C);
    AttnArgs args = attn_args(s);
    AttnPos pos = attn_pos(params, p, s);
    attention_forward(a->atty, a->att_lse, a->proj, s->pos ? &pos : NULL, &args);
    linear_forward(sc->branch, a->atty, W(p->projw), WB(s->bias, p->projb), N, C, C);
    if (s->dropout > 0.0f)
        dropout_forward(sc->branch, sc->branch, n, s->dropout, dropout_seed(s->seed, 0, SITE_ATTN_OUT));
    residual_forward(a->res2, x, sc->branch, n);

    layernorm_forward(a->ln2, a->ln2_mean, a->ln2_rstd, a->res2, W(p->ln2w), WB(s->bias, p->ln2b), N, C);
    linear_forward(a->fch, a->ln2, W(p->fcw), WB(s->bias, p->fcb), N, C, s->mlp);
    if (s->gelu)
        gelu_forward(a->fch_act, a->fch, (size_t)N * s->mlp);
    else
        relu_forward(a->fch_act, a->fch, (size_t)N * s->mlp);
    linear_forward(sc->branch, a->fch_act, W(p->fcpw), WB(s->bias, p->fcpb), N, s->mlp, C);
    if (s->dropout > 0.0f)
        dropout_forward(sc->branch, sc->branch, n, s->dropout, dropout_seed(s->seed, 0, SITE_MLP_OUT));
    residual_forward(a->out, a->res2, sc->branch, n);
}

/* Gradient through a dropout site: mask * dres / (1-p), or dres itself. */
static const float *through_dropout(const BlockShape *s, BlockScratch *sc, const float *dres, size_t n, int site) {
    if (s->dropout <= 0.0f) return dres;
    dev_zero(sc->dbranch, n * sizeof(float));
    dropout_backward(sc->dbranch, dres, n, s->dropout, dropout_seed(s->seed, 0, (uint64_t)site));
    return sc->dbranch;
}

#define G(off) (grads + (off))
#define GB(flag, off) ((flag) ? grads + (off) : NULL)

void block_backward(float *dres, float *grads, const BlockActs *a, const float *x, const float *params,
                    const BlockParams *p, const BlockShape *s, BlockScratch *sc) {
    int N = (int)bt(s), C = s->C, P = attn_num_proj(ATTN_VARIANT);
    size_t n = bt(s) * C, nm = bt(s) * s->mlp;

    /* MLP sublayer */
    const float *dbranch = through_dropout(s, sc, dres, n, SITE_MLP_OUT);
    dev_zero(sc->dfch_act, nm * sizeof(float));
    linear_backward(sc->dfch_act, G(p->fcpw), GB(s->bias, p->fcpb), dbranch, a->fch_act, W(p->fcpw), N, s->mlp, C);
    dev_zero(sc->dfch, nm * sizeof(float));
    if (s->gelu)
        gelu_backward(sc->dfch, a->fch, sc->dfch_act, nm);
    else
        relu_backward(sc->dfch, a->fch, sc->dfch_act, nm);
    dev_zero(sc->dln, n * sizeof(float));
    linear_backward(sc->dln, G(p->fcw), GB(s->bias, p->fcb), sc->dfch, a->ln2, W(p->fcw), N, C, s->mlp);
    layernorm_backward(dres, G(p->ln2w), GB(s->bias, p->ln2b), sc->dln, a->res2, W(p->ln2w), a->ln2_mean,
                       a->ln2_rstd, N, C);

    /* attention sublayer */
    dbranch = through_dropout(s, sc, dres, n, SITE_ATTN_OUT);
    dev_zero(sc->datty, n * sizeof(float));
    linear_backward(sc->datty, G(p->projw), GB(s->bias, p->projb), dbranch, a->atty, W(p->projw), N, C, C);
    dev_zero(sc->dproj, n * P * sizeof(float));
    AttnArgs args = attn_args(s);
    AttnPos pos = attn_pos(params, p, s);
    AttnPosGrad dpos = {.dw = G(p->posw), .db = G(p->posb)};
    attention_backward(sc->dproj, s->pos ? &dpos : NULL, sc->datty, a->proj, a->atty, a->att_lse,
                       s->pos ? &pos : NULL, &args);
    dev_zero(sc->dln, n * sizeof(float));
    linear_backward(sc->dln, G(p->attnw), GB(s->attn_bias, p->attnb), sc->dproj, a->ln1, W(p->attnw), N, C, P * C);
    layernorm_backward(dres, G(p->ln1w), GB(s->bias, p->ln1b), sc->dln, x, W(p->ln1w), a->ln1_mean, a->ln1_rstd, N,
                       C);
}
