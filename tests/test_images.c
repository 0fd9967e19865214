/* Image data set tests: IDX and CIFAR round trips through files written
 * here (IDX plain and gzipped), rejection of every kind of damaged or
 * mismatched file, channel statistics and ViT patch extraction against
 * hand-computed values. The real data sets are checked when present:
 * Fashion-MNIST from the Debian package dataset-fashion-mnist, and the MNIST
 * test set from $KVLAB_MNIST_DIR (default data/mnist); otherwise SKIP.
 * Run from the repository root. */
#define _GNU_SOURCE
#include <ftw.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>

#include "common.h"
#include "vit/images.h"
#include "test.h"

static char dir[] = "/tmp/kvlab_test_images_XXXXXX";

static int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st, (void)flag, (void)ftw;
    return remove(path);
}

static void tmp_path(char path[4096], const char *name) { snprintf(path, 4096, "%s/%s", dir, name); }

static void write_plain(const char *name, const void *data, size_t n) {
    char path[4096];
    tmp_path(path, name);
    Err e;
    CHECK(write_file_atomic(path, data, n, &e) == 0, "%s", e.msg);
}

static void write_gz(const char *name, const void *data, size_t n) {
    char path[4096];
    tmp_path(path, name);
    gzFile f = gzopen(path, "wb");
    CHECK(f && (n == 0 || gzwrite(f, data, (unsigned)n) == (int)n) && gzclose(f) == Z_OK, "gzip write of %s", name);
}

/* An IDX file: 0 0 type k, k big-endian dims, then the payload. */
static uint8_t *idx_bytes(uint8_t type, int k, const uint32_t *dims, const uint8_t *data, size_t ndata, size_t *size) {
    *size = 4 + 4 * (size_t)k + ndata;
    uint8_t *b = xmalloc(*size);
    b[0] = b[1] = 0;
    b[2] = type;
    b[3] = (uint8_t)k;
    for (int d = 0; d < k; d++)
        for (int j = 0; j < 4; j++) b[4 + 4 * d + j] = (uint8_t)(dims[d] >> (24 - 8 * j));
    memcpy(b + 4 + 4 * k, data, ndata);
    return b;
}

/* The round-trip set: 3 images of 5 x 4 (not square, so h and w cannot be swapped unnoticed). */
enum { N = 3, H = 5, W = 4 };
static uint8_t pix[N * H * W], lab[N] = {9, 0, 4};

static void make_pixels(void) {
    for (int i = 0; i < N * H * W; i++) pix[i] = (uint8_t)((i * 37 + 11) % 256);
    pix[0] = 0;
    pix[N * H * W - 1] = 255;
}

static int same_set(const ImageSet *s, int h, int w, int c, int classes, const uint8_t *pixels, const uint8_t *labels, int n) {
    return s->n == n && s->h == h && s->w == w && s->c == c && s->classes == classes && s->pixels && s->labels &&
           memcmp(s->pixels, pixels, (size_t)n * h * w * c) == 0 && memcmp(s->labels, labels, (size_t)n) == 0;
}

static void write_good_idx(void) {
    uint32_t idims[3] = {N, H, W}, ldims[1] = {N};
    size_t ni, nl;
    uint8_t *img = idx_bytes(0x08, 3, idims, pix, sizeof pix, &ni), *labs = idx_bytes(0x08, 1, ldims, lab, N, &nl);
    write_plain("images", img, ni);
    write_plain("labels", labs, nl);
    write_gz("images.gz", img, ni);
    write_gz("labels.gz", labs, nl);
    free(img);
    free(labs);
}

static void test_idx_round_trip(void) {
    const char *pairs[][2] = {{"images", "labels"}, {"images.gz", "labels.gz"}, {"images.gz", "labels"}, {"images", "labels.gz"}};
    for (int t = 0; t < 4; t++) {
        char ip[4096], lp[4096];
        tmp_path(ip, pairs[t][0]);
        tmp_path(lp, pairs[t][1]);
        ImageSet s;
        Err e = {{0}};
        int rc = imageset_load_idx(&s, ip, lp, &e);
        CHECK(rc == 0, "load %s + %s: %s", pairs[t][0], pairs[t][1], e.msg);
        CHECK(rc == 0 && same_set(&s, H, W, 1, 10, pix, lab, N), "%s + %s: 3 x 5 x 4 x 1, 10 classes, bytes as written",
              pairs[t][0], pairs[t][1]);
        imageset_free(&s);
        CHECK(s.pixels == NULL && s.labels == NULL && s.n == 0, "imageset_free zeroes the set");
    }
    /* the .gz files really are gzip, so the test above exercised inflation */
    char gp[4096];
    tmp_path(gp, "images.gz");
    size_t n = 0;
    Err e;
    char *raw = read_file(gp, &n, &e);
    CHECK(raw && n > 2 && (uint8_t)raw[0] == 0x1f && (uint8_t)raw[1] == 0x8b, "gzip magic in images.gz");
    free(raw);
}

/* imageset_load_idx must fail with a message naming `culprit` and containing want, leaving s zeroed. */
static void expect_idx_reject(const char *images, const char *labels, const char *culprit, const char *want, const char *what) {
    char ip[4096], lp[4096], cp[4096];
    tmp_path(ip, images);
    tmp_path(lp, labels);
    tmp_path(cp, culprit);
    ImageSet s;
    Err e = {{0}};
    int rc = imageset_load_idx(&s, ip, lp, &e);
    CHECK(rc != 0 && strncmp(e.msg, cp, strlen(cp)) == 0 && e.msg[strlen(cp)] == ':' && strstr(e.msg, want),
          "%s rejected with \"%s\", got: %s", what, want, e.msg);
    CHECK(s.pixels == NULL && s.labels == NULL && s.n == 0, "%s: set left zeroed", what);
    if (rc != 0) printf("  %s -> %s\n", what, e.msg);
    if (rc == 0) imageset_free(&s);
}

static void test_idx_rejects(void) {
    uint32_t idims[3] = {N, H, W}, ldims[1] = {N};
    size_t ni, nl, n;
    uint8_t *img = idx_bytes(0x08, 3, idims, pix, sizeof pix, &ni), *labs = idx_bytes(0x08, 1, ldims, lab, N, &nl);

    write_plain("img_short", img, ni - 1);
    expect_idx_reject("img_short", "labels", "img_short", "truncated: the file is 75 bytes, but the header's dims 3 x 5 x 4 need 76",
                      "images one byte short");
    write_gz("img_short.gz", img, ni - 1);
    expect_idx_reject("img_short.gz", "labels", "img_short.gz", "truncated: the decompressed data is 75 bytes",
                      "gzipped images one byte short");
    write_plain("lab_short", labs, nl - 1);
    expect_idx_reject("images", "lab_short", "lab_short", "truncated: the file is 10 bytes, but the header's dims 3 need 11",
                      "labels one byte short");
    write_gz("lab_short.gz", labs, nl - 1);
    expect_idx_reject("images.gz", "lab_short.gz", "lab_short.gz", "truncated", "gzipped labels one byte short");
    write_plain("img_head", img, 10);
    expect_idx_reject("img_head", "labels", "img_head", "ends inside the 16-byte header", "images cut inside the header");
    write_plain("img_tiny", img, 2);
    expect_idx_reject("img_tiny", "labels", "img_tiny", "shorter than the 4-byte IDX magic", "2-byte images file");
    write_plain("empty", img, 0);
    expect_idx_reject("empty", "labels", "empty", "shorter than the 4-byte IDX magic", "empty images file");
    expect_idx_reject("no_such_file", "labels", "no_such_file", "cannot open", "missing images file");

    /* a gzip file cut in the middle of the compressed stream */
    char gp[4096];
    tmp_path(gp, "images.gz");
    Err e;
    char *gz = read_file(gp, &n, &e);
    if (gz) write_plain("img_cut.gz", gz, n / 2);
    free(gz);
    expect_idx_reject("img_cut.gz", "labels", "img_cut.gz", "the gzip stream ends early", "gzip stream cut short");

    uint8_t *longer = xcalloc(ni + 3, 1);
    memcpy(longer, img, ni);
    write_plain("img_long", longer, ni + 3);
    expect_idx_reject("img_long", "labels", "img_long", "trailing bytes: the file is 79 bytes, 3 more than the 76 the header's dims 3 x 5 x 4 need", "3 bytes after the images");
    free(longer);
    longer = xcalloc(nl + 1, 1);
    memcpy(longer, labs, nl);
    write_gz("lab_long.gz", longer, nl + 1);
    expect_idx_reject("images", "lab_long.gz", "lab_long.gz", "trailing bytes: the decompressed data is 12 bytes, 1 more than the 11 the header's dims 3 need",
                      "1 byte after the gzipped labels");
    free(longer);

    expect_idx_reject("labels", "images", "labels", "bad magic 0x00000801, expected 0x00000803 (hint: images and labels files swapped?)",
                      "labels file given as images");
    uint32_t d4[4] = {N, H, W, 1};
    uint8_t *b = idx_bytes(0x08, 4, d4, pix, sizeof pix, &n);
    write_plain("img_4d", b, n);
    expect_idx_reject("img_4d", "labels", "img_4d", "bad magic 0x00000804, expected 0x00000803", "4-dimensional images");
    free(b);
    b = idx_bytes(0x0D, 3, idims, pix, sizeof pix, &n);
    write_plain("img_f32", b, n);
    expect_idx_reject("img_f32", "labels", "img_f32", "element type 0x0d, expected 0x08", "f32 element type");
    free(b);
    b = idx_bytes(0x0B, 1, ldims, lab, N, &n);
    write_gz("lab_i16.gz", b, n);
    expect_idx_reject("images", "lab_i16.gz", "lab_i16.gz", "element type 0x0b", "i16 labels");
    free(b);

    uint32_t zero[3] = {N, 0, W};
    b = idx_bytes(0x08, 3, zero, pix, 0, &n);
    write_plain("img_zero", b, n);
    expect_idx_reject("img_zero", "labels", "img_zero", "dimension 1 is 0", "zero height");
    free(b);
    uint32_t neg[3] = {N, H, 0x80000000u};
    b = idx_bytes(0x08, 3, neg, pix, 0, &n);
    write_plain("img_neg", b, n);
    expect_idx_reject("img_neg", "labels", "img_neg", "dimension 2 is 2147483648", "width past INT_MAX");
    free(b);
    uint32_t huge[3] = {0x7fffffffu, 0x7fffffffu, 0x7fffffffu};
    b = idx_bytes(0x08, 3, huge, pix, 0, &n);
    write_plain("img_huge", b, n);
    expect_idx_reject("img_huge", "labels", "img_huge", "larger than memory can address", "dims overflowing 64 bits");
    free(b);
    /* a count far beyond the data: rejected as truncated without allocating for the claim */
    uint32_t many[3] = {0x7fffffffu, 28, 28};
    b = idx_bytes(0x08, 3, many, pix, sizeof pix, &n);
    write_gz("img_many.gz", b, n);
    expect_idx_reject("img_many.gz", "labels", "img_many.gz", "truncated: the decompressed data is 76 bytes", "count far beyond the data");
    free(b);

    uint32_t two[1] = {2};
    b = idx_bytes(0x08, 1, two, lab, 2, &n);
    write_plain("lab_two", b, n);
    expect_idx_reject("images", "lab_two", "lab_two", "2 labels, but", "2 labels for 3 images");
    free(b);
    uint8_t bad[N] = {9, 0, 10};
    b = idx_bytes(0x08, 1, ldims, bad, N, &n);
    write_gz("lab_ten.gz", b, n);
    expect_idx_reject("images.gz", "lab_ten.gz", "lab_ten.gz", "record 2 is mislabelled: label 10, not below the 10 classes",
                      "label 10 in a 10-class set");
    free(b);
    free(img);
    free(labs);
}

/* CIFAR records: label byte(s) then 3072 pixel bytes that depend on the record. */
static uint8_t *cifar_bytes(int cifar100, int nrec, const uint8_t *coarse, const uint8_t *labels, int seed, size_t *size) {
    size_t rec = cifar100 ? 3074 : 3073;
    *size = rec * nrec;
    uint8_t *b = xmalloc(*size);
    for (int i = 0; i < nrec; i++) {
        uint8_t *r = b + i * rec;
        if (cifar100) r[0] = coarse[i];
        r[cifar100] = labels[i];
        for (int j = 0; j < 3072; j++) r[1 + cifar100 + j] = (uint8_t)((seed + i * 11 + j * 7 + j / 1024) % 256);
    }
    return b;
}

/* The pixels of record i of a cifar_bytes file. */
static const uint8_t *cifar_pixels(const uint8_t *file, int cifar100, int i) { return file + (size_t)i * (cifar100 ? 3074 : 3073) + 1 + cifar100; }

static int same_image(const ImageSet *s, int i, const uint8_t *pixels) {
    return i < s->n && memcmp(s->pixels + (size_t)i * 3072, pixels, 3072) == 0;
}

static int load_cifar(ImageSet *s, const char *const *names, int n, int cifar100, Err *e) {
    char paths[4][4096];
    const char *p[4];
    for (int i = 0; i < n; i++) {
        tmp_path(paths[i], names[i]);
        p[i] = paths[i];
    }
    return imageset_load_cifar(s, p, n, cifar100, e);
}

static void expect_cifar_reject(const char *const *names, int n, int cifar100, const char *culprit, const char *want, const char *what) {
    char cp[4096];
    tmp_path(cp, culprit);
    ImageSet s;
    Err e = {{0}};
    int rc = load_cifar(&s, names, n, cifar100, &e);
    CHECK(rc != 0 && strncmp(e.msg, cp, strlen(cp)) == 0 && e.msg[strlen(cp)] == ':' && strstr(e.msg, want),
          "%s rejected with \"%s\", got: %s", what, want, e.msg);
    CHECK(s.pixels == NULL && s.labels == NULL && s.n == 0, "%s: set left zeroed", what);
    if (rc != 0) printf("  %s -> %s\n", what, e.msg);
    if (rc == 0) imageset_free(&s);
}

static void test_cifar(void) {
    uint8_t la[2] = {3, 9}, lb[3] = {0, 5, 1};
    size_t na, nb, n;
    uint8_t *a = cifar_bytes(0, 2, NULL, la, 1, &na), *b = cifar_bytes(0, 3, NULL, lb, 100, &nb);
    CHECK(na == 2 * 3073 && nb == 3 * 3073, "CIFAR-10 records are 3073 bytes");
    write_plain("a.bin", a, na);
    write_plain("b.bin", b, nb);

    ImageSet s;
    Err e = {{0}};
    const char *ab[] = {"a.bin", "b.bin"}, *ba[] = {"b.bin", "a.bin"};
    CHECK(load_cifar(&s, ab, 2, 0, &e) == 0, "CIFAR-10 a + b: %s", e.msg);
    uint8_t want_ab[5] = {3, 9, 0, 5, 1};
    CHECK(s.n == 5 && s.h == 32 && s.w == 32 && s.c == 3 && s.classes == 10, "a + b: 5 images of 32 x 32 x 3, 10 classes");
    CHECK(s.labels && memcmp(s.labels, want_ab, 5) == 0, "a + b: labels in file order");
    CHECK(same_image(&s, 0, cifar_pixels(a, 0, 0)) && same_image(&s, 1, cifar_pixels(a, 0, 1)) &&
              same_image(&s, 2, cifar_pixels(b, 0, 0)) && same_image(&s, 4, cifar_pixels(b, 0, 2)),
          "a + b: planar pixels copied record by record");
    /* planar layout: image 3's green value at (y 2, x 3) is its record's byte 1 + 1024 + 2*32 + 3 */
    CHECK(s.pixels && s.pixels[3 * 3072 + 1024 + 2 * 32 + 3] == b[3073 + 1 + 1024 + 67], "image 3 green (2, 3)");
    imageset_free(&s);
    CHECK(load_cifar(&s, ba, 2, 0, &e) == 0, "CIFAR-10 b + a: %s", e.msg);
    uint8_t want_ba[5] = {0, 5, 1, 3, 9};
    CHECK(s.n == 5 && s.labels && memcmp(s.labels, want_ba, 5) == 0 && same_image(&s, 3, cifar_pixels(a, 0, 0)),
          "b + a: files concatenated in the order given");
    imageset_free(&s);

    uint8_t coarse[3] = {19, 0, 7}, fine[3] = {99, 0, 42};
    uint8_t *c = cifar_bytes(1, 3, coarse, fine, 5, &n);
    CHECK(n == 3 * 3074, "CIFAR-100 records are 3074 bytes");
    write_plain("c100.bin", c, n);
    const char *c100[] = {"c100.bin"};
    CHECK(load_cifar(&s, c100, 1, 1, &e) == 0, "CIFAR-100: %s", e.msg);
    CHECK(s.n == 3 && s.h == 32 && s.w == 32 && s.c == 3 && s.classes == 100 && s.labels && memcmp(s.labels, fine, 3) == 0,
          "CIFAR-100: 3 images, 100 classes, the fine labels");
    CHECK(same_image(&s, 0, cifar_pixels(c, 1, 0)) && same_image(&s, 2, cifar_pixels(c, 1, 2)), "CIFAR-100 pixels after both labels");
    imageset_free(&s);

    /* rejections */
    expect_cifar_reject(c100, 1, 0, "c100.bin", "size 9222 is not a positive multiple of the 3073-byte CIFAR-10 record",
                        "CIFAR-100 file loaded as CIFAR-10");
    uint8_t *longer = xcalloc(na + 1, 1);
    memcpy(longer, a, na);
    write_plain("a_long.bin", longer, na + 1);
    const char *along[] = {"b.bin", "a_long.bin"};
    expect_cifar_reject(along, 2, 0, "a_long.bin", "size 6147 is not a positive multiple", "one byte too many in the second file");
    free(longer);
    write_plain("a_short.bin", a, na - 1);
    const char *ashort[] = {"a_short.bin"};
    expect_cifar_reject(ashort, 1, 0, "a_short.bin", "size 6145 is not a positive multiple", "one byte short");
    write_plain("empty.bin", a, 0);
    const char *empty[] = {"a.bin", "empty.bin"};
    expect_cifar_reject(empty, 2, 0, "empty.bin", "size 0 is not a positive multiple", "empty batch file");
    const char *missing[] = {"a.bin", "no_such.bin"};
    expect_cifar_reject(missing, 2, 0, "no_such.bin", "cannot open", "missing batch file");
    CHECK(imageset_load_cifar(&s, NULL, 0, 0, &e) != 0 && strstr(e.msg, "no batch files"), "no files rejected: %s", e.msg);

    uint8_t ten[3] = {0, 10, 1};
    uint8_t *t = cifar_bytes(0, 3, NULL, ten, 7, &n);
    write_plain("ten.bin", t, n);
    const char *tenl[] = {"a.bin", "ten.bin"};
    expect_cifar_reject(tenl, 2, 0, "ten.bin", "record 1 is mislabelled: label 10, not below the 10 classes", "CIFAR-10 label 10");
    free(t);
    uint8_t fine100[3] = {5, 6, 100};
    t = cifar_bytes(1, 3, coarse, fine100, 7, &n);
    write_plain("fine100.bin", t, n);
    const char *f100[] = {"fine100.bin"};
    expect_cifar_reject(f100, 1, 1, "fine100.bin", "record 2 is mislabelled: fine label 100, not below the 100 classes",
                        "CIFAR-100 fine label 100");
    free(t);
    uint8_t coarse20[3] = {20, 0, 7};
    t = cifar_bytes(1, 3, coarse20, fine, 7, &n);
    write_plain("coarse20.bin", t, n);
    const char *c20[] = {"coarse20.bin"};
    expect_cifar_reject(c20, 1, 1, "coarse20.bin", "record 0 is mislabelled: coarse label 20", "CIFAR-100 coarse label 20");
    free(t);
    free(a);
    free(b);
    free(c);
}

static void test_channel_stats(void) {
    /* 2 images of 1 x 2 with 2 channels; channel 0 is {0, 255, 255, 255} / 255 =
     * {0, 1, 1, 1}: mean 0.75, variance 0.75 - 0.5625 = 0.1875; channel 1 is
     * {51, 51, 102, 0} / 255 = {0.2, 0.2, 0.4, 0}: mean 0.2, variance 0.08 / 4 = 0.02. */
    uint8_t px[8] = {0, 255, 51, 51, /* image 1 */ 255, 255, 102, 0};
    ImageSet s = {.n = 2, .h = 1, .w = 2, .c = 2, .classes = 2, .pixels = px};
    double mean[2], std[2];
    imageset_channel_stats(&s, mean, std);
    CHECK_CLOSE(mean[0], 0.75, 1e-12, 0, "channel 0 mean");
    CHECK_CLOSE(std[0], 0.4330127018922193, 1e-12, 0, "channel 0 std = sqrt(0.1875)");
    CHECK_CLOSE(mean[1], 0.2, 1e-12, 0, "channel 1 mean");
    CHECK_CLOSE(std[1], 0.1414213562373095, 1e-12, 0, "channel 1 std = sqrt(0.02)");
    uint8_t flat[6] = {77, 77, 77, 77, 77, 77};
    ImageSet f = {.n = 3, .h = 1, .w = 2, .c = 1, .classes = 1, .pixels = flat};
    imageset_channel_stats(&f, mean, std);
    CHECK(mean[0] == 77.0 / 255.0 && std[0] == 0.0, "constant image: mean 77/255, std exactly 0 (got %.17g, %.17g)", mean[0], std[0]);
}

/* Compares out[0..n) with hand-made pixel values v, normalised with the given per-channel
 * stats; v < 0 marks padding, which must be exactly 0. */
static int patch_is(const float *out, const int *v, int n, int c, const double *mean, const double *std) {
    for (int j = 0; j < n; j++) {
        double want = v[j] < 0 ? 0.0 : (v[j] / 255.0 - mean[j % c]) / std[j % c];
        if (v[j] < 0 ? out[j] != 0.0f : fabs(out[j] - want) > 1e-6 * (1 + fabs(want))) {
            printf("  element %d: got %.9g expected %.9g (pixel %d)\n", j, out[j], want, v[j]);
            return 0;
        }
    }
    return 1;
}

static void test_patchify(void) {
    /* 4 x 4 x 3, planar: pixel (ch, y, x) = 16 ch + 4 y + x + 1, so
     * red   1  2  3  4 / 5  6  7  8 / 9 10 11 12 / 13 14 15 16
     * green 17 .. 32, blue 33 .. 48 (same layout, +16 and +32). */
    uint8_t px[48];
    for (int i = 0; i < 48; i++) px[i] = (uint8_t)(i + 1);
    uint8_t two[2 * 48];
    memset(two, 200, 48); /* image 0 is flat; image 1 is the one above */
    memcpy(two + 48, px, 48);
    ImageSet s = {.n = 2, .h = 4, .w = 4, .c = 3, .classes = 1, .pixels = two};
    double mean[3] = {0.1, 0.2, 0.3}, std[3] = {0.5, 0.25, 2.0};
    float out[4 * 12];

    imageset_patchify(&s, 1, 2, mean, std, 0, 0, 0, out);
    /* patch 0 holds pixels (0,0) (0,1) (1,0) (1,1), channel fastest */
    int p0[12] = {1, 17, 33, 2, 18, 34, 5, 21, 37, 6, 22, 38};
    int p1[12] = {3, 19, 35, 4, 20, 36, 7, 23, 39, 8, 24, 40}; /* top right */
    int p2[12] = {9, 25, 41, 10, 26, 42, 13, 29, 45, 14, 30, 46}; /* bottom left */
    int p3[12] = {11, 27, 43, 12, 28, 44, 15, 31, 47, 16, 32, 48};
    CHECK(patch_is(out, p0, 12, 3, mean, std), "first patch: (row, column, channel), channel fastest");
    CHECK(patch_is(out + 12, p1, 12, 3, mean, std) && patch_is(out + 24, p2, 12, 3, mean, std), "patches in row-major grid order");
    CHECK(patch_is(out + 36, p3, 12, 3, mean, std), "last patch");
    CHECK_CLOSE(out[0], (1 / 255.0 - 0.1) / 0.5, 1e-6, 0, "first value (1/255 - 0.1) / 0.5");
    CHECK_CLOSE(out[47], (48 / 255.0 - 0.3) / 2.0, 1e-6, 0, "last value (48/255 - 0.3) / 2");

    imageset_patchify(&s, 1, 2, mean, std, 1, 0, 0, out);
    /* mirrored: row 0 reads 4 3 2 1 */
    int f0[12] = {4, 20, 36, 3, 19, 35, 8, 24, 40, 7, 23, 39};
    int f3[12] = {10, 26, 42, 9, 25, 41, 14, 30, 46, 13, 29, 45};
    CHECK(patch_is(out, f0, 12, 3, mean, std) && patch_is(out + 36, f3, 12, 3, mean, std), "flip: first and last patch mirrored");

    imageset_patchify(&s, 1, 2, mean, std, 0, 1, -1, out);
    /* output (y, x) reads (y + 1, x - 1): column 0 and row 3 are padding */
    int t0[12] = {-1, -1, -1, 5, 21, 37, -1, -1, -1, 9, 25, 41};
    int t3[12] = {14, 30, 46, 15, 31, 47, -1, -1, -1, -1, -1, -1};
    CHECK(patch_is(out, t0, 12, 3, mean, std) && patch_is(out + 36, t3, 12, 3, mean, std), "translation (1, -1) with zero padding");

    imageset_patchify(&s, 1, 2, mean, std, 1, 0, 1, out);
    /* flip, then (y, x) reads mirrored (y, x + 1) = stored (y, 2 - x) */
    int ft0[12] = {3, 19, 35, 2, 18, 34, 7, 23, 39, 6, 22, 38};
    int ft1[12] = {1, 17, 33, -1, -1, -1, 5, 21, 37, -1, -1, -1};
    CHECK(patch_is(out, ft0, 12, 3, mean, std) && patch_is(out + 12, ft1, 12, 3, mean, std), "flip then translate (0, 1)");

    imageset_patchify(&s, 0, 4, mean, std, 0, 9, 0, out);
    int pad[48];
    for (int j = 0; j < 48; j++) pad[j] = -1;
    CHECK(patch_is(out, pad, 48, 3, mean, std), "shifted off the image: all padding");
    imageset_patchify(&s, 0, 4, mean, std, 0, 0, 0, out);
    int flat[48];
    for (int j = 0; j < 48; j++) flat[j] = 200;
    CHECK(patch_is(out, flat, 48, 3, mean, std), "p = h = w: one patch of the selected image 0");

    /* one channel, non-square both ways: 2 x 6 gives 3 patches in a row, 4 x 2 two in a column */
    uint8_t g[12];
    for (int i = 0; i < 12; i++) g[i] = (uint8_t)(i + 1);
    ImageSet wide = {.n = 1, .h = 2, .w = 6, .c = 1, .classes = 1, .pixels = g};
    ImageSet tall = {.n = 1, .h = 4, .w = 2, .c = 1, .classes = 1, .pixels = g};
    double m0[1] = {0.0}, s1[1] = {1.0};
    int wide_want[12] = {1, 2, 7, 8, 3, 4, 9, 10, 5, 6, 11, 12}, tall_want[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    imageset_patchify(&wide, 0, 2, m0, s1, 0, 0, 0, out);
    CHECK(patch_is(out, wide_want, 12, 1, m0, s1), "2 x 6 image: patches left to right");
    imageset_patchify(&tall, 0, 2, m0, s1, 0, 0, 0, out);
    CHECK(patch_is(out, tall_want, 8, 1, m0, s1), "4 x 2 image: patches top to bottom");
    /* the MNIST normalisation maps 0 and 255 to these */
    uint8_t ends[4] = {0, 255, 255, 0};
    ImageSet ends_set = {.n = 1, .h = 2, .w = 2, .c = 1, .classes = 1, .pixels = ends};
    double mm[1] = {0.1307}, ms[1] = {0.3081};
    imageset_patchify(&ends_set, 0, 2, mm, ms, 0, 0, 0, out);
    CHECK_CLOSE(out[0], -0.424212917883804, 1e-6, 0, "pixel 0 -> -0.1307/0.3081");
    CHECK_CLOSE(out[1], 2.82148653034729, 1e-6, 0, "pixel 255 -> 0.8693/0.3081");
}

static const char *env_or(const char *name, const char *dflt) {
    const char *v = getenv(name);
    return v && *v ? v : dflt;
}

static void count_labels(const ImageSet *s, int *counts) {
    memset(counts, 0, 10 * sizeof(int));
    for (int i = 0; i < s->n; i++) counts[s->labels[i]]++;
}

static void test_fashion_mnist(void) {
    const char *d = "/usr/share/datasets/fashion-mnist";
    const char *split[2] = {"train", "t10k"};
    for (int t = 0; t < 2; t++) {
        char ip[4096], lp[4096];
        snprintf(ip, sizeof ip, "%s/%s-images-idx3-ubyte.gz", d, split[t]);
        snprintf(lp, sizeof lp, "%s/%s-labels-idx1-ubyte.gz", d, split[t]);
        if (!file_exists(ip) || !file_exists(lp)) {
            printf("SKIP Fashion-MNIST %s: %s not found (apt-get install dataset-fashion-mnist)\n", split[t], ip);
            continue;
        }
        ImageSet s;
        Err e = {{0}};
        int want = t == 0 ? 60000 : 10000, counts[10], balanced = 1;
        CHECK(imageset_load_idx(&s, ip, lp, &e) == 0, "Fashion-MNIST %s: %s", split[t], e.msg);
        CHECK(s.n == want && s.h == 28 && s.w == 28 && s.c == 1 && s.classes == 10, "Fashion-MNIST %s: %d images of 28 x 28 x 1, 10 classes",
              split[t], want);
        if (s.n) {
            count_labels(&s, counts);
            for (int k = 0; k < 10; k++) balanced &= counts[k] == want / 10;
            CHECK(balanced, "Fashion-MNIST %s: %d images per class", split[t], want / 10);
        }
        if (t == 0 && s.n) { /* the commonly quoted training-set statistics */
            double mean, std;
            imageset_channel_stats(&s, &mean, &std);
            CHECK_CLOSE(mean, 0.2860, 1e-3, 0, "Fashion-MNIST train mean");
            CHECK_CLOSE(std, 0.3530, 1e-3, 0, "Fashion-MNIST train std");
        }
        imageset_free(&s);
    }
}

static void test_mnist(void) {
    const char *d = env_or("KVLAB_MNIST_DIR", "data/mnist");
    char ip[4096], lp[4096];
    snprintf(ip, sizeof ip, "%s/t10k-images-idx3-ubyte.gz", d);
    snprintf(lp, sizeof lp, "%s/t10k-labels-idx1-ubyte.gz", d);
    if (!file_exists(ip) || !file_exists(lp)) {
        printf("SKIP MNIST test set: %s not found (set KVLAB_MNIST_DIR, e.g. to /work/shared/data/mnist)\n", ip);
        return;
    }
    ImageSet s;
    Err e = {{0}};
    CHECK(imageset_load_idx(&s, ip, lp, &e) == 0, "MNIST t10k: %s", e.msg);
    CHECK(s.n == 10000 && s.h == 28 && s.w == 28 && s.c == 1 && s.classes == 10, "MNIST t10k: 10000 images of 28 x 28 x 1");
    if (s.n == 10000) {
        int counts[10], want[10] = {980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009}, same = 1;
        count_labels(&s, counts);
        for (int k = 0; k < 10; k++) same &= counts[k] == want[k];
        CHECK(same, "MNIST t10k: the published per-digit counts 980 1135 ... 1009");
        double mean, std;
        imageset_channel_stats(&s, &mean, &std);
        CHECK_CLOSE(mean, 0.1325, 1e-3, 0, "MNIST t10k mean");
        CHECK_CLOSE(std, 0.3105, 1e-3, 0, "MNIST t10k std");
    }
    imageset_free(&s);
}

int main(void) {
    if (!mkdtemp(dir)) {
        printf("cannot create a temporary folder under /tmp\n");
        return 1;
    }
    make_pixels();
    write_good_idx();
    test_idx_round_trip();
    test_idx_rejects();
    test_cifar();
    test_channel_stats();
    test_patchify();
    test_fashion_mnist();
    test_mnist();
    CHECK(nftw(dir, remove_entry, 8, FTW_DEPTH | FTW_PHYS) == 0, "remove %s", dir);
    return TEST_SUMMARY("test_images");
}
