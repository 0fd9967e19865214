/* The spool: every record of a run as one line of
 * <dir>/wandb-c/<run_id>/spool.jsonl (the run, its config, history rows,
 * summaries, files, the exit code), the files themselves under files/
 * beside it. History rows and the summary are key/value rows (WbKV), written
 * as JSON and read back exactly. WandbRun (run.c) writes a spool as the run
 * goes; sync.c reads one back to upload it or to attach results to it. */
#define _GNU_SOURCE
#include "internal.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define SUMMARY_PREFIX "{\"t\":\"summary\",\"summary\":"

/* ---------------------------------------------------------------- key/value rows */

/* Shortest text that reads back as v; integral values print without a point
 * (so _step stays an integer); non-finite values as W&B's bare tokens. */
static void buf_num(WbBuf *b, double v) {
    char s[32];
    if (isnan(v))
        strcpy(s, "NaN");
    else if (isinf(v))
        strcpy(s, v > 0 ? "Infinity" : "-Infinity");
    else
        for (int digits = 15; digits <= 17; digits++) {
            snprintf(s, sizeof s, "%.*g", digits, v);
            if (strtod(s, NULL) == v) break;
        }
    wb_buf_puts(b, s);
}

void wb_kv_set(WbKV *kv, const char *key, size_t klen, double v) {
    for (int i = 0; i < kv->n; i++)
        if (strlen(kv->it[i].key) == klen && !memcmp(kv->it[i].key, key, klen)) {
            kv->it[i].v = v;
            return;
        }
    if (kv->n == kv->cap) {
        kv->cap = kv->cap ? 2 * kv->cap : 16;
        kv->it = xrealloc(kv->it, (size_t)kv->cap * sizeof *kv->it);
    }
    kv->it[kv->n++] = (WbItem){wb_xstrndup(key, klen), v};
}

void wb_kv_clear(WbKV *kv) {
    for (int i = 0; i < kv->n; i++) free(kv->it[i].key);
    kv->n = 0;
}

void wb_kv_free(WbKV *kv) {
    wb_kv_clear(kv);
    free(kv->it);
}

static double kv_get(const WbKV *kv, const char *key, double missing) {
    for (int i = 0; i < kv->n; i++)
        if (!strcmp(kv->it[i].key, key)) return kv->it[i].v;
    return missing;
}

void wb_kv_json(WbBuf *b, const WbKV *kv) {
    wb_buf_puts(b, "{");
    for (int i = 0; i < kv->n; i++) {
        if (i) wb_buf_puts(b, ",");
        wb_buf_puts(b, kv->it[i].key);
        wb_buf_puts(b, ":");
        buf_num(b, kv->it[i].v);
    }
    wb_buf_puts(b, "}");
}

/* The summary line: last values plus "_wandb": {"runtime": whole seconds}. */
void wb_summary_json(WbBuf *b, const WbKV *kv) {
    wb_kv_json(b, kv);
    b->p[--b->n] = 0; /* reopen the object */
    wb_buf_printf(b, "%s\"_wandb\":{\"runtime\":%ld}}", kv->n ? "," : "", (long)kv_get(kv, "\"_runtime\"", 0));
}

/* The spool record of a summary, newline included. */
void wb_summary_record(WbBuf *b, const WbKV *kv) {
    wb_buf_puts(b, SUMMARY_PREFIX);
    wb_summary_json(b, kv);
    wb_buf_puts(b, "}\n");
}

/* Reads a flat object written by wb_kv_json/wb_summary_json back (NaN and Infinity
 * through strtod); nested objects (_wandb) are skipped. *step (if step) gets the
 * value of its "_step", NaN without one. */
static int kv_parse(WbKV *kv, const char *s, double *step) {
    if (step) *step = NAN;
    if (*s++ != '{') return -1;
    if (*s == '}') return 0;
    for (;;) {
        const char *key = s;
        if (*s++ != '"') return -1;
        while (*s && *s != '"') s += s[0] == '\\' && s[1] ? 2 : 1;
        if (*s++ != '"') return -1;
        size_t klen = (size_t)(s - key);
        if (*s++ != ':') return -1;
        if (*s == '{') {
            s = strchr(s, '}');
            if (!s) return -1;
            s++;
        } else {
            char *end;
            double v = strtod(s, &end);
            if (end == s) return -1;
            wb_kv_set(kv, key, klen, v);
            if (step && klen == 7 && !memcmp(key, "\"_step\"", 7)) *step = v;
            s = end;
        }
        if (*s == '}') return 0;
        if (*s++ != ',') return -1;
    }
}

/* ---------------------------------------------------------------- writing */

/* Writes a record at the end of fd, which holds size bytes of whole records: 0, or an errno with any partial
 * record cut off again (-1 in *cut when even that failed: the file then ends in a partial line). */
static int write_record(int fd, off_t size, const char *rec, size_t n, int *cut) {
    size_t done = 0;
    ssize_t got = 0;
    *cut = 0;
    /* after a short write, writing the rest gives the error */
    while (done < n && (got = write(fd, rec + done, n - done)) > 0) done += (size_t)got;
    if (done == n) return 0;
    int err = got < 0 ? errno : ENOSPC;
    if (done > 0 && ftruncate(fd, size) != 0) *cut = -1;
    return err;
}

/* One write(2) per record, straight to the kernel: a crash loses at most the open row. The first write that
 * fails (a full disk) is cut off again and ends the spool: records after a gap would be replayed at the wrong
 * offsets, and a partial one would join the next into a damaged line. */
void wb_spool_write(SpoolWriter *w, const char *rec, size_t n) {
    if (w->fd < 0 || w->failed) return;
    int cut, err = write_record(w->fd, w->size, rec, n, &cut);
    if (!err) {
        w->size += (off_t)n;
        return;
    }
    w->failed = 1;
    if (w->failed_flag) atomic_store(w->failed_flag, 1);
    wb_say("%s/spool.jsonl: write failed: %s; the spool takes no more records%s (hint: is the disk full? a later "
           "sync uploads what it holds; the live upload, if any, goes on)", w->dir, strerror(err),
           cut ? ", and its last line is a partial record" : "");
}

void wb_spool_json(SpoolWriter *w, cJSON *rec) {
    char *text = cJSON_PrintUnformatted(rec);
    WbBuf b = {0};
    wb_buf_puts(&b, text);
    wb_buf_puts(&b, "\n");
    wb_spool_write(w, b.p, b.n);
    free(b.p);
    free(text);
}

/* <root>/wandb-c/<run_id>, or <run_id>-2, -3, ... when an earlier process left a spool there. */
void wb_spool_open(SpoolWriter *w, const char *root, const char *run_id) {
    char *dir = wb_join(root, "wandb-c"), *base = wb_join(dir, run_id), *path = NULL, *file = NULL;
    for (int k = 1;; k++) {
        free(path);
        free(file);
        WbBuf b = {0};
        wb_buf_puts(&b, base);
        if (k > 1) wb_buf_printf(&b, "-%d", k);
        path = b.p;
        file = wb_join(path, "spool.jsonl");
        if (!file_exists(file)) break;
    }
    char *files = wb_join(path, "files");
    Err e;
    if (make_dirs(files, &e) != 0) {
        wb_say("%s; running without a spool (nothing to sync later)", e.msg);
        free(path);
    } else if ((w->fd = open(file, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644)) < 0) {
        wb_say("%s: cannot create: %s; running without a spool (nothing to sync later)", file, strerror(errno));
        free(path);
    } else {
        w->dir = path;
        w->size = 0;
        const char header[] = "{\"t\":\"spool\",\"version\":1}\n";
        wb_spool_write(w, header, sizeof header - 1);
    }
    free(files);
    free(file);
    free(base);
    free(dir);
}

/* Makes the spool's records durable and closes it; w->dir stays. */
void wb_spool_close(SpoolWriter *w) {
    if (w->fd >= 0) {
        fsync(w->fd);
        close(w->fd);
        w->fd = -1;
    }
}

/* Appends records to the spool in dir: they go in whole or not at all. A last line without its newline (a record
 * cut short by a crash, which the reader skips) is cut off first, so that the records do not join it. */
int wb_spool_append(const char *dir, const char *rec, size_t n, Err *e) {
    char *path = wb_join(dir, "spool.jsonl");
    size_t have = 0;
    char *text = read_file(path, &have, NULL);
    int err = text ? 0 : errno ? errno : EIO, cut = 0, fd = -1; /* never go on from a size of 0 */
    if (!err && (fd = open(path, O_WRONLY | O_APPEND | O_CLOEXEC)) < 0) err = errno;
    off_t size = (off_t)have;
    while (text && size > 0 && text[size - 1] != '\n') size--;
    free(text);
    if (!err && (off_t)have > size && ftruncate(fd, size) != 0) err = errno;
    if (!err) err = write_record(fd, size, rec, n, &cut);
    if (!err && fsync(fd) != 0) {
        err = errno;
        if (ftruncate(fd, size) != 0) cut = -1; /* not durable: not there either */
    }
    if (fd >= 0) close(fd);
    if (err)
        err_set(e, "%s: cannot append: %s (hint: is the disk full? %s)", path, strerror(err),
                cut ? "what was appended may stay at its end: check its last line before a sync"
                    : "the spool holds its records as before");
    free(path);
    return err ? -1 : 0;
}

/* Relative, '/'-separated, no empty, "." or ".." parts, no control characters. */
int wb_valid_run_path(const char *p) {
    for (const char *s = p; *s; s++)
        if ((unsigned char)*s < 0x20 || *s == '\\') return 0;
    for (const char *s = p;; s++) {
        size_t n = strcspn(s, "/");
        if (n == 0 || (n == 1 && s[0] == '.') || (n == 2 && s[0] == '.' && s[1] == '.')) return 0;
        s += n;
        if (!*s) return 1;
    }
}

/* Copies local_path to <spool_dir>/files/<run_path>. */
int wb_copy_into_spool(const char *spool_dir, const char *local_path, const char *run_path, Err *e) {
    size_t n;
    char *data = read_file(local_path, &n, e);
    char *files = wb_join(spool_dir, "files"), *dst = wb_join(files, run_path), *slash = strrchr(dst, '/');
    int rc = -1;
    if (data) {
        *slash = 0;
        rc = make_dirs(dst, e);
        *slash = '/';
        if (rc == 0) rc = write_file_atomic(dst, data, n, e);
    }
    free(data);
    free(dst);
    free(files);
    return rc;
}

/* ---------------------------------------------------------------- reading */

void wb_spool_free(Spool *sp) {
    cJSON_Delete(sp->run);
    cJSON_Delete(sp->config);
    cJSON_Delete(sp->files);
    for (long i = 0; i < sp->nrows; i++) free(sp->rows[i]);
    free(sp->rows);
    wb_kv_free(&sp->summary);
}

#define SPOOL_DAMAGED "(hint: spool.jsonl was changed after kvlab wrote it; restore it from a copy)"

/* Reads spool.jsonl; a last line without its newline (cut by a crash) is ignored. History rows must carry a
 * _step, a whole number above the row before's, as kvlab writes them (the server files rows by it). */
int wb_spool_read(const char *dir, Spool *sp, Err *e) {
    char *path = wb_join(dir, "spool.jsonl");
    size_t n, hp = strlen(WB_HIST_PREFIX), sp_len = strlen(SUMMARY_PREFIX);
    char *text = read_file(path, &n, e), *line = text, *nl;
    long lineno = 1, cap = 0;
    double step, last_step = -1;
    int rc = text ? 0 : -1;
    sp->files = cJSON_CreateArray();
    for (; rc == 0 && (nl = memchr(line, '\n', (size_t)(text + n - line))); line = nl + 1, lineno++) {
        *nl = 0;
        size_t len = (size_t)(nl - line);
        if (lineno == 1) {
            cJSON *h = cJSON_Parse(line);
            const cJSON *version = cJSON_GetObjectItem(h, "version");
            if (!wb_str_item(h, "t") || strcmp(wb_str_item(h, "t"), "spool") || !cJSON_IsNumber(version) ||
                version->valueint != 1)
                rc = err_set(e, "%s: not a kvlab W&B spool (version 1) (hint: make wandb-sync reads the folders "
                             "<output>/<run>/wandb-c/<run_id> that a run with CONFIG_WANDB writes)", path);
            cJSON_Delete(h);
        } else if (len > hp && !strncmp(line, WB_HIST_PREFIX, hp) && line[len - 1] == '}') {
            if (sp->nrows == cap) {
                cap = cap ? 2 * cap : 1024;
                sp->rows = xrealloc(sp->rows, (size_t)cap * sizeof *sp->rows);
            }
            sp->rows[sp->nrows] = wb_xstrndup(line + hp, len - hp - 1);
            if (kv_parse(&sp->summary, sp->rows[sp->nrows++], &step) != 0)
                rc = err_set(e, "%s:%ld: damaged history record " SPOOL_DAMAGED, path, lineno);
            else if (!(step > last_step && step <= 9007199254740992.0 && step == floor(step)))
                rc = err_set(e, "%s:%ld: history record's _step is %.17g, not a whole number above the row before's "
                             "(%.0f) " SPOOL_DAMAGED, path, lineno, step, last_step);
            last_step = step;
        } else if (len > sp_len && !strncmp(line, SUMMARY_PREFIX, sp_len)) {
            wb_kv_clear(&sp->summary);
            if (kv_parse(&sp->summary, line + sp_len, NULL) != 0)
                rc = err_set(e, "%s:%ld: damaged summary record " SPOOL_DAMAGED, path, lineno);
        } else {
            cJSON *rec = cJSON_Parse(line);
            const char *t = wb_str_item(rec, "t"), *file = wb_str_item(rec, "path");
            const cJSON *code = cJSON_GetObjectItem(rec, "code");
            if (!t) {
                rc = err_set(e, "%s:%ld: damaged record (not a JSON object with a \"t\" kind) " SPOOL_DAMAGED, path,
                             lineno);
            } else if (!strcmp(t, "run") && !sp->run) {
                sp->run = cJSON_Duplicate(rec, 1);
            } else if (!strcmp(t, "config")) {
                cJSON_Delete(sp->config);
                sp->config = cJSON_DetachItemFromObject(rec, "config");
            } else if (!strcmp(t, "file") && file && !wb_in_array(sp->files, file)) {
                cJSON_AddItemToArray(sp->files, cJSON_CreateString(file));
            } else if (!strcmp(t, "exit") && cJSON_IsNumber(code)) {
                sp->has_exit = 1;
                sp->exit_code = code->valueint;
            }
            cJSON_Delete(rec);
        }
    }
    if (rc == 0 && !sp->run) rc = err_set(e, "%s: no run record (hint: is this a spool folder wandb-c/<run_id>?)", path);
    free(text);
    free(path);
    return rc;
}

/* The spool folder under root/wandb-c whose spool.jsonl changed last, or NULL. */
char *wb_newest_spool(const char *root) {
    char *dir = wb_join(root, "wandb-c"), *best = NULL;
    struct timespec best_t = {0, 0};
    DIR *d = opendir(dir);
    struct dirent *de;
    while (d && (de = readdir(d))) {
        if (de->d_name[0] == '.') continue;
        char *path = wb_join(dir, de->d_name), *file = wb_join(path, "spool.jsonl");
        struct stat st;
        if (stat(file, &st) == 0 && (!best || st.st_mtim.tv_sec > best_t.tv_sec ||
                                     (st.st_mtim.tv_sec == best_t.tv_sec && st.st_mtim.tv_nsec >= best_t.tv_nsec))) {
            free(best);
            best = path;
            path = NULL;
            best_t = st.st_mtim;
        }
        free(path);
        free(file);
    }
    if (d) closedir(d);
    free(dir);
    return best;
}
