/* The small helpers the rest of the W&B client is written with: "wandb: ..."
 * lines on stderr, settings from the arguments or the environment, strings,
 * growing text buffers with JSON string literals, cJSON items, and the
 * xorshift generator of run IDs and backoff jitter. */
#define _GNU_SOURCE
#include "internal.h"

#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

/* One "wandb: ..." line on stderr, written at once so that lines of the two threads never mix. */
void wb_say(const char *fmt, ...) {
    char line[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    fprintf(stderr, "wandb: %s\n", line);
}

const char *wb_env(const char *name) {
    const char *v = getenv(name);
    return v && *v ? v : NULL;
}

const char *wb_first(const char *a, const char *b) { return a && *a ? a : (b && *b ? b : NULL); }

char *wb_xstrndup(const char *s, size_t n) {
    char *p = xmalloc(n + 1);
    memcpy(p, s, n);
    p[n] = 0;
    return p;
}

char *wb_join(const char *a, const char *b) {
    size_t n = strlen(a) + strlen(b) + 2;
    char *p = xmalloc(n);
    snprintf(p, n, "%s/%s", a, b);
    return p;
}

/* A time setting: v when set (> 0), else $var when it is a positive number
 * (one line says when it is not), else dflt. */
double wb_setting(double v, const char *var, double dflt) {
    if (v > 0) return v;
    const char *x = var ? wb_env(var) : NULL;
    if (x) {
        char *end;
        double d = strtod(x, &end);
        if (end != x && !*end && d > 0) return d;
        wb_say("%s=%s is not a number of seconds; using %g", var, x, dflt);
    }
    return dflt;
}

uint64_t wb_rng_next(uint64_t *s) { /* xorshift64 */
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* ---------------------------------------------------------------- text */

void wb_buf_add(WbBuf *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        b->cap = 2 * (b->n + n + 1);
        b->p = xrealloc(b->p, b->cap);
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

void wb_buf_puts(WbBuf *b, const char *s) { wb_buf_add(b, s, strlen(s)); }

void wb_buf_printf(WbBuf *b, const char *fmt, ...) {
    char tmp[256];
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (k < 0 || k >= (int)sizeof tmp) FATAL("wb_buf_printf: '%s' is too long", fmt);
    wb_buf_add(b, tmp, (size_t)k);
}

/* A JSON string literal, quotes included. */
void wb_buf_json_str(WbBuf *b, const char *s) {
    wb_buf_add(b, "\"", 1);
    for (;;) {
        size_t run = strcspn(s, "\"\\\b\f\n\r\t\001\002\003\004\005\006\007\013\016\017\020\021\022\023\024\025"
                                "\026\027\030\031\032\033\034\035\036\037");
        wb_buf_add(b, s, run);
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
        wb_buf_puts(b, esc);
        s++;
    }
    wb_buf_add(b, "\"", 1);
}

/* ---------------------------------------------------------------- cJSON items */

const char *wb_str_item(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItem(o, key);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

void wb_add_str(cJSON *o, const char *key, const char *v) {
    cJSON_AddItemToObject(o, key, v && *v ? cJSON_CreateString(v) : cJSON_CreateNull());
}

int wb_in_array(const cJSON *a, const char *s) {
    const cJSON *it;
    cJSON_ArrayForEach(it, a) if (cJSON_IsString(it) && !strcmp(it->valuestring, s)) return 1;
    return 0;
}
