/* Force-included into every translation unit (-include include/kconfig.h).
 * Brings in the generated configuration and the IS_ENABLED() helper of the
 * Linux kernel: IS_ENABLED(option) is the constant 1 when the option macro is
 * defined to 1 and 0 when it is not defined at all, so plain `if` statements
 * on it compile away and both branches are still type-checked. (No option
 * names in this comment: scripts/fixdep.py would count them as uses.) */
#ifndef KVLAB_KCONFIG_H
#define KVLAB_KCONFIG_H

#include <generated/autoconf.h>

#define KV_ARG_PLACEHOLDER_1 0,
#define KV_TAKE_SECOND_ARG(ignored, val, ...) val
#define KV_IS_DEFINED(x) KV_IS_DEFINED_(x)
#define KV_IS_DEFINED_(val) KV_IS_DEFINED__(KV_ARG_PLACEHOLDER_##val)
#define KV_IS_DEFINED__(arg1_or_junk) KV_TAKE_SECOND_ARG(arg1_or_junk 1, 0, 0)

#define IS_ENABLED(option) KV_IS_DEFINED(option)

#endif
