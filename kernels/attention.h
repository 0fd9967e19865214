/* Multi-head attention in every variant of kvlab (docs/kernels.md has the math).
 *
 * The variants are the rows of kernels/attention.tbl: which projection blocks
 * a variant has and which block plays query, key and value. The configured
 * variant is a compile-time constant (ATTN_VARIANT, from the Kconfig
 * "Attention" menu), so code for the other variants is removed by the
 * compiler. Self-attention takes the fused projection output of one layer,
 * (B, T, P*C) with the P blocks side by side and the heads contiguous inside
 * each block; the scores are s * (query role) (key role)^T with
 * s = 1/sqrt(head dim) and the output is A (value role). With grouped K/V
 * heads (attn_kv_heads) the blocks other than the query's are narrower and
 * several query heads share one K/V head.
 *
 * +Pos (ATTN_POS) turns the scores into S' = alpha S + f(i) + g(j) + b, the
 * factored form of the paper's term sum_c w_c (S_ij + P_ijc) + b
 * (alpha = sum_c w_c), see attn_pos_*.
 * A position scheme acting inside attention (AttnPos.scheme, see below)
 * rotates the query and key roles before the scores (RoPE) or adds a bias
 * b_h(i, j) after +Pos (ALiBi, relative bias).
 * Order of operations: rotation, scale, +Pos, position bias, masks (causal,
 * key padding), softmax, dropout, times values. Cross-attention (decoder queries, encoder
 * keys and values) is always plain QKV without +Pos.
 *
 * This header and kernels/attention.c are backend-neutral; a backend
 * (kernels/cpu/, ...) implements the compute functions declared below. */
#ifndef KVLAB_ATTENTION_H
#define KVLAB_ATTENTION_H

#include <stddef.h>
#include <stdint.h>

#include <generated/attn_head_dim.h>
#include <generated/attn_variants.h>

#include "kernels.h" /* act_t */

/* ---- the variant table ----------------------------------------------------
 * One row per variant, generated from kernels/attention.tbl (the only place
 * these facts live; Python reads the same file). The array is static const
 * in this header so that a row indexed by the compile-time ATTN_VARIANT
 * folds to constants: code for the other variants is removed. */
typedef struct {
    int id;                 /* ATTN_QKV, ... (= row index) */
    const char *name;       /* "qkv", "kv_tying": metadata and file names */
    const char *label;      /* "QKV", "KV tying": tables and logs */
    int nproj;              /* P: projection blocks side by side in the fused (B, T, P*C) */
    const char *blocks[3];  /* checkpoint names of the blocks: attn.<block>.weight */
    int query, key, value;  /* the block playing each role */
    const char *roles;      /* the role sharing in words */
    const char *kconfig;    /* the Kconfig symbol that selects it */
} AttnVariantInfo;

static const AttnVariantInfo attn_variants[ATTN_NUM_VARIANTS] = {ATTN_VARIANT_ROWS};

/* The configured variant, as compile-time constants. */
#define ATTN_VARIANT ATTN_VARIANT_SELECTED
#if ATTN_VARIANT < 0
#error "no attention variant in the configuration (run make olddefconfig)"
#endif
#define ATTN_POS IS_ENABLED(CONFIG_ATTN_POS)
#define ATTN_POS_DIM (ATTN_POS ? CONFIG_ATTN_POS_DIM : 0)
#if IS_ENABLED(CONFIG_ATTN_POS_PER_HEAD)
#define ATTN_POS_PER_HEAD 1
#elif IS_ENABLED(CONFIG_ATTN_POS_PER_LAYER) || !ATTN_POS
#define ATTN_POS_PER_HEAD 0
#else
#error "+Pos without a weight-sharing choice (run make olddefconfig)"
#endif

/* Head dim of the configured model families, so loops over it get a constant
 * trip count; other head dims take the same code with a runtime count.
 * Families built together with different head dims: 0 (runtime for all).
 * scripts/kconfig.py works it out from the families' symbols, which kernels/
 * does not read. */
#define ATTN_HEAD_DIM KVLAB_ATTN_HEAD_DIM

/* Facts of a variant, read from its row (constants for ATTN_VARIANT). */
static inline int attn_num_proj(int variant) { return attn_variants[variant].nproj; }
static inline int attn_query_block(int variant) { return attn_variants[variant].query; }
static inline int attn_key_block(int variant) { return attn_variants[variant].key; }
static inline int attn_value_block(int variant) { return attn_variants[variant].value; }
/* Query role == key role: the scores S = s K K^T are symmetric before masks. */
static inline int attn_symmetric(int variant) { return attn_query_block(variant) == attn_key_block(variant); }
/* KV-cache tensors per layer: K and V, or one when the key is the value. */
static inline int attn_cache_tensors(int variant) {
    return attn_key_block(variant) == attn_value_block(variant) ? 1 : 2;
}
/* ---- grouped K/V heads (GQA / MQA) ------------------------------------------
 * A layer of H query heads has G K/V heads (G divides H); query head h reads
 * K/V head h / (H/G). G = H is standard attention, G = 1 multi-query. The
 * count comes from Kconfig (CONFIG_ATTN_KV_HEADS, 0 = one per query head)
 * and is read here only: every family resolves it once for its head count
 * into its configuration (and model description), and every layer gets it
 * from there (BlockShape.kv_heads -> AttnArgs.kv_heads). KV and K never
 * group (their key is their query; Kconfig offers it for QKV only). */
static inline int attn_kv_heads(int H) { return CONFIG_ATTN_KV_HEADS > 0 ? CONFIG_ATTN_KV_HEADS : H; }
/* The K/V heads of a layer whose settings say kv_heads (0 = one per query
 * head), and the width of its K/V blocks, kv_heads * head dim. */
static inline int attn_kv_count(int H, int kv_heads) { return kv_heads ? kv_heads : H; }
static inline int attn_kv_width(int C, int H, int kv_heads) { return attn_kv_count(H, kv_heads) * (C / H); }
/* Projection layout with grouped K/V heads: the query block is C = H*hd
 * wide, every other block kvC = G*hd (= C when G = H; in KV and K the key
 * block is the query block and G = H). The blocks sit side by side in this
 * order in the fused projection (B, T, W), W = attn_proj_width(). */
static inline int attn_block_width(int variant, int block, int C, int kvC) {
    return block == attn_query_block(variant) ? C : kvC;
}
static inline int attn_block_offset(int variant, int block, int C, int kvC) {
    int off = 0;
    for (int b = 0; b < block; b++) off += attn_block_width(variant, b, C, kvC);
    return off;
}
static inline int attn_proj_width(int variant, int C, int kvC) {
    return attn_block_offset(variant, attn_num_proj(variant), C, kvC);
}
/* Projection block names in order, e.g. "q","k","v"; used for tensor names. */
const char *attn_block_name(int variant, int block);
/* "QKV", "KV+Pos", "KV tying", ... followed by the configured position
 * scheme's suffix ("KV+RoPE"; nothing for the default) */
const char *attn_variant_label(int variant, int pos);
/* "qkv", "kv_pos", "kv_tying", "kv_rope", ... (metadata and file-friendly) */
const char *attn_variant_id(int variant, int pos);

/* ---- +Pos: the fixed sinusoidal basis and the learned weights -------------
 * P[i,j] = concat(feat(i), feat(j))[:m], feat(p) = [sin(p f0), cos(p f0),
 * sin(p f1), ...] with c = ceil(m/4)*2 channels and f_k = 10000^(-2k/c).
 * Channels 0..ci-1 come from the query position i (ci = min(c, m)), the
 * remaining m-ci from the key position j, so w.P[i,j] = f(i) + g(j). */
int attn_pos_channels(int m);                 /* c */
int attn_pos_query_channels(int m);           /* ci */
/* feat table: T rows of c values (float64 math, rounded to float), on the
 * host; attn_pos_features_dev puts the same table in a dev_alloc buffer
 * (the caller dev_frees it). */
void attn_pos_features(float *feat, int T, int m);
float *attn_pos_features_dev(int T, int m);
/* Full P[i,j] (m values), for tests and analyses; never used in training. */
void attn_pos_entry(double *out, int i, int j, int m);

/* ---- position schemes ---------------------------------------------------------
 * The @position rows of kernels/attention.tbl: how a model knows where a
 * token is (kernels/Kconfig "Positions"; the math in docs/kernels.md). The
 * configured scheme is ATTN_POSITION; the kernels take the scheme of each
 * call from AttnPos.scheme, so the tests cover every scheme in every
 * variant's build. Schemes whose row says "embedding" act in the families'
 * embeddings, the others inside self-attention. */
typedef struct {
    int id;                 /* ATTN_POSITION_ABSOLUTE, ... (= row index) */
    const char *name;       /* appended to the variant's name: "_rope" ("" for the default) */
    const char *label;      /* appended to its label: "+RoPE" */
    int where;              /* ATTN_PE_EMBEDDING, ATTN_PE_ROTARY, ATTN_PE_BIAS */
    int symmetric;          /* bidirectional K.K^T scores stay symmetric under it */
    const char *kconfig;
} AttnPositionInfo;

static const AttnPositionInfo attn_positions[ATTN_NUM_POSITIONS] = {ATTN_POSITION_ROWS};

#define ATTN_POSITION ATTN_POSITION_SELECTED
#if ATTN_POSITION < 0
#error "no position scheme in the configuration (run make olddefconfig)"
#endif
/* The configured scheme acts inside self-attention (rotary or bias): layers
 * then take an AttnPos even without +Pos, and no absolute embedding. */
#define ATTN_POSITION_IN_ATTENTION (attn_positions[ATTN_POSITION].where != ATTN_PE_EMBEDDING)

/* RoPE: cos and sin of p * base^(-2k/hd) for T positions and the hd/2 pairs
 * (2k, 2k+1) of a head, (T, hd/2, 2), float64 math rounded to float; the
 * _dev form in a dev_alloc buffer (the caller dev_frees it). */
void attn_rope_table(float *tab, int T, int hd, double base);
float *attn_rope_table_dev(int T, int hd, double base);
/* ALiBi slope of head h of H (the ALiBi paper's sequence). */
double attn_alibi_slope(int h, int H);
/* T5 relative-position bucket of a key at distance d = j - i from its query:
 * bidirectional (causal = 0) gives half the buckets to d > 0; causal layers
 * bucket the past (d <= 0) only. */
int attn_rel_bucket(int d, int causal, int buckets, int max_distance);

/* Positional inputs of a self-attention layer: the paper's +Pos (fields m to
 * feat, only with ATTN_POS) and the position scheme (rope, rel). NULL when a
 * layer has neither (the scheme acts in the embeddings and +Pos is off). */
typedef struct {
    int m;              /* +Pos: positional dim */
    int groups;         /* 1 (per layer) or H (per head) */
    const float *w;     /* (groups, m) */
    const float *b;     /* (groups) */
    const float *feat;  /* (T, c) from attn_pos_features_dev (device memory, like w and b) */
    int T;              /* positions in feat and rope (>= sequence length) */
    int scheme;         /* ATTN_POSITION_*: what acts inside attention (rotary or bias rows) */
    const float *rope;  /* RoPE: (T, rope_hd/2, 2) from attn_rope_table_dev */
    int rope_hd;        /* the head dim the table was made for */
    const float *rel;   /* relative bias: (H, rel_buckets), learned */
    int rel_buckets, rel_max_distance;
} AttnPos;

typedef struct {
    float *dw;          /* (groups, m), accumulated */
    float *db;          /* (groups), accumulated */
    float *drel;        /* (H, rel_buckets), accumulated (relative bias only) */
} AttnPosGrad;

/* ---- shapes ------------------------------------------------------------------ */

typedef struct {
    int B, T, H, hd;            /* C = H * hd */
    int kv_heads;               /* K/V heads G (0 = H): proj is (B, T, attn_proj_width(variant, C, G*hd)) and
                                 * query head h reads K/V head h / (H/G); G must divide H, and be H in KV and K */
    int causal;                 /* mask keys j > i */
    const unsigned char *key_pad; /* (B, T) device memory: nonzero = padding key, masked; or NULL */
    float dropout;              /* on the attention probabilities (0 = off) */
    uint64_t seed;              /* dropout seed for this layer and step */
} AttnArgs;

/* Self-attention in the configured variant.
 * proj: (B, T, W), the variant's blocks side by side (W = P*C without
 * grouped K/V heads, attn_proj_width() with); out: (B, T, C) heads concatenated; lse: (B, H, T) row
 * log-sum-exp saved for the backward pass (the T x T probabilities are
 * recomputed there, never stored). pos: the layer's positional inputs (AttnPos) or NULL. */
void attention_forward(act_t *out, float *lse, const act_t *proj, const AttnPos *pos,
                       const AttnArgs *a);
/* dproj (B, T, W) and dpos are accumulated. */
void attention_backward(act_t *dproj, AttnPosGrad *dpos, const act_t *dout, const act_t *proj,
                        const act_t *out, const float *lse, const AttnPos *pos, const AttnArgs *a);

/* Cross-attention, always QKV: q (B, Tq, C) from the decoder, kv (B, Tk, 2C)
 * = [K|V] from the encoder, key_pad (B, Tk) or NULL, no causal mask. */
typedef struct {
    int B, Tq, Tk, H, hd;
    const unsigned char *key_pad; /* (B, Tk) device memory, or NULL */
    float dropout;
    uint64_t seed;
} CrossAttnArgs;
void cross_attention_forward(act_t *out, float *lse, const act_t *q, const act_t *kv,
                             const CrossAttnArgs *a);
void cross_attention_backward(act_t *dq, act_t *dkv, const act_t *dout, const act_t *q,
                              const act_t *kv, const act_t *out, const float *lse,
                              const CrossAttnArgs *a);

/* Decoding with a KV cache: N sequences, each with one new query at position
 * t against its cached key-role and value-role rows 0..t. q: (N, C) query-role
 * rows, row stride q_ld; keys and values: (N, T, G*hd) each, position-major
 * per sequence, G = kv_heads (0 = H) K/V heads (they may be the same buffer,
 * as in K and KV tying, whose caches hold one tensor); out: (N, C). C = H * hd;
 * query head h reads cached head h / (H/G). */
void attention_decode(act_t *out, const act_t *q, int q_ld, const act_t *keys, const act_t *values, int T, int t,
                      int N, int H, int hd, int kv_heads, const AttnPos *pos);

/* For backends (kernels/<backend>/attention.*), the checks every backend makes, with the same messages:
 * shapes and dropout of a call; the K/V head count G of a self-attention call (kv_heads 0 = H), checked against
 * H and the variant; an AttnPos against the call and the build (+Pos weights, RoPE table, relative bias),
 * returning its scheme. */
void attn_check_args(const char *op, int B, int Tq, int Tk, int H, int hd, float dropout);
int attn_check_kv_heads(const char *op, int H, int kv_heads);
int attn_check_pos(const char *op, const AttnPos *pos, int H, int hd, int T);
/* The arguments of attention_decode (shapes, K/V heads, positions); returns the position scheme. */
int attn_check_decode(const AttnPos *pos, int q_ld, int T, int t, int N, int H, int hd, int kv_heads);

/* Bidirectional KV and K attention compute each score pair once (ssyrk).
 * Turning that off sends them through the general path: for benchmarks
 * that measure the saving and tests that compare the two paths. Default on. */
void attention_set_symmetric_path(int on);
int attention_symmetric_path(void); /* as last set */

/* On the CUDA target with bf16 products (CUDA_BF16, CUDA_BF16_MATMUL) the attention's training kernels keep
 * their scores in registers (mma.sync; docs/cuda.md). Turning that off runs the WMMA kernels instead, the same
 * values up to float summation order: for benchmarks that compare the two in one run and tests that check both.
 * No effect on other targets and precisions. Default on. */
void attention_set_mma_path(int on);
int attention_mma_path(void); /* as last set */
/* Runs the helpers of those kernels on one warp with small integer matrices, loaded from float and from bf16
 * (cp.async), and compares their products with exact ones: the check that this GPU's mma.sync, ldmatrix and
 * cp.async place elements where kernels/cuda/mma.cuh says (the CPU emulation of the tests implements that
 * reading). Returns the number of elements out of place (the first is named on stderr), or -1 where the build has
 * no such kernels (other targets and precisions). */
int attention_mma_check(void);

/* One (batch, head) as dense T x T matrices (S and A: device memory), computed by the same code as
 * the forward pass, for tests and analyses: the scores S' before any mask
 * (scale and +Pos applied), and the probabilities A (masks and softmax
 * applied, no dropout). */
void attention_scores(float *S, const act_t *proj, const AttnPos *pos, const AttnArgs *a, int b, int h);
void attention_probs(float *A, const act_t *proj, const AttnPos *pos, const AttnArgs *a, int b, int h);

#endif
