/* safetensors reader and writer (formats.md section 1).
 *
 * Layout: u64 LE header length N, N bytes of JSON (padded with spaces), then
 * the tensor data back to back. The reader applies every validation rule of
 * formats.md 1.3 before handing out anything, reads only the header on open
 * and each tensor on demand with pread (no alignment assumed). The writer
 * streams tensors straight from the caller's memory into a temporary file
 * that is fsynced and renamed into place.
 *
 * Errors are one line: "<path>: <problem> (hint: <what to do>)".
 */
#ifndef KVLAB_SAFETENSORS_H
#define KVLAB_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "common.h"

#define ST_MAX_DIMS 8

typedef enum {
    ST_BOOL, ST_U8, ST_I8, ST_F8_E5M2, ST_F8_E4M3, ST_I16, ST_U16, ST_F16, ST_BF16,
    ST_I32, ST_U32, ST_F32, ST_F64, ST_I64, ST_U64, ST_NDTYPES
} StDtype;

size_t st_dtype_size(StDtype d);      /* bytes per element; 0 if out of range */
/* Parses a dtype name ("F32"); returns 0 and sets *d, or -1 if unknown. */
int st_dtype_parse(const char *name, StDtype *d);

/* ---- writing ---- */

typedef struct {
    const char *name;
    StDtype dtype;
    int ndim;                     /* 0 = scalar (1 element) */
    int64_t shape[ST_MAX_DIMS];
    const void *data;             /* little-endian, row-major; may be NULL when empty */
} StTensorIn;

typedef struct {
    const char *key;
    const char *value;            /* metadata values are strings only */
} StMeta;

/* Atomic write: header padded with spaces to a multiple of 8, tensors ordered
 * by decreasing element size then name (so each is naturally aligned),
 * streamed to a temporary file next to path, fsync, rename. Rejects (before
 * creating any file) duplicate or invalid names ([A-Za-z0-9_.] only,
 * non-empty, not "__metadata__"), bad shapes, duplicate metadata keys and
 * strings that are not valid UTF-8. */
int st_save(const char *path, const StTensorIn *t, int nt, const StMeta *meta, int nmeta, Err *e);

/* ---- reading ---- */

typedef struct {
    char *name;
    StDtype dtype;
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    uint64_t begin, end;          /* [begin, end) relative to the data buffer */
    size_t numel;
} StTensorInfo;

typedef struct StFile StFile;

/* Reads and validates the header and the offsets against the file size;
 * reads no tensor data. Returns NULL (and fills e) on any violation. */
StFile *st_open(const char *path, Err *e);
int st_count(const StFile *f);
const StTensorInfo *st_get(const StFile *f, int i);            /* file order (by begin); NULL if out of range */
const StTensorInfo *st_find(const StFile *f, const char *name); /* NULL if absent */
const char *st_meta(const StFile *f, const char *key);          /* NULL if absent */
int st_meta_count(const StFile *f);
const char *st_meta_key(const StFile *f, int i);                /* file order; NULL if out of range */
const char *st_path(const StFile *f);
/* Reads one tensor's bytes (t from st_get/st_find of this f). dst_bytes must
 * equal the tensor's byte size; a short read (file changed or truncated since
 * st_open) is an error. */
int st_read(StFile *f, const StTensorInfo *t, void *dst, size_t dst_bytes, Err *e);
/* For model loaders: checks that name exists with dtype F32 and exactly this
 * shape, then reads it. The error names the tensor, the expectation and what
 * the file has. */
int st_read_f32(StFile *f, const char *name, int ndim, const int64_t *shape, float *dst, Err *e);
void st_close(StFile *f);

#endif
