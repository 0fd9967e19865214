#!/usr/bin/python3
"""Runs a sweep: every (ablation step, grid point, seed) of the configuration, then aggregates them.

CONFIG_SWEEP is a grid over any symbols, "SYM=v1,v2;SYM2=w1,w2" (every combination is a grid point), and
CONFIG_SWEEP_SEEDS the number of seeds per point (seed k is CONFIG_SEED + k; for the synthetic seq2seq tasks,
whose jobs take their seeds from CONFIG_SEQ2SEQ_SEEDS, that list becomes the one seed). Each run has its own
resolved configuration (base + step fragment + point + seed) and its own folder,
<output>/<run>/runs/<point>/seed<N>/, holding the usual per-step files; a run already complete with the same
configuration is skipped, one that stopped continues from its checkpoint.

Builds: a run-time symbol (scripts/kconfig.py RUNTIME) is handed to the trainer as `--set NAME=VALUE`; only the
other symbols of a point are compiled in, so each step is built once per distinct build-time part of the grid
(build/<run>/<step> when the grid has none, build/<run>/<step>@<build point> otherwise).

Sharding: --shard K/N (make SHARD=K/N) runs every N-th run starting at the K-th, so N processes or machines
sharing the output folder cover every run exactly once; each writes the summary of what is complete so far.

Aggregation (sweep_summary.json, sweep_summary.md, sweep_curves.png): per step and grid point the mean, standard
deviation and n of every final metric over seeds; per step the average of the point means over the grid (as the
paper averages over its sweeps) with the pooled seed standard deviation; every single run's numbers are kept.

Called by `make` when CONFIG_SWEEP is set or CONFIG_SWEEP_SEEDS > 1 (docs/sweeps.md).
"""
import argparse
import fcntl
import itertools
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import kconfig
import run_steps
from run_steps import REPO, FAMILIES, Stop, say, load_json, write_atomic, fmt

FAMILY_PREFIXES = ("GPT2_", "VIT_", "SEQ2SEQ_")
# symbols a grid may not name: the sweep's own, the ones that say where things go, and the seed (SWEEP_SEEDS)
NOT_SWEPT = re.compile(r"^(SWEEP|SEED$|RUN_NAME$|OUTPUT_DIR$|DATA_DIR$|DATA_MIRROR$|ABLATION)")


class SweepError(Exception):
    pass


# ---------------------------------------------------------------- the grid

def parse_grid(text):
    """The axes of "SYM=v1,v2;SYM2=w1,w2" (CONFIG_ prefixes allowed, spaces around items ignored): [(names,
    [values])], names a list of symbols and each value a list of one value per name. Symbols that must change
    together are one axis, "SYM:SYM2=v1:w1,v2:w2" (a width and the MLP that is twice it). Syntax only: the values
    are checked when each point's configuration is resolved."""
    grid, seen = [], set()
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        left, eq, values = part.partition("=")
        names = [n.strip()[7:] if n.strip().startswith("CONFIG_") else n.strip() for n in left.split(":")]
        vals = [[x.strip() for x in v.split(":")] for v in values.split(",")]
        if not eq or not all(re.match(r"^[A-Z0-9_]+$", n) for n in names) or \
                not all(len(v) == len(names) and all(v) for v in vals):
            raise SweepError(f"CONFIG_SWEEP: {part!r} is not SYMBOL=value,value,... (or SYMBOL:SYMBOL=a:b,c:d for "
                             "symbols that change together) (hint: e.g. \"SEQ2SEQ_DIM:SEQ2SEQ_MLP=32:64,64:128;"
                             "SEQ2SEQ_LR=1e-3,1e-2\")")
        for name in names:
            if name in seen:
                raise SweepError(f"CONFIG_SWEEP: {name} is named twice (hint: one SYMBOL=values per symbol)")
            seen.add(name)
            if NOT_SWEPT.match(name):
                raise SweepError(f"CONFIG_SWEEP: {name} cannot be swept (hint: seeds come from CONFIG_SWEEP_SEEDS; "
                                 "steps from CONFIG_ABLATION_STEPS; where outputs go is one per run)")
        if len({tuple(v) for v in vals}) != len(vals):
            raise SweepError(f"CONFIG_SWEEP: {':'.join(names)} lists a value twice")
        grid.append((names, vals))
    return grid


def expand(grid):
    """Every grid point, the first axis varying slowest: [[(symbol, value), ...], ...] ([[]] for no grid)."""
    return [[(n, v) for (names, _), vals in zip(grid, combo) for n, v in zip(names, vals)]
            for combo in itertools.product(*[values for _, values in grid])]


def grid_text(grid):
    return "; ".join(f"{':'.join(names)} = {', '.join(':'.join(v) for v in vals)}" for names, vals in grid)


def short_name(symbol):
    for p in FAMILY_PREFIXES:
        if symbol.startswith(p):
            symbol = symbol[len(p):]
            break
    return symbol.lower()


def point_name(point):
    """A readable folder name: "dim32-enc_layers2-lr1e-3"; "default" for the empty point."""
    if not point:
        return "default"
    return "-".join(short_name(s) + re.sub(r"[^A-Za-z0-9_.+-]", "_", v) for s, v in point)


def shard(runs, k, n):
    """The K-th of N shares (1-based): every N-th run from the K-th. The shares are disjoint and cover all runs."""
    if not (1 <= k <= n):
        raise SweepError(f"SHARD={k}/{n}: K must be from 1 to N (hint: e.g. make SHARD=1/2 on one machine and "
                         "SHARD=2/2 on another)")
    return runs[k - 1::n]


def parse_shard(text):
    m = re.match(r"^(\d+)/(\d+)$", text or "")
    if not m:
        raise SweepError(f"SHARD={text}: expected K/N, e.g. 1/2")
    return int(m.group(1)), int(m.group(2))


# ---------------------------------------------------------------- planning

def fragment_text(assignments, kconf):
    lines = []
    for name, value in assignments:
        sym = kconf.syms.get(name)
        if sym is None or not sym.nodes:
            raise SweepError(f"CONFIG_SWEEP: unknown symbol CONFIG_{name} (hint: `make menuconfig` shows every symbol)")
        if sym.orig_type == kconfig.kconfiglib.STRING:
            value = '"' + kconfig.kconfiglib.escape(value) + '"'
        lines.append(f"CONFIG_{name}={value}\n")
    return "".join(lines)


def resolve(kconf, path_base, fragments, origin, work):
    """(config text, config dict) of base + fragment files, strictly checked (work: a scratch folder)."""
    try:
        kconfig.load_strict(kconf, path_base, replace=True, check_values=False)
        for f in fragments:
            kconfig.load_strict(kconf, f, replace=False)
        kconfig.check_values(kconf, origin)
    except kconfig.ConfigError as e:
        # the grid's values reach kconfig through scratch fragments in work, gone once the sweep stops: name the
        # grid instead, and the origin once (check_values puts it in front itself)
        msg = re.sub(re.escape(work) + r"/[^:\s]+(:\d+)?", "CONFIG_SWEEP", str(e))
        if not msg.startswith(origin):
            msg = f"{origin}: {msg}"
        if "(hint: " not in msg:
            msg += " (hint: each value in CONFIG_SWEEP must be one Kconfig takes for its symbol; `make menuconfig` " \
                   "shows the symbol's type and range)"
        raise SweepError(msg)
    tmp = os.path.join(work, f"resolved.tmp.{os.getpid()}")
    kconfig.write_config(kconf, tmp)
    with open(tmp, encoding="utf-8") as f:
        text = f.read()
    os.remove(tmp)
    return text, kconfig.resolved_json(kconf)


def seed_assignments(cfg, seed, point):
    """The seed of a run: CONFIG_SEED, and the synthetic tasks' seed list unless the grid sets that itself."""
    out = [("SEED", str(seed))]
    if cfg.get("SEQ2SEQ") and cfg.get("SEQ2SEQ_TASK_SYNTHETIC") and "SEQ2SEQ_SEEDS" not in dict(point):
        out.append(("SEQ2SEQ_SEEDS", str(seed)))
    return out


# Every build and run of a sweep has the sweep options off: they only say which runs exist, so growing the grid
# or the seed count changes no build and no run's configuration (which its checkpoints record and resume checks).
SWEEP_OFF = [("SWEEP", ""), ("SWEEP_SEEDS", "1")]


def plan(config, steps, steps_dir, build_root, out_root, work):
    """Every run: dict(step, point, seed, build (folder), build_fragments, out, assignments (the run-time ones),
    config text and dict). work is a scratch folder for fragment files."""
    kconf = kconfig.load_kconfig()
    os.makedirs(work, exist_ok=True)
    _base_text, base_cfg = resolve(kconf, config, [], config, work)
    grid = parse_grid(base_cfg.get("SWEEP", ""))
    seeds = [base_cfg["SEED"] + k for k in range(base_cfg.get("SWEEP_SEEDS", 1))]
    runtime = set(kconfig.RUNTIME)
    runs = []
    off = os.path.join(work, "sweep-off")
    write_atomic(off, fragment_text(SWEEP_OFF, kconf))
    for step in steps:
        step_frag = [] if step == "base" else [os.path.join(REPO, steps_dir, step)]
        if step_frag and not os.path.isfile(step_frag[0]):
            raise SweepError(f"{step_frag[0]}: step fragment not found (hint: create it with the CONFIG_ lines of "
                             "this step, see defconfigs/steps/)")
        step_frag.append(off)
        for point in expand(grid):
            build_part = [(s, v) for s, v in point if s not in runtime]
            bname = point_name(build_part) if build_part else ""
            bdir = os.path.join(build_root, step + ("@" + bname if bname else ""))
            frags = list(step_frag)
            if build_part:
                f = os.path.join(work, f"build-{step}@{bname}")
                write_atomic(f, fragment_text(build_part, kconf))
                frags.append(f)
            for seed in seeds:
                run_part = [(s, v) for s, v in point if s in runtime]
                f = os.path.join(work, f"run-{step}-{point_name(point)}-{seed}")
                probe = run_part + [("SEED", str(seed))]
                write_atomic(f, fragment_text(probe, kconf))
                _t, probe_cfg = resolve(kconf, config, frags + [f], f"step {step}, point {point_name(point)}", work)
                assigns = run_part + seed_assignments(probe_cfg, seed, point)
                write_atomic(f, fragment_text(assigns, kconf))
                text, cfg = resolve(kconf, config, frags + [f],
                                    f"step {step}, point {point_name(point)}, seed {seed}", work)
                runs.append({"step": step, "point": point, "point_name": point_name(point), "seed": seed,
                             "build": bdir, "build_fragments": frags, "assignments": assigns,
                             "out": os.path.join(out_root, "runs", point_name(point), f"seed{seed}"),
                             "config_text": text, "config": cfg})
    return runs, grid, seeds


# ---------------------------------------------------------------- building and running

def build(run, config, sanitize):
    """Builds the run's binary tree once (a lock keeps concurrent shards from building the same tree twice)."""
    bdir = run["build"]
    os.makedirs(os.path.dirname(bdir), exist_ok=True)
    with open(bdir + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        py = sys.executable
        if subprocess.call([py, os.path.join(REPO, "scripts", "kconfig.py"), "step", bdir, config] +
                           run["build_fragments"], cwd=REPO) != 0:
            return False
        return subprocess.call(["make", "-f", "scripts/Makefile.build", f"B={bdir}", f"SANITIZE={sanitize}",
                                f"-j{len(os.sched_getaffinity(0))}"], cwd=REPO) == 0


def set_args(run, build_cfg):
    """--set NAME=VALUE for every run-time symbol whose value differs from the one compiled in."""
    out = []
    for name in kconfig.RUNTIME:
        if name in run["config"] and run["config"][name] != build_cfg.get(name):
            out += ["--set", f"{name}={run['config'][name]}"]
    return out


# ---------------------------------------------------------------- aggregation

def mean_std(xs):
    """(mean, sample standard deviation or None for n < 2, n) of the finite numbers in xs; (None, None, 0) if none."""
    xs = [x for x in xs if run_steps.finite(x)]
    n = len(xs)
    if not n:
        return None, None, 0
    m = sum(xs) / n
    return m, (math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1)) if n > 1 else None), n


METRICS = ["best_val_loss", "final_val_loss", "final_val_accuracy", "test_accuracy", "test_bleu", "final_train_loss"]


def run_metrics(metrics_json):
    """The final numbers of one run's metrics file: {name: value}; for the synthetic tasks (one job per task and
    seed in one run) the mean test accuracy and each task's as "synthetic.<task>"."""
    m = metrics_json or {}
    s = m.get("metrics", {})
    out = {"best_val_loss": m.get("best_val_loss"), "final_val_loss": run_steps.last(s.get("val_losses", [])),
           "final_val_accuracy": run_steps.last(s.get("val_accuracies", [])), "test_accuracy": m.get("test_accuracy"),
           "test_bleu": m.get("test_bleu"), "final_train_loss": run_steps.last(s.get("train_losses", []))}
    synthetic = m.get("synthetic_test_accuracy") or {}
    if synthetic:  # one job per task: the losses and validation accuracy above are the last job's alone
        out = {"test_accuracy": out["test_accuracy"]}
    for task, acc in synthetic.items():
        out["synthetic." + task] = acc
    return {k: v for k, v in out.items() if run_steps.finite(v)}


def aggregate(results):
    """results: [{step, variant, point, seed, metrics {name: value}}] of complete runs. Returns {step: {variant,
    points: {point: {metric: {mean, std, n}}}, grid: {metric: {mean, pooled_std, spread, points, runs}}}}:
    per point the mean and sample standard deviation over seeds; per step the mean of the point means (every point
    weighs the same, as in the paper's averages), the pooled standard deviation over seeds (square root of the mean
    per-point variance, over points with two seeds or more) and the standard deviation of the point means."""
    out = {}
    for r in results:
        step = out.setdefault(r["step"], {"variant": r["variant"], "points": {}, "grid": {}})
        pt = step["points"].setdefault(r["point"], {})
        for k, v in r["metrics"].items():
            pt.setdefault(k, []).append(v)
    for step in out.values():
        names = sorted({k for pt in step["points"].values() for k in pt})
        for pname, pt in step["points"].items():
            step["points"][pname] = {k: dict(zip(("mean", "std", "n"), mean_std(v))) for k, v in pt.items()}
        for k in names:
            cells = [pt[k] for pt in step["points"].values() if k in pt and pt[k]["n"]]
            mean, spread, npts = mean_std([c["mean"] for c in cells])
            variances = [c["std"] ** 2 for c in cells if c["std"] is not None]
            step["grid"][k] = {"mean": mean, "pooled_std": math.sqrt(sum(variances) / len(variances)) if variances
                               else None, "spread": spread, "points": npts, "runs": sum(c["n"] for c in cells)}
    return out


def pm(mean, std, spec):
    return fmt(mean, spec) + (f" ± {format(std, spec)}" if std is not None else "")


def summarise(out_root, runs, grid, seeds, steps_order):
    """Writes sweep_summary.json and .md from the complete runs, prints the table; returns the aggregate."""
    results, missing = [], 0
    for run in runs:
        for fam in [f for sym, f in FAMILIES.items() if run["config"].get(sym)]:
            sid = run["sid"][fam["name"]]
            m = load_json(os.path.join(run["out"], f"training_metrics_step{sid}.json"))
            if not m or m.get("status") != "complete":
                missing += 1
                continue
            results.append({"step": sid, "variant": m.get("variant_label", run_steps.variant_label(run["config"])),
                            "point": run["point_name"], "seed": run["seed"], "out": os.path.relpath(run["out"], REPO),
                            "metrics": run_metrics(m), "curve": curve(m)})
    agg = aggregate(results)
    summary = {"run": os.path.basename(os.path.normpath(out_root)), "grid": [[n, v] for n, v in grid],
               "seeds": seeds, "complete": len(results), "missing": missing, "steps": agg,
               "curves": curves(results, list(agg)),
               "runs": [{k: r[k] for k in ("step", "variant", "point", "seed", "out", "metrics")} for r in results],
               "created_unix": time.time()}
    write_atomic(os.path.join(out_root, "sweep_summary.json"), json.dumps(summary, indent=1) + "\n")
    order = [s for s in steps_order if s in agg] + [s for s in agg if s not in steps_order]
    names = [k for k in METRICS + sorted({k for s in agg.values() for k in s["grid"] if k.startswith("synthetic.")})
             if any(k in agg[s]["grid"] for s in order)]
    head = ["step", "variant", "points", "runs"] + [k.replace("synthetic.", "") for k in names]
    rows = []
    for s in order:
        g = agg[s]["grid"]
        any_k = next(iter(g.values()), {"points": 0, "runs": 0})
        rows.append([s, agg[s]["variant"], str(any_k["points"]), str(any_k["runs"])] +
                    [pm(g[k]["mean"], g[k]["pooled_std"], ".4f") if k in g else "-" for k in names])
    md = [f"# Sweep summary: {summary['run']}", "",
          f"Grid: {grid_text(grid) or 'none'}. Seeds: {', '.join(map(str, seeds))}. Complete runs: {len(results)}"
          f"{f' ({missing} not complete)' if missing else ''}.", "",
          "Each cell: the mean over grid points of the per-point means over seeds, ± the pooled standard deviation "
          "over seeds (no ± with one seed). Per point below; every run's numbers in sweep_summary.json.", "",
          "| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    md += ["| " + " | ".join(r) + " |" for r in rows]
    paper_md, paper_lines = synthetic_paper(agg, order, summary)
    if paper_md:
        write_atomic(os.path.join(out_root, "sweep_summary.json"), json.dumps(summary, indent=1) + "\n")
        md += [""] + paper_md
    for s in order:
        md += ["", f"## {s} ({agg[s]['variant']}): per grid point (mean ± std over seeds, n)", "",
               "| point | " + " | ".join(h for h in head[4:]) + " |", "|---|" + "|".join("---" for _ in names) + "|"]
        for pname, pt in agg[s]["points"].items():
            md.append(f"| {pname} | " + " | ".join(
                f"{pm(pt[k]['mean'], pt[k]['std'], '.4f')} ({pt[k]['n']})" if k in pt else "-" for k in names) + " |")
    write_atomic(os.path.join(out_root, "sweep_summary.md"), "\n".join(md) + "\n")
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    say("")
    say(f"Sweep summary ({os.path.relpath(out_root, REPO)}/sweep_summary.md): {len(results)} complete run(s)"
        f"{f', {missing} not complete' if missing else ''}; mean over the grid ± pooled std over seeds")
    for r in [head] + rows:
        say("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)))
    for line in paper_lines:
        say("  " + line)
    plot(out_root, results, order)
    return agg


def kendall_tau(x, y):
    """Kendall's tau-a of two scorings of the same items ({item: score}): concordant minus discordant pairs over all
    pairs (a pair tied in either counts as neither); None for fewer than two items."""
    items = sorted(x)
    pairs = [(a, b) for i, a in enumerate(items) for b in items[i + 1:]]
    if not pairs:
        return None
    sign = lambda v: (v > 0) - (v < 0)  # noqa: E731
    return sum(sign(x[a] - x[b]) * sign(y[a] - y[b]) for a, b in pairs) / len(pairs)


def discordant(x, y):
    """The pairs of items that the two scorings order the opposite way (ties in either are not discordant)."""
    items = sorted(x)
    return [(a, b) for i, a in enumerate(items) for b in items[i + 1:] if (x[a] - x[b]) * (y[a] - y[b]) < 0]


def ranking(scores):
    """Names by decreasing score; ties keep the given order."""
    return [n for n, _ in sorted(scores.items(), key=lambda kv: -kv[1])]


def synthetic_paper(agg, order, summary):
    """The paper's synthetic table (run_steps.PAPER_SYNTH) beside the sweep's: per task and variant the mean over
    the grid ± pooled std over seeds (the paper's number), the average over tasks, and whether the variants rank
    the same (Kendall's tau of the averages). Returns (markdown, console lines); nothing without synthetic runs."""
    cols = [s for s in order if any(k.startswith("synthetic.") for k in agg[s]["grid"])
            and agg[s]["variant"] in run_steps.SYNTH_VARIANTS]
    if not cols:
        return [], []
    tasks = [t for t in run_steps.SYNTH_TASKS if any("synthetic." + t in agg[s]["grid"] for s in cols)]
    head = ["task"] + [agg[s]["variant"] for s in cols]
    rows, measured, paper = [], {}, {}
    for t in tasks:
        row = [t]
        for s in cols:
            g = agg[s]["grid"].get("synthetic." + t)
            ref = run_steps.PAPER_SYNTH[t][run_steps.SYNTH_VARIANTS.index(agg[s]["variant"])]
            row.append((pm(g["mean"], g["pooled_std"], ".3f") if g else "-") + f" ({ref:.3f})")
        rows.append(row)
    row = ["average"]
    for s in cols:
        v = agg[s]["variant"]
        got = [agg[s]["grid"]["synthetic." + t]["mean"] for t in tasks if "synthetic." + t in agg[s]["grid"]]
        refs = [run_steps.PAPER_SYNTH[t][run_steps.SYNTH_VARIANTS.index(v)] for t in tasks]
        measured[v] = sum(got) / len(got) if len(got) == len(tasks) else None
        paper[v] = sum(refs) / len(refs)
        row.append(fmt(measured[v], ".3f") + f" ({paper[v]:.3f})")
    rows.append(row)
    ok = {v: m for v, m in measured.items() if m is not None}
    ref = {v: paper[v] for v in ok}
    ours, theirs = ranking(ok), ranking(ref)
    tau, against = kendall_tau(ok, ref), discordant(ok, ref)
    verdict = ("fewer than two variants have every task: nothing to rank yet" if len(ok) < 2 else
               "the ranking of the variants agrees with the paper's (no pair in the opposite order)" if not against
               else f"the ranking differs from the paper's in {len(against)} of {len(ok) * (len(ok) - 1) // 2} pairs "
                    f"({', '.join(f'{a} vs {b}' for a, b in against)}; Kendall's tau {fmt(tau, '.2f')})")
    summary["paper"] = {"table": "synthetic", "tasks": tasks, "measured_average": measured, "paper_average": paper,
                        "ranking": ours, "paper_ranking": theirs, "kendall_tau": tau,
                        "discordant_pairs": against, "agrees": (not against) if len(ok) >= 2 else None}
    md = ["## Synthetic tasks beside the paper's Table 2", "",
          "Test token accuracy: mean over the grid ± pooled std over seeds, the paper's number in parentheses.", "",
          "| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    md += ["| " + " | ".join(r) + " |" for r in rows]
    md += ["", f"Ranking by the average over tasks, best first: measured {', '.join(ours)}; paper "
               f"{', '.join(theirs)}: {verdict}."]
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    lines = ["Synthetic tasks, test token accuracy (paper in parentheses):"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in [head] + rows]
    lines.append(f"ranking: measured {', '.join(ours)}; paper {', '.join(theirs)}: {verdict}")
    return md, lines


# The per-evaluation series a run's metrics file may hold (name in the summary: name in the metrics file).
SERIES = {"val_loss": "val_losses", "val_accuracy": "val_accuracies", "val_bleu": "val_bleus",
          "test_bleu": "test_bleus"}


def curve(m):
    """A run's validation curves: x (examples seen at each evaluation), its unit, and {series: values} of the
    series with a number (a series of nulls, such as BLEU of a synthetic task, is left out)."""
    s = (m or {}).get("metrics", {})
    unit = (m or {}).get("unit", "tokens")
    return {"x": s.get("val_" + unit, []), "unit": unit,
            "series": {k: s[v] for k, v in SERIES.items() if any(run_steps.finite(x) for x in s.get(v) or [])}}


def band(results, step, key="val_loss"):
    """(x, mean, std or None, whether x is the evaluation index) of a step's validation curves of one series
    (SERIES): per point the mean over seeds, then the mean of those over the grid; the band is the pooled per-point
    std over seeds. Curves are cut to the shortest; x is the first run's when every run has the same, else the
    evaluation index (points with other batch shapes see other numbers of examples by the same evaluation)."""
    rs = [dict(r, curve=dict(r["curve"], y=r["curve"]["series"][key])) for r in results
          if r["step"] == step and r["curve"]["series"].get(key)]
    if not rs:
        return None
    n = min(len(r["curve"]["y"]) for r in rs)
    xs = [tuple(r["curve"]["x"][:n]) for r in rs]
    indexed = not (len(set(xs)) == 1 and len(xs[0]) == n)
    x = list(range(1, n + 1)) if indexed else list(xs[0])
    by_point = {}
    for r in rs:
        by_point.setdefault(r["point"], []).append(r["curve"]["y"][:n])
    mean, std = [], []
    for i in range(n):
        cells = [c for c in (mean_std([c[i] for c in curves]) for curves in by_point.values()) if c[2]]
        if not cells:  # no finite value at this evaluation: the curve ends before it
            x = x[:i]
            break
        mean.append(sum(c[0] for c in cells) / len(cells))
        var = [c[1] ** 2 for c in cells if c[1] is not None]
        std.append(math.sqrt(sum(var) / len(var)) if var else None)
    return x, mean, (std if all(v is not None for v in std) else None), indexed


def curves(results, steps):
    """{step: {series: {x, mean, std, indexed, unit}}}: every step's averaged validation curves (band), which the
    paper report (scripts/paper.py) plots per evaluation, i.e. per epoch where a run evaluates once an epoch."""
    out = {}
    for s in steps:
        for key in SERIES:
            b = band(results, s, key)
            if b and b[1]:
                x, mean, std, indexed = b
                out.setdefault(s, {})[key] = {"x": x, "mean": mean, "std": std, "indexed": indexed,
                                              "unit": results[0]["curve"]["unit"]}
    return out


def plot(out_root, results, order):
    plt = run_steps.pyplot()
    if plt is None or not results:
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    unit = results[0]["curve"]["unit"]
    indexed = False
    for i, s in enumerate(order):
        b = band(results, s)
        if not b:
            continue
        x, mean, std, ix = b
        indexed |= ix
        variant = next(r["variant"] for r in results if r["step"] == s)
        ax.plot(x, mean, color=f"C{i % 10}", marker="o", markersize=3, label=f"{s} ({variant})")
        if std:
            ax.fill_between(x, [m - d for m, d in zip(mean, std)], [m + d for m, d in zip(mean, std)],
                            color=f"C{i % 10}", alpha=0.2)
    ax.set_xlabel("evaluation (n-th of each run)" if indexed else f"training {unit}")
    ax.set_ylabel("validation loss (nats)")
    ax.grid(alpha=0.3)
    run_steps.legend(ax, fontsize=8)
    ax.set_title(f"{os.path.basename(os.path.normpath(out_root))}: mean over the grid, band ± pooled std over seeds",
                 fontsize=10)
    fig.tight_layout()
    path = os.path.join(out_root, "sweep_curves.png")
    run_steps.save_figure(plt, fig, path)
    say(f"Plot: {os.path.relpath(path, REPO)}")


# ---------------------------------------------------------------- main

def main():
    for sig in (run_steps.signal.SIGINT, run_steps.signal.SIGTERM, run_steps.signal.SIGHUP):
        run_steps.signal.signal(sig, run_steps.on_stop_signal)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="the .config")
    ap.add_argument("--build", required=True, help="build/<run name>")
    ap.add_argument("--out", required=True, help="<output folder>/<run name>")
    ap.add_argument("--steps", required=True)
    ap.add_argument("--steps-dir", default="defconfigs/steps")
    ap.add_argument("--shard", default="1/1", help="K/N: this process's share of the runs")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--sanitize", default="")
    ap.add_argument("--plan", action="store_true", help="print the runs (and their builds) and stop")
    ap.add_argument("--build-only", action="store_true", help="build what this shard's runs need and stop")
    args = ap.parse_args()
    try:
        k, n = parse_shard(args.shard)
        out_root = os.path.abspath(args.out)
        build_root = os.path.abspath(args.build)
        steps = args.steps.split()
        # fragments of this process's plan: shards may plan at the same time
        work = os.path.join(build_root, "sweep", f"{socket.gethostname()}-{os.getpid()}")
        runs, grid, seeds = plan(args.config, steps, args.steps_dir, build_root, out_root, work)
        mine = shard(runs, k, n)
    except SweepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        return execute(args, runs, grid, seeds, mine, k, n, steps, out_root)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def execute(args, runs, grid, seeds, mine, k, n, steps, out_root):
    builds = sorted({r["build"] for r in mine})
    for run in runs:
        fams = [f for sym, f in FAMILIES.items() if run["config"].get(sym)]
        if not fams:
            print(f"error: step {run['step']} enables no model family (hint: enable one under 'Model families')",
                  file=sys.stderr)
            return 1
        run["sid"] = {f["name"]: run["step"] if len(fams) == 1 else f"{run['step']}-{f['name']}" for f in fams}
    say(f"kvlab sweep '{os.path.basename(out_root)}': {len(steps)} step(s) x {len(expand(grid))} grid point(s) x "
        f"{len(seeds)} seed(s) = {len(runs)} run(s); {len({r['build'] for r in runs})} build(s)" +
        (f"; shard {k}/{n}: {len(mine)} run(s), {len(builds)} build(s)" if n > 1 else ""))
    if args.plan:
        for r in mine:
            say(f"  {r['step']}  {r['point_name']}  seed{r['seed']}  build {os.path.relpath(r['build'], REPO)}  "
                f"-> {os.path.relpath(r['out'], REPO)}")
        return 0
    if args.build_only:
        for b in builds:
            say(f"  BUILD   {os.path.relpath(b, REPO)}")
            if not build(next(r for r in mine if r["build"] == b), args.config, args.sanitize):
                return 1
        return 0
    build_cfgs, failed, t0 = {}, 0, time.time()
    for i, run in enumerate(mine, 1):
        if Stop.signal:
            break
        if run["build"] not in build_cfgs:
            say(f"  BUILD   {os.path.relpath(run['build'], REPO)}")
            ok = build(run, args.config, args.sanitize)
            build_cfgs[run["build"]] = load_json(os.path.join(run["build"], "include", "generated", "config.json")) \
                if ok else None
        bcfg = build_cfgs[run["build"]]
        for fam in [f for sym, f in FAMILIES.items() if run["config"].get(sym)]:
            sid = run["sid"][fam["name"]]
            say(f"run {i}/{len(mine)}: step {sid}, {run['point_name']}, seed {run['seed']}")
            if bcfg is None:
                say(f"step {sid}: FAILED: the build {os.path.relpath(run['build'], REPO)} failed (see above)")
                failed += 1
                continue
            os.makedirs(run["out"], exist_ok=True)
            # this step's files only: another machine's shard may be writing another step's in this folder
            run_steps.remove_stale_temp_files(run["out"], only=set(
                os.path.basename(p) for p in run_steps.step_files(run["out"], sid, fam["name"]).values()))
            status = run_steps.run_step(run["step"], sid, fam, run["build"], run["config"], run["config_text"],
                                        run["out"], args.force, extra=set_args(run, bcfg))
            if Stop.signal:
                say(run_steps.stopped_message(sid, run_steps.step_files(run["out"], sid, fam["name"]), status))
                return 128 + Stop.signal
            failed += status == "failed"
    if Stop.signal:  # between two runs
        say(f"kvlab: stopped by {run_steps.signal.Signals(Stop.signal).name} between runs; run make again to go on")
        return 128 + Stop.signal
    summarise(out_root, runs, grid, seeds, [sid for s in steps for r in runs[:1] for sid in
                                             ([s] if len(r["sid"]) == 1 else [f"{s}-{f}" for f in r["sid"]])])
    say(f"Sweep time {time.time() - t0:.0f} s; outputs in {os.path.relpath(out_root, REPO)}/")
    if failed:
        say(f"error: {failed} run(s) failed: {run_steps.failed_line(out_root)}")
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except OSError as e:
        print(f"error: {e.filename or 'output'}: {e.strerror} (hint: CONFIG_OUTPUT_DIR must be a folder you can "
              "write to, with space left)", file=sys.stderr)
        sys.exit(1)
