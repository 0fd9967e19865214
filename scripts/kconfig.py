#!/usr/bin/python3
"""kvlab's configuration tool: a strict front end to Debian's kconfiglib.

Every command that reads a configuration fails, naming the symbol, when an
assignment names an unknown symbol, has an invalid value, or does not take
effect (unmet dependencies). kconfiglib's own tools only warn and drop such
assignments silently, which is how the earlier framework lost settings.

Commands (run from the repository root, with the Debian python: /usr/bin/python3):
  defconfig FILE OUT          resolve a defconfig into a full configuration
  merge OUT BASE FRAGMENT...  merge fragments over a full configuration (ablation steps)
  set CONFIG NAME=VALUE...    change values in a configuration
  olddefconfig CONFIG         update a configuration to the current Kconfig (drops unknown symbols, warns)
  savedefconfig CONFIG OUT    write the minimal defconfig equivalent to CONFIG
  genconfig CONFIG OUTDIR     write OUTDIR/include/generated/{autoconf.h,config.json,config_data.h,
                              runtime_config.h,attn_head_dim.h}
                              and OUTDIR/include/config/ (auto.conf + per-symbol files for fixdep)
  step OUTDIR BASE [FRAGMENT] merge + genconfig for one ablation step into OUTDIR
  steps CONFIG                print the ablation step names, one per line
  list-defconfigs             print "name<TAB>description" for every defconfig
  check-symbols               every CONFIG_ name used in the tree exists in Kconfig and every
                              Kconfig symbol is used outside Kconfig files
"""
import glob
import json
import os
import re
import sys

try:
    import kconfiglib
except ImportError:
    sys.exit("error: kconfiglib is missing (hint: apt-get install python3-kconfiglib, or run make, which installs it)")

KCONFIG = "Kconfig"
HEADER = "# kvlab configuration: edit with `make menuconfig` or `scripts/config NAME=VALUE`\n"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUMBER_RE = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")

# What every string symbol may hold (docs/build.md, "String symbols"). The values become file names,
# folders, command-line arguments and make variables, so each kind allows a conservative set of
# characters and nothing a shell or make would interpret; free text ("text") only ever travels as data
# (C string literals, JSON, argv). A string symbol whose default is a number holds a number. A new string
# symbol must be listed here (check-symbols fails otherwise). Written as a block of text so that the names
# do not count as uses of the symbols in check-symbols.
STRING_KINDS = dict(line.split() for line in """
    RUN_NAME                name
    ABLATION_STEPS          names
    OUTPUT_DIR              folder
    DATA_DIR                folder
    ABLATION_STEPS_DIR      path
    DATA_MIRROR             path-or-empty
    DIST_HOSTFILE           path-or-empty
    SWEEP                   grid
    GPT2_DATA_TRAIN_SHARDS  glob
    GPT2_DATA_VAL_SHARDS    glob
    SEQ2SEQ_TASKS           list
    SEQ2SEQ_SEEDS           list
    MECHINT_MASK_TARGETS    list
    WANDB_BASE_URL          url
    WANDB_PROJECT           project
    WANDB_ENTITY            name-or-empty
    WANDB_RUN_NAME          text
    WANDB_TAGS              text
    GPT2_SAMPLE_PROMPT      text
""".strip().splitlines())

# Run-time symbols: training values the binaries read when they run rather than when they are compiled. Each is
# compiled in as its configured value, and `train --set NAME=VALUE` replaces it for one run (lib/runconfig.h), so
# a sweep over these symbols only (docs/sweeps.md) reuses one build per step. Everything else is build-time: a
# change rebuilds. A symbol may join only if the code reads it at run time: its CONFIG_ name expands to a function
# call, which the compiler refuses in a constant expression (a static initialiser, a file-scope array size, #if),
# and check-symbols refuses in a Makefile, an #if or between [ ] (a local array would silently become a VLA). A
# block of text, so that the names do not count as uses in check-symbols.
RUNTIME = """
    SEED
    GPT2_LR GPT2_MIN_LR GPT2_MAX_ITERS GPT2_WARMUP_ITERS GPT2_WEIGHT_DECAY GPT2_GRAD_CLIP
    GPT2_BETA1 GPT2_BETA2 GPT2_ADAM_EPS GPT2_MAX_TIME GPT2_LOG_INTERVAL
    VIT_LR VIT_MIN_LR VIT_EPOCHS VIT_WARMUP_ITERS VIT_WEIGHT_DECAY VIT_GRAD_CLIP VIT_BETA1 VIT_BETA2 VIT_ADAM_EPS
    VIT_MAX_TIME VIT_LOG_INTERVAL
    SEQ2SEQ_LR SEQ2SEQ_EPOCHS SEQ2SEQ_WARMUP_ITERS SEQ2SEQ_WEIGHT_DECAY SEQ2SEQ_GRAD_CLIP SEQ2SEQ_TASKS SEQ2SEQ_SEEDS
    SEQ2SEQ_BETA1 SEQ2SEQ_BETA2 SEQ2SEQ_ADAM_EPS SEQ2SEQ_MAX_TIME SEQ2SEQ_LOG_INTERVAL
""".split()

NAME_RE = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_.-]*$")
PATH_RE = re.compile(r"^[A-Za-z0-9_./+,@:][A-Za-z0-9_./+,@:-]*$")
GLOB_RE = re.compile(r"^[A-Za-z0-9_.+,@:*?\[\]][A-Za-z0-9_./+,@:*?\[\]-]*$")
LIST_RE = re.compile(r"^[A-Za-z0-9_.,+ -]*$")
GRID_RE = re.compile(r"^[A-Za-z0-9_.+=,;: -]*$")
URL_RE = re.compile(r"^https?://[A-Za-z0-9.:\[\]-]+(/[A-Za-z0-9_./~%+-]*)?$")
PATH_MAX = 1024
NAME_CHARS = "letters, digits, '-', '_' and '.', not starting with '-', and not '.' or '..'"
PATH_CHARS = "letters, digits and / . _ - + , @ :, not starting with '-'"
KINDS_HINT = "docs/build.md, \"String symbols\", says what each string symbol may hold"


class ConfigError(Exception):
    pass


def load_kconfig():
    kconf = kconfiglib.Kconfig(KCONFIG, warn_to_stderr=False)
    kconf.warn_assign_undef = True
    kconf.warn_assign_override = False
    kconf.warn_assign_redun = False
    return kconf


def parse_assignments(path):
    """Returns [(lineno, name, value)] for assignment lines and 'is not set' comments."""
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\n")
            m = re.match(r"^CONFIG_([A-Za-z0-9_]+)=(.*)$", line)
            if m:
                val = m.group(2)
                if val.startswith('"'):
                    if len(val) < 2 or not val.endswith('"'):
                        raise ConfigError(f"{path}:{lineno}: CONFIG_{m.group(1)}: malformed string value {val} "
                                          "(hint: strings are written \"...\" with \\\" and \\\\ escapes)")
                    val = kconfiglib.unescape(val[1:-1])
                out.append((lineno, m.group(1), val))
                continue
            m = re.match(r"^# CONFIG_([A-Za-z0-9_]+) is not set$", line)
            if m:
                out.append((lineno, m.group(1), "n"))
                continue
            if line.strip() and not line.lstrip().startswith("#"):
                raise ConfigError(f"{path}:{lineno}: not an assignment (CONFIG_ prefix, name, =, value): {line!r}")
    return out


RANGE_WARNING = re.compile(r"user value (\S+) on the (?:int|hex) symbol (\w+) .*outside the active range \(\[(.*)\]\)")


def load_strict(kconf, path, replace, check_values=True):
    """Loads path into kconf; any warning or an assignment that did not take is an error."""
    assignments = parse_assignments(path)
    for lineno, name, _ in assignments:
        if name not in kconf.syms or not kconf.syms[name].nodes:
            raise ConfigError(f"{path}:{lineno}: unknown symbol CONFIG_{name} "
                              "(hint: `make menuconfig` shows every symbol; search with '/')")
    del kconf.warnings[:]
    kconf.load_config(path, replace=replace)
    # kconfiglib finds an int or hex value outside its range only when it evaluates the symbol, and then warns and
    # falls back on the default: a hand-edited .config (make reads it with check_values=False) would have run with
    # the default. Evaluating the assigned symbols now makes that warning an error here.
    line_of = {name: lineno for lineno, name, _ in assignments}
    for name in line_of:
        kconf.syms[name].str_value
    for w in kconf.warnings:
        m = RANGE_WARNING.search(w)
        if m and m.group(2) in line_of:
            raise ConfigError(f"{path}:{line_of[m.group(2)]}: CONFIG_{m.group(2)}={m.group(1)} is outside its "
                              f"range {m.group(3).replace(', ', '..')} (hint: `make menuconfig` shows the range in "
                              "the symbol's help; scripts/config NAME=VALUE checks a value as it sets it)")
        raise ConfigError(f"{path}: {re.sub(r'^warning: ', '', w.strip())}")
    if check_values:
        check_took_effect(kconf, path, assignments)
    return assignments


def check_took_effect(kconf, path, assignments):
    for lineno, name, want in assignments:
        sym = kconf.syms[name]
        got = sym.str_value
        if sym.orig_type in (kconfiglib.BOOL, kconfiglib.TRISTATE):
            want = want if want in ("y", "m", "n") else want
        if sym.orig_type == kconfiglib.INT and got and want:
            try:
                same = int(got, 0) == int(want, 0)
            except ValueError:
                same = False
        else:
            same = got == want
        if not same:
            why = ""
            if sym.direct_dep is not kconf.y and kconfiglib.expr_value(sym.direct_dep) == 0:
                why = f": it depends on {kconfiglib.expr_str(sym.direct_dep)}, which is not met"
            elif not sym.visibility:
                why = ": it has no prompt in this configuration, so it is derived, not set"
            elif sym.ranges:
                why = f" (allowed range: {describe_ranges(sym)})"
            raise ConfigError(f"{path}:{lineno}: CONFIG_{name}={want!r} did not take effect, "
                              f"value is {got!r}{why}")


def describe_ranges(sym):
    return ", ".join(f"{kconfiglib.expr_str(lo)}..{kconfiglib.expr_str(hi)}" for lo, hi, _ in sym.ranges)


def is_numeric_string_symbol(sym):
    """A string symbol whose default is a number holds a number (our float options)."""
    if sym.orig_type != kconfiglib.STRING:
        return False
    for default, _cond in sym.defaults:
        if isinstance(default, kconfiglib.Symbol) and default.is_constant:
            return bool(NUMBER_RE.match(default.name))
    return False


def check_name(value):
    if not NAME_RE.match(value) or value in (".", ".."):
        return f"must be a name of {NAME_CHARS} (hint: e.g. run1; {KINDS_HINT})"
    return None


def check_path(value):
    if not value:
        return "must not be empty (hint: a folder relative to the repository root, or an absolute path)"
    if len(value) > PATH_MAX or not PATH_RE.match(value):
        return f"must be a path of at most {PATH_MAX} characters: {PATH_CHARS} (hint: {KINDS_HINT})"
    return None


def check_folder(value):
    """A folder kvlab writes into (outputs, data): a path, and none of the repository's own folders."""
    problem = check_path(value)
    if problem:
        return problem
    where = os.path.normpath(os.path.join(REPO, value))
    if where == REPO:
        return "is the repository root (hint: give the files a folder of their own, e.g. 'output', or an absolute path)"
    for tree in ("build", "build-san", "include"):
        if where == os.path.join(REPO, tree) or where.startswith(os.path.join(REPO, tree) + os.sep):
            return f"lies in the repository's {tree}/ folder, which make clean and mrproper remove (hint: 'output', " \
                   "or an absolute path)"
    return None


def check_glob(value):
    if not value or len(value) > PATH_MAX or not GLOB_RE.match(value):
        return (f"must be a file pattern relative to the data folder: {PATH_CHARS} and * ? [ ], not starting with '/' "
                f"(hint: e.g. tinyshakespeare/tiny_shakespeare_train_*.bin; {KINDS_HINT})")
    return None


STRING_CHECKS = {
    "name": check_name,
    "names": lambda v: None,  # each step name is checked by check_values (with the step's own message)
    "name-or-empty": lambda v: check_name(v) if v else None,
    "folder": check_folder,
    "path": check_path,
    "path-or-empty": lambda v: check_path(v) if v else None,
    "glob": check_glob,
    "list": lambda v: None if LIST_RE.match(v) else f"must be a comma-separated list of letters, digits, '.', '_', "
                                                    f"'+' and '-' (hint: e.g. 1,2; {KINDS_HINT})",
    "url": lambda v: None if URL_RE.match(v) else "must be an http:// or https:// address: host, optional port, path of "
                                                  f"letters, digits and . _ ~ % + - / (hint: e.g. https://api.wandb.ai; "
                                                  f"{KINDS_HINT})",
    "project": lambda v: f"must be at most 128 characters, none of / \\ # ? % : (hint: {KINDS_HINT})" if len(v) > 128
                         or any(c in v for c in "/\\#?%:") else None,
    "text": lambda v: None,  # free text, only ever passed as data
    "grid": lambda v: None if GRID_RE.match(v) else "must be SYMBOL=value,value;SYMBOL:SYMBOL=a:b,c:d of letters, "
                                                    f"digits and . _ + - (hint: e.g. SEQ2SEQ_DIM=32,64;SEQ2SEQ_LR=1e-3,1e-2; "
                                                    f"{KINDS_HINT})",
}


def check_values(kconf, origin):
    """Checks the values that Kconfig itself cannot type-check."""
    for sym in kconf.unique_defined_syms:
        if not sym.config_string or sym.orig_type != kconfiglib.STRING:
            continue
        if is_numeric_string_symbol(sym):
            if not NUMBER_RE.match(sym.str_value):
                raise ConfigError(f"{origin}: CONFIG_{sym.name}={sym.str_value!r} is not a number "
                                  "(hint: write it like 0.1, 6e-4 or 1)")
            continue
        # an unlisted string symbol gets the strictest useful kind until check-symbols has it classified
        problem = STRING_CHECKS[STRING_KINDS.get(sym.name, "path")](sym.str_value)
        if problem:
            raise ConfigError(f"{origin}: CONFIG_{sym.name}={sym.str_value!r} {problem}")
    check_kv_heads(kconf, origin)
    sym = kconf.syms.get("ABLATION_STEPS")
    if sym is not None and sym.config_string:
        for step in step_names(kconf):
            if check_name(step) or step == "base":
                raise ConfigError(f"{origin}: CONFIG_ABLATION_STEPS: step name {step!r} must use only {NAME_CHARS}, "
                                  f"and 'base' is reserved (hint: e.g. \"V0,V1\"; {KINDS_HINT})")


# The width and head count of each model family, next to the symbol that enables it: ATTN_KV_HEADS must divide
# each head count, and their quotient is the head dim (attn_head_dim_header).
FAMILY_SHAPES = {"GPT2": ("GPT2_N_EMBD", "GPT2_N_HEAD"), "VIT": ("VIT_DIM", "VIT_HEADS"),
                 "SEQ2SEQ": ("SEQ2SEQ_DIM", "SEQ2SEQ_HEADS")}
FAMILY_HEADS = {family: heads for family, (_, heads) in FAMILY_SHAPES.items()}


def attn_head_dim_header(kconf):
    """generated/attn_head_dim.h: the head dim of the configured families (width / heads), so that kernels/ gets a
    constant trip count for its loops over it without knowing the families; 0 when none is configured or two
    differ (a runtime count for all)."""
    dims = {int(kconf.syms[w].str_value, 0) // int(kconf.syms[h].str_value, 0)
            for family, (w, h) in FAMILY_SHAPES.items() if kconf.syms[family].str_value == "y"}
    hd = dims.pop() if len(dims) == 1 else 0
    return ("/* Generated by scripts/kconfig.py: the configured families' head dim (0: none, or they differ). */\n"
            f"#define KVLAB_ATTN_HEAD_DIM {hd}\n")


def check_kv_heads(kconf, origin):
    """Grouped K/V heads (kernels/Kconfig, ATTN_KV_HEADS): G > 0 must divide the heads of every configured family,
    a relation between two int symbols that Kconfig's ranges cannot express."""
    sym = kconf.syms.get("ATTN_KV_HEADS")
    if sym is None or not sym.config_string or int(sym.str_value or "0", 0) == 0:
        return
    g = int(sym.str_value, 0)
    for family, heads in FAMILY_HEADS.items():
        if kconf.syms[family].str_value != "y":
            continue
        h = int(kconf.syms[heads].str_value, 0)
        if h % g:
            raise ConfigError(f"{origin}: CONFIG_ATTN_KV_HEADS={g} does not divide CONFIG_{heads}={h} (hint: the "
                              f"K/V heads must divide the query heads: 0 for one per query head, 1 for MQA, or a "
                              f"divisor of {h})")


def step_names(kconf):
    if kconf.syms["ABLATION"].str_value != "y":
        return ["base"]
    steps = [s.strip() for s in kconf.syms["ABLATION_STEPS"].str_value.split(",")]
    if not steps or any(not s for s in steps):
        raise ConfigError("CONFIG_ABLATION_STEPS: empty step name (hint: write steps like \"V0,V1\")")
    if len(set(steps)) != len(steps):
        raise ConfigError(f"CONFIG_ABLATION_STEPS: repeated step name in {','.join(steps)}")
    return steps


def write_config(kconf, path):
    """Writes a full configuration; kconfiglib leaves the file untouched when nothing changed,
    which keeps make's timestamps honest."""
    kconf.write_config(path, header=HEADER, save_old=False)


def resolved_json(kconf):
    out = {}
    for sym in kconf.unique_defined_syms:
        if not sym.config_string:
            continue
        v = sym.str_value
        if sym.orig_type in (kconfiglib.BOOL, kconfiglib.TRISTATE):
            out[sym.name] = v != "n"
        elif sym.orig_type in (kconfiglib.INT, kconfiglib.HEX):
            out[sym.name] = int(v, 0)
        else:
            out[sym.name] = v
    return out


def write_if_changed(path, text):
    try:
        with open(path, encoding="utf-8") as f:
            if f.read() == text:
                return
    except FileNotFoundError:
        pass
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def c_string(text):
    """A C string literal of text; '?' as \\? so that no ??x trigraph (gcc -std=c11 converts them) can end it."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("?", "\\?") + '"'


def runtime_symbols(kconf):
    """The run-time symbols active in this configuration (the others are off, their value never matters)."""
    return [kconf.syms[n] for n in RUNTIME if kconf.syms[n].config_string]


def autoconf_text(kconf, header):
    """kconfiglib's autoconf.h, with '?' in string values written \\? (see c_string): free-text values
    such as the sample prompt reach the compiler as data whatever they hold. A run-time symbol's CONFIG_ name
    reads its value through lib/runconfig.c (its compiled value is in runtime_config.h, runtime_header)."""
    out = []
    for line in kconf._autoconf_contents(header).splitlines(True):
        m = re.match(r'^(#define CONFIG_(\w+) )(.*)$', line.rstrip("\n"))
        if m and m.group(2) in RUNTIME:
            getter = "str" if kconf.syms[m.group(2)].orig_type == kconfiglib.STRING else "int"
            line = f'{m.group(1)}kconfig_runtime_{getter}("{m.group(2)}")\n'
        elif m and m.group(3).startswith('"'):
            line = m.group(1) + m.group(3).replace("?", "\\?") + "\n"
        out.append(line)
    # by name, not by an index: an object that names a symbol is rebuilt when its value changes (scripts/fixdep.py),
    # not when other symbols come and go, so nothing it compiled in may depend on the set of active symbols
    out.append("/* Run-time symbols (scripts/kconfig.py RUNTIME; lib/runconfig.h): read when the binary runs. */\n"
               "int kconfig_runtime_int(const char *name);\n"
               "const char *kconfig_runtime_str(const char *name);\n")
    out.append(inactive_defaults(kconf))
    return "".join(out)


def runtime_header(kconf):
    """generated/runtime_config.h: one line per active run-time symbol: its name, compiled value and what it may hold
    (int range; a string holding a number; a list)."""
    lines = ["/* Generated by scripts/kconfig.py: do not edit. The compiled values of the run-time symbols\n"
             " * (lib/runconfig.c includes this once per table it builds). */\n"]
    for s in runtime_symbols(kconf):
        if s.orig_type == kconfiglib.INT:
            rng = next(((int(lo.str_value, 0), int(hi.str_value, 0)) for lo, hi, cond in s.ranges
                        if kconfiglib.expr_value(cond)), (-2147483647 - 1, 2147483647))
            lines.append(f"KCONFIG_RUNTIME_INT({s.name}, {int(s.str_value, 0)}, {rng[0]}, {rng[1]})\n")
        else:
            kind = "NUMBER" if is_numeric_string_symbol(s) else "LIST"
            lines.append(f"KCONFIG_RUNTIME_{kind}({s.name}, {c_string(s.str_value)})\n")
    return "".join(lines)


def inactive_defaults(kconf):
    """#defines for the value symbols (int, hex, string) that are off in this configuration because a menu or
    choice they depend on is: their Kconfig default. Code can then name them in a branch on that menu's
    IS_ENABLED() that folds away, without a copy of the default or an #ifdef; their value never matters."""
    lines = []
    for sym in kconf.unique_defined_syms:
        if sym.orig_type not in (kconfiglib.INT, kconfiglib.HEX, kconfiglib.STRING) or sym.config_string:
            continue
        active = [d for d, cond in sym.defaults if kconfiglib.expr_value(cond)]
        chosen = (active or [d for d, _ in sym.defaults] or [None])[0]
        value = chosen.str_value if isinstance(chosen, kconfiglib.Symbol) else ""
        if sym.orig_type == kconfiglib.STRING:
            value = c_string(value)
        elif not value:
            value = "0"
        lines.append(f"#define CONFIG_{sym.name} {value}\n")
    if not lines:
        return ""
    return ("/* Off in this configuration (a menu or choice they depend on is off): their Kconfig defaults, for\n"
            " * branches that fold away. */\n" + "".join(lines))


# ---------------------------------------------------------------- commands

def cmd_defconfig(defconfig, out):
    kconf = load_kconfig()
    load_strict(kconf, defconfig, replace=True)
    check_values(kconf, defconfig)
    write_config(kconf, out)
    print(f"{out}: written from {defconfig}")


def cmd_merge(out, base, *fragments):
    kconf = load_kconfig()
    load_strict(kconf, base, replace=True, check_values=False)
    for frag in fragments:
        if not os.path.isfile(frag):
            raise ConfigError(f"{frag}: step fragment not found (hint: create it with the CONFIG_ lines "
                              "of this step, see defconfigs/steps/)")
        load_strict(kconf, frag, replace=False)
    check_values(kconf, " + ".join((base,) + fragments))
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    write_config(kconf, out)


def cmd_set(config, *assignments):
    kconf = load_kconfig()
    load_strict(kconf, config, replace=True, check_values=False)
    lines = []
    for a in assignments:
        name, eq, value = a.partition("=")
        name = name[7:] if name.startswith("CONFIG_") else name
        if not eq:
            raise ConfigError(f"{a}: expected NAME=VALUE")
        sym = kconf.syms.get(name)
        if sym is None or not sym.nodes:
            raise ConfigError(f"unknown symbol CONFIG_{name} (hint: `make menuconfig` shows every symbol; "
                              "search with '/')")
        if sym.orig_type == kconfiglib.STRING:
            value = '"' + kconfiglib.escape(value) + '"'
        lines.append(f"CONFIG_{name}={value}\n")
    tmp = config + ".set"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(lines)
    try:
        load_strict(kconf, tmp, replace=False)
    except ConfigError as e:
        raise ConfigError(str(e).replace(tmp, "scripts/config"))
    finally:
        os.remove(tmp)
    check_values(kconf, config)
    write_config(kconf, config)
    for a in assignments:
        print(f"{config}: {a}")


def cmd_olddefconfig(config):
    kconf = load_kconfig()
    kconf.load_config(config)
    for w in kconf.warnings:
        print(f"warning: {config}: {w.strip()}", file=sys.stderr)
    check_values(kconf, config)
    write_config(kconf, config)


def cmd_savedefconfig(config, out):
    kconf = load_kconfig()
    load_strict(kconf, config, replace=True, check_values=False)
    kconf.write_min_config(out)
    print(f"{out}: minimal configuration written")


def cmd_genconfig(config, outdir):
    kconf = load_kconfig()
    load_strict(kconf, config, replace=True, check_values=False)
    check_values(kconf, config)
    gen = os.path.join(outdir, "include", "generated")
    deps = os.path.join(outdir, "include", "config")
    os.makedirs(gen, exist_ok=True)
    write_if_changed(os.path.join(gen, "autoconf.h"),
                     autoconf_text(kconf, "/* Generated from " + config + " by scripts/kconfig.py: do not edit. */\n"))
    write_if_changed(os.path.join(gen, "runtime_config.h"), runtime_header(kconf))
    write_if_changed(os.path.join(gen, "attn_head_dim.h"), attn_head_dim_header(kconf))
    resolved = resolved_json(kconf)
    text = json.dumps(resolved, indent=1, sort_keys=True) + "\n"
    write_if_changed(os.path.join(gen, "config.json"), text)
    # The resolved configuration compiled into the binaries, so every checkpoint and metrics
    # file records exactly what ran (like the kernel's IKCONFIG).
    compact = json.dumps(resolved, sort_keys=True, separators=(",", ":"))
    write_if_changed(os.path.join(gen, "config_data.h"),
                     "/* Generated by scripts/kconfig.py: do not edit. */\n"
                     f"#define KVLAB_CONFIG_JSON {c_string(compact)}\n")
    kconf.sync_deps(deps)


def cmd_step(outdir, base, *fragments):
    """Resolves one ablation step (base + fragments) into outdir/.config and generates its headers."""
    cmd_merge(os.path.join(outdir, ".config"), base, *fragments)
    cmd_genconfig(os.path.join(outdir, ".config"), outdir)


def cmd_steps(config):
    kconf = load_kconfig()
    load_strict(kconf, config, replace=True, check_values=False)
    for s in step_names(kconf):
        print(s)


def defconfig_files():
    return sorted(p for p in glob.glob("defconfigs/*") if os.path.isfile(p))


def defconfig_description(path):
    with open(path, encoding="utf-8") as f:
        first = f.readline().strip()
    return first.lstrip("#").strip() if first.startswith("#") else ""


def cmd_list_defconfigs():
    for p in defconfig_files():
        print(f"{os.path.basename(p)}\t{defconfig_description(p)}")


SOURCE_GLOBS = ["**/*.c", "**/*.h", "**/*.cu", "**/*.cuh", "**/*.py", "**/*.sh", "**/Makefile*",
                "scripts/*"]


def kconfig_references(kconf):
    """Symbols that other Kconfig entries read: presets in defaults, dependencies, ranges, selects."""
    refs = {}
    for node in kconf.node_iter():
        item = node.item
        exprs = [node.dep]
        if isinstance(item, (kconfiglib.Symbol, kconfiglib.Choice)):
            exprs += [e for d in item.defaults for e in d]
        if isinstance(item, kconfiglib.Symbol):
            exprs += [e for r in item.ranges for e in r] + [e for s in item.selects for e in s]
        owner = getattr(item, "name", None)
        for e in exprs:
            for s in kconfiglib.expr_items(e):
                if isinstance(s, kconfiglib.Symbol) and s.nodes and s.name != owner:
                    refs.setdefault(s.name, set()).add(f"Kconfig ({owner or 'menu'})")
    return refs


def cmd_check_symbols():
    kconf = load_kconfig()
    defined = {s.name for s in kconf.unique_defined_syms}
    choices = {s.name for c in kconf.unique_choices for s in c.syms}
    used = {}
    files = set()
    for g in SOURCE_GLOBS:
        files.update(p for p in glob.glob(g, recursive=True)
                     if os.path.isfile(p) and not p.startswith(("build", "output", "data", "include/generated")))
    for p in sorted(files):
        with open(p, encoding="utf-8", errors="replace") as f:
            text = f.read()
        for name in re.findall(r"\bCONFIG_([A-Z0-9][A-Z0-9_]*)", text):
            used.setdefault(name, set()).add(p)
        if p.endswith(".py"):  # Python reads the resolved config.json, whose keys have no prefix
            for name in re.findall(r"[\"']([A-Z][A-Z0-9_]+)[\"']", text):
                if name in defined:
                    used.setdefault(name, set()).add(p)
    for name, where in kconfig_references(kconf).items():
        used.setdefault(name, set()).update(where)
    problems = []
    # the attention-variant table selects variants by Kconfig symbol: its symbols are used, must exist, and
    # every member of the variant choice must have a row
    import attention_tbl
    table = os.path.relpath(attention_tbl.TABLE)
    try:
        table_syms = ([r["kconfig"] for r in attention_tbl.variants()] + [m["kconfig"] for m in attention_tbl.modifiers()] +
                      [p["kconfig"] for p in attention_tbl.positions()])
    except (attention_tbl.TableError, OSError) as e:
        table_syms = []
        problems.append(str(e))
    for name in table_syms:
        used.setdefault(name, set()).add(table)
    for choice in kconf.unique_choices:
        members = [sym.name for sym in choice.syms]
        if any(name in members for name in table_syms):
            for name in members:
                if name not in table_syms:
                    problems.append(f"CONFIG_{name} is an attention variant in Kconfig but has no row in {table}")
    for name, where in sorted(used.items()):
        if name not in defined:
            problems.append(f"CONFIG_{name} is used in {', '.join(sorted(where))} but not defined in Kconfig")
    for sym in kconf.unique_defined_syms:
        if not any(node.help for node in sym.nodes):
            problems.append(f"CONFIG_{sym.name} has no help text")
    for sym in kconf.unique_defined_syms:
        if sym.orig_type == kconfiglib.STRING and not is_numeric_string_symbol(sym) and sym.name not in STRING_KINDS:
            problems.append(f"CONFIG_{sym.name} is a string symbol without a kind in STRING_KINDS of scripts/kconfig.py "
                            "(what its value may hold)")
    for name, kind in sorted(STRING_KINDS.items()):
        if name not in defined or kconf.syms[name].orig_type != kconfiglib.STRING or kind not in STRING_CHECKS:
            problems.append(f"STRING_KINDS in scripts/kconfig.py: {name} {kind}: not a string symbol or not a kind")
    for name in RUNTIME:  # a run-time value cannot be read where a constant is needed
        for p in sorted(used.get(name, ())):
            if not os.path.isfile(p):
                continue
            with open(p, encoding="utf-8", errors="replace") as f:
                text = f.read()
            if os.path.basename(p).startswith("Makefile") or re.search(
                    r"^\s*#\s*(el)?if.*\bCONFIG_" + name + r"\b|\[[^\]\n]*\bCONFIG_" + name + r"\b[^\]\n]*\]", text, re.M):
                problems.append(f"RUNTIME in scripts/kconfig.py: CONFIG_{name} is read in {p} in a Makefile, an #if "
                                "or an array size, where its run-time value cannot reach (hint: drop it from RUNTIME)")
        sym = kconf.syms.get(name)
        if sym is None or not sym.nodes or not (sym.orig_type == kconfiglib.INT or is_numeric_string_symbol(sym) or
                                                STRING_KINDS.get(name) == "list"):
            problems.append(f"RUNTIME in scripts/kconfig.py: {name}: not an int, number or list symbol")
    for choice in kconf.unique_choices:
        if not any(node.help for node in choice.nodes):
            problems.append(f"choice '{choice.nodes[0].prompt[0]}' has no help text")
    for name in sorted(defined):
        # A choice member is consumed when any code tests it; plain symbols must be read somewhere.
        if name not in used:
            problems.append(f"CONFIG_{name} is defined in Kconfig but nothing uses it"
                            + (" (choice member)" if name in choices else ""))
    for p in defconfig_files() + sorted(glob.glob("defconfigs/steps/*")):
        for lineno, name, _ in parse_assignments(p):
            if name not in defined:
                problems.append(f"{p}:{lineno}: unknown symbol CONFIG_{name}")
    for line in problems:
        print(line)
    if problems:
        raise ConfigError(f"{len(problems)} Kconfig consistency problem(s)")
    print(f"Kconfig consistency: {len(defined)} symbols defined, all used and documented; "
          f"{len(used)} names referenced, all defined")


COMMANDS = {
    "defconfig": (cmd_defconfig, 2),
    "merge": (cmd_merge, -3),
    "set": (cmd_set, -2),
    "olddefconfig": (cmd_olddefconfig, 1),
    "savedefconfig": (cmd_savedefconfig, 2),
    "genconfig": (cmd_genconfig, 2),
    "step": (cmd_step, -2),
    "steps": (cmd_steps, 1),
    "list-defconfigs": (cmd_list_defconfigs, 0),
    "check-symbols": (cmd_check_symbols, 0),
}


def main(argv):
    if len(argv) < 2 or argv[1] not in COMMANDS:
        sys.stderr.write(__doc__)
        return 2
    fn, nargs = COMMANDS[argv[1]]
    args = argv[2:]
    if (nargs >= 0 and len(args) != nargs) or (nargs < 0 and len(args) < -nargs):
        sys.stderr.write(__doc__)
        return 2
    try:
        fn(*args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except kconfiglib.KconfigError as e:
        print(f"error: Kconfig: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"error: {e.filename}: {e.strerror}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
