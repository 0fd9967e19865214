#define _GNU_SOURCE
#include "images.h"

#include <assert.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <zlib.h>

#define IDX_IMAGES_MAGIC 0x00000803u
#define IDX_LABELS_MAGIC 0x00000801u
#define IDX_U8 0x08
#define CIFAR_SIDE 32
#define CIFAR_PIXELS (3 * CIFAR_SIDE * CIFAR_SIDE)

void imageset_free(ImageSet *s) {
    free(s->pixels);
    free(s->labels);
    memset(s, 0, sizeof *s);
}

static uint32_t be32(const uint8_t *b) {
    return (uint32_t)b[0] << 24 | (uint32_t)b[1] << 16 | (uint32_t)b[2] << 8 | b[3];
}

/* Reads up to n bytes; returns how many (fewer only at the end of the data),
 * or -1 on a read or decompression error, including a gzip stream that stops
 * early (zlib reports that only through gzerror, not gzread's result). */
static long long gz_read_up_to(gzFile f, uint8_t *buf, size_t n) {
    size_t len = 0;
    while (len < n) {
        size_t chunk = n - len < (1u << 30) ? n - len : (1u << 30); /* gzread takes an unsigned, returns an int */
        int r = gzread(f, buf + len, (unsigned)chunk);
        if (r <= 0) break;
        len += (size_t)r;
    }
    int err;
    gzerror(f, &err);
    return err == Z_OK ? (long long)len : -1;
}

static const char *gz_problem(gzFile f) {
    int err;
    const char *msg = gzerror(f, &err);
    if (err == Z_ERRNO) return strerror(errno);
    if (err == Z_BUF_ERROR) return "the gzip stream ends early";
    if (err == Z_DATA_ERROR) return "the gzip data is corrupt";
    return msg;
}

/* Reads a u8 IDX file with k <= 3 dimensions and the given magic into dims[]
 * and *data (prod(dims) bytes). gzread inflates gzip files and passes plain
 * ones through unchanged; gzdirect says which, by the gzip magic. */
static int idx_read(const char *path, uint32_t magic, int k, int dims[], uint8_t **data, Err *e) {
    *data = NULL;
    gzFile f = gzopen(path, "rb");
    if (!f) return err_set(e, "%s: cannot open: %s (hint: check the path; the data script fetches MNIST)", path, strerror(errno));
    const char *what = gzdirect(f) ? "the file" : "the decompressed data";
    uint8_t head[16], *buf = NULL;
    long long got = gz_read_up_to(f, head, 4);
    if (got < 0) goto gz_fail;
    if (got < 4) {
        err_set(e, "%s: truncated: %s is %lld bytes, shorter than the 4-byte IDX magic (hint: incomplete download; fetch it again)",
                path, what, got);
        goto fail;
    }
    if (head[0] != 0 || head[1] != 0 || head[3] != k) {
        uint32_t other = magic == IDX_IMAGES_MAGIC ? IDX_LABELS_MAGIC : IDX_IMAGES_MAGIC;
        err_set(e, "%s: bad magic 0x%08x, expected 0x%08x (hint: %s)", path, be32(head), magic,
                be32(head) == other ? "images and labels files swapped?" : "not an IDX file of this kind");
        goto fail;
    }
    if (head[2] != IDX_U8) {
        err_set(e, "%s: element type 0x%02x, expected 0x08 (u8) (hint: only u8 IDX files, as MNIST ships them, are supported)",
                path, head[2]);
        goto fail;
    }
    got = gz_read_up_to(f, head + 4, 4 * (size_t)k);
    if (got < 0) goto gz_fail;
    if (got < 4 * k) {
        err_set(e, "%s: truncated: %s ends inside the %d-byte header (hint: incomplete download; fetch it again)", path, what,
                4 + 4 * k);
        goto fail;
    }
    char shape[64] = "";
    size_t want = 1;
    for (int d = 0; d < k; d++) {
        uint32_t v = be32(head + 4 + 4 * d);
        if (v == 0 || v > INT_MAX) { /* ImageSet keeps sizes as int */
            err_set(e, "%s: dimension %d is %u, outside [1, %d] (hint: corrupt header)", path, d, v, INT_MAX);
            goto fail;
        }
        if (want > SIZE_MAX / v) {
            err_set(e, "%s: dimension %d is %u, making the data larger than memory can address (hint: corrupt header)", path, d, v);
            goto fail;
        }
        dims[d] = (int)v;
        want *= v;
        size_t used = strlen(shape);
        snprintf(shape + used, sizeof shape - used, d ? " x %u" : "%u", v);
    }

    /* Grow the buffer as data arrives instead of trusting the header, so a
     * corrupt count cannot make us allocate far more than the file holds. */
    size_t cap = want < (1u << 20) ? want : (1u << 20), len = 0;
    buf = xmalloc(cap);
    for (;;) {
        got = gz_read_up_to(f, buf + len, cap - len);
        if (got < 0) goto gz_fail;
        len += (size_t)got;
        if (len < cap || cap == want) break;
        cap = want - cap < cap ? want : 2 * cap;
        buf = xrealloc(buf, cap);
    }
    if (len < want) {
        err_set(e, "%s: truncated: %s is %llu bytes, but the header's dims %s need %llu (hint: incomplete download; fetch it again)",
                path, what, (unsigned long long)(4 + 4 * k + len), shape, (unsigned long long)(4 + 4 * k + want));
        goto fail;
    }
    long long extra = 0;
    uint8_t tail[4096];
    while ((got = gz_read_up_to(f, tail, sizeof tail)) > 0) extra += got;
    if (got < 0) goto gz_fail;
    if (extra) {
        err_set(e, "%s: trailing bytes: %s is %llu bytes, %lld more than the %llu the header's dims %s need (hint: wrong header, or several files joined)",
                path, what, (unsigned long long)(4 + 4 * k + want + extra), extra, (unsigned long long)(4 + 4 * k + want), shape);
        goto fail;
    }
    gzclose(f);
    *data = buf;
    return 0;
gz_fail:
    err_set(e, "%s: read error: %s (hint: damaged or cut-short download; fetch it again)", path, gz_problem(f));
fail:
    gzclose(f);
    free(buf);
    return -1;
}

int imageset_load_idx(ImageSet *s, const char *images_path, const char *labels_path, Err *e) {
    memset(s, 0, sizeof *s);
    int idims[3], ldims[1];
    uint8_t *pixels, *labels;
    if (idx_read(images_path, IDX_IMAGES_MAGIC, 3, idims, &pixels, e) != 0) return -1;
    if (idx_read(labels_path, IDX_LABELS_MAGIC, 1, ldims, &labels, e) != 0) {
        free(pixels);
        return -1;
    }
    const int classes = 10;
    if (ldims[0] != idims[0]) {
        err_set(e, "%s: %d labels, but %s has %d images (hint: the files come from different splits, e.g. train and t10k)",
                labels_path, ldims[0], images_path, idims[0]);
        goto fail;
    }
    for (int i = 0; i < ldims[0]; i++)
        if (labels[i] >= classes) {
            err_set(e, "%s: record %d is mislabelled: label %u, not below the %d classes (hint: corrupt file, or not a 10-class data set)",
                    labels_path, i, (unsigned)labels[i], classes);
            goto fail;
        }
    *s = (ImageSet){.n = idims[0], .h = idims[1], .w = idims[2], .c = 1, .classes = classes, .pixels = pixels, .labels = labels};
    return 0;
fail:
    free(pixels);
    free(labels);
    return -1;
}

/* Appends the records of one batch file to s, growing its arrays. */
static int cifar_read(ImageSet *s, const char *path, int cifar100, Err *e) {
    const size_t rec = cifar100 ? 2 + CIFAR_PIXELS : 1 + CIFAR_PIXELS;
    FILE *f = fopen(path, "rb");
    if (!f) return err_set(e, "%s: cannot open: %s (hint: check the path; the data script fetches CIFAR)", path, strerror(errno));
    struct stat st;
    if (fstat(fileno(f), &st) != 0) {
        err_set(e, "%s: cannot stat: %s (hint: check the file system)", path, strerror(errno));
        goto fail;
    }
    long long size = (long long)st.st_size;
    if (size == 0 || size % (long long)rec != 0) {
        err_set(e, "%s: size %lld is not a positive multiple of the %zu-byte %s record (hint: truncated download, or the other "
                   "CIFAR variant: CIFAR-10 records are 3073 bytes, CIFAR-100 3074)",
                path, size, rec, cifar100 ? "CIFAR-100" : "CIFAR-10");
        goto fail;
    }
    size_t count = (size_t)(size / (long long)rec), base = (size_t)s->n;
    if (count > (size_t)INT_MAX - base) {
        err_set(e, "%s: %zu more records would pass %d in all (hint: load fewer batches)", path, count, INT_MAX);
        goto fail;
    }
    s->pixels = xrealloc(s->pixels, (base + count) * CIFAR_PIXELS);
    s->labels = xrealloc(s->labels, base + count);
    uint8_t r[2 + CIFAR_PIXELS];
    for (size_t i = 0; i < count; i++) {
        if (fread(r, rec, 1, f) != 1) {
            err_set(e, "%s: read error at record %zu (hint: was the file changed while loading?)", path, i);
            goto fail;
        }
        if (cifar100 && r[0] >= 20) {
            err_set(e, "%s: record %zu is mislabelled: coarse label %u, not below the 20 superclasses (hint: corrupt file, or not CIFAR-100)",
                    path, i, (unsigned)r[0]);
            goto fail;
        }
        unsigned label = r[cifar100]; /* CIFAR-100: byte 1, the fine label */
        if (label >= (unsigned)s->classes) {
            err_set(e, "%s: record %zu is mislabelled: %slabel %u, not below the %d classes (hint: corrupt file, or not %s)", path,
                    i, cifar100 ? "fine " : "", label, s->classes, cifar100 ? "CIFAR-100" : "CIFAR-10");
            goto fail;
        }
        s->labels[base + i] = (uint8_t)label;
        memcpy(s->pixels + (base + i) * CIFAR_PIXELS, r + rec - CIFAR_PIXELS, CIFAR_PIXELS);
    }
    s->n += (int)count; /* only whole, checked files count */
    fclose(f);
    return 0;
fail:
    fclose(f);
    return -1;
}

int imageset_load_cifar(ImageSet *s, const char *const *paths, int npaths, int cifar100, Err *e) {
    memset(s, 0, sizeof *s);
    if (npaths < 1) return err_set(e, "cifar: no batch files given (hint: list e.g. data_batch_1.bin .. data_batch_5.bin)");
    s->h = s->w = CIFAR_SIDE;
    s->c = 3;
    s->classes = cifar100 ? 100 : 10;
    for (int i = 0; i < npaths; i++)
        if (cifar_read(s, paths[i], cifar100, e) != 0) {
            imageset_free(s);
            return -1;
        }
    return 0;
}

void imageset_channel_stats(const ImageSet *s, double *mean, double *std) {
    const size_t plane = (size_t)s->h * s->w;
    const double count = (double)s->n * (double)plane;
    for (int ch = 0; ch < s->c; ch++) {
        uint64_t sum = 0, sum2 = 0;
        for (int i = 0; i < s->n; i++) {
            const uint8_t *q = s->pixels + ((size_t)i * s->c + ch) * plane;
            for (size_t j = 0; j < plane; j++) {
                sum += q[j];
                sum2 += (uint64_t)q[j] * q[j];
            }
        }
        double m = (double)sum / count, var = (double)sum2 / count - m * m;
        mean[ch] = m / 255.0;
        std[ch] = sqrt(var > 0 ? var : 0) / 255.0; /* rounding can make a zero variance slightly negative */
    }
}

void imageset_patchify(const ImageSet *s, int i, int p, const double *mean, const double *std, int flip, int dy, int dx,
                       float *out) {
    assert(i >= 0 && i < s->n && p > 0 && s->h % p == 0 && s->w % p == 0);
    const int h = s->h, w = s->w, c = s->c;
    const uint8_t *img = s->pixels + (size_t)i * h * w * c;
    for (int gy = 0; gy < h / p; gy++)
        for (int gx = 0; gx < w / p; gx++)
            for (int py = 0; py < p; py++)
                for (int px = 0; px < p; px++) {
                    /* (y, x) in the mirrored image, then back to a stored column */
                    int y = gy * p + py + dy, x = gx * p + px + dx;
                    int inside = y >= 0 && y < h && x >= 0 && x < w;
                    if (flip) x = w - 1 - x;
                    for (int ch = 0; ch < c; ch++)
                        *out++ = inside ? (float)((img[((size_t)ch * h + y) * w + x] / 255.0 - mean[ch]) / std[ch]) : 0.0f;
                }
}
