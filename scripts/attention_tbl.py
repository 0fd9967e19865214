#!/usr/bin/python3
"""Reader of kernels/attention.tbl, the table of attention variants, and the
generator of its C header.

As a module (run_steps.py, bench.py, mechint.py, the tests):
    import attention_tbl
    attention_tbl.variants()            # rows in table order, each a dict
    attention_tbl.for_config(cfg)       # the row a resolved config.json selects
    attention_tbl.positions()           # the position schemes, in table order
    attention_tbl.label(cfg)            # "KV tying+Pos", "KV+RoPE", ...
    attention_tbl.name(cfg)             # "kv_tying_pos", "kv_rope", ...

As a program (scripts/Makefile.build):
    scripts/attention_tbl.py --header OUT    write the C header (only when it changes)
"""
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLE = os.path.join(REPO, "kernels", "attention.tbl")
COLUMNS = ["id", "kconfig", "name", "label", "blocks", "query", "key", "value", "roles"]
MOD_COLUMNS = ["kconfig", "name", "label"]
POS_COLUMNS = ["kconfig", "name", "label", "where", "symmetric"]
POS_WHERE = ("embedding", "rotary", "bias")
KV_COLUMNS = ["kconfig", "mqa_name", "mqa_label", "gqa_name", "gqa_label"]


class TableError(Exception):
    pass


def _parse(path=TABLE):
    rows, mods, positions, kv = [], [], [], []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            cells = [c.strip() for c in text.split("|")]
            where = f"{path}:{lineno}"
            if cells[0] == "@modifier":
                if len(cells) != 1 + len(MOD_COLUMNS):
                    raise TableError(f"{where}: a modifier has {len(MOD_COLUMNS)} columns after @modifier")
                mods.append(dict(zip(MOD_COLUMNS, cells[1:])))
                continue
            if cells[0] == "@kv_heads":
                if len(cells) != 1 + len(KV_COLUMNS) or kv:
                    raise TableError(f"{where}: one @kv_heads row of {len(KV_COLUMNS)} columns ({' | '.join(KV_COLUMNS)})")
                kv.append(dict(zip(KV_COLUMNS, cells[1:])))
                continue
            if cells[0] == "@position":
                if len(cells) != 1 + len(POS_COLUMNS):
                    raise TableError(f"{where}: a position scheme has {len(POS_COLUMNS)} columns after @position "
                                     f"({' | '.join(POS_COLUMNS)})")
                pos = dict(zip(POS_COLUMNS, cells[1:]))
                for key in ("name", "label"):
                    pos[key] = "" if pos[key] == "-" else pos[key]
                if pos["where"] not in POS_WHERE:
                    raise TableError(f"{where}: where '{pos['where']}' is not one of {', '.join(POS_WHERE)}")
                if pos["symmetric"] not in ("yes", "no"):
                    raise TableError(f"{where}: symmetric is yes or no, not '{pos['symmetric']}'")
                pos["symmetric"] = pos["symmetric"] == "yes"
                pos["index"] = len(positions)
                positions.append(pos)
                continue
            if len(cells) != len(COLUMNS):
                raise TableError(f"{where}: {len(cells)} columns, expected {len(COLUMNS)} ({' | '.join(COLUMNS)})")
            row = dict(zip(COLUMNS, cells))
            row["blocks"] = row["blocks"].split()
            for role in ("query", "key", "value"):
                if row[role] not in row["blocks"]:
                    raise TableError(f"{where}: {role} block '{row[role]}' is not one of the blocks {row['blocks']}")
            if len(set(row["blocks"])) != len(row["blocks"]) or not 1 <= len(row["blocks"]) <= 3:
                raise TableError(f"{where}: blocks must be 1 to 3 distinct names")
            used = {row["query"], row["key"], row["value"]}
            if used != set(row["blocks"]):
                raise TableError(f"{where}: block(s) {sorted(set(row['blocks']) - used)} play no role")
            row["index"] = len(rows)
            row["nproj"] = len(row["blocks"])
            row["query_block"] = row["blocks"].index(row["query"])
            row["key_block"] = row["blocks"].index(row["key"])
            row["value_block"] = row["blocks"].index(row["value"])
            row["symmetric"] = row["query"] == row["key"]
            row["cache_tensors"] = 1 if row["key"] == row["value"] else 2
            rows.append(row)
    if not rows:
        raise TableError(f"{path}: no variants")
    for key in ("id", "kconfig", "name", "label"):
        seen = [r[key] for r in rows]
        if len(set(seen)) != len(seen):
            raise TableError(f"{path}: column {key} repeats a value: {seen}")
    if not positions or positions[0]["name"] or positions[0]["label"]:
        raise TableError(f"{path}: the first position scheme is the default and appends nothing ('-')")
    for key in ("kconfig", "name", "label"):
        seen = [p[key] for p in positions]
        if len(set(seen)) != len(seen):
            raise TableError(f"{path}: position column {key} repeats a value: {seen}")
    if len(kv) != 1:
        raise TableError(f"{path}: no @kv_heads row")
    return rows, mods, positions, kv[0]


_CACHE = {}


def variants():
    """The rows in table order (index = the C constant's value)."""
    if "rows" not in _CACHE:
        _CACHE["rows"], _CACHE["mods"], _CACHE["positions"], _CACHE["kv"] = _parse()
    return _CACHE["rows"]


def modifiers():
    variants()
    return _CACHE["mods"]


def positions():
    """The position schemes in table order (index = the C constant ATTN_POSITION_<kconfig minus POSITION_>)."""
    variants()
    return _CACHE["positions"]


def kv_heads_row():
    variants()
    return _CACHE["kv"]


def kv_heads_suffix(cfg, column):
    """What CONFIG_ATTN_KV_HEADS appends to a name ("name") or label ("label"): "_mqa", "+GQA2", or ""."""
    g = int(cfg.get(kv_heads_row()["kconfig"]) or 0)
    if g <= 0:
        return ""
    return kv_heads_row()["mqa_" + column] if g == 1 else kv_heads_row()["gqa_" + column].replace("%d", str(g))


def position_for_config(cfg):
    """The position scheme a resolved configuration selects (the first row when none is set: configurations
    from before the choice existed)."""
    chosen = [p for p in positions() if cfg.get(p["kconfig"])]
    return chosen[0] if chosen else positions()[0]


def for_config(cfg):
    """The row selected by a resolved configuration (config.json: symbol -> value, no CONFIG_ prefix).
    A later row's symbol refines an earlier one's, as in the generated C selection."""
    chosen = None
    for row in variants():
        if cfg.get(row["kconfig"]):
            chosen = row
    if chosen is None:
        raise TableError("the configuration selects no attention variant of kernels/attention.tbl")
    return chosen


def _with_modifiers(cfg, column):
    return (for_config(cfg)[column] + kv_heads_suffix(cfg, column) +
            "".join(m[column] for m in modifiers() if cfg.get(m["kconfig"])) + position_for_config(cfg)[column])


def label(cfg):
    return _with_modifiers(cfg, "label")


def name(cfg):
    return _with_modifiers(cfg, "name")


def _c_string(s):
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def header():
    rows, mods = variants(), modifiers()
    out = ["/* Generated from kernels/attention.tbl by scripts/attention_tbl.py: do not edit. */",
           "#ifndef KVLAB_ATTN_VARIANTS_H", "#define KVLAB_ATTN_VARIANTS_H", "",
           "enum {"]
    out += [f"    ATTN_{r['id']} = {r['index']}," for r in rows]
    out += [f"    ATTN_NUM_VARIANTS = {len(rows)}", "};", ""]
    # selection: the last row whose symbol is set wins (refining symbols come later)
    sel = "-1"
    for r in rows:
        sel = f"(IS_ENABLED(CONFIG_{r['kconfig']}) ? ATTN_{r['id']} : {sel})"
    out += ["/* The variant the configuration selects (-1: none). */", f"#define ATTN_VARIANT_SELECTED {sel}", ""]
    out += ["/* Rows of AttnVariantInfo (kernels/attention.h), in table order. */", "#define ATTN_VARIANT_ROWS \\"]
    for r in rows:
        blocks = ", ".join(_c_string(b) for b in r["blocks"])
        out.append(f"    {{.id = ATTN_{r['id']}, .name = {_c_string(r['name'])}, .label = {_c_string(r['label'])}, "
                   f".nproj = {r['nproj']}, .blocks = {{{blocks}}}, .query = {r['query_block']}, "
                   f".key = {r['key_block']}, .value = {r['value_block']}, .roles = {_c_string(r['roles'])}, "
                   f".kconfig = {_c_string('CONFIG_' + r['kconfig'])}}}, \\")
    out += ["", ""]
    for m in mods:
        sym = m["kconfig"]
        out += [f"#define {sym}_NAME_SUFFIX {_c_string(m['name'])}", f"#define {sym}_LABEL_SUFFIX {_c_string(m['label'])}"]
    kv = kv_heads_row()
    out += ["", "/* What grouped K/V heads append to names and labels (printf formats take G). */"]
    out += [f"#define ATTN_KV_HEADS_{k.upper()} {_c_string(kv[k])}" for k in KV_COLUMNS[1:]]
    pos = positions()
    out += ["", "/* Position schemes (the @position rows), where each acts. */",
            "enum { " + ", ".join(f"ATTN_PE_{w.upper()}" for w in POS_WHERE) + " };", "enum {"]
    out += [f"    ATTN_{p['kconfig']} = {p['index']}," for p in pos]
    out += [f"    ATTN_NUM_POSITIONS = {len(pos)}", "};"]
    sel = "-1"
    for p in reversed(pos):
        sel = f"(IS_ENABLED(CONFIG_{p['kconfig']}) ? ATTN_{p['kconfig']} : {sel})"
    out += ["/* The scheme the configuration selects (-1: none). */", f"#define ATTN_POSITION_SELECTED {sel}", "",
            "/* Rows of AttnPositionInfo (kernels/attention.h), in table order. */", "#define ATTN_POSITION_ROWS \\"]
    for p in pos:
        out.append(f"    {{.id = ATTN_{p['kconfig']}, .name = {_c_string(p['name'])}, .label = {_c_string(p['label'])}, "
                   f".where = ATTN_PE_{p['where'].upper()}, .symmetric = {int(p['symmetric'])}, "
                   f".kconfig = {_c_string('CONFIG_' + p['kconfig'])}}}, \\")
    out += [""]
    out += ["", "#endif", ""]
    return "\n".join(out)


def main(argv):
    if len(argv) != 3 or argv[1] != "--header":
        sys.stderr.write(__doc__)
        return 2
    try:
        text = header()
    except (TableError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    path = argv[2]
    try:
        with open(path, encoding="utf-8") as f:
            if f.read() == text:
                return 0
    except FileNotFoundError:
        pass
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(path + ".tmp", path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
