#include "ref.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "hash.h"

/* Role columns of each variant, from its row of kernels/attention.tbl:
 * which projection block serves as query, key and value. */
static void roles(int variant, int *P, int *qb, int *kb, int *vb) {
    *P = attn_num_proj(variant), *qb = attn_query_block(variant), *kb = attn_key_block(variant);
    *vb = attn_value_block(variant);
}

/* The positional table P[i,j,:] for all (i, j), kept between calls: finite
 * differences evaluate the same shapes thousands of times. */
static const double *pos_table(int Tq, int Tk, int m) {
    static double *table;
    static int tq, tk, tm;
    if (!table || tq != Tq || tk != Tk || tm != m) {
        free(table);
        table = malloc((size_t)Tq * Tk * m * sizeof(double));
        for (int i = 0; i < Tq; i++)
            for (int j = 0; j < Tk; j++) attn_pos_entry(table + ((size_t)i * Tk + j) * m, i, j, m);
        tq = Tq, tk = Tk, tm = m;
    }
    return table;
}

/* One head: scores, +Pos, position bias pb(j - i) (pb[d] for d = j - i, or NULL), masks, softmax, dropout,
 * values. */
static void ref_head(double *out, int o_ld, const double *Q, int q_ld, const double *K, const double *V, int kv_ld,
                     int Tq, int Tk, int hd, int causal, const unsigned char *pad, const double *w, double bias,
                     int m, double dropout, uint64_t seed, size_t drop_base, const double *pb) {
    double s = 1.0 / sqrt((double)hd);
    double *row = malloc((size_t)Tk * sizeof(double));
    const double *table = w ? pos_table(Tq, Tk, m) : NULL;
    uint32_t thr = (uint32_t)((float)dropout * 16777216.0f);
    for (int i = 0; i < Tq; i++) {
        double mx = -INFINITY;
        for (int j = 0; j < Tk; j++) {
            double dot = 0.0;
            for (int d = 0; d < hd; d++) dot += Q[(size_t)i * q_ld + d] * K[(size_t)j * kv_ld + d];
            double sc = s * dot;
            if (w) {
                const double *P = table + ((size_t)i * Tk + j) * m;
                double t = bias;
                for (int c = 0; c < m; c++) t += w[c] * (sc + P[c]);
                sc = t;
            }
            if (pb) sc += pb[j - i];
            if ((causal && j > i) || (pad && pad[j])) sc = -INFINITY;
            row[j] = sc;
            if (sc > mx) mx = sc;
        }
        double sum = 0.0;
        for (int j = 0; j < Tk; j++) {
            row[j] = mx == -INFINITY ? 0.0 : exp(row[j] - mx);
            sum += row[j];
        }
        for (int d = 0; d < hd; d++) out[(size_t)i * o_ld + d] = 0.0;
        if (sum == 0.0) continue;
        for (int j = 0; j < Tk; j++) {
            double a = row[j] / sum;
            if (dropout > 0.0)
                a = dropout_keep(seed, drop_base + (size_t)i * Tk + j, thr) ? a / (1.0 - (float)dropout) : 0.0;
            for (int d = 0; d < hd; d++) out[(size_t)i * o_ld + d] += a * V[(size_t)j * kv_ld + d];
        }
    }
    free(row);
}

int ref_proj_width(int variant, int H, int hd, int kv_heads) {
    return H * hd + (attn_num_proj(variant) - 1) * (kv_heads ? kv_heads : H) * hd;
}

/* ALiBi slopes written from the paper's code: 2^(-8/n) * 2^(-8/n)^h for n a power of two; otherwise those of
 * the power of two p below H, then the even-indexed slopes of 2p. */
static double alibi_slope(int h, int H) {
    int p = 1;
    while (p * 2 <= H) p *= 2;
    double start = pow(2.0, -8.0 / p), start2 = pow(2.0, -8.0 / (2 * p));
    return h < p ? start * pow(start, h) : start2 * pow(start2, 2 * (h - p));
}

/* Row t of the rotated copy: pairs (2k, 2k+1) of each head turned by t * base^(-2k/hd). */
static void rotate_block(double *x, int heads, int hd, int t, double base) {
    for (int h = 0; h < heads; h++)
        for (int k = 0; k < hd / 2; k++) {
            double a = t * pow(base, -2.0 * k / hd), *p = x + (size_t)h * hd + 2 * k;
            double x0 = p[0], x1 = p[1];
            p[0] = cos(a) * x0 - sin(a) * x1;
            p[1] = sin(a) * x0 + cos(a) * x1;
        }
}

void ref_self_attention(double *out, const double *proj, int variant, int B, int T, int H, int hd, int kv_heads,
                        int causal, const unsigned char *key_pad, const double *w, const double *bias, int m,
                        int groups, double dropout, uint64_t seed) {
    ref_self_attention_pe(out, proj, variant, B, T, H, hd, kv_heads, causal, key_pad, w, bias, m, groups, dropout,
                          seed, NULL);
}

void ref_self_attention_pe(double *out, const double *proj, int variant, int B, int T, int H, int hd, int kv_heads,
                           int causal, const unsigned char *key_pad, const double *w, const double *bias, int m,
                           int groups, double dropout, uint64_t seed, const RefPositions *pe) {
    int P, qb, kb, vb;
    roles(variant, &P, &qb, &kb, &vb);
    /* grouped K/V heads: the query block is C wide, every other block G*hd, in the table's block order;
     * query head h reads K/V head h / (H/G) (docs/kernels.md) */
    int G = kv_heads ? kv_heads : H, C = H * hd, kvC = G * hd;
    int off[3], ld = 0;
    for (int p = 0; p < P; p++) off[p] = ld, ld += p == qb ? C : kvC;
    int scheme = pe ? pe->scheme : ATTN_POSITION_ABSOLUTE;
    /* RoPE: the query role read from a copy with the query block rotated, the key role from one with the key
     * block rotated, the value role from the projection itself */
    size_t n = (size_t)B * T * ld;
    double *pq = malloc(n * sizeof(double)), *pk = malloc(n * sizeof(double));
    memcpy(pq, proj, n * sizeof(double)), memcpy(pk, proj, n * sizeof(double));
    if (scheme == ATTN_POSITION_ROPE)
        for (size_t r = 0; r < (size_t)B * T; r++) {
            rotate_block(pq + r * ld + off[qb], H, hd, (int)(r % T), pe->rope_base);
            rotate_block(pk + r * ld + off[kb], kb == qb ? H : G, hd, (int)(r % T), pe->rope_base);
        }
    double *pb = malloc((size_t)(2 * T - 1) * sizeof(double));
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++) {
            size_t base = (size_t)b * T * ld;
            size_t qh = (size_t)h * hd, kvh = (size_t)(h / (H / G)) * hd;
            int gi = groups == 1 ? 0 : h;
            for (int d = -(T - 1); d <= T - 1; d++)
                pb[d + T - 1] = scheme == ATTN_POSITION_ALIBI ? -alibi_slope(h, H) * abs(d)
                                : scheme == ATTN_POSITION_REL_BIAS
                                    ? pe->rel[(size_t)h * pe->buckets + attn_rel_bucket(d, causal, pe->buckets, pe->max_distance)]
                                    : 0.0;
            int biased = scheme == ATTN_POSITION_ALIBI || scheme == ATTN_POSITION_REL_BIAS;
            ref_head(out + (size_t)b * T * C + (size_t)h * hd, C, pq + base + off[qb] + qh, ld, pk + base + off[kb] + kvh,
                     proj + base + off[vb] + kvh, ld, T, T, hd, causal, key_pad ? key_pad + (size_t)b * T : NULL,
                     w ? w + (size_t)gi * m : NULL, w ? bias[gi] : 0.0, m, dropout, seed,
                     ((size_t)b * H + h) * T * T, biased ? pb + T - 1 : NULL);
        }
    free(pq), free(pk), free(pb);
}

void ref_cross_attention(double *out, const double *q, const double *kv, int B, int Tq, int Tk, int H, int hd,
                         const unsigned char *key_pad, double dropout, uint64_t seed) {
    int C = H * hd;
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++) {
            const double *K = kv + (size_t)b * Tk * 2 * C + (size_t)h * hd;
            ref_head(out + (size_t)b * Tq * C + (size_t)h * hd, C, q + (size_t)b * Tq * C + (size_t)h * hd, C, K,
                     K + C, 2 * C, Tq, Tk, hd, 0, key_pad ? key_pad + (size_t)b * Tk : NULL, NULL, 0.0, 0, dropout,
                     seed, ((size_t)b * H + h) * Tq * Tk, NULL);
        }
}

void ref_layernorm(double *out, const double *inp, const double *w, const double *b, int N, int C) {
    for (int i = 0; i < N; i++) {
        const double *x = inp + (size_t)i * C;
        double m = 0.0, v = 0.0;
        for (int c = 0; c < C; c++) m += x[c];
        m /= C;
        for (int c = 0; c < C; c++) v += (x[c] - m) * (x[c] - m);
        v /= C;
        for (int c = 0; c < C; c++) out[(size_t)i * C + c] = (x[c] - m) / sqrt(v + 1e-5) * w[c] + (b ? b[c] : 0.0);
    }
}

void ref_linear(double *out, const double *inp, const double *w, const double *b, int N, int C, int OC) {
    for (int i = 0; i < N; i++)
        for (int o = 0; o < OC; o++) {
            double s = b ? b[o] : 0.0;
            for (int c = 0; c < C; c++) s += inp[(size_t)i * C + c] * w[(size_t)o * C + c];
            out[(size_t)i * OC + o] = s;
        }
}

void ref_gelu(double *out, const double *inp, size_t n) {
    for (size_t i = 0; i < n; i++) {
        double x = inp[i];
        out[i] = 0.5 * x * (1.0 + tanh(sqrt(2.0 / 3.14159265358979323846) * (x + 0.044715 * x * x * x)));
    }
}

void ref_relu(double *out, const double *inp, size_t n) {
    for (size_t i = 0; i < n; i++) out[i] = inp[i] > 0.0 ? inp[i] : 0.0;
}

double ref_crossentropy(const double *logits, const int *targets, int N, int V, int ignore_index, double smoothing) {
    double total = 0.0;
    int count = 0;
    for (int i = 0; i < N; i++) {
        if (targets[i] == ignore_index) continue;
        const double *x = logits + (size_t)i * V;
        double mx = x[0], s = 0.0;
        for (int j = 1; j < V; j++) mx = x[j] > mx ? x[j] : mx;
        for (int j = 0; j < V; j++) s += exp(x[j] - mx);
        double lse = mx + log(s);
        /* -sum_j q_j log p_j with q = (1-eps) onehot + eps/V */
        double loss = 0.0;
        for (int j = 0; j < V; j++) {
            double q = smoothing / V + (j == targets[i] ? 1.0 - smoothing : 0.0);
            loss -= q * (x[j] - lse);
        }
        total += loss;
        count++;
    }
    return count ? total / count : 0.0;
}

double ref_central_difference(double *x, size_t k, double h, double (*f)(void *ctx), void *ctx) {
    double old = x[k];
    x[k] = old + h;
    double fp = f(ctx);
    x[k] = old - h;
    double fm = f(ctx);
    x[k] = old;
    return (fp - fm) / (2.0 * h);
}
