#define _GNU_SOURCE
#include "text.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unicase.h>
#include <unictype.h>
#include <unistr.h>
#include <zlib.h>

void strs_push(Strs *l, const char *s, size_t len) {
    if (l->n == l->cap) {
        l->cap = l->cap ? 2 * l->cap : 64;
        l->s = xrealloc(l->s, (size_t)l->cap * sizeof(char *));
    }
    char *c = xmalloc(len + 1);
    memcpy(c, s, len);
    c[len] = 0;
    l->s[l->n++] = c;
}

void strs_free(Strs *l) {
    for (int i = 0; i < l->n; i++) free(l->s[i]);
    free(l->s);
    memset(l, 0, sizeof *l);
}

static int is_word_char(ucs4_t c) {
    return uc_is_general_category(c, UC_CATEGORY_L) || uc_is_general_category(c, UC_CATEGORY_N) ||
           uc_is_general_category(c, UC_CATEGORY_M); /* combining marks stay inside words */
}

void tokenize_line(const char *line, Strs *out) {
    size_t n = strlen(line), len = 0;
    uint8_t *lower = u8_tolower((const uint8_t *)line, n, NULL, NULL, NULL, &len);
    const uint8_t *s = lower ? lower : (const uint8_t *)line;
    if (!lower) len = n;
    size_t i = 0;
    while (i < len) {
        ucs4_t c;
        int k = u8_mbtouc(&c, s + i, len - i);
        if (uc_is_property_white_space(c)) {
            i += (size_t)k;
            continue;
        }
        size_t start = i;
        if (is_word_char(c)) {
            while (i < len) {
                k = u8_mbtouc(&c, s + i, len - i);
                if (!is_word_char(c)) break;
                i += (size_t)k;
            }
        } else {
            i += (size_t)k; /* punctuation and symbols: one character each */
        }
        strs_push(out, (const char *)s + start, i - start);
    }
    free(lower);
}

char *detokenize(const Strs *words) {
    size_t cap = 1;
    for (int i = 0; i < words->n; i++) cap += strlen(words->s[i]) + 1;
    char *out = xmalloc(cap), *p = out;
    for (int i = 0; i < words->n; i++) {
        const char *w = words->s[i], *prev = i ? words->s[i - 1] : NULL;
        int glue = !prev || (strchr(".,!?;:)]}", w[0]) && w[1] == 0) || (strchr("([{", prev[0]) && prev[1] == 0) ||
                   (!strcmp(w, "'") && i + 1 < words->n) || !strcmp(prev, "'");
        if (!glue) *p++ = ' ';
        size_t n = strlen(w);
        memcpy(p, w, n);
        p += n;
    }
    *p = 0;
    return out;
}

/* ------------------------------------------------------------------ vocabulary */

static uint64_t hash_str(const char *s) {
    uint64_t h = 1469598103934665603ull;
    while (*s) h = (h ^ (uint8_t)*s++) * 1099511628211ull;
    return h;
}

/* slot of word in a table of words (index + 1 stored), or of the empty slot where it belongs */
static size_t find_slot(const int *slots, size_t nslots, char *const *words, const char *w) {
    size_t i = hash_str(w) & (nslots - 1);
    while (slots[i] && strcmp(words[slots[i] - 1], w) != 0) i = (i + 1) & (nslots - 1);
    return i;
}

typedef struct {
    const char *w;
    long count;
} WordCount;

static int by_count(const void *a, const void *b) {
    const WordCount *x = a, *y = b;
    if (x->count != y->count) return x->count < y->count ? 1 : -1;
    return strcmp(x->w, y->w);
}

void vocab_build(Vocab *v, const Strs *const *lists, int nlists, int min_freq) {
    /* count every distinct word */
    size_t nslots = 1 << 16;
    int *slots = xcalloc(nslots, sizeof(int));
    Strs distinct = {0};
    long *counts = NULL;
    for (int l = 0; l < nlists; l++)
        for (int i = 0; i < lists[l]->n; i++) {
            const char *w = lists[l]->s[i];
            size_t k = find_slot(slots, nslots, distinct.s, w);
            if (!slots[k]) {
                strs_push(&distinct, w, strlen(w));
                counts = xrealloc(counts, (size_t)distinct.cap * sizeof(long));
                counts[distinct.n - 1] = 0;
                slots[k] = distinct.n;
                if ((size_t)distinct.n * 2 > nslots) { /* grow and rehash */
                    free(slots);
                    nslots *= 2;
                    slots = xcalloc(nslots, sizeof(int));
                    for (int j = 0; j < distinct.n; j++)
                        slots[find_slot(slots, nslots, distinct.s, distinct.s[j])] = j + 1;
                    k = find_slot(slots, nslots, distinct.s, w);
                }
            }
            counts[slots[k] - 1]++;
        }
    WordCount *wc = xmalloc((size_t)(distinct.n ? distinct.n : 1) * sizeof(WordCount));
    int m = 0;
    for (int j = 0; j < distinct.n; j++)
        if (counts[j] >= min_freq) wc[m++] = (WordCount){distinct.s[j], counts[j]};
    qsort(wc, (size_t)m, sizeof(WordCount), by_count);
    memset(v, 0, sizeof *v);
    static const char *specials[NUM_SPECIALS] = {"<unk>", "<pad>", "<bos>", "<eos>"};
    for (int j = 0; j < NUM_SPECIALS; j++) strs_push(&v->words, specials[j], strlen(specials[j]));
    for (int j = 0; j < m; j++) strs_push(&v->words, wc[j].w, strlen(wc[j].w));
    v->nslots = 16;
    while (v->nslots < (size_t)v->words.n * 2) v->nslots *= 2;
    v->slots = xcalloc(v->nslots, sizeof(int));
    for (int j = 0; j < v->words.n; j++) v->slots[find_slot(v->slots, v->nslots, v->words.s, v->words.s[j])] = j + 1;
    free(wc);
    free(counts);
    free(slots);
    strs_free(&distinct);
}

int vocab_id(const Vocab *v, const char *word) {
    size_t k = find_slot(v->slots, v->nslots, v->words.s, word);
    return v->slots[k] ? v->slots[k] - 1 : TOK_UNK;
}

void vocab_free(Vocab *v) {
    strs_free(&v->words);
    free(v->slots);
    memset(v, 0, sizeof *v);
}

void corpus_free(Corpus *c) {
    for (int i = 0; i < c->n; i++) free(c->src[i]), free(c->tgt[i]);
    free(c->src), free(c->tgt), free(c->src_len), free(c->tgt_len);
    memset(c, 0, sizeof *c);
}

/* ------------------------------------------------------------------ files */

int read_lines_gz(const char *path, Strs *lines, Err *e) {
    gzFile f = gzopen(path, "rb");
    if (!f) return err_set(e, "%s: cannot open (hint: scripts/get_data.sh multi30k fetches the corpus)", path);
    size_t cap = 1 << 12, len = 0;
    char *buf = xmalloc(cap);
    int c;
    while ((c = gzgetc(f)) != -1) {
        if (c == '\n') {
            strs_push(lines, buf, len);
            len = 0;
            continue;
        }
        if (c == '\r') continue;
        if (len + 1 >= cap) buf = xrealloc(buf, cap *= 2);
        buf[len++] = (char)c;
    }
    int errnum;
    const char *msg = gzerror(f, &errnum);
    int bad = errnum != Z_OK && errnum != Z_STREAM_END;
    char why[160];
    snprintf(why, sizeof why, "%s", bad && msg ? msg : ""); /* msg lives in f: copy before gzclose */
    msg = why;
    if (!bad && len) strs_push(lines, buf, len);
    free(buf);
    gzclose(f);
    if (bad) return err_set(e, "%s: damaged gzip data: %s (hint: delete it and fetch it again)", path, msg);
    return 0;
}
