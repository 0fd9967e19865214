#include "runconfig.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

/* The table of this build's run-time symbols, in the order of autoconf.h's enum (both generated from the same
 * list by scripts/kconfig.py). */
enum { RT_INT, RT_NUMBER, RT_LIST };

typedef struct {
    const char *name;
    int kind;
    long long lo, hi; /* RT_INT: the symbol's Kconfig range */
    int value;        /* RT_INT */
    const char *text; /* RT_NUMBER, RT_LIST */
    int replaced;
} RuntimeSymbol;

#define KCONFIG_RUNTIME_INT(name, v, lo, hi) {#name, RT_INT, lo, hi, v, NULL, 0},
#define KCONFIG_RUNTIME_NUMBER(name, s) {#name, RT_NUMBER, 0, 0, 0, s, 0},
#define KCONFIG_RUNTIME_LIST(name, s) {#name, RT_LIST, 0, 0, 0, s, 0},
static RuntimeSymbol table[KCONFIG_RUNTIME_COUNT + 1] = {
#include <generated/runtime_config.h>
    {NULL, 0, 0, 0, 0, NULL, 0}};

int kconfig_runtime_int(int id) { return table[id].value; }
const char *kconfig_runtime_str(int id) { return table[id].text; }
int kconfig_runtime_count(void) { return KCONFIG_RUNTIME_COUNT; }
const char *kconfig_runtime_name(int id) { return table[id].name; }
int kconfig_runtime_replaced(int id) { return table[id].replaced; }
int kconfig_runtime_is_int(int id) { return table[id].kind == RT_INT; }

/* The names of the run-time symbols of this build, for hints. */
static const char *runtime_names(void) {
    static char buf[1024];
    buf[0] = '\0';
    for (int i = 0; i < KCONFIG_RUNTIME_COUNT; i++) {
        size_t n = strlen(buf);
        snprintf(buf + n, sizeof buf - n, "%s%s", i ? ", " : "", table[i].name);
    }
    return KCONFIG_RUNTIME_COUNT ? buf : "none";
}

void kconfig_runtime_set(const char *assignment) {
    const char *eq = strchr(assignment, '=');
    if (!eq) FATAL("--set %s: expected NAME=VALUE (hint: e.g. --set SEED=2)", assignment);
    const char *name = assignment;
    size_t n = (size_t)(eq - name);
    if (n > 7 && !strncmp(name, "CONFIG_", 7)) name += 7, n -= 7;
    const char *value = eq + 1;
    RuntimeSymbol *s = NULL;
    for (int i = 0; i < KCONFIG_RUNTIME_COUNT; i++)
        if (strlen(table[i].name) == n && !strncmp(table[i].name, name, n)) s = &table[i];
    if (!s)
        FATAL("--set %s: %.*s is not a run-time symbol of this build (hint: these are: %s; any other symbol is "
              "compiled in and needs its own build, docs/sweeps.md)", assignment, (int)n, name, runtime_names());
    char *end;
    errno = 0;
    if (s->kind == RT_INT) {
        long long v = strtoll(value, &end, 0);
        if (end == value || *end || errno || v < s->lo || v > s->hi)
            FATAL("--set %s: CONFIG_%s must be a whole number from %lld to %lld (hint: its Kconfig range)", assignment,
                  s->name, s->lo, s->hi);
        s->value = (int)v;
    } else if (s->kind == RT_NUMBER) {
        double v = strtod(value, &end);
        if (end == value || *end || errno || !isfinite(v))
            FATAL("--set %s: CONFIG_%s must be a number (hint: write it like 0.1, 6e-4 or 1)", assignment, s->name);
        s->text = value;
    } else {
        if (strspn(value, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.,+ -") != strlen(value))
            FATAL("--set %s: CONFIG_%s must be a comma-separated list of letters, digits, '.', '_', '+' and '-' "
                  "(hint: e.g. 1,2)", assignment, s->name);
        s->text = value;
    }
    s->replaced = 1;
}
