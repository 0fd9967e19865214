/* GPT-2 data sets: tiny Shakespeare characters, the spelled-out numbers,
 * and GPT-2 BPE token shards. Files come from scripts/get_data.sh (local
 * mirror or download, verified); the loaders check what they read and
 * name the file and the problem when something is off. */
#ifndef KVLAB_GPT2_DATA_H
#define KVLAB_GPT2_DATA_H

#include <stddef.h>
#include <stdio.h>

#include "bpe.h"
#include "common.h"
#include "rng.h"
#include "token_shards.h"

typedef enum { DATA_CHAR, DATA_NUMBERS, DATA_BPE } DataKind;

typedef struct {
    DataKind kind;
    const char *name;    /* "tinyshakespeare-char", "numbers", "bpe-shards" */
    int V;               /* vocabulary size */
    int T;               /* sequence length of the windows */
    /* vocabulary */
    char chars[256];     /* char: the V distinct bytes, sorted */
    char **words;        /* numbers: the V words by first appearance */
    Bpe *bpe;            /* BPE: tokenizer (for prompts and samples) */
    /* char and numbers: token streams; numbers use non-overlapping windows */
    int *train, *val;
    size_t ntrain, nval;
    size_t train_windows, val_windows; /* numbers */
    /* BPE: shards, read a window at a time */
    Shard *train_shards, *val_shards;
    int n_train_shards, n_val_shards;
    size_t train_tokens, val_tokens;
    uint16_t *buf;
} Dataset;

/* Checks that the n bytes read from path are the file scripts/get_data.sh
 * verified (md5) as part of data set `set`: their size and CRC-32 must match
 * what it recorded in <path>.verified. Returns 0, or -1 with a hint to run
 * the data script. */
int data_file_verified(const char *path, const void *data, size_t n, const char *set, Err *e);

/* Loads the configured data set for windows of T tokens (T+1 with targets). */
int dataset_load(Dataset *d, const char *data_dir, int T, Err *e);
/* Loads a given kind (tests use every kind whatever the configuration). */
int dataset_load_kind(Dataset *d, DataKind kind, const char *data_dir, int T, Err *e);
void dataset_free(Dataset *d);

/* B random training windows from rng: x = tokens[i:i+T], y = tokens[i+1:i+T+1]. */
int dataset_train_batch(Dataset *d, Rng *rng, int B, int *x, int *y, Err *e);
/* Rows [first, first + count) of that batch only (data parallelism: one rank's share), into x and y
 * (count windows); rng advances past all B draws, as dataset_train_batch's. */
int dataset_train_rows(Dataset *d, Rng *rng, int B, int first, int count, int *x, int *y, Err *e);
/* Validation batches: the same fixed windows at every evaluation (the whole
 * validation split in order for numbers; evenly spaced windows otherwise),
 * at most max_batches. Rows past the end get target -1 (ignored). */
int dataset_val_batches(const Dataset *d, int B, int max_batches);
int dataset_val_batch(Dataset *d, int k, int B, int max_batches, int *x, int *y, Err *e);

/* Vocabulary description for checkpoint metadata (JSON) and its inverse. */
char *dataset_vocab_json(const Dataset *d);
/* Encodes a prompt; an empty prompt gives the data set's start token. */
int dataset_encode(Dataset *d, const char *text, int **ids, size_t *n, Err *e);
void dataset_print_token(const Dataset *d, int id, FILE *out);

/* The spelled-out number n (1..9999) as words, e.g. "one hundred ten". */
void number_words(int n, char *out, size_t cap);

#endif
