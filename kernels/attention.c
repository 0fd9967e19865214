/* The backend-neutral part of kernels/attention.h: names from the variant
 * table and the fixed +Pos basis. Every backend links it. */
#include "attention.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "kernels.h"

/* ------------------------------------------------------------------ names */

const char *attn_block_name(int variant, int block) {
    if (variant < 0 || variant >= ATTN_NUM_VARIANTS || block < 0 || block >= attn_variants[variant].nproj)
        FATAL("attn_block_name: no block %d in variant %d", block, variant);
    return attn_variants[variant].blocks[block];
}

/* name or label with the +Pos suffix, from a static store (the strings live as long as the program) */
static const char *with_pos(int variant, int pos, int label) {
    static char store[2][ATTN_NUM_VARIANTS][48];
    if (variant < 0 || variant >= ATTN_NUM_VARIANTS) FATAL("attention variant %d is not in the table", variant);
    const AttnVariantInfo *v = &attn_variants[variant];
    const char *base = label ? v->label : v->name;
    if (!pos) return base;
    char *s = store[label][variant];
    if (!s[0]) snprintf(s, sizeof store[0][0], "%s%s", base, label ? ATTN_POS_LABEL_SUFFIX : ATTN_POS_NAME_SUFFIX);
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
