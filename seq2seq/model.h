/* Sequence models of the seq2seq family.
 *
 * Encoder only (the paper's synthetic tasks): tokens -> input layer (a
 * Linear on one-hot digits, or an embedding) + sinusoidal positions -> L
 * blocks (post-LN as the paper, or pre-LN) with bidirectional attention in
 * the configured variant -> per-token head.
 *
 * Encoder-decoder (translation; synthetic with the decoder option):
 * source embedding x sqrt(d) + positions -> pre-LN encoder blocks (source
 * padding masked) -> LayerNorm = memory; target embedding x sqrt(d) +
 * positions -> pre-LN decoder blocks: causal self-attention in the
 * configured variant, cross-attention to the memory (always QKV), MLP ->
 * LayerNorm -> generator. Shared embeddings tie source, target and
 * generator to one table over a joint vocabulary. */
#ifndef KVLAB_SEQ2SEQ_MODEL_H
#define KVLAB_SEQ2SEQ_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "block.h"
#include "params.h"

typedef struct {
    int decoder;        /* 1: encoder-decoder; 0: encoder only */
    int Vs, Vt;         /* vocabularies (equal when shared); encoder only: Vt output classes */
    int onehot;         /* encoder input Linear(Vs, C) on one-hot tokens instead of an embedding */
    int Tmax;           /* longest sequence: positions table and +Pos basis */
    int C, H, mlp, L_enc, L_dec;
    int post_ln;        /* encoder blocks post-LN (no final encoder LayerNorm then) */
    int gelu;           /* MLP activation; 0 = ReLU */
    int mlp_dropout;    /* dropout inside the MLP as well */
    int scale_emb;      /* embeddings times sqrt(C) */
    int shared_emb;
    int head_mlp;       /* encoder only: Linear(C,C), LayerNorm, ReLU, dropout, Linear(C,V) */
    int pad;            /* padding id (masked as key, ignored as target); -1 = none */
    float dropout, label_smoothing;
    int variant, pos, pos_m, pos_groups;
    int kv_heads;   /* K/V heads G of self-attention (attn_kv_heads(H)); cross-attention keeps H */
} S2SConfig;

char *s2s_config_json(const S2SConfig *c);

typedef struct {
    act_t *x0;                      /* (B,S,C) encoder input after positions and dropout */
    BlockActs *enc;                 /* per encoder layer */
    act_t *mem;                     /* encoder output (after the final LayerNorm when there is one) */
    float *mem_mean, *mem_rstd;     /* its LayerNorm's statistics */
    act_t *hfc, *hln, *hact;        /* encoder-only head */
    float *hln_mean, *hln_rstd;
    act_t *y0;                      /* (B,T,C) decoder input */
    DecBlockActs *dec;
    act_t *yout;                    /* decoder output after its LayerNorm */
    float *yout_mean, *yout_rstd;
    act_t *logits;
    float *losses, *ce_lse;
    act_t *onehot;                  /* (B*S, Vs) one-hot input */
    act_t *dres, *dmem, *dtmp, *dtmp2, *dtmp3;
    BlockScratch scratch;
    DecBlockScratch dscratch;
} S2SActs;

typedef struct {
    S2SConfig cfg;
    Params w; /* parameters, gradients, AdamW moments (nn/params.h) */
    size_t inw, inb, src_emb, tgt_emb, enc_lnfw, enc_lnfb, dec_lnfw, dec_lnfb, genw, genb;
    size_t hfcw, hfcb, hlnw, hlnb, houtw, houtb;
    BlockParams *enc;
    DecBlockParams *dec;
    float *pe;                      /* (Tmax, C) sinusoidal positions; NULL when the position scheme acts in attention */
    float *rope;                    /* RoPE table with POSITION_ROPE, else NULL */
    float *pos_feat;                /* +Pos basis */
    S2SActs acts;
    void *act_memory;
    size_t act_capacity; /* bytes */
    size_t src_capacity, tgt_capacity; /* token slots behind src/src_pad and tgt_*; grown with the arena */
    int *src, *tgt_in, *tgt_out;    /* device copies of the batch */
    unsigned char *src_pad, *tgt_pad;
    int fwd_B, fwd_S, fwd_T, fwd_training, counted;
    uint64_t dropout_seed_base;
    /* analysis (mechint): hooks on every self-attention block (encoder
     * layers 0..L_enc-1, then decoder layers), and a backward that starts
     * from d(loss)/d(logits) the caller wrote into acts.logits */
    const BlockHook *hook;
    int external_dlogits;
} S2S;

void s2s_init(S2S *m, const S2SConfig *cfg, uint64_t seed);
void s2s_free(S2S *m);
size_t s2s_num_params(const S2SConfig *c);
size_t s2s_matmul_params(const S2SConfig *c);

/* Encoder only: src (B, S) tokens, targets (B, S) labels (pad ignored).
 * Encoder-decoder: src (B, S), tgt_in (B, T) decoder inputs (<bos> y...),
 * tgt_out (B, T) the next tokens. Each target's loss stays on the device
 * (m->counted of them count); s2s_loss_into adds them to a training step's
 * record without waiting for a GPU. */
void s2s_forward_pass(S2S *m, const int *src, int S, const int *tgt_in, const int *tgt_out, int T, int B,
                      int training, uint64_t dropout_seed);
/* *acc (a double in device memory) += scale * the sum of the last pass's losses. */
void s2s_loss_into(S2S *m, double *acc, double scale);
/* The mean loss over the counted targets of the last pass (reads it back). */
double s2s_loss(S2S *m);
/* s2s_forward_pass, then its s2s_loss. */
double s2s_forward(S2S *m, const int *src, int S, const int *tgt_in, const int *tgt_out, int T, int B, int training,
                   uint64_t dropout_seed);
/* Targets of the last forward the model ranked first (argmax), of m->counted (reads the count back). */
int s2s_correct(S2S *m);
/* *acc (a double in device memory) += s2s_correct's count, on the device. */
void s2s_correct_into(S2S *m, double *acc);
void s2s_backward(S2S *m, float loss_scale);

/* ---- decoding (encoder-decoder) -------------------------------------------
 * Greedy or beam search with caches: the encoder runs once, each decoder
 * layer caches its self-attention rows (one tensor for K and KV tying) and
 * the cross-attention keys and values of the source. out (B, max_len) gets
 * token ids ending with <eos> or cut at max_len; lens the lengths without
 * <eos>. Beam search ranks finished hypotheses by log-probability divided by
 * length^alpha; width 1 is greedy decoding exactly. */
void s2s_decode(S2S *m, const int *src, int S, int B, int beam, double alpha, int max_len, int bos, int eos,
                int *out, int *lens);

#endif
