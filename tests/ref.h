/* Float64 reference implementations, written straight from the math in
 * docs/kernels.md (and ../shared/reference/attention-variants.md) with no
 * attention to speed. Tests compare the float32 kernels' forward outputs to
 * these, and their backward passes to central finite differences of these. */
#ifndef KVLAB_REF_H
#define KVLAB_REF_H

#include <stddef.h>
#include <stdint.h>

/* Self-attention of any variant. proj (B, T, W) in the variant's block
 * layout: the query block C = H*hd wide, the others kv_heads*hd (kv_heads 0
 * = H; query head h reads K/V head h / (H/kv_heads)); +Pos when w != NULL,
 * with `groups` sets of (m weights, 1 bias), applied in the unfactored form
 * sum_c w_c (S_ij + P_ijc) + b. */
void ref_self_attention(double *out, const double *proj, int variant, int B, int T, int H, int hd, int kv_heads,
                        int causal, const unsigned char *key_pad, const double *w, const double *bias, int m,
                        int groups, double dropout, uint64_t seed);
/* Position scheme inside attention for ref_self_attention_pe: rotary
 * (RoPE with this base: the query and key roles' pairs (2k, 2k+1) of row t
 * rotated by t * base^(-2k/hd), values not), ALiBi (-slope_h |i - j|) or the
 * relative bias rel[h * buckets + bucket(j - i)], added after +Pos. */
typedef struct {
    int scheme;            /* ATTN_POSITION_* */
    double rope_base;
    const double *rel;     /* (H, buckets) */
    int buckets, max_distance;
} RefPositions;
void ref_self_attention_pe(double *out, const double *proj, int variant, int B, int T, int H, int hd, int kv_heads,
                           int causal, const unsigned char *key_pad, const double *w, const double *bias, int m,
                           int groups, double dropout, uint64_t seed, const RefPositions *pe);
/* Width of that projection: C for the query block, kv_heads*hd for each other block. */
int ref_proj_width(int variant, int H, int hd, int kv_heads);
/* Cross-attention, QKV: q (B, Tq, C), kv (B, Tk, 2C). */
void ref_cross_attention(double *out, const double *q, const double *kv, int B, int Tq, int Tk, int H, int hd,
                         const unsigned char *key_pad, double dropout, uint64_t seed);

/* (f(x + h e_k) - f(x - h e_k)) / 2h, with x[k] restored: the finite difference every gradient check uses. */
double ref_central_difference(double *x, size_t k, double h, double (*f)(void *ctx), void *ctx);

void ref_layernorm(double *out, const double *inp, const double *w, const double *b, int N, int C);
void ref_linear(double *out, const double *inp, const double *w, const double *b, int N, int C, int OC);
void ref_gelu(double *out, const double *inp, size_t n);
void ref_relu(double *out, const double *inp, size_t n);
/* Mean cross-entropy over rows whose target != ignore_index. */
double ref_crossentropy(const double *logits, const int *targets, int N, int V, int ignore_index, double smoothing);

#endif
