/* A checkpoint's self-attention heads as matrices (mechint.h). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "common.h"
#include "mechint.h"

void model_build(Model *m, const char *family, const ModelSource *src) {
    memset(m, 0, sizeof *m);
    int C = src->C, H = src->H, r = C / H, P = attn_num_proj(src->variant);
    int qb = attn_query_block(src->variant), kb = attn_key_block(src->variant), vb = attn_value_block(src->variant);
    /* grouped K/V heads: query head h reads K/V head h / group; its Wk and Wv are copies of that head's */
    int G = attn_kv_count(H, src->kv_heads), group = H / G, kvC = G * r;
    if (G < 1 || H % G != 0) FATAL("mechint: %d K/V heads for %d query heads", G, H);
    m->kv_heads = G;
    m->family = family;
    m->variant = src->variant, m->pos = src->pos, m->pos_m = src->pos_m, m->pos_groups = src->pos_groups;
    m->L = src->L, m->H = H, m->d = C, m->r = r;
    m->layer = xcalloc((size_t)src->L, sizeof(Layer));
    const float *W = src->params;
    size_t blk = (size_t)(C + 1) * r; /* one (d+1) x r matrix */
    for (int l = 0; l < src->L; l++) {
        Layer *ly = &m->layer[l];
        const BlockParams *bp = &src->bp[l];
        snprintf(ly->name, sizeof ly->name, "%s", src->names ? src->names[l] : "");
        ly->causal = src->causal ? src->causal[l] : 0;
        ly->folded = !src->post_ln;
        ly->head = xcalloc((size_t)H, sizeof(Head));
        ly->store = xcalloc((size_t)H * (P * blk + (size_t)r * C), sizeof(double));
        for (int h = 0; h < H; h++) {
            double *base = ly->store + (size_t)h * (P * blk + (size_t)r * C);
            for (int p = 0; p < P; p++) {
                double *Wp = base + p * blk;
                /* first row of this head's slice of block p: the query block has H heads, the others G */
                size_t r0 = (size_t)attn_block_offset(src->variant, p, C, kvC) + (size_t)(p == qb ? h : h / group) * r;
                for (int c = 0; c < r; c++) {
                    const float *row = W + bp->attnw + (r0 + c) * C; /* Linear (out, in) */
                    double bias = src->attn_bias ? W[bp->attnb + r0 + c] : 0.0;
                    for (int i = 0; i < C; i++) {
                        double w = row[i];
                        if (!src->post_ln) { /* x_ln = gamma * xhat + beta: fold both into the projection */
                            if (src->bias) bias += W[bp->ln1b + i] * w;
                            w *= W[bp->ln1w + i];
                        }
                        Wp[(size_t)i * r + c] = w;
                    }
                    Wp[(size_t)C * r + c] = bias;
                }
            }
            double *Wo = base + P * blk;
            for (int c = 0; c < r; c++)
                for (int j = 0; j < C; j++) Wo[(size_t)c * C + j] = W[bp->projw + (size_t)j * C + (size_t)h * r + c];
            ly->head[h].Wq = base + qb * blk;
            ly->head[h].Wk = base + kb * blk;
            ly->head[h].Wv = base + vb * blk;
            ly->head[h].Wo = Wo;
        }
        if (src->pos) {
            int g = src->pos_groups, mm = src->pos_m;
            ly->pos_w = xmalloc((size_t)g * mm * sizeof(double));
            ly->pos_b = xmalloc((size_t)g * sizeof(double));
            for (int k = 0; k < g * mm; k++) ly->pos_w[k] = W[bp->posw + k];
            for (int k = 0; k < g; k++) ly->pos_b[k] = W[bp->posb + k];
        }
    }
}

void model_free(Model *m) {
    for (int l = 0; l < m->L; l++) {
        free(m->layer[l].head), free(m->layer[l].store);
        free(m->layer[l].pos_w), free(m->layer[l].pos_b);
    }
    free(m->layer);
    free(m->pos_table);
    memset(m, 0, sizeof *m);
}
