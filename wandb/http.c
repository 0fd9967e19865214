/* HTTP for the W&B client: the Uplink (one libcurl handle and everything
 * needed to talk to the server about one run), requests sent again with the
 * same bytes under the SDK's retry rules, exponential backoff with jitter,
 * the server's Retry-After and RateLimit headers, the deadlines that bound
 * wandb_init and wandb_finish, the grace after which refused connections
 * (nothing listening) end a bounded wait, and the API key. */
#define _GNU_SOURCE
#include "internal.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#define USER_AGENT "kvlab-wandb/1"
#define REQUEST_BYTES (10L << 20)      /* history bytes per FileStream request */
#define GRAPHQL_ATTEMPTS 20
#define FILESTREAM_ATTEMPTS 10085      /* the SDK's: about 7 days at the longest wait */
#define FINAL_ATTEMPT_S 5.0            /* a bounded wait's last attempt starts this long before its end (see attempt_wait) */

static pthread_once_t curl_once = PTHREAD_ONCE_INIT;
static void curl_init_once(void) { curl_global_init(CURL_GLOBAL_DEFAULT); }

void wb_uplink_setup(Uplink *u, const WandbSettings *s) {
    memset(u, 0, sizeof *u);
    pthread_once(&curl_once, curl_init_once);
    u->curl = curl_easy_init();
    if (!u->curl) FATAL("curl_easy_init failed");
    u->json_headers = curl_slist_append(NULL, "Content-Type: application/json");
    u->json_headers = curl_slist_append(u->json_headers, "Expect:"); /* no 100-continue round trip */
    u->base = xstrdup(wb_first(s->base_url, wb_first(wb_env("WANDB_BASE_URL"), WB_DEFAULT_BASE)));
    for (size_t n = strlen(u->base); n > 0 && u->base[n - 1] == '/'; n--) u->base[n - 1] = 0;
    u->http_timeout = wb_setting(s->http_timeout_s, "WANDB_HTTP_TIMEOUT", 30);
    u->fs_timeout = wb_setting(s->filestream_timeout_s, NULL, 180);
    u->retry_min = wb_setting(s->retry_min_s, NULL, 2);
    u->retry_max = wb_setting(s->retry_max_s, NULL, 60);
    /* at most one FileStream request per second (W&B rate limits), or faster when tests flush faster */
    u->min_gap = fmin(1.0, wb_setting(s->flush_interval_s, NULL, 10));
    u->request_bytes = s->request_bytes > 0 ? s->request_bytes : REQUEST_BYTES;
    u->rng = ((uint64_t)(unix_seconds() * 1e9) ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)u) | 1;
    u->deadline = u->refused_grace = INFINITY;
    u->uploaded = cJSON_CreateArray();
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC); /* wall_seconds() is monotonic */
    pthread_cond_init(&u->cv, &ca);
    pthread_condattr_destroy(&ca);
    pthread_mutex_init(&u->mu, NULL);
}

void wb_uplink_free(Uplink *u) {
    curl_easy_cleanup(u->curl);
    curl_slist_free_all(u->json_headers);
    free(u->base);
    free(u->key);
    free(u->entity);
    free(u->project);
    free(u->run_id);
    free(u->url);
    free(u->fs_url);
    free(u->state_path);
    cJSON_Delete(u->uploaded);
    pthread_cond_destroy(&u->cv);
    pthread_mutex_destroy(&u->mu);
}

static double deadline_of(Uplink *u) {
    pthread_mutex_lock(&u->mu);
    double d = u->deadline;
    pthread_mutex_unlock(&u->mu);
    return d;
}

static double refused_grace_of(Uplink *u) {
    pthread_mutex_lock(&u->mu);
    double g = u->refused_grace;
    pthread_mutex_unlock(&u->mu);
    return g;
}

/* Bounds the waits from now on (mu held): give up at deadline d, and after
 * `grace` seconds of refused connections. Wakes a waiting worker. */
void wb_set_bounds_locked(Uplink *u, double d, double grace) {
    u->deadline = d;
    u->bound_start = wall_seconds();
    u->refused_grace = grace;
    pthread_cond_broadcast(&u->cv);
}

void wb_set_bounds(Uplink *u, double d, double grace) {
    pthread_mutex_lock(&u->mu);
    wb_set_bounds_locked(u, d, grace);
    pthread_mutex_unlock(&u->mu);
}

/* Waits on the condition until monotonic time t (mu held); t may be INFINITY. */
void wb_wait_until(Uplink *u, double t) {
    if (!(t < 1e15)) {
        pthread_cond_wait(&u->cv, &u->mu);
        return;
    }
    struct timespec ts;
    ts.tv_sec = (time_t)t;
    ts.tv_nsec = (long)((t - (double)ts.tv_sec) * 1e9);
    if (ts.tv_nsec > 999999999) ts.tv_nsec = 999999999;
    pthread_cond_timedwait(&u->cv, &u->mu, &ts);
}

/* Sleeps until the next attempt of a request may start: at `planned` (our
 * backoff), never before `firm` (Retry-After, RateLimit-Reset, FileStream
 * pacing: the server's rules). A bounded wait ends with an attempt at its
 * end instead of giving up early: an attempt planned after the last moment
 * that still leaves time for an answer before the deadline (FINAL_ATTEMPT_S,
 * at most a quarter of the bound and the attempt's timeout) is made at that
 * moment, and one planned after the end of the refusal grace (refused_since
 * + refused_grace) at that end. *final says whether this attempt is the one
 * at the deadline's end; after it, -1. Also -1 once the deadline passes or
 * a firm wait reaches past it. The bounds are read again after every wake-up
 * (wandb_finish sets them while the worker sleeps here). */
static int attempt_wait(Uplink *u, double planned, double firm, double per_attempt, double refused_since, int *final) {
    int rc = 0;
    pthread_mutex_lock(&u->mu);
    for (;;) {
        double now = wall_seconds(), t = planned;
        double last = u->deadline - fmin(per_attempt, fmin(FINAL_ATTEMPT_S, 0.25 * (u->deadline - u->bound_start)));
        if (t > refused_since + u->refused_grace) t = refused_since + u->refused_grace;
        if (t > last) {
            if (*final) {
                rc = -1;
                break;
            }
            t = last;
        }
        t = fmax(t, firm);
        if (now >= u->deadline || t >= u->deadline) {
            rc = -1;
            break;
        }
        if (now >= t) {
            *final = now >= last;
            break;
        }
        wb_wait_until(u, t);
    }
    pthread_mutex_unlock(&u->mu);
    return rc;
}

static size_t on_body(char *p, size_t size, size_t n, void *ud) {
    wb_buf_add(ud, p, size * n);
    return size * n;
}

/* A header's number (seconds, or requests left), clamped to [0, 86400]; Retry-After may also be
 * an HTTP date. -1 when unreadable. */
static double header_number(const char *v) {
    char *end;
    struct tm tm = {0};
    double s = strtod(v, &end);
    if (end == v || isnan(s)) {
        if (!strptime(v, "%a, %d %b %Y %H:%M:%S", &tm)) return -1;
        s = (double)timegm(&tm) - unix_seconds();
    }
    return fmax(0, fmin(s, 86400));
}

static size_t on_header(char *p, size_t size, size_t n, void *ud) {
    WbResp *r = ud;
    size_t len = size * n;
    char line[256];
    if (len >= sizeof line) return len;
    memcpy(line, p, len);
    line[len] = 0;
    char *v = strchr(line, ':');
    if (!v) return len;
    *v++ = 0;
    v += strspn(v, " \t");
    v[strcspn(v, "\r\n")] = 0;
    if (!strcasecmp(line, "Retry-After"))
        r->retry_after = header_number(v);
    else if (!strcasecmp(line, "RateLimit-Remaining"))
        r->rl_remaining = header_number(v);
    else if (!strcasecmp(line, "RateLimit-Reset"))
        r->rl_reset = header_number(v);
    return len;
}

/* Aborts a transfer once the deadline passes, so finish() stays bounded. */
static int on_progress(void *ud, curl_off_t a, curl_off_t b, curl_off_t c, curl_off_t d) {
    (void)a, (void)b, (void)c, (void)d;
    return wall_seconds() >= deadline_of(ud);
}

/* One exchange, no retries. The API key goes only with auth=1, which callers
 * pass only for URLs built from the base URL (GraphQL, FileStream); storage
 * PUTs go to signed URLs without it. Redirects are never followed. */
static void http_once(Uplink *u, const char *url, int auth, struct curl_slist *headers, const char *body,
                      size_t len, FILE *upload, curl_off_t upload_size, double timeout, WbResp *r) {
    CURL *c = u->curl;
    free(r->body.p);
    memset(r, 0, sizeof *r);
    r->retry_after = r->rl_remaining = -1;
    curl_easy_reset(c); /* keeps the connection cache */
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_USERAGENT, USER_AGENT " libcurl/" LIBCURL_VERSION);
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, headers);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &r->body);
    curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(c, CURLOPT_HEADERDATA, r);
    curl_easy_setopt(c, CURLOPT_XFERINFOFUNCTION, on_progress);
    curl_easy_setopt(c, CURLOPT_XFERINFODATA, u);
    curl_easy_setopt(c, CURLOPT_NOPROGRESS, 0L);
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, (long)(fmin(timeout > 0 ? timeout : 30, 30) * 1000) + 1);
    if (timeout > 0) {
        curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, (long)(timeout * 1000) + 1);
    } else { /* storage PUTs have no time limit, but a stalled one must not hold the worker forever */
        curl_easy_setopt(c, CURLOPT_LOW_SPEED_LIMIT, 1L);
        curl_easy_setopt(c, CURLOPT_LOW_SPEED_TIME, 60L);
    }
    if (auth) {
        curl_easy_setopt(c, CURLOPT_HTTPAUTH, (long)CURLAUTH_BASIC);
        curl_easy_setopt(c, CURLOPT_USERNAME, "api");
        curl_easy_setopt(c, CURLOPT_PASSWORD, u->key);
    }
    if (upload) {
        curl_easy_setopt(c, CURLOPT_UPLOAD, 1L); /* PUT with Content-Length, never chunked */
        curl_easy_setopt(c, CURLOPT_READDATA, upload);
        curl_easy_setopt(c, CURLOPT_INFILESIZE_LARGE, upload_size);
    } else {
        curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
        curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)len);
    }
    r->cc = curl_easy_perform(c);
    if (r->cc == CURLE_OK) curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &r->status);
}

/* Which failures deserve another attempt (the SDK's rules). */
static int retryable(WbKind kind, const WbResp *r) {
    if (r->status == 0) {
        switch (r->cc) {
        case CURLE_UNSUPPORTED_PROTOCOL:
        case CURLE_URL_MALFORMAT:
        case CURLE_TOO_MANY_REDIRECTS:
        case CURLE_PEER_FAILED_VERIFICATION:
        case CURLE_SSL_CACERT_BADFILE:
        case CURLE_SSL_CERTPROBLEM:
        case CURLE_READ_ERROR:
            return 0;
        default:
            return 1;
        }
    }
    if (kind == WB_STORAGE) return r->status == 429 || (r->status >= 500 && r->status != 501);
    switch (r->status) {
    case 409:
        return kind == WB_UPSERT;
    case 400: case 401: case 403: case 404: case 410: case 413: case 422: case 501:
        return 0;
    default:
        return r->status >= 400;
    }
}

/* The error text of a JSON answer: "error" (string or {"message"}), else every errors[].message. */
void wb_server_message(const cJSON *j, WbBuf *m) {
    const cJSON *err = cJSON_GetObjectItem(j, "error"), *msg = cJSON_GetObjectItem(err, "message"), *it;
    if (cJSON_IsString(err)) {
        wb_buf_puts(m, err->valuestring);
        return;
    }
    if (cJSON_IsString(msg)) {
        wb_buf_puts(m, msg->valuestring);
        return;
    }
    cJSON_ArrayForEach(it, cJSON_GetObjectItem(j, "errors")) {
        msg = cJSON_GetObjectItem(it, "message");
        if (!cJSON_IsString(msg)) continue;
        if (m->n) wb_buf_puts(m, "; ");
        wb_buf_puts(m, msg->valuestring);
    }
}

static const char *netloc(const char *base, char out[256]) {
    const char *s = strstr(base, "://");
    s = s ? s + 3 : base;
    snprintf(out, 256, "%.*s", (int)strcspn(s, "/"), s);
    return out;
}

static void describe(const Uplink *u, WbKind kind, const WbResp *r, Err *e) {
    char host[256];
    if (r->status == 0) {
        err_set(e, "no answer from %s: %s", kind == WB_STORAGE ? "the storage server" : u->base, curl_easy_strerror(r->cc));
    } else if (r->status == 401 && kind != WB_STORAGE) {
        err_set(e, "invalid API key for %s (hint: check WANDB_API_KEY, or the password of 'machine %s' in ~/.netrc)",
                u->base, netloc(u->base, host));
    } else {
        WbBuf m = {0};
        cJSON *j = cJSON_Parse(r->body.p ? r->body.p : "");
        wb_server_message(j, &m);
        cJSON_Delete(j);
        err_set(e, "HTTP %ld%s%s", r->status, m.n ? ": " : "", m.n ? m.p : "");
        free(m.p);
    }
}

/* Sends until a 2xx answer, a failure not worth retrying, the attempt limit,
 * the deadline or, while connections are refused (nothing listening), the
 * refusal grace. Every attempt sends the same bytes; waits follow
 * exponential backoff with jitter unless the server said Retry-After, and a
 * bounded wait ends with a last attempt at its end (attempt_wait).
 * FileStream requests also keep min_gap apart. Returns 0 on 2xx (answer in
 * r), else -1 and e; u->refused tells whether the last failure was a
 * refused connection. */
int wb_request(Uplink *u, WbKind kind, const char *url, struct curl_slist *headers, const char *body, size_t len,
               FILE *upload, curl_off_t upload_size, WbResp *r, Err *e) {
    int attempts = kind == WB_FILESTREAM ? FILESTREAM_ATTEMPTS : GRAPHQL_ATTEMPTS, final = 0;
    double per_attempt = kind == WB_FILESTREAM ? u->fs_timeout : kind == WB_STORAGE ? INFINITY : u->http_timeout;
    double planned = 0, refused_since = INFINITY;
    Err last = {""};
    u->refused = 0;
    for (int a = 0; a < attempts; a++) {
        double firm = fmax(u->not_before, kind == WB_FILESTREAM ? u->last_fs + u->min_gap : 0);
        if (attempt_wait(u, planned, firm, per_attempt, refused_since, &final) != 0) break;
        double start = wall_seconds(), timeout = fmin(per_attempt, deadline_of(u) - start);
        if (upload) rewind(upload);
        if (kind == WB_FILESTREAM) u->last_fs = start;
        http_once(u, url, kind != WB_STORAGE, headers, body, len, upload, upload_size,
                  isfinite(timeout) ? timeout : 0, r);
        if (r->rl_remaining >= 0 && r->rl_remaining < 1 && r->rl_reset > 0)
            u->not_before = wall_seconds() + r->rl_reset;
        if (r->status >= 200 && r->status < 300) return 0;
        if (r->cc == CURLE_ABORTED_BY_CALLBACK) break; /* the deadline passed mid-transfer */
        u->refused = r->status == 0 && r->cc == CURLE_COULDNT_CONNECT;
        refused_since = u->refused ? fmin(refused_since, start) : INFINITY;
        describe(u, kind, r, &last);
        if (!retryable(kind, r)) {
            *e = last;
            return -1;
        }
        if (a + 1 == attempts) return err_set(e, "%s (gave up after %d attempts)", last.msg, attempts);
        double now = wall_seconds();
        if (u->refused && now - refused_since >= refused_grace_of(u))
            return err_set(e, "%s (connections refused for %.1f s)", last.msg, now - refused_since);
        double wait = fmin(u->retry_max, u->retry_min * ldexp(1.0, a < 30 ? a : 30) *
                                             (1.0 + 0.25 * (double)(wb_rng_next(&u->rng) >> 11) / 9007199254740992.0));
        if (r->retry_after >= 0) /* the server's wait is firm: never shortened to fit a deadline */
            u->not_before = fmax(u->not_before, now + r->retry_after);
        else
            planned = now + wait;
    }
    return err_set(e, "stopped at the time limit%s%s", last.msg[0] ? " after: " : "", last.msg);
}

/* ---------------------------------------------------------------- the API key */

/* netrc: the password of "machine <host[:port]>" ($NETRC, else ~/.netrc, else ~/_netrc). */
static char *netrc_key(const char *host) {
    const char *home = wb_first(wb_env("HOME"), "/");
    char *paths[3] = {wb_env("NETRC") ? xstrdup(wb_env("NETRC")) : NULL, wb_join(home, ".netrc"),
                      wb_join(home, "_netrc")};
    char *key = NULL;
    for (int i = 0; i < 3 && !key; i++) {
        char *text = paths[i] && (i == 0 || !paths[0]) ? read_file(paths[i], NULL, NULL) : NULL;
        if (!text) continue;
        int match = 0;
        char *save, *prev = NULL;
        for (char *tok = strtok_r(text, " \t\r\n", &save); tok && !key; prev = tok, tok = strtok_r(NULL, " \t\r\n", &save)) {
            if (prev && !strcmp(prev, "machine")) match = !strcmp(tok, host);
            else if (!strcmp(tok, "default")) match = 0;
            else if (prev && !strcmp(prev, "password") && match) key = xstrdup(tok);
        }
        free(text);
    }
    for (int i = 0; i < 3; i++) free(paths[i]);
    return key;
}

/* Explicit key, else $WANDB_API_KEY, else netrc. Keys are never length-checked (formats vary). */
char *wb_find_key(const WandbSettings *s, const char *base, Err *e) {
    char host[256];
    const char *k = wb_first(s->api_key, wb_env("WANDB_API_KEY"));
    char *key = k ? xstrdup(k) : netrc_key(netloc(base, host));
    if (!key) {
        err_set(e, "no API key for %s (hint: set WANDB_API_KEY, or add 'machine %s password <key>' to ~/.netrc)", base,
                netloc(base, host));
    } else if (strchr(" \t\r\n", key[0]) || strchr(" \t\r\n", key[strlen(key) - 1])) {
        err_set(e, "the API key for %s has leading or trailing whitespace (hint: copy it again from wandb.ai/authorize)",
                base);
        free(key);
        key = NULL;
    }
    return key;
}
