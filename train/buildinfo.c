#include "buildinfo.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include <cjson/cJSON.h>

#include <generated/config_data.h>
#include <generated/version.h>

#include "common.h"
#include "runconfig.h"

/* The compiled configuration, with the values `train --set` replaced (lib/runconfig.h): what this process runs. */
const char *build_config_json(void) {
    static char *patched;
    int any = 0;
    for (int i = 0; i < kconfig_runtime_count(); i++) any |= kconfig_runtime_replaced(i);
    if (!any) return KVLAB_CONFIG_JSON;
    if (patched) return patched;
    cJSON *cfg = cJSON_Parse(KVLAB_CONFIG_JSON);
    if (!cfg) FATAL("the compiled configuration is not JSON (hint: rebuild)");
    for (int i = 0; i < kconfig_runtime_count(); i++) {
        if (!kconfig_runtime_replaced(i)) continue;
        const char *name = kconfig_runtime_name(i);
        cJSON *v = kconfig_runtime_is_int(i) ? cJSON_CreateNumber(kconfig_runtime_value(i))
                                             : cJSON_CreateString(kconfig_runtime_text(i));
        if (!v || !cJSON_ReplaceItemInObjectCaseSensitive(cfg, name, v))
            FATAL("the compiled configuration has no %s (hint: rebuild)", name);
    }
    patched = cJSON_PrintUnformatted(cfg);
    cJSON_Delete(cfg);
    if (!patched) FATAL("out of memory");
    return patched;
}

const char *build_git_commit(void) { return KVLAB_GIT_COMMIT; }

void build_info_print(void) {
    printf("config: %s\n", build_config_json());
    printf("git commit: %s\n", build_git_commit());
}

double config_number(const char *symbol, const char *text, double lo, double hi) {
    char *end;
    errno = 0;
    double v = strtod(text, &end);
    if (end == text || *end != '\0' || errno != 0 || !isfinite(v))
        FATAL("%s=\"%s\" is not a number (hint: set it with make menuconfig or scripts/config)", symbol, text);
    if (v < lo || v > hi)
        FATAL("%s=%s is outside [%g, %g] (hint: set it with make menuconfig or scripts/config)", symbol, text, lo, hi);
    return v;
}
