#!/usr/bin/python3
"""Rewrites a gcc -MD dependency file the way Linux's scripts/basic/fixdep does.

Every object would otherwise depend on include/generated/autoconf.h, so any
configuration change would rebuild everything. Instead the object depends on
one file per CONFIG_ symbol that its sources mention; kconfiglib's sync_deps()
touches exactly the files of the symbols whose value changed.

usage: fixdep.py RAW_DEPFILE SYMBOL_FILES_DIR > DEPFILE
"""
import re
import sys

raw, config_dir = sys.argv[1], sys.argv[2]
text = open(raw, encoding="utf-8").read().replace("\\\n", " ")
target, _, deps = text.partition(":")
deps = deps.split()
kept, symbols = [], set()
for dep in deps:
    if dep.endswith("generated/autoconf.h"):
        continue
    kept.append(dep)
    if dep.startswith("/usr/"):
        continue  # system headers mention no CONFIG_ symbols of ours
    with open(dep, encoding="utf-8", errors="replace") as f:
        symbols.update(re.findall(r"\bCONFIG_([A-Za-z0-9_]+)", f.read()))
out = [f"{target.strip()}: {' '.join(kept)}"]
if symbols:
    files = " ".join(f"{config_dir}/{s.lower().replace('_', '/')}.h" for s in sorted(symbols))
    out.append(f"{target.strip()}: $(wildcard {files})")
# Empty rules so that a deleted header does not break the build (like gcc -MP).
out += [f"{d}:" for d in kept[1:]]
sys.stdout.write("\n".join(out) + "\n")
