/* Declarations shared by the files of the W&B client and by nothing else;
 * the interface for the rest of kvlab is wandb.h. The files, each using only
 * those above it (docs/wandb.md, "Source"):
 *   util.c   "wandb: ..." lines, settings, strings, JSON text, cJSON items
 *   http.c   the Uplink: requests with retries and backoff, deadlines, the
 *            grace of refused connections, the API key
 *   api.c    the run API: UpsertBucket, FileStream, file uploads, and the
 *            cursor in sync_state.json
 *   spool.c  the spool: key/value rows, writing and reading spool.jsonl,
 *            files in the spool
 *   sync.c   wandb_sync_dir and wandb_attach_spool (make wandb-sync)
 *   run.c    WandbRun: the in-process client and its upload thread
 * wandb_sync_main.c (the wandb_sync program) uses util.c too.
 * The functions below are link-visible in every program that links the
 * client (the trainers), so they are all named wb_*; generic type, constant
 * and macro names carry Wb / WB_ as well. What one file alone uses stays
 * static there. */
#ifndef KVLAB_WANDB_INTERNAL_H
#define KVLAB_WANDB_INTERNAL_H

#include "wandb.h"

#include <cjson/cJSON.h>
#include <curl/curl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define WB_DEFAULT_BASE "https://api.wandb.ai"
#define WB_HIST_PREFIX "{\"t\":\"history\",\"row\":"

/* ---------------------------------------------------------------- util.c */

void wb_say(const char *fmt, ...) KV_PRINTF(1, 2);
const char *wb_env(const char *name); /* NULL when unset or empty */
const char *wb_first(const char *a, const char *b); /* the first non-empty one, or NULL */
char *wb_xstrndup(const char *s, size_t n);
char *wb_join(const char *a, const char *b); /* a/b, allocated */
double wb_setting(double v, const char *var, double dflt);
uint64_t wb_rng_next(uint64_t *s);

typedef struct {
    char *p;
    size_t n, cap;
} WbBuf;

void wb_buf_add(WbBuf *b, const char *s, size_t n);
void wb_buf_puts(WbBuf *b, const char *s);
void wb_buf_printf(WbBuf *b, const char *fmt, ...) KV_PRINTF(2, 3);
void wb_buf_json_str(WbBuf *b, const char *s);

const char *wb_str_item(const cJSON *o, const char *key);
void wb_add_str(cJSON *o, const char *key, const char *v);
int wb_in_array(const cJSON *a, const char *s);

/* ---------------------------------------------------------------- http.c */

typedef enum { WB_GRAPHQL, WB_UPSERT, WB_FILESTREAM, WB_STORAGE } WbKind;

/* Everything needed to talk to the server about one run, shared by the
 * online worker and wandb_sync_dir. */
typedef struct {
    CURL *curl;
    struct curl_slist *json_headers;
    char *base, *key;
    double http_timeout, fs_timeout, retry_min, retry_max, min_gap;
    long request_bytes;
    uint64_t rng;
    double last_fs;    /* start of the last FileStream request (pacing, heartbeats) */
    double not_before; /* no request before this time (Retry-After, RateLimit-Reset) */
    pthread_mutex_t mu; /* also guards the run's queue (WandbRun) */
    pthread_cond_t cv;
    double deadline;    /* guarded by mu: give up once passed (init and finish bounds) */
    double bound_start; /* guarded by mu: when the deadline was set */
    double refused_grace; /* guarded by mu: stop retrying once connections were refused this long (INFINITY: never) */
    int refused;        /* the last request failed on a refused connection (nothing listening) */
    /* the run as the server names it, from the UpsertBucket answer */
    char *entity, *project, *run_id, *url, *fs_url;
    /* the cursor, persisted in sync_state.json */
    char *state_path;
    long hist_offset; /* server line number of the next history line */
    long hist_sent;   /* spool history records acknowledged */
    cJSON *uploaded;  /* run paths acknowledged in "uploaded" */
    int complete, state_failed;
    atomic_int spool_short; /* the spool stopped taking records (a failed write): history_sent may exceed its rows */
    int exit_known, exit_code; /* the run's exit code went up with "complete" (a short spool may not hold it) */
} Uplink;

typedef struct {
    long status; /* 0: no HTTP answer (connection error, timeout, reset) */
    CURLcode cc;
    WbBuf body;
    double retry_after;            /* seconds, < 0: no header */
    double rl_remaining, rl_reset; /* RateLimit-* headers, rl_remaining < 0: none */
} WbResp;

void wb_uplink_setup(Uplink *u, const WandbSettings *s);
void wb_uplink_free(Uplink *u);
void wb_set_bounds_locked(Uplink *u, double d, double grace);
void wb_set_bounds(Uplink *u, double d, double grace);
void wb_wait_until(Uplink *u, double t);
int wb_request(Uplink *u, WbKind kind, const char *url, struct curl_slist *headers, const char *body, size_t len,
               FILE *upload, curl_off_t upload_size, WbResp *r, Err *e);
void wb_server_message(const cJSON *j, WbBuf *m);
char *wb_find_key(const WandbSettings *s, const char *base, Err *e);

/* ---------------------------------------------------------------- api.c */

int wb_upsert(Uplink *u, const cJSON *run, const cJSON *config, long *lines, int *inserted, Err *e);
char *wb_filestream_body(long offset, char *const *lines, long n, const char *summary, const cJSON *uploaded,
                         int complete, int exit_code, size_t *len);
int wb_filestream(Uplink *u, const char *body, size_t len, int *stopped, Err *e);
void wb_state_save(Uplink *u);
int wb_state_load(Uplink *u, Err *e);
void wb_state_reopen(const char *dir);
int wb_upload_files(Uplink *u, const char *spool_dir, const cJSON *paths, cJSON *done, Err *e);

/* ---------------------------------------------------------------- spool.c */

/* A history row or the summary: keys are kept as JSON string literals
 * (quotes included), so rows are written and compared without re-escaping. */
typedef struct {
    char *key;
    double v;
} WbItem;
typedef struct {
    WbItem *it;
    int n, cap;
} WbKV;

void wb_kv_set(WbKV *kv, const char *key, size_t klen, double v);
void wb_kv_clear(WbKV *kv);
void wb_kv_free(WbKV *kv);
void wb_kv_json(WbBuf *b, const WbKV *kv);
void wb_summary_json(WbBuf *b, const WbKV *kv);
void wb_summary_record(WbBuf *b, const WbKV *kv);

/* The spool of a run being written (spool.jsonl opened for appending). After a failed write it takes no more
 * records, so that it stays what a sync can replay: the run's records up to one, in order, with none missing. */
typedef struct {
    char *dir;   /* <root>/wandb-c/<run_id>[-k], NULL without a spool */
    int fd;
    off_t size;  /* bytes of whole records written */
    int failed;  /* a write failed: the records from there on are not in the spool */
    atomic_int *failed_flag; /* set too when a write fails (the run's Uplink.spool_short), or NULL */
} SpoolWriter;

void wb_spool_open(SpoolWriter *w, const char *root, const char *run_id);
void wb_spool_write(SpoolWriter *w, const char *rec, size_t n);
void wb_spool_json(SpoolWriter *w, cJSON *rec);
void wb_spool_close(SpoolWriter *w);
int wb_spool_append(const char *dir, const char *rec, size_t n, Err *e);
int wb_valid_run_path(const char *p);
int wb_copy_into_spool(const char *spool_dir, const char *local_path, const char *run_path, Err *e);

/* A spool read back (wb_spool_read). */
typedef struct {
    cJSON *run, *config, *files; /* run record, latest config, run paths in first-seen order */
    char **rows;                 /* history lines, exactly as spooled */
    long nrows;
    WbKV summary;                  /* replayed: rows fold in, summary records replace */
    int has_exit, exit_code;
} Spool;

int wb_spool_read(const char *dir, Spool *sp, Err *e);
void wb_spool_free(Spool *sp);
char *wb_newest_spool(const char *root);

#endif
