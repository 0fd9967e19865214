/* Uploading a spool after the run (make wandb-sync): wandb_sync_dir replays
 * a spool from the cursor in its sync_state.json with the same request code
 * as the online upload; wandb_attach_spool adds results computed after the
 * run ended (mechint) to its newest spool and syncs it. */
#define _GNU_SOURCE
#include "internal.h"

#include <stdlib.h>
#include <string.h>

/* History from the cursor in chunks, the summary with the last chunk, the
 * files and their "uploaded" notice, then "complete" when the run ended. A
 * short spool whose rows the live upload sent already has an older summary
 * than the server's: it is not sent. */
static int sync_send(Uplink *u, Spool *sp, const char *dir, Err *e) {
    WbBuf summary = {0};
    int stopped, rc = 0,
                 summary_sent = sp->summary.n == 0 || (atomic_load(&u->spool_short) && u->hist_sent >= sp->nrows);
    wb_summary_json(&summary, &sp->summary);
    while (rc == 0 && (u->hist_sent < sp->nrows || !summary_sent)) {
        long i = u->hist_sent, n = 0;
        size_t bytes = 0;
        while (i + n < sp->nrows && (n == 0 || bytes + strlen(sp->rows[i + n]) <= (size_t)u->request_bytes))
            bytes += strlen(sp->rows[i + n++]);
        int last = i + n >= sp->nrows;
        size_t len;
        char *body = wb_filestream_body(u->hist_offset, sp->rows + i, n, last ? summary.p : NULL, NULL, 0, 0, &len);
        rc = wb_filestream(u, body, len, &stopped, e);
        free(body);
        if (rc == 0) {
            u->hist_sent += n;
            u->hist_offset += n;
            summary_sent |= last;
            wb_state_save(u);
        }
    }
    free(summary.p);
    if (rc != 0) return -1;

    cJSON *todo = cJSON_CreateArray(), *done = cJSON_CreateArray(), *it;
    cJSON_ArrayForEach(it, sp->files) if (!wb_in_array(u->uploaded, it->valuestring))
        cJSON_AddItemToArray(todo, cJSON_CreateString(it->valuestring));
    Err fe;
    int files_rc = cJSON_GetArraySize(todo) ? wb_upload_files(u, dir, todo, done, &fe) : 0;
    if (cJSON_GetArraySize(done)) {
        size_t len;
        char *body = wb_filestream_body(0, NULL, 0, NULL, done, 0, 0, &len);
        rc = wb_filestream(u, body, len, &stopped, e);
        free(body);
        if (rc == 0) {
            cJSON_ArrayForEach(it, done) cJSON_AddItemToArray(u->uploaded, cJSON_CreateString(it->valuestring));
            wb_state_save(u);
        }
    }
    cJSON_Delete(todo);
    cJSON_Delete(done);
    if (rc != 0) return -1;
    if (files_rc != 0) {
        *e = fe;
        return -1;
    }
    if (sp->has_exit || u->exit_known) { /* a short spool may lack the exit record the server had */
        size_t len;
        char *body = wb_filestream_body(0, NULL, 0, NULL, NULL, 1, sp->has_exit ? sp->exit_code : u->exit_code, &len);
        rc = wb_filestream(u, body, len, &stopped, e);
        free(body);
        if (rc == 0) {
            u->complete = 1;
            u->exit_known = 1, u->exit_code = sp->has_exit ? sp->exit_code : u->exit_code;
            wb_state_save(u);
        }
    }
    return rc;
}

int wandb_sync_dir(const char *spool_dir, const WandbSettings *s, Err *e) {
    Spool sp = {0};
    Uplink u;
    Err ie;
    int rc = -1;
    wb_uplink_setup(&u, s);
    if (wb_spool_read(spool_dir, &sp, e) != 0) goto out;
    if (!(u.key = wb_find_key(s, u.base, &ie))) {
        err_set(e, "%s: %s", spool_dir, ie.msg);
        goto out;
    }
    u.state_path = wb_join(spool_dir, "sync_state.json");
    int have_cursor = wb_state_load(&u, e);
    if (have_cursor < 0) goto out;
    if (u.hist_sent > sp.nrows && !atomic_load(&u.spool_short)) {
        err_set(e, "%s: damaged sync cursor: history_sent is %ld, but the spool holds %ld rows (hint: restore "
                   "spool.jsonl or the cursor from a copy; deleting the cursor sends the whole history again, which "
                   "the server then holds twice)", u.state_path, u.hist_sent, sp.nrows);
        goto out;
    }
    if (u.complete) { /* nothing may follow "complete" */
        wb_say("%s was already synced to %s", spool_dir, u.url);
        rc = 0;
        goto out;
    }
    long lines;
    int inserted;
    if (wb_upsert(&u, sp.run, sp.config, &lines, &inserted, &ie) != 0) {
        err_set(e, "%s: cannot create the run on %s: %s", spool_dir, u.base, ie.msg);
        goto out;
    }
    if (!have_cursor) { /* never uploaded: the run's lines follow whatever the server holds */
        u.hist_sent = 0;
        u.hist_offset = lines;
    } else if (lines > u.hist_offset && lines - u.hist_offset <= sp.nrows - u.hist_sent) {
        /* a request whose answer was lost (a killed upload) was stored: those lines are ours, go on after them */
        u.hist_sent += lines - u.hist_offset;
        u.hist_offset = lines;
    }
    if (atomic_load(&u.spool_short))
        wb_say("%s/spool.jsonl is short: a write failed during the run, so it holds %ld history rows and no records "
               "after them%s (hint: what the live upload did not send of the rest is lost)", spool_dir, sp.nrows,
               u.hist_sent > sp.nrows ? "; the live upload sent more, which the server keeps" : "");
    wb_state_save(&u);
    u.last_fs = wall_seconds(); /* pacing also keeps a rerun's first request apart from an interrupted sync's last */
    if (sync_send(&u, &sp, spool_dir, &ie) != 0) {
        err_set(e, "%s: %s (hint: run the sync again; it resumes where it stopped)", spool_dir, ie.msg);
        goto out;
    }
    wb_say("synced %s to %s%s", spool_dir, u.url,
           sp.has_exit || u.exit_known ? "" : " (no exit record: the run is left unfinished)");
    rc = 0;
out:
    wb_uplink_free(&u);
    wb_spool_free(&sp);
    return rc;
}

/* ---------------------------------------------------------------- results attached later */

int wandb_attach_spool(const char *spool_root, const char *summary, const char *const *files, int nfiles,
                       const char *folder, const WandbSettings *s, Err *e) {
    const char *mode = wb_first(wb_env("WANDB_MODE"), wb_first(s->mode, "online"));
    if (!strcmp(mode, "disabled")) return 1;
    char *dir = wb_newest_spool(spool_root);
    if (!dir) return 1;
    Spool sp = {0};
    WbBuf rec = {0};
    int rc = -1;
    cJSON *add = summary ? cJSON_Parse(summary) : NULL;
    if (wb_spool_read(dir, &sp, e) != 0) goto out;
    if (summary && !cJSON_IsObject(add)) {
        err_set(e, "results for %s: the summary is not a JSON object", dir);
        goto out;
    }
    int changed = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, add) {
        if (!cJSON_IsNumber(it) || !it->string[0] || it->string[0] == '_') {
            wb_say("results for %s: summary value \"%s\" is not a number or starts with '_'; left out", dir,
                   it->string);
            continue;
        }
        WbBuf k = {0};
        wb_buf_json_str(&k, it->string);
        wb_kv_set(&sp.summary, k.p, k.n, it->valuedouble);
        free(k.p);
        changed = 1;
    }
    if (changed) wb_summary_record(&rec, &sp.summary);
    for (int i = 0; i < nfiles; i++) {
        const char *name = strrchr(files[i], '/');
        name = name ? name + 1 : files[i];
        WbBuf path = {0};
        wb_buf_printf(&path, "%s/", folder);
        wb_buf_puts(&path, name);
        Err fe;
        if (!wb_valid_run_path(path.p))
            wb_say("results for %s: \"%s\" is not a path inside the run; left out", dir, path.p);
        else if (wb_copy_into_spool(dir, files[i], path.p, &fe) != 0)
            wb_say("%s; not attached", fe.msg);
        else {
            cJSON *f = cJSON_CreateObject();
            cJSON_AddStringToObject(f, "t", "file");
            cJSON_AddStringToObject(f, "path", path.p);
            char *text = cJSON_PrintUnformatted(f);
            wb_buf_puts(&rec, text);
            wb_buf_puts(&rec, "\n");
            free(text);
            cJSON_Delete(f);
        }
        free(path.p);
    }
    if (rec.n) {
        if (wb_spool_append(dir, rec.p, rec.n, e) != 0) goto out;
        wb_state_reopen(dir);
    }
    rc = 0;
    if (rec.n && !strcmp(mode, "online")) {
        Err se;
        if (wandb_sync_dir(dir, s, &se) != 0)
            wb_say("%s; the results stay in the spool (hint: upload them later with make wandb-sync)", se.msg);
    } else if (rec.n) {
        wb_say("results attached to %s (hint: upload them with make wandb-sync)", dir);
    }
out:
    cJSON_Delete(add);
    wb_spool_free(&sp);
    free(rec.p);
    free(dir);
    return rc;
}
