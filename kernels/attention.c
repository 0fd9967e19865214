/* The backend-neutral part of kernels/attention.h: names from the variant
 * table and the fixed +Pos basis. Every backend links it. */
#include "attention.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "kernels.h"

/* ------------------------------------------------------------------ path switches */

/* Host flags every backend reads (attention.h): the symmetric backward of KV and K, and the CUDA bf16 kernels with
 * the scores in registers. Both default on; tests and benchmarks turn them off to compare paths in one run. */
static int g_symmetric_path = 1, g_mma_path = 1;
void attention_set_symmetric_path(int on) { g_symmetric_path = on; }
int attention_symmetric_path(void) { return g_symmetric_path; }
void attention_set_mma_path(int on) { g_mma_path = on; }
int attention_mma_path(void) { return g_mma_path; }

/* ------------------------------------------------------------------ names */

const char *attn_block_name(int variant, int block) {
    if (variant < 0 || variant >= ATTN_NUM_VARIANTS || block < 0 || block >= attn_variants[variant].nproj)
        FATAL("attn_block_name: no block %d in variant %d", block, variant);
    return attn_variants[variant].blocks[block];
}

/* name or label with the +Pos suffix and the configured position scheme's, from a static store (the strings
 * live as long as the program) */
static const char *with_pos(int variant, int pos, int label) {
    static char store[2][2][ATTN_NUM_VARIANTS][80];
    if (variant < 0 || variant >= ATTN_NUM_VARIANTS) FATAL("attention variant %d is not in the table", variant);
    const AttnVariantInfo *v = &attn_variants[variant];
    const AttnPositionInfo *pe = &attn_positions[ATTN_POSITION];
    pos = pos != 0;
    char *s = store[label][pos][variant];
    if (!s[0]) {
        char kv[24] = ""; /* grouped K/V heads: "+MQA", "+GQA2" (the @kv_heads row) */
        int G = CONFIG_ATTN_KV_HEADS;
        if (G == 1) snprintf(kv, sizeof kv, "%s", label ? ATTN_KV_HEADS_MQA_LABEL : ATTN_KV_HEADS_MQA_NAME);
        if (G > 1) snprintf(kv, sizeof kv, label ? ATTN_KV_HEADS_GQA_LABEL : ATTN_KV_HEADS_GQA_NAME, G);
        snprintf(s, sizeof store[0][0][0], "%s%s%s%s", label ? v->label : v->name, kv,
                 pos ? (label ? ATTN_POS_LABEL_SUFFIX : ATTN_POS_NAME_SUFFIX) : "", label ? pe->label : pe->name);
    }
    return s;
}

const char *attn_variant_label(int variant, int pos) { return with_pos(variant, pos, 1); }

const char *attn_variant_id(int variant, int pos) { return with_pos(variant, pos, 0); }

/* ------------------------------------------------------------------ +Pos basis */

int attn_pos_channels(int m) { return (m + 3) / 4 * 2; }

int attn_pos_query_channels(int m) {
    int c = attn_pos_channels(m);
    return c < m ? c : m;
}

static double pos_feature(int p, int k, int c) {
    double f = pow(10000.0, -2.0 * (k / 2) / c);
    return k % 2 == 0 ? sin(p * f) : cos(p * f);
}

void attn_pos_features(float *feat, int T, int m) {
    int c = attn_pos_channels(m);
    for (int p = 0; p < T; p++)
        for (int k = 0; k < c; k++) feat[(size_t)p * c + k] = (float)pos_feature(p, k, c);
}

float *attn_pos_features_dev(int T, int m) {
    size_t n = (size_t)T * attn_pos_channels(m);
    float *host = xmalloc(n * sizeof(float));
    attn_pos_features(host, T, m);
    float *dev = dev_alloc(n * sizeof(float));
    dev_upload(dev, host, n * sizeof(float));
    free(host);
    return dev;
}

void attn_pos_entry(double *out, int i, int j, int m) {
    int c = attn_pos_channels(m), ci = attn_pos_query_channels(m);
    for (int k = 0; k < ci; k++) out[k] = pos_feature(i, k, c);
    for (int k = ci; k < m; k++) out[k] = pos_feature(j, k - ci, c);
}

/* ------------------------------------------------------------------ position schemes */

void attn_rope_table(float *tab, int T, int hd, double base) {
    if (hd < 2 || hd % 2) FATAL("RoPE needs an even head dim, got %d (hint: choose channels and heads so that "
                                "channels / heads is even)", hd);
    int half = hd / 2;
    for (int p = 0; p < T; p++)
        for (int k = 0; k < half; k++) {
            double a = p * pow(base, -2.0 * k / hd);
            tab[((size_t)p * half + k) * 2] = (float)cos(a);
            tab[((size_t)p * half + k) * 2 + 1] = (float)sin(a);
        }
}

float *attn_rope_table_dev(int T, int hd, double base) {
    size_t n = (size_t)T * hd;
    float *host = xmalloc(n * sizeof(float));
    attn_rope_table(host, T, hd, base);
    float *dev = dev_alloc(n * sizeof(float));
    dev_upload(dev, host, n * sizeof(float));
    free(host);
    return dev;
}

/* Press et al.: for H a power of two the slopes are 2^(-8/H), 2^(-16/H), ...;
 * otherwise those of the power of two below H, then every other slope of
 * twice that power for the rest. */
double attn_alibi_slope(int h, int H) {
    if (H < 1 || h < 0 || h >= H) FATAL("attn_alibi_slope: head %d of %d", h, H);
    int p = 1;
    while (p * 2 <= H) p *= 2;
    if (h < p) return pow(2.0, -8.0 * (h + 1) / p);
    return pow(2.0, -8.0 * (2 * (h - p) + 1) / (2 * p));
}

/* T5's bucketing (Raffel et al., mesh-tensorflow _relative_position_bucket). */
int attn_rel_bucket(int d, int causal, int buckets, int max_distance) {
    int n = buckets, base = 0, r;
    if (!causal) {
        n /= 2;
        if (d > 0) base = n;
        r = d < 0 ? -d : d;
    } else {
        r = d < 0 ? -d : 0; /* the past; the future is masked */
    }
    int exact = n / 2;
    if (r < exact) return base + r;
    if (exact < 1 || max_distance <= exact) return base + n - 1;
    int v = exact + (int)(log((double)r / exact) / log((double)max_distance / exact) * (n - exact));
    return base + (v < n - 1 ? v : n - 1);
}

/* ------------------------------------------------------------------ argument checks of every backend */

void attn_check_args(const char *op, int B, int Tq, int Tk, int H, int hd, float dropout) {
    if (B <= 0 || Tq <= 0 || Tk <= 0 || H <= 0 || hd <= 0)
        FATAL("%s: bad shape B=%d Tq=%d Tk=%d H=%d head_dim=%d (all must be positive)", op, B, Tq, Tk, H, hd);
    if (!(dropout >= 0.0f && dropout < 1.0f)) FATAL("%s: dropout must be in [0, 1), got %g", op, (double)dropout);
}

int attn_check_kv_heads(const char *op, int H, int kv_heads) {
    int G = attn_kv_count(H, kv_heads);
    if (G < 1 || G > H || H % G != 0)
        FATAL("%s: %d K/V heads for %d query heads (the K/V head count must divide the query head count)", op, G, H);
    if (G != H && attn_symmetric(ATTN_VARIANT))
        FATAL("%s: %d K/V heads for %d query heads in variant %s, whose key also plays the query role (grouped K/V "
              "heads are defined for QKV and KV tying only)", op, G, H, attn_variant_label(ATTN_VARIANT, 0));
    return G;
}

int attn_check_pos(const char *op, const AttnPos *pos, int H, int hd, int T) {
    if (ATTN_POS) {
        if (!pos || !pos->w || !pos->b || !pos->feat) FATAL("%s: +Pos is configured but no positional weights given", op);
        if (pos->m != ATTN_POS_DIM) FATAL("%s: positional dim %d, configured %d", op, pos->m, ATTN_POS_DIM);
        if (pos->groups != (ATTN_POS_PER_HEAD ? H : 1))
            FATAL("%s: %d +Pos weight groups, configured %d", op, pos->groups, ATTN_POS_PER_HEAD ? H : 1);
        if (pos->T < T) FATAL("%s: +Pos basis has %d positions, sequence has %d", op, pos->T, T);
    } else if (pos && (pos->w || pos->b)) {
        FATAL("%s: +Pos weights given but +Pos is not configured", op);
    }
    int scheme = pos ? pos->scheme : ATTN_POSITION_ABSOLUTE;
    if (scheme < 0 || scheme >= ATTN_NUM_POSITIONS) FATAL("%s: position scheme %d is not in the table", op, scheme);
    if (attn_positions[scheme].where == ATTN_PE_ROTARY) {
        if (!pos->rope || pos->rope_hd != hd || pos->T < T)
            FATAL("%s: RoPE table for head dim %d and %d positions, the call has head dim %d and %d positions", op,
                  pos->rope ? pos->rope_hd : 0, pos->rope ? pos->T : 0, hd, T);
    }
    if (scheme == ATTN_POSITION_REL_BIAS && (!pos->rel || pos->rel_buckets < 4 || pos->rel_max_distance < 2))
        FATAL("%s: relative bias without its weights or with %d buckets / max distance %d (at least 4 / 2)", op,
              pos->rel_buckets, pos->rel_max_distance);
    return scheme;
}

int attn_check_decode(const AttnPos *pos, int q_ld, int T, int t, int N, int H, int hd, int kv_heads) {
    int C = H * hd, G = attn_kv_count(H, kv_heads);
    if (t < 0 || t >= T || N <= 0 || H <= 0 || hd <= 0 || q_ld < C)
        FATAL("attention_decode: bad shape N=%d t=%d T=%d H=%d hd=%d q_ld=%d", N, t, T, H, hd, q_ld);
    if (G < 1 || G > H || H % G != 0 || (G != H && attn_symmetric(ATTN_VARIANT)))
        FATAL("attention_decode: %d K/V heads for %d query heads (must divide them; QKV and KV tying only)", G, H);
    return attn_check_pos("attention_decode", pos, H, hd, t + 1);
}
