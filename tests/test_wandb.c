/* W&B client tests against tests/fake_wandb.py, one fake server per scenario
 * (a child process on a free port): the happy path (rows, merged eval
 * values, summary, config, metadata, file upload, completion, the state
 * file), entity resolution, netrc keys, transient failures (500, 503, 429
 * with Retry-After, RateLimit headers), permanent failures (UpsertBucket
 * 400, FileStream 404 and 413), a wrong API key, dropped connections and
 * answers slower than the per-attempt timeout, heartbeats, pacing under a
 * burst, the stop flag, NaN and infinities, a bounded finish, a server down
 * for the whole run followed by sync (nothing listening: offline after a
 * short grace), a server back within the init bound (a last attempt at its
 * end), a server appearing mid-run (the rows go up live), interrupted syncs
 * (a failing request, a killed sync), a spool cut short by a failed write, disabled and offline modes. The server records protocol
 * violations; every scenario asserts there are none, and that the API key
 * never appears in stdout, stderr or the spool. Run from the repository root. */
#define _GNU_SOURCE
#include <cjson/cJSON.h>
#include <curl/curl.h>
#include <fcntl.h>
#include <ftw.h>
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common.h"
#include "test.h"
#include "wandb.h"

#define KEY "test-key-7f3a9c2e"
#define METRICS_TEXT "{\"best_val_loss\": 2.31}\n"
enum { STEPS = 100 };

static char tmp[] = "/tmp/kvlab_test_wandb_XXXXXX";
static char metrics_path[4096];

static void sleep_s(double s) {
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&ts, NULL);
}

/* ---------------------------------------------------------------- HTTP to the fake's control endpoints */

typedef struct {
    char *p;
    size_t n;
} Text;

static size_t on_text(char *p, size_t size, size_t n, void *ud) {
    Text *t = ud;
    t->p = xrealloc(t->p, t->n + size * n + 1);
    memcpy(t->p + t->n, p, size * n);
    t->n += size * n;
    t->p[t->n] = 0;
    return size * n;
}

static char *http(const char *method, const char *url, const char *body) {
    CURL *c = curl_easy_init();
    Text t = {xcalloc(1, 1), 0};
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, method);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_text);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &t);
    curl_easy_setopt(c, CURLOPT_TIMEOUT, 30L);
    if (body) curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
    if (curl_easy_perform(c) != CURLE_OK) {
        free(t.p);
        t.p = NULL;
    }
    curl_easy_cleanup(c);
    return t.p;
}

typedef struct {
    pid_t pid;
    char url[64];
} Server;

/* Starts the fake with extra options (NULL-terminated); waits for its port file. */
static int server_start(Server *sv, const char *const *extra) {
    static int count;
    char port_file[4200];
    snprintf(port_file, sizeof port_file, "%s/port.%d", tmp, count++);
    const char *argv[32] = {"/usr/bin/python3", "tests/fake_wandb.py", "--port-file", port_file, "--api-key", KEY,
                            "--min-gap", "0.15"};
    int n = 8;
    for (; extra && *extra && n < 31; extra++) argv[n++] = *extra;
    argv[n] = NULL;
    fflush(NULL);
    sv->pid = fork();
    if (sv->pid == 0) {
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    for (int i = 0; i < 3000 && !file_exists(port_file); i++) sleep_s(0.01);
    char *port = read_file(port_file, NULL, NULL);
    CHECK(port != NULL, "fake server started (python3 tests/fake_wandb.py, run from the repository root)");
    if (!port) {
        kill(sv->pid, SIGKILL);
        waitpid(sv->pid, NULL, 0);
        return 0;
    }
    snprintf(sv->url, sizeof sv->url, "http://127.0.0.1:%d", atoi(port));
    free(port);
    return 1;
}

static void server_stop(Server *sv) {
    char url[128];
    snprintf(url, sizeof url, "%s/_fake/shutdown", sv->url);
    free(http("POST", url, "{}"));
    int status = 0;
    for (int i = 0; i < 500 && waitpid(sv->pid, &status, WNOHANG) == 0; i++) sleep_s(0.01);
    if (waitpid(sv->pid, &status, WNOHANG) == 0) {
        kill(sv->pid, SIGKILL);
        waitpid(sv->pid, &status, 0);
    }
}

static void inject(const Server *sv, const char *rules) {
    char url[128];
    snprintf(url, sizeof url, "%s/_fake/inject", sv->url);
    char *ans = http("POST", url, rules);
    CHECK(ans != NULL, "fault injection accepted: %s", rules);
    free(ans);
}

static cJSON *fetch_state(const Server *sv) {
    char url[128];
    snprintf(url, sizeof url, "%s/_fake/state", sv->url);
    char *text = http("GET", url, NULL);
    cJSON *st = cJSON_Parse(text ? text : "");
    free(text);
    return st;
}

static cJSON *server_state(const Server *sv) {
    cJSON *st = fetch_state(sv);
    CHECK(cJSON_IsObject(st), "GET /_fake/state returns a JSON object");
    return st;
}

/* Waits until every request the fake received has been answered (delayed ones included). */
static void wait_answered(const Server *sv) {
    for (int i = 0; i < 500; i++) {
        cJSON *st = fetch_state(sv), *q;
        int pending = 0;
        cJSON_ArrayForEach(q, cJSON_GetObjectItem(st, "requests")) pending += cJSON_IsNull(cJSON_GetObjectItem(q, "status"));
        cJSON_Delete(st);
        if (!pending) return;
        sleep_s(0.02);
    }
}

/* ---------------------------------------------------------------- JSON helpers */

static cJSON *item(const cJSON *o, const char *k) { return cJSON_GetObjectItemCaseSensitive(o, k); }

static double num(const cJSON *o, const char *k) {
    const cJSON *v = item(o, k);
    return cJSON_IsNumber(v) ? v->valuedouble : NAN;
}

static const char *str(const cJSON *o, const char *k) {
    const cJSON *v = item(o, k);
    return cJSON_IsString(v) ? v->valuestring : "";
}

static cJSON *find_run(const cJSON *st, const char *name) {
    cJSON *run;
    cJSON_ArrayForEach(run, item(st, "runs")) if (!strcmp(str(run, "name"), name)) return run;
    return NULL;
}

/* Requests of an operation (UpsertBucket, FileStream, CreateRunFiles, Storage); status 0 = any. */
static int count_requests(const cJSON *st, const char *op, int status) {
    int n = 0;
    const cJSON *q;
    cJSON_ArrayForEach(q, item(st, "requests")) if (!strcmp(str(q, "op"), op) && (!status || num(q, "status") == status)) n++;
    return n;
}

static int in_strings(const cJSON *a, const char *s) {
    const cJSON *it;
    cJSON_ArrayForEach(it, a) if (cJSON_IsString(it) && !strcmp(it->valuestring, s)) return 1;
    return 0;
}

static void check_no_violations(const cJSON *st, const char *what) {
    const cJSON *v = item(st, "violations");
    int n = cJSON_GetArraySize(v);
    CHECK(cJSON_IsArray(v) && n == 0, "%s: %d protocol violations, first: %s", what, n,
          n ? cJSON_GetArrayItem(v, 0)->valuestring : "-");
}

/* Rows with _step 0..n-1 in order; returns the first bad index or -1. */
static int bad_steps(const cJSON *run, int n) {
    const cJSON *rows = item(run, "rows");
    if (cJSON_GetArraySize(rows) != n) return -2;
    for (int i = 0; i < n; i++)
        if (num(cJSON_GetArrayItem(rows, i), "_step") != i) return i;
    return -1;
}

/* ---------------------------------------------------------------- output capture */

static int saved_out = -1, saved_err = -1;

static void capture_begin(void) {
    char path[4200];
    snprintf(path, sizeof path, "%s/capture.txt", tmp);
    fflush(NULL);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    saved_out = dup(1);
    saved_err = dup(2);
    dup2(fd, 1);
    dup2(fd, 2);
    close(fd);
}

/* Restores stdout/stderr and returns what was printed meanwhile (which must never hold the key). */
static char *capture_end(void) {
    char path[4200];
    snprintf(path, sizeof path, "%s/capture.txt", tmp);
    fflush(NULL);
    dup2(saved_out, 1);
    dup2(saved_err, 2);
    close(saved_out);
    close(saved_err);
    char *text = read_file(path, NULL, NULL);
    if (!text) text = xcalloc(1, 1);
    CHECK(!strstr(text, KEY), "the API key never appears in stdout/stderr");
    return text;
}

static int count_of(const char *text, const char *needle) {
    int n = 0;
    for (const char *p = text; (p = strstr(p, needle)); p += strlen(needle)) n++;
    return n;
}

static int spool_records(const char *spool_dir, const char *type) {
    char path[4200], needle[64];
    snprintf(path, sizeof path, "%s/spool.jsonl", spool_dir);
    snprintf(needle, sizeof needle, "{\"t\":\"%s\"", type);
    char *text = read_file(path, NULL, NULL);
    int n = text ? count_of(text, needle) : -1;
    free(text);
    return n;
}

/* ---------------------------------------------------------------- runs */

static WandbSettings settings(const Server *sv, const char *run_id) {
    WandbSettings s = {0};
    s.mode = "online";
    s.base_url = sv ? sv->url : NULL;
    s.api_key = KEY;
    s.project = "tiny-gpt";
    s.name = "gpt6L-kv";
    s.group = "kv-ablation";
    s.job_type = "train";
    s.tags = "baseline, kv,,";
    s.commit = "0123abcd";
    s.run_id = run_id;
    s.dir = tmp;
    s.config_json = "{\"lr\":0.0003,\"model\":{\"d_model\":384,\"attn\":\"kv\"}}";
    s.flush_interval_s = 0.2;
    s.heartbeat_s = 0.5;
    s.finish_timeout_s = 15;
    s.retry_min_s = 0.05;
    s.retry_max_s = 0.5;
    s.init_timeout_s = 10;
    s.http_timeout_s = 5;
    s.filestream_timeout_s = 5;
    return s;
}

static double loss_at(long step) { return 3.0 - 0.01 * (double)step; }

/* The happy-path workload: STEPS rows of train metrics, eval values every 20
 * steps in the same row, an explicit summary value and one file;
 * standard_steps logs the rows of steps [from, to). */
static void standard_steps(WandbRun *r, long from, long to, double step_sleep) {
    for (long step = from; step < to; step++) {
        wandb_log(r, step, "train/loss", loss_at(step));
        wandb_log(r, step, "train/lr", 3e-4);
        if (step % 20 == 0) wandb_log(r, step, "eval/loss", loss_at(step) + 0.1);
        wandb_commit(r, step);
        if (step_sleep > 0) sleep_s(step_sleep);
    }
}

static void standard_end(WandbRun *r) {
    wandb_summary_set(r, "best/eval_loss", 2.31);
    CHECK(wandb_upload_file(r, metrics_path, "metrics.json") == 0, "upload_file accepts metrics.json");
}

static void standard_run(WandbRun *r, double step_sleep) {
    standard_steps(r, 0, STEPS, step_sleep);
    standard_end(r);
}

/* The server state a complete standard run must leave, however it got there. */
static void check_standard(const cJSON *st, const char *run_id, const char *entity, int allow_duplicates,
                           const char *what) {
    check_no_violations(st, what);
    const cJSON *run = find_run(st, run_id);
    CHECK(run != NULL, "%s: run %s exists on the server", what, run_id);
    if (!run) return;
    CHECK(!strcmp(str(run, "entity"), entity) && !strcmp(str(run, "project"), "tiny-gpt"),
          "%s: run under %s/tiny-gpt (got %s/%s)", what, entity, str(run, "entity"), str(run, "project"));
    const cJSON *rows = item(run, "rows");
    int n = cJSON_GetArraySize(rows), bad = -1;
    for (int i = 0; i < n && bad < 0; i++) {
        const cJSON *row = cJSON_GetArrayItem(rows, i);
        int has_eval = item(row, "eval/loss") != NULL;
        if (num(row, "_step") != i || fabs(num(row, "train/loss") - loss_at(i)) > 1e-12 ||
            num(row, "train/lr") != 3e-4 || has_eval != (i % 20 == 0) ||
            (has_eval && fabs(num(row, "eval/loss") - loss_at(i) - 0.1) > 1e-12) || !(num(row, "_runtime") >= 0) ||
            !(num(row, "_timestamp") > 1.6e9))
            bad = i;
    }
    CHECK(n == STEPS && bad < 0, "%s: %d rows (want %d with steps 0..%d in order), first bad row %d", what, n, STEPS,
          STEPS - 1, bad);
    CHECK(allow_duplicates || num(run, "duplicates") == 0, "%s: no row delivered twice (%g duplicates)", what,
          num(run, "duplicates"));
    const cJSON *sum = item(run, "summary");
    CHECK(fabs(num(sum, "train/loss") - loss_at(STEPS - 1)) < 1e-12 && num(sum, "best/eval_loss") == 2.31 &&
              num(sum, "_step") == STEPS - 1 && cJSON_IsNumber(item(item(sum, "_wandb"), "runtime")),
          "%s: summary has the last train/loss, best/eval_loss, _step and _wandb.runtime", what);
    const cJSON *cfg = item(run, "config");
    CHECK(num(item(cfg, "lr"), "value") == 0.0003 && num(item(item(cfg, "model"), "value"), "d_model") == 384 &&
              !strcmp(str(item(item(cfg, "model"), "value"), "attn"), "kv"),
          "%s: config arrives as {\"key\": {\"value\": ...}} with nesting kept", what);
    const cJSON *tags = item(run, "tags");
    CHECK(!strcmp(str(run, "displayName"), "gpt6L-kv") && !strcmp(str(run, "group"), "kv-ablation") &&
              !strcmp(str(run, "jobType"), "train") && !strcmp(str(run, "commit"), "0123abcd") &&
              cJSON_GetArraySize(tags) == 2 && in_strings(tags, "baseline") && in_strings(tags, "kv") &&
              str(run, "host")[0] && str(run, "program")[0],
          "%s: run metadata (name, group, job type, commit, tags, host, program)", what);
    const cJSON *file = item(item(run, "files"), "metrics.json");
    CHECK(in_strings(item(run, "uploaded"), "metrics.json") && !strcmp(str(file, "text"), METRICS_TEXT) &&
              num(file, "size") == strlen(METRICS_TEXT),
          "%s: metrics.json PUT with its exact bytes and reported as uploaded", what);
    CHECK(cJSON_IsTrue(item(run, "completed")) && num(run, "exitcode") == 0, "%s: run completed with exit code 0",
          what);
}

/* ---------------------------------------------------------------- scenarios */

static void test_happy_path(void) {
    Server sv;
    char state_file[4200];
    snprintf(state_file, sizeof state_file, "%s/state.json", tmp);
    if (!server_start(&sv, (const char *[]){"--strict", "--state-file", state_file, NULL})) return;
    WandbSettings s = settings(&sv, "happy001");
    s.entity = "alice";
    capture_begin();
    WandbRun *r = wandb_init(&s);
    char url[256], spool[4200];
    snprintf(url, sizeof url, "%s", wandb_run_url(r) ? wandb_run_url(r) : "(none)");
    snprintf(spool, sizeof spool, "%s", wandb_spool_dir(r) ? wandb_spool_dir(r) : "(none)");
    standard_run(r, 0.005);
    wandb_finish(r, 0);
    char *out = capture_end();

    char want[256];
    snprintf(want, sizeof want, "%s/alice/tiny-gpt/runs/happy001", sv.url);
    CHECK(!strcmp(url, want), "happy: run URL %s (want %s)", url, want);
    CHECK(strstr(out, want) && strstr(out, "run uploaded"), "happy: prints the run URL and the upload result:\n%s", out);
    char want_spool[4200];
    snprintf(want_spool, sizeof want_spool, "%s/wandb-c/happy001", tmp);
    CHECK(!strcmp(spool, want_spool), "happy: spool in %s (got %s)", want_spool, spool);
    CHECK(spool_records(spool, "history") == STEPS && spool_records(spool, "run") == 1 &&
              spool_records(spool, "config") == 1 && spool_records(spool, "file") == 1 &&
              spool_records(spool, "exit") == 1 && spool_records(spool, "spool") == 1,
          "happy: the spool holds the header, run, config, %d rows, the file and the exit code", STEPS);

    cJSON *st = server_state(&sv);
    check_standard(st, "happy001", "alice", 0, "happy");
    /* request order: the PUT carries no credentials, complete comes last, nothing follows */
    const cJSON *q;
    int fs = 0, after_complete = 0, bad_path = 0, put_auth = -1, complete_seen = 0;
    cJSON_ArrayForEach(q, item(st, "requests")) {
        if (complete_seen) after_complete++;
        if (!strcmp(str(q, "op"), "Storage")) put_auth = cJSON_IsTrue(item(q, "auth"));
        if (strcmp(str(q, "op"), "FileStream")) continue;
        fs++;
        bad_path += strcmp(str(q, "path"), "/files/alice/tiny-gpt/happy001/file_stream") != 0;
        complete_seen |= cJSON_IsTrue(item(item(q, "fs"), "complete"));
    }
    CHECK(fs >= 2 && bad_path == 0, "happy: %d FileStream requests, %d to another path", fs, bad_path);
    CHECK(put_auth == 0, "happy: the storage PUT carries no Authorization header (%d)", put_auth);
    CHECK(complete_seen && after_complete == 0, "happy: complete is the last request (%d after it)", after_complete);
    int before = cJSON_GetArraySize(item(st, "requests"));
    cJSON_Delete(st);

    /* nothing after complete: no stray traffic, and a sync of the finished spool sends nothing */
    sleep_s(0.5);
    Err e;
    capture_begin();
    int rc = wandb_sync_dir(spool, &s, &e);
    free(out);
    out = capture_end();
    CHECK(rc == 0 && strstr(out, "already synced"), "happy: sync of a completed run is a no-op: %s", out);
    st = server_state(&sv);
    CHECK(cJSON_GetArraySize(item(st, "requests")) == before, "happy: no request after completion (%d, then %d)",
          before, cJSON_GetArraySize(item(st, "requests")));
    cJSON_Delete(st);
    server_stop(&sv);

    char *saved = read_file(state_file, NULL, NULL);
    st = cJSON_Parse(saved ? saved : "");
    CHECK(bad_steps(find_run(st, "happy001"), STEPS) == -1, "happy: --state-file written on shutdown with all rows");
    cJSON_Delete(st);
    free(saved);
    free(out);
}

static void test_entity_resolution(void) {
    Server sv;
    if (!server_start(&sv, NULL)) return;
    WandbSettings s = settings(&sv, "entity01"); /* entity unset: the server picks it */
    capture_begin();
    WandbRun *r = wandb_init(&s);
    char want[256];
    snprintf(want, sizeof want, "%s/fake-default-entity/tiny-gpt/runs/entity01", sv.url);
    int url_ok = wandb_run_url(r) && !strcmp(wandb_run_url(r), want);
    standard_run(r, 0);
    wandb_finish(r, 0);
    free(capture_end());
    CHECK(url_ok, "entity: run URL uses the entity from the UpsertBucket answer");
    cJSON *st = server_state(&sv);
    check_standard(st, "entity01", "fake-default-entity", 0, "entity");
    int bad = 0;
    const cJSON *q;
    cJSON_ArrayForEach(q, item(st, "requests")) if (!strcmp(str(q, "op"), "FileStream") &&
                                                   strncmp(str(q, "path"), "/files/fake-default-entity/", 27)) bad++;
    CHECK(count_requests(st, "FileStream", 0) > 0 && bad == 0, "entity: every FileStream path uses fake-default-entity");
    cJSON_Delete(st);
    server_stop(&sv);
}

static void test_netrc(void) {
    Server sv;
    if (!server_start(&sv, NULL)) return;
    char netrc[4200], host[64], text[512];
    snprintf(netrc, sizeof netrc, "%s/netrc", tmp);
    snprintf(host, sizeof host, "%s", sv.url + strlen("http://"));
    snprintf(text, sizeof text, "machine api.wandb.ai login user password wrong-one\nmachine %s login api password %s\n",
             host, KEY);
    Err e;
    CHECK(write_file_atomic(netrc, text, strlen(text), &e) == 0, "%s", e.msg);
    setenv("NETRC", netrc, 1);
    WandbSettings s = settings(&sv, "netrc001");
    s.api_key = NULL;
    capture_begin();
    WandbRun *r = wandb_init(&s);
    int online = wandb_run_url(r) != NULL;
    wandb_log(r, 0, "train/loss", 1.0);
    wandb_finish(r, 0);
    free(capture_end());
    CHECK(online, "netrc: the key comes from the entry for host:port");

    snprintf(text, sizeof text, "machine 127.0.0.1:1 password %s\n", KEY); /* no entry for this port */
    CHECK(write_file_atomic(netrc, text, strlen(text), &e) == 0, "%s", e.msg);
    s.run_id = "netrc002";
    capture_begin();
    r = wandb_init(&s);
    online = wandb_run_url(r) != NULL;
    wandb_finish(r, 0);
    char *out = capture_end();
    CHECK(!online && strstr(out, "no API key for") && strstr(out, "make wandb-sync"),
          "netrc: without a matching entry the run goes offline with one clear line:\n%s", out);
    free(out);
    unsetenv("NETRC");
    cJSON *st = server_state(&sv);
    const cJSON *run = find_run(st, "netrc001");
    CHECK(run && cJSON_IsTrue(item(run, "completed")) && !find_run(st, "netrc002"),
          "netrc: the run with the key is complete, the other never reached the server");
    cJSON_Delete(st);
    server_stop(&sv);
}

static void test_transient(void) {
    Server sv;
    if (!server_start(&sv, NULL)) return;
    inject(&sv, "[{\"match\":\"UpsertBucket\",\"times\":2,\"action\":{\"status\":500}},"
                "{\"match\":\"FileStream\",\"times\":3,\"action\":{\"status\":503}},"
                "{\"match\":\"FileStream\",\"times\":1,\"action\":{\"status\":429,\"retry_after\":1}},"
                "{\"match\":\"FileStream\",\"times\":1,\"action\":{\"ratelimit_headers\":{\"remaining\":0,\"reset\":1}}}]");
    WandbSettings s = settings(&sv, "transient");
    capture_begin();
    WandbRun *r = wandb_init(&s);
    for (long step = 0; step < 30; step++) {
        wandb_log(r, step, "train/loss", loss_at(step));
        wandb_commit(r, step);
        sleep_s(0.01);
    }
    sleep_s(2.7); /* the failures, the Retry-After and RateLimit-Reset waits happen mid-run */
    for (long step = 30; step < 40; step++) {
        wandb_log(r, step, "train/loss", loss_at(step));
        wandb_commit(r, step);
    }
    wandb_finish(r, 0);
    free(capture_end());

    cJSON *st = server_state(&sv);
    check_no_violations(st, "transient"); /* includes: identical resends, Retry-After and RateLimit-Reset honoured */
    const cJSON *run = find_run(st, "transient");
    CHECK(count_requests(st, "UpsertBucket", 500) == 2 && count_requests(st, "UpsertBucket", 200) == 1,
          "transient: UpsertBucket retried after two 500s");
    CHECK(count_requests(st, "FileStream", 503) == 3 && count_requests(st, "FileStream", 429) == 1,
          "transient: three 503s and one 429 seen");
    CHECK(run && bad_steps(run, 40) == -1 && num(run, "duplicates") == 0,
          "transient: 40 rows exactly once, in order (bad %d, %g duplicates)", run ? bad_steps(run, 40) : -3,
          run ? num(run, "duplicates") : -1);
    CHECK(run && cJSON_IsTrue(item(run, "completed")), "transient: run completed");
    /* the wait after the 429 */
    double t429 = -1, next = -1;
    const cJSON *q;
    cJSON_ArrayForEach(q, item(st, "requests")) {
        if (strcmp(str(q, "op"), "FileStream")) continue;
        if (t429 > 0 && next < 0) next = num(q, "t");
        if (num(q, "status") == 429) t429 = num(q, "t");
    }
    CHECK(t429 > 0 && next - t429 >= 0.98, "transient: Retry-After: 1 honoured (%.3f s)", next - t429);
    cJSON_Delete(st);
    server_stop(&sv);
}

static void test_upsert_400(void) {
    Server sv;
    if (!server_start(&sv, NULL)) return;
    inject(&sv, "{\"match\":\"UpsertBucket\",\"times\":5,\"action\":{\"status\":400,\"body\":{\"data\":{\"upsertBucket\":null},"
                "\"errors\":[{\"message\":\"run config cannot exceed 15 MB\",\"path\":[\"upsertBucket\"]}]}}}");
    WandbSettings s = settings(&sv, "upsert400");
    capture_begin();
    WandbRun *r = wandb_init(&s);
    int offline = wandb_run_url(r) == NULL;
    for (long step = 0; step < 10; step++) {
        wandb_log(r, step, "train/loss", loss_at(step));
        wandb_commit(r, step);
    }
    char spool[4200];
    snprintf(spool, sizeof spool, "%s", wandb_spool_dir(r));
    wandb_finish(r, 0);
    char *out = capture_end();
    CHECK(offline && count_of(out, "run config cannot exceed 15 MB") == 1 && strstr(out, "continuing offline") &&
              strstr(out, "make wandb-sync"),
          "upsert 400: the server's message in one line, the run goes on offline:\n%s", out);
    cJSON *st = server_state(&sv);
    CHECK(count_requests(st, "UpsertBucket", 0) == 1 && count_requests(st, "FileStream", 0) == 0,
          "upsert 400: not retried, no FileStream");
    CHECK(spool_records(spool, "history") == 10 && spool_records(spool, "exit") == 1, "upsert 400: spool complete");
    cJSON_Delete(st);
    free(out);
    server_stop(&sv);
}

/* FileStream answers `status` (404 or 413) to the second request: no retry,
 * nothing more sent, the spool keeps everything and a sync completes the run. */
static void test_filestream_permanent(int status) {
    Server sv;
    if (!server_start(&sv, NULL)) return;
    char rule[256], id[32], what[32];
    snprintf(rule, sizeof rule, "{\"match\":\"FileStream\",\"after\":1,\"action\":{\"status\":%d}}", status);
    snprintf(id, sizeof id, "perm%d", status);
    snprintf(what, sizeof what, "FileStream %d", status);
    inject(&sv, rule);
    WandbSettings s = settings(&sv, id);
    capture_begin();
    WandbRun *r = wandb_init(&s);
    for (long step = 0; step < 30; step++) {
        wandb_log(r, step, "train/loss", loss_at(step));
        wandb_commit(r, step);
        if (step % 10 == 9) sleep_s(0.4);
    }
    char spool[4200];
    snprintf(spool, sizeof spool, "%s", wandb_spool_dir(r));
    wandb_finish(r, 3);
    char *out = capture_end();
    char code[32];
    snprintf(code, sizeof code, "HTTP %d", status);
    CHECK(strstr(out, code) && strstr(out, "make wandb-sync"), "%s: reported with the sync hint:\n%s", what, out);
    cJSON *st = server_state(&sv);
    const cJSON *run = find_run(st, id);
    CHECK(count_requests(st, "FileStream", 0) == 2 && count_requests(st, "FileStream", status) == 1,
          "%s: no retry and nothing after it (%d FileStream requests)", what, count_requests(st, "FileStream", 0));
    CHECK(run && !cJSON_IsTrue(item(run, "completed")), "%s: the run is not completed online", what);
    CHECK(spool_records(spool, "history") == 30, "%s: the spool holds all 30 rows", what);
    cJSON_Delete(st);

    Err e;
    capture_begin();
    int rc = wandb_sync_dir(spool, &s, &e);
    free(capture_end());
    CHECK(rc == 0, "%s: sync afterwards: %s", what, rc ? e.msg : "ok");
    st = server_state(&sv);
    run = find_run(st, id);
    check_no_violations(st, what);
    CHECK(run && bad_steps(run, 30) == -1 && num(run, "duplicates") == 0 && cJSON_IsTrue(item(run, "completed")) &&
              num(run, "exitcode") == 3,
          "%s: after sync 30 rows exactly once, completed with exit code 3", what);
    cJSON_Delete(st);
    free(out);
    server_stop(&sv);
}

static void test_wrong_key(void) {
    Server sv;
    if (!server_start(&sv, NULL)) return;
    const char *wrong = "wrong-key-0000-1111";
    WandbSettings s = settings(&sv, "wrongkey");
    s.api_key = wrong;
    capture_begin();
    WandbRun *r = wandb_init(&s);
    int offline = wandb_run_url(r) == NULL;
    for (long step = 0; step < 10; step++) {
        wandb_log(r, step, "train/loss", loss_at(step));
        wandb_commit(r, step);
    }
    char spool[4200];
    snprintf(spool, sizeof spool, "%s", wandb_spool_dir(r));
    wandb_finish(r, 0);
    char *out = capture_end();
    CHECK(offline && count_of(out, "invalid API key") == 1 && strstr(out, "continuing offline") &&
              strstr(out, "make wandb-sync") && !strstr(out, wrong),
          "wrong key: one clear line, the key not shown, the run carries on offline:\n%s", out);
    cJSON *st = server_state(&sv);
    CHECK(count_requests(st, "UpsertBucket", 401) == 1 && count_requests(st, "UpsertBucket", 0) == 1 &&
              count_requests(st, "FileStream", 0) == 0,
          "wrong key: one UpsertBucket (401), no retry, no FileStream");
    CHECK(spool_records(spool, "history") == 10 && spool_records(spool, "exit") == 1, "wrong key: spool complete");
    char path[4300];
    snprintf(path, sizeof path, "%s/spool.jsonl", spool);
    char *text = read_file(path, NULL, NULL);
    CHECK(text && !strstr(text, wrong), "wrong key: the key is not in the spool");
    free(text);
    cJSON_Delete(st);

    Err e;
    capture_begin();
    int rc = wandb_sync_dir(spool, &s, &e);
    free(capture_end());
    CHECK(rc != 0 && strstr(e.msg, "invalid API key"), "wrong key: sync with the wrong key fails clearly: %s", e.msg);
    s.api_key = KEY;
    capture_begin();
    rc = wandb_sync_dir(spool, &s, &e);
    free(capture_end());
    st = server_state(&sv);
    const cJSON *run = find_run(st, "wrongkey");
    CHECK(rc == 0 && run && bad_steps(run, 10) == -1 && cJSON_IsTrue(item(run, "completed")),
          "wrong key: sync with the right key uploads the run");
    cJSON_Delete(st);
    free(out);
    server_stop(&sv);
}

static void test_drops_and_delays(void) {
    Server sv;
    if (!server_start(&sv, NULL)) return;
    /* the 2nd and 3rd FileStream requests lose their connection; a later one answers after the client's timeout */
    inject(&sv, "[{\"match\":\"FileStream\",\"after\":1,\"times\":2,\"action\":{\"close_connection\":true}},"
                "{\"match\":\"FileStream\",\"after\":3,\"times\":1,\"action\":{\"delay_ms\":1000}}]");
    WandbSettings s = settings(&sv, "flaky001");
    s.filestream_timeout_s = 0.4;
    capture_begin();
    WandbRun *r = wandb_init(&s);
    for (long step = 0; step < 60; step++) {
        wandb_log(r, step, "train/loss", loss_at(step));
        wandb_commit(r, step);
        sleep_s(0.03);
    }
    wandb_finish(r, 0);
    free(capture_end());
    wait_answered(&sv);
    cJSON *st = server_state(&sv);
    check_no_violations(st, "drops and delays");
    const cJSON *run = find_run(st, "flaky001"), *rule;
    int closed = 0, left = 0;
    const cJSON *q;
    cJSON_ArrayForEach(q, item(st, "requests")) closed += !strcmp(str(q, "status"), "closed");
    cJSON_ArrayForEach(rule, item(st, "rules")) left += (int)num(rule, "times");
    CHECK(closed == 2 && left == 0, "drops and delays: 2 dropped connections and the slow answer happened (%d, %d left)",
          closed, left);
    CHECK(run && bad_steps(run, 60) == -1 && cJSON_IsTrue(item(run, "completed")),
          "drops and delays: 60 rows in order, no gaps, completed (duplicates only as identical resends: %g)",
          run ? num(run, "duplicates") : -1);
    cJSON_Delete(st);
    server_stop(&sv);
}

static void test_heartbeat(void) {
    Server sv;
    if (!server_start(&sv, (const char *[]){"--heartbeat-limit", "1.0", NULL})) return;
    WandbSettings s = settings(&sv, "heartbt1");
    s.heartbeat_s = 0.2;
    capture_begin();
    WandbRun *r = wandb_init(&s);
    wandb_log(r, 0, "train/loss", 1.0);
    wandb_commit(r, 0);
    sleep_s(1.5); /* a long evaluation: the worker must keep the run alive */
    wandb_log(r, 1, "train/loss", 0.9);
    wandb_finish(r, 0);
    free(capture_end());
    cJSON *st = server_state(&sv);
    int beats = 0;
    const cJSON *q;
    cJSON_ArrayForEach(q, item(st, "requests")) beats += cJSON_IsTrue(item(item(q, "fs"), "heartbeat"));
    check_no_violations(st, "heartbeat"); /* no gap over 1 s */
    CHECK(beats >= 4, "heartbeat: %d {} requests while the caller slept 1.5 s", beats);
    CHECK(bad_steps(find_run(st, "heartbt1"), 2) == -1, "heartbeat: both rows arrived");
    cJSON_Delete(st);
    server_stop(&sv);
}

static void test_burst(void) {
    Server sv;
    if (!server_start(&sv, NULL)) return;
    enum { N = 3000 };
    WandbSettings s = settings(&sv, "burst001");
    s.request_bytes = 64 << 10; /* forces splitting: N rows are about 300 KB */
    capture_begin();
    WandbRun *r = wandb_init(&s);
    double t0 = wall_seconds();
    for (long step = 0; step < N; step++) {
        wandb_log(r, step, "train/loss", loss_at(step));
        wandb_log(r, step, "train/lr", 3e-4);
        wandb_log(r, step, "perf/tokens_per_sec", 12345.5 + (double)step);
        wandb_commit(r, step);
    }
    double logging = wall_seconds() - t0;
    wandb_finish(r, 0);
    free(capture_end());
    cJSON *st = server_state(&sv);
    check_no_violations(st, "burst"); /* includes pacing: data requests >= 0.15 s apart */
    const cJSON *q;
    int data = 0;
    long expect = 0, contiguous = 1;
    cJSON_ArrayForEach(q, item(st, "requests")) {
        const cJSON *fs = item(q, "fs");
        if (num(fs, "history_lines") > 0) {
            data++;
            contiguous &= num(fs, "history_offset") == expect;
            expect += (long)num(fs, "history_lines");
        }
    }
    CHECK(bad_steps(find_run(st, "burst001"), N) == -1, "burst: %d rows in order", N);
    CHECK(data >= 5 && data <= 60 && contiguous, "burst: %d batched data requests with contiguous offsets", data);
    CHECK(logging < 5.0, "burst: logging %d steps never waits for the network (%.2f s)", N, logging);
    cJSON_Delete(st);
    server_stop(&sv);
}

static void test_stop(void) {
    Server sv;
    if (!server_start(&sv, NULL)) return;
    inject(&sv, "{\"match\":\"FileStream\",\"action\":{\"stopped\":true}}");
    WandbSettings s = settings(&sv, "stop0001");
    capture_begin();
    WandbRun *r = wandb_init(&s);
    int before = wandb_should_stop(r);
    wandb_log(r, 0, "train/loss", 1.0);
    wandb_commit(r, 0);
    for (int i = 0; i < 500 && !wandb_should_stop(r); i++) sleep_s(0.01);
    int after = wandb_should_stop(r);
    wandb_finish(r, 0);
    free(capture_end());
    CHECK(!before && after, "stop: should_stop goes from 0 to 1 after the server says stopped (%d, %d)", before, after);
    CHECK(wandb_should_stop(NULL) == 0, "stop: should_stop(NULL) is 0");
    server_stop(&sv);
}

/* CreateRunFiles answers 200 with errors: reported once, not retried, the run still completes. */
static void test_file_upload_error(void) {
    Server sv;
    if (!server_start(&sv, NULL)) return;
    inject(&sv, "{\"match\":\"CreateRunFiles\",\"action\":{\"graphql_errors\":\"storage quota exceeded\"}}");
    WandbSettings s = settings(&sv, "fileerr1");
    capture_begin();
    WandbRun *r = wandb_init(&s);
    wandb_log(r, 0, "train/loss", 1.0);
    int rc = wandb_upload_file(r, metrics_path, "plots/metrics.json");
    int escape = wandb_upload_file(r, metrics_path, "../outside.json") + wandb_upload_file(r, metrics_path, "/abs.json") +
                 wandb_upload_file(r, metrics_path, "a//b.json");
    char copy[4300];
    snprintf(copy, sizeof copy, "%s/files/plots/metrics.json", wandb_spool_dir(r));
    wandb_finish(r, 0);
    char *out = capture_end();
    char *text = read_file(copy, NULL, NULL);
    CHECK(rc == 0 && text && !strcmp(text, METRICS_TEXT), "file error: the file is copied into the spool");
    CHECK(escape == -3 && count_of(out, "is not a path inside the run") == 3, "file error: paths outside the run refused");
    CHECK(count_of(out, "storage quota exceeded") == 1, "file error: the server's message in one line:\n%s", out);
    cJSON *st = server_state(&sv);
    const cJSON *run = find_run(st, "fileerr1");
    check_no_violations(st, "file error");
    CHECK(count_requests(st, "CreateRunFiles", 0) == 1 && count_requests(st, "Storage", 0) == 0,
          "file error: errors at 200 are not retried");
    CHECK(run && cJSON_GetArraySize(item(run, "uploaded")) == 0 && cJSON_IsTrue(item(run, "completed")),
          "file error: nothing reported as uploaded, the run completes");
    CHECK(wandb_upload_file(NULL, metrics_path, "x.json") == 0, "file error: upload_file(NULL) is a no-op");
    cJSON_Delete(st);
    free(text);
    free(out);
    server_stop(&sv);
}

static void test_nan_inf(void) {
    Server sv;
    if (!server_start(&sv, NULL)) return;
    WandbSettings s = settings(&sv, "nanrun01");
    capture_begin();
    WandbRun *r = wandb_init(&s);
    double bad[3] = {NAN, INFINITY, -INFINITY};
    for (long step = 0; step < 3; step++) {
        wandb_log(r, step, "train/loss", bad[step]);
        wandb_log(r, step, "train/lr", 1e-3);
        wandb_commit(r, step);
    }
    wandb_log(r, 5, "train/lr", 2e-3);
    wandb_commit(r, 5);
    wandb_log(r, 3, "train/lr", 9.0);      /* lower step: dropped */
    wandb_log(r, 5, "train/lr", 9.0);      /* the closed step again: dropped */
    wandb_log(r, 6, "_private", 9.0);      /* reserved prefix: dropped */
    char spool[4200];
    snprintf(spool, sizeof spool, "%s", wandb_spool_dir(r));
    wandb_finish(r, 0);
    char *out = capture_end();
    CHECK(strstr(out, "dropped") && strstr(out, "3 values were dropped"), "nan: drops reported and counted:\n%s", out);
    cJSON *st = server_state(&sv);
    check_no_violations(st, "nan"); /* every line parsed as an object with its _step */
    const cJSON *run = find_run(st, "nanrun01"), *hist = item(run, "history"), *rows = item(run, "rows");
    const char *want[3] = {"\"train/loss\":NaN", "\"train/loss\":Infinity", "\"train/loss\":-Infinity"};
    const char *parsed[3] = {"NaN", "Infinity", "-Infinity"};
    int ok = cJSON_GetArraySize(hist) == 4;
    for (int i = 0; i < 3 && ok; i++) {
        const cJSON *line = cJSON_GetArrayItem(hist, i);
        ok = cJSON_IsString(line) && strstr(line->valuestring, want[i]) &&
             !strcmp(str(cJSON_GetArrayItem(rows, i), "train/loss"), parsed[i]);
    }
    CHECK(ok, "nan: NaN, Infinity, -Infinity arrive as bare tokens and parse as floats");
    CHECK(num(cJSON_GetArrayItem(rows, 3), "_step") == 5 && num(cJSON_GetArrayItem(rows, 3), "train/lr") == 2e-3,
          "nan: the dropped values did not reach the server");
    CHECK(!strcmp(str(item(run, "summary"), "train/loss"), "-Infinity"), "nan: the summary keeps the last value");
    char path[4300];
    snprintf(path, sizeof path, "%s/spool.jsonl", spool);
    char *text = read_file(path, NULL, NULL);
    CHECK(text && strstr(text, want[0]) && !strstr(text, "\"NaN\""), "nan: bare tokens in the spool too");
    free(text);
    cJSON_Delete(st);
    free(out);
    server_stop(&sv);
}

/* The first FileStream answer takes 2 s, longer than the finish bound of
 * 1 s: finish gives up in time and the spool keeps everything. The server
 * still stores that request after the client hung up, so the sync must go
 * on after those lines instead of sending them again. */
static void test_finish_bounded(void) {
    Server sv;
    if (!server_start(&sv, NULL)) return;
    inject(&sv, "{\"match\":\"FileStream\",\"times\":1,\"action\":{\"delay_ms\":2000}}");
    WandbSettings s = settings(&sv, "slowfin1");
    s.finish_timeout_s = 1.0;
    s.filestream_timeout_s = 30;
    capture_begin();
    WandbRun *r = wandb_init(&s);
    for (long step = 0; step < 10; step++) {
        wandb_log(r, step, "train/loss", loss_at(step));
        wandb_commit(r, step);
    }
    char spool[4200];
    snprintf(spool, sizeof spool, "%s", wandb_spool_dir(r));
    sleep_s(0.4); /* a request is in flight when finish starts */
    double t0 = wall_seconds();
    wandb_finish(r, 0);
    double took = wall_seconds() - t0;
    char *out = capture_end();
    CHECK(took < 2.0, "finish bounded: returned after %.2f s (bound 1 s)", took);
    CHECK(strstr(out, "time limit") && strstr(out, "make wandb-sync"), "finish bounded: says what to do:\n%s", out);
    CHECK(spool_records(spool, "history") == 10 && spool_records(spool, "exit") == 1, "finish bounded: spool complete");
    free(out);

    wait_answered(&sv); /* the abandoned request lands */
    cJSON *st = server_state(&sv);
    const cJSON *run = find_run(st, "slowfin1");
    int stored = run ? cJSON_GetArraySize(item(run, "rows")) : -1;
    cJSON_Delete(st);
    Err e;
    capture_begin();
    int rc = wandb_sync_dir(spool, &s, &e);
    free(capture_end());
    st = server_state(&sv);
    run = find_run(st, "slowfin1");
    check_no_violations(st, "finish bounded then sync");
    CHECK(stored == 10 && rc == 0 && bad_steps(run, 10) == -1 && num(run, "duplicates") == 0 &&
              cJSON_IsTrue(item(run, "completed")),
          "finish bounded: the sync goes on after the %d lines stored without an answer: no row twice (%g)", stored,
          num(run, "duplicates"));
    cJSON_Delete(st);
    server_stop(&sv);
}

/* Online run while nothing listens at the server's address the whole time,
 * then sync: the same final state as the happy path. With a 30 s init bound
 * and WANDB_CONNECT_GRACE=1, the step goes offline after the 1 s grace
 * (not after 30 s), and finish gives up after one last refused attempt
 * instead of waiting for its 15 s bound. */
static void test_down_then_sync(void) {
    Server dead;
    if (!server_start(&dead, NULL)) return;
    server_stop(&dead); /* nothing listens on its port any more */
    WandbSettings s = settings(&dead, "downrun1");
    s.init_timeout_s = 30;
    setenv("WANDB_CONNECT_GRACE", "1", 1);
    capture_begin();
    double t0 = wall_seconds();
    WandbRun *r = wandb_init(&s);
    double init_took = wall_seconds() - t0;
    int offline = wandb_run_url(r) == NULL;
    standard_run(r, 0);
    char spool[4200];
    snprintf(spool, sizeof spool, "%s", wandb_spool_dir(r));
    t0 = wall_seconds();
    wandb_finish(r, 0);
    double finish_took = wall_seconds() - t0;
    char *out = capture_end();
    unsetenv("WANDB_CONNECT_GRACE");
    CHECK(offline && init_took >= 0.95 && init_took < 4.0 && count_of(out, "continuing offline for now") == 1,
          "nothing listening: init retries for the 1 s grace, not the 30 s bound (%.2f s), and says it goes "
          "offline for now:\n%s", init_took, out);
    CHECK(finish_took < 4.0 && strstr(out, "the run stays in the spool") && strstr(out, "make wandb-sync"),
          "nothing listening: finish gives up after one last attempt (%.2f s, bound 15 s) and says to sync:\n%s",
          finish_took, out);
    free(out);

    Server sv;
    if (!server_start(&sv, NULL)) return;
    s.base_url = sv.url;
    Err e;
    capture_begin();
    int rc = wandb_sync_dir(spool, &s, &e);
    out = capture_end();
    CHECK(rc == 0 && strstr(out, "synced"), "server down: sync succeeds: %s%s", rc ? e.msg : "", out);
    cJSON *st = server_state(&sv);
    check_standard(st, "downrun1", "fake-default-entity", 0, "down then sync");
    CHECK(count_requests(st, "UpsertBucket", 0) == 1, "down then sync: one UpsertBucket");
    int before = cJSON_GetArraySize(item(st, "requests"));
    cJSON_Delete(st);
    free(out);
    capture_begin();
    rc = wandb_sync_dir(spool, &s, &e);
    free(capture_end());
    st = server_state(&sv);
    CHECK(rc == 0 && cJSON_GetArraySize(item(st, "requests")) == before, "down then sync: a second sync sends nothing");
    cJSON_Delete(st);
    server_stop(&sv);
}

/* The server answers 503 for the first 20 s of a 30 s init bound, with the
 * default backoff (2, 4, 8, 16 s: attempts near 0, 2, 6 and 14 s, the next
 * one planned past 30 s). The last attempt is moved to the end of the bound
 * (25 s: 5 s before it), finds the server back and the run goes online. */
static void test_init_last_attempt(void) {
    Server sv;
    if (!server_start(&sv, NULL)) return;
    inject(&sv, "{\"match\":\"UpsertBucket\",\"for_s\":20,\"action\":{\"status\":503}}");
    WandbSettings s = settings(&sv, "lastatt1");
    s.init_timeout_s = 30;
    s.retry_min_s = s.retry_max_s = 0; /* the defaults: 2 to 60 s */
    capture_begin();
    double t0 = wall_seconds();
    WandbRun *r = wandb_init(&s);
    double init_took = wall_seconds() - t0;
    int online = wandb_run_url(r) != NULL;
    standard_run(r, 0);
    wandb_finish(r, 0);
    char *out = capture_end();
    CHECK(online && init_took >= 20 && init_took <= 30.5,
          "init, server back after 20 s of a 30 s bound: online (%d) after a last attempt before the bound "
          "(%.1f s):\n%s", online, init_took, out);
    cJSON *st = server_state(&sv);
    CHECK(count_requests(st, "UpsertBucket", 503) >= 3 && count_requests(st, "UpsertBucket", 200) == 1,
          "init, server back after 20 s: %d answers 503, then one 200", count_requests(st, "UpsertBucket", 503));
    check_standard(st, "lastatt1", "fake-default-entity", 0, "init last attempt");
    cJSON_Delete(st);
    free(out);
    server_stop(&sv);
}

/* Nothing listens when the step starts: init goes offline for now after the
 * 1 s grace; a server then appears on that port while the step trains, and
 * the upload thread (still retrying) creates the run, uploads the rows
 * logged meanwhile in order, and the rows logged after it answered arrive
 * live, before finish: every row exactly once, no protocol violation. */
static void test_server_appears_later(void) {
    Server sv;
    if (!server_start(&sv, NULL)) return;
    server_stop(&sv);
    const char *port = strrchr(sv.url, ':') + 1;
    WandbSettings s = settings(&sv, "latesrv1");
    s.init_timeout_s = 30;
    s.connect_grace_s = 1;
    capture_begin();
    double t0 = wall_seconds();
    WandbRun *r = wandb_init(&s);
    double init_took = wall_seconds() - t0;
    int offline = wandb_run_url(r) == NULL;
    standard_steps(r, 0, STEPS / 2, 0.005);
    int started = server_start(&sv, (const char *[]){"--port", port, NULL});
    standard_steps(r, STEPS / 2, STEPS, 0.02);
    int stored = -1;
    for (int i = 0; started && i < 400 && stored < STEPS; i++) { /* live: before finish, within 20 s */
        cJSON *st = fetch_state(&sv);
        const cJSON *run = find_run(st, "latesrv1");
        stored = run ? cJSON_GetArraySize(item(run, "rows")) : -1;
        cJSON_Delete(st);
        if (stored < STEPS) sleep_s(0.05);
    }
    char url[256];
    snprintf(url, sizeof url, "%s", wandb_run_url(r) ? wandb_run_url(r) : "(none)");
    standard_end(r);
    wandb_finish(r, 0);
    char *out = capture_end();
    CHECK(offline && init_took >= 0.95 && init_took < 4.0 && strstr(out, "continuing offline for now"),
          "server appears later: init goes offline for now after the 1 s grace (%.2f s):\n%s", init_took, out);
    if (!started) {
        free(out);
        return;
    }
    char want[256];
    snprintf(want, sizeof want, "%s/fake-default-entity/tiny-gpt/runs/latesrv1", sv.url);
    CHECK(stored == STEPS && !strcmp(url, want) && strstr(out, "answers now") && strstr(out, "run uploaded"),
          "server appears later: all %d rows stored before finish (%d), run URL %s:\n%s", STEPS, stored, url, out);
    cJSON *st = server_state(&sv);
    check_standard(st, "latesrv1", "fake-default-entity", 0, "server appears later");
    CHECK(count_requests(st, "UpsertBucket", 0) == 1, "server appears later: one UpsertBucket");
    cJSON_Delete(st);
    free(out);
    server_stop(&sv);
}

/* The standard workload as an offline run of s (made offline here, with requests of 2 kB: about 25 rows each);
 * its spool folder into spool. Returns what the run printed (the caller frees it). */
static char *offline_standard_run(WandbSettings *s, char *spool, size_t cap) {
    s->mode = "offline";
    s->request_bytes = 2048;
    capture_begin();
    WandbRun *r = wandb_init(s);
    standard_run(r, 0);
    snprintf(spool, cap, "%s", wandb_spool_dir(r));
    wandb_finish(r, 0);
    return capture_end();
}

/* wandb_sync_dir with its output captured; *requests: the requests the server has seen by then. */
static int sync_counting(const Server *sv, const char *spool, const WandbSettings *s, Err *e, int *requests) {
    capture_begin();
    int rc = wandb_sync_dir(spool, s, e);
    free(capture_end());
    cJSON *st = server_state(sv);
    *requests = cJSON_GetArraySize(item(st, "requests"));
    cJSON_Delete(st);
    return rc;
}

/* An offline run (no traffic while offline) whose sync fails midway, then resumes. */
static void test_sync_resumes_after_failure(void) {
    Server sv;
    if (!server_start(&sv, NULL)) return;
    WandbSettings s = settings(&sv, "resume01");
    char spool[4200];
    char *out = offline_standard_run(&s, spool, sizeof spool);
    CHECK(strstr(out, "make wandb-sync") != NULL, "offline: finish says how to upload:\n%s", out);
    free(out);
    cJSON *st = server_state(&sv);
    CHECK(cJSON_GetArraySize(item(st, "requests")) == 0, "offline: no traffic");
    cJSON_Delete(st);

    inject(&sv, "{\"match\":\"FileStream\",\"after\":2,\"action\":{\"status\":404}}");
    Err e;
    capture_begin();
    int rc = wandb_sync_dir(spool, &s, &e);
    free(capture_end());
    CHECK(rc != 0 && strstr(e.msg, "HTTP 404") && strstr(e.msg, "run the sync again"),
          "interrupted sync: the failure is reported: %s", rc ? e.msg : "(succeeded)");
    st = server_state(&sv);
    const cJSON *run = find_run(st, "resume01");
    int stored = run ? cJSON_GetArraySize(item(run, "rows")) : -1;
    cJSON_Delete(st);
    char path[4300];
    snprintf(path, sizeof path, "%s/sync_state.json", spool);
    char *text = read_file(path, NULL, NULL);
    cJSON *cursor = cJSON_Parse(text ? text : "");
    CHECK(stored > 0 && stored < STEPS && num(cursor, "history_sent") == stored,
          "interrupted sync: the cursor (%g) matches the %d rows acknowledged", num(cursor, "history_sent"), stored);
    cJSON_Delete(cursor);
    free(text);

    capture_begin();
    rc = wandb_sync_dir(spool, &s, &e);
    free(capture_end());
    CHECK(rc == 0, "interrupted sync: the rerun succeeds: %s", rc ? e.msg : "ok");
    st = server_state(&sv);
    check_standard(st, "resume01", "fake-default-entity", 0, "resumed sync");
    cJSON_Delete(st);
    server_stop(&sv);
}

static void write_text(const char *path, const char *text) {
    Err e;
    if (write_file_atomic(path, text, strlen(text), &e) != 0) FATAL("%s", e.msg);
}

/* A sync whose cursor (sync_state.json) or spool was damaged after an interrupted sync: it stops naming the file
 * and field, and sends nothing (until 2026-12-07 a damaged cursor counted as none, and the whole history went out
 * again as new rows: the server held it twice). With the cursor restored the sync completes with each row once. */
static void test_sync_damaged(void) {
    Server sv;
    if (!server_start(&sv, NULL)) return;
    WandbSettings s = settings(&sv, "damage01");
    char spool[4200], cursor[4300], rows[4300];
    free(offline_standard_run(&s, spool, sizeof spool));
    inject(&sv, "{\"match\":\"FileStream\",\"after\":2,\"action\":{\"status\":404}}");
    Err e;
    capture_begin();
    int rc = wandb_sync_dir(spool, &s, &e);
    free(capture_end());
    snprintf(cursor, sizeof cursor, "%s/sync_state.json", spool);
    snprintf(rows, sizeof rows, "%s/spool.jsonl", spool);
    char *good = read_file(cursor, NULL, NULL), *good_rows = read_file(rows, NULL, NULL);
    cJSON *st = server_state(&sv);
    int stored = cJSON_GetArraySize(item(find_run(st, "damage01"), "rows")),
        requests = cJSON_GetArraySize(item(st, "requests"));
    cJSON_Delete(st);
    CHECK(rc != 0 && good && good_rows && stored > 0 && stored < STEPS, "damaged: an interrupted sync left %d rows "
          "and a cursor", stored);
    if (!good || !good_rows) return;
    char many[256];
    snprintf(many, sizeof many, "{\"base_url\":\"%s\",\"url\":\"u\",\"history_sent\":%d,\"history_offset\":%d,"
             "\"uploaded\":[]}", sv.url, STEPS + 1, STEPS + 1);
    const char *cases[][2] = {
        {"{\"base_url\": ", "not a JSON object"},
        {"[]", "not a JSON object"},
        {"{\"url\":\"u\",\"history_sent\":0,\"history_offset\":0,\"uploaded\":[]}", "no base_url"},
        {"{\"base_url\":\"B\",\"url\":\"u\",\"history_sent\":-1,\"history_offset\":0,\"uploaded\":[]}", "history_sent"},
        {"{\"base_url\":\"B\",\"url\":\"u\",\"history_sent\":2.5,\"history_offset\":3,\"uploaded\":[]}", "history_sent"},
        {"{\"base_url\":\"B\",\"url\":\"u\",\"history_sent\":\"9\",\"history_offset\":9,\"uploaded\":[]}", "history_sent"},
        {"{\"base_url\":\"B\",\"url\":\"u\",\"history_sent\":5,\"history_offset\":4,\"uploaded\":[]}", "below"},
        {"{\"base_url\":\"B\",\"url\":\"u\",\"history_sent\":1,\"history_offset\":1,\"uploaded\":{}}", "uploaded is not"},
        {"{\"base_url\":\"B\",\"url\":\"u\",\"history_sent\":1,\"history_offset\":1,\"uploaded\":[7]}", "not a file name"},
        {"{\"base_url\":\"B\",\"url\":\"u\",\"history_sent\":1,\"history_offset\":1,\"uploaded\":[],\"complete\":1}",
         "complete"},
        {"{\"base_url\":\"B\",\"url\":\"u\",\"history_sent\":1,\"history_offset\":1,\"uploaded\":[],"
         "\"spool_short\":\"yes\"}", "spool_short is not"},
        {"{\"base_url\":\"B\",\"url\":\"u\",\"history_sent\":1,\"history_offset\":1,\"uploaded\":[],"
         "\"exit_code\":1.5}", "exit_code is not a whole number"},
        {many, "but the spool holds"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        write_text(cursor, cases[i][0]);
        int now;
        rc = sync_counting(&sv, spool, &s, &e, &now);
        CHECK(rc != 0 && strstr(e.msg, cursor) && strstr(e.msg, "damaged sync cursor") && strstr(e.msg, cases[i][1]) &&
                  strstr(e.msg, "hint:") && now == requests,
              "damaged cursor %s: refused naming '%s', no request sent (%d more): %s", cases[i][0], cases[i][1],
              now - requests, rc ? e.msg : "(synced)");
    }
    write_text(cursor, good);
    /* history rows whose _step is not a whole number above the row before's (the spool's 3rd line is step 0's row,
     * its 4th step 1's) */
    const char *steps[][2] = {{"\"_step\":1,", "\"_step\":1e400,"}, {"\"_step\":1,", "\"_step\":0,"},
                              {"\"_step\":1,", "\"_step\":1.5,"}, {"\"_step\":1,", "\"_stop\":1,"}};
    for (size_t i = 0; i < sizeof steps / sizeof *steps; i++) {
        char *text = xstrdup(good_rows), *at = strstr(text, steps[i][0]);
        CHECK(at != NULL, "the spool holds step 1's row as %s", steps[i][0]);
        if (!at) {
            free(text);
            break;
        }
        size_t a = strlen(steps[i][0]), b = strlen(steps[i][1]);
        char *bad = xmalloc(strlen(text) + b + 1);
        memcpy(bad, text, (size_t)(at - text));
        strcpy(bad + (at - text), steps[i][1]);
        strcat(bad, at + a);
        write_text(rows, bad);
        int line = 1;
        for (const char *p = bad; p < bad + (at - text); p++) line += *p == '\n';
        char where[4400];
        snprintf(where, sizeof where, "%s:%d: history record's _step is", rows, line);
        int now;
        rc = sync_counting(&sv, spool, &s, &e, &now);
        CHECK(rc != 0 && strstr(e.msg, where) && strstr(e.msg, "hint:") && now == requests,
              "a history row with %s: refused naming its line, no request sent: %s", steps[i][1], rc ? e.msg : "(synced)");
        free(bad), free(text);
    }
    write_text(rows, good_rows);
    capture_begin();
    rc = wandb_sync_dir(spool, &s, &e);
    free(capture_end());
    CHECK(rc == 0, "damaged: with the cursor and spool restored the sync completes: %s", rc ? e.msg : "ok");
    st = server_state(&sv);
    check_standard(st, "damage01", "fake-default-entity", 0, "sync after the damaged cursor was restored");
    cJSON_Delete(st);
    free(good), free(good_rows);
    server_stop(&sv);
}

/* An online run in a child whose files may not grow past limit bytes (a full disk's stand-in), its output in log.
 * finish: it ends normally; else it is killed once the live upload has sent every row (returns 0 if that never
 * came). */
static int run_with_file_limit(const WandbSettings *s, const char *cursor, const char *log, long limit, int finish) {
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        dup2(fd, 1);
        dup2(fd, 2);
        signal(SIGXFSZ, SIG_IGN);
        setrlimit(RLIMIT_FSIZE, &(struct rlimit){(rlim_t)limit, (rlim_t)limit});
        WandbRun *r = wandb_init(s);
        if (finish) {
            standard_run(r, 0);
            wandb_finish(r, 0);
            _exit(0);
        }
        standard_steps(r, 0, STEPS, 0);
        for (;;) pause(); /* killed with every row acknowledged, before finish */
    }
    long sent = -1;
    for (int i = 0; i < 2000 && !finish && sent != STEPS; i++) {
        sleep_s(0.01);
        char *text = read_file(cursor, NULL, NULL);
        cJSON *c = cJSON_Parse(text ? text : "");
        sent = cJSON_IsNumber(item(c, "history_sent")) ? (long)num(c, "history_sent") : -1;
        cJSON_Delete(c);
        free(text);
    }
    if (!finish) kill(pid, SIGKILL);
    int status;
    waitpid(pid, &status, 0);
    return finish ? WIFEXITED(status) && WEXITSTATUS(status) == 0 : sent == STEPS;
}

/* The spool's writes fail part way through an online run and the run is killed once the live upload has sent
 * every row. The spool ends at its last whole record, the cursor says it is short, and a sync says so and sends no
 * history again: no row twice, and the server's summary, newer than the spool's, stays. Before, the sync took the
 * cursor for a damaged one and stopped. A short spool of a run that ended keeps it ended when results are
 * attached (its exit code is in the cursor, not in the spool), also after a crash cut its last record short. */
static void test_spool_short(void) {
    Server sv;
    if (!server_start(&sv, NULL)) return;
    WandbSettings s = settings(&sv, "short001");
    char spool[4200], cursor[4300], rows_path[4300], log[4200];
    snprintf(spool, sizeof spool, "%s/wandb-c/short001", tmp);
    snprintf(cursor, sizeof cursor, "%s/sync_state.json", spool);
    snprintf(rows_path, sizeof rows_path, "%s/spool.jsonl", spool);
    snprintf(log, sizeof log, "%s/short001.log", tmp);
    const long limit = 4000; /* bytes: the header, run and config records and a few dozen rows */
    int all_sent = run_with_file_limit(&s, cursor, log, limit, 0);
    char *out = read_file(log, NULL, NULL), *cur = read_file(cursor, NULL, NULL);
    size_t n = 0;
    char *rows = read_file(rows_path, &n, NULL);
    cJSON *c = cJSON_Parse(cur ? cur : "");
    int kept = spool_records(spool, "history");
    CHECK(all_sent && out && strstr(out, "write failed") && strstr(out, "takes no more records"),
          "short spool: the live upload sent all %d rows and the failed write was reported: %s", STEPS,
          out ? out : "(no log)");
    CHECK(rows && n > 0 && n <= (size_t)limit && rows[n - 1] == '\n' && kept > 0 && kept < STEPS,
          "short spool: %zu bytes ending at a whole record, %d of the %d rows", n, kept, STEPS);
    CHECK(cJSON_IsTrue(item(c, "spool_short")), "short spool: the cursor says so: %s", cur ? cur : "(none)");
    cJSON *st = server_state(&sv);
    const cJSON *summary = item(find_run(st, "short001"), "summary");
    double last_loss = cJSON_IsNumber(item(summary, "train/loss")) ? num(summary, "train/loss") : -1;
    cJSON_Delete(st);
    Err e;
    capture_begin();
    int rc = wandb_sync_dir(spool, &s, &e);
    char *sync_out = capture_end();
    CHECK(rc == 0 && strstr(sync_out, "spool.jsonl is short") && strstr(sync_out, "the server keeps") &&
              strstr(sync_out, "hint:"),
          "short spool: the sync says the spool is short, not the cursor damaged: %s%s", rc ? e.msg : "", sync_out);
    st = server_state(&sv);
    const cJSON *run = find_run(st, "short001");
    check_no_violations(st, "short spool sync");
    CHECK(cJSON_GetArraySize(item(run, "rows")) == STEPS && num(run, "duplicates") == 0 &&
              fabs(last_loss - loss_at(STEPS - 1)) < 1e-12 &&
              fabs(num(item(run, "summary"), "train/loss") - last_loss) < 1e-12,
          "short spool: the server keeps its %d rows, none twice, and its newest summary (train/loss %g, then %g)",
          cJSON_GetArraySize(item(run, "rows")), last_loss, num(item(run, "summary"), "train/loss"));
    cJSON_Delete(st);
    free(sync_out);
    cJSON_Delete(c);
    free(out), free(cur), free(rows);

    /* a run that ended online with a short spool, then results attached: ended again, with its exit code */
    WandbSettings s2 = settings(&sv, "short002");
    char root[4200], spool2[4300], cursor2[4400], plot[4300];
    snprintf(root, sizeof root, "%s/short-ended", tmp);
    snprintf(spool2, sizeof spool2, "%s/wandb-c/short002", root);
    snprintf(cursor2, sizeof cursor2, "%s/sync_state.json", spool2);
    snprintf(log, sizeof log, "%s/short002.log", tmp);
    snprintf(plot, sizeof plot, "%s/short-plot.png", tmp);
    s2.dir = root;
    int ended = run_with_file_limit(&s2, cursor2, log, limit, 1);
    cur = read_file(cursor2, NULL, NULL);
    c = cJSON_Parse(cur ? cur : "");
    st = server_state(&sv);
    run = find_run(st, "short002");
    CHECK(ended && spool_records(spool2, "exit") == 0 && cJSON_IsTrue(item(run, "completed")) &&
              cJSON_IsTrue(item(c, "complete")) && cJSON_IsTrue(item(c, "spool_short")) &&
              num(c, "exit_code") == 0,
          "short spool of an ended run: no exit record in it, the run completed on the server, the cursor holds "
          "the exit code: %s", cur ? cur : "(none)");
    cJSON_Delete(st), cJSON_Delete(c), free(cur);
    CHECK(write_file_atomic(plot, "png", 3, &e) == 0, "%s", e.msg);
    /* and the spool ends in a record cut short (a crash): the appended results must not join it */
    char rows2[4400];
    snprintf(rows2, sizeof rows2, "%s/spool.jsonl", spool2);
    int fd = open(rows2, O_WRONLY | O_APPEND);
    CHECK(fd >= 0 && write(fd, "{\"t\":\"hist", 10) == 10, "a partial record appended to %s", rows2);
    if (fd >= 0) close(fd);
    const char *files[] = {plot};
    capture_begin();
    rc = wandb_attach_spool(root, "{\"probe/accuracy\":0.5}", files, 1, "mechint", &s2, &e);
    out = capture_end();
    st = server_state(&sv);
    run = find_run(st, "short002");
    CHECK(rc == 0 && cJSON_IsTrue(item(run, "completed")) && num(run, "reopened") == 1 && num(run, "exitcode") == 0 &&
              in_strings(item(run, "uploaded"), "mechint/short-plot.png") && !strstr(out, "left unfinished"),
          "short spool of an ended run: attached results reopen it, and it ends again with its exit code: %s", out);
    check_no_violations(st, "attach to a short spool");
    cJSON_Delete(st);
    free(out);
    server_stop(&sv);
}

/* A sync killed with SIGKILL while a request is in flight, then rerun. */
static void test_sync_killed(void) {
    Server sv;
    if (!server_start(&sv, NULL)) return;
    WandbSettings s = settings(&sv, "killed01");
    char spool[4200];
    free(offline_standard_run(&s, spool, sizeof spool));

    inject(&sv, "{\"match\":\"FileStream\",\"after\":2,\"action\":{\"delay_ms\":2000}}");
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        int devnull = open("/dev/null", O_WRONLY);
        dup2(devnull, 1);
        dup2(devnull, 2);
        Err e;
        _exit(wandb_sync_dir(spool, &s, &e) == 0 ? 0 : 1);
    }
    int seen = 0;
    for (int i = 0; i < 1000 && seen < 3; i++) { /* the 3rd request is the slow one */
        sleep_s(0.02);
        cJSON *st = fetch_state(&sv);
        seen = count_requests(st, "FileStream", 0);
        cJSON_Delete(st);
    }
    kill(pid, SIGKILL);
    int status;
    waitpid(pid, &status, 0);
    CHECK(seen >= 3 && WIFSIGNALED(status), "killed sync: killed while its 3rd request was in flight");
    cJSON *st = server_state(&sv);
    const cJSON *run = find_run(st, "killed01");
    CHECK(run && !cJSON_IsTrue(item(run, "completed")) && cJSON_GetArraySize(item(run, "rows")) < STEPS,
          "killed sync: the run was left incomplete");
    cJSON_Delete(st);

    Err e;
    capture_begin();
    int rc = wandb_sync_dir(spool, &s, &e);
    free(capture_end());
    CHECK(rc == 0, "killed sync: the rerun succeeds: %s", rc ? e.msg : "ok");
    wait_answered(&sv); /* the slow request of the killed sync lands too */
    st = server_state(&sv);
    check_standard(st, "killed01", "fake-default-entity", 1, "killed then resumed sync");
    cJSON_Delete(st);
    server_stop(&sv);
}

/* Results attached after the run ended (mechint's plots and numbers): online
 * they reach the completed run in a new session; offline they wait in the
 * spool for the sync; without a spool nothing happens. */
static void test_attach_results(void) {
    Server sv;
    if (!server_start(&sv, NULL)) return;
    char root[4200], plot[4200], none[4200];
    snprintf(root, sizeof root, "%s/attach", tmp);
    snprintf(none, sizeof none, "%s/attach-none", tmp);
    snprintf(plot, sizeof plot, "%s/attn_map.png", tmp);
    const char png[] = "\x89PNG\r\n\x1a\nfake plot bytes";
    Err e;
    CHECK(write_file_atomic(plot, png, sizeof png - 1, &e) == 0, "%s", e.msg);
    const char *files[] = {plot};
    const char *summary = "{\"probe/accuracy\":0.91,\"heads_pruned\":3,\"label\":\"x\"}";

    WandbSettings s = settings(&sv, "attach01");
    s.dir = root;
    capture_begin();
    WandbRun *r = wandb_init(&s);
    standard_run(r, 0);
    wandb_finish(r, 0);
    cJSON *st = server_state(&sv);
    int before = count_requests(st, "UpsertBucket", 0);
    cJSON_Delete(st);
    int rc = wandb_attach_spool(root, summary, files, 1, "mechint", &s, &e);
    char *out = capture_end();
    CHECK(rc == 0, "attach online: attached (%d): %s", rc, rc < 0 ? e.msg : "");
    CHECK(count_of(out, "\"label\" is not a number") == 1, "attach: a non-number summary value is named:\n%s", out);
    free(out);
    st = server_state(&sv);
    check_standard(st, "attach01", "fake-default-entity", 0, "attach online");
    const cJSON *run = find_run(st, "attach01"), *sum = item(run, "summary");
    const cJSON *file = item(item(run, "files"), "mechint/attn_map.png");
    CHECK(num(sum, "probe/accuracy") == 0.91 && num(sum, "heads_pruned") == 3 && !item(sum, "label") &&
              fabs(num(sum, "train/loss") - loss_at(STEPS - 1)) < 1e-12,
          "attach online: the summary gains the results and keeps the run's values");
    CHECK(in_strings(item(run, "uploaded"), "mechint/attn_map.png") && num(file, "size") == sizeof png - 1,
          "attach online: the plot is PUT as mechint/attn_map.png and reported as uploaded");
    CHECK(count_requests(st, "UpsertBucket", 0) == before + 1 && num(run, "reopened") == 1 &&
              cJSON_IsTrue(item(run, "completed")) && num(run, "exitcode") == 0,
          "attach online: one new session of the same run, completed again with its exit code");
    cJSON_Delete(st);

    /* offline: the results go into the spool; the sync uploads run and results together */
    WandbSettings o = settings(&sv, "attach02");
    snprintf(root, sizeof root, "%s/attach-offline", tmp);
    o.dir = root;
    o.mode = "offline";
    capture_begin();
    r = wandb_init(&o);
    standard_run(r, 0);
    char spool[4200];
    snprintf(spool, sizeof spool, "%s", wandb_spool_dir(r));
    wandb_finish(r, 0);
    rc = wandb_attach_spool(root, summary, files, 1, "mechint", &o, &e);
    int requests = -1;
    st = server_state(&sv);
    run = find_run(st, "attach02");
    requests = run ? -1 : count_requests(st, "UpsertBucket", 0);
    cJSON_Delete(st);
    int synced = wandb_sync_dir(spool, &o, &e);
    out = capture_end();
    CHECK(rc == 0 && requests == before + 1 && strstr(out, "make wandb-sync"),
          "attach offline: into the spool, no traffic, says how to upload:\n%s", out);
    free(out);
    st = server_state(&sv);
    check_standard(st, "attach02", "fake-default-entity", 0, "attach offline then sync");
    run = find_run(st, "attach02");
    CHECK(synced == 0 && num(item(run, "summary"), "probe/accuracy") == 0.91 &&
              in_strings(item(run, "uploaded"), "mechint/attn_map.png") && num(run, "reopened") == 0,
          "attach offline: one sync uploads the run with its results");
    cJSON_Delete(st);

    CHECK(wandb_attach_spool(none, summary, files, 1, "mechint", &s, &e) == 1,
          "attach: no spool (tracking was off) -> 1, nothing done");
    s.mode = "disabled";
    snprintf(root, sizeof root, "%s/attach", tmp);
    CHECK(wandb_attach_spool(root, summary, files, 1, "mechint", &s, &e) == 1, "attach: mode disabled -> 1");
    CHECK(wandb_attach_spool(root, "[1,2]", NULL, 0, "mechint", &o, &e) == -1 && strstr(e.msg, "not a JSON object"),
          "attach: a summary that is not an object is an error: %s", e.msg);
    server_stop(&sv);
}

static void test_disabled(void) {
    Server sv;
    if (!server_start(&sv, NULL)) return;
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/disabled", tmp);
    WandbSettings s = settings(&sv, "disabled");
    s.dir = dir;
    s.mode = "disabled";
    WandbRun *a = wandb_init(&s);
    s.mode = "online";
    setenv("WANDB_MODE", "disabled", 1); /* the environment overrides the setting */
    WandbRun *b = wandb_init(&s);
    unsetenv("WANDB_MODE");
    CHECK(a == NULL && b == NULL, "disabled: wandb_init returns NULL");
    wandb_log(a, 0, "train/loss", 1.0);
    wandb_commit(a, 0);
    wandb_summary_set(a, "x", 1.0);
    CHECK(wandb_upload_file(a, metrics_path, "m.json") == 0 && !wandb_should_stop(a) && !wandb_run_url(a) &&
              !wandb_spool_dir(a),
          "disabled: every call accepts NULL");
    wandb_finish(a, 0);
    cJSON *st = server_state(&sv);
    CHECK(cJSON_GetArraySize(item(st, "requests")) == 0 && !file_exists(dir), "disabled: no traffic, no files");
    cJSON_Delete(st);
    server_stop(&sv);
}

/* ---------------------------------------------------------------- main */

static int key_files;

static int scan_for_key(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st, (void)ftw;
    if (flag != FTW_F || strstr(path, "/netrc")) return 0; /* the netrc file holds the key by design */
    char *text = read_file(path, NULL, NULL);
    if (text && strstr(text, KEY)) {
        printf("  the key is in %s\n", path);
        key_files++;
    }
    free(text);
    return 0;
}

static int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st, (void)flag, (void)ftw;
    return remove(path);
}

/* Runs one scenario and prints how long it took (the whole program should stay well under a minute). */
#define TIMED(call)                                                        \
    do {                                                                   \
        double t_ = wall_seconds();                                        \
        call;                                                              \
        printf("  %-40s %5.2f s\n", #call, wall_seconds() - t_);           \
        fflush(stdout);                                                    \
    } while (0)

int main(void) {
    /* the developer's own W&B settings must not leak into the tests */
    const char *vars[] = {"WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_ENTITY", "WANDB_PROJECT", "WANDB_MODE",
                          "WANDB_RUN_ID", "WANDB_NAME", "WANDB_NOTES", "WANDB_RUN_GROUP", "WANDB_JOB_TYPE",
                          "WANDB_TAGS", "WANDB_DIR", "WANDB_HTTP_TIMEOUT", "WANDB_INIT_TIMEOUT",
                          "WANDB_CONNECT_GRACE", "NETRC"};
    for (size_t i = 0; i < sizeof vars / sizeof *vars; i++) unsetenv(vars[i]);
    if (!mkdtemp(tmp)) FATAL("mkdtemp failed");
    setenv("HOME", tmp, 1); /* no ~/.netrc of the developer either */
    signal(SIGPIPE, SIG_IGN);
    curl_global_init(CURL_GLOBAL_DEFAULT);
    snprintf(metrics_path, sizeof metrics_path, "%s/metrics.json", tmp);
    Err e;
    if (write_file_atomic(metrics_path, METRICS_TEXT, strlen(METRICS_TEXT), &e) != 0) FATAL("%s", e.msg);

    double t0 = wall_seconds();
    TIMED(test_happy_path());
    TIMED(test_entity_resolution());
    TIMED(test_netrc());
    TIMED(test_transient());
    TIMED(test_upsert_400());
    TIMED(test_filestream_permanent(404));
    TIMED(test_filestream_permanent(413));
    TIMED(test_wrong_key());
    TIMED(test_drops_and_delays());
    TIMED(test_heartbeat());
    TIMED(test_burst());
    TIMED(test_stop());
    TIMED(test_file_upload_error());
    TIMED(test_nan_inf());
    TIMED(test_finish_bounded());
    TIMED(test_down_then_sync());
    TIMED(test_init_last_attempt());
    TIMED(test_server_appears_later());
    TIMED(test_sync_resumes_after_failure());
    TIMED(test_sync_killed());
    TIMED(test_sync_damaged());
    TIMED(test_spool_short());
    TIMED(test_attach_results());
    TIMED(test_disabled());

    nftw(tmp, scan_for_key, 16, FTW_PHYS);
    CHECK(key_files == 0, "the API key is in no spool, state or capture file (%d files)", key_files);
    printf("# wandb scenarios took %.1f s\n", wall_seconds() - t0);
    nftw(tmp, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
    curl_global_cleanup();
    return TEST_SUMMARY("wandb");
}
