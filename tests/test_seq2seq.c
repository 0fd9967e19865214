/* seq2seq tests for the attention variant this binary is built for:
 *  - each synthetic task's generator against hand examples, seeded generation;
 *  - corpus BLEU against hand-computed cases, the detokeniser, the tokeniser,
 *    vocabularies, gzip reading and translation batches;
 *  - parameter counts against the reference's synthetic oracles;
 *  - the whole model against a float64 reference composed from tests/ref.c
 *    (loss, and every parameter's gradient by central differences): the
 *    paper's post-LN encoder with one-hot input, a pre-LN encoder with an
 *    embedding, and encoder-decoders with padding, label smoothing, cross-
 *    attention and shared or separate embeddings;
 *  - decoding: beam width 1 against an uncached greedy search, and a beam
 *    wide enough to be exhaustive against an exhaustive search. */
#define _GNU_SOURCE
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>

#include "attention.h"
#include "common.h"
#include "kernels.h"
#include "model_check.h"
#include "ref.h"
#include "seq2seq/bleu.h"
#include "seq2seq/data.h"
#include "seq2seq/model.h"
#include "seq2seq/tasks.h"
#include "seq2seq/text.h"
#include "test.h"

/* ------------------------------------------------------------------ synthetic tasks */

static int same_ints(const int *a, const int *b, int n) {
    for (int i = 0; i < n; i++)
        if (a[i] != b[i]) return 0;
    return 1;
}

static void test_tasks(void) {
    const int x[8] = {3, 1, 4, 1, 5, 9, 2, 6};
    const int want[NUM_TASKS][8] = {
        [TASK_REVERSE] = {6, 2, 9, 5, 1, 4, 1, 3}, [TASK_SORT] = {1, 1, 2, 3, 4, 5, 6, 9},
        [TASK_SWAP] = {5, 9, 2, 6, 3, 1, 4, 1},    [TASK_SUB] = {6, 8, 5, 8, 4, 0, 7, 3},
        [TASK_COPY] = {3, 1, 4, 1, 5, 9, 2, 6},
    };
    for (int t = 0; t < NUM_TASKS; t++) {
        int y[8];
        task_labels((SynthTask)t, x, 8, y);
        CHECK(same_ints(y, want[t], 8), "%s of 3 1 4 1 5 9 2 6: got %d %d %d %d %d %d %d %d", task_name((SynthTask)t),
              y[0], y[1], y[2], y[3], y[4], y[5], y[6], y[7]);
        CHECK(task_from_name(task_name((SynthTask)t)) == t, "task name %s round trip", task_name((SynthTask)t));
    }
    /* odd length: swap = x[T/2:] then x[:T/2] */
    const int x5[5] = {1, 2, 3, 4, 5}, swap5[5] = {3, 4, 5, 1, 2}, rev5[5] = {5, 4, 3, 2, 1};
    int y5[5];
    task_labels(TASK_SWAP, x5, 5, y5);
    CHECK(same_ints(y5, swap5, 5), "swap of 1 2 3 4 5 is 3 4 5 1 2");
    task_labels(TASK_REVERSE, x5, 5, y5);
    CHECK(same_ints(y5, rev5, 5), "reverse of 1 2 3 4 5");
    CHECK(task_from_name("shuffle") == -1, "unknown task names are rejected");
    /* generation: digits, labels from task_labels, same seed same data, streams differ */
    enum { N = 200, T = 16 };
    static int xa[N * T], ya[N * T], xb[N * T], yb[N * T], xc[N * T], yc[N * T];
    task_generate(TASK_SORT, N, T, 7, 1, xa, ya);
    task_generate(TASK_SORT, N, T, 7, 1, xb, yb);
    task_generate(TASK_SORT, N, T, 7, 2, xc, yc);
    int digits = 1, labels = 1, hist[10] = {0};
    for (int s = 0; s < N; s++) {
        int y[T];
        task_labels(TASK_SORT, xa + s * T, T, y);
        labels &= same_ints(y, ya + s * T, T);
        for (int i = 0; i < T; i++) {
            digits &= xa[s * T + i] >= 0 && xa[s * T + i] <= 9;
            hist[xa[s * T + i]]++;
        }
    }
    int uniform = 1;
    for (int d = 0; d < 10; d++) uniform &= hist[d] > N * T / 10 * 0.75 && hist[d] < N * T / 10 * 1.25;
    CHECK(digits && labels, "generated inputs are digits with their task's labels");
    CHECK(uniform, "digits are spread evenly over 0..9");
    CHECK(same_ints(xa, xb, N * T) && !same_ints(xa, xc, N * T), "same seed and stream same data; streams differ");
    SynthData d;
    synth_load(&d, TASK_COPY, 8, 50, 10, 20, 3);
    CHECK(!same_ints(d.train_x, d.val_x, 10 * 8) && !same_ints(d.val_x, d.test_x, 10 * 8),
          "train, validation and test sets come from different streams");
    synth_free(&d);
}

/* ------------------------------------------------------------------ text and BLEU */

static void test_bleu(void) {
    BleuStats s = {0};
    const int a[6] = {1, 2, 3, 4, 5, 6};
    bleu_add(&s, a, 6, a, 6);
    CHECK_CLOSE(bleu_score(&s), 100.0, 1e-9, 0, "a hypothesis equal to its reference scores 100");
    /* the reference minus its last word: all precisions 1, brevity penalty exp(1 - 6/5) */
    BleuStats s2 = {0};
    bleu_add(&s2, a, 5, a, 6);
    CHECK_CLOSE(bleu_score(&s2), 100.0 * exp(-0.2), 1e-9, 0, "brevity penalty");
    /* corpus statistics: "a b c d e" | "a b c d e" and "a a a b" | "a b b c x";
     * second pair by hand: unigrams a:3 clipped to 1, b:1 -> 2/4; bigrams "a a" x2 (0), "a b" (1) -> 1/3;
     * trigrams 0/2; 4-grams 0/1. Corpus: 7/9, 5/7, 3/5, 2/3; lengths 9 vs 10. */
    BleuStats c = {0};
    const int h1[5] = {1, 2, 3, 4, 5}, h2[4] = {1, 1, 1, 2}, r2[5] = {1, 2, 2, 3, 9};
    bleu_add(&c, h1, 5, h1, 5);
    bleu_add(&c, h2, 4, r2, 5);
    CHECK(c.match[0] == 7 && c.total[0] == 9 && c.match[1] == 5 && c.total[1] == 7 && c.match[2] == 3 &&
              c.total[2] == 5 && c.match[3] == 2 && c.total[3] == 3,
          "clipped n-gram counts summed over the corpus");
    double want = 100.0 * exp(1.0 - 10.0 / 9.0) * pow(7.0 / 9 * 5.0 / 7 * 3.0 / 5 * 2.0 / 3, 0.25);
    CHECK_CLOSE(bleu_score(&c), want, 1e-9, 0, "corpus BLEU from the summed counts");
    /* clipping alone: "the the the the" against "the cat" has unigram precision 1/4 */
    BleuStats k = {0};
    const int the4[4] = {7, 7, 7, 7}, cat[2] = {7, 8};
    bleu_add(&k, the4, 4, cat, 2);
    CHECK(k.match[0] == 1 && k.total[0] == 4, "a repeated word counts at most as often as in the reference");
    CHECK(bleu_score(&k) == 0.0, "a zero 4-gram precision gives 0 (no smoothing)");
    BleuStats e = {0};
    bleu_add(&e, a, 0, a, 6);
    CHECK(bleu_score(&e) == 0.0, "empty hypotheses score 0");
    /* text: tokenised alike, so case and spacing around punctuation do not matter */
    BleuStats t = {0};
    bleu_add_text(&t, "two dogs run.", "Two dogs run .");
    CHECK_CLOSE(bleu_score(&t), 100.0, 1e-9, 0, "BLEU on text is case- and punctuation-spacing-insensitive");
    BleuStats t2 = {0};
    bleu_add_text(&t2, "a man in a red shirt", "A man in a red shirt is smiling.");
    CHECK_CLOSE(bleu_score(&t2), 100.0 * exp(1.0 - 9.0 / 6.0), 1e-9, 0, "text BLEU: a correct prefix");
}

static int strs_equal(const Strs *a, const char *const *b, int n) {
    if (a->n != n) return 0;
    for (int i = 0; i < n; i++)
        if (strcmp(a->s[i], b[i])) return 0;
    return 1;
}

static void test_text(void) {
    Strs w = {0};
    tokenize_line("Ein Mann läuft, ÜBER die Straße!", &w);
    const char *want[] = {"ein", "mann", "läuft", ",", "über", "die", "straße", "!"};
    CHECK(strs_equal(&w, want, 8), "tokenizer: lowercase (also non-ASCII), punctuation split (%d tokens)", w.n);
    strs_free(&w);
    tokenize_line("  3 kids' \"toys\"(red)  ", &w);
    const char *want2[] = {"3", "kids", "'", "\"", "toys", "\"", "(", "red", ")"};
    CHECK(strs_equal(&w, want2, 9), "tokenizer: digits, quotes, brackets, extra spaces (%d tokens)", w.n);
    strs_free(&w);
    const char *words[] = {"a", "man", "'", "s", "hat", ",", "(", "red", ")", "."};
    Strs in = {0}, back = {0};
    for (int i = 0; i < 10; i++) strs_push(&in, words[i], strlen(words[i]));
    char *text = detokenize(&in);
    CHECK(!strcmp(text, "a man's hat, (red)."), "detokenize: '%s'", text);
    tokenize_line(text, &back);
    CHECK(strs_equal(&back, words, 10), "tokenize(detokenize(words)) == words");
    free(text), strs_free(&in), strs_free(&back);

    /* vocabulary: min frequency, most frequent first, ties alphabetical, specials first */
    Strs corpus = {0};
    const char *toks[] = {"b", "a", "c", "a", "b", "d", "a"};
    for (int i = 0; i < 7; i++) strs_push(&corpus, toks[i], 1);
    const Strs *lists[1] = {&corpus};
    Vocab v;
    vocab_build(&v, lists, 1, 2);
    CHECK(v.words.n == NUM_SPECIALS + 2 && !strcmp(v.words.s[TOK_PAD], "<pad>") && !strcmp(v.words.s[4], "a") &&
              !strcmp(v.words.s[5], "b"),
          "vocabulary: specials, then a (3), b (2); c and d below min_freq");
    CHECK(vocab_id(&v, "a") == 4 && vocab_id(&v, "c") == TOK_UNK && vocab_id(&v, "<eos>") == TOK_EOS,
          "vocabulary lookups, unknown words are <unk>");
    int ids[6] = {4, 0, 5, TOK_EOS, 4, 4};
    Strs out = {0};
    ids_to_words(&v, ids, 6, &out);
    const char *want3[] = {"a", "<unk>", "b"};
    CHECK(strs_equal(&out, want3, 3), "ids_to_words stops at <eos> and keeps <unk>");
    strs_free(&out), strs_free(&corpus);
    vocab_free(&v);

    /* gzip lines, and a damaged file named in the error */
    char path[] = "/tmp/kvlab_test_lines_XXXXXX";
    int fd = mkstemp(path);
    close(fd);
    gzFile g = gzopen(path, "wb");
    const char body[] = "first line\nzweite Zeile\r\n\nlast without newline";
    gzwrite(g, body, sizeof body - 1);
    gzclose(g);
    Strs lines = {0};
    Err e;
    CHECK(read_lines_gz(path, &lines, &e) == 0 && lines.n == 4 && !strcmp(lines.s[1], "zweite Zeile") &&
              lines.s[2][0] == 0 && !strcmp(lines.s[3], "last without newline"),
          "gzip lines: CRLF, empty line, last line without newline (%d lines)", lines.n);
    strs_free(&lines);
    FILE *f = fopen(path, "r+b");
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fclose(f);
    CHECK(truncate(path, size - 12) == 0, "truncate the test file");
    int rc = read_lines_gz(path, &lines, &e);
    CHECK(rc != 0 && strstr(e.msg, path) && strstr(e.msg, "hint"), "a truncated gzip file is an error naming it: %s",
          rc ? e.msg : "(no error)");
    strs_free(&lines);
    unlink(path);
    CHECK(read_lines_gz("/nonexistent/train.de.gz", &lines, &e) != 0 && strstr(e.msg, "get_data.sh"),
          "a missing file names the data script: %s", e.msg);
}

static void test_batches(void) {
    /* corpus of 7 pairs with lengths 1..7 */
    Corpus c = {0};
    c.n = 7;
    c.src = xmalloc(7 * sizeof(int *)), c.tgt = xmalloc(7 * sizeof(int *));
    c.src_len = xmalloc(7 * sizeof(int)), c.tgt_len = xmalloc(7 * sizeof(int));
    for (int i = 0; i < 7; i++) {
        c.src_len[i] = i + 1, c.tgt_len[i] = 7 - i;
        c.src[i] = xmalloc(7 * sizeof(int)), c.tgt[i] = xmalloc(7 * sizeof(int));
        for (int j = 0; j < 7; j++) c.src[i][j] = 10 + j, c.tgt[i][j] = 20 + j;
    }
    int idx[2] = {1, 5}, src[16], tin[16], tout[16], S, T;
    trans_batch(&c, idx, 2, src, tin, tout, &S, &T);
    /* pair 1: src 2 tokens, tgt 6; pair 5: src 6, tgt 2 */
    CHECK(S == 6 && T == 7, "batch shape: longest source 6, longest target + 1 = 7 (got %d, %d)", S, T);
    const int src0[6] = {10, 11, TOK_PAD, TOK_PAD, TOK_PAD, TOK_PAD};
    const int tin1[7] = {TOK_BOS, 20, 21, TOK_PAD, TOK_PAD, TOK_PAD, TOK_PAD};
    const int tout1[7] = {20, 21, TOK_EOS, TOK_PAD, TOK_PAD, TOK_PAD, TOK_PAD};
    CHECK(same_ints(src, src0, 6) && same_ints(tin + 7, tin1, 7) && same_ints(tout + 7, tout1, 7),
          "padding, <bos> y as decoder input, y <eos> as targets");
    TransData d;
    memset(&d, 0, sizeof d);
    d.train = c;
    int order[7], starts[8], order2[7], starts2[8];
    int nb = trans_epoch_batches(&d, 3, 5, 0, order, starts);
    trans_epoch_batches(&d, 3, 5, 0, order2, starts2);
    int seen[7] = {0}, ok = nb == 3 && starts[0] == 0 && starts[3] == 7;
    for (int i = 0; i < 7; i++) seen[order[i]]++;
    for (int i = 0; i < 7; i++) ok &= seen[i] == 1;
    CHECK(ok, "an epoch's batches hold every pair exactly once");
    CHECK(same_ints(order, order2, 7) && same_ints(starts, starts2, 4), "batches are deterministic given the seed");
    corpus_free(&c);
}

/* ------------------------------------------------------------------ parameter counts */

static S2SConfig synthetic_config(void) {
    S2SConfig c = {.decoder = 0, .Vs = 10, .Vt = 10, .onehot = 1, .Tmax = 16, .C = 32, .H = 1, .mlp = 64, .L_enc = 1,
                   .post_ln = 1, .mlp_dropout = 1, .head_mlp = 1, .pad = -1, .dropout = 0.1f,
                   .variant = ATTN_VARIANT, .pos = ATTN_POS, .pos_m = ATTN_POS_DIM,
                   .pos_groups = ATTN_POS ? 1 : 0};
    return c;
}

/* Parameter counts are a pure function of the configuration: every variant
 * and +Pos setting is checked in every build. */
/* A model's parameter count as the oracles state it: without the relative-bias weights of that position
 * scheme (seq2seq's own positions are fixed). */
static long oracle_count(const S2SConfig *c) {
    return (long)s2s_num_params(c) - position_param_delta(c->L_enc + (c->decoder ? c->L_dec : 0), c->H, 0, c->C);
}

static void test_param_counts(void) {
    /* attention-variants.md table 4, synthetic row: d=32, L=1, H=1, 10 classes, biases */
    static const long oracle[ATTN_NUM_VARIANTS] = {[ATTN_QKV] = 10346, [ATTN_KV] = 9290, [ATTN_K] = 8234,
                                                   [ATTN_KV_TYING] = 9290};
    for (int v = 0; v < ATTN_NUM_VARIANTS; v++) {
        const char *name = attn_variant_label(v, 0);
        CHECK(oracle[v] > 0, "no synthetic parameter-count oracle for variant %s (add it from its definition)", name);
        S2SConfig c = synthetic_config();
        c.variant = v, c.pos = 0, c.pos_m = 0, c.pos_groups = 0;
        CHECK((long)oracle_count(&c) == oracle[v], "synthetic %s: %ld parameters, oracle %ld", name,
              oracle_count(&c), oracle[v]);
        c.pos = 1, c.pos_m = 10, c.pos_groups = 1;
        CHECK((long)oracle_count(&c) == oracle[v] + 11, "synthetic %s+Pos (m = 10): %ld parameters", name,
              oracle_count(&c));
        /* encoder-decoder: cross-attention adds 4d^2 + 4d and a LayerNorm per decoder layer, whatever the variant */
        for (int groups = 0; groups <= 2; groups++) { /* no +Pos, per layer, per head */
            S2SConfig t = {.decoder = 1, .Vs = 100, .Vt = 80, .Tmax = 20, .C = 16, .H = 2, .mlp = 64, .L_enc = 2,
                           .L_dec = 3, .gelu = 0, .scale_emb = 1, .pad = TOK_PAD, .variant = v, .pos = groups > 0,
                           .pos_m = groups ? 7 : 0, .pos_groups = groups};
            long C = 16, P = attn_num_proj(v), mlp = 64, posn = (long)groups * (groups ? 8 : 0);
            long self = P * (C * C + C) + C * C + C + posn, ffn = C * mlp + mlp + mlp * C + C, ln = 2 * C;
            long enc = 2 * (self + ffn + 2 * ln), dec = 3 * (self + ffn + 3 * ln + 4 * (C * C + C));
            long sep = 100 * C + enc + ln + 80 * C + dec + ln + 80 * C + 80;
            CHECK((long)oracle_count(&t) == sep, "%s encoder-decoder, separate embeddings, %d +Pos groups: %ld "
                  "parameters, by hand %ld", name, groups, oracle_count(&t), sep);
            t.shared_emb = 1;
            t.Vs = t.Vt = 100;
            long shared = 100 * C + enc + ln + dec + ln + 100;
            CHECK((long)oracle_count(&t) == shared, "%s encoder-decoder, one shared table, %d +Pos groups: %ld "
                  "parameters, by hand %ld", name, groups, oracle_count(&t), shared);
        }
    }
    /* grouped K/V heads (QKV, KV tying): the self-attention's non-query blocks are G*hd wide, cross-attention
     * keeps its 4 (d^2 + d); by hand for d = 16, 2 heads, MQA (kvC = 8) */
    for (int v = 0; v < ATTN_NUM_VARIANTS; v++) {
        if (attn_symmetric(v)) continue;
        S2SConfig t = {.decoder = 1, .Vs = 100, .Vt = 80, .Tmax = 20, .C = 16, .H = 2, .mlp = 64, .L_enc = 2,
                       .L_dec = 3, .scale_emb = 1, .pad = TOK_PAD, .variant = v, .kv_heads = 1};
        long C = 16, kvC = 8, P = attn_num_proj(v), mlp = 64, ln = 2 * C;
        long self = (C + (P - 1) * kvC) * (C + 1) + C * C + C, ffn = C * mlp + mlp + mlp * C + C;
        long enc = 2 * (self + ffn + 2 * ln), dec = 3 * (self + ffn + 3 * ln + 4 * (C * C + C));
        long want = 100 * C + enc + ln + 80 * C + dec + ln + 80 * C + 80;
        CHECK((long)oracle_count(&t) == want, "%s MQA encoder-decoder: %ld parameters, by hand %ld",
              attn_variant_label(v, 0), oracle_count(&t), want);
    }
    /* the reference's +Pos rows (m = 10) */
    S2SConfig c = synthetic_config();
    c.pos = 1, c.pos_m = 10, c.pos_groups = 1;
    c.variant = ATTN_K;
    CHECK(oracle_count(&c) == 8245u, "the reference's K+Pos row (m = 10)");
    c.variant = ATTN_KV;
    CHECK(oracle_count(&c) == 9301u, "the reference's KV+Pos row (m = 10)");
}

/* ------------------------------------------------------------------ float64 reference */

typedef struct {
    S2S *m;
    double *P;
    const int *src, *tin, *tout;
    int B, S, T;
} RefCtx;

/* The sinusoidal positions added to the embeddings (none when the configured scheme acts in attention). */
static void ref_positions(double *x, int B, int T, int C) {
    if (ATTN_POSITION_IN_ATTENTION) return;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int i = 0; i < C; i += 2) {
                double f = pow(10000.0, -(double)i / C);
                x[((size_t)b * T + t) * C + i] += sin(t * f);
                if (i + 1 < C) x[((size_t)b * T + t) * C + i + 1] += cos(t * f);
            }
}

static void ref_pad(unsigned char *mask, const int *tok, size_t n, int pad) {
    for (size_t i = 0; i < n; i++) mask[i] = pad >= 0 && tok[i] == pad;
}

/* x += proj(attention(qkv(in))) of block lp */
static void ref_attn_branch(double *x, const double *in, const double *P, const BlockParams *lp, const S2SConfig *c,
                            int B, int T, int causal, const unsigned char *pad) {
    int C = c->C, PW = ref_proj_width(c->variant, c->H, c->C / c->H, c->kv_heads);
    size_t n = (size_t)B * T * C;
    double *proj = xmalloc(n / C * PW * sizeof(double)), *att = xmalloc(n * sizeof(double)), *br = xmalloc(n * sizeof(double));
    ref_linear(proj, in, P + lp->attnw, P + lp->attnb, B * T, C, PW);
    RefPositions pe = ref_layer_positions(P, lp);
    ref_self_attention_pe(att, proj, c->variant, B, T, c->H, C / c->H, c->kv_heads, causal, pad,
                          c->pos ? P + lp->posw : NULL, c->pos ? P + lp->posb : NULL, c->pos_m, c->pos_groups, 0.0, 0,
                          &pe);
    ref_linear(br, att, P + lp->projw, P + lp->projb, B * T, C, C);
    for (size_t i = 0; i < n; i++) x[i] += br[i];
    free(proj), free(att), free(br);
}

static void ref_mlp_branch(double *x, const double *in, const double *P, const BlockParams *lp, const S2SConfig *c,
                           int N) {
    size_t nm = (size_t)N * c->mlp, n = (size_t)N * c->C;
    double *fc = xmalloc(nm * sizeof(double)), *act = xmalloc(nm * sizeof(double)), *br = xmalloc(n * sizeof(double));
    ref_linear(fc, in, P + lp->fcw, P + lp->fcb, N, c->C, c->mlp);
    if (c->gelu)
        ref_gelu(act, fc, nm);
    else
        ref_relu(act, fc, nm);
    ref_linear(br, act, P + lp->fcpw, P + lp->fcpb, N, c->mlp, c->C);
    for (size_t i = 0; i < n; i++) x[i] += br[i];
    free(fc), free(act), free(br);
}

static void ref_embed(double *x, const double *table, const int *tok, int B, int T, int C, double scale) {
    for (size_t i = 0; i < (size_t)B * T; i++)
        for (int k = 0; k < C; k++) x[i * C + k] = scale * table[(size_t)tok[i] * C + k];
    ref_positions(x, B, T, C);
}

static double ref_loss(void *vctx) {
    RefCtx *r = vctx;
    S2S *m = r->m;
    const S2SConfig *c = &m->cfg;
    const double *P = r->P;
    int B = r->B, S = r->S, T = r->T, C = c->C;
    size_t ns = (size_t)B * S * C, nt = (size_t)B * T * C;
    double scale = c->scale_emb ? sqrt((double)C) : 1.0;
    double *x = xmalloc(ns * sizeof(double)), *ln = xmalloc((ns > nt ? ns : nt) * sizeof(double));
    unsigned char *spad = xmalloc((size_t)B * S), *tpad = xmalloc((size_t)B * T);
    ref_pad(spad, r->src, (size_t)B * S, c->pad);
    if (c->onehot) {
        double *oh = xcalloc((size_t)B * S * c->Vs, sizeof(double));
        for (int i = 0; i < B * S; i++) oh[(size_t)i * c->Vs + r->src[i]] = 1.0;
        ref_linear(x, oh, P + m->inw, P + m->inb, B * S, c->Vs, C);
        ref_positions(x, B, S, C);
        free(oh);
    } else {
        ref_embed(x, P + m->src_emb, r->src, B, S, C, scale);
    }
    for (int l = 0; l < c->L_enc; l++) {
        const BlockParams *lp = &m->enc[l];
        if (c->post_ln) {
            memcpy(ln, x, ns * sizeof(double));
            ref_attn_branch(ln, x, P, lp, c, B, S, 0, spad); /* ln = x + attn(x) */
            ref_layernorm(x, ln, P + lp->ln1w, P + lp->ln1b, B * S, C);
            memcpy(ln, x, ns * sizeof(double));
            ref_mlp_branch(ln, x, P, lp, c, B * S);
            ref_layernorm(x, ln, P + lp->ln2w, P + lp->ln2b, B * S, C);
        } else {
            ref_layernorm(ln, x, P + lp->ln1w, P + lp->ln1b, B * S, C);
            ref_attn_branch(x, ln, P, lp, c, B, S, 0, spad);
            ref_layernorm(ln, x, P + lp->ln2w, P + lp->ln2b, B * S, C);
            ref_mlp_branch(x, ln, P, lp, c, B * S);
        }
    }
    double *mem = xmalloc(ns * sizeof(double));
    if (c->post_ln)
        memcpy(mem, x, ns * sizeof(double));
    else
        ref_layernorm(mem, x, P + m->enc_lnfw, P + m->enc_lnfb, B * S, C);
    double loss;
    if (!c->decoder) {
        double *logits = xmalloc((size_t)B * S * c->Vt * sizeof(double)), *h = mem;
        double *hfc = xmalloc(ns * sizeof(double)), *hln = xmalloc(ns * sizeof(double));
        if (c->head_mlp) {
            ref_linear(hfc, mem, P + m->hfcw, P + m->hfcb, B * S, C, C);
            ref_layernorm(hln, hfc, P + m->hlnw, P + m->hlnb, B * S, C);
            ref_relu(hln, hln, ns);
            h = hln;
        }
        ref_linear(logits, h, P + m->houtw, P + m->houtb, B * S, C, c->Vt);
        loss = ref_crossentropy(logits, r->tout, B * S, c->Vt, c->pad, c->label_smoothing);
        free(logits), free(hfc), free(hln);
    } else {
        double *y = xmalloc(nt * sizeof(double)), *q = xmalloc(nt * sizeof(double));
        double *kv = xmalloc(ns * 2 * sizeof(double)), *att = xmalloc(nt * sizeof(double));
        double *br = xmalloc(nt * sizeof(double)), *logits = xmalloc((size_t)B * T * c->Vt * sizeof(double));
        ref_pad(tpad, r->tin, (size_t)B * T, c->pad);
        ref_embed(y, P + m->tgt_emb, r->tin, B, T, C, scale);
        for (int l = 0; l < c->L_dec; l++) {
            const DecBlockParams *dp = &m->dec[l];
            ref_layernorm(ln, y, P + dp->b.ln1w, P + dp->b.ln1b, B * T, C);
            ref_attn_branch(y, ln, P, &dp->b, c, B, T, 1, tpad);
            ref_layernorm(ln, y, P + dp->lnxw, P + dp->lnxb, B * T, C);
            ref_linear(q, ln, P + dp->xqw, P + dp->xqb, B * T, C, C);
            ref_linear(kv, mem, P + dp->xkvw, P + dp->xkvb, B * S, C, 2 * C);
            ref_cross_attention(att, q, kv, B, T, S, c->H, C / c->H, spad, 0.0, 0);
            ref_linear(br, att, P + dp->xprojw, P + dp->xprojb, B * T, C, C);
            for (size_t i = 0; i < nt; i++) y[i] += br[i];
            ref_layernorm(ln, y, P + dp->b.ln2w, P + dp->b.ln2b, B * T, C);
            ref_mlp_branch(y, ln, P, &dp->b, c, B * T);
        }
        ref_layernorm(ln, y, P + m->dec_lnfw, P + m->dec_lnfb, B * T, C);
        ref_linear(logits, ln, P + m->genw, P + m->genb, B * T, C, c->Vt);
        loss = ref_crossentropy(logits, r->tout, B * T, c->Vt, c->pad, c->label_smoothing);
        free(y), free(q), free(kv), free(att), free(br), free(logits);
    }
    free(x), free(ln), free(mem), free(spad), free(tpad);
    return loss;
}

/* One forward and backward pass on given sequences (attn_grads_only_errors) */
typedef struct {
    S2S *m;
    const int *src, *tin, *tout;
    int S, T, B;
} Pass;

static void pass(void *v) {
    Pass *p = v;
    s2s_forward(p->m, p->src, p->S, p->tin, p->tout, p->T, p->B, 1, 99);
    params_zero_grad(&p->m->w);
    s2s_backward(p->m, 1.0f);
}

static void model_case(const char *name, S2SConfig c, const int *src, int S, const int *tin, const int *tout, int T,
                       int B) {
    S2S m;
    s2s_init(&m, &c, 11);
    float *hp = perturb_params(&m.w, 1.5f);
    double loss = s2s_forward(&m, src, S, tin, tout, T, B, 1, 99); /* training with dropout 0: same function */
    params_zero_grad(&m.w);
    s2s_backward(&m, 1.0f);
    RefCtx r = {&m, xmalloc(m.w.table.total * sizeof(double)), src, tin, tout, B, S, c.decoder ? T : S};
    for (size_t k = 0; k < m.w.table.total; k++) r.P[k] = hp[k];
    double want = ref_loss(&r);
    CHECK(fabs(loss - want) <= 1e-5 * fabs(want), "%s: loss %.8f, float64 reference %.8f", name, loss, want);
    double worst_rel;
    int bad = gradcheck(name, &m.w, r.P, ref_loss, &r, 24, &worst_rel);
    CHECK(bad == 0, "%s: %d of %d tensors have gradients off the finite differences (worst relative %.3g)", name,
          bad, m.w.table.n, worst_rel);
    CHECK(param_layout_errors(name, &m.w) == 0, "%s: %zu parameters in %zu floats: tensors aligned, fused blocks "
          "adjacent, the gaps zero after a backward pass", name, m.w.table.count, m.w.table.total);
    /* an analysis's pass (mechint's masks): the self-attention projections' gradients alone, the same bits */
    Pass ps = {&m, src, tin, tout, S, T, B};
    int nb = c.L_enc + (c.decoder ? c.L_dec : 0);
    const BlockParams **bl = xmalloc((size_t)nb * sizeof *bl);
    for (int l = 0; l < nb; l++) bl[l] = l < c.L_enc ? &m.enc[l] : &m.dec[l - c.L_enc].b;
    CHECK(attn_grads_only_errors(name, &m.w, pass, &ps, bl, nb) == 0, "%s: with attn_grads_only the "
          "self-attention projections' gradients are the same bits, the output projection's and the MLP's skipped",
          name);
    free(bl);
    free(r.P), free(hp);
    s2s_free(&m);
}

static void test_models(void) {
    /* the paper's synthetic encoder: one-hot input, post-LN, ReLU, MLP head; two layers, two heads */
    S2SConfig enc = synthetic_config();
    enc.C = 8, enc.H = 2, enc.mlp = 16, enc.L_enc = 2, enc.Tmax = 6, enc.dropout = 0.0f;
    enc.pos_groups = ATTN_POS ? (ATTN_POS_PER_HEAD ? enc.H : 1) : 0;
    const int x[12] = {3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8}, y[12] = {9, 5, 1, 4, 1, 3, 8, 5, 3, 5, 6, 2};
    model_case("post-LN one-hot encoder", enc, x, 6, NULL, y, 6, 2);
    /* pre-LN encoder with an embedding, GELU, final LayerNorm, linear head */
    S2SConfig pre = enc;
    pre.post_ln = 0, pre.onehot = 0, pre.gelu = 1, pre.head_mlp = 0;
    model_case("pre-LN embedding encoder", pre, x, 6, NULL, y, 6, 2);

    /* encoder-decoders: padding in source and target, label smoothing, scaled embeddings */
    S2SConfig ed = {.decoder = 1, .Vs = 11, .Vt = 9, .Tmax = 8, .C = 8, .H = 2, .mlp = 16, .L_enc = 2, .L_dec = 2,
                    .gelu = 0, .scale_emb = 1, .pad = TOK_PAD, .label_smoothing = 0.1f, .variant = ATTN_VARIANT,
                    .pos = ATTN_POS, .pos_m = ATTN_POS_DIM,
                    .pos_groups = ATTN_POS ? (ATTN_POS_PER_HEAD ? 2 : 1) : 0};
    const int src[10] = {5, 7, 4, 9, 6, 8, 10, 4, TOK_PAD, TOK_PAD};
    const int tin[8] = {TOK_BOS, 4, 6, 8, TOK_BOS, 7, TOK_PAD, TOK_PAD};
    const int tout[8] = {4, 6, 8, TOK_EOS, 7, TOK_EOS, TOK_PAD, TOK_PAD};
    model_case("encoder-decoder, separate embeddings", ed, src, 5, tin, tout, 4, 2);
    S2SConfig sh = ed;
    sh.shared_emb = 1, sh.Vs = sh.Vt = 11, sh.gelu = 1;
    model_case("encoder-decoder, shared embedding and generator", sh, src, 5, tin, tout, 4, 2);

    if (!attn_symmetric(ATTN_VARIANT)) { /* grouped K/V heads in encoder and decoder self-attention */
        S2SConfig g = ed;
        g.C = 16, g.H = 4, g.kv_heads = 2, g.pos_groups = ATTN_POS ? (ATTN_POS_PER_HEAD ? 4 : 1) : 0;
        model_case("encoder-decoder, 2 K/V heads for 4", g, src, 5, tin, tout, 4, 2);
        S2SConfig mq = enc;
        mq.kv_heads = 1;
        model_case("post-LN one-hot encoder, MQA", mq, x, 6, NULL, y, 6, 2);
    }

    /* dropout: deterministic given the seed, off outside training */
    S2SConfig dr = ed;
    dr.dropout = 0.2f;
    S2S m;
    s2s_init(&m, &dr, 3);
    double a = s2s_forward(&m, src, 5, tin, tout, 4, 2, 1, 5), b = s2s_forward(&m, src, 5, tin, tout, 4, 2, 1, 5);
    double c2 = s2s_forward(&m, src, 5, tin, tout, 4, 2, 1, 6), e1 = s2s_forward(&m, src, 5, tin, tout, 4, 2, 0, 5);
    double e2 = s2s_forward(&m, src, 5, tin, tout, 4, 2, 0, 6);
    CHECK(a == b && a != c2, "dropout is a function of the seed (%.6f %.6f %.6f)", a, b, c2);
    CHECK(e1 == e2 && e1 != a, "no dropout outside training");
    s2s_free(&m);
}

/* ------------------------------------------------------------------ decoding */

/* Log-probabilities of the next token after <bos> prefix[0..t) for source row b, uncached. */
static void next_logprobs(S2S *m, const int *src, int S, const int *prefix, int t, double *lp) {
    int V = m->cfg.Vt, tin[64], tout[64];
    tin[0] = TOK_BOS;
    for (int i = 0; i < t; i++) tin[i + 1] = prefix[i];
    for (int i = 0; i <= t; i++) tout[i] = 0;
    s2s_forward(m, src, S, tin, tout, t + 1, 1, 0, 0);
    float *logits = xmalloc((size_t)(t + 1) * V * sizeof(float));
    act_download(logits, m->acts.logits, (size_t)(t + 1) * V);
    const float *row = logits + (size_t)t * V;
    double mx = row[0], z = 0.0;
    for (int v = 1; v < V; v++) mx = row[v] > mx ? row[v] : mx;
    for (int v = 0; v < V; v++) z += exp(row[v] - mx);
    for (int v = 0; v < V; v++) lp[v] = row[v] - mx - log(z);
    free(logits);
}

/* H heads of dim 4, kv_heads K/V heads (0: one per query head): the cache, its beam reordering and the
 * decoder block at one position against whole forward passes. */
static void test_decoding(int H, int kv_heads) {
    S2SConfig c = {.decoder = 1, .Vs = 12, .Vt = 6, .Tmax = 12, .C = 4 * H, .H = H, .mlp = 16, .L_enc = 1,
                   .L_dec = 2, .scale_emb = 1, .pad = TOK_PAD, .variant = ATTN_VARIANT, .pos = ATTN_POS,
                   .pos_m = ATTN_POS_DIM, .pos_groups = ATTN_POS ? (ATTN_POS_PER_HEAD ? H : 1) : 0,
                   .kv_heads = kv_heads};
    S2S m;
    s2s_init(&m, &c, 21);
    free(perturb_params(&m.w, 1.5f * 1.5f)); /* peaked distributions: few near-ties */
    enum { B = 3, S = 5, L = 10 };
    const int src[B * S] = {4, 5, 6, 7, 8, 9, 10, 11, TOK_PAD, TOK_PAD, 7, 4, 4, 11, TOK_PAD};
    int out[B * L], lens[B], agree = 1;
    s2s_decode(&m, src, S, B, 1, 0.6, L, TOK_BOS, TOK_EOS, out, lens);
    for (int b = 0; b < B; b++) { /* greedy without caches: a whole forward pass per token */
        int seq[L], n = 0;
        double lp[6];
        while (n < L) {
            next_logprobs(&m, src + b * S, S, seq, n, lp);
            int best = 0;
            for (int v = 1; v < 6; v++) best = v != TOK_PAD && v != TOK_BOS && lp[v] > lp[best] ? v : best;
            if (best == TOK_EOS) break;
            seq[n++] = best;
        }
        agree &= lens[b] == n && same_ints(out + b * L, seq, n) && (n == L || out[b * L + n] == TOK_EOS);
    }
    CHECK(agree, "%d K/V heads for %d: beam width 1 equals an uncached greedy search (lengths %d %d %d)",
          kv_heads ? kv_heads : H, H, lens[0], lens[1], lens[2]);

    /* exhaustive search over every output of at most 3 tokens (V = 6): a beam of 36 keeps every prefix */
    for (int ai = 0; ai < 2; ai++) {
        double alpha = ai ? 0.6 : 0.0;
        int ok = 1;
        for (int b = 0; b < B; b++) {
            double best = -INFINITY, lp0[6], lp1[6], lp2[6];
            int best_seq[3] = {0}, best_len = -1, p[3];
            next_logprobs(&m, src + b * S, S, p, 0, lp0);
            for (int t0 = 0; t0 < 6; t0++) {
                if (t0 == TOK_PAD || t0 == TOK_BOS) continue; /* never generated */
                if (t0 == TOK_EOS) {
                    if (lp0[t0] > best) best = lp0[t0], best_len = 0; /* length 0 counts as 1 */
                    continue;
                }
                p[0] = t0;
                next_logprobs(&m, src + b * S, S, p, 1, lp1);
                for (int t1 = 0; t1 < 6; t1++) {
                    if (t1 == TOK_PAD || t1 == TOK_BOS) continue;
                    double s1 = lp0[t0] + lp1[t1];
                    if (t1 == TOK_EOS) {
                        if (s1 / pow(1, alpha) > best) best = s1, best_len = 1, best_seq[0] = t0;
                        continue;
                    }
                    p[1] = t1;
                    next_logprobs(&m, src + b * S, S, p, 2, lp2);
                    for (int t2 = 0; t2 < 6; t2++) {
                        if (t2 == TOK_PAD || t2 == TOK_BOS) continue;
                        double s2 = s1 + lp2[t2];
                        int len = t2 == TOK_EOS ? 2 : 3;
                        double norm = s2 / pow(len, alpha);
                        if (norm > best) best = norm, best_len = len, best_seq[0] = t0, best_seq[1] = t1, best_seq[2] = t2;
                    }
                }
            }
            int o[3], n;
            s2s_decode(&m, src + b * S, S, 1, 36, alpha, 3, TOK_BOS, TOK_EOS, o, &n);
            ok &= n == best_len && same_ints(o, best_seq, n);
        }
        CHECK(ok, "%d K/V heads for %d: beam 36 over 3 tokens finds the exhaustive best (alpha %.1f)",
              kv_heads ? kv_heads : H, H, alpha);
    }
    s2s_free(&m);
}

/* seq2seq's initialisation as seq2seq/model.c states it (the reference models), tensor by tensor from the names:
 * every matrix Xavier-uniform, U(-b, b) with b = sqrt(6 / (rows + columns)), the +Pos weights as Linear(m, 1)'s
 * (b = sqrt(6 / (m + 1))), LayerNorm weights 1, every bias and relative-position bias 0. */
static InitRule s2s_init_rule(const ParamSpec *s, const void *ctx, double *x) {
    const S2SConfig *c = ctx;
    const char *n = s->name;
    if (str_ends_with(n, ".pos.w")) return *x = sqrt(6.0 / (c->pos_m + 1)), INIT_UNIFORM;
    if (s->ndim == 2 && !strstr(n, ".rel_bias"))
        return *x = sqrt(6.0 / (double)(s->shape[0] + s->shape[1])), INIT_UNIFORM;
    return *x = strstr(n, "ln") && str_ends_with(n, ".weight"), INIT_CONST;
}
static void test_init(void) {
    S2SConfig c = {.decoder = 1, .Vs = 100, .Vt = 80, .Tmax = 20, .C = 32, .H = 2, .mlp = 64, .L_enc = 2,
                   .L_dec = 2, .scale_emb = 1, .pad = TOK_PAD, .variant = ATTN_VARIANT, .pos = ATTN_POS,
                   .pos_m = ATTN_POS_DIM, .pos_groups = ATTN_POS ? (ATTN_POS_PER_HEAD ? 2 : 1) : 0};
    S2S m;
    s2s_init(&m, &c, 1);
    int bad = init_errors("seq2seq", &m.w, s2s_init_rule, &c);
    CHECK(bad == 0, "seq2seq initialisation: %d of %d tensors off their rule", bad, m.w.table.n);
    s2s_free(&m);
}

int main(void) {
    backend_init(1);
    test_tasks();
    test_bleu();
    test_text();
    test_batches();
    test_param_counts();
    test_init();
    test_models();
    test_decoding(2, 0);
    if (!attn_symmetric(ATTN_VARIANT)) { /* grouped K/V heads: QKV and KV tying */
        test_decoding(4, 2);
        test_decoding(4, 1);
    }
    return TEST_SUMMARY("test_seq2seq");
}
