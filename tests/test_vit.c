/* ViT tests for the attention variant this binary is built for:
 *  - parameter counts against the reference's oracles (attention-variants.md 4);
 *  - the whole model against a float64 reference composed from tests/ref.c
 *    (loss, and every parameter's gradient by central differences), with CLS
 *    pooling and a two-layer head, and with mean pooling, a final LayerNorm
 *    and a single-layer head;
 *  - a tiny overfit run that must reach 100% on a handful of images;
 *  - the data split (disjoint, seeded) and deterministic augmentation. */
#define _GNU_SOURCE
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "common.h"
#include "kernels.h"
#include "model_check.h"
#include "ref.h"
#include "rng.h"
#include "test.h"
#include "vit/data.h"
#include "vit/model.h"

static ViTConfig config(int h, int w, int c, int classes, int P, int C, int L, int H, int mlp) {
    ViTConfig v = {.img_h = h, .img_w = w, .img_c = c, .classes = classes, .P = P, .N = (h / P) * (w / P), .C = C,
                   .L = L, .H = H, .mlp = mlp, .cls = 1, .head_mlp = 1, .variant = ATTN_VARIANT, .pos = ATTN_POS,
                   .pos_m = ATTN_POS_DIM, .pos_groups = ATTN_POS ? (ATTN_POS_PER_HEAD ? H : 1) : 0};
    v.T = v.N + 1;
    return v;
}

/* Parameter counts are a pure function of the configuration: every variant
 * and +Pos setting is checked in every build. */
/* A model's parameter count as the oracles state it: with ViT's learned absolute positions. */
static long oracle_count(const ViTConfig *c) {
    return (long)vit_num_params(c) - position_param_delta(c->L, c->H, c->T, c->C);
}

static void test_param_counts(void) {
    /* attention-variants.md table 4: the paper's ViT rows without +Pos */
    static const long mnist[ATTN_NUM_VARIANTS] = {[ATTN_QKV] = 59210, [ATTN_KV] = 51018, [ATTN_K] = 42826,
                                                  [ATTN_KV_TYING] = 51018};
    static const long cifar[ATTN_NUM_VARIANTS] = {[ATTN_QKV] = 1702410, [ATTN_KV] = 1440266, [ATTN_K] = 1178122,
                                                  [ATTN_KV_TYING] = 1440266};
    for (int v = 0; v < ATTN_NUM_VARIANTS; v++) {
        const char *name = attn_variant_label(v, 0);
        CHECK(mnist[v] > 0 && cifar[v] > 0, "no ViT parameter-count oracle for variant %s (add it from its "
              "definition)", name);
        for (int groups = 0; groups <= 2; groups++) { /* no +Pos, per layer, per head (m = 50, as the paper's ViT) */
            ViTConfig a = config(28, 28, 1, 10, 7, 64, 2, 2, 64), b = config(32, 32, 3, 10, 8, 256, 4, 4, 256);
            a.variant = b.variant = v;
            a.pos = b.pos = groups > 0;
            a.pos_m = b.pos_m = groups ? 50 : 0;
            a.pos_groups = groups == 2 ? a.H : groups;
            b.pos_groups = groups == 2 ? b.H : groups;
            long pa = (long)a.L * a.pos_groups * (a.pos_m + 1), pb = (long)b.L * b.pos_groups * (b.pos_m + 1);
            CHECK((long)oracle_count(&a) == mnist[v] + pa, "ViT MNIST p=7 d=64 %s, %d +Pos groups: %ld parameters, "
                  "oracle %ld", name, a.pos_groups, oracle_count(&a), mnist[v] + pa);
            CHECK((long)oracle_count(&b) == cifar[v] + pb, "ViT CIFAR p=8 d=256 %s, %d +Pos groups: %ld parameters, "
                  "oracle %ld", name, b.pos_groups, oracle_count(&b), cifar[v] + pb);
        }
    }
    /* grouped K/V heads, by hand from the oracles: each non-query block loses (C - G hd) x C (no Q/K/V bias).
     * CIFAR d = 256, 4 layers, 4 heads of 64: QKV G = 2: 1,702,410 - 4 x 2 x 128 x 256 = 1,440,266;
     * QKV MQA: - 4 x 2 x 192 x 256 = 1,309,194; KV tying MQA: 1,440,266 - 4 x 192 x 256 = 1,243,658.
     * MNIST d = 64, 2 layers, 2 heads of 32, QKV MQA: 59,210 - 2 x 2 x 32 x 64 = 51,018 */
    ViTConfig b = config(32, 32, 3, 10, 8, 256, 4, 4, 256), a = config(28, 28, 1, 10, 7, 64, 2, 2, 64);
    b.pos = a.pos = 0, b.pos_m = a.pos_m = 0, b.pos_groups = a.pos_groups = 0;
    b.variant = a.variant = ATTN_QKV, b.kv_heads = 2, a.kv_heads = 1;
    CHECK(oracle_count(&b) == 1440266, "ViT CIFAR QKV, 2 K/V heads: %ld parameters", oracle_count(&b));
    CHECK(oracle_count(&a) == 51018, "ViT MNIST QKV, MQA: %ld parameters", oracle_count(&a));
    b.kv_heads = 1;
    CHECK(oracle_count(&b) == 1309194, "ViT CIFAR QKV, MQA: %ld parameters", oracle_count(&b));
    b.variant = ATTN_KV_TYING;
    CHECK(oracle_count(&b) == 1243658, "ViT CIFAR KV tying, MQA: %ld parameters", oracle_count(&b));
}

/* ------------------------------------------------------------------ float64 reference */

typedef struct {
    ViT *m;
    double *P, *patches;
    const int *labels;
    int B;
} RefCtx;

static double ref_loss(void *vctx) {
    RefCtx *r = vctx;
    const ViT *m = r->m;
    const ViTConfig *c = &m->cfg;
    const double *P = r->P;
    int B = r->B, C = c->C, T = c->T, N = c->N, PW = ref_proj_width(c->variant, c->H, c->C / c->H, c->kv_heads), pd = c->P * c->P * c->img_c;
    size_t n = (size_t)B * T * C;
    double *pemb = xmalloc((size_t)B * N * C * sizeof(double)), *x = xmalloc(n * sizeof(double));
    double *ln = xmalloc(n * sizeof(double)), *proj = xmalloc(n / C * PW * sizeof(double));
    double *att = xmalloc(n * sizeof(double)), *br = xmalloc(n * sizeof(double));
    double *fc = xmalloc((size_t)B * T * c->mlp * sizeof(double)), *act = xmalloc((size_t)B * T * c->mlp * sizeof(double));
    double *pooled = xcalloc((size_t)B * C, sizeof(double)), *hfc = xmalloc((size_t)B * c->mlp * sizeof(double));
    double *hact = xmalloc((size_t)B * c->mlp * sizeof(double)), *logits = xmalloc((size_t)B * c->classes * sizeof(double));
    ref_linear(pemb, r->patches, P + m->patchw, P + m->patchb, B * N, pd, C);
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int k = 0; k < C; k++) {
                double src = c->cls && t == 0 ? P[m->clstok + k] : pemb[((size_t)b * N + t - c->cls) * C + k];
                x[((size_t)b * T + t) * C + k] = src + ref_abs_position(P, m->posemb, t, k, C);
            }
    for (int l = 0; l < c->L; l++) {
        const BlockParams *lp = &m->layer[l];
        ref_layernorm(ln, x, P + lp->ln1w, P + lp->ln1b, B * T, C);
        ref_linear(proj, ln, P + lp->attnw, c->attn_bias ? P + lp->attnb : NULL, B * T, C, PW);
        RefPositions pe = ref_layer_positions(P, lp);
        ref_self_attention_pe(att, proj, c->variant, B, T, c->H, C / c->H, c->kv_heads, 0, NULL,
                              c->pos ? P + lp->posw : NULL, c->pos ? P + lp->posb : NULL, c->pos_m, c->pos_groups, 0.0,
                              0, &pe);
        ref_linear(br, att, P + lp->projw, P + lp->projb, B * T, C, C);
        for (size_t i = 0; i < n; i++) x[i] += br[i];
        ref_layernorm(ln, x, P + lp->ln2w, P + lp->ln2b, B * T, C);
        ref_linear(fc, ln, P + lp->fcw, P + lp->fcb, B * T, C, c->mlp);
        ref_gelu(act, fc, (size_t)B * T * c->mlp);
        ref_linear(br, act, P + lp->fcpw, P + lp->fcpb, B * T, c->mlp, C);
        for (size_t i = 0; i < n; i++) x[i] += br[i];
    }
    if (c->final_ln) {
        ref_layernorm(ln, x, P + m->lnfw, P + m->lnfb, B * T, C);
        memcpy(x, ln, n * sizeof(double));
    }
    for (int b = 0; b < B; b++) /* CLS: token 0; mean: all patch tokens */
        for (int t = 0; t < (c->cls ? 1 : N); t++)
            for (int k = 0; k < C; k++) pooled[(size_t)b * C + k] += x[((size_t)b * T + t) * C + k] / (c->cls ? 1 : N);
    if (c->head_mlp) {
        ref_linear(hfc, pooled, P + m->headfcw, P + m->headfcb, B, C, c->mlp);
        ref_gelu(hact, hfc, (size_t)B * c->mlp);
        ref_linear(logits, hact, P + m->headw, P + m->headb, B, c->mlp, c->classes);
    } else {
        ref_linear(logits, pooled, P + m->headw, P + m->headb, B, C, c->classes);
    }
    double loss = ref_crossentropy(logits, r->labels, B, c->classes, -1, 0.0);
    free(pemb), free(x), free(ln), free(proj), free(att), free(br), free(fc), free(act), free(pooled), free(hfc);
    free(hact), free(logits);
    return loss;
}

/* One forward and backward pass on given patches (attn_grads_only_errors) */
typedef struct {
    ViT *m;
    const float *patches;
    int *labels, B;
} Pass;

static void pass(void *v) {
    Pass *p = v;
    vit_forward(p->m, p->patches, p->labels, p->B, 1, 0);
    params_zero_grad(&p->m->w);
    vit_backward(p->m, 1.0f);
}

static void model_case(const char *name, ViTConfig c) {
    ViT m;
    vit_init(&m, &c, 5);
    float *hp = perturb_params(&m.w, 1.5f);
    int B = 3, pd = c.P * c.P * c.img_c;
    size_t np = (size_t)B * c.N * pd;
    float *patches = xmalloc(np * sizeof(float));
    for (size_t i = 0; i < np; i++) patches[i] = (float)sin(0.37 * (double)i) * 1.3f;
    int labels[3] = {2, 0, 3};
    double loss = vit_forward(&m, patches, labels, B, 1, 0);
    params_zero_grad(&m.w);
    vit_backward(&m, 1.0f);
    RefCtx r = {&m, xmalloc(m.w.table.total * sizeof(double)), xmalloc(np * sizeof(double)), labels, B};
    for (size_t k = 0; k < m.w.table.total; k++) r.P[k] = hp[k];
    for (size_t k = 0; k < np; k++) r.patches[k] = patches[k];
    double want = ref_loss(&r);
    CHECK(fabs(loss - want) <= 1e-5 * fabs(want), "%s: loss %.8f, float64 reference %.8f", name, loss, want);
    double worst_rel;
    int bad = gradcheck(name, &m.w, r.P, ref_loss, &r, 20, &worst_rel);
    CHECK(bad == 0, "%s: %d of %d tensors have gradients off the finite differences (worst relative %.3g)", name,
          bad, m.w.table.n, worst_rel);
    CHECK(param_layout_errors(name, &m.w) == 0, "%s: %zu parameters in %zu floats: tensors aligned, fused blocks "
          "adjacent, the gaps zero after a backward pass", name, m.w.table.count, m.w.table.total);
    /* an analysis's pass (mechint's masks): the attention projections' gradients alone, the same bits */
    Pass ps = {&m, patches, labels, B};
    const BlockParams **bl = xmalloc((size_t)c.L * sizeof *bl);
    for (int l = 0; l < c.L; l++) bl[l] = &m.layer[l];
    CHECK(attn_grads_only_errors(name, &m.w, pass, &ps, bl, c.L) == 0, "%s: with attn_grads_only the projections' "
          "gradients are the same bits, the output projection's and the MLP's skipped", name);
    free(bl);
    free(r.P), free(r.patches), free(patches), free(hp);
    vit_free(&m);
}

/* A handful of images a tiny ViT must learn by heart. */
static void test_overfit(void) {
    ViTConfig c = config(8, 8, 1, 8, 4, 16, 1, 2, 16);
    ViT m;
    vit_init(&m, &c, 9);
    int B = 8, pd = 16;
    float *patches = xmalloc((size_t)B * c.N * pd * sizeof(float));
    int labels[8];
    Rng rng = rng_seeded(3, 4);
    for (int b = 0; b < B; b++) {
        labels[b] = b;
        for (int i = 0; i < c.N * pd; i++) patches[(size_t)b * c.N * pd + i] = (float)rng_normal(&rng);
    }
    double loss = 0.0;
    int correct = 0;
    for (int it = 1; it <= 150; it++) {
        params_zero_grad(&m.w);
        loss = vit_forward(&m, patches, labels, B, 1, (uint64_t)it);
        correct = vit_correct(&m, NULL);
        vit_backward(&m, 1.0f);
        params_adamw(&m.w, 3e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, it);
    }
    vit_forward(&m, patches, labels, B, 0, 0);
    correct = vit_correct(&m, NULL);
    CHECK(correct == B, "tiny overfit: %d of %d images right after 150 steps (loss %.4f)", correct, B, loss);
    free(patches);
    vit_free(&m);
}

static ImageSet synthetic(int n, int h, int w, int c, int classes, uint64_t seed) {
    ImageSet s = {.n = n, .h = h, .w = w, .c = c, .classes = classes};
    s.pixels = xmalloc((size_t)n * h * w * c);
    s.labels = xmalloc((size_t)n);
    Rng r = rng_seeded(seed, 1);
    for (size_t i = 0; i < (size_t)n * h * w * c; i++) s.pixels[i] = (uint8_t)rng_below(&r, 256);
    for (int i = 0; i < n; i++) s.labels[i] = (uint8_t)(i % classes);
    return s;
}

static void test_split_and_augment(void) {
    VitData a, b, c;
    Err e;
    CHECK(vit_data_from_sets(&a, "cifar10", synthetic(100, 32, 32, 3, 10, 1), synthetic(20, 32, 32, 3, 10, 2), 30, 7, 0,
                             1, &e) == 0, "split: %s", e.msg);
    vit_data_from_sets(&b, "cifar10", synthetic(100, 32, 32, 3, 10, 1), synthetic(20, 32, 32, 3, 10, 2), 30, 7, 0, 1,
                       &e);
    vit_data_from_sets(&c, "cifar10", synthetic(100, 32, 32, 3, 10, 1), synthetic(20, 32, 32, 3, 10, 2), 30, 8, 0, 1,
                       &e);
    int seen[100] = {0};
    for (int i = 0; i < a.ntrain; i++) seen[a.train_idx[i]]++;
    for (int i = 0; i < a.nval; i++) seen[a.val_idx[i]] += 10;
    int disjoint = a.ntrain == 70 && a.nval == 30;
    for (int i = 0; i < 100; i++) disjoint &= seen[i] == 1 || seen[i] == 10;
    CHECK(disjoint, "validation and training images are disjoint and cover the set");
    CHECK(!memcmp(a.val_idx, b.val_idx, 30 * sizeof(int)) && memcmp(a.val_idx, c.val_idx, 30 * sizeof(int)),
          "the split is a function of the seed");
    int P = 8, per = 16 * P * P * 3, idx[4] = {3, 5, 7, 11}, l1[4], l2[4];
    float *p1 = xmalloc((size_t)4 * per * sizeof(float)), *p2 = xmalloc((size_t)4 * per * sizeof(float));
    vit_batch(&a, &a.train, idx, 4, P, 1, 42, p1, l1);
    vit_batch(&a, &a.train, idx, 4, P, 1, 42, p2, l2);
    CHECK(!memcmp(p1, p2, (size_t)4 * per * sizeof(float)) && !memcmp(l1, l2, sizeof l1),
          "augmented batches are a function of (seed, image)");
    vit_batch(&a, &a.train, idx, 4, P, 1, 43, p2, l2);
    CHECK(memcmp(p1, p2, (size_t)4 * per * sizeof(float)) != 0, "another epoch seed gives other augmentations");
    vit_batch(&a, &a.train, idx, 4, P, 0, 42, p1, l1);
    double mean = 0.0;
    for (int i = 0; i < 4 * per; i++) mean += p1[i];
    CHECK(fabs(mean / (4 * per)) < 0.2, "normalised pixels are centred (mean %.3f)", mean / (4 * per));
    free(p1), free(p2);
    vit_data_free(&a), vit_data_free(&b), vit_data_free(&c);
    CHECK(vit_data_from_sets(&b, "x", synthetic(10, 8, 8, 1, 10, 1), synthetic(5, 8, 8, 1, 10, 2), 10, 7, 0, 0, &e) != 0 &&
              strstr(e.msg, "CONFIG_VIT_VAL_IMAGES"), "a validation split of the whole set is refused: %s", e.msg);
    vit_data_free(&b);
}

/* CONFIG_VIT_REFERENCE_NORM: the paper's MNIST constants (mean 0.1307, std 0.3081) instead of the training
 * images' own statistics; every pixel p of a batch becomes (p/255 - 0.1307)/0.3081. */
static void test_reference_norm(void) {
    VitData d;
    Err e;
    int P = 4, per = 8 * 8, idx[4] = {0, 1, 2, 3}, labels[4];
    CHECK(vit_data_from_sets(&d, "mnist", synthetic(40, 8, 8, 1, 10, 3), synthetic(10, 8, 8, 1, 10, 4), 10, 7, 1, 0,
                             &e) == 0, "reference normalisation: %s", e.msg);
    CHECK(d.mean[0] == 0.1307 && d.std[0] == 0.3081, "reference normalisation: mean %g, std %g", d.mean[0], d.std[0]);
    float *x = xmalloc((size_t)4 * per * sizeof(float));
    vit_batch(&d, &d.train, idx, 4, P, 0, 1, x, labels);
    double got = 0.0, want = 0.0; /* sums over the four images: the patch layout does not change them */
    for (int i = 0; i < 4 * per; i++) got += x[i], want += (d.train.pixels[i] / 255.0 - 0.1307) / 0.3081;
    CHECK(fabs(got - want) < 1e-3, "reference normalisation: pixels as (p/255 - 0.1307)/0.3081 (sums %.6f, %.6f)", got,
          want);
    free(x);
    vit_data_free(&d);
    CHECK(vit_data_from_sets(&d, "mnist", synthetic(40, 8, 8, 1, 10, 3), synthetic(10, 8, 8, 1, 10, 4), 10, 7, 0, 0,
                             &e) == 0 && fabs(d.mean[0] - 0.1307) > 0.2,
          "without it, the training images' own mean (%.3f for uniform pixels)", d.mean[0]);
    vit_data_free(&d);
}

/* ViT's initialisation as vit/model.c states it (PyTorch's defaults, as the reference ViT), tensor by tensor from
 * the names: every weight U(-1/sqrt(fan-in), 1/sqrt(fan-in)) with fan-in its rows' width, every bias as its own
 * weight (the tensor of the same name), the CLS token and position table N(0, 1), LayerNorm 1 and 0, +Pos
 * U(-1/sqrt(m), 1/sqrt(m)), relative-position biases 0. */
static InitRule vit_init_rule(const ParamSpec *s, const void *ctx, double *x) {
    const ViT *m = ctx;
    const char *n = s->name;
    *x = 0.0;
    if (strstr(n, ".rel_bias")) return INIT_CONST;
    if (strstr(n, ".pos.")) return *x = 1.0 / sqrt((double)m->cfg.pos_m), INIT_UNIFORM;
    if (!strcmp(n, "cls") || !strcmp(n, "pos_emb")) return *x = 1.0, INIT_NORMAL;
    if (!strncmp(n, "ln", 2) || strstr(n, ".ln")) return *x = str_ends_with(n, ".weight"), INIT_CONST;
    char wname[PARAM_NAME_MAX];
    const char *dot = strrchr(n, '.');
    snprintf(wname, sizeof wname, "%.*s.weight", dot ? (int)(dot - n) : (int)strlen(n), n);
    const ParamSpec *w = param_find(&m->w.table, wname);
    if (!w) return *x = NAN, INIT_CONST; /* no weight to take the fan-in from: reported as off */
    return *x = 1.0 / sqrt((double)w->shape[w->ndim - 1]), INIT_UNIFORM;
}
static void test_init(void) {
    ViTConfig c = config(28, 28, 1, 10, 7, 64, 2, 2, 64);
    c.attn_bias = 1; /* a tensor of every kind */
    if (!attn_symmetric(ATTN_VARIANT)) c.kv_heads = 1; /* a bias narrower than the one before it */
    ViT m;
    vit_init(&m, &c, 1);
    int bad = init_errors("ViT", &m.w, vit_init_rule, &m);
    CHECK(bad == 0, "ViT initialisation: %d of %d tensors off their rule", bad, m.w.table.n);
    vit_free(&m);
}

int main(void) {
    backend_init(0);
    printf("vit model test: attention %s\n", attn_variant_label(ATTN_VARIANT, ATTN_POS));
    test_param_counts();
    test_init();
    model_case("CLS pooling, two-layer head", config(8, 8, 2, 5, 4, 8, 2, 2, 12));
    ViTConfig mean = config(8, 12, 1, 4, 4, 8, 1, 2, 8);
    mean.cls = 0, mean.T = mean.N, mean.head_mlp = 0, mean.final_ln = 1, mean.attn_bias = 1;
    model_case("mean pooling, final LayerNorm, linear head", mean);
    if (!attn_symmetric(ATTN_VARIANT)) { /* grouped K/V heads: QKV and KV tying */
        ViTConfig g = config(8, 8, 2, 5, 4, 16, 2, 4, 12);
        g.kv_heads = 2;
        model_case("CLS pooling, 2 K/V heads for 4", g);
        mean.kv_heads = 1;
        model_case("mean pooling, MQA", mean);
    }
    test_overfit();
    test_split_and_augment();
    test_reference_norm();
    return TEST_SUMMARY("test_vit");
}
