/* The W&B run API over an Uplink (docs/wandb.md): UpsertBucket over GraphQL
 * creates or updates the run, the FileStream endpoint receives history rows,
 * the summary, "uploaded" notices and completion, CreateRunFiles + signed
 * PUTs upload files. What the server acknowledged is the cursor in the
 * spool's sync_state.json, so that a later sync neither resends nor skips. */
#define _GNU_SOURCE
#include "internal.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* POSTs a GraphQL document; returns data.<field> (owned by *root) or NULL with e set. Consumes vars. */
static cJSON *graphql(Uplink *u, WbKind kind, const char *op, const char *query, cJSON *vars, const char *field,
                      cJSON **root, Err *e) {
    cJSON *req = cJSON_CreateObject();
    cJSON_AddStringToObject(req, "operationName", op);
    cJSON_AddStringToObject(req, "query", query);
    cJSON_AddItemToObject(req, "variables", vars);
    char *body = cJSON_PrintUnformatted(req);
    cJSON_Delete(req);
    char *url = wb_join(u->base, "graphql");
    WbResp r = {0};
    cJSON *ans = NULL;
    *root = NULL;
    if (wb_request(u, kind, url, u->json_headers, body, strlen(body), NULL, 0, &r, e) == 0) {
        WbBuf m = {0};
        *root = cJSON_Parse(r.body.p ? r.body.p : "");
        wb_server_message(*root, &m);
        ans = cJSON_GetObjectItem(cJSON_GetObjectItem(*root, "data"), field);
        if (m.n) { /* errors at 200 are final */
            err_set(e, "%s", m.p);
            ans = NULL;
        } else if (!cJSON_IsObject(ans)) {
            err_set(e, "%s: the answer has no %s (hint: is %s a W&B server?)", op, field, u->base);
            ans = NULL;
        }
        free(m.p);
    }
    free(r.body.p);
    free(url);
    free(body);
    return ans;
}

static void set_str(char **dst, const char *v) {
    free(*dst);
    *dst = xstrdup(v);
}

/* ---------------------------------------------------------------- run creation */

static const char UPSERT_QUERY[] =
    "mutation UpsertBucket($name: String, $project: String, $entity: String, $displayName: String, "
    "$groupName: String, $jobType: String, $notes: String, $config: JSONString, $host: String, $program: String, "
    "$commit: String, $repo: String, $tags: [String!]) { upsertBucket(input: {name: $name, modelName: $project, "
    "entityName: $entity, displayName: $displayName, groupName: $groupName, jobType: $jobType, notes: $notes, "
    "config: $config, host: $host, jobProgram: $program, commit: $commit, jobRepo: $repo, tags: $tags}) { bucket { "
    "id name displayName project { name entity { name } } historyLineCount } inserted } }";

/* Creates or updates the run of a spool "run" record. The answer names the
 * entity, project and run ID used from then on, and how many history lines
 * the server already holds. */
int wb_upsert(Uplink *u, const cJSON *run, const cJSON *config, long *lines, int *inserted, Err *e) {
    static const char *const vars_of_record[][2] = {
        {"name", "run_id"}, {"project", "project"}, {"entity", "entity"}, {"displayName", "name"},
        {"groupName", "group"}, {"jobType", "job_type"}, {"notes", "notes"}, {"host", "host"},
        {"program", "program"}, {"commit", "commit"}};
    cJSON *v = cJSON_CreateObject();
    for (size_t i = 0; i < sizeof vars_of_record / sizeof *vars_of_record; i++)
        wb_add_str(v, vars_of_record[i][0], wb_str_item(run, vars_of_record[i][1]));
    cJSON_AddNullToObject(v, "repo");
    const cJSON *tags = cJSON_GetObjectItem(run, "tags");
    cJSON_AddItemToObject(v, "tags", cJSON_GetArraySize(tags) ? cJSON_Duplicate(tags, 1) : cJSON_CreateNull());
    if (cJSON_IsObject(config)) { /* a JSON string of {"key": {"value": ...}} */
        cJSON *enc = cJSON_CreateObject();
        const cJSON *it;
        cJSON_ArrayForEach(it, config) {
            cJSON *wrap = cJSON_CreateObject();
            cJSON_AddItemToObject(wrap, "value", cJSON_Duplicate(it, 1));
            cJSON_AddItemToObject(enc, it->string, wrap);
        }
        char *text = cJSON_PrintUnformatted(enc);
        cJSON_AddStringToObject(v, "config", text);
        free(text);
        cJSON_Delete(enc);
    } else {
        cJSON_AddNullToObject(v, "config");
    }

    cJSON *root;
    cJSON *ans = graphql(u, WB_UPSERT, "UpsertBucket", UPSERT_QUERY, v, "upsertBucket", &root, e);
    const cJSON *b = cJSON_GetObjectItem(ans, "bucket"), *project = cJSON_GetObjectItem(b, "project");
    const char *name = wb_str_item(b, "name"), *pname = wb_str_item(project, "name"),
               *entity = wb_str_item(cJSON_GetObjectItem(project, "entity"), "name");
    int rc = -1;
    if (ans && (!name || !pname || !entity)) {
        err_set(e, "the UpsertBucket answer lacks the run's name, project or entity (hint: is %s a W&B server?)",
                u->base);
    } else if (ans) {
        set_str(&u->run_id, name);
        set_str(&u->project, pname);
        set_str(&u->entity, entity);
        const cJSON *count = cJSON_GetObjectItem(b, "historyLineCount");
        *lines = cJSON_IsNumber(count) ? (long)count->valuedouble : 0;
        *inserted = !cJSON_IsFalse(cJSON_GetObjectItem(ans, "inserted"));
        /* web page: api.wandb.ai -> wandb.ai, api.X -> app.X, else the base URL */
        WbBuf url = {0};
        if (!strcmp(u->base, WB_DEFAULT_BASE))
            wb_buf_puts(&url, "https://wandb.ai");
        else if (!strncmp(u->base, "https://api.", 12)) {
            wb_buf_puts(&url, "https://app.");
            wb_buf_puts(&url, u->base + 12);
        } else
            wb_buf_puts(&url, u->base);
        const char *path[] = {"/", entity, "/", pname, "/runs/", name};
        for (int i = 0; i < 6; i++) wb_buf_puts(&url, path[i]);
        free(u->url);
        u->url = url.p;
        WbBuf fs = {0};
        wb_buf_puts(&fs, u->base);
        wb_buf_puts(&fs, "/files");
        const char *parts[] = {entity, pname, name};
        for (int i = 0; i < 3; i++) {
            char *esc = curl_easy_escape(u->curl, parts[i], 0);
            wb_buf_puts(&fs, "/");
            wb_buf_puts(&fs, esc);
            curl_free(esc);
        }
        wb_buf_puts(&fs, "/file_stream");
        free(u->fs_url);
        u->fs_url = fs.p;
        rc = 0;
    }
    cJSON_Delete(root);
    return rc;
}

/* ---------------------------------------------------------------- FileStream */

/* {"files": {history from offset, summary}, "uploaded": [...], "complete": true, "exitcode": N};
 * empty parts are left out, so nothing at all is the heartbeat {}. */
char *wb_filestream_body(long offset, char *const *lines, long n, const char *summary, const cJSON *uploaded,
                         int complete, int exit_code, size_t *len) {
    WbBuf b = {0};
    const char *sep = "";
    wb_buf_puts(&b, "{");
    if (n || summary) {
        wb_buf_puts(&b, "\"files\":{");
        if (n) {
            wb_buf_printf(&b, "\"wandb-history.jsonl\":{\"offset\":%ld,\"content\":[", offset);
            for (long i = 0; i < n; i++) {
                if (i) wb_buf_puts(&b, ",");
                wb_buf_json_str(&b, lines[i]);
            }
            wb_buf_puts(&b, "]}");
        }
        if (summary) {
            if (n) wb_buf_puts(&b, ",");
            wb_buf_puts(&b, "\"wandb-summary.json\":{\"offset\":0,\"content\":[");
            wb_buf_json_str(&b, summary);
            wb_buf_puts(&b, "]}");
        }
        wb_buf_puts(&b, "}");
        sep = ",";
    }
    if (cJSON_GetArraySize(uploaded)) {
        char *names = cJSON_PrintUnformatted(uploaded);
        wb_buf_printf(&b, "%s\"uploaded\":", sep);
        wb_buf_puts(&b, names);
        free(names);
        sep = ",";
    }
    if (complete) wb_buf_printf(&b, "%s\"complete\":true,\"exitcode\":%d", sep, exit_code);
    wb_buf_puts(&b, "}");
    *len = b.n;
    return b.p;
}

int wb_filestream(Uplink *u, const char *body, size_t len, int *stopped, Err *e) {
    WbResp r = {0};
    int rc = wb_request(u, WB_FILESTREAM, u->fs_url, u->json_headers, body, len, NULL, 0, &r, e);
    if (rc == 0) { /* the body may be empty or not JSON: only "stopped" matters */
        cJSON *j = cJSON_Parse(r.body.p ? r.body.p : "");
        *stopped = cJSON_IsTrue(cJSON_GetObjectItem(j, "stopped"));
        cJSON_Delete(j);
    }
    free(r.body.p);
    return rc;
}

/* ---------------------------------------------------------------- the cursor (sync_state.json) */

/* Writes the cursor so that a later sync neither resends acknowledged rows at new offsets nor skips any. */
void wb_state_save(Uplink *u) {
    if (!u->state_path) return;
    cJSON *s = cJSON_CreateObject();
    cJSON_AddStringToObject(s, "base_url", u->base);
    cJSON_AddStringToObject(s, "url", u->url);
    cJSON_AddNumberToObject(s, "history_sent", (double)u->hist_sent);
    cJSON_AddNumberToObject(s, "history_offset", (double)u->hist_offset);
    cJSON_AddItemToObject(s, "uploaded", cJSON_Duplicate(u->uploaded, 1));
    cJSON_AddBoolToObject(s, "complete", u->complete);
    if (atomic_load(&u->spool_short)) cJSON_AddTrueToObject(s, "spool_short");
    if (u->exit_known) cJSON_AddNumberToObject(s, "exit_code", u->exit_code);
    char *text = cJSON_Print(s);
    Err e;
    if (write_file_atomic(u->state_path, text, strlen(text), &e) != 0 && !u->state_failed) {
        u->state_failed = 1;
        wb_say("%s (a later sync may resend rows)", e.msg);
    }
    free(text);
    cJSON_Delete(s);
}

/* A whole number in [0, 2^53] (a count of rows or lines), or -1. */
static long cursor_count(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItem(o, key);
    double x = cJSON_IsNumber(v) ? v->valuedouble : -1;
    return x >= 0 && x <= 9007199254740992.0 && x == floor(x) ? (long)x : -1;
}

/* Reads the cursor: 1 when it exists and belongs to the same server; 0 when there is none, or another server's;
 * -1 (e set) when the file is there but damaged. Resending from a guessed cursor would store rows twice. */
int wb_state_load(Uplink *u, Err *e) {
    errno = 0;
    char *text = read_file(u->state_path, NULL, NULL);
    if (!text && errno == ENOENT) return 0;
    cJSON *s = cJSON_Parse(text ? text : "");
    free(text);
    const char *base = wb_str_item(s, "base_url"), *url = wb_str_item(s, "url");
    long sent = cursor_count(s, "history_sent"), off = cursor_count(s, "history_offset");
    const cJSON *up = cJSON_GetObjectItem(s, "uploaded"), *done = cJSON_GetObjectItem(s, "complete"), *it,
                *short_ = cJSON_GetObjectItem(s, "spool_short"), *code = cJSON_GetObjectItem(s, "exit_code");
    const char *bad = !cJSON_IsObject(s) ? "not a JSON object" : !base || !url ? "no base_url or url string"
                      : sent < 0 || off < 0 ? "history_sent or history_offset is not a whole number >= 0"
                      : off < sent ? "history_offset is below history_sent"
                      : !cJSON_IsArray(up) ? "uploaded is not a list"
                      : done && !cJSON_IsBool(done) ? "complete is not true or false"
                      : short_ && !cJSON_IsBool(short_) ? "spool_short is not true or false"
                      : code && !(cJSON_IsNumber(code) && code->valuedouble == floor(code->valuedouble) &&
                                  fabs(code->valuedouble) <= INT_MAX)
                          ? "exit_code is not a whole number"
                          : NULL;
    if (!bad)
        cJSON_ArrayForEach(it, up) if (!cJSON_IsString(it)) bad = "uploaded holds a value that is not a file name";
    if (bad) {
        cJSON_Delete(s);
        return err_set(e, "%s: damaged sync cursor: %s (hint: it records what the server acknowledged; restore it "
                          "from a copy; deleting it sends the whole history again, which the server then holds twice)",
                       u->state_path, bad);
    }
    int ours = !strcmp(base, u->base);
    if (cJSON_IsTrue(short_)) atomic_store(&u->spool_short, 1); /* facts about the spool and the run, whichever server */
    u->exit_known = code != NULL;
    u->exit_code = code ? (int)code->valuedouble : 0;
    if (ours) {
        u->hist_sent = sent;
        u->hist_offset = off;
        cJSON_Delete(u->uploaded);
        u->uploaded = cJSON_Duplicate(up, 1);
        u->complete = cJSON_IsTrue(done);
        set_str(&u->url, url);
    }
    cJSON_Delete(s);
    return ours;
}

/* A run completed on the server gets a new session (summary, files,
 * completion again): the cursor of the spool in dir forgets "complete". */
void wb_state_reopen(const char *dir) {
    char *state = wb_join(dir, "sync_state.json"), *text = read_file(state, NULL, NULL);
    cJSON *st = cJSON_Parse(text ? text : "");
    if (cJSON_IsTrue(cJSON_GetObjectItem(st, "complete"))) {
        cJSON_ReplaceItemInObject(st, "complete", cJSON_CreateFalse());
        char *out = cJSON_Print(st);
        Err se;
        if (write_file_atomic(state, out, strlen(out), &se) != 0) wb_say("%s", se.msg);
        free(out);
    }
    cJSON_Delete(st);
    free(text);
    free(state);
}

/* ---------------------------------------------------------------- files */

static const char CREATE_FILES_QUERY[] =
    "mutation CreateRunFiles($entity: String!, $project: String!, $run: String!, $files: [String!]!) { "
    "createRunFiles(input: {entityName: $entity, projectName: $project, runName: $run, files: $files}) { runID "
    "uploadHeaders files { name uploadUrl } } }";

/* CreateRunFiles for paths, then one PUT per file from <spool>/files/ (with
 * the answer's uploadHeaders, without credentials). Paths uploaded are
 * appended to done; returns -1 with e at the first failure. */
int wb_upload_files(Uplink *u, const char *spool_dir, const cJSON *paths, cJSON *done, Err *e) {
    cJSON *v = cJSON_CreateObject(), *root;
    cJSON_AddStringToObject(v, "entity", u->entity);
    cJSON_AddStringToObject(v, "project", u->project);
    cJSON_AddStringToObject(v, "run", u->run_id);
    cJSON_AddItemToObject(v, "files", cJSON_Duplicate(paths, 1));
    cJSON *ans = graphql(u, WB_GRAPHQL, "CreateRunFiles", CREATE_FILES_QUERY, v, "createRunFiles", &root, e);
    const cJSON *files = cJSON_GetObjectItem(ans, "files"), *h, *f;
    const char *run_id = wb_str_item(ans, "runID");
    int rc = -1;
    if (!ans) goto out;
    if (!run_id || !*run_id) {
        err_set(e, "CreateRunFiles: the server does not know run %s/%s/%s", u->entity, u->project, u->run_id);
        goto out;
    }
    if (cJSON_GetArraySize(files) != cJSON_GetArraySize(paths)) {
        err_set(e, "CreateRunFiles: the answer lists %d files for %d asked; none uploaded", cJSON_GetArraySize(files),
                cJSON_GetArraySize(paths));
        goto out;
    }
    struct curl_slist *headers = curl_slist_append(NULL, "Expect:");
    cJSON_ArrayForEach(h, cJSON_GetObjectItem(ans, "uploadHeaders")) { /* "Key: Value" */
        const char *text = cJSON_IsString(h) ? h->valuestring : "";
        size_t name = strcspn(text, ":");
        if (name == 0 || !text[name]) continue;
        const char *value = text + name + 1 + strspn(text + name + 1, " \t");
        size_t n = strlen(text) + 3;
        char *line = xmalloc(n);
        snprintf(line, n, "%.*s: %s", (int)name, text, value);
        headers = curl_slist_append(headers, line);
        free(line);
    }
    rc = 0;
    cJSON_ArrayForEach(f, files) {
        const char *name = wb_str_item(f, "name"), *url = wb_str_item(f, "uploadUrl");
        if (!name || !url || !wb_in_array(paths, name)) continue; /* null uploadUrl: the server skips it */
        char *dir = wb_join(spool_dir, "files"), *local = wb_join(dir, name);
        FILE *fp = fopen(local, "rb");
        struct stat st;
        WbResp r = {0};
        Err pe;
        if (!fp || fstat(fileno(fp), &st) != 0)
            err_set(&pe, "%s: cannot open: %s", local, strerror(errno));
        else if (wb_request(u, WB_STORAGE, url, headers, NULL, 0, fp, (curl_off_t)st.st_size, &r, &pe) == 0)
            cJSON_AddItemToArray(done, cJSON_CreateString(name));
        if (!wb_in_array(done, name) && rc == 0) {
            err_set(e, "upload of %s: %s", name, pe.msg);
            rc = -1;
        }
        if (fp) fclose(fp);
        free(r.body.p);
        free(local);
        free(dir);
    }
    curl_slist_free_all(headers);
out:
    cJSON_Delete(root);
    return rc;
}
