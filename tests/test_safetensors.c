/* Tests for lib/safetensors: round trip, one crafted file per validation rule
 * of formats.md 1.3, truncation at every length, a mutation fuzz, atomic
 * writes, and an independent numpy reader (tests/safetensors_numpy_check.py).
 * Also the per-tensor checksums of kvlab checkpoints (train/checkpoint.c).
 * Run from the repository root. */
#define _GNU_SOURCE
#include "safetensors.h"
#include "checkpoint.h"
#include "test.h"

#include <dirent.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char tmpdir[] = "/tmp/kvlab_test_st_XXXXXX";

/* Rotates over a few buffers so that a caller can hold two paths at once. */
static const char *tmp_path(const char *name) {
    static char buf[4][512]; /* a folder name plus any file name fits */
    static int next;
    char *p = buf[next++ % 4];
    snprintf(p, sizeof buf[0], "%s/%s", tmpdir, name);
    return p;
}

static void write_bytes(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f || (n && fwrite(data, 1, n, f) != n) || fclose(f) != 0) FATAL("cannot write %s", path);
}

/* A file made of: u64 LE hlen, hlen header bytes (no padding added), data_len zero bytes. */
static void write_raw(const char *path, const char *header, size_t hlen, size_t data_len) {
    size_t n = 8 + hlen + data_len;
    unsigned char *b = xcalloc(n, 1);
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)((uint64_t)hlen >> (8 * i));
    memcpy(b + 8, header, hlen);
    write_bytes(path, b, n);
    free(b);
}

/* "<path>: <problem> (hint: <what to do>)" on one line. */
static int well_formed(const char *msg, const char *path) {
    size_t lp = strlen(path), lm = strlen(msg);
    return strncmp(msg, path, lp) == 0 && strncmp(msg + lp, ": ", 2) == 0 && strstr(msg, " (hint: ") &&
           lm > 0 && msg[lm - 1] == ')' && !strchr(msg, '\n');
}

static int count_temp_files(void) {
    DIR *d = opendir(tmpdir);
    int n = 0;
    for (struct dirent *de; d && (de = readdir(d));) n += strstr(de->d_name, ".tmp.") != NULL;
    if (d) closedir(d);
    return n;
}

/* Opens path expecting a rejection whose message contains w1 and w2 (if given). */
static void expect_open_fails(const char *what, const char *path, const char *w1, const char *w2) {
    Err e = {{0}};
    StFile *f = st_open(path, &e);
    CHECK(f == NULL, "%s: st_open accepted a bad file", what);
    st_close(f);
    CHECK(strstr(e.msg, w1) && (!w2 || strstr(e.msg, w2)), "%s: message lacks '%s'/'%s': %s", what, w1, w2 ? w2 : "",
          e.msg);
    CHECK(well_formed(e.msg, path), "%s: malformed message: %s", what, e.msg);
}

static uint16_t bf16_of(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return (uint16_t)(u >> 16); /* the test values are exact in bf16 */
}

static float f32_of_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* ---------------------------------------------------------------- round trip */

#define RT_N 8
static float rt_w[6], rt_scalar = 3.25f;
static int32_t rt_idx[5];
static uint8_t rt_u8[7];
static uint16_t rt_bf16[3];
static double rt_f64[2] = {3.141592653589793, -1e300};
static int8_t rt_i8[1] = {-5};

/* Deliberately not in the order the writer must produce. */
static void make_round_trip(StTensorIn *t, StMeta *m) {
    const float bf[3] = {1.0f, -2.5f, 0.15625f};
    for (int i = 0; i < 6; i++) rt_w[i] = 0.5f * (float)i - 1.0f;
    for (int i = 0; i < 5; i++) rt_idx[i] = i * 1000003 - 7;
    for (int i = 0; i < 7; i++) rt_u8[i] = (uint8_t)(3 * i + 1);
    for (int i = 0; i < 3; i++) rt_bf16[i] = bf16_of(bf[i]);
    StTensorIn in[RT_N] = {
        {"bytes", ST_U8, 1, {7}, rt_u8},
        {"w", ST_F32, 2, {2, 3}, rt_w},
        {"half", ST_BF16, 1, {3}, rt_bf16},
        {"scalar", ST_F32, 0, {0}, &rt_scalar},
        {"empty", ST_F32, 2, {0, 4}, NULL},
        {"idx", ST_I32, 1, {5}, rt_idx},
        {"d", ST_F64, 1, {2}, rt_f64},
        {"blocks.0.i8", ST_I8, 1, {1}, rt_i8},
    };
    StMeta meta[4] = {
        {"format_version", "1"},
        {"note", "quote \" backslash \\ newline \n tab \t ctrl \x01 utf8 \xc3\xa9\xe2\x82\xac"},
        {"config", "{\"d\":384,\"L\":6}"},
        {"empty", ""},
    };
    memcpy(t, in, sizeof in);
    memcpy(m, meta, sizeof meta);
}

static void test_round_trip(void) {
    StTensorIn in[RT_N];
    StMeta meta[4];
    make_round_trip(in, meta);
    const char *path = tmp_path("rt.safetensors");
    Err e = {{0}};
    CHECK(st_save(path, in, RT_N, meta, 4, &e) == 0, "st_save: %s", e.msg);
    StFile *f = st_open(path, &e);
    CHECK(f != NULL, "st_open: %s", e.msg);
    if (!f) return;
    CHECK(strcmp(st_path(f), path) == 0, "st_path");
    CHECK(st_count(f) == RT_N, "count %d", st_count(f));
    for (int i = 0; i < RT_N; i++) {
        const StTensorInfo *t = st_find(f, in[i].name);
        CHECK(t != NULL, "tensor %s missing", in[i].name);
        if (!t) continue;
        CHECK(strcmp(t->name, in[i].name) == 0 && t->dtype == in[i].dtype && t->ndim == in[i].ndim, "%s: dtype/ndim",
              in[i].name);
        size_t numel = 1;
        for (int k = 0; k < in[i].ndim; k++) {
            CHECK(t->shape[k] == in[i].shape[k], "%s: shape[%d]", in[i].name, k);
            numel *= (size_t)in[i].shape[k];
        }
        CHECK(t->numel == numel, "%s: numel %zu vs %zu", in[i].name, t->numel, numel);
        size_t bytes = numel * st_dtype_size(in[i].dtype);
        CHECK(t->end - t->begin == bytes, "%s: byte size", in[i].name);
        unsigned char *buf = xmalloc(bytes);
        CHECK(st_read(f, t, buf, bytes, &e) == 0, "st_read %s: %s", in[i].name, e.msg);
        CHECK(bytes == 0 || memcmp(buf, in[i].data, bytes) == 0, "%s: bytes differ", in[i].name);
        free(buf);
    }
    CHECK(f32_of_bf16(rt_bf16[1]) == -2.5f, "bf16 helper");
    CHECK(st_find(f, "nope") == NULL && st_get(f, -1) == NULL && st_get(f, RT_N) == NULL, "out-of-range lookups");

    /* Metadata in file order, values exact (escapes, UTF-8, empty). */
    CHECK(st_meta_count(f) == 4, "meta count %d", st_meta_count(f));
    for (int i = 0; i < 4; i++) {
        const char *k = st_meta_key(f, i), *v = st_meta(f, meta[i].key);
        CHECK(k && strcmp(k, meta[i].key) == 0, "meta key %d", i);
        CHECK(v && strcmp(v, meta[i].value) == 0, "meta value %s", meta[i].key);
    }
    CHECK(st_meta(f, "absent") == NULL && st_meta_key(f, 4) == NULL, "absent metadata");

    /* Layout: N % 8 == 0, order by decreasing element size then name, natural alignment. */
    size_t fsize;
    unsigned char *raw = (unsigned char *)read_file(path, &fsize, &e);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = (n << 8) | raw[i];
    free(raw);
    CHECK(n % 8 == 0, "header length %llu not a multiple of 8", (unsigned long long)n);
    for (int i = 0; i < st_count(f); i++) {
        const StTensorInfo *t = st_get(f, i);
        size_t es = st_dtype_size(t->dtype);
        CHECK((8 + n + t->begin) % es == 0, "%s at file offset %llu not aligned to %zu", t->name,
              (unsigned long long)(8 + n + t->begin), es);
        if (i == 0) continue;
        const StTensorInfo *p = st_get(f, i - 1);
        size_t ps = st_dtype_size(p->dtype);
        CHECK(p->end == t->begin, "file order by begin");
        CHECK(ps > es || (ps == es && strcmp(p->name, t->name) < 0), "order: %s before %s", p->name, t->name);
    }
    CHECK(8 + n + st_get(f, RT_N - 1)->end == fsize, "file size");

    /* st_read_f32: success and each kind of mismatch, naming tensor, expectation and file's version. */
    float w[6];
    const int64_t s23[2] = {2, 3}, s32[2] = {3, 2}, s5[1] = {5};
    CHECK(st_read_f32(f, "w", 2, s23, w, &e) == 0 && memcmp(w, rt_w, sizeof w) == 0, "st_read_f32 w: %s", e.msg);
    float sc = 0;
    CHECK(st_read_f32(f, "scalar", 0, NULL, &sc, &e) == 0 && sc == 3.25f, "st_read_f32 scalar: %s", e.msg);
    CHECK(st_read_f32(f, "w", 2, s32, w, &e) != 0 && strstr(e.msg, "'w'") && strstr(e.msg, "[3, 2]") &&
              strstr(e.msg, "[2, 3]") && well_formed(e.msg, path),
          "wrong shape message: %s", e.msg);
    CHECK(st_read_f32(f, "idx", 1, s5, w, &e) != 0 && strstr(e.msg, "'idx'") && strstr(e.msg, "F32") &&
              strstr(e.msg, "I32") && well_formed(e.msg, path),
          "wrong dtype message: %s", e.msg);
    CHECK(st_read_f32(f, "nope", 1, s5, w, &e) != 0 && strstr(e.msg, "'nope'") && strstr(e.msg, "not found"),
          "missing tensor message: %s", e.msg);
    CHECK(st_read(f, st_find(f, "w"), w, 20, &e) != 0 && strstr(e.msg, "24 bytes"), "wrong buffer size: %s", e.msg);
    CHECK(st_read(f, NULL, w, 4, &e) != 0 && well_formed(e.msg, path), "NULL tensor: %s", e.msg);
    st_close(f);
}

/* Valid files another writer could produce: no padding, unaligned and
 * unordered tensors, whitespace, escaped key, no tensors at all. */
static void test_foreign_files(void) {
    const char *path = tmp_path("foreign.safetensors");
    const char *h = "{\n  \"b\": {\"dtype\": \"U8\", \"shape\": [3], \"data_offsets\": [0, 3]},\n"
                    "  \"a\": {\"data_offsets\": [3, 11], \"shape\": [2], \"dtype\": \"F32\"},\n"
                    "\t\"z\" : {\"dtype\":\"F32\",\"shape\":[2, 0],\"data_offsets\":[11,11]},\r\n"
                    "  \"\\u0063\": {\"dtype\":\"U8\",\"shape\":[],\"data_offsets\":[11,12]} }";
    size_t hl = strlen(h);
    unsigned char *b = xcalloc(8 + hl + 12, 1);
    b[0] = (unsigned char)hl;
    memcpy(b + 8, h, hl);
    const float a[2] = {1.5f, -2.0f};
    b[8 + hl] = 1, b[8 + hl + 1] = 2, b[8 + hl + 2] = 3;
    memcpy(b + 8 + hl + 3, a, 8);
    b[8 + hl + 11] = 9;
    write_bytes(path, b, 8 + hl + 12);
    free(b);

    Err e = {{0}};
    StFile *f = st_open(path, &e);
    CHECK(f != NULL, "foreign file: %s", e.msg);
    if (!f) return;
    CHECK(st_count(f) == 4 && strcmp(st_get(f, 0)->name, "b") == 0 && strcmp(st_get(f, 1)->name, "a") == 0,
          "foreign order");
    const int64_t s2[1] = {2};
    float got[2] = {0, 0};
    CHECK(st_read_f32(f, "a", 1, s2, got, &e) == 0 && got[0] == 1.5f && got[1] == -2.0f, "unaligned read: %s", e.msg);
    const StTensorInfo *c = st_find(f, "c");
    uint8_t cv = 0;
    CHECK(c && c->ndim == 0 && c->numel == 1 && st_read(f, c, &cv, 1, &e) == 0 && cv == 9, "escaped key / scalar");
    const StTensorInfo *z = st_find(f, "z");
    CHECK(z && z->numel == 0 && st_read(f, z, NULL, 0, &e) == 0, "empty tensor read: %s", e.msg);
    CHECK(st_meta_count(f) == 0 && st_meta(f, "x") == NULL, "no metadata");
    st_close(f);

    write_raw(path, "{}", 2, 0);
    f = st_open(path, &e);
    CHECK(f && st_count(f) == 0, "empty file list: %s", e.msg);
    st_close(f);
    const char *m = "{\"__metadata__\":{\"k\":\"v\"}}      ";
    write_raw(path, m, strlen(m), 0);
    f = st_open(path, &e);
    CHECK(f && st_count(f) == 0 && st_meta(f, "k") && strcmp(st_meta(f, "k"), "v") == 0, "metadata only: %s", e.msg);
    st_close(f);
}

/* ---------------------------------------------------------------- bad files */

#define T1(body) "{\"a\":{" body "}}"
#define OK_A "\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]"

static const struct {
    const char *what, *header;
    size_t data;
    const char *w1, *w2;
} bad_headers[] = {
    {"empty header", "", 0, "not a safetensors file", "empty"},
    {"array header", "[1,2]", 0, "not a safetensors file", "'{'"},
    {"leading space", " {}", 0, "does not start with '{'", "object"},
    {"not JSON", "{\"a\": }", 0, "not valid JSON", NULL},
    {"unterminated", "{\"a\"", 0, "not valid JSON", NULL},
    {"trailing garbage", "{}x", 0, "trailing", NULL},
    {"trailing newline", "{}\n", 0, "trailing", NULL},
    {"two objects", "{}{}", 0, "trailing", NULL},
    {"invalid UTF-8", "{\"__metadata__\":{\"a\":\"\xff\"}}", 0, "UTF-8", NULL},
    {"overlong UTF-8", "{\"__metadata__\":{\"a\":\"\xc0\xaf\"}}", 0, "UTF-8", NULL},
    {"surrogate UTF-8", "{\"__metadata__\":{\"a\":\"\xed\xa0\x80\"}}", 0, "UTF-8", NULL},
    {"cut UTF-8", "{\"__metadata__\":{\"a\":\"\xe2\x82\"}}", 0, "UTF-8", NULL},
    {"raw newline in string", "{\"__metadata__\":{\"a\":\"x\ny\"}}", 0, "control character", "string"},
    {"control byte", "{\x01}", 0, "control character", "0x01"},
    {"escaped NUL", "{\"__metadata__\":{\"a\":\"x\\u0000y\"}}", 0, "NUL", NULL},
    {"duplicate tensor", "{\"a\":{" OK_A "},\"a\":{" OK_A "}}", 4, "duplicate", "'a'"},
    {"duplicate escaped", "{\"a\":{" OK_A "},\"\\u0061\":{" OK_A "}}", 4, "duplicate", "'a'"},
    {"duplicate metadata key", "{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}}", 0, "__metadata__", "duplicate key 'k'"},
    {"duplicate __metadata__", "{\"__metadata__\":{},\"__metadata__\":{}}", 0, "duplicate", "__metadata__"},
    {"duplicate field", T1("\"dtype\":\"F32\"," OK_A), 4, "duplicate key 'dtype'", "'a'"},
    {"metadata not object", "{\"__metadata__\":\"x\"}", 0, "__metadata__", "not an object"},
    {"metadata value number", "{\"__metadata__\":{\"step\":5}}", 0, "'step'", "not a string"},
    {"metadata value object", "{\"__metadata__\":{\"cfg\":{\"d\":1}}}", 0, "'cfg'", "not a string"},
    {"unknown dtype", T1("\"dtype\":\"F31\",\"shape\":[1],\"data_offsets\":[0,4]"), 4, "unknown dtype", "F31"},
    {"unsupported dtype", T1("\"dtype\":\"C64\",\"shape\":[1],\"data_offsets\":[0,8]"), 8, "not supported", "C64"},
    {"dtype not string", T1("\"dtype\":11,\"shape\":[1],\"data_offsets\":[0,4]"), 4, "dtype", "not a string"},
    {"negative shape", T1("\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]"), 4, "negative", "field 'shape'"},
    {"fraction", T1("\"dtype\":\"F32\",\"shape\":[1.5],\"data_offsets\":[0,4]"), 4, "fraction", "tensor 'a'"},
    {"integral fraction", T1("\"dtype\":\"F32\",\"shape\":[1.0],\"data_offsets\":[0,4]"), 4, "fraction", "1.0"},
    {"exponent", T1("\"dtype\":\"F32\",\"shape\":[1e0],\"data_offsets\":[0,4]"), 4, "exponent", NULL},
    {"exponent offset", T1("\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4E+0]"), 4, "exponent",
     "field 'data_offsets'"},
    {"leading zero", T1("\"dtype\":\"F32\",\"shape\":[01],\"data_offsets\":[0,4]"), 4, "leading zero", NULL},
    {"over 2^53", T1("\"dtype\":\"U8\",\"shape\":[9007199254740993],\"data_offsets\":[0,4]"), 4, "2^53", NULL},
    {"negative zero offset", T1("\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-0,4]"), 4, "negative",
     "data_offsets"},
    {"metadata number", "{\"__metadata__\":{\"step\":-5}}", 0, "negative", "'step'"},
    {"shape not array", T1("\"dtype\":\"F32\",\"shape\":4,\"data_offsets\":[0,16]"), 16, "shape is not an array", NULL},
    {"shape entry string", T1("\"dtype\":\"F32\",\"shape\":[\"1\"],\"data_offsets\":[0,4]"), 4, "shape entry 0",
     NULL},
    {"too many dims", T1("\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,4]"), 4, "9 dimensions",
     NULL},
    {"element count overflow", T1("\"dtype\":\"U8\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,4]"), 4,
     "element count", "overflows"},
    {"byte size overflow", T1("\"dtype\":\"F64\",\"shape\":[4294967296,1073741824],\"data_offsets\":[0,4]"), 4,
     "byte size", "overflows"},
    {"offsets mismatch", T1("\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]"), 4, "does not match", "8 bytes"},
    {"begin after end", T1("\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[4,0]"), 4, "after end", NULL},
    {"one offset", T1("\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4]"), 4, "exactly 2", NULL},
    {"three offsets", T1("\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,8]"), 4, "exactly 2", NULL},
    {"string offsets", T1("\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[\"0\",\"4\"]"), 4, "exactly 2", NULL},
    {"overlap",
     "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
     "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
     12, "overlap", "'b'"},
    {"hole between",
     "{\"a\":{" OK_A "},\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}", 12, "hole", "4 unused bytes"},
    {"hole at start", T1("\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]"), 8, "hole", "not 0"},
    {"buffer not covered", T1(OK_A), 8, "not covered", "last 4 bytes"},
    {"data without tensors", "{}", 4, "not covered", NULL},
    {"truncated data", T1("\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]"), 4, "truncated", "cut short"},
    {"unknown field", T1(OK_A ",\"foo\":1"), 4, "unknown field 'foo'", "tensor 'a'"},
    {"missing field", T1("\"dtype\":\"F32\",\"shape\":[1]"), 4, "missing", "data_offsets"},
    {"entry not object", "{\"a\":[1]}", 0, "'a'", "not an object"},
    {"empty name", "{\"\":{" OK_A "}}", 4, "empty name", NULL},
};

static void test_bad_files(void) {
    const char *path = tmp_path("bad.safetensors");
    int nbad = (int)(sizeof bad_headers / sizeof *bad_headers);
    for (int i = 0; i < nbad; i++) {
        write_raw(path, bad_headers[i].header, strlen(bad_headers[i].header), bad_headers[i].data);
        expect_open_fails(bad_headers[i].what, path, bad_headers[i].w1, bad_headers[i].w2);
    }

    /* Byte-level cases the table cannot express. */
    write_bytes(path, "", 0);
    expect_open_fails("empty file", path, "too short", "0 bytes");
    write_bytes(path, "\x08\0\0\0\0", 5);
    expect_open_fails("5-byte file", path, "too short", "cut short");
    unsigned char hdr[16] = {0x01, 0xe1, 0xf5, 0x05}; /* 100,000,001 */
    write_bytes(path, hdr, 16);
    expect_open_fails("absurd header length", path, "not a safetensors file", "absurd");
    memset(hdr, 0xff, 8); /* 2^64-1: 8 + N would overflow */
    write_bytes(path, hdr, 16);
    expect_open_fails("maximal header length", path, "not a safetensors file", "absurd");
    write_raw(path, "{}", 2, 0);
    if (truncate(path, 9) != 0) FATAL("cannot truncate %s", path);
    expect_open_fails("truncated header", path, "truncated", "declares 2 bytes");
    write_raw(path, "{\0}", 3, 0);
    expect_open_fails("NUL in header", path, "control character", "0x00");

    /* Deep nesting must fail cleanly, not overflow the stack. */
    size_t depth = 100000;
    char *deep = xmalloc(depth + 8);
    memcpy(deep, "{\"a\":", 5);
    memset(deep + 5, '[', depth);
    write_raw(path, deep, depth + 5, 0);
    free(deep);
    expect_open_fails("deep nesting", path, "not valid JSON", NULL);

    Err e = {{0}};
    StFile *f = st_open(tmp_path("does-not-exist"), &e);
    CHECK(!f && strstr(e.msg, "cannot open"), "missing file: %s", e.msg);
    f = st_open(tmpdir, &e);
    CHECK(!f && strstr(e.msg, "not a regular file"), "folder: %s", e.msg);
}

/* Every proper prefix of a valid file is rejected. */
static void test_truncation(void) {
    const char *full = tmp_path("rt.safetensors"), *path = tmp_path("trunc.safetensors");
    Err e = {{0}};
    size_t n;
    char *data = read_file(full, &n, &e);
    CHECK(data != NULL, "%s", e.msg);
    if (!data) return;
    int wrong = 0, first_bad = -1;
    for (size_t len = 0; len < n; len++) {
        write_bytes(path, data, len);
        StFile *f = st_open(path, &e);
        const char *word = len < 8 ? "too short" : "truncated";
        if (f || !strstr(e.msg, word) || !well_formed(e.msg, path)) {
            if (first_bad < 0) first_bad = (int)len, printf("  length %zu: %s\n", len, f ? "accepted" : e.msg);
            wrong++;
        }
        st_close(f);
    }
    CHECK(wrong == 0, "%d of %zu prefixes not rejected as truncated (first at length %d)", wrong, n, first_bad);
    free(data);
}

/* ---------------------------------------------------------------- fuzz */

static uint64_t rng_state = 0x9e3779b97f4a7c15ULL;
static uint32_t rng(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 32);
}

static void test_fuzz(void) {
    const char *full = tmp_path("rt.safetensors"), *path = tmp_path("fuzz.safetensors");
    static const char interesting[] = "{}[]\":,0123456789-.eE \\u\xff\x00\n";
    Err e = {{0}};
    size_t n;
    char *base = read_file(full, &n, &e);
    CHECK(base != NULL, "%s", e.msg);
    if (!base) return;
    char *buf = xmalloc(n + 16);
    int opened = 0, rejected = 0, read_fail = 0, bad_msg = 0;
    for (int iter = 0; iter < 4000; iter++) {
        size_t len = n;
        memcpy(buf, base, n);
        int nmut = 1 + (int)(rng() % 4);
        for (int m = 0; m < nmut; m++) {
            size_t pos = rng() % len;
            char c = interesting[rng() % (sizeof interesting - 1)];
            switch (rng() % 5) {
            case 0: buf[pos] ^= (char)(1u << (rng() % 8)); break;
            case 1: buf[pos] = c; break;
            case 2: memmove(buf + pos + 1, buf + pos, len - pos), buf[pos] = c, len++; break;
            case 3: if (len > 1) memmove(buf + pos, buf + pos + 1, len - pos - 1), len--; break;
            default: buf[0] = (char)(buf[0] + (int)(rng() % 17) - 8); break; /* header length off by a little */
            }
        }
        write_bytes(path, buf, len);
        StFile *f = st_open(path, &e);
        if (!f) {
            rejected++;
            if (!well_formed(e.msg, path) && bad_msg++ == 0) printf("  iteration %d: %s\n", iter, e.msg);
            continue;
        }
        opened++;
        for (int i = 0; i < st_count(f); i++) {
            const StTensorInfo *t = st_get(f, i);
            size_t bytes = (size_t)(t->end - t->begin);
            void *dst = xmalloc(bytes);
            if (st_read(f, t, dst, bytes, &e) != 0 || st_find(f, t->name) != t) {
                if (read_fail++ == 0) printf("  iteration %d: %s\n", iter, e.msg);
            }
            free(dst);
        }
        st_close(f);
    }
    printf("  fuzz: %d opened, %d rejected\n", opened, rejected);
    CHECK(opened > 0 && rejected > 0, "fuzz should produce both outcomes");
    CHECK(read_fail == 0, "%d reads failed on files st_open accepted", read_fail);
    CHECK(bad_msg == 0, "%d malformed error messages", bad_msg);
    free(buf);
    free(base);
}

/* ---------------------------------------------------------------- writing */

static void test_save_rejects(void) {
    const char *path = tmp_path("rejected.safetensors");
    float x[4] = {0};
    const struct {
        const char *what;
        StTensorIn t[2];
        int nt;
        StMeta m[2];
        int nm;
        const char *w1, *w2;
    } cases[] = {
        {"dash in name", {{"a-b", ST_F32, 1, {1}, x}}, 1, {{0}}, 0, "invalid tensor name", "'a-b'"},
        {"empty name", {{"", ST_F32, 1, {1}, x}}, 1, {{0}}, 0, "invalid tensor name", NULL},
        {"reserved name", {{"__metadata__", ST_F32, 1, {1}, x}}, 1, {{0}}, 0, "invalid tensor name", "__metadata__"},
        {"duplicate name", {{"x", ST_F32, 1, {1}, x}, {"x", ST_U8, 1, {1}, x}}, 2, {{0}}, 0, "duplicate tensor name",
         "'x'"},
        {"bad dtype", {{"x", ST_NDTYPES, 1, {1}, x}}, 1, {{0}}, 0, "invalid dtype", "'x'"},
        {"too many dims", {{"x", ST_F32, 9, {1}, x}}, 1, {{0}}, 0, "9 dimensions", "'x'"},
        {"negative dim", {{"x", ST_F32, 2, {2, -1}, x}}, 1, {{0}}, 0, "shape [2, -1]", "'x'"},
        {"no data", {{"x", ST_F32, 1, {4}, NULL}}, 1, {{0}}, 0, "no data pointer", "'x'"},
        {"duplicate meta", {{"x", ST_F32, 1, {1}, x}}, 1, {{"k", "1"}, {"k", "2"}}, 2, "duplicate metadata key", "'k'"},
        {"bad UTF-8 meta", {{"x", ST_F32, 1, {1}, x}}, 1, {{"k", "\xff"}}, 1, "UTF-8", NULL},
        {"NULL meta value", {{"x", ST_F32, 1, {1}, x}}, 1, {{"k", NULL}}, 1, "NULL", NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        Err e = {{0}};
        int rc = st_save(path, cases[i].t, cases[i].nt, cases[i].m, cases[i].nm, &e);
        CHECK(rc != 0, "%s: st_save accepted", cases[i].what);
        CHECK(strstr(e.msg, cases[i].w1) && (!cases[i].w2 || strstr(e.msg, cases[i].w2)) && well_formed(e.msg, path),
              "%s: message: %s", cases[i].what, e.msg);
        CHECK(!file_exists(path) && count_temp_files() == 0, "%s: a file was created", cases[i].what);
    }
}

static void test_atomic(void) {
    const char *path = tmp_path("atomic.safetensors");
    float old[4] = {1, 2, 3, 4};
    uint8_t nw[2] = {7, 8};
    StTensorIn t_old = {"old", ST_F32, 1, {4}, old}, t_new = {"new", ST_U8, 1, {2}, nw};
    Err e = {{0}};

    char missing[300];
    snprintf(missing, sizeof missing, "%s/no-such-folder/x.safetensors", tmpdir);
    CHECK(st_save(missing, &t_old, 1, NULL, 0, &e) != 0 && strstr(e.msg, "no-such-folder") && strstr(e.msg, "hint"),
          "save into a missing folder: %s", e.msg);
    CHECK(count_temp_files() == 0, "temp file left behind");

    /* Saving over an existing file replaces it. */
    CHECK(st_save(path, &t_old, 1, NULL, 0, &e) == 0, "%s", e.msg);
    CHECK(st_save(path, &t_new, 1, NULL, 0, &e) == 0, "%s", e.msg);
    StFile *f = st_open(path, &e);
    uint8_t got[2] = {0, 0};
    CHECK(f && st_count(f) == 1 && !st_find(f, "old") && st_find(f, "new") &&
              st_read(f, st_find(f, "new"), got, 2, &e) == 0 && got[1] == 8,
          "replaced file: %s", e.msg);
    st_close(f);

    /* A write failing midway (file size limit, like a full disk) leaves the
     * old file intact and no temporary file. */
    size_t big_n = 1 << 18;
    float *big = xcalloc(big_n, sizeof(float));
    StTensorIn t_big = {"big", ST_F32, 1, {(int64_t)big_n}, big};
    struct rlimit saved, lim;
    getrlimit(RLIMIT_FSIZE, &saved);
    lim = saved;
    lim.rlim_cur = 65536;
    void (*old_handler)(int) = signal(SIGXFSZ, SIG_IGN);
    setrlimit(RLIMIT_FSIZE, &lim);
    int rc = st_save(path, &t_big, 1, NULL, 0, &e);
    setrlimit(RLIMIT_FSIZE, &saved);
    signal(SIGXFSZ, old_handler);
    free(big);
    CHECK(rc != 0 && strstr(e.msg, "failed"), "write past the size limit should fail: %s", e.msg);
    CHECK(count_temp_files() == 0, "temp file left behind after a failed write");
    f = st_open(path, &e);
    CHECK(f && st_find(f, "new") && !st_find(f, "big"), "old file damaged: %s", e.msg);
    st_close(f);

    /* st_read notices a file truncated after st_open. */
    CHECK(st_save(path, &t_old, 1, NULL, 0, &e) == 0, "%s", e.msg);
    f = st_open(path, &e);
    CHECK(f != NULL, "%s", e.msg);
    if (!f) return;
    struct stat sb;
    stat(path, &sb);
    if (truncate(path, sb.st_size - 2) != 0) FATAL("cannot truncate %s", path);
    float buf[4];
    CHECK(st_read(f, st_find(f, "old"), buf, sizeof buf, &e) != 0 && strstr(e.msg, "truncated") &&
              strstr(e.msg, "'old'") && well_formed(e.msg, path),
          "short read: %s", e.msg);
    st_close(f);
}

/* ---------------------------------------------------------------- numpy cross-check */

/* Must match the expectations in tests/safetensors_numpy_check.py. */
static void test_numpy(void) {
    const char *script = "tests/safetensors_numpy_check.py";
    if (!file_exists(script)) {
        CHECK(0, "%s not found: run the tests from the repository root", script);
        return;
    }
    if (system("/usr/bin/python3 -c 'import numpy' >/dev/null 2>&1") != 0) {
        printf("  skip: numpy cross-check (/usr/bin/python3 with numpy not available)\n");
        return;
    }
    float f32[12], bf_vals[4] = {1.0f, -2.5f, 0.15625f, 65536.0f};
    int32_t i32[5];
    uint8_t u8[300];
    uint16_t bf[4], f16[3] = {0x3c00, 0xb800, 0x6800}; /* 1.0, -0.5, 2048.0 */
    double pi = 3.141592653589793;
    int64_t i64[3] = {(1LL << 40) + 1, -(1LL << 53), 1LL << 62};
    for (int i = 0; i < 12; i++) f32[i] = 0.25f * (float)i - 1.5f;
    for (int i = 0; i < 5; i++) i32[i] = i * 1000003 - 7;
    for (int i = 0; i < 300; i++) u8[i] = (uint8_t)(i * 7);
    for (int i = 0; i < 4; i++) bf[i] = bf16_of(bf_vals[i]);
    StTensorIn t[] = {
        {"u8.ramp", ST_U8, 1, {300}, u8},        {"f32.ramp", ST_F32, 2, {3, 4}, f32},
        {"bf16.vals", ST_BF16, 1, {4}, bf},      {"f16.vals", ST_F16, 1, {3}, f16},
        {"f64.scalar", ST_F64, 0, {0}, &pi},     {"i64.big", ST_I64, 1, {3}, i64},
        {"i32.ramp", ST_I32, 1, {5}, i32},       {"empty", ST_F32, 2, {0, 3}, NULL},
    };
    StMeta m[2] = {{"format_version", "1"}, {"note", "quote \" backslash \\ newline \n \xc3\xa9"}};
    const char *path = tmp_path("numpy.safetensors");
    Err e = {{0}};
    CHECK(st_save(path, t, (int)(sizeof t / sizeof *t), m, 2, &e) == 0, "%s", e.msg);
    char cmd[512];
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s %s", script, path);
    fflush(stdout);
    int rc = system(cmd);
    CHECK(rc != -1 && WIFEXITED(rc) && WEXITSTATUS(rc) == 0, "numpy cross-check failed (status %d)", rc);
}

/* kvlab checkpoints carry a CRC-32 per tensor (metadata tensor_crc32): one
 * flipped data byte, in a parameter or an AdamW moment, is a one-line error
 * naming the file and the tensor; a damaged checksum table is an error too;
 * files without checksums (written before them) still load, unchecked. */
static void test_checkpoint_checksums(void) {
    ParamTable t = {0};
    param_add(&t, "blocks.0.attn.k.weight", 1, 2, 3, 4);
    param_add(&t, "lnf.bias", 0, 1, 5);
    size_t bytes = t.total * sizeof(float);
    /* the tensors' values; the alignment gap between them (nn/params.h) zero, as in a model's buffers */
    float *p = xcalloc(t.total, sizeof(float)), *m = xcalloc(t.total, sizeof(float)),
          *v = xcalloc(t.total, sizeof(float)), *got = xcalloc(3 * t.total, sizeof(float));
    CHECK(t.specs[1].offset == PARAM_ALIGN && t.total == PARAM_ALIGN + 5 && t.count == 17,
          "the second tensor starts at the next multiple of %d floats: offset %zu, %zu floats, %zu parameters",
          PARAM_ALIGN, t.specs[1].offset, t.total, t.count);
    for (int i = 0; i < t.n; i++)
        for (size_t k = t.specs[i].offset; k < t.specs[i].offset + t.specs[i].numel; k++)
            p[k] = 0.25f * (float)k - 1, m[k] = 1e-3f * (float)k, v[k] = 1.0f / (float)(k + 1);
    const char *path = tmp_path("state.safetensors"), *bad = tmp_path("flipped.safetensors");
    StMeta meta[] = {{"family", "test"}};
    Err e;
    CHECK(checkpoint_save(path, &t, p, m, v, meta, 1, &e) == 0, "checkpoint_save: %s", e.msg);
    StFile *f = checkpoint_open(path, "test", &e);
    CHECK(f && checkpoint_read(f, &t, got, got + t.total, got + 2 * t.total, &e) == 0 && !memcmp(got, p, bytes) &&
              !memcmp(got + t.total, m, bytes) && !memcmp(got + 2 * t.total, v, bytes),
          "a checkpoint with checksums reads back: %s", f ? e.msg : "not opened");
    int ntensors = f ? st_count(f) : 0;
    CHECK(f && ntensors == 6 && st_meta(f, CHECKPOINT_CRC_KEY) && strlen(st_meta(f, CHECKPOINT_CRC_KEY)) > 6 * 10,
          "metadata %s holds a checksum for each of the 6 tensors: %s", CHECKPOINT_CRC_KEY,
          f && st_meta(f, CHECKPOINT_CRC_KEY) ? st_meta(f, CHECKPOINT_CRC_KEY) : "(none)");
    size_t n;
    unsigned char *orig = (unsigned char *)read_file(path, &n, &e);
    uint64_t hlen = 0;
    for (int i = 0; orig && i < 8; i++) hlen |= (uint64_t)orig[i] << (8 * i);
    /* one flipped byte in the middle of each tensor in turn: parameters and optim.m/optim.v */
    for (int i = 0; orig && i < ntensors; i++) {
        const StTensorInfo *ti = st_get(f, i);
        size_t at = 8 + (size_t)hlen + (size_t)(ti->begin + ti->end) / 2;
        orig[at] ^= 0x01;
        write_bytes(bad, orig, n);
        orig[at] ^= 0x01;
        char quoted[128];
        snprintf(quoted, sizeof quoted, "'%s'", ti->name);
        StFile *g = checkpoint_open(bad, "test", &e);
        int rc = g ? checkpoint_read(g, &t, got, got + t.total, got + 2 * t.total, &e) : 0;
        CHECK(g && rc != 0 && well_formed(e.msg, bad) && strstr(e.msg, quoted) && strstr(e.msg, "checksum"),
              "a flipped byte in %s is reported naming the file and the tensor: %s", ti->name, g ? e.msg : "not opened");
        if (g) st_close(g);
    }
    /* a damaged checksum table: an error, not a silent unchecked load */
    StMeta damaged[] = {{"framework", "kvlab"}, {"format_version", CHECKPOINT_FORMAT_VERSION}, {"family", "test"},
                        {CHECKPOINT_CRC_KEY, "{\"lnf.bias\": \"00000000\""}};
    StTensorIn in[2] = {{.name = "blocks.0.attn.k.weight", .dtype = ST_F32, .ndim = 2, .shape = {3, 4}, .data = p},
                        {.name = "lnf.bias", .dtype = ST_F32, .ndim = 1, .shape = {5}, .data = p + t.specs[1].offset}};
    CHECK(st_save(bad, in, 2, damaged, 4, &e) == 0, "st_save: %s", e.msg);
    StFile *g = checkpoint_open(bad, "test", &e);
    CHECK(g && checkpoint_read(g, &t, got, NULL, NULL, &e) != 0 && well_formed(e.msg, bad) &&
              strstr(e.msg, CHECKPOINT_CRC_KEY),
          "a checksum table that is not JSON is reported: %s", g ? e.msg : "not opened");
    if (g) st_close(g);
    /* an older checkpoint (no checksums) loads, also with a flipped byte: nothing to check it against */
    p[1] = -p[1];
    CHECK(st_save(bad, in, 2, damaged, 3, &e) == 0, "st_save: %s", e.msg);
    g = checkpoint_open(bad, "test", &e);
    CHECK(g && !st_meta(g, CHECKPOINT_CRC_KEY) && checkpoint_read(g, &t, got, NULL, NULL, &e) == 0 &&
              !memcmp(got, p, bytes),
          "a checkpoint without checksums still loads: %s", g ? e.msg : "not opened");
    if (g) st_close(g);
    if (f) st_close(f);
    free(orig);
    free(p), free(m), free(v), free(got);
    param_table_free(&t);
}

static void remove_tmpdir(void) {
    DIR *d = opendir(tmpdir);
    for (struct dirent *de; d && (de = readdir(d));)
        if (strcmp(de->d_name, ".") && strcmp(de->d_name, "..")) unlink(tmp_path(de->d_name));
    if (d) closedir(d);
    rmdir(tmpdir);
}

/* An error about a path as long as the system allows, and one naming two such paths (a file and its folder):
 * the line keeps both in full and ends with its hint (until 2026-12-07 it was cut at 1024 bytes). */
static void test_long_path_errors(void) {
    char path[4096];
    size_t n = (size_t)snprintf(path, sizeof path, "%s/", tmpdir);
    for (; n < sizeof path - 16; n++) path[n] = n % 200 == 0 ? '/' : 'd';
    snprintf(path + n, sizeof path - n, ".safetensors");
    Err e;
    StFile *f = st_open(path, &e);
    size_t len = strlen(e.msg);
    CHECK(!f && strncmp(e.msg, path, strlen(path)) == 0 && len > strlen(path) &&
              strcmp(e.msg + len - strlen("(hint: check the path)"), "(hint: check the path)") == 0,
          "a %zu-character path stays whole in its error, the hint after it (%zu characters)", strlen(path), len);
    err_set(&e, "%s: mismatched, it belongs to %s (hint: move it away; %s)", path, path, "make FORCE=1 does it");
    len = strlen(e.msg);
    CHECK(len == 2 * strlen(path) + strlen(": mismatched, it belongs to  (hint: move it away; make FORCE=1 does it)") &&
              e.msg[len - 1] == ')',
          "two such paths in one error are kept whole, the hint after them (%zu characters)", len);
    /* a hint added to an error with its own goes into it: one "(hint: " per line */
    Err in, out;
    err_set(&in, "x.gz: truncated (hint: incomplete download; fetch it again)");
    err_with_hint(&out, &in, "scripts/get_data.sh mnist downloads it");
    CHECK(!strcmp(out.msg, "x.gz: truncated (hint: incomplete download; fetch it again; scripts/get_data.sh mnist "
                           "downloads it)"), "a second hint joins the first: %s", out.msg);
    err_set(&in, "x.gz: cannot open: No such file or directory");
    err_with_hint(&in, &in, "scripts/get_data.sh mnist downloads it");
    CHECK(!strcmp(in.msg, "x.gz: cannot open: No such file or directory (hint: scripts/get_data.sh mnist downloads it)"),
          "an error without a hint gets one, in place: %s", in.msg);
}

int main(void) {
    if (!mkdtemp(tmpdir)) FATAL("cannot create %s", tmpdir);
    test_long_path_errors();
    test_round_trip();
    test_foreign_files();
    test_bad_files();
    test_truncation();
    test_fuzz();
    test_save_rejects();
    test_atomic();
    test_numpy();
    test_checkpoint_checksums();
    remove_tmpdir();
    return TEST_SUMMARY("safetensors");
}
