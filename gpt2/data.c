#define _GNU_SOURCE
#include "data.h"

#include <glob.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

/* tiny Shakespeare as mirrored and verified by scripts/get_data.sh */
#define SHAKESPEARE_BYTES 1115394

/* ------------------------------------------------------------------ verified files */

int data_file_verified(const char *path, const void *data, size_t n, const char *set, Err *e) {
    char stamp_path[4200];
    snprintf(stamp_path, sizeof stamp_path, "%s.verified", path);
    char *stamp = read_file(stamp_path, NULL, NULL);
    size_t size;
    unsigned long want;
    int ok = stamp && sscanf(stamp, "size %zu crc32 %lx", &size, &want) == 2;
    free(stamp);
    if (!ok)
        return err_set(e, "%s: not verified by the data script (no valid %s) (hint: run scripts/get_data.sh %s, "
                          "which checks the file's md5 sum and records it)", path, stamp_path, set);
    uLong crc = crc32(0L, Z_NULL, 0);
    for (size_t off = 0; off < n; off += 1u << 30) {
        size_t len = n - off < (1u << 30) ? n - off : (1u << 30);
        crc = crc32(crc, (const Bytef *)data + off, (uInt)len);
    }
    if (size != n || crc != want)
        return err_set(e, "%s: not the file the data script verified (%zu bytes, CRC-32 %08lx; it recorded %zu "
                          "bytes, %08lx) (hint: delete it and run scripts/get_data.sh %s)",
                       path, n, (unsigned long)crc, size, want, set);
    return 0;
}

/* ------------------------------------------------------------------ numbers */

void number_words(int n, char *out, size_t cap) {
    static const char *ones[20] = {"",        "one",     "two",       "three",    "four",
                                   "five",    "six",     "seven",     "eight",    "nine",
                                   "ten",     "eleven",  "twelve",    "thirteen", "fourteen",
                                   "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"};
    static const char *tens[10] = {"", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"};
    out[0] = 0;
    size_t len = 0;
#define ADD(w)                                                                      \
    do {                                                                            \
        len += (size_t)snprintf(out + len, cap > len ? cap - len : 0, "%s%s", len ? " " : "", (w)); \
    } while (0)
    if (n >= 1000) {
        ADD(ones[n / 1000]);
        ADD("thousand");
        n %= 1000;
    }
    if (n >= 100) {
        ADD(ones[n / 100]);
        ADD("hundred");
        n %= 100;
    }
    if (n >= 20) {
        ADD(tens[n / 10]);
        n %= 10;
    }
    if (n > 0) ADD(ones[n]);
#undef ADD
}

static int numbers_add(Dataset *d, const char *word, int **toks, size_t *n, size_t *cap, Err *e) {
    int id = 0;
    while (id < d->V && strcmp(d->words[id], word) != 0) id++;
    if (id == d->V) {
        if (d->V == 64) return err_set(e, "numbers: more than 64 word types (internal error)");
        d->words[d->V++] = xstrdup(word);
    }
    if (*n == *cap) *toks = xrealloc(*toks, (*cap *= 2) * sizeof(int));
    (*toks)[(*n)++] = id;
    return 0;
}

/* The paper's corpus: 1..7999 then 8001..9999 (8000 is absent), joined
 * with " . ", split on spaces; word ids by first appearance. */
static int load_numbers(Dataset *d, Err *e) {
    size_t cap = 70000, n = 0;
    int *toks = xmalloc(cap * sizeof(int));
    d->words = xcalloc(64, sizeof(char *));
    char line[128], *save;
    for (int k = 1; k <= 9999; k++) {
        if (k == 8000) continue;
        if (n > 0 && numbers_add(d, ".", &toks, &n, &cap, e) != 0) return -1;
        number_words(k, line, sizeof line);
        for (char *w = strtok_r(line, " ", &save); w; w = strtok_r(NULL, " ", &save))
            if (numbers_add(d, w, &toks, &n, &cap, e) != 0) return -1;
    }
    /* non-overlapping windows x = t[i:i+T], i = 0, T, 2T, ... < n - T - 1 */
    size_t nwin = n > (size_t)d->T + 1 ? (n - (size_t)d->T - 1 + (size_t)d->T - 1) / (size_t)d->T : 0;
    if (nwin < 5)
        return err_set(e, "numbers: context length %d leaves only %zu windows (hint: lower CONFIG_GPT2_BLOCK_SIZE)",
                       d->T, nwin);
    d->train_windows = nwin * 8 / 10;
    d->val_windows = nwin - d->train_windows;
    d->train = toks;
    d->ntrain = n;
    d->val = toks + d->train_windows * (size_t)d->T; /* windows of the validation split start here */
    d->nval = n - d->train_windows * (size_t)d->T;
    return 0;
}

/* ------------------------------------------------------------------ characters */

static int load_chars(Dataset *d, const char *data_dir, Err *e) {
    char path[4096];
    snprintf(path, sizeof path, "%s/tinyshakespeare/input.txt", data_dir);
    size_t n;
    Err re;
    char *text = read_file(path, &n, &re);
    if (!text)
        return err_set(e, "%s (hint: run `make`, which fetches the data, or scripts/get_data.sh tinyshakespeare)",
                       re.msg);
    if (n != SHAKESPEARE_BYTES) {
        free(text);
        return err_set(e, "%s: %zu bytes, the tiny Shakespeare file has %d (hint: the file is wrong or cut short; "
                          "delete it and run scripts/get_data.sh tinyshakespeare)", path, n, SHAKESPEARE_BYTES);
    }
    if (data_file_verified(path, text, n, "tinyshakespeare", e) != 0) {
        free(text);
        return -1;
    }
    int seen[256] = {0}, id[256];
    for (size_t i = 0; i < n; i++) seen[(unsigned char)text[i]] = 1;
    d->V = 0;
    for (int c = 0; c < 256; c++)
        if (seen[c]) id[c] = d->V, d->chars[d->V++] = (char)c;
    int *toks = xmalloc(n * sizeof(int));
    for (size_t i = 0; i < n; i++) toks[i] = id[(unsigned char)text[i]];
    free(text);
    d->train = toks;
    d->ntrain = n * 9 / 10;
    d->val = toks + d->ntrain;
    d->nval = n - d->ntrain;
    return 0;
}

/* ------------------------------------------------------------------ BPE shards */

static int open_shards(const char *data_dir, const char *pattern, const char *what, Shard **out, int *count,
                       size_t *total, Err *e) {
    char pat[4096];
    snprintf(pat, sizeof pat, "%s/%s", data_dir, pattern);
    glob_t g;
    if (glob(pat, 0, NULL, &g) != 0 || g.gl_pathc == 0) {
        globfree(&g);
        return err_set(e, "%s: no %s shards match (hint: run `make`, which prepares the tiny Shakespeare shards, or "
                          "set the shard patterns in make menuconfig, GPT-2 data)", pat, what);
    }
    *out = xcalloc(g.gl_pathc, sizeof(Shard));
    *count = 0;
    *total = 0;
    for (size_t i = 0; i < g.gl_pathc; i++) { /* glob sorts the names */
        if (shard_open(&(*out)[i], g.gl_pathv[i], e) != 0) {
            globfree(&g);
            return -1;
        }
        (*count)++;
        *total += (*out)[i].ntok;
    }
    globfree(&g);
    return 0;
}

static int load_bpe(Dataset *d, const char *data_dir, Err *e) {
    char enc[4096], voc[4096];
    snprintf(enc, sizeof enc, "%s/gpt2-bpe/encoder.json", data_dir);
    snprintf(voc, sizeof voc, "%s/gpt2-bpe/vocab.bpe", data_dir);
    for (int i = 0; i < 2; i++) {
        const char *path = i ? voc : enc;
        size_t n;
        char *bytes = read_file(path, &n, e);
        if (!bytes) return err_with_hint(e, e, "scripts/get_data.sh gpt2-bpe fetches the GPT-2 BPE files; make does "
                                               "it before a step");
        int bad = data_file_verified(path, bytes, n, "gpt2-bpe", e) != 0;
        free(bytes);
        if (bad) return -1;
    }
    d->bpe = bpe_load(enc, voc, e);
    if (!d->bpe) return -1;
    d->V = bpe_vocab_size(d->bpe);
    if (open_shards(data_dir, CONFIG_GPT2_DATA_TRAIN_SHARDS, "training", &d->train_shards, &d->n_train_shards,
                    &d->train_tokens, e) != 0)
        return -1;
    if (open_shards(data_dir, CONFIG_GPT2_DATA_VAL_SHARDS, "validation", &d->val_shards, &d->n_val_shards,
                    &d->val_tokens, e) != 0)
        return -1;
    for (int i = 0; i < d->n_train_shards; i++)
        if (d->train_shards[i].ntok < (size_t)d->T + 1)
            return err_set(e, "%s: %zu tokens, fewer than one window of %d (hint: lower CONFIG_GPT2_BLOCK_SIZE)",
                           d->train_shards[i].path, d->train_shards[i].ntok, d->T + 1);
    for (int i = 0; i < d->n_val_shards; i++)
        if (d->val_shards[i].ntok < (size_t)d->T + 1)
            return err_set(e, "%s: %zu tokens, fewer than one window of %d (hint: lower CONFIG_GPT2_BLOCK_SIZE)",
                           d->val_shards[i].path, d->val_shards[i].ntok, d->T + 1);
    d->buf = xmalloc(((size_t)d->T + 1) * sizeof(uint16_t));
    return 0;
}

/* ------------------------------------------------------------------ loading */

int dataset_load(Dataset *d, const char *data_dir, int T, Err *e) {
    DataKind kind = IS_ENABLED(CONFIG_GPT2_DATA_NUMBERS) ? DATA_NUMBERS
                    : IS_ENABLED(CONFIG_GPT2_DATA_BPE)   ? DATA_BPE
                                                         : DATA_CHAR;
    if (kind == DATA_CHAR && !IS_ENABLED(CONFIG_GPT2_DATA_SHAKESPEARE_CHAR))
        return err_set(e, "no GPT-2 data set in the configuration (hint: run make olddefconfig)");
    return dataset_load_kind(d, kind, data_dir, T, e);
}

int dataset_load_kind(Dataset *d, DataKind kind, const char *data_dir, int T, Err *e) {
    memset(d, 0, sizeof *d);
    d->T = T;
    d->kind = kind;
    int rc;
    if (kind == DATA_NUMBERS) {
        d->name = "numbers";
        rc = load_numbers(d, e);
    } else if (kind == DATA_BPE) {
        d->name = "bpe-shards";
        rc = load_bpe(d, data_dir, e);
    } else {
        d->name = "tinyshakespeare-char";
        rc = load_chars(d, data_dir, e);
    }
    if (rc != 0) return rc;
    if (d->kind == DATA_CHAR && (d->ntrain < (size_t)T + 2 || d->nval < (size_t)T + 2))
        return err_set(e, "tiny Shakespeare: context length %d is longer than a split (hint: lower "
                          "CONFIG_GPT2_BLOCK_SIZE)", T);
    return 0;
}

void dataset_free(Dataset *d) {
    if (d->kind == DATA_NUMBERS)
        for (int i = 0; i < d->V; i++) free(d->words[i]);
    free(d->words);
    free(d->train); /* val points into the same array */
    for (int i = 0; i < d->n_train_shards; i++) shard_close(&d->train_shards[i]);
    for (int i = 0; i < d->n_val_shards; i++) shard_close(&d->val_shards[i]);
    free(d->train_shards);
    free(d->val_shards);
    free(d->buf);
    if (d->bpe) bpe_free(d->bpe);
    memset(d, 0, sizeof *d);
}

/* ------------------------------------------------------------------ batches */

/* Window of T+1 tokens starting at global token index start of a shard list. */
static int shard_window(Dataset *d, Shard *shards, int nshards, size_t start, int *x, int *y, Err *e) {
    int s = 0; /* shard s has ntok - T window starts; windows never cross shard ends */
    while (s < nshards - 1 && start >= shards[s].ntok - (size_t)d->T) {
        start -= shards[s].ntok - (size_t)d->T;
        s++;
    }
    if (shard_read_tokens(&shards[s], start, (size_t)d->T + 1, d->V, d->buf, e) != 0) return -1;
    for (int t = 0; t < d->T; t++) {
        x[t] = d->buf[t];
        y[t] = d->buf[t + 1];
    }
    return 0;
}

/* number of window start positions over a shard list (windows within a shard) */
static size_t shard_starts(const Shard *shards, int nshards, int T) {
    size_t n = 0;
    for (int s = 0; s < nshards; s++) n += shards[s].ntok - (size_t)T;
    return n;
}

int dataset_train_batch(Dataset *d, Rng *rng, int B, int *x, int *y, Err *e) {
    return dataset_train_rows(d, rng, B, 0, B, x, y, e);
}

int dataset_train_rows(Dataset *d, Rng *rng, int B, int first, int count, int *x, int *y, Err *e) {
    int T = d->T;
    if (first < 0 || count < 0 || first + count > B)
        return err_set(e, "dataset_train_rows: rows [%d, %d) of a batch of %d", first, first + count, B);
    for (int b = 0; b < B; b++) { /* every row's draw, so that the stream stays the same for every rank */
        int mine = b >= first && b < first + count;
        int *xb = mine ? x + (size_t)(b - first) * T : NULL, *yb = mine ? y + (size_t)(b - first) * T : NULL;
        if (d->kind == DATA_BPE) {
            size_t start = rng_below(rng, shard_starts(d->train_shards, d->n_train_shards, T));
            if (mine && shard_window(d, d->train_shards, d->n_train_shards, start, xb, yb, e) != 0) return -1;
            continue;
        }
        size_t i = d->kind == DATA_NUMBERS ? rng_below(rng, d->train_windows) * (size_t)T
                                           : rng_below(rng, d->ntrain - (size_t)T - 1);
        if (!mine) continue;
        memcpy(xb, d->train + i, (size_t)T * sizeof(int));
        memcpy(yb, d->train + i + 1, (size_t)T * sizeof(int));
    }
    return 0;
}

static size_t val_windows(const Dataset *d, int B, int max_batches) {
    if (d->kind == DATA_NUMBERS) return d->val_windows;
    size_t avail = d->kind == DATA_BPE ? shard_starts(d->val_shards, d->n_val_shards, d->T) : d->nval - (size_t)d->T;
    size_t want = (size_t)B * (size_t)max_batches;
    return want < avail ? want : avail;
}

int dataset_val_batches(const Dataset *d, int B, int max_batches) {
    size_t w = val_windows(d, B, max_batches);
    size_t n = (w + (size_t)B - 1) / (size_t)B;
    return (int)(n < (size_t)max_batches ? n : (size_t)max_batches);
}

int dataset_val_batch(Dataset *d, int k, int B, int max_batches, int *x, int *y, Err *e) {
    int T = d->T;
    size_t nw = val_windows(d, B, max_batches);
    for (int b = 0; b < B; b++) {
        size_t w = (size_t)k * B + (size_t)b;
        int *xb = x + (size_t)b * T, *yb = y + (size_t)b * T;
        if (w >= nw) { /* past the end: a harmless row whose targets do not count */
            for (int t = 0; t < T; t++) xb[t] = 0, yb[t] = -1;
            continue;
        }
        if (d->kind == DATA_NUMBERS) {
            memcpy(xb, d->val + w * (size_t)T, (size_t)T * sizeof(int));
            memcpy(yb, d->val + w * (size_t)T + 1, (size_t)T * sizeof(int));
        } else if (d->kind == DATA_BPE) {
            size_t starts = shard_starts(d->val_shards, d->n_val_shards, T);
            size_t start = nw > 1 ? w * (starts - 1) / (nw - 1) : 0;
            if (shard_window(d, d->val_shards, d->n_val_shards, start, xb, yb, e) != 0) return -1;
        } else { /* evenly spaced over the validation split */
            size_t span = d->nval - (size_t)T - 1;
            size_t start = nw > 1 ? w * span / (nw - 1) : 0;
            memcpy(xb, d->val + start, (size_t)T * sizeof(int));
            memcpy(yb, d->val + start + 1, (size_t)T * sizeof(int));
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ vocabulary */

static void json_escape(char *out, size_t cap, const char *s, size_t n) {
    size_t len = 0;
    for (size_t i = 0; i < n && len + 8 < cap; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\')
            len += (size_t)snprintf(out + len, cap - len, "\\%c", c);
        else if (c < 0x20 || c >= 0x7f)
            len += (size_t)snprintf(out + len, cap - len, "\\u%04x", c);
        else
            out[len++] = (char)c;
    }
    out[len] = 0;
}

char *dataset_vocab_json(const Dataset *d) {
    size_t cap = 8192;
    char *s = xmalloc(cap), tmp[64];
    if (d->kind == DATA_BPE) {
        snprintf(s, cap, "{\"type\":\"gpt2-bpe\",\"size\":%d,\"eot\":%d}", d->V, bpe_eot(d->bpe));
        return s;
    }
    size_t len = (size_t)snprintf(s, cap, "{\"type\":\"%s\",\"size\":%d,\"tokens\":[",
                                  d->kind == DATA_CHAR ? "bytes" : "words", d->V);
    for (int i = 0; i < d->V; i++) {
        if (d->kind == DATA_CHAR)
            json_escape(tmp, sizeof tmp, &d->chars[i], 1);
        else
            json_escape(tmp, sizeof tmp, d->words[i], strlen(d->words[i]));
        len += (size_t)snprintf(s + len, cap - len, "%s\"%s\"", i ? "," : "", tmp);
    }
    snprintf(s + len, cap - len, "]}");
    return s;
}

int dataset_encode(Dataset *d, const char *text, int **ids, size_t *n, Err *e) {
    size_t cap = 0;
    *ids = NULL;
    *n = 0;
    if (d->kind == DATA_BPE) {
        if (!*text) {
            *ids = xmalloc(sizeof(int));
            (*ids)[0] = bpe_eot(d->bpe);
            *n = 1;
            return 0;
        }
        return bpe_encode(d->bpe, text, strlen(text), ids, n, &cap, e);
    }
    if (d->kind == DATA_CHAR) {
        if (!*text) text = "\n";
        size_t len = strlen(text);
        *ids = xmalloc(len * sizeof(int));
        for (size_t i = 0; i < len; i++) {
            int id = 0;
            while (id < d->V && d->chars[id] != text[i]) id++;
            if (id == d->V) {
                free(*ids);
                *ids = NULL;
                return err_set(e, "prompt: character 0x%02x at offset %zu is not in the vocabulary of tiny "
                                  "Shakespeare (hint: use only characters of the training text)",
                               (unsigned char)text[i], i);
            }
            (*ids)[(*n)++] = id;
        }
        return 0;
    }
    /* numbers: words separated by spaces */
    char *buf = xstrdup(*text ? text : "."), *save = NULL;
    *ids = xmalloc((strlen(buf) + 1) * sizeof(int));
    for (char *w = strtok_r(buf, " \n\t", &save); w; w = strtok_r(NULL, " \n\t", &save)) {
        int id = 0;
        while (id < d->V && strcmp(d->words[id], w) != 0) id++;
        if (id == d->V) {
            err_set(e, "prompt: word '%s' is not in the numbers vocabulary (hint: words like 'one', 'hundred', "
                       "'thousand' and '.')", w);
            free(buf);
            free(*ids);
            *ids = NULL;
            *n = 0;
            return -1;
        }
        (*ids)[(*n)++] = id;
    }
    free(buf);
    if (*n == 0) return err_set(e, "prompt: no words (hint: a prompt of the data's words, e.g. \"one hundred\")");
    return 0;
}

void dataset_print_token(const Dataset *d, int id, FILE *out) {
    if (d->kind == DATA_CHAR) {
        fputc(d->chars[id], out);
    } else if (d->kind == DATA_NUMBERS) {
        fprintf(out, "%s ", d->words[id]);
    } else {
        size_t len;
        const char *b = bpe_token_bytes(d->bpe, id, &len);
        fwrite(b, 1, len, out);
    }
}
