/* Text side of translation: the tokeniser (lowercase; words are runs of
 * Unicode letters and digits, every other non-space character is a token of
 * its own), vocabularies with a minimum frequency and the four specials, and
 * the Multi30k loader (gzip, one sentence per line, files aligned by line). */
#ifndef KVLAB_SEQ2SEQ_TEXT_H
#define KVLAB_SEQ2SEQ_TEXT_H

#include <stddef.h>

#include "common.h"

enum { TOK_UNK = 0, TOK_PAD = 1, TOK_BOS = 2, TOK_EOS = 3, NUM_SPECIALS = 4 };

/* A list of strings in one arena. */
typedef struct {
    char **s;
    int n, cap;
} Strs;
void strs_push(Strs *l, const char *s, size_t len);
void strs_free(Strs *l);

/* Appends the tokens of one line (UTF-8) to out. */
void tokenize_line(const char *line, Strs *out);
/* Words back to text: spaces between words, none before closing
 * punctuation (. , ! ? ; : ) ] }) or after opening brackets, none around an
 * apostrophe between two words. tokenize_line(detokenize(w)) == w. */
char *detokenize(const Strs *words);

typedef struct {
    Strs words;       /* id -> word; ids 0..3 are <unk> <pad> <bos> <eos> */
    int *slots;       /* open-addressing word -> id */
    size_t nslots;
} Vocab;

/* Words of the given token lists with frequency >= min_freq, most frequent
 * first (ties alphabetical), after the specials. */
void vocab_build(Vocab *v, const Strs *const *token_lists, int nlists, int min_freq);
int vocab_id(const Vocab *v, const char *word); /* TOK_UNK if absent */
void vocab_free(Vocab *v);

/* A parallel corpus of token-id sentences (no specials). */
typedef struct {
    int n;
    int **src, **tgt;
    int *src_len, *tgt_len;
} Corpus;
void corpus_free(Corpus *c);

/* Reads the gzip'd lines of path (error names the file). */
int read_lines_gz(const char *path, Strs *lines, Err *e);

#endif
