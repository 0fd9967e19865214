/* GPT-2 byte-level BPE tokenizer (formats.md §5): loads OpenAI's
 * encoder.json + vocab.bpe, encodes UTF-8 (or any) bytes to token ids and
 * decodes ids back to the exact bytes.
 *
 * Pre-tokenisation follows the GPT-2 pattern with Python `regex` semantics
 *   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 * using libunistring's Unicode tables. Bytes that are not valid UTF-8 count
 * as one "other" character each, so every byte string round-trips. The text
 * "<|endoftext|>" is not special: callers insert bpe_eot() themselves. */
#ifndef KVLAB_BPE_H
#define KVLAB_BPE_H

#include <stddef.h>

#include "common.h"

typedef struct Bpe Bpe;

/* Loads and validates both files; NULL + e on any problem. Warns on stderr
 * when the merge of rank r does not produce id 256 + r (true of the
 * released files; ids are always taken from encoder.json). */
Bpe *bpe_load(const char *encoder_json_path, const char *vocab_bpe_path, Err *e);
void bpe_free(Bpe *b);
int bpe_vocab_size(const Bpe *b); /* 50257 */
int bpe_eot(const Bpe *b);        /* id of <|endoftext|>, 50256 */

/* Encodes len bytes of text and appends the ids to the growable array
 * (*ids, *n, *cap); *ids may start NULL with *n = *cap = 0. Returns 0. */
int bpe_encode(Bpe *b, const char *text, size_t len, int **ids, size_t *n, size_t *cap, Err *e);
/* Decodes ids to bytes: malloc'd, NUL-terminated, *len excludes the NUL.
 * NULL + e if an id is out of range. */
char *bpe_decode(const Bpe *b, const int *ids, size_t n, size_t *len, Err *e);
/* The raw bytes of one token (not NUL-terminated), NULL if id is out of range. */
const char *bpe_token_bytes(const Bpe *b, int id, size_t *len);

#endif
