#include "data.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "buildinfo.h"
#include "rng.h"

/* ------------------------------------------------------------------ synthetic */

void synth_load(SynthData *d, SynthTask task, int T, int ntrain, int nval, int ntest, uint64_t seed) {
    memset(d, 0, sizeof *d);
    d->T = T, d->ntrain = ntrain, d->nval = nval, d->ntest = ntest;
    d->train_x = xmalloc((size_t)ntrain * T * sizeof(int)), d->train_y = xmalloc((size_t)ntrain * T * sizeof(int));
    d->val_x = xmalloc((size_t)nval * T * sizeof(int)), d->val_y = xmalloc((size_t)nval * T * sizeof(int));
    d->test_x = xmalloc((size_t)ntest * T * sizeof(int)), d->test_y = xmalloc((size_t)ntest * T * sizeof(int));
    /* each split from its own stream of the seed: generated once, never resampled */
    task_generate(task, ntrain, T, seed, 101, d->train_x, d->train_y);
    task_generate(task, nval, T, seed, 102, d->val_x, d->val_y);
    task_generate(task, ntest, T, seed, 103, d->test_x, d->test_y);
}

void synth_free(SynthData *d) {
    free(d->train_x), free(d->train_y), free(d->val_x), free(d->val_y), free(d->test_x), free(d->test_y);
    memset(d, 0, sizeof *d);
}

/* ------------------------------------------------------------------ translation */

/* Tokenised lines of path; the raw lines go to raw when given. */
static int tokenize_file(const char *path, Strs **sentences, int *n, Strs *raw, Err *e) {
    Strs lines = {0};
    if (read_lines_gz(path, &lines, e) != 0) {
        strs_free(&lines);
        return -1;
    }
    *n = lines.n;
    *sentences = xcalloc((size_t)(lines.n ? lines.n : 1), sizeof(Strs));
    for (int i = 0; i < lines.n; i++) tokenize_line(lines.s[i], &(*sentences)[i]);
    if (raw)
        *raw = lines;
    else
        strs_free(&lines);
    return 0;
}

static void free_sentences(Strs *s, int n) {
    for (int i = 0; i < n; i++) strs_free(&s[i]);
    free(s);
}

/* Sentence pairs as ids; training pairs longer than max_len are dropped. */
static void to_corpus(Corpus *c, const Strs *src, const Strs *tgt, int n, const Vocab *sv, const Vocab *tv, int max_len,
                      int *dropped) {
    memset(c, 0, sizeof *c);
    c->src = xmalloc((size_t)(n ? n : 1) * sizeof(int *)), c->tgt = xmalloc((size_t)(n ? n : 1) * sizeof(int *));
    c->src_len = xmalloc((size_t)(n ? n : 1) * sizeof(int)), c->tgt_len = xmalloc((size_t)(n ? n : 1) * sizeof(int));
    for (int i = 0; i < n; i++) {
        int ls = src[i].n, lt = tgt[i].n;
        if (max_len > 0 && (ls > max_len || lt + 1 > max_len)) {
            if (dropped) (*dropped)++;
            continue;
        }
        int k = c->n++;
        c->src[k] = xmalloc((size_t)(ls ? ls : 1) * sizeof(int));
        c->tgt[k] = xmalloc((size_t)(lt ? lt : 1) * sizeof(int));
        for (int j = 0; j < ls; j++) c->src[k][j] = vocab_id(sv, src[i].s[j]);
        for (int j = 0; j < lt; j++) c->tgt[k][j] = vocab_id(tv, tgt[i].s[j]);
        c->src_len[k] = ls, c->tgt_len[k] = lt;
    }
}

int trans_load(TransData *d, const char *data_dir, int de_en, int min_freq, int max_len, int shared, Err *e) {
    memset(d, 0, sizeof *d);
    d->src_lang = de_en ? "de" : "en";
    d->tgt_lang = de_en ? "en" : "de";
    static const char *const splits[3] = {"train", "val", "test_2016_flickr"};
    static const int expected[3] = {29000, 1014, 1000};
    Strs *src[3] = {0}, *tgt[3] = {0};
    int ns[3], nt[3], rc = 0;
    for (int k = 0; k < 3 && rc == 0; k++) {
        char ps[4096], pt[4096];
        snprintf(ps, sizeof ps, "%s/multi30k/%s.%s.gz", data_dir, splits[k], d->src_lang);
        snprintf(pt, sizeof pt, "%s/multi30k/%s.%s.gz", data_dir, splits[k], d->tgt_lang);
        Strs *raw = k == 1 ? &d->val_lines : k == 2 ? &d->test_lines : NULL;
        if (tokenize_file(ps, &src[k], &ns[k], NULL, e) != 0 || tokenize_file(pt, &tgt[k], &nt[k], raw, e) != 0) {
            rc = -1;
            break;
        }
        /* name the file whose count is wrong (the source's when both are) */
        if (ns[k] != expected[k] || nt[k] != expected[k])
            rc = err_set(e, "%s: %d lines, Multi30k's %s split has %d (its %s file %s has %d) (hint: the files are "
                            "damaged or mixed up; delete data/multi30k and run scripts/get_data.sh multi30k)",
                         ns[k] != expected[k] ? ps : pt, ns[k] != expected[k] ? ns[k] : nt[k], splits[k], expected[k],
                         ns[k] != expected[k] ? d->tgt_lang : d->src_lang, ns[k] != expected[k] ? pt : ps,
                         ns[k] != expected[k] ? nt[k] : ns[k]);
    }
    if (rc == 0) {
        /* vocabularies from the training set only */
        Strs *all_src = xcalloc(1, sizeof(Strs)), *all_tgt = xcalloc(1, sizeof(Strs));
        for (int i = 0; i < ns[0]; i++) {
            for (int j = 0; j < src[0][i].n; j++) strs_push(all_src, src[0][i].s[j], strlen(src[0][i].s[j]));
            for (int j = 0; j < tgt[0][i].n; j++) strs_push(all_tgt, tgt[0][i].s[j], strlen(tgt[0][i].s[j]));
        }
        if (shared) {
            const Strs *both[2] = {all_src, all_tgt};
            vocab_build(&d->src_vocab, both, 2, min_freq);
            vocab_build(&d->tgt_vocab, both, 2, min_freq);
        } else {
            const Strs *s1[1] = {all_src}, *t1[1] = {all_tgt};
            vocab_build(&d->src_vocab, s1, 1, min_freq);
            vocab_build(&d->tgt_vocab, t1, 1, min_freq);
        }
        strs_free(all_src), strs_free(all_tgt), free(all_src), free(all_tgt);
        to_corpus(&d->train, src[0], tgt[0], ns[0], &d->src_vocab, &d->tgt_vocab, max_len, &d->dropped);
        to_corpus(&d->val, src[1], tgt[1], ns[1], &d->src_vocab, &d->tgt_vocab, 0, NULL);
        to_corpus(&d->test, src[2], tgt[2], ns[2], &d->src_vocab, &d->tgt_vocab, 0, NULL);
    }
    for (int k = 0; k < 3; k++) {
        if (src[k]) free_sentences(src[k], ns[k]);
        if (tgt[k]) free_sentences(tgt[k], nt[k]);
    }
    return rc;
}

void trans_free(TransData *d) {
    vocab_free(&d->src_vocab), vocab_free(&d->tgt_vocab);
    corpus_free(&d->train), corpus_free(&d->val), corpus_free(&d->test);
    strs_free(&d->val_lines), strs_free(&d->test_lines);
    memset(d, 0, sizeof *d);
}

/* ------------------------------------------------------------------ batches */

static const Corpus *g_sort_corpus; /* qsort has no context argument */

static int by_length(const void *a, const void *b) {
    int i = *(const int *)a, j = *(const int *)b;
    int li = g_sort_corpus->src_len[i] + g_sort_corpus->tgt_len[i];
    int lj = g_sort_corpus->src_len[j] + g_sort_corpus->tgt_len[j];
    return li != lj ? li - lj : i - j;
}

int trans_epoch_batches(const TransData *d, int batch, uint64_t seed, int epoch, int *order, int *starts) {
    int n = d->train.n;
    Rng rng = rng_seeded(seed ^ 0x7a11ull, 2000 + (uint64_t)epoch);
    for (int i = 0; i < n; i++) order[i] = i;
    for (int i = n - 1; i > 0; i--) { /* shuffle, then sort chunks of 100 batches by length */
        int j = (int)rng_below(&rng, (uint64_t)i + 1), t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
    int chunk = 100 * batch;
    g_sort_corpus = &d->train;
    for (int s = 0; s < n; s += chunk) qsort(order + s, (size_t)(s + chunk < n ? chunk : n - s), sizeof(int), by_length);
    int nb = (n + batch - 1) / batch;
    /* batches in a shuffled order: start offsets permuted */
    int *perm = xmalloc((size_t)nb * sizeof(int));
    for (int b = 0; b < nb; b++) perm[b] = b;
    for (int b = nb - 1; b > 0; b--) {
        int j = (int)rng_below(&rng, (uint64_t)b + 1), t = perm[b];
        perm[b] = perm[j];
        perm[j] = t;
    }
    int *tmp = xmalloc((size_t)n * sizeof(int)), k = 0;
    for (int b = 0; b < nb; b++) {
        int s = perm[b] * batch, e = s + batch < n ? s + batch : n;
        starts[b] = k;
        for (int i = s; i < e; i++) tmp[k++] = order[i];
    }
    starts[nb] = k;
    memcpy(order, tmp, (size_t)n * sizeof(int));
    free(tmp);
    free(perm);
    return nb;
}

void trans_batch(const Corpus *c, const int *idx, int n, int *src, int *tgt_in, int *tgt_out, int *S, int *T) {
    trans_batch_lengths(c, idx, n, S, T);
    trans_batch_fill(c, idx, n, *S, *T, src, tgt_in, tgt_out);
}

void trans_batch_lengths(const Corpus *c, const int *idx, int n, int *S, int *T) {
    int ms = 1, mt = 1;
    for (int b = 0; b < n; b++) {
        ms = c->src_len[idx[b]] > ms ? c->src_len[idx[b]] : ms;
        mt = c->tgt_len[idx[b]] + 1 > mt ? c->tgt_len[idx[b]] + 1 : mt;
    }
    *S = ms, *T = mt;
}

void trans_batch_fill(const Corpus *c, const int *idx, int n, int ms, int mt, int *src, int *tgt_in, int *tgt_out) {
    for (int b = 0; b < n; b++) {
        int i = idx[b], ls = c->src_len[i], lt = c->tgt_len[i];
        for (int t = 0; t < ms; t++) src[(size_t)b * ms + t] = t < ls ? c->src[i][t] : TOK_PAD;
        for (int t = 0; t < mt; t++) {
            tgt_in[(size_t)b * mt + t] = t == 0 ? TOK_BOS : t <= lt ? c->tgt[i][t - 1] : TOK_PAD;
            tgt_out[(size_t)b * mt + t] = t < lt ? c->tgt[i][t] : t == lt ? TOK_EOS : TOK_PAD;
        }
    }
}

void ids_to_words(const Vocab *v, const int *ids, int n, Strs *out) {
    for (int i = 0; i < n && ids[i] != TOK_EOS; i++)
        if (ids[i] >= NUM_SPECIALS || ids[i] == TOK_UNK) strs_push(out, v->words.s[ids[i]], strlen(v->words.s[ids[i]]));
}

_Static_assert(!TRANSLATION || IS_ENABLED(CONFIG_SEQ2SEQ_DE_EN) + IS_ENABLED(CONFIG_SEQ2SEQ_EN_DE) == 1,
               "the translation direction is a Kconfig choice");

S2SConfig s2s_config_from_kconfig(const TransData *td) {
    S2SConfig c = {
        .decoder = IS_ENABLED(CONFIG_SEQ2SEQ_ENCODER_DECODER),
        .C = CONFIG_SEQ2SEQ_DIM,
        .H = CONFIG_SEQ2SEQ_HEADS,
        .mlp = CONFIG_SEQ2SEQ_MLP,
        .L_enc = CONFIG_SEQ2SEQ_ENC_LAYERS,
        .L_dec = (IS_ENABLED(CONFIG_SEQ2SEQ_ENCODER_DECODER) ? CONFIG_SEQ2SEQ_DEC_LAYERS : 0),
        .post_ln = IS_ENABLED(CONFIG_SEQ2SEQ_POST_LN),
        .gelu = IS_ENABLED(CONFIG_SEQ2SEQ_GELU),
        .mlp_dropout = 1,
        .onehot = IS_ENABLED(CONFIG_SEQ2SEQ_ONEHOT_INPUT),
        .shared_emb = IS_ENABLED(CONFIG_SEQ2SEQ_SHARED_EMB),
        .head_mlp = !TRANSLATION,
        .dropout = (float)KCONFIG_NUMBER(CONFIG_SEQ2SEQ_DROPOUT, 0.0, 0.999),
        .variant = ATTN_VARIANT,
        .pos = ATTN_POS,
        .pos_m = ATTN_POS_DIM,
        .pos_groups = ATTN_POS ? (ATTN_POS_PER_HEAD ? CONFIG_SEQ2SEQ_HEADS : 1) : 0,
        .kv_heads = attn_kv_heads(CONFIG_SEQ2SEQ_HEADS),
    };
    if (c.C % c.H != 0)
        FATAL("CONFIG_SEQ2SEQ_DIM=%d is not a multiple of CONFIG_SEQ2SEQ_HEADS=%d (hint: the head dim is channels / "
              "heads)", c.C, c.H);
    if (c.H % c.kv_heads != 0)
        FATAL("CONFIG_ATTN_KV_HEADS=%d does not divide CONFIG_SEQ2SEQ_HEADS=%d (hint: 0 or a divisor of the heads)",
              c.kv_heads, c.H);
    if (td) {
        c.Vs = td->src_vocab.words.n;
        c.Vt = td->tgt_vocab.words.n;
        c.scale_emb = 1;
        c.pad = TOK_PAD;
        c.label_smoothing = (float)KCONFIG_NUMBER(CONFIG_SEQ2SEQ_LABEL_SMOOTHING, 0.0, 0.999);
        /* positions for the longest training pair and any validation or test sentence */
        c.Tmax = CONFIG_SEQ2SEQ_MAX_LEN + 1;
        const Corpus *all[3] = {&td->train, &td->val, &td->test};
        for (int k = 0; k < 3; k++)
            for (int i = 0; i < all[k]->n; i++) {
                if (all[k]->src_len[i] > c.Tmax) c.Tmax = all[k]->src_len[i];
                if (all[k]->tgt_len[i] + 1 > c.Tmax) c.Tmax = all[k]->tgt_len[i] + 1;
            }
    } else {
        c.Vs = c.Vt = c.decoder ? SYNTH_BOS + 1 : 10; /* digits, and <bos> for a decoder */
        c.pad = -1;
        c.Tmax = CONFIG_SEQ2SEQ_SEQ_LEN;
    }
    return c;
}
