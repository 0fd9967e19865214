#include "buildinfo.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>

#include <generated/config_data.h>
#include <generated/version.h>

#include "common.h"

const char *build_config_json(void) { return KVLAB_CONFIG_JSON; }

const char *build_git_commit(void) { return KVLAB_GIT_COMMIT; }

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
