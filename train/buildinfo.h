/* What a binary was built from: the resolved configuration (JSON) and the
 * git commit, both compiled in so that every checkpoint and metrics file
 * records exactly what ran. Also the parsing of numeric string options. */
#ifndef KVLAB_BUILDINFO_H
#define KVLAB_BUILDINFO_H

/* The resolved configuration as JSON, with the run-time symbols' values replaced by --set (lib/runconfig.h). */
const char *build_config_json(void);
const char *build_git_commit(void);
/* What `train_<family> info` prints after its banner, the same in every family: "config: <JSON>" and
 * "git commit: <describe>", one line each. */
void build_info_print(void);
/* A string Kconfig option holding a number, checked against [lo, hi]; stops
 * with an error naming the symbol when the text is not such a number. */
double config_number(const char *symbol, const char *text, double lo, double hi);
#define KCONFIG_NUMBER(sym, lo, hi) config_number(#sym, sym, (lo), (hi))

#endif
