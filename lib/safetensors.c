/* safetensors reader and writer; see safetensors.h and formats.md section 1.
 * Rule numbers in comments refer to formats.md 1.3. */
#define _POSIX_C_SOURCE 200809L
#include "safetensors.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Tensor data is copied between the file and memory without byte swapping. */
#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors data is little-endian and kvlab copies it in host byte order"
#endif
_Static_assert(sizeof(size_t) == sizeof(uint64_t), "kvlab assumes a 64-bit size_t");

#define ST_MAX_HEADER 100000000ULL           /* reference implementation's limit */
#define ST_MAX_INT 9007199254740992ULL       /* 2^53: largest integer a double holds exactly */

#define HINT_TRUNC "the file was cut short: was the write interrupted? re-run training or use another checkpoint"
#define HINT_NOT_ST "is this really a .safetensors file?"
#define HINT_CORRUPT "the header is malformed: the file is corrupt or was written by a non-conforming tool; use another checkpoint or re-export it"

static const char *dtype_names[ST_NDTYPES] = {
    "BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16",
    "I32", "U32", "F32", "F64", "I64", "U64",
};
static const size_t dtype_sizes[ST_NDTYPES] = {1, 1, 1, 1, 1, 2, 2, 2, 2, 4, 4, 4, 8, 8, 8};
/* Valid in the safetensors spec but without a kvlab enum value: named in the error. */
static const char *unsupported_dtypes[] = {"F8_E8M0", "C64", "F4", "F6_E2M3", "F6_E3M2"};

size_t st_dtype_size(StDtype d) {
    return (unsigned)d < ST_NDTYPES ? dtype_sizes[d] : 0;
}

int st_dtype_parse(const char *name, StDtype *d) {
    for (int i = 0; i < ST_NDTYPES; i++) {
        if (strcmp(name, dtype_names[i]) == 0) {
            *d = (StDtype)i;
            return 0;
        }
    }
    return -1;
}

/* Copies s[0..len) for an error message: printable ASCII only, bounded length,
 * so a hostile name can neither break the one-line format nor flood it. */
static const char *printable(const char *s, size_t len, char *buf, size_t cap) {
    size_t n = 0;
    for (size_t i = 0; i < len && n + 4 < cap; i++) buf[n++] = (s[i] >= 0x20 && s[i] < 0x7f) ? s[i] : '?';
    if (n + 4 >= cap && len > n) memcpy(buf + n - 3, "...", 3);
    buf[n] = 0;
    return buf;
}
#define PRINTABLE(s, buf) printable((s), strlen(s), (buf), sizeof(buf))

static void format_shape(char *buf, size_t cap, int ndim, const int64_t *shape) {
    size_t n = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < ndim && n < cap; i++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%" PRId64, i ? ", " : "", shape[i]);
    if (n < cap) snprintf(buf + n, cap - n, "]");
}

/* Strict UTF-8: no overlong forms, no surrogates, nothing above U+10FFFF.
 * Returns the offset of the first bad byte, or len if all is valid. */
static size_t utf8_invalid_at(const unsigned char *s, size_t len) {
    size_t i = 0;
    while (i < len) {
        unsigned c = s[i];
        size_t k;
        uint32_t cp, min;
        if (c < 0x80) { i++; continue; }
        if (c >= 0xc2 && c <= 0xdf) { k = 1; cp = c & 0x1f; min = 0x80; }
        else if (c >= 0xe0 && c <= 0xef) { k = 2; cp = c & 0x0f; min = 0x800; }
        else if (c >= 0xf0 && c <= 0xf4) { k = 3; cp = c & 0x07; min = 0x10000; }
        else return i;
        if (len - i <= k) return i;
        for (size_t j = 1; j <= k; j++) {
            if ((s[i + j] & 0xc0) != 0x80) return i;
            cp = (cp << 6) | (s[i + j] & 0x3f);
        }
        if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return i;
        i += k + 1;
    }
    return len;
}

/* pread until n bytes or end of file; returns bytes read, or -1 on error. */
static ssize_t pread_full(int fd, void *dst, size_t n, uint64_t off) {
    size_t got = 0;
    while (got < n) {
        size_t chunk = n - got < (1u << 30) ? n - got : (1u << 30);
        ssize_t r = pread(fd, (char *)dst + got, chunk, (off_t)(off + got));
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return -1;
        if (r == 0) break;
        got += (size_t)r;
    }
    return (ssize_t)got;
}

/* ---------------------------------------------------------------- reading */

struct StFile {
    char *path;
    int fd;
    uint64_t data_start;     /* 8 + N: file offset of the byte buffer */
    int n;
    StTensorInfo *t;         /* sorted by begin */
    StTensorInfo **by_name;  /* into t, sorted by name, for st_find */
    int nmeta;
    char **meta_keys, **meta_values;
};

static int json_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

/* Rules 2 and 6 on the raw text of a header cJSON already accepted (so every
 * string is terminated). cJSON is lenient where the format is not: it stores
 * numbers as doubles (no way to see "1.0", "1e3" or 2^53+1 afterwards) and
 * truncates strings at an escaped NUL. Keys at depth 1 (tensor) and 2 (field)
 * are tracked to name the culprit. */
static int scan_raw(const char *h, size_t n, const char *path, Err *e) {
    int depth = 0;
    const char *key[3] = {NULL, NULL, NULL};
    size_t keylen[3] = {0, 0, 0};
    for (size_t i = 0; i < n; i++) {
        char c = h[i];
        if (c == '{' || c == '[') depth++;
        else if (c == '}' || c == ']') depth--;
        else if (c == '"') {
            size_t s = ++i;
            for (; i < n && h[i] != '"'; i++) {
                if ((unsigned char)h[i] < 0x20)
                    return err_set(e, "%s: header has a raw control character inside a string at byte %zu (hint: %s)",
                                   path, 8 + i, HINT_CORRUPT);
                if (h[i] == '\\') {
                    if (i + 6 <= n && memcmp(h + i + 1, "u0000", 5) == 0)
                        return err_set(e, "%s: header has an escaped NUL character (\\u0000) in a string at byte %zu (hint: %s)",
                                       path, 8 + i, HINT_CORRUPT);
                    i++;
                }
            }
            size_t j = i + 1;
            while (j < n && json_ws(h[j])) j++;
            if (j < n && h[j] == ':' && depth >= 1 && depth <= 2) {
                key[depth] = h + s;
                keylen[depth] = i - s;
                if (depth == 1) key[2] = NULL;
            }
        } else if (c == '-' || (c >= '0' && c <= '9')) {
            size_t s = i, stop = i;
            while (stop < n && h[stop] && strchr("0123456789+-.eE", h[stop])) stop++; /* cJSON's number characters */
            size_t len = stop - s, k;
            i = stop - 1;
            const char *why = NULL;
            for (k = 0; k < len && h[s + k] >= '0' && h[s + k] <= '9'; k++) {}
            if (h[s] == '-') why = "is negative";
            else if (memchr(h + s, '.', len)) why = "has a fraction";
            else if (k < len) why = "has an exponent";
            else if (len > 1 && h[s] == '0') why = "has a leading zero";
            else if (len > 16 || strtoull(h + s, NULL, 10) > ST_MAX_INT) why = "exceeds 2^53";
            if (why) {
                char b1[80], b2[80], b3[40], where[200];
                int in_meta = key[1] && keylen[1] == 12 && memcmp(key[1], "__metadata__", 12) == 0;
                if (depth >= 2 && in_meta && key[2])
                    snprintf(where, sizeof where, "__metadata__ key '%s'", printable(key[2], keylen[2], b2, sizeof b2));
                else if (depth >= 2 && key[1] && key[2])
                    snprintf(where, sizeof where, "tensor '%s' field '%s'", printable(key[1], keylen[1], b1, sizeof b1),
                             printable(key[2], keylen[2], b2, sizeof b2));
                else if (key[1])
                    snprintf(where, sizeof where, "entry '%s'", printable(key[1], keylen[1], b1, sizeof b1));
                else
                    snprintf(where, sizeof where, "header byte %zu", 8 + s);
                return err_set(e, "%s: %s: number %s %s; shapes and offsets must be plain non-negative integers up to 2^53 (hint: %s)",
                               path, where, printable(h + s, len, b3, sizeof b3), why, HINT_CORRUPT);
            }
        }
    }
    return 0;
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Rule 3 for one object: cJSON keeps duplicates (lookups return the first). */
static const char *duplicate_key(const cJSON *obj) {
    int n = cJSON_GetArraySize(obj);
    const char **keys = xmalloc((size_t)n * sizeof *keys);
    int i = 0;
    for (const cJSON *c = obj->child; c; c = c->next) keys[i++] = c->string;
    qsort(keys, (size_t)n, sizeof *keys, cmp_str);
    const char *dup = NULL;
    for (i = 1; i < n && !dup; i++)
        if (strcmp(keys[i - 1], keys[i]) == 0) dup = keys[i];
    free(keys);
    return dup;
}

/* A number the raw scan has proven to be an integer in [0, 2^53], so the
 * double cJSON holds is exact. */
static uint64_t json_uint(const cJSON *x) { return (uint64_t)x->valuedouble; }

/* Rules 5 and 7 for one tensor entry. */
static int parse_entry(const cJSON *item, StTensorInfo *t, const char *path, Err *e) {
    char nb[80];
    const char *name = PRINTABLE(item->string, nb);
    if (!item->string[0])
        return err_set(e, "%s: header has a tensor with an empty name (hint: %s)", path, HINT_CORRUPT);
    if (!cJSON_IsObject(item))
        return err_set(e, "%s: tensor '%s': entry is not an object with dtype, shape and data_offsets (hint: %s)",
                       path, name, HINT_CORRUPT);
    const cJSON *dtype = NULL, *shape = NULL, *offs = NULL;
    for (const cJSON *c = item->child; c; c = c->next) {
        const cJSON **slot = strcmp(c->string, "dtype") == 0          ? &dtype
                             : strcmp(c->string, "shape") == 0        ? &shape
                             : strcmp(c->string, "data_offsets") == 0 ? &offs
                                                                      : NULL;
        char fb[80];
        if (!slot)
            return err_set(e, "%s: tensor '%s' has an unknown field '%s' (hint: only dtype, shape and data_offsets are allowed; %s)",
                           path, name, PRINTABLE(c->string, fb), HINT_CORRUPT);
        if (*slot)
            return err_set(e, "%s: tensor '%s' has a duplicate key '%s' (hint: %s)", path, name, c->string, HINT_CORRUPT);
        *slot = c;
    }
    if (!dtype || !shape || !offs)
        return err_set(e, "%s: tensor '%s' is missing the field '%s' (hint: %s)", path, name,
                       !dtype ? "dtype" : !shape ? "shape" : "data_offsets", HINT_CORRUPT);

    if (!cJSON_IsString(dtype))
        return err_set(e, "%s: tensor '%s': dtype is not a string (hint: %s)", path, name, HINT_CORRUPT);
    if (st_dtype_parse(dtype->valuestring, &t->dtype) != 0) {
        char db[40];
        for (size_t i = 0; i < sizeof unsupported_dtypes / sizeof *unsupported_dtypes; i++)
            if (strcmp(dtype->valuestring, unsupported_dtypes[i]) == 0)
                return err_set(e, "%s: tensor '%s' has dtype %s, which is valid safetensors but not supported by kvlab "
                                  "(hint: convert the tensor to F32, F16 or BF16 before loading)",
                               path, name, unsupported_dtypes[i]);
        return err_set(e, "%s: tensor '%s' has an unknown dtype '%s' (hint: %s)", path, name,
                       PRINTABLE(dtype->valuestring, db), HINT_CORRUPT);
    }

    if (!cJSON_IsArray(shape))
        return err_set(e, "%s: tensor '%s': shape is not an array (hint: %s)", path, name, HINT_CORRUPT);
    int ndim = cJSON_GetArraySize(shape);
    if (ndim > ST_MAX_DIMS)
        return err_set(e, "%s: tensor '%s' has %d dimensions; kvlab supports at most %d (hint: reshape it before export)",
                       path, name, ndim, ST_MAX_DIMS);
    t->ndim = ndim;
    int k = 0, has_zero = 0;
    for (const cJSON *c = shape->child; c; c = c->next, k++) {
        if (!cJSON_IsNumber(c))
            return err_set(e, "%s: tensor '%s': shape entry %d is not a number (hint: %s)", path, name, k, HINT_CORRUPT);
        t->shape[k] = (int64_t)json_uint(c);
        has_zero |= t->shape[k] == 0;
    }
    /* Rule 7: element count with overflow checking; a 0 dimension makes it 0
     * whatever the others are. */
    uint64_t numel = 1;
    for (k = 0; k < ndim && !has_zero; k++) {
        uint64_t d = (uint64_t)t->shape[k];
        if (numel > UINT64_MAX / d)
            return err_set(e, "%s: tensor '%s': element count of shape overflows 64 bits (hint: %s)", path, name, HINT_CORRUPT);
        numel *= d;
    }
    if (has_zero) numel = 0;
    uint64_t size = dtype_sizes[t->dtype];
    if (numel > UINT64_MAX / size)
        return err_set(e, "%s: tensor '%s': byte size of shape overflows 64 bits (hint: %s)", path, name, HINT_CORRUPT);
    uint64_t bytes = numel * size;
    t->numel = (size_t)numel;

    if (!cJSON_IsArray(offs) || cJSON_GetArraySize(offs) != 2 || !cJSON_IsNumber(offs->child) ||
        !cJSON_IsNumber(offs->child->next))
        return err_set(e, "%s: tensor '%s': data_offsets must be an array of exactly 2 integers [begin, end] (hint: %s)",
                       path, name, HINT_CORRUPT);
    t->begin = json_uint(offs->child);
    t->end = json_uint(offs->child->next);
    if (t->begin > t->end)
        return err_set(e, "%s: tensor '%s': data_offsets begin %" PRIu64 " is after end %" PRIu64 " (hint: %s)",
                       path, name, t->begin, t->end, HINT_CORRUPT);
    if (t->end - t->begin != bytes) {
        char sb[200];
        format_shape(sb, sizeof sb, t->ndim, t->shape);
        return err_set(e, "%s: tensor '%s': data_offsets [%" PRIu64 ", %" PRIu64 "] span %" PRIu64
                          " bytes, which does not match shape %s x %s = %" PRIu64 " bytes (hint: %s)",
                       path, name, t->begin, t->end, t->end - t->begin, sb, dtype_names[t->dtype], bytes, HINT_CORRUPT);
    }
    t->name = xstrdup(item->string);
    return 0;
}

static int cmp_begin(const void *a, const void *b) {
    const StTensorInfo *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1; /* empty tensors before the one starting there */
    return strcmp(x->name, y->name);
}

static int cmp_info_name(const void *a, const void *b) {
    return strcmp((*(StTensorInfo *const *)a)->name, (*(StTensorInfo *const *)b)->name);
}

/* Everything after reading the header bytes: rules 2-8. */
static int parse_header(StFile *f, char *h, uint64_t n, uint64_t file_size, Err *e) {
    const char *path = f->path;
    if (n == 0) return err_set(e, "%s: not a safetensors file: the JSON header is empty (hint: %s)", path, HINT_NOT_ST);
    if (h[0] != '{')
        return err_set(e, "%s: not a safetensors file: the header does not start with '{' (it must be a JSON object) (hint: %s)",
                       path, HINT_NOT_ST);
    size_t bad = utf8_invalid_at((const unsigned char *)h, n);
    if (bad < n) return err_set(e, "%s: header is not valid UTF-8 (byte %zu) (hint: %s)", path, 8 + bad, HINT_CORRUPT);

    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(h, n, &end, 0);
    if (!root)
        return err_set(e, "%s: header is not valid JSON (error near byte %zu) (hint: %s)", path,
                       8 + (size_t)(end ? end - h : 0), HINT_CORRUPT);
    int rc = -1;
    size_t json_len = (size_t)(end - h);
    for (size_t i = json_len; i < n; i++) {
        if (h[i] != ' ') {
            err_set(e, "%s: header has trailing bytes after the JSON object at byte %zu (only spaces may follow) (hint: %s)",
                    path, 8 + i, HINT_CORRUPT);
            goto done;
        }
    }
    if (scan_raw(h, json_len, path, e) != 0) goto done;
    const char *dup = duplicate_key(root);
    if (dup) {
        char db[80];
        err_set(e, "%s: header has a duplicate %s '%s' (hint: %s)", path,
                strcmp(dup, "__metadata__") == 0 ? "key" : "tensor name", PRINTABLE(dup, db), HINT_CORRUPT);
        goto done;
    }

    /* Rule 4: __metadata__ is an object of strings. */
    const cJSON *meta = cJSON_GetObjectItemCaseSensitive(root, "__metadata__");
    if (meta) {
        if (!cJSON_IsObject(meta)) {
            err_set(e, "%s: __metadata__ is not an object of strings (hint: %s)", path, HINT_CORRUPT);
            goto done;
        }
        if ((dup = duplicate_key(meta)) != NULL) {
            char db[80];
            err_set(e, "%s: __metadata__ has a duplicate key '%s' (hint: %s)", path, PRINTABLE(dup, db), HINT_CORRUPT);
            goto done;
        }
        f->nmeta = cJSON_GetArraySize(meta);
        f->meta_keys = xcalloc((size_t)f->nmeta, sizeof(char *));
        f->meta_values = xcalloc((size_t)f->nmeta, sizeof(char *));
        int i = 0;
        for (const cJSON *c = meta->child; c; c = c->next, i++) {
            if (!cJSON_IsString(c)) {
                char kb[80];
                err_set(e, "%s: __metadata__ value of '%s' is not a string (metadata values must be strings) (hint: %s)",
                        path, PRINTABLE(c->string, kb), HINT_CORRUPT);
                goto done;
            }
            f->meta_keys[i] = xstrdup(c->string);
            f->meta_values[i] = xstrdup(c->valuestring);
        }
    }

    /* Rules 5 and 7. */
    f->t = xcalloc((size_t)cJSON_GetArraySize(root), sizeof(StTensorInfo));
    for (const cJSON *c = root->child; c; c = c->next) {
        if (c == meta) continue;
        if (parse_entry(c, &f->t[f->n], path, e) != 0) goto done;
        f->n++;
    }

    /* Rule 8: sorted by begin, the tensors tile the buffer exactly. */
    qsort(f->t, (size_t)f->n, sizeof *f->t, cmp_begin);
    uint64_t pos = 0, buf_size = file_size - f->data_start;
    for (int i = 0; i < f->n; i++) {
        const StTensorInfo *t = &f->t[i];
        char nb[80], pb[80];
        if (t->begin > pos) {
            if (i == 0)
                err_set(e, "%s: hole in the data buffer: the first tensor '%s' starts at byte %" PRIu64 ", not 0 (hint: %s)",
                        path, PRINTABLE(t->name, nb), t->begin, HINT_CORRUPT);
            else
                err_set(e, "%s: hole in the data buffer: %" PRIu64 " unused bytes between tensors '%s' and '%s' (hint: %s)",
                        path, t->begin - pos, PRINTABLE(f->t[i - 1].name, pb), PRINTABLE(t->name, nb), HINT_CORRUPT);
            goto done;
        }
        if (t->begin < pos) {
            err_set(e, "%s: tensors '%s' and '%s' overlap in the data buffer (hint: %s)", path,
                    PRINTABLE(f->t[i - 1].name, pb), PRINTABLE(t->name, nb), HINT_CORRUPT);
            goto done;
        }
        pos = t->end;
    }
    if (pos > buf_size) {
        err_set(e, "%s: truncated: the tensors need %" PRIu64 " data bytes but the file has only %" PRIu64 " (hint: %s)",
                path, pos, buf_size, HINT_TRUNC);
        goto done;
    }
    if (pos < buf_size) {
        err_set(e, "%s: the last %" PRIu64 " bytes of the data buffer are not covered by any tensor (hint: %s)",
                path, buf_size - pos, HINT_CORRUPT);
        goto done;
    }

    f->by_name = xmalloc((size_t)f->n * sizeof *f->by_name);
    for (int i = 0; i < f->n; i++) f->by_name[i] = &f->t[i];
    qsort(f->by_name, (size_t)f->n, sizeof *f->by_name, cmp_info_name);
    rc = 0;
done:
    cJSON_Delete(root);
    return rc;
}

StFile *st_open(const char *path, Err *e) {
    StFile *f = xcalloc(1, sizeof *f);
    f->path = xstrdup(path);
    char *h = NULL;
    /* O_NONBLOCK so a FIFO cannot hang the open; it has no effect on regular files. */
    f->fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (f->fd < 0) {
        err_set(e, "%s: cannot open: %s (hint: check the path)", path, strerror(errno));
        goto fail;
    }
    struct stat sb;
    if (fstat(f->fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        err_set(e, "%s: not a regular file (hint: %s)", path, HINT_NOT_ST);
        goto fail;
    }
    uint64_t size = (uint64_t)sb.st_size;
    /* Rule 1. */
    unsigned char len8[8];
    if (size < 8 || pread_full(f->fd, len8, 8, 0) != 8) {
        err_set(e, "%s: file too short (%" PRIu64 " bytes): a safetensors file starts with an 8-byte header length (hint: %s)",
                path, size, HINT_TRUNC);
        goto fail;
    }
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = (n << 8) | len8[i];
    if (n > ST_MAX_HEADER) {
        err_set(e, "%s: not a safetensors file: header length %" PRIu64 " is absurd (> %llu) (hint: %s)",
                path, n, ST_MAX_HEADER, HINT_NOT_ST);
        goto fail;
    }
    f->data_start = 8 + n; /* cannot overflow: n <= 10^8 */
    if (f->data_start > size) {
        err_set(e, "%s: truncated: the header declares %" PRIu64 " bytes but only %" PRIu64 " follow (hint: %s)",
                path, n, size - 8, HINT_TRUNC);
        goto fail;
    }
    h = xmalloc((size_t)n + 1);
    ssize_t got = pread_full(f->fd, h, (size_t)n, 8);
    if (got < 0 || (uint64_t)got != n) {
        err_set(e, "%s: truncated: could not read the %" PRIu64 "-byte header (%s) (hint: %s)", path, n,
                got < 0 ? strerror(errno) : "file shrank while reading", HINT_TRUNC);
        goto fail;
    }
    h[n] = 0;
    /* Rule 2, first part: control bytes are invalid anywhere in JSON, but
     * cJSON skips every byte <= 0x20 (NUL included) as whitespace. */
    for (uint64_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)h[i];
        if (c < 0x20 && !json_ws((char)c)) {
            err_set(e, "%s: header has a control character (byte 0x%02x) at byte %" PRIu64 " (hint: %s)",
                    path, c, 8 + i, HINT_CORRUPT);
            goto fail;
        }
    }
    if (parse_header(f, h, n, size, e) != 0) goto fail;
    free(h);
    return f;
fail:
    free(h);
    st_close(f);
    return NULL;
}

int st_count(const StFile *f) { return f->n; }

const StTensorInfo *st_get(const StFile *f, int i) { return i >= 0 && i < f->n ? &f->t[i] : NULL; }

const StTensorInfo *st_find(const StFile *f, const char *name) {
    int lo = 0, hi = f->n - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        const StTensorInfo *t = f->by_name[mid];
        int c = strcmp(name, t->name);
        if (c == 0) return t;
        if (c < 0) hi = mid - 1;
        else lo = mid + 1;
    }
    return NULL;
}

const char *st_meta(const StFile *f, const char *key) {
    for (int i = 0; i < f->nmeta; i++)
        if (strcmp(f->meta_keys[i], key) == 0) return f->meta_values[i];
    return NULL;
}

int st_meta_count(const StFile *f) { return f->nmeta; }
const char *st_meta_key(const StFile *f, int i) { return i >= 0 && i < f->nmeta ? f->meta_keys[i] : NULL; }
const char *st_path(const StFile *f) { return f->path; }

int st_read(StFile *f, const StTensorInfo *t, void *dst, size_t dst_bytes, Err *e) {
    char nb[80];
    if (!t) return err_set(e, "%s: st_read called without a tensor (hint: this is a bug in the caller: check st_find's result)", f->path);
    uint64_t bytes = t->end - t->begin;
    if (dst_bytes != bytes)
        return err_set(e, "%s: tensor '%s' has %" PRIu64 " bytes but the destination buffer has %zu (hint: this is a bug in the caller)",
                       f->path, PRINTABLE(t->name, nb), bytes, dst_bytes);
    ssize_t got = pread_full(f->fd, dst, (size_t)bytes, f->data_start + t->begin);
    if (got < 0)
        return err_set(e, "%s: reading tensor '%s' failed: %s (hint: check the disk)", f->path, PRINTABLE(t->name, nb),
                       strerror(errno));
    if ((uint64_t)got != bytes)
        return err_set(e, "%s: truncated: tensor '%s' ends past the end of the file, which changed since it was opened (hint: %s)",
                       f->path, PRINTABLE(t->name, nb), HINT_TRUNC);
    return 0;
}

int st_read_f32(StFile *f, const char *name, int ndim, const int64_t *shape, float *dst, Err *e) {
    char nb[80], want[200], have[200];
    if (ndim < 0 || ndim > ST_MAX_DIMS)
        return err_set(e, "%s: tensor '%s': requested %d dimensions (hint: this is a bug in the caller)",
                       f->path, PRINTABLE(name, nb), ndim);
    const StTensorInfo *t = st_find(f, name);
    format_shape(want, sizeof want, ndim, shape);
    if (!t)
        return err_set(e, "%s: tensor '%s' not found (expected F32 %s) (hint: the checkpoint was written for a different model configuration?)",
                       f->path, PRINTABLE(name, nb), want);
    int same = t->ndim == ndim && t->dtype == ST_F32;
    for (int i = 0; same && i < ndim; i++) same = t->shape[i] == shape[i];
    if (!same) {
        format_shape(have, sizeof have, t->ndim, t->shape);
        return err_set(e, "%s: tensor '%s': expected F32 %s, the file has %s %s (hint: the checkpoint was written for a different model configuration?)",
                       f->path, PRINTABLE(name, nb), want, dtype_names[t->dtype], have);
    }
    return st_read(f, t, dst, t->numel * sizeof(float), e);
}

void st_close(StFile *f) {
    if (!f) return;
    if (f->fd >= 0) close(f->fd);
    for (int i = 0; i < f->n; i++) free(f->t[i].name);
    for (int i = 0; i < f->nmeta; i++) {
        free(f->meta_keys[i]);
        free(f->meta_values[i]);
    }
    free(f->t);
    free(f->by_name);
    free(f->meta_keys);
    free(f->meta_values);
    free(f->path);
    free(f);
}

/* ---------------------------------------------------------------- writing */

typedef struct {
    char *p;
    size_t n, cap;
} Buf;

static void buf_add(Buf *b, const char *s, size_t len) {
    if (b->n + len + 1 > b->cap) {
        while (b->n + len + 1 > b->cap) b->cap = b->cap ? 2 * b->cap : 256;
        b->p = xrealloc(b->p, b->cap);
    }
    memcpy(b->p + b->n, s, len);
    b->n += len;
    b->p[b->n] = 0;
}

static void buf_str(Buf *b, const char *s) { buf_add(b, s, strlen(s)); }

static void buf_u64(Buf *b, uint64_t v) {
    char num[24];
    snprintf(num, sizeof num, "%" PRIu64, v);
    buf_str(b, num);
}

/* JSON string literal; s is valid UTF-8, so only quotes, backslashes and
 * control characters need escaping. */
static void buf_json_string(Buf *b, const char *s) {
    buf_add(b, "\"", 1);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        char esc[8];
        if (c == '"' || c == '\\') {
            esc[0] = '\\';
            esc[1] = (char)c;
            buf_add(b, esc, 2);
        } else if (c < 0x20) {
            snprintf(esc, sizeof esc, "\\u%04x", c);
            buf_add(b, esc, 6);
        } else {
            buf_add(b, (const char *)&c, 1);
        }
    }
    buf_add(b, "\"", 1);
}

static int valid_utf8(const char *s) {
    size_t n = strlen(s);
    return utf8_invalid_at((const unsigned char *)s, n) == n;
}

static int valid_tensor_name(const char *s) {
    if (!*s || strcmp(s, "__metadata__") == 0) return 0;
    for (; *s; s++)
        if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9') || *s == '_' || *s == '.'))
            return 0;
    return 1;
}

/* Returns a name that occurs twice in names[0..n), or NULL. */
static const char *first_duplicate(const char **names, int n) {
    const char **s = xmalloc((size_t)n * sizeof *s);
    memcpy(s, names, (size_t)n * sizeof *s);
    qsort(s, (size_t)n, sizeof *s, cmp_str);
    const char *dup = NULL;
    for (int i = 1; i < n && !dup; i++)
        if (strcmp(s[i - 1], s[i]) == 0) dup = s[i];
    free(s);
    return dup;
}

static int cmp_save_order(const void *a, const void *b) {
    const StTensorIn *x = *(const StTensorIn *const *)a, *y = *(const StTensorIn *const *)b;
    size_t sx = dtype_sizes[x->dtype], sy = dtype_sizes[y->dtype];
    if (sx != sy) return sx > sy ? -1 : 1;
    return strcmp(x->name, y->name);
}

/* Checks what st_save was given; fills bytes[i]. Nothing is written yet. */
static int check_save_input(const char *path, const StTensorIn *t, int nt, const StMeta *meta, int nmeta,
                            uint64_t *bytes, Err *e) {
    if (nt < 0 || nmeta < 0 || (nt > 0 && !t) || (nmeta > 0 && !meta))
        return err_set(e, "%s: invalid tensor or metadata list (hint: this is a bug in the caller)", path);
    uint64_t total = 0;
    for (int i = 0; i < nt; i++) {
        char nb[80], sb[200];
        if (!t[i].name || !valid_tensor_name(t[i].name))
            return err_set(e, "%s: invalid tensor name '%s' (hint: names must be non-empty, use only A-Z a-z 0-9 _ . and not be __metadata__)",
                           path, t[i].name ? PRINTABLE(t[i].name, nb) : "(null)");
        const char *name = t[i].name;
        if ((unsigned)t[i].dtype >= ST_NDTYPES)
            return err_set(e, "%s: tensor '%s' has an invalid dtype %d (hint: this is a bug in the caller)", path, name,
                           (int)t[i].dtype);
        if (t[i].ndim < 0 || t[i].ndim > ST_MAX_DIMS)
            return err_set(e, "%s: tensor '%s' has %d dimensions; 0 to %d are allowed (hint: this is a bug in the caller)",
                           path, name, t[i].ndim, ST_MAX_DIMS);
        uint64_t numel = 1;
        int ok = 1;
        for (int k = 0; k < t[i].ndim; k++) ok &= t[i].shape[k] >= 0 && (uint64_t)t[i].shape[k] <= ST_MAX_INT;
        for (int k = 0; ok && k < t[i].ndim; k++) {
            uint64_t d = (uint64_t)t[i].shape[k];
            if (d && numel > ST_MAX_INT / d) ok = 0;
            numel *= d;
        }
        /* The reader accepts offsets up to 2^53, so the file must stay below. */
        uint64_t b = numel * dtype_sizes[t[i].dtype];
        if (!ok || b > ST_MAX_INT - total) {
            format_shape(sb, sizeof sb, t[i].ndim, t[i].shape);
            return err_set(e, "%s: tensor '%s' has an invalid or too large shape %s (hint: dimensions must be >= 0 and the file below 2^53 bytes)",
                           path, name, sb);
        }
        if (b > 0 && !t[i].data)
            return err_set(e, "%s: tensor '%s' has no data pointer (hint: this is a bug in the caller)", path, name);
        bytes[i] = b;
        total += b;
    }
    const char **names = xmalloc((size_t)(nt > nmeta ? nt : nmeta) * sizeof *names);
    for (int i = 0; i < nt; i++) names[i] = t[i].name;
    const char *dup = first_duplicate(names, nt);
    if (dup) {
        free(names);
        return err_set(e, "%s: duplicate tensor name '%s' (hint: every tensor needs its own name)", path, dup);
    }
    for (int i = 0; i < nmeta; i++) {
        if (!meta[i].key || !meta[i].value || !valid_utf8(meta[i].key) || !valid_utf8(meta[i].value)) {
            free(names);
            return err_set(e, "%s: metadata entry %d is NULL or not valid UTF-8 (hint: metadata keys and values must be UTF-8 strings)",
                           path, i);
        }
        names[i] = meta[i].key;
    }
    dup = first_duplicate(names, nmeta);
    if (dup) {
        char db[80];
        err_set(e, "%s: duplicate metadata key '%s' (hint: every metadata key must be unique)", path, PRINTABLE(dup, db));
    }
    free(names);
    return dup ? -1 : 0;
}

int st_save(const char *path, const StTensorIn *t, int nt, const StMeta *meta, int nmeta, Err *e) {
    uint64_t *bytes = xmalloc((size_t)(nt > 0 ? nt : 1) * sizeof *bytes);
    if (check_save_input(path, t, nt, meta, nmeta, bytes, e) != 0) {
        free(bytes);
        return -1;
    }
    /* Decreasing element size then name: with a header padded to 8 bytes,
     * every tensor starts at a multiple of its element size. */
    const StTensorIn **order = xmalloc((size_t)(nt > 0 ? nt : 1) * sizeof *order);
    for (int i = 0; i < nt; i++) order[i] = &t[i];
    qsort(order, (size_t)nt, sizeof *order, cmp_save_order);

    /* Numbers are printed here, not by cJSON, which would write 1e+15. */
    Buf h = {0};
    buf_str(&h, "{");
    if (nmeta > 0) {
        buf_str(&h, "\"__metadata__\":{");
        for (int i = 0; i < nmeta; i++) {
            if (i) buf_str(&h, ",");
            buf_json_string(&h, meta[i].key);
            buf_str(&h, ":");
            buf_json_string(&h, meta[i].value);
        }
        buf_str(&h, "}");
    }
    uint64_t off = 0;
    for (int j = 0; j < nt; j++) {
        const StTensorIn *x = order[j];
        if (j || nmeta > 0) buf_str(&h, ",");
        buf_json_string(&h, x->name);
        buf_str(&h, ":{\"dtype\":\"");
        buf_str(&h, dtype_names[x->dtype]);
        buf_str(&h, "\",\"shape\":[");
        for (int k = 0; k < x->ndim; k++) {
            if (k) buf_str(&h, ",");
            buf_u64(&h, (uint64_t)x->shape[k]);
        }
        buf_str(&h, "],\"data_offsets\":[");
        buf_u64(&h, off);
        buf_str(&h, ",");
        off += bytes[x - t];
        buf_u64(&h, off);
        buf_str(&h, "]}");
    }
    buf_str(&h, "}");
    while (h.n % 8) buf_str(&h, " ");

    int rc = -1;
    AtomicFile af;
    if (h.n > ST_MAX_HEADER) {
        err_set(e, "%s: the header would be %zu bytes, over the %llu-byte limit of safetensors readers (hint: shorten the metadata)",
                path, h.n, ST_MAX_HEADER);
        goto done;
    }
    if (atomic_open(&af, path, e) != 0) goto done;
    unsigned char len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (unsigned char)((uint64_t)h.n >> (8 * i));
    if (atomic_write(&af, len8, 8, e) != 0 || atomic_write(&af, h.p, h.n, e) != 0) goto abort;
    for (int j = 0; j < nt; j++)
        if (atomic_write(&af, order[j]->data, (size_t)bytes[order[j] - t], e) != 0) goto abort;
    rc = atomic_commit(&af, e);
    goto done;
abort:
    atomic_abort(&af);
done:
    free(h.p);
    free(order);
    free(bytes);
    return rc;
}
