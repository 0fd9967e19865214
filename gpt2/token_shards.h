/* llm.c token shards (formats.md §2.3): a 256 x int32 header (magic
 * 20240520, version 1, [2] = ntok) followed by ntok uint16 token ids,
 * little-endian. A file is valid iff its size is exactly 1024 + 2 * ntok.
 * All errors are one line "<path>: <problem> (hint: ...)". */
#ifndef KVLAB_TOKEN_SHARDS_H
#define KVLAB_TOKEN_SHARDS_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "common.h"

#define SHARD_MAGIC 20240520
#define SHARD_VERSION 1
#define SHARD_HEADER_BYTES 1024

/* Writes ids[0..n) as a shard at path (temp file + fsync + rename). Every id
 * must be in [0, 65535] and n < 2^31, else nothing is written. */
int shard_write(const char *path, const int *ids, size_t n, Err *e);
/* The same written into *af's temporary file, not yet in place: atomic_commit (or atomic_abort) it, so that
 * several shards are moved into place only once all of them are written. */
int shard_stage(AtomicFile *af, const char *path, const int *ids, size_t n, Err *e);

/* An open shard whose header and size have been checked; tokens are read on
 * demand, so a loader can take windows without holding the whole file. */
typedef struct {
    FILE *f;
    char *path;
    size_t ntok;
} Shard;

int shard_open(Shard *s, const char *path, Err *e);
/* Reads tokens [start, start + count) into out and checks each id is below
 * vocab_size (error names the token's index in the file and its value). */
int shard_read_tokens(Shard *s, size_t start, size_t count, int vocab_size, uint16_t *out, Err *e);
void shard_close(Shard *s);

#endif
