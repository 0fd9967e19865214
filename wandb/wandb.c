/* Weights & Biases client: UpsertBucket over GraphQL creates the run, the
 * FileStream endpoint receives history rows, the summary, "uploaded" notices
 * and completion, CreateRunFiles + signed PUTs upload files (docs/wandb.md).
 *
 * Layout: the training thread appends every record to the spool
 * (<dir>/wandb-c/<run_id>/spool.jsonl) and, when online, queues history
 * lines for one worker thread that owns the libcurl handle. The worker
 * batches the queue into FileStream requests, retries each request with the
 * same body, sends heartbeats, and writes the acknowledged offsets to
 * sync_state.json after every success; wandb_sync_dir replays a spool from
 * that cursor with the same request code. */
#define _GNU_SOURCE
#include "wandb.h"

#include <cjson/cJSON.h>
#include <curl/curl.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define DEFAULT_BASE "https://api.wandb.ai"
#define USER_AGENT "kvlab-wandb/1"
#define MAX_LINE 10383360L             /* longest history line W&B stores (10 MiB - 100 KiB) */
#define REQUEST_BYTES (10L << 20)      /* history bytes per FileStream request */
#define QUEUE_BYTES ((size_t)256 << 20) /* unsent rows kept in memory before the upload gives up */
#define GRAPHQL_ATTEMPTS 20
#define FILESTREAM_ATTEMPTS 10085      /* the SDK's: about 7 days at the longest wait */
#define FINAL_ATTEMPT_S 5.0            /* a bounded wait's last attempt starts this long before its end (see attempt_wait) */
#define CONNECT_GRACE_S 5.0            /* default of WANDB_CONNECT_GRACE: how long refused connections are retried in a bounded wait */
#define HIST_PREFIX "{\"t\":\"history\",\"row\":"
#define SUMMARY_PREFIX "{\"t\":\"summary\",\"summary\":"
#define SYNC_HINT "continuing offline, sync later with make wandb-sync"

/* One "wandb: ..." line on stderr, written at once so that lines of the two threads never mix. */
static void say(const char *fmt, ...) KV_PRINTF(1, 2);
static void say(const char *fmt, ...) {
    char line[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    fprintf(stderr, "wandb: %s\n", line);
}

static const char *env(const char *name) {
    const char *v = getenv(name);
    return v && *v ? v : NULL;
}

static const char *first(const char *a, const char *b) { return a && *a ? a : (b && *b ? b : NULL); }

static char *xstrndup(const char *s, size_t n) {
    char *p = xmalloc(n + 1);
    memcpy(p, s, n);
    p[n] = 0;
    return p;
}

static char *join(const char *a, const char *b) {
    size_t n = strlen(a) + strlen(b) + 2;
    char *p = xmalloc(n);
    snprintf(p, n, "%s/%s", a, b);
    return p;
}

/* ---------------------------------------------------------------- text */

typedef struct {
    char *p;
    size_t n, cap;
} Buf;

static void buf_add(Buf *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        b->cap = 2 * (b->n + n + 1);
        b->p = xrealloc(b->p, b->cap);
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

static void buf_puts(Buf *b, const char *s) { buf_add(b, s, strlen(s)); }

static void buf_printf(Buf *b, const char *fmt, ...) KV_PRINTF(2, 3);
static void buf_printf(Buf *b, const char *fmt, ...) {
    char tmp[256];
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (k < 0 || k >= (int)sizeof tmp) FATAL("buf_printf: '%s' is too long", fmt);
    buf_add(b, tmp, (size_t)k);
}

/* A JSON string literal, quotes included. */
static void buf_json_str(Buf *b, const char *s) {
    buf_add(b, "\"", 1);
    for (;;) {
        size_t run = strcspn(s, "\"\\\b\f\n\r\t\001\002\003\004\005\006\007\013\016\017\020\021\022\023\024\025"
                                "\026\027\030\031\032\033\034\035\036\037");
        buf_add(b, s, run);
        s += run;
        if (!*s) break;
        char esc[8];
        switch (*s) {
        case '"': strcpy(esc, "\\\""); break;
        case '\\': strcpy(esc, "\\\\"); break;
        case '\b': strcpy(esc, "\\b"); break;
        case '\f': strcpy(esc, "\\f"); break;
        case '\n': strcpy(esc, "\\n"); break;
        case '\r': strcpy(esc, "\\r"); break;
        case '\t': strcpy(esc, "\\t"); break;
        default: snprintf(esc, sizeof esc, "\\u%04x", (unsigned)(unsigned char)*s);
        }
        buf_puts(b, esc);
        s++;
    }
    buf_add(b, "\"", 1);
}

/* Shortest text that reads back as v; integral values print without a point
 * (so _step stays an integer); non-finite values as W&B's bare tokens. */
static void buf_num(Buf *b, double v) {
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
    buf_puts(b, s);
}

/* ---------------------------------------------------------------- key/value rows */

/* A history row or the summary: keys are kept as JSON string literals
 * (quotes included), so rows are written and compared without re-escaping. */
typedef struct {
    char *key;
    double v;
} Item;
typedef struct {
    Item *it;
    int n, cap;
} KV;

static void kv_set(KV *kv, const char *key, size_t klen, double v) {
    for (int i = 0; i < kv->n; i++)
        if (strlen(kv->it[i].key) == klen && !memcmp(kv->it[i].key, key, klen)) {
            kv->it[i].v = v;
            return;
        }
    if (kv->n == kv->cap) {
        kv->cap = kv->cap ? 2 * kv->cap : 16;
        kv->it = xrealloc(kv->it, (size_t)kv->cap * sizeof *kv->it);
    }
    kv->it[kv->n++] = (Item){xstrndup(key, klen), v};
}

static void kv_clear(KV *kv) {
    for (int i = 0; i < kv->n; i++) free(kv->it[i].key);
    kv->n = 0;
}

static void kv_free(KV *kv) {
    kv_clear(kv);
    free(kv->it);
}

static double kv_get(const KV *kv, const char *key, double missing) {
    for (int i = 0; i < kv->n; i++)
        if (!strcmp(kv->it[i].key, key)) return kv->it[i].v;
    return missing;
}

static void kv_json(Buf *b, const KV *kv) {
    buf_puts(b, "{");
    for (int i = 0; i < kv->n; i++) {
        if (i) buf_puts(b, ",");
        buf_puts(b, kv->it[i].key);
        buf_puts(b, ":");
        buf_num(b, kv->it[i].v);
    }
    buf_puts(b, "}");
}

/* The summary line: last values plus "_wandb": {"runtime": whole seconds}. */
static void summary_json(Buf *b, const KV *kv) {
    kv_json(b, kv);
    b->p[--b->n] = 0; /* reopen the object */
    buf_printf(b, "%s\"_wandb\":{\"runtime\":%ld}}", kv->n ? "," : "", (long)kv_get(kv, "\"_runtime\"", 0));
}

/* The spool record of a summary, newline included. */
static void summary_record(Buf *b, const KV *kv) {
    buf_puts(b, SUMMARY_PREFIX);
    summary_json(b, kv);
    buf_puts(b, "}\n");
}

/* Reads a flat object written by kv_json/summary_json back (NaN and Infinity
 * through strtod); nested objects (_wandb) are skipped. */
static int kv_parse(KV *kv, const char *s) {
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
            kv_set(kv, key, klen, v);
            s = end;
        }
        if (*s == '}') return 0;
        if (*s++ != ',') return -1;
    }
}

/* ---------------------------------------------------------------- HTTP */

typedef enum { GRAPHQL, UPSERT, FILESTREAM, STORAGE } Kind;

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
} Uplink;

typedef struct {
    long status; /* 0: no HTTP answer (connection error, timeout, reset) */
    CURLcode cc;
    Buf body;
    double retry_after;            /* seconds, < 0: no header */
    double rl_remaining, rl_reset; /* RateLimit-* headers, rl_remaining < 0: none */
} Resp;

static pthread_once_t curl_once = PTHREAD_ONCE_INIT;
static void curl_init_once(void) { curl_global_init(CURL_GLOBAL_DEFAULT); }

static uint64_t rng_next(uint64_t *s) { /* xorshift64 */
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static double setting(double v, const char *var, double dflt) {
    if (v > 0) return v;
    const char *x = var ? env(var) : NULL;
    if (x) {
        char *end;
        double d = strtod(x, &end);
        if (end != x && !*end && d > 0) return d;
        say("%s=%s is not a number of seconds; using %g", var, x, dflt);
    }
    return dflt;
}

static void uplink_setup(Uplink *u, const WandbSettings *s) {
    memset(u, 0, sizeof *u);
    pthread_once(&curl_once, curl_init_once);
    u->curl = curl_easy_init();
    if (!u->curl) FATAL("curl_easy_init failed");
    u->json_headers = curl_slist_append(NULL, "Content-Type: application/json");
    u->json_headers = curl_slist_append(u->json_headers, "Expect:"); /* no 100-continue round trip */
    u->base = xstrdup(first(s->base_url, first(env("WANDB_BASE_URL"), DEFAULT_BASE)));
    for (size_t n = strlen(u->base); n > 0 && u->base[n - 1] == '/'; n--) u->base[n - 1] = 0;
    u->http_timeout = setting(s->http_timeout_s, "WANDB_HTTP_TIMEOUT", 30);
    u->fs_timeout = setting(s->filestream_timeout_s, NULL, 180);
    u->retry_min = setting(s->retry_min_s, NULL, 2);
    u->retry_max = setting(s->retry_max_s, NULL, 60);
    /* at most one FileStream request per second (W&B rate limits), or faster when tests flush faster */
    u->min_gap = fmin(1.0, setting(s->flush_interval_s, NULL, 10));
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

static void uplink_free(Uplink *u) {
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
static void set_bounds_locked(Uplink *u, double d, double grace) {
    u->deadline = d;
    u->bound_start = wall_seconds();
    u->refused_grace = grace;
    pthread_cond_broadcast(&u->cv);
}

static void set_bounds(Uplink *u, double d, double grace) {
    pthread_mutex_lock(&u->mu);
    set_bounds_locked(u, d, grace);
    pthread_mutex_unlock(&u->mu);
}

/* Waits on the condition until monotonic time t (mu held); t may be INFINITY. */
static void wait_until(Uplink *u, double t) {
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
        wait_until(u, t);
    }
    pthread_mutex_unlock(&u->mu);
    return rc;
}

static size_t on_body(char *p, size_t size, size_t n, void *ud) {
    buf_add(ud, p, size * n);
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
    Resp *r = ud;
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
                      size_t len, FILE *upload, curl_off_t upload_size, double timeout, Resp *r) {
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
static int retryable(Kind kind, const Resp *r) {
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
    if (kind == STORAGE) return r->status == 429 || (r->status >= 500 && r->status != 501);
    switch (r->status) {
    case 409:
        return kind == UPSERT;
    case 400: case 401: case 403: case 404: case 410: case 413: case 422: case 501:
        return 0;
    default:
        return r->status >= 400;
    }
}

/* The error text of a JSON answer: "error" (string or {"message"}), else every errors[].message. */
static void server_message(const cJSON *j, Buf *m) {
    const cJSON *err = cJSON_GetObjectItem(j, "error"), *msg = cJSON_GetObjectItem(err, "message"), *it;
    if (cJSON_IsString(err)) {
        buf_puts(m, err->valuestring);
        return;
    }
    if (cJSON_IsString(msg)) {
        buf_puts(m, msg->valuestring);
        return;
    }
    cJSON_ArrayForEach(it, cJSON_GetObjectItem(j, "errors")) {
        msg = cJSON_GetObjectItem(it, "message");
        if (!cJSON_IsString(msg)) continue;
        if (m->n) buf_puts(m, "; ");
        buf_puts(m, msg->valuestring);
    }
}

static const char *netloc(const char *base, char out[256]) {
    const char *s = strstr(base, "://");
    s = s ? s + 3 : base;
    snprintf(out, 256, "%.*s", (int)strcspn(s, "/"), s);
    return out;
}

static void describe(const Uplink *u, Kind kind, const Resp *r, Err *e) {
    char host[256];
    if (r->status == 0) {
        err_set(e, "no answer from %s: %s", kind == STORAGE ? "the storage server" : u->base, curl_easy_strerror(r->cc));
    } else if (r->status == 401 && kind != STORAGE) {
        err_set(e, "invalid API key for %s (hint: check WANDB_API_KEY, or the password of 'machine %s' in ~/.netrc)",
                u->base, netloc(u->base, host));
    } else {
        Buf m = {0};
        cJSON *j = cJSON_Parse(r->body.p ? r->body.p : "");
        server_message(j, &m);
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
static int request(Uplink *u, Kind kind, const char *url, struct curl_slist *headers, const char *body, size_t len,
                   FILE *upload, curl_off_t upload_size, Resp *r, Err *e) {
    int attempts = kind == FILESTREAM ? FILESTREAM_ATTEMPTS : GRAPHQL_ATTEMPTS, final = 0;
    double per_attempt = kind == FILESTREAM ? u->fs_timeout : kind == STORAGE ? INFINITY : u->http_timeout;
    double planned = 0, refused_since = INFINITY;
    Err last = {""};
    u->refused = 0;
    for (int a = 0; a < attempts; a++) {
        double firm = fmax(u->not_before, kind == FILESTREAM ? u->last_fs + u->min_gap : 0);
        if (attempt_wait(u, planned, firm, per_attempt, refused_since, &final) != 0) break;
        double start = wall_seconds(), timeout = fmin(per_attempt, deadline_of(u) - start);
        if (upload) rewind(upload);
        if (kind == FILESTREAM) u->last_fs = start;
        http_once(u, url, kind != STORAGE, headers, body, len, upload, upload_size, isfinite(timeout) ? timeout : 0, r);
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
                                             (1.0 + 0.25 * (double)(rng_next(&u->rng) >> 11) / 9007199254740992.0));
        if (r->retry_after >= 0) /* the server's wait is firm: never shortened to fit a deadline */
            u->not_before = fmax(u->not_before, now + r->retry_after);
        else
            planned = now + wait;
    }
    return err_set(e, "stopped at the time limit%s%s", last.msg[0] ? " after: " : "", last.msg);
}

/* POSTs a GraphQL document; returns data.<field> (owned by *root) or NULL with e set. Consumes vars. */
static cJSON *graphql(Uplink *u, Kind kind, const char *op, const char *query, cJSON *vars, const char *field,
                      cJSON **root, Err *e) {
    cJSON *req = cJSON_CreateObject();
    cJSON_AddStringToObject(req, "operationName", op);
    cJSON_AddStringToObject(req, "query", query);
    cJSON_AddItemToObject(req, "variables", vars);
    char *body = cJSON_PrintUnformatted(req);
    cJSON_Delete(req);
    char *url = join(u->base, "graphql");
    Resp r = {0};
    cJSON *ans = NULL;
    *root = NULL;
    if (request(u, kind, url, u->json_headers, body, strlen(body), NULL, 0, &r, e) == 0) {
        Buf m = {0};
        *root = cJSON_Parse(r.body.p ? r.body.p : "");
        server_message(*root, &m);
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

static const char *str_item(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItem(o, key);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

static void add_str(cJSON *o, const char *key, const char *v) {
    cJSON_AddItemToObject(o, key, v && *v ? cJSON_CreateString(v) : cJSON_CreateNull());
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
static int upsert(Uplink *u, const cJSON *run, const cJSON *config, long *lines, int *inserted, Err *e) {
    static const char *const vars_of_record[][2] = {
        {"name", "run_id"}, {"project", "project"}, {"entity", "entity"}, {"displayName", "name"},
        {"groupName", "group"}, {"jobType", "job_type"}, {"notes", "notes"}, {"host", "host"},
        {"program", "program"}, {"commit", "commit"}};
    cJSON *v = cJSON_CreateObject();
    for (size_t i = 0; i < sizeof vars_of_record / sizeof *vars_of_record; i++)
        add_str(v, vars_of_record[i][0], str_item(run, vars_of_record[i][1]));
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
    cJSON *ans = graphql(u, UPSERT, "UpsertBucket", UPSERT_QUERY, v, "upsertBucket", &root, e);
    const cJSON *b = cJSON_GetObjectItem(ans, "bucket"), *project = cJSON_GetObjectItem(b, "project");
    const char *name = str_item(b, "name"), *pname = str_item(project, "name"),
               *entity = str_item(cJSON_GetObjectItem(project, "entity"), "name");
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
        Buf url = {0};
        if (!strcmp(u->base, DEFAULT_BASE))
            buf_puts(&url, "https://wandb.ai");
        else if (!strncmp(u->base, "https://api.", 12)) {
            buf_puts(&url, "https://app.");
            buf_puts(&url, u->base + 12);
        } else
            buf_puts(&url, u->base);
        const char *path[] = {"/", entity, "/", pname, "/runs/", name};
        for (int i = 0; i < 6; i++) buf_puts(&url, path[i]);
        free(u->url);
        u->url = url.p;
        Buf fs = {0};
        buf_puts(&fs, u->base);
        buf_puts(&fs, "/files");
        const char *parts[] = {entity, pname, name};
        for (int i = 0; i < 3; i++) {
            char *esc = curl_easy_escape(u->curl, parts[i], 0);
            buf_puts(&fs, "/");
            buf_puts(&fs, esc);
            curl_free(esc);
        }
        buf_puts(&fs, "/file_stream");
        free(u->fs_url);
        u->fs_url = fs.p;
        rc = 0;
    }
    cJSON_Delete(root);
    return rc;
}

/* ---------------------------------------------------------------- FileStream and files */

/* {"files": {history from offset, summary}, "uploaded": [...], "complete": true, "exitcode": N};
 * empty parts are left out, so nothing at all is the heartbeat {}. */
static char *filestream_body(long offset, char *const *lines, long n, const char *summary, const cJSON *uploaded,
                             int complete, int exit_code, size_t *len) {
    Buf b = {0};
    const char *sep = "";
    buf_puts(&b, "{");
    if (n || summary) {
        buf_puts(&b, "\"files\":{");
        if (n) {
            buf_printf(&b, "\"wandb-history.jsonl\":{\"offset\":%ld,\"content\":[", offset);
            for (long i = 0; i < n; i++) {
                if (i) buf_puts(&b, ",");
                buf_json_str(&b, lines[i]);
            }
            buf_puts(&b, "]}");
        }
        if (summary) {
            if (n) buf_puts(&b, ",");
            buf_puts(&b, "\"wandb-summary.json\":{\"offset\":0,\"content\":[");
            buf_json_str(&b, summary);
            buf_puts(&b, "]}");
        }
        buf_puts(&b, "}");
        sep = ",";
    }
    if (cJSON_GetArraySize(uploaded)) {
        char *names = cJSON_PrintUnformatted(uploaded);
        buf_printf(&b, "%s\"uploaded\":", sep);
        buf_puts(&b, names);
        free(names);
        sep = ",";
    }
    if (complete) buf_printf(&b, "%s\"complete\":true,\"exitcode\":%d", sep, exit_code);
    buf_puts(&b, "}");
    *len = b.n;
    return b.p;
}

static int filestream(Uplink *u, const char *body, size_t len, int *stopped, Err *e) {
    Resp r = {0};
    int rc = request(u, FILESTREAM, u->fs_url, u->json_headers, body, len, NULL, 0, &r, e);
    if (rc == 0) { /* the body may be empty or not JSON: only "stopped" matters */
        cJSON *j = cJSON_Parse(r.body.p ? r.body.p : "");
        *stopped = cJSON_IsTrue(cJSON_GetObjectItem(j, "stopped"));
        cJSON_Delete(j);
    }
    free(r.body.p);
    return rc;
}

/* Writes the cursor so that a later sync neither resends acknowledged rows at new offsets nor skips any. */
static void state_save(Uplink *u) {
    if (!u->state_path) return;
    cJSON *s = cJSON_CreateObject();
    cJSON_AddStringToObject(s, "base_url", u->base);
    cJSON_AddStringToObject(s, "url", u->url);
    cJSON_AddNumberToObject(s, "history_sent", (double)u->hist_sent);
    cJSON_AddNumberToObject(s, "history_offset", (double)u->hist_offset);
    cJSON_AddItemToObject(s, "uploaded", cJSON_Duplicate(u->uploaded, 1));
    cJSON_AddBoolToObject(s, "complete", u->complete);
    char *text = cJSON_Print(s);
    Err e;
    if (write_file_atomic(u->state_path, text, strlen(text), &e) != 0 && !u->state_failed) {
        u->state_failed = 1;
        say("%s (a later sync may resend rows)", e.msg);
    }
    free(text);
    cJSON_Delete(s);
}

/* Reads the cursor; 1 when it exists and belongs to the same server. */
static int state_load(Uplink *u) {
    char *text = read_file(u->state_path, NULL, NULL);
    cJSON *s = cJSON_Parse(text ? text : "");
    free(text);
    const char *base = str_item(s, "base_url"), *url = str_item(s, "url");
    const cJSON *sent = cJSON_GetObjectItem(s, "history_sent"), *off = cJSON_GetObjectItem(s, "history_offset"),
                *up = cJSON_GetObjectItem(s, "uploaded");
    int ok = base && url && !strcmp(base, u->base) && cJSON_IsNumber(sent) && cJSON_IsNumber(off) && cJSON_IsArray(up);
    if (ok) {
        u->hist_sent = (long)sent->valuedouble;
        u->hist_offset = (long)off->valuedouble;
        cJSON_Delete(u->uploaded);
        u->uploaded = cJSON_Duplicate(up, 1);
        u->complete = cJSON_IsTrue(cJSON_GetObjectItem(s, "complete"));
        set_str(&u->url, url);
    }
    cJSON_Delete(s);
    return ok;
}

/* A run completed on the server gets a new session (summary, files,
 * completion again): the cursor of the spool in dir forgets "complete". */
static void state_reopen(const char *dir) {
    char *state = join(dir, "sync_state.json"), *text = read_file(state, NULL, NULL);
    cJSON *st = cJSON_Parse(text ? text : "");
    if (cJSON_IsTrue(cJSON_GetObjectItem(st, "complete"))) {
        cJSON_ReplaceItemInObject(st, "complete", cJSON_CreateFalse());
        char *out = cJSON_Print(st);
        Err se;
        if (write_file_atomic(state, out, strlen(out), &se) != 0) say("%s", se.msg);
        free(out);
    }
    cJSON_Delete(st);
    free(text);
    free(state);
}

static int in_array(const cJSON *a, const char *s) {
    const cJSON *it;
    cJSON_ArrayForEach(it, a) if (cJSON_IsString(it) && !strcmp(it->valuestring, s)) return 1;
    return 0;
}

static const char CREATE_FILES_QUERY[] =
    "mutation CreateRunFiles($entity: String!, $project: String!, $run: String!, $files: [String!]!) { "
    "createRunFiles(input: {entityName: $entity, projectName: $project, runName: $run, files: $files}) { runID "
    "uploadHeaders files { name uploadUrl } } }";

/* CreateRunFiles for paths, then one PUT per file from <spool>/files/ (with
 * the answer's uploadHeaders, without credentials). Paths uploaded are
 * appended to done; returns -1 with e at the first failure. */
static int upload_files(Uplink *u, const char *spool_dir, const cJSON *paths, cJSON *done, Err *e) {
    cJSON *v = cJSON_CreateObject(), *root;
    cJSON_AddStringToObject(v, "entity", u->entity);
    cJSON_AddStringToObject(v, "project", u->project);
    cJSON_AddStringToObject(v, "run", u->run_id);
    cJSON_AddItemToObject(v, "files", cJSON_Duplicate(paths, 1));
    cJSON *ans = graphql(u, GRAPHQL, "CreateRunFiles", CREATE_FILES_QUERY, v, "createRunFiles", &root, e);
    const cJSON *files = cJSON_GetObjectItem(ans, "files"), *h, *f;
    const char *run_id = str_item(ans, "runID");
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
        const char *name = str_item(f, "name"), *url = str_item(f, "uploadUrl");
        if (!name || !url || !in_array(paths, name)) continue; /* null uploadUrl: the server skips it */
        char *dir = join(spool_dir, "files"), *local = join(dir, name);
        FILE *fp = fopen(local, "rb");
        struct stat st;
        Resp r = {0};
        Err pe;
        if (!fp || fstat(fileno(fp), &st) != 0)
            err_set(&pe, "%s: cannot open: %s", local, strerror(errno));
        else if (request(u, STORAGE, url, headers, NULL, 0, fp, (curl_off_t)st.st_size, &r, &pe) == 0)
            cJSON_AddItemToArray(done, cJSON_CreateString(name));
        if (!in_array(done, name) && rc == 0) {
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

/* ---------------------------------------------------------------- the run */

typedef struct Line {
    struct Line *next;
    size_t len;
    char text[];
} Line;

/* The spool of a run being written (spool.jsonl opened for appending). */
typedef struct {
    char *dir; /* <root>/wandb-c/<run_id>[-k], NULL without a spool */
    int fd, failed;
} SpoolWriter;

struct WandbRun {
    Uplink up;
    pthread_t worker;
    int has_worker;
    SpoolWriter spool;
    double t0, flush_s, heartbeat_s, finish_timeout_s, connect_grace_s;
    cJSON *run_rec, *config; /* kept until the worker has created the run (wandb_init found nothing listening) */
    atomic_int connected;    /* the run exists on the server; up.url and the names are set */
    /* training thread only */
    KV row;
    long row_step, last_step; /* last_step: the last closed row, -1 before the first */
    long dropped;
    /* shared with the worker, guarded by up.mu */
    KV summary;
    int summary_dirty;
    Line *head, *tail;
    size_t queued_bytes;
    cJSON *files_pending;    /* run paths to upload */
    cJSON *uploaded_pending; /* uploaded, to report in the next FileStream request */
    int finishing, exit_code, gave_up, completed;
    atomic_int stopped;
};

/* One write(2) per record, straight to the kernel: a crash loses at most the open row. */
static void spool_write(SpoolWriter *w, const char *rec, size_t n) {
    if (w->fd < 0) return;
    if (write(w->fd, rec, n) != (ssize_t)n && !w->failed) {
        w->failed = 1;
        say("%s/spool.jsonl: write failed: %s (hint: is the disk full? the spool misses records from here on)",
            w->dir, strerror(errno));
    }
}

static void spool_json(SpoolWriter *w, cJSON *rec) {
    char *text = cJSON_PrintUnformatted(rec);
    Buf b = {0};
    buf_puts(&b, text);
    buf_puts(&b, "\n");
    spool_write(w, b.p, b.n);
    free(b.p);
    free(text);
}

static void spool_summary(WandbRun *r) {
    Buf b = {0};
    pthread_mutex_lock(&r->up.mu);
    summary_record(&b, &r->summary);
    pthread_mutex_unlock(&r->up.mu);
    spool_write(&r->spool, b.p, b.n);
    free(b.p);
}

/* <root>/wandb-c/<run_id>, or <run_id>-2, -3, ... when an earlier process left a spool there. */
static void spool_open(SpoolWriter *w, const char *root, const char *run_id) {
    char *dir = join(root, "wandb-c"), *base = join(dir, run_id), *path = NULL, *file = NULL;
    for (int k = 1;; k++) {
        free(path);
        free(file);
        Buf b = {0};
        buf_puts(&b, base);
        if (k > 1) buf_printf(&b, "-%d", k);
        path = b.p;
        file = join(path, "spool.jsonl");
        if (!file_exists(file)) break;
    }
    char *files = join(path, "files");
    Err e;
    if (make_dirs(files, &e) != 0) {
        say("%s; running without a spool (nothing to sync later)", e.msg);
        free(path);
    } else if ((w->fd = open(file, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644)) < 0) {
        say("%s: cannot create: %s; running without a spool (nothing to sync later)", file, strerror(errno));
        free(path);
    } else {
        w->dir = path;
        const char header[] = "{\"t\":\"spool\",\"version\":1}\n";
        spool_write(w, header, sizeof header - 1);
    }
    free(files);
    free(file);
    free(base);
    free(dir);
}

/* Makes the spool's records durable and closes it; w->dir stays. */
static void spool_close(SpoolWriter *w) {
    if (w->fd >= 0) {
        fsync(w->fd);
        close(w->fd);
        w->fd = -1;
    }
}

/* Appends records to the spool in dir with one write: they go in whole or not at all. */
static int spool_append(const char *dir, const char *rec, size_t n, Err *e) {
    char *path = join(dir, "spool.jsonl");
    int fd = open(path, O_WRONLY | O_APPEND | O_CLOEXEC);
    int ok = fd >= 0 && write(fd, rec, n) == (ssize_t)n && fsync(fd) == 0;
    if (fd >= 0) close(fd);
    if (!ok) err_set(e, "%s: cannot append: %s", path, strerror(errno));
    free(path);
    return ok ? 0 : -1;
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
        char *t = xstrndup(s, n);
        char *b = t + strspn(t, " \t");
        for (size_t k = strlen(b); k > 0 && strchr(" \t", b[k - 1]); k--) b[k - 1] = 0;
        if (strlen(b) > 64)
            say("tag \"%s\" is longer than 64 characters; left out", b);
        else if (*b)
            cJSON_AddItemToArray(a, cJSON_CreateString(b));
        free(t);
        s += n + (s[n] == ',');
    }
    return a;
}

/* netrc: the password of "machine <host[:port]>" ($NETRC, else ~/.netrc, else ~/_netrc). */
static char *netrc_key(const char *host) {
    const char *home = first(env("HOME"), "/");
    char *paths[3] = {env("NETRC") ? xstrdup(env("NETRC")) : NULL, join(home, ".netrc"), join(home, "_netrc")};
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
static char *find_key(const WandbSettings *s, const char *base, Err *e) {
    char host[256];
    const char *k = first(s->api_key, env("WANDB_API_KEY"));
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
        Buf s = {0};
        summary_json(&s, &r->summary);
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
    if (upsert(u, r->run_rec, cJSON_IsObject(r->config) ? r->config : NULL, &lines, &inserted, e) != 0) return -1;
    if (!inserted)
        say("run %s already exists in %s/%s; its history continues after line %ld "
            "(hint: log steps above the last one stored there, or use a new WANDB_RUN_ID)",
            u->run_id, u->entity, u->project, lines);
    u->hist_offset = lines;
    u->state_path = r->spool.dir ? join(r->spool.dir, "sync_state.json") : NULL;
    state_save(u);
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
            say("%s answers now; logging to %s", u->base, u->url);
            return 0;
        }
        if (stop || !u->refused) {
            say("cannot create the run on %s: %s; %s", u->base, e.msg, stop ? "the run stays in the spool" : SYNC_HINT);
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
            wait_until(u, due);
            continue;
        }
        if (have_files) {
            cJSON *paths = r->files_pending, *done = cJSON_CreateArray(), *it;
            r->files_pending = cJSON_CreateArray();
            pthread_mutex_unlock(&u->mu);
            if (upload_files(u, r->spool.dir, paths, done, &e) != 0)
                say("file upload failed: %s; the file stays in %s/files", e.msg, r->spool.dir);
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
        char *body = filestream_body(u->hist_offset, b.text, b.n, b.summary, b.uploaded, final, code, &len);
        int stopped = 0, rc = filestream(u, body, len, &stopped, &e);
        free(body);
        if (rc == 0) {
            const cJSON *it;
            if (stopped) atomic_store(&r->stopped, 1);
            u->hist_offset += b.n;
            u->hist_sent += b.n;
            cJSON_ArrayForEach(it, b.uploaded) cJSON_AddItemToArray(u->uploaded, cJSON_CreateString(it->valuestring));
            u->complete = final;
            state_save(u);
        }
        batch_free(&b);

        pthread_mutex_lock(&u->mu);
        if (rc != 0) {
            r->gave_up = 1;
            say("upload to %s stopped: %s; %s", u->url, e.msg, r->finishing ? "the rest is in the spool" : SYNC_HINT);
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
        say("\"%s\" at step %ld dropped: steps must increase and keys must not start with '_' "
            "(further drops are only counted)", key, step);
}

/* Closes the open row: adds _step, _runtime (monotonic) and _timestamp, spools
 * it, queues it for upload and folds it into the summary. */
static void close_row(WandbRun *r) {
    if (!r->row.n) return;
    kv_set(&r->row, "\"_step\"", 7, (double)r->row_step);
    kv_set(&r->row, "\"_runtime\"", 10, round((wall_seconds() - r->t0) * 1e6) / 1e6); /* microseconds: short lines */
    kv_set(&r->row, "\"_timestamp\"", 12, round(unix_seconds() * 1e6) / 1e6);
    r->last_step = r->row_step;
    Buf rec = {0};
    buf_puts(&rec, HIST_PREFIX);
    size_t start = rec.n;
    kv_json(&rec, &r->row);
    size_t len = rec.n - start;
    if (len > (size_t)MAX_LINE) {
        say("the row of step %ld is %zu bytes, over W&B's limit of %ld; dropped", r->row_step, len, MAX_LINE);
    } else {
        buf_puts(&rec, "}\n");
        spool_write(&r->spool, rec.p, rec.n);
        pthread_mutex_lock(&r->up.mu);
        for (int i = 0; i < r->row.n; i++) kv_set(&r->summary, r->row.it[i].key, strlen(r->row.it[i].key), r->row.it[i].v);
        r->summary_dirty = 1;
        if (r->has_worker && !r->gave_up) {
            if (r->queued_bytes + len > QUEUE_BYTES) {
                r->gave_up = 1;
                pthread_cond_broadcast(&r->up.cv);
                say("upload to %s fell %zu MiB behind; %s", r->up.base, QUEUE_BYTES >> 20, SYNC_HINT);
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
    kv_clear(&r->row);
    free(rec.p);
}

WandbRun *wandb_init(const WandbSettings *s) {
    const char *mode = first(env("WANDB_MODE"), first(s->mode, "online"));
    if (!strcmp(mode, "disabled")) return NULL;
    int online = !strcmp(mode, "online");
    if (!online && strcmp(mode, "offline") && strcmp(mode, "dryrun"))
        say("unknown mode \"%s\" (hint: online, offline or disabled); running offline", mode);

    WandbRun *r = xcalloc(1, sizeof *r);
    Uplink *u = &r->up;
    uplink_setup(u, s);
    r->t0 = wall_seconds();
    r->flush_s = setting(s->flush_interval_s, NULL, 10);
    r->heartbeat_s = setting(s->heartbeat_s, NULL, 30);
    r->finish_timeout_s = setting(s->finish_timeout_s, NULL, 120);
    r->connect_grace_s = setting(s->connect_grace_s, "WANDB_CONNECT_GRACE", CONNECT_GRACE_S);
    r->last_step = -1;
    r->spool.fd = -1;
    r->files_pending = cJSON_CreateArray();
    r->uploaded_pending = cJSON_CreateArray();

    char generated[9];
    for (int i = 0; i < 8; i++) generated[i] = "abcdefghijklmnopqrstuvwxyz0123456789"[rng_next(&u->rng) % 36];
    generated[8] = 0;
    const char *run_id = first(s->run_id, env("WANDB_RUN_ID"));
    if (run_id && !valid_run_id(run_id))
        say("invalid run ID \"%s\" (hint: no outer spaces and none of : ; , # ? / '); using %s", run_id, generated);
    if (!run_id || !valid_run_id(run_id)) run_id = generated;

    cJSON *run = cJSON_CreateObject();
    char host[256] = "";
    gethostname(host, sizeof host - 1);
    cJSON_AddStringToObject(run, "t", "run");
    add_str(run, "entity", first(env("WANDB_ENTITY"), s->entity));
    add_str(run, "project", first(env("WANDB_PROJECT"), s->project));
    add_str(run, "run_id", run_id);
    add_str(run, "name", first(env("WANDB_NAME"), s->name));
    add_str(run, "group", first(env("WANDB_RUN_GROUP"), s->group));
    add_str(run, "job_type", first(env("WANDB_JOB_TYPE"), s->job_type));
    cJSON_AddItemToObject(run, "tags", parse_tags(first(env("WANDB_TAGS"), s->tags)));
    add_str(run, "notes", first(env("WANDB_NOTES"), s->notes));
    add_str(run, "host", host);
    add_str(run, "program", program_invocation_name);
    add_str(run, "commit", s->commit);
    cJSON_AddNumberToObject(run, "start_time", unix_seconds());
    cJSON *config = s->config_json ? cJSON_Parse(s->config_json) : NULL;
    if (s->config_json && !cJSON_IsObject(config))
        say("the run config is not a JSON object; the run goes without one");

    spool_open(&r->spool, first(s->dir, first(env("WANDB_DIR"), "wandb")), run_id);
    spool_json(&r->spool, run);
    if (cJSON_IsObject(config)) {
        cJSON *rec = cJSON_CreateObject();
        cJSON_AddStringToObject(rec, "t", "config");
        cJSON_AddItemReferenceToObject(rec, "config", config);
        spool_json(&r->spool, rec);
        cJSON_Delete(rec);
    }

    Err e;
    r->run_rec = run;
    r->config = config;
    if (online && !(u->key = find_key(s, u->base, &e))) {
        say("%s; %s", e.msg, SYNC_HINT);
    } else if (online) {
        set_bounds(u, wall_seconds() + setting(s->init_timeout_s, "WANDB_INIT_TIMEOUT", 90), r->connect_grace_s);
        int rc = create_run(r, &e);
        if (rc != 0 && !u->refused)
            say("cannot create the run on %s: %s; %s", u->base, e.msg, SYNC_HINT);
        else if (rc != 0) /* nothing listens (yet): the worker keeps trying */
            say("cannot create the run on %s: %s; continuing offline for now, retrying in the background "
                "(the rows go up live once the server answers; else sync later with make wandb-sync)",
                u->base, e.msg);
        set_bounds(u, INFINITY, INFINITY);
        u->last_fs = wall_seconds();
        if ((rc == 0 || u->refused) && pthread_create(&r->worker, NULL, worker_main, r) != 0)
            say("cannot start the upload thread; %s", SYNC_HINT);
        else if (rc == 0 || u->refused) {
            r->has_worker = 1;
            if (rc == 0) say("logging to %s", u->url);
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
    Buf k = {0};
    buf_json_str(&k, key);
    kv_set(&r->row, k.p, k.n, value);
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
    Buf k = {0};
    buf_json_str(&k, key);
    pthread_mutex_lock(&r->up.mu);
    kv_set(&r->summary, k.p, k.n, value);
    r->summary_dirty = 1;
    pthread_mutex_unlock(&r->up.mu);
    free(k.p);
    spool_summary(r);
}

/* Relative, '/'-separated, no empty, "." or ".." parts, no control characters. */
static int valid_run_path(const char *p) {
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
static int copy_into_spool(const char *spool_dir, const char *local_path, const char *run_path, Err *e) {
    size_t n;
    char *data = read_file(local_path, &n, e);
    char *files = join(spool_dir, "files"), *dst = join(files, run_path), *slash = strrchr(dst, '/');
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

int wandb_upload_file(WandbRun *r, const char *local_path, const char *run_path) {
    if (!r) return 0;
    if (!valid_run_path(run_path)) {
        say("\"%s\" is not a path inside the run (hint: relative, '/'-separated, no . or .. parts)", run_path);
        return -1;
    }
    if (!r->spool.dir) {
        say("%s not uploaded: the run has no spool folder", local_path);
        return -1;
    }
    Err e;
    int rc = copy_into_spool(r->spool.dir, local_path, run_path, &e);
    if (rc != 0) {
        say("%s; not uploaded", e.msg);
    } else {
        cJSON *rec = cJSON_CreateObject();
        cJSON_AddStringToObject(rec, "t", "file");
        cJSON_AddStringToObject(rec, "path", run_path);
        spool_json(&r->spool, rec);
        cJSON_Delete(rec);
        pthread_mutex_lock(&r->up.mu);
        if (r->has_worker && !r->gave_up && !in_array(r->files_pending, run_path)) {
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
    spool_write(&r->spool, rec, strlen(rec));
    spool_close(&r->spool);
    if (r->has_worker) {
        pthread_mutex_lock(&r->up.mu);
        r->finishing = 1;
        r->exit_code = exit_code;
        r->summary_dirty = 1; /* the summary always goes right before completion */
        set_bounds_locked(&r->up, wall_seconds() + r->finish_timeout_s, r->connect_grace_s);
        pthread_mutex_unlock(&r->up.mu);
        pthread_join(r->worker, NULL);
        if (r->completed) say("run uploaded: %s", r->up.url);
    }
    if (r->dropped > 1) say("%ld values were dropped in all (earlier steps or keys starting with '_')", r->dropped);
    if (!r->completed && r->spool.dir) say("run saved in %s (hint: upload it with make wandb-sync)", r->spool.dir);
    kv_free(&r->row);
    kv_free(&r->summary);
    queue_free(r);
    cJSON_Delete(r->files_pending);
    cJSON_Delete(r->uploaded_pending);
    cJSON_Delete(r->run_rec);
    cJSON_Delete(r->config);
    uplink_free(&r->up);
    free(r->spool.dir);
    free(r);
}

/* ---------------------------------------------------------------- sync */

typedef struct {
    cJSON *run, *config, *files; /* run record, latest config, run paths in first-seen order */
    char **rows;                 /* history lines, exactly as spooled */
    long nrows;
    KV summary;                  /* replayed: rows fold in, summary records replace */
    int has_exit, exit_code;
} Spool;

static void spool_free(Spool *sp) {
    cJSON_Delete(sp->run);
    cJSON_Delete(sp->config);
    cJSON_Delete(sp->files);
    for (long i = 0; i < sp->nrows; i++) free(sp->rows[i]);
    free(sp->rows);
    kv_free(&sp->summary);
}

/* Reads spool.jsonl; a last line without its newline (cut by a crash) is ignored. */
static int spool_read(const char *dir, Spool *sp, Err *e) {
    char *path = join(dir, "spool.jsonl");
    size_t n, hp = strlen(HIST_PREFIX), sp_len = strlen(SUMMARY_PREFIX);
    char *text = read_file(path, &n, e), *line = text, *nl;
    long lineno = 1, cap = 0;
    int rc = text ? 0 : -1;
    sp->files = cJSON_CreateArray();
    for (; rc == 0 && (nl = memchr(line, '\n', (size_t)(text + n - line))); line = nl + 1, lineno++) {
        *nl = 0;
        size_t len = (size_t)(nl - line);
        if (lineno == 1) {
            cJSON *h = cJSON_Parse(line);
            const cJSON *version = cJSON_GetObjectItem(h, "version");
            if (!str_item(h, "t") || strcmp(str_item(h, "t"), "spool") || !cJSON_IsNumber(version) ||
                version->valueint != 1)
                rc = err_set(e, "%s: not a kvlab W&B spool (version 1)", path);
            cJSON_Delete(h);
        } else if (len > hp && !strncmp(line, HIST_PREFIX, hp) && line[len - 1] == '}') {
            if (sp->nrows == cap) {
                cap = cap ? 2 * cap : 1024;
                sp->rows = xrealloc(sp->rows, (size_t)cap * sizeof *sp->rows);
            }
            sp->rows[sp->nrows] = xstrndup(line + hp, len - hp - 1);
            if (kv_parse(&sp->summary, sp->rows[sp->nrows++]) != 0)
                rc = err_set(e, "%s:%ld: damaged history record", path, lineno);
        } else if (len > sp_len && !strncmp(line, SUMMARY_PREFIX, sp_len)) {
            kv_clear(&sp->summary);
            if (kv_parse(&sp->summary, line + sp_len) != 0)
                rc = err_set(e, "%s:%ld: damaged summary record", path, lineno);
        } else {
            cJSON *rec = cJSON_Parse(line);
            const char *t = str_item(rec, "t"), *file = str_item(rec, "path");
            const cJSON *code = cJSON_GetObjectItem(rec, "code");
            if (!t) {
                rc = err_set(e, "%s:%ld: damaged record", path, lineno);
            } else if (!strcmp(t, "run") && !sp->run) {
                sp->run = cJSON_Duplicate(rec, 1);
            } else if (!strcmp(t, "config")) {
                cJSON_Delete(sp->config);
                sp->config = cJSON_DetachItemFromObject(rec, "config");
            } else if (!strcmp(t, "file") && file && !in_array(sp->files, file)) {
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

/* History from the cursor in chunks, the summary with the last chunk, the
 * files and their "uploaded" notice, then "complete" when the run ended. */
static int sync_send(Uplink *u, Spool *sp, const char *dir, Err *e) {
    Buf summary = {0};
    int stopped, rc = 0, summary_sent = sp->summary.n == 0;
    summary_json(&summary, &sp->summary);
    while (rc == 0 && (u->hist_sent < sp->nrows || !summary_sent)) {
        long i = u->hist_sent, n = 0;
        size_t bytes = 0;
        while (i + n < sp->nrows && (n == 0 || bytes + strlen(sp->rows[i + n]) <= (size_t)u->request_bytes))
            bytes += strlen(sp->rows[i + n++]);
        int last = i + n >= sp->nrows;
        size_t len;
        char *body = filestream_body(u->hist_offset, sp->rows + i, n, last ? summary.p : NULL, NULL, 0, 0, &len);
        rc = filestream(u, body, len, &stopped, e);
        free(body);
        if (rc == 0) {
            u->hist_sent += n;
            u->hist_offset += n;
            summary_sent |= last;
            state_save(u);
        }
    }
    free(summary.p);
    if (rc != 0) return -1;

    cJSON *todo = cJSON_CreateArray(), *done = cJSON_CreateArray(), *it;
    cJSON_ArrayForEach(it, sp->files) if (!in_array(u->uploaded, it->valuestring))
        cJSON_AddItemToArray(todo, cJSON_CreateString(it->valuestring));
    Err fe;
    int files_rc = cJSON_GetArraySize(todo) ? upload_files(u, dir, todo, done, &fe) : 0;
    if (cJSON_GetArraySize(done)) {
        size_t len;
        char *body = filestream_body(0, NULL, 0, NULL, done, 0, 0, &len);
        rc = filestream(u, body, len, &stopped, e);
        free(body);
        if (rc == 0) {
            cJSON_ArrayForEach(it, done) cJSON_AddItemToArray(u->uploaded, cJSON_CreateString(it->valuestring));
            state_save(u);
        }
    }
    cJSON_Delete(todo);
    cJSON_Delete(done);
    if (rc != 0) return -1;
    if (files_rc != 0) {
        *e = fe;
        return -1;
    }
    if (sp->has_exit) {
        size_t len;
        char *body = filestream_body(0, NULL, 0, NULL, NULL, 1, sp->exit_code, &len);
        rc = filestream(u, body, len, &stopped, e);
        free(body);
        if (rc == 0) {
            u->complete = 1;
            state_save(u);
        }
    }
    return rc;
}

int wandb_sync_dir(const char *spool_dir, const WandbSettings *s, Err *e) {
    Spool sp = {0};
    Uplink u;
    Err ie;
    int rc = -1;
    uplink_setup(&u, s);
    if (spool_read(spool_dir, &sp, e) != 0) goto out;
    if (!(u.key = find_key(s, u.base, &ie))) {
        err_set(e, "%s: %s", spool_dir, ie.msg);
        goto out;
    }
    u.state_path = join(spool_dir, "sync_state.json");
    int have_cursor = state_load(&u);
    if (u.complete) { /* nothing may follow "complete" */
        say("%s was already synced to %s", spool_dir, u.url);
        rc = 0;
        goto out;
    }
    long lines;
    int inserted;
    if (upsert(&u, sp.run, sp.config, &lines, &inserted, &ie) != 0) {
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
    state_save(&u);
    u.last_fs = wall_seconds(); /* pacing also keeps a rerun's first request apart from an interrupted sync's last */
    if (sync_send(&u, &sp, spool_dir, &ie) != 0) {
        err_set(e, "%s: %s (hint: run the sync again; it resumes where it stopped)", spool_dir, ie.msg);
        goto out;
    }
    say("synced %s to %s%s", spool_dir, u.url, sp.has_exit ? "" : " (no exit record: the run is left unfinished)");
    rc = 0;
out:
    uplink_free(&u);
    spool_free(&sp);
    return rc;
}

/* ---------------------------------------------------------------- results attached later */

/* The spool folder under root/wandb-c whose spool.jsonl changed last, or NULL. */
static char *newest_spool(const char *root) {
    char *dir = join(root, "wandb-c"), *best = NULL;
    struct timespec best_t = {0, 0};
    DIR *d = opendir(dir);
    struct dirent *de;
    while (d && (de = readdir(d))) {
        if (de->d_name[0] == '.') continue;
        char *path = join(dir, de->d_name), *file = join(path, "spool.jsonl");
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

int wandb_attach_spool(const char *spool_root, const char *summary, const char *const *files, int nfiles,
                       const char *folder, const WandbSettings *s, Err *e) {
    const char *mode = first(env("WANDB_MODE"), first(s->mode, "online"));
    if (!strcmp(mode, "disabled")) return 1;
    char *dir = newest_spool(spool_root);
    if (!dir) return 1;
    Spool sp = {0};
    Buf rec = {0};
    int rc = -1;
    cJSON *add = summary ? cJSON_Parse(summary) : NULL;
    if (spool_read(dir, &sp, e) != 0) goto out;
    if (summary && !cJSON_IsObject(add)) {
        err_set(e, "results for %s: the summary is not a JSON object", dir);
        goto out;
    }
    int changed = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, add) {
        if (!cJSON_IsNumber(it) || !it->string[0] || it->string[0] == '_') {
            say("results for %s: summary value \"%s\" is not a number or starts with '_'; left out", dir, it->string);
            continue;
        }
        Buf k = {0};
        buf_json_str(&k, it->string);
        kv_set(&sp.summary, k.p, k.n, it->valuedouble);
        free(k.p);
        changed = 1;
    }
    if (changed) summary_record(&rec, &sp.summary);
    for (int i = 0; i < nfiles; i++) {
        const char *name = strrchr(files[i], '/');
        name = name ? name + 1 : files[i];
        Buf path = {0};
        buf_printf(&path, "%s/", folder);
        buf_puts(&path, name);
        Err fe;
        if (!valid_run_path(path.p))
            say("results for %s: \"%s\" is not a path inside the run; left out", dir, path.p);
        else if (copy_into_spool(dir, files[i], path.p, &fe) != 0)
            say("%s; not attached", fe.msg);
        else {
            cJSON *f = cJSON_CreateObject();
            cJSON_AddStringToObject(f, "t", "file");
            cJSON_AddStringToObject(f, "path", path.p);
            char *text = cJSON_PrintUnformatted(f);
            buf_puts(&rec, text);
            buf_puts(&rec, "\n");
            free(text);
            cJSON_Delete(f);
        }
        free(path.p);
    }
    if (rec.n) {
        if (spool_append(dir, rec.p, rec.n, e) != 0) goto out;
        state_reopen(dir);
    }
    rc = 0;
    if (rec.n && !strcmp(mode, "online")) {
        Err se;
        if (wandb_sync_dir(dir, s, &se) != 0)
            say("%s; the results stay in the spool (hint: upload them later with make wandb-sync)", se.msg);
    } else if (rec.n) {
        say("results attached to %s (hint: upload them with make wandb-sync)", dir);
    }
out:
    cJSON_Delete(add);
    spool_free(&sp);
    free(rec.p);
    free(dir);
    return rc;
}
