/* Run-time configuration symbols (scripts/kconfig.py RUNTIME, docs/sweeps.md).
 *
 * Most of the configuration is compiled in. A few training values (the seed,
 * learning rates, iterations and epochs, the synthetic tasks and seeds) are
 * run-time symbols: their CONFIG_ name expands to kconfig_runtime_int() or
 * kconfig_runtime_str() (generated/autoconf.h), which return the compiled value
 * unless `train --set NAME=VALUE` replaced it for this process. A sweep over
 * run-time symbols only then runs one build many times. */
#ifndef KVLAB_RUNCONFIG_H
#define KVLAB_RUNCONFIG_H

/* Replaces a run-time symbol's value for this process: "NAME=VALUE" (NAME with or without its CONFIG_ prefix).
 * Checked like scripts/kconfig.py checks it (an int in the symbol's range, a number, a list of letters,
 * digits, '.', '_', '+', ',', ' ' and '-'); anything else, or a symbol that is not a run-time symbol of this
 * build, stops the program with one line naming it and a hint. Call before anything reads the configuration. */
void kconfig_runtime_set(const char *assignment);

/* The number of run-time symbols of this build; the name (without CONFIG_), whether --set replaced it, and
 * whether it is an int symbol, for id in [0, count). */
int kconfig_runtime_count(void);
const char *kconfig_runtime_name(int id);
int kconfig_runtime_replaced(int id);
int kconfig_runtime_is_int(int id);
/* Its value: the int (int symbols) or the text (numbers and lists). */
int kconfig_runtime_value(int id);
const char *kconfig_runtime_text(int id);

#endif
