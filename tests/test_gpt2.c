/* GPT-2 model tests for the variant this binary is built for:
 *  - parameter counts against the reference's oracles (attention-variants.md 4);
 *  - the whole model against a float64 reference composed from tests/ref.c:
 *    the loss, and every parameter's gradient against central differences;
 *  - determinism of forward and backward. */
#define _GNU_SOURCE
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "attention.h"
#include "common.h"
#include "kernels.h"
#include "gpt2/model.h"
#include "gpt2/sample.h"
#include "checkpoint.h"
#include "model_check.h"
#include "ref.h"
#include "test.h"

/* The paper's char GPT: V=65, C=192, T=64, L=6, H=3, ReLU, no Q/K/V bias,
 * other biases, untied head with bias. */
static GPT2Config char_gpt(void) {
    GPT2Config c = {.V = 65, .T = 64, .L = 6, .H = 3, .C = 192, .bias = 1, .attn_bias = 0, .tie = 0, .head_bias = 1,
                    .gelu = 0, .variant = ATTN_VARIANT, .pos = ATTN_POS, .pos_m = ATTN_POS_DIM,
                    .pos_groups = ATTN_POS ? (ATTN_POS_PER_HEAD ? 3 : 1) : 0};
    return c;
}

/* Parameter counts are a pure function of the configuration, so every
 * variant and +Pos setting is checked in every build, not only the built one. */
/* A model's parameter count as the oracles state it: with GPT-2's learned absolute positions. */
static long oracle_count(const GPT2Config *c) {
    return (long)gpt2_num_params(c) - position_param_delta(c->L, c->H, c->T, c->C);
}

static void test_param_counts(void) {
    /* attention-variants.md table 4, char GPT row, without +Pos */
    static const long base[ATTN_NUM_VARIANTS] = {[ATTN_QKV] = 2703425, [ATTN_KV] = 2482241, [ATTN_K] = 2261057,
                                                 [ATTN_KV_TYING] = 2482241};
    for (int v = 0; v < ATTN_NUM_VARIANTS; v++) {
        const char *name = attn_variant_label(v, 0);
        CHECK(base[v] > 0, "no char-GPT parameter-count oracle for variant %s (add it from its definition)", name);
        GPT2Config c = char_gpt();
        c.variant = v, c.pos = 0, c.pos_m = 0, c.pos_groups = 0;
        CHECK((long)oracle_count(&c) == base[v], "%s char-GPT parameter count %ld, oracle %ld", name,
              oracle_count(&c), base[v]);
        for (int groups = 1; groups <= c.H; groups += c.H - 1) { /* +Pos per layer and per head, m = 20 */
            GPT2Config p = c;
            p.pos = 1, p.pos_m = 20, p.pos_groups = groups;
            CHECK((long)oracle_count(&p) == base[v] + (long)c.L * groups * 21, "%s+Pos (%d groups) count %ld",
                  name, groups, oracle_count(&p));
        }
        /* GPT-2 124M (tied head, biases, V = 50257, T = 1024): 124,439,808 parameters for QKV
         * (formats.md 2.1, llm.c's count with the unpadded vocabulary); each projection
         * fewer removes C^2 + C per layer */
        GPT2Config g = {.V = 50257, .T = 1024, .L = 12, .H = 12, .C = 768, .bias = 1, .attn_bias = 1, .tie = 1,
                        .gelu = 1, .variant = v};
        long want124 = 124439808L - 12L * (3 - attn_num_proj(v)) * (768L * 768 + 768);
        CHECK((long)oracle_count(&g) == want124, "GPT-2 124M %s: %ld parameters, expected %ld", name,
              oracle_count(&g), want124);
        /* matmul parameters: fewer projections, fewer parameters and FLOPs */
        size_t per_layer = (size_t)(attn_num_proj(v) + 1 + 8) * 192 * 192;
        CHECK(gpt2_matmul_params(&c) == 6 * per_layer + 65 * 192, "%s matmul parameter count", name);
        CHECK(fabs(gpt2_flops_per_token(&c, 64) - (6.0 * (6 * per_layer + 65 * 192) + 12.0 * 6 * 64 * 192)) < 1,
              "%s FLOPs per token = 6 N_matmul + 12 L T C", name);
    }
    /* the oracle rows with +Pos, m = 20: KV+Pos 2,482,619 per head / 2,482,367 per layer; K+Pos 2,261,435 per head */
    GPT2Config c = char_gpt();
    c.pos = 1, c.pos_m = 20;
    c.variant = ATTN_KV, c.pos_groups = 3;
    CHECK(oracle_count(&c) == 2482619, "KV+Pos per head oracle");
    c.pos_groups = 1;
    CHECK(oracle_count(&c) == 2482367, "KV+Pos per layer oracle");
    c.variant = ATTN_K, c.pos_groups = 3;
    CHECK(oracle_count(&c) == 2261435, "K+Pos per head oracle");
    /* grouped K/V heads (QKV and KV tying): the k and v blocks shrink from C x C to G*hd x C (plus G*hd biases),
     * the query stays; worked out by hand:
     *   char GPT, no Q/K/V bias, MQA (G = 1, hd 64): QKV 2,703,425 - 6 layers x 2 x 128 x 192 = 2,408,513;
     *     KV tying 2,482,241 - 6 x 128 x 192 = 2,334,785;
     *   GPT-2 124M (biases), QKV: G = 4 removes 12 x 2 x 512 x 769 = 9,449,472 -> 114,990,336;
     *     MQA removes 12 x 2 x 704 x 769 -> 111,446,784; KV tying + MQA: 124,439,808 - 12 (768^2 + 768)
     *     - 12 x 704 x 769 = 110,856,192 */
    {
        GPT2Config q = char_gpt();
        q.pos = 0, q.pos_m = 0, q.pos_groups = 0, q.kv_heads = 1;
        q.variant = ATTN_QKV;
        CHECK(oracle_count(&q) == 2408513, "char-GPT QKV with MQA: %ld parameters, expected 2,408,513",
              oracle_count(&q));
        q.variant = ATTN_KV_TYING;
        CHECK(oracle_count(&q) == 2334785, "char-GPT KV tying with MQA: %ld parameters, expected 2,334,785",
              oracle_count(&q));
        q.kv_heads = 3; /* G = H: standard */
        CHECK(oracle_count(&q) == 2482241, "char-GPT KV tying with K/V heads = H is the standard count");
        GPT2Config g = {.V = 50257, .T = 1024, .L = 12, .H = 12, .C = 768, .bias = 1, .attn_bias = 1, .tie = 1,
                        .gelu = 1, .variant = ATTN_QKV, .kv_heads = 4};
        CHECK(oracle_count(&g) == 114990336, "GPT-2 124M QKV, 4 K/V heads: %ld parameters, expected 114,990,336",
              oracle_count(&g));
        g.kv_heads = 1;
        CHECK(oracle_count(&g) == 111446784, "GPT-2 124M QKV, MQA: %ld parameters, expected 111,446,784",
              oracle_count(&g));
        g.variant = ATTN_KV_TYING;
        CHECK(oracle_count(&g) == 110856192, "GPT-2 124M KV tying, MQA: %ld parameters, expected 110,856,192",
              oracle_count(&g));
        /* KV cache per token: layers x tensors x G x hd activations (QKV: K and V; KV tying: V only) */
        const size_t A = sizeof(act_t);
        g.variant = ATTN_QKV, g.kv_heads = 4;
        CHECK(gpt2_cache_bytes_per_token(&g) == 12 * 2 * 256 * A, "124M QKV, 4 K/V heads: cache %zu bytes per "
              "token, expected 24,576 in float32", gpt2_cache_bytes_per_token(&g));
        g.kv_heads = 1;
        CHECK(gpt2_cache_bytes_per_token(&g) == 12 * 2 * 64 * A, "124M QKV, MQA: cache %zu bytes per token, "
              "expected 6,144 in float32", gpt2_cache_bytes_per_token(&g));
        g.variant = ATTN_KV_TYING;
        CHECK(gpt2_cache_bytes_per_token(&g) == 12 * 1 * 64 * A, "124M KV tying, MQA: cache %zu bytes per token, "
              "expected 3,072 in float32", gpt2_cache_bytes_per_token(&g));
        g.kv_heads = 0;
        CHECK(gpt2_cache_bytes_per_token(&g) == 12 * 1 * 768 * A, "124M KV tying: cache %zu bytes per token",
              gpt2_cache_bytes_per_token(&g));
        /* matmul parameters and FLOPs: the projection is (C + 2 G hd) x C; the attention products stay 12 L T C */
        q = char_gpt();
        q.variant = ATTN_QKV, q.kv_heads = 1;
        size_t per_layer = (size_t)192 * (192 + 2 * 64) + 9 * 192 * 192;
        CHECK(gpt2_matmul_params(&q) == 6 * per_layer + 65 * 192, "char-GPT QKV MQA matmul parameters %zu",
              gpt2_matmul_params(&q));
        CHECK(fabs(gpt2_flops_per_token(&q, 64) - (6.0 * (6 * per_layer + 65 * 192) + 12.0 * 6 * 64 * 192)) < 1,
              "char-GPT QKV MQA FLOPs per token = 6 N_matmul + 12 L T C");
    }
    /* the model the build is for allocates exactly its table */
    GPT2Config b = char_gpt();
    GPT2 m;
    gpt2_init(&m, &b, 1);
    CHECK(m.w.table.count == gpt2_num_params(&b), "built %s model: %zu parameters", attn_variant_label(ATTN_VARIANT,
          ATTN_POS), m.w.table.count);
    gpt2_free(&m);
}

/* ------------------------------------------------------------------ float64 reference model */

typedef struct {
    GPT2 *m;
    double *P; /* parameters in double, same table */
    const int *in, *tg;
    int B, T;
} RefCtx;

static double ref_loss(void *vctx) {
    RefCtx *r = vctx;
    const GPT2 *m = r->m;
    const GPT2Config *c = &m->cfg;
    const double *P = r->P;
    int B = r->B, T = r->T, C = c->C, V = c->V, PW = ref_proj_width(c->variant, c->H, c->C / c->H, c->kv_heads);
    size_t BT = (size_t)B * T, n = BT * C;
    double *x = xmalloc(n * sizeof(double)), *ln = xmalloc(n * sizeof(double));
    double *proj = xmalloc(n / C * PW * sizeof(double)), *att = xmalloc(n * sizeof(double));
    double *br = xmalloc(n * sizeof(double)), *fc = xmalloc(4 * n * sizeof(double));
    double *act = xmalloc(4 * n * sizeof(double)), *logits = xmalloc(BT * V * sizeof(double));
    for (size_t i = 0; i < BT; i++)
        for (int k = 0; k < C; k++) x[i * C + k] = P[m->wte + (size_t)r->in[i] * C + k] + ref_abs_position(P, m->wpe, (int)(i % T), k, C);
    for (int l = 0; l < c->L; l++) {
        const BlockParams *lp = &m->layer[l];
        ref_layernorm(ln, x, P + lp->ln1w, c->bias ? P + lp->ln1b : NULL, (int)BT, C);
        ref_linear(proj, ln, P + lp->attnw, c->attn_bias ? P + lp->attnb : NULL, (int)BT, C, PW);
        RefPositions pe = ref_layer_positions(P, lp);
        ref_self_attention_pe(att, proj, c->variant, B, T, c->H, C / c->H, c->kv_heads, 1, NULL,
                              c->pos ? P + lp->posw : NULL, c->pos ? P + lp->posb : NULL, c->pos_m, c->pos_groups, 0.0,
                              0, &pe);
        ref_linear(br, att, P + lp->projw, c->bias ? P + lp->projb : NULL, (int)BT, C, C);
        for (size_t i = 0; i < n; i++) x[i] += br[i];
        ref_layernorm(ln, x, P + lp->ln2w, c->bias ? P + lp->ln2b : NULL, (int)BT, C);
        ref_linear(fc, ln, P + lp->fcw, c->bias ? P + lp->fcb : NULL, (int)BT, C, 4 * C);
        if (c->gelu)
            ref_gelu(act, fc, 4 * n);
        else
            ref_relu(act, fc, 4 * n);
        ref_linear(br, act, P + lp->fcpw, c->bias ? P + lp->fcpb : NULL, (int)BT, 4 * C, C);
        for (size_t i = 0; i < n; i++) x[i] += br[i];
    }
    ref_layernorm(ln, x, P + m->lnfw, c->bias ? P + m->lnfb : NULL, (int)BT, C);
    ref_linear(logits, ln, P + m->headw, !c->tie && c->head_bias ? P + m->headb : NULL, (int)BT, C, V);
    double loss = ref_crossentropy(logits, r->tg, (int)BT, V, -1, 0.0);
    free(x), free(ln), free(proj), free(att), free(br), free(fc), free(act), free(logits);
    return loss;
}

/* Multiplies every parameter by f (through host memory: model buffers are the backend's). */
static void scale_params(GPT2 *m, float f) {
    float *p = params_to_host(&m->w, m->w.params);
    for (size_t k = 0; k < m->w.table.total; k++) p[k] *= f;
    params_from_host(&m->w, m->w.params, p);
    free(p);
}

/* One forward and backward pass on given tokens (attn_grads_only_errors) */
typedef struct {
    GPT2 *m;
    const int *in, *tg;
    int B, T;
} Pass;

static void pass(void *v) {
    Pass *p = v;
    gpt2_forward(p->m, p->in, p->tg, p->B, p->T, 1, 0);
    params_zero_grad(&p->m->w);
    gpt2_backward(p->m, 1.0f);
}

static void model_case(const char *name, GPT2Config c, int B, int T) {
    GPT2 m;
    gpt2_init(&m, &c, 7);
    float *hp = perturb_params(&m.w, 8.0f); /* weights far above GPT-2's 0.02 init: attention is not uniform */
    int *in = xmalloc((size_t)B * T * sizeof(int)), *tg = xmalloc((size_t)B * T * sizeof(int));
    for (int i = 0; i < B * T; i++) {
        in[i] = (i * 7 + 3) % c.V;
        tg[i] = (i * 5 + 1) % c.V;
    }
    tg[2] = -1; /* an ignored target */
    double loss = gpt2_forward(&m, in, tg, B, T, 1, 0);
    params_zero_grad(&m.w);
    gpt2_backward(&m, 1.0f);
    RefCtx r = {&m, xmalloc(m.w.table.total * sizeof(double)), in, tg, B, T};
    for (size_t k = 0; k < m.w.table.total; k++) r.P[k] = hp[k];
    double want = ref_loss(&r);
    CHECK(fabs(loss - want) <= 1e-5 * fabs(want), "%s: loss %.8f, float64 reference %.8f", name, loss, want);
    /* every tensor's gradient against central differences of the reference */
    double worst_rel;
    int bad = gradcheck(name, &m.w, r.P, ref_loss, &r, 24, &worst_rel);
    CHECK(bad == 0, "%s: %d of %d tensors have gradients off the finite differences (worst relative %.3g)", name,
          bad, m.w.table.n, worst_rel);
    CHECK(param_layout_errors(name, &m.w) == 0, "%s: %zu parameters in %zu floats: tensors aligned, fused blocks "
          "adjacent, the gaps zero after a backward pass", name, m.w.table.count, m.w.table.total);
    /* determinism: the same pass twice gives bit-identical gradients */
    float *g1 = params_to_host(&m.w, m.w.grads);
    double loss2 = gpt2_forward(&m, in, tg, B, T, 1, 0);
    params_zero_grad(&m.w);
    gpt2_backward(&m, 1.0f);
    float *g2 = params_to_host(&m.w, m.w.grads);
    CHECK(loss2 == loss && memcmp(g1, g2, m.w.table.total * sizeof(float)) == 0,
          "%s: repeated forward/backward is bit-identical", name);
    free(g1), free(g2), free(hp);
    /* an analysis's pass (mechint's masks): the attention projections' gradients alone, the same bits */
    Pass ps = {&m, in, tg, B, T};
    const BlockParams **bl = xmalloc((size_t)c.L * sizeof *bl);
    for (int l = 0; l < c.L; l++) bl[l] = &m.layer[l];
    CHECK(attn_grads_only_errors(name, &m.w, pass, &ps, bl, c.L) == 0, "%s: with attn_grads_only the projections' "
          "gradients are the same bits, the output projection's and the MLP's skipped", name);
    free(bl);
    free(r.P);
    free(in);
    free(tg);
    gpt2_free(&m);
}

static void test_dropout_changes_training_only(void) {
    GPT2Config c = {.V = 13, .T = 8, .L = 1, .H = 2, .C = 8, .bias = 1, .attn_bias = 1, .tie = 1, .gelu = 1,
                    .dropout = 0.3f, .variant = ATTN_VARIANT, .pos = ATTN_POS, .pos_m = ATTN_POS_DIM,
                    .pos_groups = ATTN_POS ? (ATTN_POS_PER_HEAD ? 2 : 1) : 0};
    GPT2 m;
    gpt2_init(&m, &c, 3);
    int in[16], tg[16];
    for (int i = 0; i < 16; i++) in[i] = i % 13, tg[i] = (i + 1) % 13;
    double e1 = gpt2_forward(&m, in, tg, 2, 8, 0, 1), e2 = gpt2_forward(&m, in, tg, 2, 8, 0, 2);
    double t1 = gpt2_forward(&m, in, tg, 2, 8, 1, 1), t2 = gpt2_forward(&m, in, tg, 2, 8, 1, 2);
    double t1b = gpt2_forward(&m, in, tg, 2, 8, 1, 1);
    CHECK(e1 == e2, "evaluation ignores dropout seeds");
    CHECK(t1 != t2 && t1 == t1b, "training dropout follows its seed");
    gpt2_free(&m);
}

/* Generation with the KV cache gives the logits of the full forward pass; with H heads and kv_heads K/V
 * heads (0: one per query head). */
static void test_cache_equivalence(int H, int kv_heads) {
    int g = ATTN_POS_PER_HEAD ? H : 1;
    GPT2Config c = {.V = 17, .T = 12, .L = 2, .H = H, .C = 4 * H, .bias = 1, .attn_bias = 1, .tie = 0,
                    .head_bias = 1, .gelu = 1, .variant = ATTN_VARIANT, .pos = ATTN_POS, .pos_m = ATTN_POS_DIM,
                    .pos_groups = ATTN_POS ? g : 0, .kv_heads = kv_heads};
    GPT2 m;
    gpt2_init(&m, &c, 11);
    scale_params(&m, 10.0f); /* sharp attention */
    int toks[12] = {3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8};
    GPT2Decoder d;
    gpt2_decoder_init(&d, &m);
    double worst = 0.0, lmax = 0.0;
    float *full = xmalloc((size_t)c.V * sizeof(float)), *dec = xmalloc((size_t)c.V * sizeof(float));
    for (int t = 0; t < c.T; t++) {
        act_download(dec, gpt2_decode(&m, &d, toks[t]), (size_t)c.V);
        gpt2_forward(&m, toks, NULL, 1, t + 1, 0, 0);
        act_download(full, m.acts.logits + (size_t)t * c.V, (size_t)c.V);
        for (int v = 0; v < c.V; v++) {
            worst = fmax(worst, fabs(dec[v] - full[v]));
            lmax = fmax(lmax, fabs(full[v]));
        }
    }
    /* float32 rounding (sgemv against sgemm) is amplified by the sharp (x10) attention: up to ~2e-5 relative
     * at one near-tied position for some seeds; a wrong role or position differs by O(max |logit|) */
    CHECK(worst <= 1e-4 * lmax + 1e-5, "%s, %d K/V heads for %d: cached and uncached logits differ by %.3g (max "
          "|logit| %.3g)", attn_variant_label(ATTN_VARIANT, ATTN_POS), kv_heads ? kv_heads : H, H, worst, lmax);
    /* known answers, one per row (a new row without one fails here): K and KV tying cache one tensor, the key
     * being the value */
    static const int cache_tensors[ATTN_NUM_VARIANTS] = {[ATTN_QKV] = 2, [ATTN_KV] = 2, [ATTN_K] = 1,
                                                         [ATTN_KV_TYING] = 1};
    int tensors = cache_tensors[ATTN_VARIANT];
    CHECK(tensors > 0, "no cache-tensor count known for variant %s (add it from its definition)",
          attn_variant_label(ATTN_VARIANT, ATTN_POS));
    CHECK(d.cache.tensors == tensors && (d.cache.tensors == 2) == (d.cache.values != d.cache.keys),
          "%s caches %d tensor(s) per layer, expected %d", attn_variant_label(ATTN_VARIANT, ATTN_POS), d.cache.tensors,
          tensors);
    int G = kv_heads ? kv_heads : H;
    CHECK(gpt2_cache_bytes_per_token(&c) == (size_t)c.L * tensors * G * 4 * sizeof(act_t), "cache bytes per token");
    CHECK(d.cache.C == G * 4, "the cache keeps %d values per position, expected G x hd = %d", d.cache.C, G * 4);
    gpt2_decoder_free(&d);
    free(full), free(dec);
    gpt2_free(&m);
}

/* Save, load into a fresh model: identical parameters and moments; strict
 * errors otherwise, and a failed read leaves the model as it was. */
static void test_checkpoint_round_trip(void) {
    GPT2Config c = {.V = 13, .T = 8, .L = 2, .H = 2, .C = 8, .bias = 1, .attn_bias = 1, .tie = 1, .gelu = 1,
                    .variant = ATTN_VARIANT, .pos = ATTN_POS, .pos_m = ATTN_POS_DIM,
                    .pos_groups = ATTN_POS ? (ATTN_POS_PER_HEAD ? 2 : 1) : 0};
    GPT2 a, b;
    gpt2_init(&a, &c, 1);
    gpt2_init(&b, &c, 2);
    size_t n = a.w.table.total, bytes = n * sizeof(float);
    float *hm = xcalloc(n, sizeof(float)), *hv = xcalloc(n, sizeof(float)); /* zero in the alignment gaps */
    for (int i = 0; i < a.w.table.n; i++)
        for (size_t k = a.w.table.specs[i].offset; k < a.w.table.specs[i].offset + a.w.table.specs[i].numel; k++)
            hm[k] = 0.5f * (float)k, hv[k] = 1.0f / (1.0f + (float)k);
    params_from_host(&a.w, a.w.m, hm);
    params_from_host(&a.w, a.w.v, hv);
    char dir[] = "/tmp/kvlab_test_ckpt_XXXXXX";
    if (!mkdtemp(dir)) FATAL("mkdtemp failed");
    char path[256], path2[256];
    snprintf(path, sizeof path, "%s/state.safetensors", dir);
    snprintf(path2, sizeof path2, "%s/model.safetensors", dir);
    StMeta meta[2] = {{"family", "gpt2"}, {"variant", attn_variant_id(ATTN_VARIANT, ATTN_POS)}};
    Err e;
    CHECK(checkpoint_save_params(path, &a.w, 1, meta, 2, &e) == 0, "save state: %s", e.msg);
    CHECK(checkpoint_save_params(path2, &a.w, 0, meta, 2, &e) == 0, "save model: %s", e.msg);
    StFile *f = checkpoint_open(path, "gpt2", &e);
    CHECK(f != NULL, "open: %s", f ? "" : e.msg);
    if (f) {
        CHECK(checkpoint_read_params(f, &b.w, 1, &e) == 0, "read: %s", e.msg);
        float *ap = params_to_host(&a.w, a.w.params), *bp = params_to_host(&b.w, b.w.params);
        float *bm = params_to_host(&b.w, b.w.m), *bv = params_to_host(&b.w, b.w.v);
        CHECK(!memcmp(ap, bp, bytes) && !memcmp(hm, bm, bytes) && !memcmp(hv, bv, bytes),
              "parameters and moments round-trip bit for bit");
        free(ap), free(bp), free(bm), free(bv);
        CHECK(checkpoint_expect(f, "variant", attn_variant_id(ATTN_VARIANT, ATTN_POS), "", &e) == 0,
              "variant metadata round-trips");
        CHECK(checkpoint_expect(f, "variant", "something_else", "use the right binary", &e) != 0 &&
                  strstr(e.msg, "mismatched") && strstr(e.msg, path), "a wrong variant is a named mismatch: %s", e.msg);
        st_close(f);
    }
    f = checkpoint_open(path2, "vit", &e);
    CHECK(!f && strstr(e.msg, "model family 'gpt2'"), "another family is rejected: %s", e.msg);
    /* a model of another shape: missing and unexpected tensors are errors */
    GPT2Config c3 = c;
    c3.L = 1;
    GPT2 small;
    gpt2_init(&small, &c3, 3);
    f = checkpoint_open(path2, "gpt2", &e);
    if (f) {
        CHECK(checkpoint_read_params(f, &small.w, 0, &e) != 0 && strstr(e.msg, "unexpected tensor"),
              "a checkpoint with more layers is rejected: %s", e.msg);
        st_close(f);
    }
    c3.L = 3;
    GPT2 big;
    gpt2_init(&big, &c3, 3);
    f = checkpoint_open(path2, "gpt2", &e);
    if (f) {
        CHECK(checkpoint_read_params(f, &big.w, 0, &e) != 0 && strstr(e.msg, "missing"),
              "a checkpoint with fewer layers is rejected: %s", e.msg);
        st_close(f);
    }
    c3.L = 2;
    c3.C = 16;
    GPT2 wide;
    gpt2_init(&wide, &c3, 3);
    f = checkpoint_open(path2, "gpt2", &e);
    if (f) {
        CHECK(checkpoint_read_params(f, &wide.w, 0, &e) != 0 && strstr(e.msg, "wte.weight"),
              "a checkpoint of another width is rejected naming the tensor: %s", e.msg);
        st_close(f);
    }
    /* a non-finite value is reported, and the model keeps its parameters */
    float *ap = params_to_host(&a.w, a.w.params), *before = params_to_host(&b.w, b.w.params);
    ap[3] = NAN;
    CHECK(checkpoint_finite(path2, &a.w.table, ap, NULL, NULL, &e) != 0 && strstr(e.msg, "not written: tensor '") &&
              strstr(e.msg, "at index 3"),
          "checkpoint_finite names the tensor and index of a NaN: %s", e.msg);
    CHECK(checkpoint_finite(path2, &a.w.table, before, ap, NULL, &e) != 0 && strstr(e.msg, "'optim.m.") &&
              checkpoint_finite(path2, &a.w.table, before, before, before, &e) == 0,
          "... and of a moment's (as 'optim.m.<name>'); finite arrays pass: %s", e.msg);
    checkpoint_save(path2, &a.w.table, ap, NULL, NULL, meta, 2, &e); /* checkpoint_save itself writes it */
    f = checkpoint_open(path2, "gpt2", &e);
    if (f) {
        CHECK(checkpoint_read_params(f, &b.w, 0, &e) != 0 && strstr(e.msg, "non-finite"),
              "a NaN in a checkpoint is reported: %s", e.msg);
        float *after = params_to_host(&b.w, b.w.params);
        CHECK(!memcmp(before, after, bytes), "a checkpoint that fails to load leaves the model unchanged");
        free(after);
        st_close(f);
    }
    free(ap), free(before), free(hm), free(hv);
    unlink(path);
    unlink(path2);
    rmdir(dir);
    gpt2_free(&a), gpt2_free(&b), gpt2_free(&small), gpt2_free(&big), gpt2_free(&wide);
}

/* The model description records the K/V heads only when grouped (standard descriptions stay as they were),
 * and a checkpoint of another K/V head count is refused naming attention.kv_heads, either way round. */
static void test_kv_heads_description(void) {
    GPT2Config c = {.V = 13, .T = 8, .L = 1, .H = 4, .C = 16, .bias = 1, .attn_bias = 1, .tie = 1, .gelu = 1,
                    .variant = ATTN_VARIANT, .pos = ATTN_POS, .pos_m = ATTN_POS_DIM,
                    .pos_groups = ATTN_POS ? (ATTN_POS_PER_HEAD ? 4 : 1) : 0};
    char *std = gpt2_config_json(&c);
    c.kv_heads = 4;
    char *same = gpt2_config_json(&c);
    c.kv_heads = 2;
    char *gqa = gpt2_config_json(&c);
    c.kv_heads = 1;
    char *mqa = gpt2_config_json(&c);
    CHECK(!strstr(std, "kv_heads") && strcmp(std, same) == 0, "standard descriptions have no kv_heads: %s", same);
    CHECK(strstr(gqa, "\"kv_heads\":2") && strstr(mqa, "\"kv_heads\":1"), "grouped descriptions record the K/V "
          "heads: %s", gqa);
    GPT2 m;
    gpt2_init(&m, &c, 1);
    char dir[] = "/tmp/kvlab_test_kvh_XXXXXX";
    if (!mkdtemp(dir)) FATAL("mkdtemp failed");
    char path[256];
    const char *cases[3][2] = {{mqa, gqa}, {mqa, std}, {std, gqa}}; /* stored, this binary's */
    Err e;
    for (int i = 0; i < 3; i++) {
        snprintf(path, sizeof path, "%s/m%d.safetensors", dir, i);
        StMeta meta[3] = {{"family", "gpt2"}, {"variant", attn_variant_id(ATTN_VARIANT, ATTN_POS)},
                          {"model", cases[i][0]}};
        CHECK(checkpoint_save_params(path, &m.w, 0, meta, 3, &e) == 0, "save: %s", e.msg);
        StFile *f = checkpoint_open(path, "gpt2", &e);
        if (!f) continue;
        CHECK(checkpoint_expect_json(f, "model", cases[i][0], "", &e) == 0, "a description matches itself: %s", e.msg);
        CHECK(checkpoint_expect_json(f, "model", cases[i][1], "use the right binary", &e) != 0 &&
                  strstr(e.msg, "model.attention.kv_heads") && strstr(e.msg, "mismatched"),
              "a checkpoint of another K/V head count is refused by name: %s", e.msg);
        st_close(f);
        unlink(path);
    }
    rmdir(dir);
    gpt2_free(&m);
    free(std), free(same), free(gqa), free(mqa);
}

/* Top-k keeps its tokens at any temperature: with top-k 1 every sample is the greedy one, even at an
 * infinite temperature, where the weights of the masked tokens are NaN. */
static void test_sample_top_k(void) {
    Dataset d;
    Err e;
    if (dataset_load_kind(&d, DATA_NUMBERS, "", 16, &e) != 0) FATAL("%s", e.msg);
    GPT2Config c = {.V = d.V, .T = 16, .L = 1, .H = 2, .C = 8, .bias = 1, .attn_bias = 1, .tie = 1, .gelu = 1,
                    .variant = ATTN_VARIANT, .pos = ATTN_POS, .pos_m = ATTN_POS_DIM,
                    .pos_groups = ATTN_POS ? (ATTN_POS_PER_HEAD ? 2 : 1) : 0};
    GPT2 m;
    gpt2_init(&m, &c, 5);
    int prompt[1] = {1};
    char *text[2] = {NULL, NULL};
    size_t len[2];
    SampleOptions opt[2] = {{.length = 12, .top_k = 0, .use_cache = 1, .temperature = 0.0f, .seed = 3},
                            {.length = 12, .top_k = 1, .use_cache = 1, .temperature = INFINITY, .seed = 3}};
    for (int i = 0; i < 2; i++) {
        FILE *f = open_memstream(&text[i], &len[i]);
        CHECK(gpt2_generate(&m, &d, prompt, 1, &opt[i], f, &e) == 0, "generate: %s", e.msg);
        fclose(f);
    }
    CHECK(len[0] == len[1] && !memcmp(text[0], text[1], len[0]),
          "top-k 1 at an infinite temperature samples the greedy tokens: '%s' vs '%s'", text[0], text[1]);
    free(text[0]), free(text[1]);
    gpt2_free(&m);
    dataset_free(&d);
}

/* GPT-2's initialisation as gpt2/model.c states it, tensor by tensor from the names: weights N(0, 0.02), the two
 * residual projections of each layer N(0, 0.02/sqrt(2L)), LayerNorm weights 1, every bias 0, +Pos as PyTorch's
 * Linear(m, 1) U(-1/sqrt(m), 1/sqrt(m)), relative-position biases 0. */
static InitRule gpt2_init_rule(const ParamSpec *s, const void *ctx, double *x) {
    const GPT2Config *c = ctx;
    const char *n = s->name;
    *x = 0.0;
    if (strstr(n, ".rel_bias") || str_ends_with(n, ".bias")) return INIT_CONST; /* +Pos's is ".pos.b" */
    if (strstr(n, ".pos.")) return *x = 1.0 / sqrt((double)c->pos_m), INIT_UNIFORM;
    if (!strncmp(n, "ln", 2) || strstr(n, ".ln")) return *x = 1.0, INIT_CONST;
    if (str_ends_with(n, "attn.proj.weight") || str_ends_with(n, "mlp.proj.weight"))
        return *x = 0.02 / sqrt(2.0 * c->L), INIT_NORMAL;
    return *x = 0.02, INIT_NORMAL;
}
static void test_init(void) {
    GPT2Config c = char_gpt();
    c.attn_bias = 1; /* a tensor of every kind */
    GPT2 m;
    gpt2_init(&m, &c, 1);
    int bad = init_errors("GPT-2", &m.w, gpt2_init_rule, &c);
    CHECK(bad == 0, "GPT-2 initialisation: %d of %d tensors off their rule", bad, m.w.table.n);
    gpt2_free(&m);
}

int main(void) {
    backend_init(0);
    printf("gpt2 model test: attention %s\n", attn_variant_label(ATTN_VARIANT, ATTN_POS));
    test_param_counts();
    test_init();
    int g = ATTN_POS_PER_HEAD ? 2 : 1;
    GPT2Config full = {.V = 11, .T = 9, .L = 2, .H = 2, .C = 8, .bias = 1, .attn_bias = 1, .tie = 1, .gelu = 1,
                       .variant = ATTN_VARIANT, .pos = ATTN_POS, .pos_m = ATTN_POS_DIM, .pos_groups = ATTN_POS ? g : 0};
    model_case("GPT-2 wiring (biases, GELU, tied head)", full, 2, 7);
    GPT2Config paper = full;
    paper.attn_bias = 0, paper.tie = 0, paper.head_bias = 1, paper.gelu = 0;
    model_case("char-GPT wiring (ReLU, untied head with bias)", paper, 2, 9);
    GPT2Config nobias = full;
    nobias.bias = 0, nobias.attn_bias = 0;
    model_case("no biases", nobias, 1, 5);
    test_dropout_changes_training_only();
    test_cache_equivalence(2, 0);
    if (!attn_symmetric(ATTN_VARIANT)) { /* grouped K/V heads: QKV and KV tying */
        test_cache_equivalence(4, 1);
        test_cache_equivalence(4, 2);
        test_cache_equivalence(4, 4);
        GPT2Config gq = full;
        gq.H = 4, gq.C = 16, gq.kv_heads = 2, gq.pos_groups = ATTN_POS ? (ATTN_POS_PER_HEAD ? 4 : 1) : 0;
        model_case("GQA, 2 K/V heads for 4", gq, 2, 7);
        gq.kv_heads = 1, gq.tie = 0, gq.head_bias = 1, gq.gelu = 0;
        model_case("MQA, untied head", gq, 2, 5);
        test_kv_heads_description();
    }
    if (attn_kv_heads(CONFIG_GPT2_N_HEAD) != CONFIG_GPT2_N_HEAD) { /* the configured K/V heads of this build */
        GPT2Config b = gpt2_config_from_kconfig(65);
        CHECK(b.kv_heads == CONFIG_ATTN_KV_HEADS, "the build's GPT-2 has %d K/V heads, configured %d", b.kv_heads,
              CONFIG_ATTN_KV_HEADS);
        test_cache_equivalence(CONFIG_GPT2_N_HEAD, CONFIG_ATTN_KV_HEADS);
    }
    test_checkpoint_round_trip();
    test_sample_top_k();
    return TEST_SUMMARY("test_gpt2");
}
