#define _GNU_SOURCE
#include "token_shards.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* The header and ids are written and read as host integers, as llm.c does. */
_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "token shards are little-endian");

int shard_write(const char *path, const int *ids, size_t n, Err *e) {
    AtomicFile af;
    return shard_stage(&af, path, ids, n, e) == 0 ? atomic_commit(&af, e) : -1;
}

int shard_stage(AtomicFile *out, const char *path, const int *ids, size_t n, Err *e) {
    if (n > INT32_MAX)
        return err_set(e, "%s: %zu tokens do not fit one shard (hint: split the data into shards below 2^31 tokens)", path, n);
    for (size_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] > UINT16_MAX)
            return err_set(e, "%s: token %zu has id %d, outside [0, 65535] (hint: uint16 shards need a vocabulary below 65536)",
                           path, i, ids[i]);
    int32_t header[256] = {SHARD_MAGIC, SHARD_VERSION, (int32_t)n};
    AtomicFile af;
    if (atomic_open(&af, path, e) != 0) return -1;
    if (atomic_write(&af, header, sizeof header, e) != 0) goto fail;
    uint16_t buf[8192]; /* convert in blocks rather than copying the whole array */
    for (size_t i = 0; i < n;) {
        size_t k = n - i < 8192 ? n - i : 8192;
        for (size_t j = 0; j < k; j++) buf[j] = (uint16_t)ids[i + j];
        if (atomic_write(&af, buf, k * sizeof(uint16_t), e) != 0) goto fail;
        i += k;
    }
    *out = af;
    return 0;
fail:
    atomic_abort(&af);
    return -1;
}

int shard_open(Shard *s, const char *path, Err *e) {
    memset(s, 0, sizeof *s);
    FILE *f = fopen(path, "rb");
    if (!f) return err_set(e, "%s: cannot open: %s (hint: check the path; shards are made by the tokenize tool)", path, strerror(errno));
    struct stat st;
    int32_t header[256];
    if (fstat(fileno(f), &st) != 0) {
        err_set(e, "%s: cannot stat: %s (hint: check the file system)", path, strerror(errno));
        goto fail;
    }
    long long size = (long long)st.st_size;
    if (size < SHARD_HEADER_BYTES || fread(header, sizeof header, 1, f) != 1) {
        err_set(e, "%s: file is %lld bytes, shorter than the %d-byte header (hint: truncated, or not an llm.c token shard)",
                path, size, SHARD_HEADER_BYTES);
        goto fail;
    }
    if (header[0] != SHARD_MAGIC) {
        err_set(e, "%s: bad magic %d, expected %d (hint: not an llm.c uint16 token shard; 20240801 is the uint32 variant, which is not supported)",
                path, header[0], SHARD_MAGIC);
        goto fail;
    }
    if (header[1] != SHARD_VERSION) {
        err_set(e, "%s: unsupported version %d, expected %d (hint: only llm.c's uint16 shards are supported)", path, header[1], SHARD_VERSION);
        goto fail;
    }
    if (header[2] < 0) {
        err_set(e, "%s: negative token count %d in header (hint: the file is corrupt; regenerate it)", path, header[2]);
        goto fail;
    }
    long long want = SHARD_HEADER_BYTES + 2LL * header[2];
    if (size != want) {
        err_set(e, "%s: size mismatch: file is %lld bytes but the header's %d tokens need %lld (hint: the file is truncated or was written incompletely; regenerate it)",
                path, size, header[2], want);
        goto fail;
    }
    s->f = f;
    s->path = xstrdup(path);
    s->ntok = (size_t)header[2];
    return 0;
fail:
    fclose(f);
    return -1;
}

int shard_read_tokens(Shard *s, size_t start, size_t count, int vocab_size, uint16_t *out, Err *e) {
    if (start > s->ntok || count > s->ntok - start)
        return err_set(e, "%s: tokens [%zu, %zu) requested but the shard has %zu (hint: a loader bug; windows must lie inside the shard)",
                       s->path, start, start + count, s->ntok);
    if (fseeko(s->f, SHARD_HEADER_BYTES + 2 * (off_t)start, SEEK_SET) != 0 || fread(out, sizeof(uint16_t), count, s->f) != count)
        return err_set(e, "%s: read error at token %zu (hint: was the file changed while in use?)", s->path, start);
    for (size_t i = 0; i < count; i++)
        if (out[i] >= vocab_size)
            return err_set(e, "%s: token %zu has id %u, not below the vocabulary size %d (hint: the shard was made with a different tokenizer)",
                           s->path, start + i, (unsigned)out[i], vocab_size);
    return 0;
}

void shard_close(Shard *s) {
    if (s->f) fclose(s->f);
    free(s->path);
    memset(s, 0, sizeof *s);
}

