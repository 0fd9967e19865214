/* GPT-2 BPE tests: the known vector, reference encodings from an independent
 * implementation (tests/data/bpe_cases.json, made with npm gpt-3-encoder by
 * tests/data/gen_bpe_cases.js), round trips on text and random bytes, and
 * rejection of damaged files and bad ids.
 * Data: $KVLAB_BPE_DIR (default /work/shared/data/gpt2-bpe) and
 * $KVLAB_SHAKESPEARE (default /work/shared/data/tinyshakespeare/input.txt).
 * Run from the repository root. */
#define _GNU_SOURCE
#include <cjson/cJSON.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpt2/bpe.h"
#include "common.h"
#include "test.h"

static const char *env_or(const char *name, const char *dflt) {
    const char *v = getenv(name);
    return v && *v ? v : dflt;
}

/* Encodes into a fresh array; *n gets the count. */
static int *encode(Bpe *b, const char *text, size_t len, size_t *n) {
    int *ids = NULL;
    size_t cap = 0;
    Err e;
    *n = 0;
    CHECK(bpe_encode(b, text, len, &ids, n, &cap, &e) == 0, "bpe_encode failed");
    return ids;
}

/* decode(encode(text)) == text byte for byte */
static int round_trips(Bpe *b, const char *text, size_t len) {
    size_t n, out_len = 0;
    int *ids = encode(b, text, len, &n);
    Err e;
    char *out = bpe_decode(b, ids, n, &out_len, &e);
    int ok = out && out_len == len && memcmp(out, text, len) == 0;
    free(ids);
    free(out);
    return ok;
}

static void test_known_vector(Bpe *b) {
    size_t n;
    int *ids = encode(b, "Hello world", 11, &n);
    CHECK(n == 2 && ids[0] == 15496 && ids[1] == 995, "\"Hello world\" -> [15496, 995], got %zu ids", n);
    free(ids);
    CHECK(bpe_vocab_size(b) == 50257, "vocab size %d", bpe_vocab_size(b));
    CHECK(bpe_eot(b) == 50256, "eot %d", bpe_eot(b));
    size_t len;
    const char *s = bpe_token_bytes(b, 50256, &len);
    CHECK(s && len == 13 && memcmp(s, "<|endoftext|>", 13) == 0, "token 50256 is <|endoftext|>");
    s = bpe_token_bytes(b, 220, &len); /* Ġ = a space */
    CHECK(s && len == 1 && s[0] == ' ', "token 220 is a space");
    CHECK(bpe_token_bytes(b, 50257, &len) == NULL, "token_bytes(50257) is NULL");

    /* encode appends to the caller's array */
    int *acc = NULL;
    size_t na = 0, cap = 0;
    Err e;
    bpe_encode(b, "Hello", 5, &acc, &na, &cap, &e);
    bpe_encode(b, " world", 6, &acc, &na, &cap, &e);
    CHECK(na == 2 && acc[0] == 15496 && acc[1] == 995, "two appends give [15496, 995]");
    free(acc);
}

static void test_reference_cases(Bpe *b, const cJSON *root) {
    const cJSON *cases = cJSON_GetObjectItem(root, "cases");
    CHECK(cJSON_IsArray(cases) && cJSON_GetArraySize(cases) > 50, "fixture has a cases array");
    int n_cases = 0, n_ok = 0, n_rt = 0;
    const cJSON *c;
    cJSON_ArrayForEach(c, cases) {
        const char *text = cJSON_GetStringValue(cJSON_GetObjectItem(c, "text"));
        const cJSON *want = cJSON_GetObjectItem(c, "ids");
        if (!text || !cJSON_IsArray(want)) continue;
        n_cases++;
        size_t n, len = strlen(text);
        int *ids = encode(b, text, len, &n);
        int ok = (int)n == cJSON_GetArraySize(want);
        for (size_t i = 0; ok && i < n; i++) ok = ids[i] == cJSON_GetArrayItem(want, (int)i)->valueint;
        if (!ok) {
            printf("  mismatch for %.60s%s\n  got ", text, len > 60 ? "..." : "");
            for (size_t i = 0; i < n && i < 20; i++) printf(" %d", ids[i]);
            printf("\n  want");
            for (int i = 0; i < cJSON_GetArraySize(want) && i < 20; i++) printf(" %d", cJSON_GetArrayItem(want, i)->valueint);
            printf("\n");
        }
        n_ok += ok;
        n_rt += round_trips(b, text, len);
        free(ids);
    }
    CHECK(n_cases == cJSON_GetArraySize(cases), "all %d cases well-formed", cJSON_GetArraySize(cases));
    CHECK(n_ok == n_cases, "reference encodings: %d of %d match", n_ok, n_cases);
    CHECK(n_rt == n_cases, "reference strings round-trip: %d of %d", n_rt, n_cases);
    printf("reference cases: %d of %d match\n", n_ok, n_cases);
}

/* The whole file against the reference's token count and hash (h = 31h + id). */
static void test_shakespeare(Bpe *b, const char *path, const cJSON *root) {
    if (!file_exists(path)) {
        printf("SKIP shakespeare round trip: %s not found (set KVLAB_SHAKESPEARE or run the data script)\n", path);
        return;
    }
    Err e;
    size_t len;
    char *text = read_file(path, &len, &e);
    CHECK(text != NULL, "%s", e.msg);
    if (!text) return;
    double t0 = wall_seconds();
    size_t n;
    int *ids = encode(b, text, len, &n);
    double dt = wall_seconds() - t0;
    printf("tiny shakespeare: %zu bytes -> %zu tokens in %.3f s\n", len, n, dt);
    const cJSON *ref = cJSON_GetObjectItem(root, "shakespeare");
    uint32_t hash = 0;
    for (size_t i = 0; i < n; i++) hash = hash * 31u + (uint32_t)ids[i];
    if (len == (size_t)cJSON_GetNumberValue(cJSON_GetObjectItem(ref, "bytes"))) {
        CHECK(n == (size_t)cJSON_GetNumberValue(cJSON_GetObjectItem(ref, "n_tokens")), "token count %zu matches the reference", n);
        CHECK(hash == (uint32_t)cJSON_GetNumberValue(cJSON_GetObjectItem(ref, "hash31")), "token hash %u matches the reference", hash);
    } else {
        printf("SKIP shakespeare reference comparison: %s is not the fixture's %g-byte file\n", path,
               cJSON_GetNumberValue(cJSON_GetObjectItem(ref, "bytes")));
    }
    size_t out_len = 0;
    char *out = bpe_decode(b, ids, n, &out_len, &e);
    CHECK(out && out_len == len && memcmp(out, text, len) == 0, "tiny shakespeare round-trips");
    /* cached chunks give the same ids as the first pass */
    size_t n2;
    int *ids2 = encode(b, text, len, &n2);
    CHECK(n2 == n && memcmp(ids, ids2, n * sizeof(int)) == 0, "second (cached) encoding is identical");
    free(ids);
    free(ids2);
    free(out);
    free(text);
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint32_t rng(void) { /* xorshift64*, fixed seed */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (uint32_t)((rng_state * 2685821657736338717ull) >> 32);
}

static void test_random_bytes(Bpe *b) {
    /* pieces that stress the pre-tokeniser: whitespace, contractions, UTF-8
     * (valid, truncated, overlong, surrogate), and lone bytes */
    static const char *pieces[] = {" ", "  ", "\n", "\r\n", "\t", "'s", "'ll", "'", "a", "Z", "7", "!", "..",
                                   "\xc3\xa9", "\xe4\xb8\xad", "\xf0\x9f\x98\x80", "\xc2\xa0", "\xe3\x80\x80",
                                   "\xcc\x81", "\xc3", "\xe4\xb8", "\xf0\x9f", "\xc0\x80", "\xed\xa0\x80",
                                   "\xff", "\x80", "\x00", "\x1c", "\x85"};
    int n_ok = 0, total = 300;
    char buf[512];
    for (int t = 0; t < total; t++) {
        size_t len = 0, want = rng() % 200;
        while (len < want) {
            if (rng() % 2) {
                buf[len++] = (char)(rng() & 0xff);
            } else {
                const char *p = pieces[rng() % (sizeof pieces / sizeof pieces[0])];
                size_t k = p[0] ? strlen(p) : 1; /* "\x00" is one NUL byte */
                memcpy(buf + len, p, k);
                len += k;
            }
        }
        n_ok += round_trips(b, buf, len);
    }
    CHECK(n_ok == total, "random byte strings round-trip: %d of %d", n_ok, total);
    /* each invalid byte is its own character, so it is its own token */
    size_t n;
    int *ids = encode(b, "\xff\xfe", 2, &n);
    CHECK(n == 2, "two invalid bytes -> two tokens, got %zu", n);
    free(ids);
}

static void test_bad_ids(Bpe *b) {
    Err e;
    size_t len;
    int bad[] = {15496, 50257};
    CHECK(bpe_decode(b, bad, 2, &len, &e) == NULL && strstr(e.msg, "50257"), "decode of id 50257 rejected: %s", e.msg);
    int neg[] = {-1};
    CHECK(bpe_decode(b, neg, 1, &len, &e) == NULL, "decode of id -1 rejected");
    char *empty = bpe_decode(b, NULL, 0, &len, &e);
    CHECK(empty && len == 0 && empty[0] == 0, "decode of no ids is the empty string");
    free(empty);
}

/* Writes data to dir/name; returns the path in a static buffer. */
static const char *write_tmp(const char *dir, const char *name, const char *data, size_t n) {
    static char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    Err e;
    CHECK(write_file_atomic(path, data, n, &e) == 0, "%s", e.msg);
    return path;
}

/* A malloc'd copy of s (n bytes) with the first `from` replaced by `to`; *out_n gets the size. */
static char *replace_first(const char *s, size_t n, const char *from, const char *to, size_t *out_n) {
    const char *at = strstr(s, from);
    CHECK(at != NULL, "test file contains \"%s\"", from);
    if (!at) at = s + n; /* no change: the load test then fails visibly */
    size_t head = (size_t)(at - s), nf = at < s + n ? strlen(from) : 0, nt = at < s + n ? strlen(to) : 0;
    char *out = xmalloc(n - nf + nt + 1);
    memcpy(out, s, head);
    memcpy(out + head, to, nt);
    memcpy(out + head + nt, at + nf, n - head - nf);
    *out_n = n - nf + nt;
    out[*out_n] = 0;
    return out;
}

/* Loading must fail with a message naming the damaged file and containing want. */
static void expect_load_error(const char *enc, const char *voc, const char *named, const char *want, const char *what) {
    Err e = {{0}};
    Bpe *b = bpe_load(enc, voc, &e);
    CHECK(b == NULL && strstr(e.msg, named) && strstr(e.msg, want), "%s rejected, got: %s", what, e.msg);
    if (!b) printf("  %s -> %s\n", what, e.msg);
    bpe_free(b);
}

/* Writes a damaged copy of one file and checks bpe_load rejects it. */
static void damaged(const char *dir, const char *name, const char *data, size_t n, int is_encoder,
                    const char *enc_path, const char *voc_path, const char *want, const char *what) {
    char path[4096];
    snprintf(path, sizeof path, "%s", write_tmp(dir, name, data, n));
    expect_load_error(is_encoder ? path : enc_path, is_encoder ? voc_path : path, path, want, what);
    unlink(path);
}

static void test_bad_files(const char *enc_path, const char *voc_path) {
    Err e;
    size_t enc_n = 0, voc_n = 0, n;
    char *enc = read_file(enc_path, &enc_n, &e);
    char *voc = read_file(voc_path, &voc_n, &e);
    char dir[] = "/tmp/kvlab_test_bpe_XXXXXX";
    int ok = enc && voc && mkdtemp(dir);
    CHECK(ok, "setup for bad-file tests");
    if (!ok) goto done;

    damaged(dir, "enc_trunc.json", enc, enc_n / 2, 1, enc_path, voc_path, "not valid JSON", "truncated encoder.json");
    const char *small = "{\"a\": 0, \"b\": 1}";
    damaged(dir, "enc_small.json", small, strlen(small), 1, enc_path, voc_path, "50257 entries", "encoder.json with 2 entries");
    char *bad = replace_first(enc, enc_n, "\"!\": 0,", "\"!\": 1,", &n); /* id 1 twice, id 0 unused */
    damaged(dir, "enc_dup.json", bad, n, 1, enc_path, voc_path, "id 1 is used by both", "encoder.json with a duplicate id");
    free(bad);
    bad = replace_first(enc, enc_n, "\"!\": 0,", "\"!\": \"0\",", &n);
    damaged(dir, "enc_str.json", bad, n, 1, enc_path, voc_path, "not a number", "encoder.json with a string id");
    free(bad);
    bad = replace_first(enc, enc_n, "\"!\": 0,", "\"!\\u0001\": 0,", &n);
    damaged(dir, "enc_sym.json", bad, n, 1, enc_path, voc_path, "byte alphabet", "encoder.json with a non-alphabet token");
    free(bad);

    /* cut at a line boundary halfway: every line is fine but merges are missing */
    size_t cut = (size_t)((char *)memchr(voc + voc_n / 2, '\n', voc_n / 2) - voc) + 1;
    damaged(dir, "voc_trunc.bpe", voc, cut, 0, enc_path, voc_path, "expected 50000", "vocab.bpe cut at a line boundary");
    damaged(dir, "voc_cut.bpe", voc, cut - 3, 0, enc_path, voc_path, "line", "vocab.bpe cut mid-line");
    bad = replace_first(voc, voc_n, "#version: 0.2\n", "", &n);
    damaged(dir, "voc_nover.bpe", bad, n, 0, enc_path, voc_path, "#version", "vocab.bpe without #version");
    free(bad);
    bad = replace_first(voc, voc_n, "\n\xc4\xa0 t\n", "\n\xc4\xa0t\n", &n); /* line 2 "Ġ t" -> "Ġt" */
    damaged(dir, "voc_nosep.bpe", bad, n, 0, enc_path, voc_path, "line 2: expected two symbols", "vocab.bpe line without a space");
    free(bad);
    bad = replace_first(voc, voc_n, "\n\xc4\xa0 t\n", "\n\xc4\xa0 t\x01\n", &n); /* a control byte is not in the alphabet */
    damaged(dir, "voc_sym.bpe", bad, n, 0, enc_path, voc_path, "not in encoder.json", "vocab.bpe with an unknown symbol");
    free(bad);
    bad = replace_first(voc, voc_n, "\n\xc4\xa0 a\n", "\n\xc4\xa0 t\n", &n); /* line 3 repeats line 2 */
    damaged(dir, "voc_rep.bpe", bad, n, 0, enc_path, voc_path, "repeats line 2", "vocab.bpe with a repeated merge");
    free(bad);

    expect_load_error("/nonexistent/encoder.json", voc_path, "/nonexistent/encoder.json", "cannot open", "missing encoder.json");
    expect_load_error(enc_path, "/nonexistent/vocab.bpe", "/nonexistent/vocab.bpe", "cannot open", "missing vocab.bpe");
    rmdir(dir);
done:
    free(enc);
    free(voc);
}

int main(void) {
    const char *dir = env_or("KVLAB_BPE_DIR", "/work/shared/data/gpt2-bpe");
    const char *shakespeare = env_or("KVLAB_SHAKESPEARE", "/work/shared/data/tinyshakespeare/input.txt");
    char enc[4096], voc[4096];
    snprintf(enc, sizeof enc, "%s/encoder.json", dir);
    snprintf(voc, sizeof voc, "%s/vocab.bpe", dir);
    if (!file_exists(enc) || !file_exists(voc)) {
        printf("SKIP all BPE tests: %s or %s not found (set KVLAB_BPE_DIR or run the data script)\n", enc, voc);
        return TEST_SUMMARY("test_bpe");
    }
    Err e;
    double t0 = wall_seconds();
    Bpe *b = bpe_load(enc, voc, &e);
    CHECK(b != NULL, "bpe_load: %s", e.msg);
    if (!b) return TEST_SUMMARY("test_bpe");
    printf("loaded GPT-2 BPE in %.3f s\n", wall_seconds() - t0);
    test_known_vector(b);
    const char *fixture = "tests/data/bpe_cases.json";
    char *json = read_file(fixture, NULL, &e);
    cJSON *root = json ? cJSON_Parse(json) : NULL;
    CHECK(root != NULL, "%s: missing or not JSON (run from the repository root)", fixture);
    free(json);
    if (root) {
        test_reference_cases(b, root);
        test_shakespeare(b, shakespeare, root);
    }
    cJSON_Delete(root);
    test_random_bytes(b);
    test_bad_ids(b);
    bpe_free(b);
    test_bad_files(enc, voc);
    return TEST_SUMMARY("test_bpe");
}
