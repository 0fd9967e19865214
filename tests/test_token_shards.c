/* llm.c token shard tests: write/read round trip, windows, and rejection of
 * truncated files, wrong magic or version, size mismatches and ids outside
 * the vocabulary. Files go to a fresh folder under /tmp. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common.h"
#include "test.h"

#include "gpt2/token_shards.h"

/* A whole shard, opened, validated and read (malloc'd, *ntok tokens); NULL with e on an error. */
static uint16_t *shard_read(const char *path, int vocab_size, size_t *ntok, Err *e) {
    Shard s;
    if (shard_open(&s, path, e) != 0) return NULL;
    uint16_t *tokens = xmalloc(s.ntok * sizeof(uint16_t));
    if (shard_read_tokens(&s, 0, s.ntok, vocab_size, tokens, e) != 0) {
        free(tokens);
        tokens = NULL;
    } else {
        *ntok = s.ntok;
    }
    shard_close(&s);
    return tokens;
}

#define VOCAB 50257

static char dir[] = "/tmp/kvlab_test_shards_XXXXXX";

static void tmp_path(char path[4096], const char *name) { snprintf(path, 4096, "%s/%s", dir, name); }

/* Writes raw bytes to dir/name (bypassing shard_write) to make damaged files. */
static void write_raw(const char *name, const void *data, size_t n) {
    char path[4096];
    tmp_path(path, name);
    Err e;
    CHECK(write_file_atomic(path, data, n, &e) == 0, "%s", e.msg);
}

/* A valid shard image: header + ntok uint16 ids i % 1000. */
static char *shard_image(int32_t magic, int32_t version, int32_t header_ntok, size_t ntok, size_t *size) {
    *size = SHARD_HEADER_BYTES + 2 * ntok;
    char *buf = xcalloc(1, *size);
    int32_t header[3] = {magic, version, header_ntok};
    memcpy(buf, header, sizeof header);
    for (size_t i = 0; i < ntok; i++) {
        uint16_t v = (uint16_t)(i % 1000);
        memcpy(buf + SHARD_HEADER_BYTES + 2 * i, &v, 2);
    }
    return buf;
}

/* shard_read of dir/name must fail with a message naming the file and containing want. */
static void expect_reject(const char *name, int vocab, const char *want, const char *what) {
    char path[4096];
    tmp_path(path, name);
    Err e = {{0}};
    size_t n = 0;
    uint16_t *t = shard_read(path, vocab, &n, &e);
    CHECK(t == NULL && strstr(e.msg, path) && strstr(e.msg, want), "%s rejected, got: %s", what, e.msg);
    if (!t) printf("  %s -> %s\n", what, e.msg);
    free(t);
    unlink(path);
}

static void test_round_trip(void) {
    size_t n = 100003; /* more than one write block */
    int *ids = xmalloc(n * sizeof(int));
    uint64_t x = 42;
    for (size_t i = 0; i < n; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        ids[i] = (int)((x >> 33) % VOCAB);
    }
    ids[0] = 50256;
    ids[1] = 0;
    char path[4096], empty[4096];
    tmp_path(path, "rt_train_000001.bin");
    Err e;
    CHECK(shard_write(path, ids, n, &e) == 0, "shard_write: %s", e.msg);
    size_t size = 0;
    char *raw = read_file(path, &size, &e);
    int32_t header[3] = {0};
    if (raw) memcpy(header, raw, sizeof header);
    CHECK(size == 1024 + 2 * n, "file size %zu == 1024 + 2 * ntok", size);
    CHECK(header[0] == 20240520 && header[1] == 1 && header[2] == (int32_t)n, "header magic/version/ntok");
    int zeros = 1;
    for (size_t i = 12; raw && i < 1024; i++) zeros &= raw[i] == 0;
    CHECK(zeros, "unused header entries are zero");
    free(raw);

    size_t got = 0;
    uint16_t *t = shard_read(path, VOCAB, &got, &e);
    CHECK(t != NULL, "shard_read: %s", e.msg);
    int same = t && got == n;
    for (size_t i = 0; same && i < n; i++) same = t[i] == ids[i];
    CHECK(same, "read ids equal written ids");
    free(t);

    /* a window in the middle, as a data loader reads it */
    Shard s;
    CHECK(shard_open(&s, path, &e) == 0 && s.ntok == n, "shard_open: %s", e.msg);
    uint16_t win[65];
    CHECK(shard_read_tokens(&s, 5000, 65, VOCAB, win, &e) == 0, "window read: %s", e.msg);
    same = 1;
    for (int i = 0; i < 65; i++) same &= win[i] == ids[5000 + i];
    CHECK(same, "window equals ids[5000..5065)");
    CHECK(shard_read_tokens(&s, n - 10, 11, VOCAB, win, &e) != 0 && strstr(e.msg, path), "window past the end rejected: %s", e.msg);
    shard_close(&s);

    /* an empty shard is valid */
    tmp_path(empty, "empty.bin");
    CHECK(shard_write(empty, ids, 0, &e) == 0, "empty shard_write: %s", e.msg);
    t = shard_read(empty, VOCAB, &got, &e);
    CHECK(t != NULL && got == 0, "empty shard reads back");
    free(t);
    unlink(empty);
    unlink(path);
    free(ids);
}

static void test_bad_writes(void) {
    Err e = {{0}};
    int ids[] = {1, 2, 65536};
    char path[4096], nodir[4096];
    tmp_path(path, "bad_write.bin");
    tmp_path(nodir, "no/such/dir.bin");
    CHECK(shard_write(path, ids, 3, &e) != 0 && strstr(e.msg, "token 2") && strstr(e.msg, "65536"), "id 65536 rejected: %s", e.msg);
    CHECK(!file_exists(path), "nothing written for a bad id");
    int neg[] = {-5};
    CHECK(shard_write(path, neg, 1, &e) != 0 && strstr(e.msg, "-5"), "id -5 rejected: %s", e.msg);
    CHECK(shard_write(nodir, ids, 2, &e) != 0 && strstr(e.msg, "no/such/dir.bin"), "unwritable path rejected: %s", e.msg);
}

static void test_bad_files(void) {
    size_t size;
    char *img = shard_image(SHARD_MAGIC, SHARD_VERSION, 50, 50, &size);
    char p[4096], vocab_path[4096];
    tmp_path(p, "ok.bin");
    tmp_path(vocab_path, "vocab.bin");
    write_raw("ok.bin", img, size);
    Err e;
    size_t n;
    uint16_t *t = shard_read(p, VOCAB, &n, &e);
    CHECK(t && n == 50 && t[49] == 49, "hand-made shard reads back: %s", t ? "" : e.msg);
    free(t);

    write_raw("short.bin", img, 100);
    expect_reject("short.bin", VOCAB, "shorter than the 1024-byte header", "file shorter than the header");
    write_raw("trunc.bin", img, size - 1);
    expect_reject("trunc.bin", VOCAB, "size mismatch", "payload truncated by one byte");
    write_raw("empty.bin", img, 0);
    expect_reject("empty.bin", VOCAB, "shorter than the 1024-byte header", "empty file");
    free(img);

    img = shard_image(20240801, SHARD_VERSION, 50, 50, &size);
    write_raw("magic.bin", img, size);
    expect_reject("magic.bin", VOCAB, "bad magic 20240801", "wrong magic");
    free(img);

    img = shard_image(SHARD_MAGIC, 7, 50, 50, &size);
    write_raw("version.bin", img, size);
    expect_reject("version.bin", VOCAB, "unsupported version 7", "wrong version");
    free(img);

    img = shard_image(SHARD_MAGIC, SHARD_VERSION, 60, 50, &size); /* header claims more than present */
    write_raw("count.bin", img, size);
    expect_reject("count.bin", VOCAB, "size mismatch", "header count larger than payload");
    free(img);

    img = shard_image(SHARD_MAGIC, SHARD_VERSION, 40, 50, &size); /* trailing bytes */
    write_raw("extra.bin", img, size);
    expect_reject("extra.bin", VOCAB, "size mismatch", "trailing data after the tokens");
    free(img);

    img = shard_image(SHARD_MAGIC, SHARD_VERSION, -1, 0, &size);
    write_raw("neg.bin", img, size);
    expect_reject("neg.bin", VOCAB, "negative token count", "negative token count");
    free(img);

    /* token 37 has id 50257 (>= vocab): error names the index and the value */
    img = shard_image(SHARD_MAGIC, SHARD_VERSION, 50, 50, &size);
    uint16_t big = 50257;
    memcpy(img + SHARD_HEADER_BYTES + 2 * 37, &big, 2);
    write_raw("vocab.bin", img, size);
    expect_reject("vocab.bin", VOCAB, "token 37 has id 50257", "token id >= vocab size");
    /* the same file is fine for a larger vocabulary */
    write_raw("vocab.bin", img, size);
    t = shard_read(vocab_path, 65536, &n, &e);
    CHECK(t && t[37] == 50257, "id 50257 accepted with vocab 65536");
    free(t);
    unlink(vocab_path);
    free(img);

    expect_reject("missing.bin", VOCAB, "cannot open", "missing file");
    unlink(p);
}

int main(void) {
    if (!mkdtemp(dir)) {
        printf("cannot create a temporary folder under /tmp\n");
        return 1;
    }
    test_round_trip();
    test_bad_writes();
    test_bad_files();
    rmdir(dir);
    return TEST_SUMMARY("test_token_shards");
}
