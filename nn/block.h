/* The transformer block shared by the model families.
 *
 * Pre-LayerNorm (GPT-2, ViT, the translation encoder):
 *   res2 = x + drop(proj(attention(qkv(ln1(x)))))        attention in the configured variant
 *   out  = res2 + drop(fc2(drop'(act(fc1(ln2(res2))))))    act = GELU or ReLU
 * Post-LayerNorm (the paper's synthetic-task encoder):
 *   res2 = ln1(x + drop(proj(attention(qkv(x)))))
 *   out  = ln2(res2 + drop(fc2(drop'(act(fc1(res2))))))
 * drop' is the optional dropout inside the MLP (the synthetic model has it).
 *
 * GPT-2 runs it causal, ViT bidirectional, a seq2seq encoder with key
 * padding. The decoder block adds cross-attention (always QKV) to an
 * encoder's output. Forward and backward sit side by side; backward passes
 * accumulate into the parameter gradients like every kernel does. */
#ifndef KVLAB_BLOCK_H
#define KVLAB_BLOCK_H

#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "attention.h"
#include "params.h"

/* Offsets of one block's tensors in the model's parameter buffer (the same
 * offsets index the gradient buffer). Absent biases are flagged in BlockShape. */
typedef struct {
    size_t ln1w, ln1b, attnw, attnb, posw, posb, projw, projb, ln2w, ln2b, fcw, fcb, fcpw, fcpb;
    size_t relw; /* relative-position bias (H, buckets), with that position scheme */
    size_t first; /* the offset of the block's first tensor: its tensors (a decoder block's cross-attention
                   * too) are registered after it, before the next block's (params_grads_final_from) */
} BlockParams;

/* Observation points for analysis (mechint): NULL in training. after_proj
 * sees a self-attention layer's projection input (B,T,C) and its
 * projections (B,T,W) (W = block_proj_width(): P*C unless K/V heads are grouped); after_attn sees the heads' outputs (B,T,C) before
 * the output projection and may change them (head ablation). */
typedef struct BlockShape BlockShape;
typedef struct BlockHook {
    void (*after_proj)(const struct BlockHook *h, int layer, const act_t *in, const act_t *proj,
                       const BlockShape *s);
    void (*after_attn)(const struct BlockHook *h, int layer, act_t *atty, const BlockShape *s);
    void *ctx;
} BlockHook;

struct BlockShape {
    int B, T, C, H, mlp;           /* mlp = hidden width of the MLP */
    int kv_heads;                  /* K/V heads G of the self-attention, from the family's configuration
                                    * (attn_kv_heads(H)); 0 = H. Cross-attention never groups. */
    int causal, gelu;
    int post_ln;                   /* LayerNorm after each residual add instead of before the sublayer */
    int mlp_dropout;               /* dropout inside the MLP too, after the activation */
    int bias, attn_bias;           /* biases on linear layers and LayerNorms / on the projections */
    int pos, pos_m, pos_groups;    /* +Pos (compile-time in the kernels) */
    const float *pos_feat;         /* +Pos basis, pos_T rows */
    const float *rope;             /* RoPE table of the model (block_rope_table_dev), pos_T rows, or NULL */
    int pos_T;
    const unsigned char *key_pad;  /* (B, T) or NULL */
    float dropout;                 /* 0 outside training */
    uint64_t seed;                 /* dropout seed of this block for this step */
    const BlockHook *hook;         /* analysis hooks (NULL: none) */
    int attn_grads_only;           /* backward: of the products' weight gradients, the projections' only (params.h) */
    int layer;                     /* self-attention layer index the hooks see */
};

/* Activations of one block for B x T tokens, kept for the backward pass.
 * Post-LN keeps the sums before each LayerNorm in res2 (x + attention) and
 * ln2 (ln1 + MLP); ln1 is then the residual stream after attention. The
 * layernorm statistics and the attention's log-sum-exp are float, the rest
 * activations (act_t, kernels/kernels.h). */
typedef struct {
    act_t *ln1, *proj, *atty, *res2, *ln2, *fch, *fch_act, *out;
    float *ln1_mean, *ln1_rstd, *att_lse, *ln2_mean, *ln2_rstd;
} BlockActs;

/* Scratch shared by all blocks of a model during the backward pass. */
typedef struct {
    act_t *dbranch, *dln, *datty, *dsum, *dproj, *dfch_act, *dfch; /* (B,T,C) x4, (B,T,W), (B,T,mlp) x2 */
    act_t *branch;                                                 /* forward: (B,T,C) sublayer output */
} BlockScratch;

/* Width W of the fused self-attention projection of a block: the query block
 * C, the other blocks kv_heads*head_dim (kernels/attention.h). */
int block_proj_width(const BlockShape *s);
/* Arrays carved out of one allocation in turn, each starting 64-byte aligned (activations of act_t and
 * statistics of float side by side). A layout function written once serves both uses: with p NULL, carve
 * returns NULL and only counts the bytes (the allocation's size); with p the allocation, it hands out the
 * arrays in the same order. */
typedef struct {
    char *p;
    size_t bytes;
} Carve;
void *carve(Carve *c, size_t bytes);

/* One block's activations and its backward's scratch carved out of c (device memory; with c->p NULL only
 * counted). */
void block_acts_carve(BlockActs *a, Carve *c, const BlockShape *s);
void block_scratch_carve(BlockScratch *sc, Carve *c, const BlockShape *s);

void block_forward(BlockActs *a, const act_t *x, const float *params, const BlockParams *p, const BlockShape *s,
                   BlockScratch *sc);
/* dres holds d(out) on entry and d(x) on exit. */
void block_backward(act_t *dres, float *grads, const BlockActs *a, const act_t *x, const float *params,
                    const BlockParams *p, const BlockShape *s, BlockScratch *sc);

/* ---- decoder block (pre-LN), for encoder-decoder models -------------------
 *   h1  = x + drop(self_attention(ln1(x)))           causal, the configured variant
 *   h2  = h1 + drop(xproj(cross(xq(lnx(h1)), xkv(mem))))  cross-attention: always QKV
 *   out = h2 + drop(mlp(ln2(h2)))
 * mem is the encoder output (B, S, C); its gradient is accumulated into dmem. */
typedef struct {
    BlockParams b; /* ln1, self-attention, ln2, MLP */
    size_t lnxw, lnxb, xqw, xqb, xkvw, xkvb, xprojw, xprojb;
} DecBlockParams;

typedef struct {
    BlockActs b;                 /* b.res2 = h1, b.ln2 = ln2(h2), b.out = out */
    act_t *lnx, *xq, *xkv, *xatty; /* (B,T,C), (B,T,C), (B,S,2C), (B,T,C) */
    act_t *h2;                   /* (B,T,C) */
    float *lnx_mean, *lnx_rstd;  /* (B,T), (B,T) */
    float *xlse;                 /* (B,H,T) */
} DecBlockActs;

typedef struct {
    BlockScratch b;
    act_t *dxq, *dxkv; /* (B,T,C), (B,S,2C) */
} DecBlockScratch;

/* s->T is the target length; S and src_pad describe the encoder side. Carved as the block's. */
void decblock_acts_carve(DecBlockActs *a, Carve *c, const BlockShape *s, int S);
void decblock_scratch_carve(DecBlockScratch *sc, Carve *c, const BlockShape *s, int S);
void decblock_forward(DecBlockActs *a, const act_t *x, const act_t *mem, int S, const unsigned char *src_pad,
                      const float *params, const DecBlockParams *p, const BlockShape *s, DecBlockScratch *sc);
void decblock_backward(act_t *dres, act_t *dmem, float *grads, const DecBlockActs *a, const act_t *x, const act_t *mem,
                       int S, const unsigned char *src_pad, const float *params, const DecBlockParams *p,
                       const BlockShape *s, DecBlockScratch *sc);

/* Adds one self-attention layer's projections, named prefix + "attn.<block>.weight" (and ".bias" when bias) in
 * the variant's block order (attn_block_name): the blocks' matrices back to back are the fused (W, C) weight
 * the products read as one, and their biases the fused bias, so each group starts aligned and its later blocks
 * follow with no gap (param_add_next); K/V blocks are kvC rows (grouped heads: docs/kernels.md). Sets
 * lp->attnw and lp->attnb (the first block's offsets). */
void block_attention_params(ParamTable *t, BlockParams *lp, const char *prefix, int variant, int C, int kvC,
                            int bias);
/* ---- positions (kernels/Kconfig "Positions", the @position rows of the table) ----
 * What a family needs for the configured scheme (ATTN_POSITION): its absolute
 * table for the embeddings, the per-layer tensors, the RoPE table. */
/* Adds one self-attention layer's positional tensors, named prefix + "attn.pos.w" etc.: the +Pos weights and
 * bias when pos (pos_groups sets of pos_m, and pos_groups), the relative bias "attn.rel_bias" (H, buckets)
 * with that scheme (initialised to zero: the families' init rules leave it alone). */
void block_position_params(ParamTable *t, BlockParams *lp, const char *prefix, int pos, int pos_m, int pos_groups,
                           int H);
/* The fixed sinusoidal table PE (T, C), PE[p, 2k] = sin(p w_k), PE[p, 2k+1] = cos(p w_k), w_k = 10000^(-2k/C),
 * in device memory (the caller dev_frees it). */
float *block_sinusoid_table_dev(int T, int C);
/* The RoPE table for T positions and head dim hd with the configured base, device memory; NULL unless the
 * configured scheme is RoPE. */
float *block_rope_table_dev(int T, int hd);
/* "learned", "sinusoidal", "rope", "alibi", "rel_bias": the configured scheme in descriptions and reports
 * (learned_kind: what the family's own absolute positions are, for the first row). */
const char *block_position_kind(const char *learned_kind);

/* ---- model descriptions (checkpoint metadata "model") ----------------------
 * The "attention" object every family writes: variant, label, projections,
 * +Pos settings and the score scale; the family adds what is its own
 * (causal, cross-attention). json_float: a float as the number its %g text
 * reads as (0.1f is 0.1), since stored descriptions are compared field by
 * field with those of the build. */
/* "kv_heads" is there only when the K/V heads are grouped (kv_heads < heads):
 * the descriptions of standard models stay as they were, and a checkpoint of
 * another count is refused by name. */
cJSON *attention_json(int variant, int pos, int pos_m, int pos_groups, int heads, int kv_heads);
double json_float(float x);

/* ---- decoding one position with a KV cache ---------------------------------
 * The same pre-LN block (with the decoder's cross-attention when cross is
 * given) for one new position t of N sequences at once: GPT-2 sampling
 * (N = 1) and the seq2seq decoder's beam search (N = batch x beams) both run
 * it. The cache keeps, per layer, the key-role rows and (unless the
 * variant's key role is its value role) the value-role rows of positions
 * 0..t of every sequence; memory a variant does not need is not allocated. */
typedef struct {
    int L, N, T, C, tensors; /* layers, sequences, positions, row width, tensors per layer (1 or 2); the row
                              * width is kv_heads * head_dim: the channels unless K/V heads are grouped */
    act_t *keys, *values;    /* (L, N, T, C) each; values == keys with one tensor */
    act_t *tmp;              /* (N, T, C): room for reordering */
    int *idx;                /* (N) device ints for reordering */
    int len;                 /* positions filled */
} KVCache;

/* Cache bytes one generated token adds: layers x tensors x kv_dim activations,
 * kv_dim = kv_heads * head_dim (C without grouped K/V heads). */
size_t kv_cache_bytes_per_token(int L, int kv_dim, int variant);
void kv_cache_init(KVCache *c, int L, int N, int T, int kv_dim, int variant);
void kv_cache_free(KVCache *c);
/* Row n continues sequence parent[n] (N host ints): reorders positions
 * 0..len-1 of every layer (beam search). */
void kv_cache_reorder(KVCache *c, const int *parent);

/* Cross-attention inputs of one decoder layer while decoding. */
typedef struct {
    const DecBlockParams *p;      /* the layer's cross-attention weights */
    const act_t *xkv;             /* (N, S, 2C): the encoder's keys and values, one copy per row */
    int S;
    const unsigned char *src_pad; /* (N, S): nonzero = padding, or NULL */
} DecodeCross;

/* Scratch for decoding N rows of width C, MLP width mlp. */
typedef struct {
    act_t *ln, *proj, *att, *branch, *fc, *fc_act, *xq, *xatt;
    float *mean, *rstd, *xlse;
} DecodeScratch;
/* proj_width: the self-attention projection width (block_proj_width()). */
void decode_scratch_init(DecodeScratch *sc, int N, int C, int H, int mlp, int proj_width);
void decode_scratch_free(DecodeScratch *sc);

/* x (N, C): the residual stream at position t, updated in place by block
 * `layer` of the model; the layer's rows for position t go into the cache
 * (the caller advances cache->len after the last layer). s describes the
 * block (C, H, mlp, activation, biases, +Pos) with B = N, T = 1; pre-LN. */
void block_decode(act_t *x, int t, KVCache *cache, int layer, const float *params, const BlockParams *p,
                  const DecodeCross *cross, const BlockShape *s, DecodeScratch *sc);

#endif
