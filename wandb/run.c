/* WandbRun, the in-process client the trainers use (wandb.h).
 *
 * The training thread appends every record to the spool
 * (<dir>/wandb-c/<run_id>/spool.jsonl) and, when online, queues history
 * lines for one worker thread that owns the libcurl handle. The worker
 * batches the queue into FileStream requests, retries each request with the
 * same body, sends heartbeats, and writes the acknowledged offsets to
 * sync_state.json after every success; wandb_sync_dir (sync.c) replays a
 * spool from that cursor with the same request code. */
#define _GNU_SOURCE
#include "internal.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_LINE 10383360L             /* longest history line W&B stores (10 MiB - 100 KiB) */
#define QUEUE_BYTES ((size_t)256 << 20) /* unsent rows kept in memory before the upload gives up */
#define CONNECT_GRACE_S 5.0            /* default of WANDB_CONNECT_GRACE: how long refused connections are retried in a bounded wait */
#define SYNC_HINT "continuing offline, sync later with make wandb-sync"

typedef struct Line {
    struct Line *next;
    size_t len;
    char text[];
} Line;

struct WandbRun {
    Uplink up;
    pthread_t worker;
    int has_worker;
    SpoolWriter spool;
    double t0, flush_s, heartbeat_s, finish_timeout_s, connect_grace_s;
    cJSON *run_rec, *config; /* kept until the worker has created the run (wandb_init found nothing listening) */
    atomic_int connected;    /* the run exists on the server; up.url and the names are set */
    /* training thread only */
    WbKV row;
    long row_step, last_step; /* last_step: the last closed row, -1 before the first */
    long dropped;
    /* shared with the worker, guarded by up.mu */
    WbKV summary;
    int summary_dirty;
    Line *head, *tail;
    size_t queued_bytes;
    cJSON *files_pending;    /* run paths to upload */
    cJSON *uploaded_pending; /* uploaded, to report in the next FileStream request */
    int finishing, exit_code, gave_up, completed;
    atomic_int stopped;
};

static void spool_summary(WandbRun *r) {
    WbBuf b = {0};
    pthread_mutex_lock(&r->up.mu);
    wb_summary_record(&b, &r->summary);
    pthread_mutex_unlock(&r->up.mu);
    wb_spool_write(&r->spool, b.p, b.n);
    free(b.p);
}

static int valid_run_id(const char *id) {
    size_t n = strlen(id);
    return n && !strpbrk(id, ":;,#?/'") && !strchr(" \t\r\n", id[0]) && !strchr(" \t\r\n", id[n - 1]) &&
           strcmp(id, ".") && strcmp(id, "..");
}

static cJSON *parse_tags(const char *tags) {
    cJSON *a = cJSON_CreateArray();
    for (const char *s = tags ? tags : ""; *s;) {
        size_t n = strcspn(s, ",");
        char *t = wb_xstrndup(s, n);
        char *b = t + strspn(t, " \t");
        for (size_t k = strlen(b); k > 0 && strchr(" \t", b[k - 1]); k--) b[k - 1] = 0;
        if (strlen(b) > 64)
            wb_say("tag \"%s\" is longer than 64 characters; left out", b);
        else if (*b)
            cJSON_AddItemToArray(a, cJSON_CreateString(b));
        free(t);
        s += n + (s[n] == ',');
    }
    return a;
}

static void queue_free(WandbRun *r) {
    while (r->head) {
        Line *l = r->head;
        r->head = l->next;
        free(l);
    }
    r->tail = NULL;
    r->queued_bytes = 0;
}

typedef struct {
    Line *first; /* the lines taken, linked */
    char **text;
    long n;
    char *summary;
    cJSON *uploaded;
} Batch;

/* Under the lock: takes up to request_bytes of queued lines (at least one),
 * the summary if it changed, and the uploaded notices. */
static void take_batch(WandbRun *r, Batch *b) {
    size_t bytes = 0;
    memset(b, 0, sizeof *b);
    Line **link = &b->first;
    while (r->head && (b->n == 0 || bytes + r->head->len <= (size_t)r->up.request_bytes)) {
        Line *l = r->head;
        r->head = l->next;
        r->queued_bytes -= l->len;
        bytes += l->len;
        l->next = NULL;
        *link = l;
        link = &l->next;
        b->n++;
    }
    if (!r->head) r->tail = NULL;
    b->text = xmalloc((size_t)(b->n + 1) * sizeof *b->text);
    long i = 0;
    for (Line *l = b->first; l; l = l->next) b->text[i++] = l->text;
    if (r->summary_dirty) {
        WbBuf s = {0};
        wb_summary_json(&s, &r->summary);
        b->summary = s.p;
        r->summary_dirty = 0;
    }
    b->uploaded = r->uploaded_pending;
    r->uploaded_pending = cJSON_CreateArray();
}

static void batch_free(Batch *b) {
    while (b->first) {
        Line *l = b->first;
        b->first = l->next;
        free(l);
    }
    free(b->text);
    free(b->summary);
    cJSON_Delete(b->uploaded);
}

/* Creates the run on the server (UpsertBucket from the run record) and sets
 * up the cursor the uploads and a later sync go by. Called by wandb_init,
 * or by the worker when wandb_init found nothing listening. */
static int create_run(WandbRun *r, Err *e) {
    Uplink *u = &r->up;
    long lines = 0;
    int inserted = 1;
    if (wb_upsert(u, r->run_rec, cJSON_IsObject(r->config) ? r->config : NULL, &lines, &inserted, e) != 0) return -1;
    if (!inserted)
        wb_say("run %s already exists in %s/%s; its history continues after line %ld "
               "(hint: log steps above the last one stored there, or use a new WANDB_RUN_ID)",
               u->run_id, u->entity, u->project, lines);
    u->hist_offset = lines;
    u->state_path = r->spool.dir ? wb_join(r->spool.dir, "sync_state.json") : NULL;
    wb_state_save(u);
    atomic_store(&r->connected, 1);
    return 0;
}

/* The worker's first job when wandb_init went offline for now because
 * nothing listened at the server's address: retry creating the run with
 * backoff, for as long as connections are refused, until the server
 * answers. The rows queued meanwhile then go up in order like any backlog.
 * wandb_finish sets the refusal grace again, so a server still absent at
 * the end costs one last attempt, not the finish bound. */
static int worker_connect(WandbRun *r) {
    Uplink *u = &r->up;
    Err e;
    for (;;) {
        int rc = create_run(r, &e);
        pthread_mutex_lock(&u->mu);
        int stop = r->finishing || r->gave_up;
        pthread_mutex_unlock(&u->mu);
        if (rc == 0) {
            wb_say("%s answers now; logging to %s", u->base, u->url);
            return 0;
        }
        if (stop || !u->refused) {
            wb_say("cannot create the run on %s: %s; %s", u->base, e.msg,
                   stop ? "the run stays in the spool" : SYNC_HINT);
            return -1;
        }
    }
}

/* The upload thread: creates the run if wandb_init could not, then files
 * first, data every flush interval, a heartbeat after heartbeat_s of
 * silence, and at finish the rest plus "complete". Any failure it cannot
 * retry stops the upload for good; the spool has it all. */
static void *worker_main(void *arg) {
    WandbRun *r = arg;
    Uplink *u = &r->up;
    Err e;
    if (!atomic_load(&r->connected)) {
        int rc = worker_connect(r);
        pthread_mutex_lock(&u->mu);
        if (rc != 0) r->gave_up = 1;
        u->last_fs = wall_seconds() - r->flush_s; /* the backlog goes at once */
        pthread_mutex_unlock(&u->mu);
    }
    pthread_mutex_lock(&u->mu);
    while (!r->gave_up) {
        int have_files = cJSON_GetArraySize(r->files_pending) > 0;
        int have_data = r->head || r->summary_dirty || cJSON_GetArraySize(r->uploaded_pending) > 0;
        double due = u->last_fs + (have_data ? r->flush_s : r->heartbeat_s);
        if (!have_files && !r->finishing && wall_seconds() < due) {
            wb_wait_until(u, due);
            continue;
        }
        if (have_files) {
            cJSON *paths = r->files_pending, *done = cJSON_CreateArray(), *it;
            r->files_pending = cJSON_CreateArray();
            pthread_mutex_unlock(&u->mu);
            if (wb_upload_files(u, r->spool.dir, paths, done, &e) != 0)
                wb_say("file upload failed: %s; the file stays in %s/files", e.msg, r->spool.dir);
            pthread_mutex_lock(&u->mu);
            cJSON_ArrayForEach(it, done) cJSON_AddItemToArray(r->uploaded_pending, cJSON_CreateString(it->valuestring));
            cJSON_Delete(paths);
            cJSON_Delete(done);
            continue;
        }
        Batch b;
        take_batch(r, &b);
        /* "complete" goes with the last data, but only after "uploaded" notices were acknowledged */
        int final = r->finishing && !r->head && !cJSON_GetArraySize(b.uploaded), code = r->exit_code;
        pthread_mutex_unlock(&u->mu);

        size_t len;
        char *body = wb_filestream_body(u->hist_offset, b.text, b.n, b.summary, b.uploaded, final, code, &len);
        int stopped = 0, rc = wb_filestream(u, body, len, &stopped, &e);
        free(body);
        if (rc == 0) {
            const cJSON *it;
            if (stopped) atomic_store(&r->stopped, 1);
            u->hist_offset += b.n;
            u->hist_sent += b.n;
            cJSON_ArrayForEach(it, b.uploaded) cJSON_AddItemToArray(u->uploaded, cJSON_CreateString(it->valuestring));
            u->complete = final;
            if (final) u->exit_known = 1, u->exit_code = code;
            wb_state_save(u);
        }
        batch_free(&b);

        pthread_mutex_lock(&u->mu);
        if (rc != 0) {
            r->gave_up = 1;
            wb_say("upload to %s stopped: %s; %s", u->url, e.msg,
                   r->finishing ? "the rest is in the spool" : SYNC_HINT);
        } else if (final) {
            r->completed = 1;
            break;
        }
    }
    queue_free(r);
    pthread_mutex_unlock(&u->mu);
    return NULL;
}

static void drop(WandbRun *r, long step, const char *key) {
    if (r->dropped++ == 0)
        wb_say("\"%s\" at step %ld dropped: steps must increase and keys must not start with '_' "
               "(further drops are only counted)", key, step);
}

/* Closes the open row: adds _step, _runtime (monotonic) and _timestamp, spools
 * it, queues it for upload and folds it into the summary. */
static void close_row(WandbRun *r) {
    if (!r->row.n) return;
    wb_kv_set(&r->row, "\"_step\"", 7, (double)r->row_step);
    wb_kv_set(&r->row, "\"_runtime\"", 10, round((wall_seconds() - r->t0) * 1e6) / 1e6); /* microseconds: short lines */
    wb_kv_set(&r->row, "\"_timestamp\"", 12, round(unix_seconds() * 1e6) / 1e6);
    r->last_step = r->row_step;
    WbBuf rec = {0};
    wb_buf_puts(&rec, WB_HIST_PREFIX);
    size_t start = rec.n;
    wb_kv_json(&rec, &r->row);
    size_t len = rec.n - start;
    if (len > (size_t)MAX_LINE) {
        wb_say("the row of step %ld is %zu bytes, over W&B's limit of %ld; dropped", r->row_step, len, MAX_LINE);
    } else {
        wb_buf_puts(&rec, "}\n");
        wb_spool_write(&r->spool, rec.p, rec.n);
        pthread_mutex_lock(&r->up.mu);
        for (int i = 0; i < r->row.n; i++) wb_kv_set(&r->summary, r->row.it[i].key, strlen(r->row.it[i].key), r->row.it[i].v);
        r->summary_dirty = 1;
        if (r->has_worker && !r->gave_up) {
            if (r->queued_bytes + len > QUEUE_BYTES) {
                r->gave_up = 1;
                pthread_cond_broadcast(&r->up.cv);
                wb_say("upload to %s fell %zu MiB behind; %s", r->up.base, QUEUE_BYTES >> 20, SYNC_HINT);
            } else {
                Line *l = xmalloc(sizeof *l + len + 1);
                l->next = NULL;
                l->len = len;
                memcpy(l->text, rec.p + start, len);
                l->text[len] = 0;
                if (r->tail)
                    r->tail->next = l;
                else {
                    r->head = l;
                    pthread_cond_signal(&r->up.cv); /* the worker now waits for the flush interval, not the heartbeat */
                }
                r->tail = l;
                r->queued_bytes += len;
            }
        }
        pthread_mutex_unlock(&r->up.mu);
    }
    wb_kv_clear(&r->row);
    free(rec.p);
}

WandbRun *wandb_init(const WandbSettings *s) {
    const char *mode = wb_first(wb_env("WANDB_MODE"), wb_first(s->mode, "online"));
    if (!strcmp(mode, "disabled")) return NULL;
    int online = !strcmp(mode, "online");
    if (!online && strcmp(mode, "offline") && strcmp(mode, "dryrun"))
        wb_say("unknown mode \"%s\" (hint: online, offline or disabled); running offline", mode);

    WandbRun *r = xcalloc(1, sizeof *r);
    Uplink *u = &r->up;
    wb_uplink_setup(u, s);
    r->t0 = wall_seconds();
    r->flush_s = wb_setting(s->flush_interval_s, NULL, 10);
    r->heartbeat_s = wb_setting(s->heartbeat_s, NULL, 30);
    r->finish_timeout_s = wb_setting(s->finish_timeout_s, NULL, 120);
    r->connect_grace_s = wb_setting(s->connect_grace_s, "WANDB_CONNECT_GRACE", CONNECT_GRACE_S);
    r->last_step = -1;
    r->spool.fd = -1;
    r->files_pending = cJSON_CreateArray();
    r->uploaded_pending = cJSON_CreateArray();

    char generated[9];
    for (int i = 0; i < 8; i++) generated[i] = "abcdefghijklmnopqrstuvwxyz0123456789"[wb_rng_next(&u->rng) % 36];
    generated[8] = 0;
    const char *run_id = wb_first(s->run_id, wb_env("WANDB_RUN_ID"));
    if (run_id && !valid_run_id(run_id))
        wb_say("invalid run ID \"%s\" (hint: no outer spaces and none of : ; , # ? / '); using %s", run_id, generated);
    if (!run_id || !valid_run_id(run_id)) run_id = generated;

    cJSON *run = cJSON_CreateObject();
    char host[256] = "";
    gethostname(host, sizeof host - 1);
    cJSON_AddStringToObject(run, "t", "run");
    wb_add_str(run, "entity", wb_first(wb_env("WANDB_ENTITY"), s->entity));
    wb_add_str(run, "project", wb_first(wb_env("WANDB_PROJECT"), s->project));
    wb_add_str(run, "run_id", run_id);
    wb_add_str(run, "name", wb_first(wb_env("WANDB_NAME"), s->name));
    wb_add_str(run, "group", wb_first(wb_env("WANDB_RUN_GROUP"), s->group));
    wb_add_str(run, "job_type", wb_first(wb_env("WANDB_JOB_TYPE"), s->job_type));
    cJSON_AddItemToObject(run, "tags", parse_tags(wb_first(wb_env("WANDB_TAGS"), s->tags)));
    wb_add_str(run, "notes", wb_first(wb_env("WANDB_NOTES"), s->notes));
    wb_add_str(run, "host", host);
    wb_add_str(run, "program", program_invocation_name);
    wb_add_str(run, "commit", s->commit);
    cJSON_AddNumberToObject(run, "start_time", unix_seconds());
    cJSON *config = s->config_json ? cJSON_Parse(s->config_json) : NULL;
    if (s->config_json && !cJSON_IsObject(config))
        wb_say("the run config is not a JSON object; the run goes without one");

    r->spool.failed_flag = &r->up.spool_short; /* set by the failed write itself, before its row can be queued */
    wb_spool_open(&r->spool, wb_first(s->dir, wb_first(wb_env("WANDB_DIR"), "wandb")), run_id);
    wb_spool_json(&r->spool, run);
    if (cJSON_IsObject(config)) {
        cJSON *rec = cJSON_CreateObject();
        cJSON_AddStringToObject(rec, "t", "config");
        cJSON_AddItemReferenceToObject(rec, "config", config);
        wb_spool_json(&r->spool, rec);
        cJSON_Delete(rec);
    }

    Err e;
    r->run_rec = run;
    r->config = config;
    if (online && !(u->key = wb_find_key(s, u->base, &e))) {
        wb_say("%s; %s", e.msg, SYNC_HINT);
    } else if (online) {
        wb_set_bounds(u, wall_seconds() + wb_setting(s->init_timeout_s, "WANDB_INIT_TIMEOUT", 90), r->connect_grace_s);
        int rc = create_run(r, &e);
        if (rc != 0 && !u->refused)
            wb_say("cannot create the run on %s: %s; %s", u->base, e.msg, SYNC_HINT);
        else if (rc != 0) /* nothing listens (yet): the worker keeps trying */
            wb_say("cannot create the run on %s: %s; continuing offline for now, retrying in the background "
                   "(the rows go up live once the server answers; else sync later with make wandb-sync)",
                   u->base, e.msg);
        wb_set_bounds(u, INFINITY, INFINITY);
        u->last_fs = wall_seconds();
        if ((rc == 0 || u->refused) && pthread_create(&r->worker, NULL, worker_main, r) != 0)
            wb_say("cannot start the upload thread; %s", SYNC_HINT);
        else if (rc == 0 || u->refused) {
            r->has_worker = 1;
            if (rc == 0) wb_say("logging to %s", u->url);
        }
    }
    return r;
}

void wandb_log(WandbRun *r, long step, const char *key, double value) {
    if (!r) return;
    if (!key[0] || key[0] == '_' || step <= r->last_step || (r->row.n && step < r->row_step)) {
        drop(r, step, key);
        return;
    }
    if (r->row.n && step > r->row_step) close_row(r);
    r->row_step = step;
    WbBuf k = {0};
    wb_buf_json_str(&k, key);
    wb_kv_set(&r->row, k.p, k.n, value);
    free(k.p);
}

void wandb_commit(WandbRun *r, long step) {
    if (r && r->row.n && r->row_step <= step) close_row(r);
}

void wandb_summary_set(WandbRun *r, const char *key, double value) {
    if (!r) return;
    if (!key[0] || key[0] == '_') {
        drop(r, r->last_step, key);
        return;
    }
    WbBuf k = {0};
    wb_buf_json_str(&k, key);
    pthread_mutex_lock(&r->up.mu);
    wb_kv_set(&r->summary, k.p, k.n, value);
    r->summary_dirty = 1;
    pthread_mutex_unlock(&r->up.mu);
    free(k.p);
    spool_summary(r);
}

int wandb_upload_file(WandbRun *r, const char *local_path, const char *run_path) {
    if (!r) return 0;
    if (!wb_valid_run_path(run_path)) {
        wb_say("\"%s\" is not a path inside the run (hint: relative, '/'-separated, no . or .. parts)", run_path);
        return -1;
    }
    if (!r->spool.dir) {
        wb_say("%s not uploaded: the run has no spool folder", local_path);
        return -1;
    }
    Err e;
    int rc = wb_copy_into_spool(r->spool.dir, local_path, run_path, &e);
    if (rc != 0) {
        wb_say("%s; not uploaded", e.msg);
    } else {
        cJSON *rec = cJSON_CreateObject();
        cJSON_AddStringToObject(rec, "t", "file");
        cJSON_AddStringToObject(rec, "path", run_path);
        wb_spool_json(&r->spool, rec);
        cJSON_Delete(rec);
        pthread_mutex_lock(&r->up.mu);
        if (r->has_worker && !r->gave_up && !wb_in_array(r->files_pending, run_path)) {
            cJSON_AddItemToArray(r->files_pending, cJSON_CreateString(run_path));
            pthread_cond_signal(&r->up.cv);
        }
        pthread_mutex_unlock(&r->up.mu);
    }
    return rc;
}

int wandb_should_stop(const WandbRun *r) { return r ? atomic_load(&r->stopped) : 0; }

const char *wandb_run_url(const WandbRun *r) {
    return r && r->has_worker && atomic_load(&r->connected) ? r->up.url : NULL;
}

const char *wandb_spool_dir(const WandbRun *r) { return r ? r->spool.dir : NULL; }

void wandb_finish(WandbRun *r, int exit_code) {
    if (!r) return;
    close_row(r);
    spool_summary(r);
    char rec[64];
    snprintf(rec, sizeof rec, "{\"t\":\"exit\",\"code\":%d}\n", exit_code);
    wb_spool_write(&r->spool, rec, strlen(rec));
    wb_spool_close(&r->spool);
    if (r->has_worker) {
        pthread_mutex_lock(&r->up.mu);
        r->finishing = 1;
        r->exit_code = exit_code;
        r->summary_dirty = 1; /* the summary always goes right before completion */
        wb_set_bounds_locked(&r->up, wall_seconds() + r->finish_timeout_s, r->connect_grace_s);
        pthread_mutex_unlock(&r->up.mu);
        pthread_join(r->worker, NULL);
        if (r->completed) wb_say("run uploaded: %s", r->up.url);
    }
    if (r->dropped > 1) wb_say("%ld values were dropped in all (earlier steps or keys starting with '_')", r->dropped);
    if (!r->completed && r->spool.dir) wb_say("run saved in %s (hint: upload it with make wandb-sync)", r->spool.dir);
    wb_kv_free(&r->row);
    wb_kv_free(&r->summary);
    queue_free(r);
    cJSON_Delete(r->files_pending);
    cJSON_Delete(r->uploaded_pending);
    cJSON_Delete(r->run_rec);
    cJSON_Delete(r->config);
    wb_uplink_free(&r->up);
    free(r->spool.dir);
    free(r);
}
