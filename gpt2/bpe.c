/* GPT-2 byte-level BPE (formats.md §5). Overview:
 *  - load: encoder.json gives each token's string in the GPT-2 byte alphabet;
 *    we store every token as its raw bytes. vocab.bpe gives the merges; we
 *    store them as (left id, right id) -> (rank, result id).
 *  - encode: split the text into chunks with the GPT-2 pattern (hand-written
 *    matcher below), then run BPE on each chunk's bytes, caching results.
 *  - decode: concatenate the tokens' bytes.
 *
 * Unicode classes. Python `regex` (what OpenAI's encoder.py uses) defines \s
 * as the Unicode White_Space property, \p{L} and \p{N} as general categories
 * L* and N*; we take all three from libunistring (Unicode 14 in libunistring
 * 1.0). Known differences from other implementations:
 *  - JavaScript \s (npm gpt-3-encoder, our test reference) excludes U+0085
 *    and includes U+FEFF; Python `re` \s also includes U+001C..U+001F. We
 *    follow Python `regex`; the test fixture avoids those code points.
 *  - Characters added after Unicode 14 are "other" here.
 * Invalid UTF-8 cannot occur in Python's str input; we treat each invalid
 * byte as one "other" character so that every byte string round-trips. */
#define _GNU_SOURCE
#include "bpe.h"

#include <cjson/cJSON.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unictype.h>
#include <unistr.h>

#define BPE_VOCAB 50257      /* 256 byte tokens + 50,000 merges + <|endoftext|> */
#define ALPHABET_CPS 324     /* byte alphabet code points are all < 256 + 68 */
#define TOK_SLOTS (1 << 17)  /* hash slots for tokens and merges (> 2x entries) */
#define CACHE_MAX (1 << 20)  /* chunk cache entries ... */
#define CACHE_MAX_BYTES (64 << 20) /* ... or arena bytes before it is cleared */
#define CACHE_MAX_CHUNK 1024 /* longer chunks (rarely repeated) are not cached */

typedef struct {
    int rank, pos, left, right, result; /* pair (left, right) starts at symbol pos */
} HeapItem;

typedef struct {
    uint64_t hash;
    size_t off;               /* key bytes then ids, in the cache arena */
    uint32_t key_len, n_ids;
} CacheEntry;

struct Bpe {
    int vocab_size, eot;
    char *tok_data;           /* all token bytes back to back */
    uint32_t *tok_off;        /* token id's bytes are tok_data[tok_off[id] .. tok_off[id+1]) */
    int *tok_slots;           /* bytes -> id hash (load time only), -1 = empty */
    int byte_id[256];         /* id of each single-byte token */
    uint64_t *merge_key;      /* (left << 32 | right), UINT64_MAX = empty */
    int *merge_rank, *merge_result;
    /* chunk cache: open addressing over entries; slot = entry index + 1 */
    uint32_t *cache_slots;
    size_t cache_nslots;
    CacheEntry *cache;
    size_t cache_n, cache_cap;
    char *arena;
    size_t arena_len, arena_cap;
    /* scratch for one chunk's merge loop */
    int *sym, *next, *prev;
    HeapItem *heap, *batch;
    size_t scratch_cap;
};

/* ---- hashing ---------------------------------------------------------- */

static uint64_t hash_bytes(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++) h = (h ^ (uint8_t)s[i]) * 1099511628211ull;
    return h;
}

static uint64_t hash_u64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    return x ^ (x >> 33);
}

static int token_find(const Bpe *b, const char *s, size_t n) {
    for (size_t i = hash_bytes(s, n) & (TOK_SLOTS - 1);; i = (i + 1) & (TOK_SLOTS - 1)) {
        int id = b->tok_slots[i];
        if (id < 0) return -1;
        if (b->tok_off[id + 1] - b->tok_off[id] == n && memcmp(b->tok_data + b->tok_off[id], s, n) == 0) return id;
    }
}

/* Returns the slot index of pair (left, right), or of the empty slot where it would go. */
static size_t merge_slot(const Bpe *b, int left, int right) {
    uint64_t key = (uint64_t)left << 32 | (uint32_t)right;
    size_t i = hash_u64(key) & (TOK_SLOTS - 1);
    while (b->merge_key[i] != UINT64_MAX && b->merge_key[i] != key) i = (i + 1) & (TOK_SLOTS - 1);
    return i;
}

/* Rank of merging (left, right), -1 if none; *result gets the merged id. */
static int merge_rank(const Bpe *b, int left, int right, int *result) {
    size_t i = merge_slot(b, left, right);
    if (b->merge_key[i] == UINT64_MAX) return -1;
    *result = b->merge_result[i];
    return b->merge_rank[i];
}

/* ---- loading ---------------------------------------------------------- */

/* GPT-2 byte alphabet: printable bytes map to themselves, the other 68 to 256, 257, ... */
static void byte_alphabet(int cp_to_byte[ALPHABET_CPS]) {
    for (int i = 0; i < ALPHABET_CPS; i++) cp_to_byte[i] = -1;
    int n = 0;
    for (int byte = 0; byte < 256; byte++) {
        int printable = (byte >= 33 && byte <= 126) || (byte >= 161 && byte <= 172) || byte >= 174;
        cp_to_byte[printable ? byte : 256 + n++] = byte;
    }
}

/* Converts a token string in the byte alphabet (UTF-8) to raw bytes in out
 * (at least strlen(s) bytes); returns the byte count or -1. */
static int alphabet_to_bytes(const int cp_to_byte[ALPHABET_CPS], const char *s, char *out) {
    const uint8_t *u = (const uint8_t *)s;
    size_t len = strlen(s), n = 0;
    for (size_t i = 0; i < len;) {
        ucs4_t c;
        int k = u8_mbtoucr(&c, u + i, len - i);
        if (k < 0 || c >= ALPHABET_CPS || cp_to_byte[c] < 0) return -1;
        out[n++] = (char)cp_to_byte[c];
        i += (size_t)k;
    }
    return (int)n;
}

/* read_file plus a hint on where the files come from. */
static char *read_bpe_file(const char *path, size_t *size, Err *e) {
    char *text = read_file(path, size, e);
    if (!text && e) {
        Err why = *e;
        err_set(e, "%s (hint: the GPT-2 BPE files are fetched by the project's data script)", why.msg);
    }
    return text;
}

static int load_encoder(Bpe *b, const char *path, const int cp_to_byte[ALPHABET_CPS], Err *e) {
    size_t size;
    char *text = read_bpe_file(path, &size, e);
    if (!text) return -1;
    cJSON *root = cJSON_ParseWithLength(text, size);
    if (!root) {
        const char *at = cJSON_GetErrorPtr();
        long off = at ? (long)(at - text) : -1;
        free(text);
        return err_set(e, "%s: not valid JSON (parse error near byte %ld of %zu) (hint: the file is damaged or truncated; fetch a fresh GPT-2 encoder.json)",
                       path, off, size);
    }
    free(text);
    int rc = -1;
    if (!cJSON_IsObject(root) || cJSON_GetArraySize(root) != BPE_VOCAB) {
        err_set(e, "%s: expected a JSON object with %d entries, found %d (hint: this is not GPT-2's encoder.json)",
                path, BPE_VOCAB, cJSON_IsObject(root) ? cJSON_GetArraySize(root) : -1);
        goto done;
    }
    /* first pass: ids and sizes; second: bytes */
    char **keys = xcalloc(BPE_VOCAB, sizeof(char *));
    size_t total = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, root) {
        double v = it->valuedouble;
        if (!cJSON_IsNumber(it) || v < 0 || v >= BPE_VOCAB || v != (double)(int)v) {
            err_set(e, "%s: entry \"%s\" has id %s, expected an integer in [0, %d) (hint: the file is damaged)",
                    path, it->string, cJSON_IsNumber(it) ? "out of range" : "that is not a number", BPE_VOCAB);
            goto free_keys;
        }
        if (keys[(int)v]) {
            err_set(e, "%s: id %d is used by both \"%s\" and \"%s\" (hint: the file is damaged)",
                    path, (int)v, keys[(int)v], it->string);
            goto free_keys;
        }
        keys[(int)v] = it->string;
        total += strlen(it->string);
    }
    /* 50,257 distinct ids in [0, 50257) cover every id, so keys[] is full */
    b->tok_data = xmalloc(total + 1);
    b->tok_off = xmalloc((BPE_VOCAB + 1) * sizeof(uint32_t));
    b->tok_slots = xmalloc(TOK_SLOTS * sizeof(int));
    for (int i = 0; i < TOK_SLOTS; i++) b->tok_slots[i] = -1;
    uint32_t off = 0;
    for (int id = 0; id < BPE_VOCAB; id++) {
        int n = alphabet_to_bytes(cp_to_byte, keys[id], b->tok_data + off);
        if (n <= 0) {
            err_set(e, "%s: token \"%s\" (id %d) is not a non-empty string in the GPT-2 byte alphabet (hint: the file is damaged)",
                    path, keys[id], id);
            goto free_keys;
        }
        b->tok_off[id] = off;
        b->tok_off[id + 1] = off + (uint32_t)n;
        size_t i = hash_bytes(b->tok_data + off, (size_t)n) & (TOK_SLOTS - 1);
        while (b->tok_slots[i] >= 0) i = (i + 1) & (TOK_SLOTS - 1);
        b->tok_slots[i] = id;
        off += (uint32_t)n;
    }
    for (int byte = 0; byte < 256; byte++) {
        char c = (char)byte;
        b->byte_id[byte] = token_find(b, &c, 1);
        if (b->byte_id[byte] < 0) {
            err_set(e, "%s: no token for byte %d (hint: the file is damaged)", path, byte);
            goto free_keys;
        }
    }
    b->eot = token_find(b, "<|endoftext|>", 13);
    if (b->eot < 0) {
        err_set(e, "%s: no <|endoftext|> token (hint: this is not GPT-2's encoder.json)", path);
        goto free_keys;
    }
    b->vocab_size = BPE_VOCAB;
    rc = 0;
free_keys:
    free(keys);
done:
    cJSON_Delete(root);
    return rc;
}

/* Looks up one merge symbol (alphabet string of n bytes at s) as a token id. */
static int symbol_id(const Bpe *b, const int cp_to_byte[ALPHABET_CPS], const char *s, size_t n) {
    char tmp[1024], buf[1024];
    if (n == 0 || n >= sizeof tmp) return -1;
    memcpy(tmp, s, n);
    tmp[n] = 0;
    int len = alphabet_to_bytes(cp_to_byte, tmp, buf);
    return len < 0 ? -1 : token_find(b, buf, (size_t)len);
}

static int load_merges(Bpe *b, const char *path, const int cp_to_byte[ALPHABET_CPS], Err *e) {
    size_t size;
    char *text = read_bpe_file(path, &size, e);
    if (!text) return -1;
    int rc = -1;
    char *line_end = memchr(text, '\n', size);
    if (size < 8 || memcmp(text, "#version", 8) != 0 || !line_end) {
        err_set(e, "%s: first line is not '#version: ...' (hint: this is not GPT-2's vocab.bpe)", path);
        goto done;
    }
    int want = b->vocab_size - 257; /* every token but the bytes and <|endoftext|> comes from one merge */
    b->merge_key = xmalloc(TOK_SLOTS * sizeof(uint64_t));
    b->merge_rank = xmalloc(TOK_SLOTS * sizeof(int));
    b->merge_result = xmalloc(TOK_SLOTS * sizeof(int));
    for (int i = 0; i < TOK_SLOTS; i++) b->merge_key[i] = UINT64_MAX;
    int rank = 0, n_off = 0, first_off = -1, first_off_id = 0;
    for (char *p = line_end + 1; p < text + size; rank++) {
        char *end = memchr(p, '\n', (size_t)(text + size - p));
        if (!end) end = text + size; /* last line without newline */
        int lineno = rank + 2;
        char *sp = memchr(p, ' ', (size_t)(end - p));
        if (!sp || sp == p || sp + 1 == end || memchr(sp + 1, ' ', (size_t)(end - sp - 1))) {
            err_set(e, "%s: line %d: expected two symbols separated by one space (hint: the file is damaged)", path, lineno);
            goto done;
        }
        if (rank >= want) {
            err_set(e, "%s: more than %d merges (hint: encoder.json and vocab.bpe do not belong together)", path, want);
            goto done;
        }
        int left = symbol_id(b, cp_to_byte, p, (size_t)(sp - p));
        int right = symbol_id(b, cp_to_byte, sp + 1, (size_t)(end - sp - 1));
        if (left < 0 || right < 0) {
            err_set(e, "%s: line %d: symbol \"%.*s\" is not in encoder.json (hint: the files do not belong together or one is damaged)",
                    path, lineno, left < 0 ? (int)(sp - p) : (int)(end - sp - 1), left < 0 ? p : sp + 1);
            goto done;
        }
        /* the merged token's bytes are the two symbols' bytes concatenated */
        size_t nl = b->tok_off[left + 1] - b->tok_off[left], nr = b->tok_off[right + 1] - b->tok_off[right];
        char joined[2048];
        memcpy(joined, b->tok_data + b->tok_off[left], nl);
        memcpy(joined + nl, b->tok_data + b->tok_off[right], nr);
        int result = token_find(b, joined, nl + nr);
        if (result < 0) {
            err_set(e, "%s: line %d: merge result \"%.*s\" is not in encoder.json (hint: the files do not belong together or one is damaged)",
                    path, lineno, (int)(end - p), p);
            goto done;
        }
        size_t slot = merge_slot(b, left, right);
        if (b->merge_key[slot] != UINT64_MAX) {
            err_set(e, "%s: line %d: merge \"%.*s\" repeats line %d (hint: the file is damaged)",
                    path, lineno, (int)(end - p), p, b->merge_rank[slot] + 2);
            goto done;
        }
        b->merge_key[slot] = (uint64_t)left << 32 | (uint32_t)right;
        b->merge_rank[slot] = rank;
        b->merge_result[slot] = result;
        if (result != 256 + rank && n_off++ == 0) {
            first_off = rank;
            first_off_id = result;
        }
        p = end + 1;
    }
    if (rank != want) {
        err_set(e, "%s: %d merges, expected %d (hint: the file is truncated; fetch a fresh GPT-2 vocab.bpe)", path, rank, want);
        goto done;
    }
    if (n_off)
        fprintf(stderr, "warning: %s: %d merges do not produce id 256 + rank (first: rank %d gives id %d); using ids from encoder.json\n",
                path, n_off, first_off, first_off_id);
    rc = 0;
done:
    free(text);
    return rc;
}

Bpe *bpe_load(const char *encoder_json_path, const char *vocab_bpe_path, Err *e) {
    int cp_to_byte[ALPHABET_CPS];
    byte_alphabet(cp_to_byte);
    Bpe *b = xcalloc(1, sizeof(Bpe));
    if (load_encoder(b, encoder_json_path, cp_to_byte, e) != 0 || load_merges(b, vocab_bpe_path, cp_to_byte, e) != 0) {
        bpe_free(b);
        return NULL;
    }
    free(b->tok_slots); /* only needed to resolve merge symbols */
    b->tok_slots = NULL;
    b->cache_nslots = 1 << 12;
    b->cache_slots = xcalloc(b->cache_nslots, sizeof(uint32_t));
    return b;
}

void bpe_free(Bpe *b) {
    if (!b) return;
    free(b->tok_data);
    free(b->tok_off);
    free(b->tok_slots);
    free(b->merge_key);
    free(b->merge_rank);
    free(b->merge_result);
    free(b->cache_slots);
    free(b->cache);
    free(b->arena);
    free(b->sym);
    free(b->next);
    free(b->prev);
    free(b->heap);
    free(b->batch);
    free(b);
}

int bpe_vocab_size(const Bpe *b) { return b->vocab_size; }
int bpe_eot(const Bpe *b) { return b->eot; }

/* ---- BPE on one chunk ------------------------------------------------- */

static void push_id(int **ids, size_t *n, size_t *cap, int id) {
    if (*n == *cap) {
        *cap = *cap ? 2 * *cap : 1024;
        *ids = xrealloc(*ids, *cap * sizeof(int));
    }
    (*ids)[(*n)++] = id;
}

static int heap_less(const HeapItem *a, const HeapItem *b) {
    return a->rank < b->rank || (a->rank == b->rank && a->pos < b->pos);
}

static void heap_push(HeapItem *h, size_t *n, HeapItem x) {
    size_t i = (*n)++;
    while (i > 0 && heap_less(&x, &h[(i - 1) / 2])) {
        h[i] = h[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    h[i] = x;
}

static HeapItem heap_pop(HeapItem *h, size_t *n) {
    HeapItem top = h[0], x = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && heap_less(&h[c + 1], &h[c])) c++;
        if (!heap_less(&h[c], &x)) break;
        h[i] = h[c];
        i = c;
    }
    h[i] = x;
    return top;
}

/* Pushes the pair starting at symbol pos if it has a merge rank. */
static void push_pair(Bpe *b, size_t *heap_n, int pos) {
    if (pos < 0 || b->next[pos] < 0) return;
    int left = b->sym[pos], right = b->sym[b->next[pos]], result;
    int rank = merge_rank(b, left, right, &result);
    if (rank >= 0) heap_push(b->heap, heap_n, (HeapItem){rank, pos, left, right, result});
}

/* Same result as OpenAI's bpe(): repeatedly take the lowest-ranked adjacent
 * pair and merge all its occurrences left to right. The heap finds that pair
 * in O(log n), so long chunks stay fast; entries go stale when a neighbour
 * merges and are checked when popped. */
static void bpe_chunk(Bpe *b, const char *s, int n, int **ids, size_t *nids, size_t *cap) {
    if ((size_t)n > b->scratch_cap) {
        b->scratch_cap = (size_t)n;
        b->sym = xrealloc(b->sym, (size_t)n * sizeof(int));
        b->next = xrealloc(b->next, (size_t)n * sizeof(int));
        b->prev = xrealloc(b->prev, (size_t)n * sizeof(int));
        /* n - 1 initial pairs plus at most two new pairs per merge */
        b->heap = xrealloc(b->heap, 3 * (size_t)n * sizeof(HeapItem));
        b->batch = xrealloc(b->batch, 3 * (size_t)n * sizeof(HeapItem));
    }
    for (int i = 0; i < n; i++) {
        b->sym[i] = b->byte_id[(uint8_t)s[i]];
        b->next[i] = i + 1 < n ? i + 1 : -1;
        b->prev[i] = i - 1;
    }
    size_t heap_n = 0;
    for (int i = 0; i + 1 < n; i++) push_pair(b, &heap_n, i);
    while (heap_n > 0) {
        /* take every occurrence of the best pair out first (leftmost first):
         * pairs these merges create wait for the next pass, as in the
         * reference loop, even if they rank lower */
        size_t nb = 0;
        int rank = b->heap[0].rank;
        while (heap_n > 0 && b->heap[0].rank == rank) b->batch[nb++] = heap_pop(b->heap, &heap_n);
        for (size_t k = 0; k < nb; k++) {
            HeapItem it = b->batch[k];
            int p = it.pos, q = b->next[p];
            if (b->sym[p] != it.left || q < 0 || b->sym[q] != it.right) continue; /* stale or overlapped */
            b->sym[p] = it.result;
            b->sym[q] = -1;
            b->next[p] = b->next[q];
            if (b->next[q] >= 0) b->prev[b->next[q]] = p;
            push_pair(b, &heap_n, b->prev[p]);
            push_pair(b, &heap_n, p);
        }
    }
    for (int i = 0; i >= 0; i = b->next[i]) push_id(ids, nids, cap, b->sym[i]);
}

/* ---- chunk cache ------------------------------------------------------ */

static CacheEntry *cache_find(Bpe *b, const char *s, uint32_t n, uint64_t h, size_t *slot) {
    size_t mask = b->cache_nslots - 1, i = h & mask;
    for (; b->cache_slots[i]; i = (i + 1) & mask) {
        CacheEntry *c = &b->cache[b->cache_slots[i] - 1];
        if (c->hash == h && c->key_len == n && memcmp(b->arena + c->off, s, n) == 0) return c;
    }
    *slot = i;
    return NULL;
}

static void cache_insert(Bpe *b, const char *s, uint32_t n, uint64_t h, const int *ids, uint32_t n_ids) {
    if (b->cache_n == CACHE_MAX || b->arena_len > CACHE_MAX_BYTES) { /* bound memory on huge corpora: start over */
        b->cache_n = 0;
        b->arena_len = 0;
        memset(b->cache_slots, 0, b->cache_nslots * sizeof(uint32_t));
    }
    if (2 * (b->cache_n + 1) > b->cache_nslots) { /* keep load <= 1/2: rehash into twice the slots */
        free(b->cache_slots);
        b->cache_nslots *= 2;
        b->cache_slots = xcalloc(b->cache_nslots, sizeof(uint32_t));
        size_t mask = b->cache_nslots - 1;
        for (size_t k = 0; k < b->cache_n; k++) {
            size_t i = b->cache[k].hash & mask;
            while (b->cache_slots[i]) i = (i + 1) & mask;
            b->cache_slots[i] = (uint32_t)(k + 1);
        }
    }
    size_t slot = 0; /* always set by cache_find; initialised for -O3 flow analysis */
    cache_find(b, s, n, h, &slot);
    if (b->cache_n == b->cache_cap) {
        b->cache_cap = b->cache_cap ? 2 * b->cache_cap : 4096;
        b->cache = xrealloc(b->cache, b->cache_cap * sizeof(CacheEntry));
    }
    size_t need = n + n_ids * sizeof(int);
    if (b->arena_len + need > b->arena_cap) {
        b->arena_cap = 2 * (b->arena_len + need) + (1 << 16);
        b->arena = xrealloc(b->arena, b->arena_cap);
    }
    memcpy(b->arena + b->arena_len, s, n);
    memcpy(b->arena + b->arena_len + n, ids, n_ids * sizeof(int));
    b->cache[b->cache_n] = (CacheEntry){h, b->arena_len, n, n_ids};
    b->arena_len += need;
    b->cache_slots[slot] = (uint32_t)++b->cache_n;
}

static void encode_chunk(Bpe *b, const char *s, size_t n, int **ids, size_t *nids, size_t *cap) {
    if (n == 1) {
        push_id(ids, nids, cap, b->byte_id[(uint8_t)s[0]]);
        return;
    }
    if (n > CACHE_MAX_CHUNK) {
        bpe_chunk(b, s, (int)n, ids, nids, cap);
        return;
    }
    uint64_t h = hash_bytes(s, n);
    size_t slot;
    const CacheEntry *c = cache_find(b, s, (uint32_t)n, h, &slot);
    if (c) {
        for (uint32_t k = 0; k < c->n_ids; k++) {
            int id;
            memcpy(&id, b->arena + c->off + c->key_len + k * sizeof(int), sizeof id);
            push_id(ids, nids, cap, id);
        }
        return;
    }
    size_t first = *nids;
    bpe_chunk(b, s, (int)n, ids, nids, cap);
    cache_insert(b, s, (uint32_t)n, h, *ids + first, (uint32_t)(*nids - first));
}

/* ---- pre-tokenisation ------------------------------------------------- */

enum { CH_LETTER, CH_NUMBER, CH_SPACE, CH_OTHER };

/* Class of the character at s[i]; *clen gets its length in bytes. */
static int char_class(const uint8_t *s, size_t len, size_t i, size_t *clen) {
    uint8_t c0 = s[i];
    if (c0 < 0x80) {
        *clen = 1;
        if ((c0 >= 'a' && c0 <= 'z') || (c0 >= 'A' && c0 <= 'Z')) return CH_LETTER;
        if (c0 >= '0' && c0 <= '9') return CH_NUMBER;
        if (c0 == ' ' || (c0 >= '\t' && c0 <= '\r')) return CH_SPACE;
        return CH_OTHER;
    }
    ucs4_t c;
    int k = u8_mbtoucr(&c, s + i, len - i);
    if (k < 0) {
        *clen = 1;
        return CH_OTHER;
    }
    *clen = (size_t)k;
    if (uc_is_property_white_space(c)) return CH_SPACE;
    if (uc_is_general_category(c, UC_CATEGORY_L)) return CH_LETTER;
    if (uc_is_general_category(c, UC_CATEGORY_N)) return CH_NUMBER;
    return CH_OTHER;
}

/* End of the chunk starting at i, as the GPT-2 regex would match it (the
 * alternatives are tried in order; comments give the one that matches). */
static size_t chunk_end(const uint8_t *s, size_t len, size_t i) {
    static const char *contractions[] = {"'s", "'t", "'re", "'ve", "'m", "'ll", "'d"};
    if (s[i] == '\'') {
        for (int k = 0; k < 7; k++) {
            size_t n = strlen(contractions[k]);
            if (len - i >= n && memcmp(s + i, contractions[k], n) == 0) return i + n;
        }
    }
    size_t clen, j = i;
    int cls = char_class(s, len, i, &clen);
    if (s[i] == ' ' && i + 1 < len) { /* " ?" prefix: the space joins a following non-space run */
        int next = char_class(s, len, i + 1, &clen);
        if (next != CH_SPACE) {
            cls = next;
            j = i + 1;
        }
    }
    if (cls != CH_SPACE) { /*  ?\p{L}+ |  ?\p{N}+ |  ?[^\s\p{L}\p{N}]+ */
        while (j < len && char_class(s, len, j, &clen) == cls) j += clen;
        return j;
    }
    size_t last = i; /* start of the run's last whitespace character */
    for (j = i; j < len && char_class(s, len, j, &clen) == CH_SPACE; j += clen) last = j;
    if (j == len) return j;       /* \s+(?!\S) at the end of the text */
    if (last > i) return last;    /* \s+(?!\S): leave the last one to prefix the next chunk */
    return j;                     /* \s+: a single whitespace character */
}

int bpe_encode(Bpe *b, const char *text, size_t len, int **ids, size_t *n, size_t *cap, Err *e) {
    if (!text && len > 0) return err_set(e, "bpe_encode: NULL text with length %zu", len);
    const uint8_t *s = (const uint8_t *)text;
    for (size_t i = 0; i < len;) {
        size_t end = chunk_end(s, len, i);
        encode_chunk(b, text + i, end - i, ids, n, cap);
        i = end;
    }
    return 0;
}

/* ---- decoding --------------------------------------------------------- */

const char *bpe_token_bytes(const Bpe *b, int id, size_t *len) {
    if (id < 0 || id >= b->vocab_size) return NULL;
    *len = b->tok_off[id + 1] - b->tok_off[id];
    return b->tok_data + b->tok_off[id];
}

char *bpe_decode(const Bpe *b, const int *ids, size_t n, size_t *len, Err *e) {
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= b->vocab_size) {
            err_set(e, "bpe_decode: token %zu has id %d, outside the vocabulary [0, %d) (hint: the ids come from a different tokenizer or are corrupt)",
                    i, ids[i], b->vocab_size);
            return NULL;
        }
        total += b->tok_off[ids[i] + 1] - b->tok_off[ids[i]];
    }
    char *out = xmalloc(total + 1);
    size_t off = 0;
    for (size_t i = 0; i < n; i++) {
        size_t k = b->tok_off[ids[i] + 1] - b->tok_off[ids[i]];
        memcpy(out + off, b->tok_data + b->tok_off[ids[i]], k);
        off += k;
    }
    out[off] = 0;
    *len = off;
    return out;
}
