#!/usr/bin/python3
"""The paper's experiments: runs them (quick or full form) and writes output/paper/report.md beside the paper.

Each experiment is a sweep defconfig per form (EXPERIMENTS below); an experiment with rows (the data sets of
Table 3, the two directions of Figure 6) runs its defconfig once per row with the row's symbols set and its own
run name. A row whose data set is not on this machine and cannot be fetched is skipped, not failed: the report says
how to get it.

    scripts/paper.py run [--form quick|full] [--only ID[,ID]]   (make paper runs this, then report)
    scripts/paper.py report [--form quick|full]                 (make paper-report)

run: for every row, `make O=build/paper/<run> defconfig-<defconfig>` (--build: another folder than build/paper), the row's symbols through scripts/config,
then `make O=build/paper/<run>`: the usual sweep (skips complete runs, resumes stopped ones), outputs in
<output>/<run>/. Its status per row goes to output/paper/status-<form>.json.

report: reads every row's sweep_summary.json and writes output/paper/report.md (and report.json, the same facts
for scripts) with figures output/paper/<experiment>-<form>.png: each table and
curve beside the paper's numbers (attention-variants.md section 6), the ranking of the variants against the
paper's, and what differs in the setup.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

import run_steps
import sweep
from run_steps import REPO, FAMILIES, say, load_json, write_atomic, fmt

# The paper's char-GPT runs (attention-variants.md section 6): final validation loss, mean of its two runs.
PAPER_CHAR_GPT = {"QKV": (1.5235 + 1.5051) / 2, "KV": (1.5390 + 1.5570) / 2, "KV+Pos": (1.5187 + 1.5235) / 2}

# Vision rows: the data set symbol, the get_data.sh name, and (CIFAR) the settings its images need.
CIFAR = {"VIT_PATCH": "8", "VIT_BATCH_SIZE": "128"}
CIFAR_FULL_GRID = "VIT_PATCH=4,8;VIT_LR:VIT_MIN_LR=1e-3:1e-3,1e-4:1e-4;VIT_DIM:VIT_MLP=64:64,256:256,512:512;" \
                  "VIT_LAYERS=2,4;VIT_HEADS=2,4"

# One entry per experiment of the paper. defconfig: per form. rows: (id, label, symbols set in both forms,
# symbols set in the full form only, paper key). kind: how the report shows it.
EXPERIMENTS = [
    {"id": "table2", "title": "Table 2: synthetic sequence tasks", "kind": "synthetic",
     "defconfig": {"quick": "seq2seq-paper-table2-quick", "full": "seq2seq-paper-table2"},
     "rows": [("", "synthetic tasks", {}, {}, None)],
     "setup": "nothing in the model, data or training (attention-variants.md 7.1); the quick form's grid is "
              "smaller, and its only length, T = 16, is the easiest of the paper's three."},
    {"id": "table3", "title": "Table 3: ViT image classification", "kind": "vision",
     "defconfig": {"quick": "vit-paper-table3-quick", "full": "vit-paper-table3"},
     "rows": [("fmnist", "Fashion-MNIST", {"VIT_DATA_FMNIST": "y"}, {}, "fashion-mnist"),
              ("mnist", "MNIST", {"VIT_DATA_MNIST": "y"}, {}, "mnist"),
              ("cifar10", "CIFAR-10", dict(CIFAR, VIT_DATA_CIFAR10="y"),
               {"VIT_EPOCHS": "40", "SWEEP": CIFAR_FULL_GRID}, "cifar10"),
              ("cifar100", "CIFAR-100", dict(CIFAR, VIT_DATA_CIFAR100="y"),
               {"VIT_EPOCHS": "50", "SWEEP": CIFAR_FULL_GRID}, "cifar100")],
     "setup": "kvlab validates on 5,000 held-out training images where the paper's code validates on the test "
              "set (MNIST, Fashion-MNIST); data sets and statistics per data set (attention-variants.md 7.3, bug 8)."},
    {"id": "fig4", "title": "Figure 4: spelled-out numbers (word language model)", "kind": "curves",
     "defconfig": {"quick": "gpt2-paper-fig4-quick", "full": "gpt2-paper-fig4"},
     "rows": [("", "numbers 1..9999", {}, {}, None)], "per_epoch": True, "rank_by": "final_val_accuracy",
     "setup": "the grid, lr and epochs are those the paper's Figure 4 states (length 16/32/64, heads 2/4, lr 1e-2, "
              "2 runs of 30 epochs); the reference notebook (attention-variants.md 7.5) ran 8 heads, lr 1e-3/1e-4, "
              "lengths 16 to 128, 15 epochs, 5 runs and dropout 0.2 in the MLP, where kvlab has one dropout (0.1) "
              "everywhere. A linear warm-up over the first quarter then a cosine, where the notebook uses fastai's "
              "one-cycle (which also cycles Adam's momentum); each step draws its windows at random, where the "
              "notebook passes once over the shuffled windows per epoch; the tied output head has no bias."},
    {"id": "fig5", "title": "Figure 5: character generation, tiny Shakespeare", "kind": "curves",
     "defconfig": {"quick": "gpt2-paper-fig5-quick", "full": "gpt2-paper-fig5"},
     "rows": [("", "tiny Shakespeare", {}, {}, None)], "per_epoch": False, "rank_by": "final_val_loss",
     "setup": "nothing in the model or training (attention-variants.md 7.2); the validation loss is estimated on "
              "20 batches in the quick form, 200 (as the paper) in the full form. The numbers in parentheses are the "
              "final losses of the paper's longer runs (6 layers, width 192, 10,000 iterations), so compare the "
              "order, not the levels."},
    {"id": "fig6", "title": "Figure 6: Multi30k translation", "kind": "translation",
     "defconfig": {"quick": "seq2seq-paper-fig6-quick", "full": "seq2seq-paper-fig6"},
     "rows": [("de-en", "German to English", {"SEQ2SEQ_DE_EN": "y"}, {}, None),
              ("en-de", "English to German", {"SEQ2SEQ_EN_DE": "y"}, {}, None)], "per_epoch": True,
     "rank_by": "test_bleu",
     "setup": "the grid and epochs are those the paper's Figure 6 states (layers 1/2, 15 epochs); the reference "
              "notebook (attention-variants.md 7.6) trained 2 layers for 20 epochs. Words split on spaces and "
              "punctuation, not spaCy tokens, with a vocabulary of words seen twice in the quick form (once, as the "
              "paper, in the full form); BLEU (0-100) on detokenised text without "
              "special tokens, where the paper's notebook counts them (bug 11), so its 0.30-0.36 do not compare; "
              "test BLEU per epoch as the paper plots it (attention-variants.md 7.6)."},
]

SERIES_LABEL = {"val_loss": "validation loss (nats)", "val_accuracy": "validation accuracy (tokens; images for ViT)",
                "val_bleu": "validation BLEU (greedy)", "test_bleu": "test BLEU (greedy)"}


class PaperError(Exception):
    pass


def experiments(only):
    ids = [e["id"] for e in EXPERIMENTS]
    want = [x.strip() for x in only.split(",") if x.strip()] if only else ids
    bad = [x for x in want if x not in ids]
    if bad:
        raise PaperError(f"--only {','.join(bad)}: no such experiment (hint: one or more of {', '.join(ids)})")
    return [e for e in EXPERIMENTS if e["id"] in want]


def defconfig_value(name, symbol):
    """A symbol's value as a defconfig file writes it (strings without their quotes), or None."""
    with open(os.path.join(REPO, "defconfigs", name), encoding="utf-8") as f:
        for line in f:
            if line.startswith(f"CONFIG_{symbol}="):
                v = line.split("=", 1)[1].strip()
                return v[1:-1] if v.startswith('"') else v
    return None


def defconfig_text(name):
    """The comment that opens a defconfig: what the form keeps of the paper's setup and what it drops."""
    out = []
    with open(os.path.join(REPO, "defconfigs", name), encoding="utf-8") as f:
        for line in f:
            if not line.startswith("# ") or line.startswith("# CONFIG_"):
                break
            out.append(line[2:].strip())
    if out and out[0][-1:] not in ".:;":
        out[0] += "."
    return " ".join(out)


def rows(exp, form):
    """[(row id, label, run name, {symbol: value} to set, paper key)] of one experiment in one form."""
    base = defconfig_value(exp["defconfig"][form], "RUN_NAME")
    out = []
    for rid, label, sets, full_sets, key in exp["rows"]:
        s = dict(sets, **(full_sets if form == "full" else {}))
        run = f"{base}-{rid}" if rid else base
        if rid:
            s["RUN_NAME"] = run
        out.append((rid, label, run, s, key))
    return out


# ---------------------------------------------------------------- running

def data_ready(cfg):
    """Whether every data set a configuration needs is here or can be fetched (get_data.sh, mirror or network)."""
    fams = [f for sym, f in FAMILIES.items() if cfg.get(sym)]
    return all(run_steps.fetch_data(cfg, f, "") for f in fams)


def run_row(exp, form, rid, label, run, sets, obj, dry, extra=()):
    """Configures and runs one row; returns (status: complete, failed, skipped (data set not here) or planned, why,
    its output folder or None)."""
    mk = ["make", f"O={obj}"]
    env = dict(os.environ, KCONFIG_CONFIG=os.path.join(obj, ".config"))
    for var in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES"):
        env.pop(var, None)
    os.makedirs(obj, exist_ok=True)
    if subprocess.call(mk + [f"defconfig-{exp['defconfig'][form]}"], cwd=REPO, env=env) != 0:
        return "failed", "its defconfig failed (see above)", None
    assigns = [f"{k}={v}" for k, v in sets.items()] + list(extra)
    if assigns and subprocess.call([os.path.join(REPO, "scripts", "config")] + assigns, cwd=REPO, env=env) != 0:
        return "failed", "setting the row's symbols failed (see above)", None
    if subprocess.call(mk + [os.path.join(obj, "include", "config", "auto.conf")], cwd=REPO, env=env) != 0:
        return "failed", "its configuration was refused (see above)", None
    cfg = load_json(os.path.join(obj, "include", "generated", "config.json")) or {}
    if not data_ready(cfg):
        names = [n for sym, f in FAMILIES.items() if cfg.get(sym) for n in f["data"](cfg)]
        return "skipped", (f"the data set {label} is not on this machine and could not be fetched (hint: "
                           f"scripts/get_data.sh {' '.join(names)} with the network, or a mirror holding its files: "
                           f"CONFIG_DATA_MIRROR, or KVLAB_DATA_MIRROR=DIR where that folder does not exist)"), None
    out = os.path.join(REPO, cfg.get("OUTPUT_DIR", "output"), run)
    if dry:
        return "planned", "", out
    rc = subprocess.call(mk, cwd=REPO, env=env)
    return ("complete", "", out) if rc == 0 else ("failed", f"make O={os.path.relpath(obj, REPO)} exited {rc}", out)


def checked_sets(sets):
    """--set NAME=VALUE... as given, refused here once rather than by every row's configuration: a name that is not
    a symbol's, and RUN_NAME, which each row sets to its own (one name would send every row to one folder)."""
    for a in sets:
        name = a.split("=", 1)[0]
        name = name[len("CONFIG_"):] if name.startswith("CONFIG_") else name
        if "=" not in a or not re.fullmatch(r"[A-Z0-9_]+", name):
            raise PaperError(f"--set {a}: not NAME=VALUE with a Kconfig symbol's name (hint: e.g. --set NUM_THREADS=1)")
        if name == "RUN_NAME":
            raise PaperError(f"--set {a}: every row names its own run (<the defconfig's RUN_NAME>-<row>), and one "
                             f"name would send every row to one folder (hint: keep a second set of runs apart with "
                             f"--set OUTPUT_DIR=DIR --output DIR)")
    return sets


def cmd_run(args):
    exps = experiments(args.only)
    extra = checked_sets(args.set)
    status_path = os.path.join(REPO, args.output, "paper", f"status-{args.form}.json")
    status = load_json(status_path) or {}
    t0, bad = time.time(), 0
    for exp in exps:
        for rid, label, run, sets, _ in rows(exp, args.form):
            say(f"paper: {exp['title']}: {label} ({args.form} form, run {run})")
            obj = os.path.join(os.path.abspath(args.build), run)
            t1 = time.time()
            st, why, out = run_row(exp, args.form, rid, label, run, sets, obj, args.dry_run, extra)
            if run_steps.Stop.signal:
                say("paper: stopped; run make paper again to go on (complete runs are skipped)")
                return 128 + run_steps.Stop.signal
            say(f"paper: {label}: {st}" + (f": {why}" if why else "") + f" ({time.time() - t1:.0f} s)")
            status[run] = {"experiment": exp["id"], "row": rid, "status": st, "why": why, "out": out,
                           "unix": time.time()}
            bad += st == "failed"
            if not args.dry_run:
                os.makedirs(os.path.dirname(status_path), exist_ok=True)
                write_atomic(status_path, json.dumps(status, indent=1) + "\n")
    say(f"paper: {args.form} form done in {time.time() - t0:.0f} s" + (f"; {bad} row(s) failed" if bad else ""))
    return 1 if bad else 0


# ---------------------------------------------------------------- the report

def order(summary):
    return [s for s in summary.get("steps", {})]


def cell(g, key, spec=".3f"):
    """mean ± pooled std (n runs) of one metric of a step's grid aggregate, or '-'."""
    c = (g or {}).get(key)
    if not c or c.get("mean") is None:
        return "-"
    return sweep.pm(c["mean"], c.get("pooled_std"), spec) + f" (n {c['runs']})"


def verdict(measured, paper, higher_better=True, stds=None, missing=0):
    """(text, details) comparing the ranking of the variants both have: best first, discordant pairs, tau; a
    discordant pair whose measured gap is within the larger of the two pooled seed stds is called noise, and the
    verdict of a sweep with runs not yet complete is provisional (its variants may average other grid points)."""
    both = {v: m for v, m in measured.items() if m is not None and v in paper}
    if len(both) < 2:
        return "fewer than two variants measured: nothing to rank", {}
    sign = 1 if higher_better else -1
    ours = {v: sign * m for v, m in both.items()}
    theirs = {v: sign * paper[v] for v in both}
    against = sweep.discordant(ours, theirs)
    tau = sweep.kendall_tau(ours, theirs)
    rank = ", ".join(sweep.ranking(ours))
    prank = ", ".join(sweep.ranking(theirs))
    stds = stds or {}
    noise = [(a, b) for a, b in against if abs(both[a] - both[b]) <= max(stds.get(a) or 0.0, stds.get(b) or 0.0)]
    text = (f"best first, measured {rank}; paper {prank}: " +
            ("the same order" if not against else
             f"{len(against)} of {len(both) * (len(both) - 1) // 2} pairs in the opposite order "
             f"({', '.join(f'{a} vs {b}' for a, b in against)}; Kendall's tau {fmt(tau, '.2f')})" +
             (f", {len(noise)} of them within one pooled seed std (noise)" if noise else "")) +
            (f" (provisional: {missing} runs not complete)" if missing else ""))
    return text, {"ranking": sweep.ranking(ours), "paper_ranking": sweep.ranking(theirs), "kendall_tau": tau,
                  "discordant_pairs": against, "within_noise": noise, "provisional": bool(missing)}


def head_line(s, n_runs):
    grid = sweep.grid_text([(n, v) for n, v in s.get("grid", [])]) or "none"
    return (f"Grid: {grid}. Seeds: {', '.join(map(str, s.get('seeds', [])))}. Complete runs: {n_runs}"
            + (f" ({s['missing']} not complete)" if s.get("missing") else "") + ".")


def report_synthetic(s, facts):
    agg = s.get("steps", {})
    md, _lines = sweep.synthetic_paper(agg, order(s), s)
    facts["paper"] = s.get("paper")
    return md[2:] if md else ["No synthetic task finished yet."]


def report_vision(row_summaries, facts):
    """One table: a row per data set, a column per variant; test accuracy, the paper's in parentheses."""
    variants = [v for v in run_steps.SYNTH_VARIANTS
                if any(st["variant"] == v for s in row_summaries.values() if s for st in s["steps"].values())]
    head = ["data set"] + variants
    md = ["Test accuracy: mean over the grid ± pooled std over seeds (n runs), the paper's in parentheses.", "",
          "| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    verdicts = []
    for (label, key, rid), s in row_summaries.items():
        ref = run_steps.PAPER.get(("vit", key), {})
        if not s:
            md.append(f"| {label} | " + " | ".join("not run" for _ in variants) + " |")
            continue
        by_var = {st["variant"]: st for st in s["steps"].values()}
        cells, measured, stds = [], {}, {}
        for v in variants:
            g = by_var.get(v, {}).get("grid", {})
            c = g.get("test_accuracy")
            measured[v] = c["mean"] if c else None
            stds[v] = c.get("pooled_std") if c else None
            cells.append(cell(g, "test_accuracy") + (f" ({ref[v]:.3f})" if v in ref else ""))
        md.append(f"| {label} | " + " | ".join(cells) + " |")
        text, det = verdict(measured, ref, stds=stds, missing=s.get("missing", 0))
        verdicts.append(f"- {label}: {text}.")
        facts.setdefault("rows", {}).setdefault(rid, {}).update(det, measured=measured, paper=ref)
    return md + [""] + verdicts


def curve_rows(s, facts, paper=None, higher_better=False, main="best_val_loss"):
    """A table of the final numbers per variant and the ranking (against the paper's numbers when there are any)."""
    keys = [k for k in ("best_val_loss", "final_val_loss", "final_val_accuracy", "test_bleu")
            if any(k in st["grid"] for st in s["steps"].values())]
    head = ["step", "variant"] + keys
    md = ["Mean over the grid ± pooled std over seeds (n runs)" +
          (", the paper's number in parentheses" if paper else "") + ".", "",
          "| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    measured, stds = {}, {}
    for sid, st in s["steps"].items():
        g = st["grid"]
        if main in g:
            measured[st["variant"]] = g[main]["mean"]
            stds[st["variant"]] = g[main].get("pooled_std")
        md.append(f"| {sid} | {st['variant']} | " + " | ".join(
            cell(g, k, ".4f" if "loss" in k else ".3f") +
            (f" ({paper[st['variant']]:.4f})" if paper and k == main and st["variant"] in paper else "")
            for k in keys) + " |")
    if paper:
        text, det = verdict(measured, paper, higher_better, stds, s.get("missing", 0))
        md += ["", f"Ranking by {main.replace('_', ' ')}, {text}."]
        facts.update(det, measured=measured, paper=paper)
    else:
        rank = sweep.ranking({v: (m if higher_better else -m) for v, m in measured.items() if m is not None})
        md += ["", f"Ranking by {main.replace('_', ' ')}, best first: {', '.join(rank)} (the paper gives curves, "
                   "not numbers, for this experiment)" +
               (f" (provisional: {s['missing']} runs not complete)." if s.get("missing") else ".")]
        facts.update(ranking=rank, measured=measured)
    return md


def plot_curves(summaries, keys, path, title, per_epoch):
    """One panel per series (validation loss, accuracy, BLEU), one line per step and row, band ± pooled std."""
    plt = run_steps.pyplot()
    have = [k for k in keys if any(k in c for s in summaries.values() if s for c in s.get("curves", {}).values())]
    if plt is None or not have:
        return None
    fig, axes = plt.subplots(1, len(have), figsize=(6 * len(have), 4.5), squeeze=False)
    for ax, key in zip(axes[0], have):
        i = 0
        for label, s in summaries.items():
            for sid, series in (s or {}).get("curves", {}).items():
                c = series.get(key)
                if not c:
                    continue
                var = s["steps"].get(sid, {}).get("variant", sid)
                x = list(range(1, len(c["mean"]) + 1)) if per_epoch else c["x"][:len(c["mean"])]
                name = f"{var}" + (f", {label}" if len(summaries) > 1 else "")
                ax.plot(x, c["mean"], color=f"C{i % 10}", marker="o", markersize=2,
                        linestyle="-" if i < 10 else "--", label=name)
                if c.get("std") and all(v is not None for v in c["std"]):
                    ax.fill_between(x, [m - d for m, d in zip(c["mean"], c["std"])],
                                    [m + d for m, d in zip(c["mean"], c["std"])], color=f"C{i % 10}", alpha=0.15)
                i += 1
        ax.set_xlabel("epoch" if per_epoch else "evaluation (n-th)" if any(
            c.get(key, {}).get("indexed") for s in summaries.values() if s for c in s.get("curves", {}).values())
            else "training " + next(c[key]["unit"] for s in summaries.values() if s
                                    for c in s.get("curves", {}).values() if key in c))
        ax.set_ylabel(SERIES_LABEL[key])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{title}: mean over the grid, band ± pooled std over seeds", fontsize=10)
    fig.tight_layout()
    run_steps.save_figure(plt, fig, path)
    return path


def cmd_report(args):
    out = os.path.join(REPO, args.output)
    pdir = os.path.join(out, "paper")
    os.makedirs(pdir, exist_ok=True)
    status = load_json(os.path.join(pdir, f"status-{args.form}.json")) or {}
    md = [f"# The paper's experiments, {args.form} form", "",
          f"Written by `make paper-report` ({'PAPER=full, ' if args.form == 'full' else ''}scripts/paper.py) from "
          f"the sweep summaries under {args.output}/. Every number is a mean over the experiment's grid of the "
          "per-point means over seeds, ± the pooled standard deviation over seeds, with the number of runs. The "
          "paper's numbers are those of attention-variants.md section 6, which numbers the synthetic and vision "
          "tables 1 and 2 (its notebooks); here they carry the paper's numbers, Table 2 and Table 3.", ""]
    facts = {"form": args.form, "experiments": {}, "created_unix": time.time()}
    for exp in experiments(args.only):
        md += [f"## {exp['title']}", "", f"This form (defconfig {exp['defconfig'][args.form]}): "
               f"{defconfig_text(exp['defconfig'][args.form])}", "",
               f"Where the setup differs from the paper's: {exp['setup']}", ""]
        ef = facts["experiments"].setdefault(exp["id"], {"rows": {}})
        sums = {}
        for rid, label, run, _sets, key in rows(exp, args.form):
            st = status.get(run, {})
            # where `run` put it (the row's CONFIG_OUTPUT_DIR), else --output
            s = load_json(os.path.join(st.get("out") or os.path.join(out, run), "sweep_summary.json"))
            shown = {k: v for k, v in _sets.items() if k != "RUN_NAME"}
            sets_note = f" (this row sets {', '.join(f'{k}={v}' for k, v in shown.items())})" if shown else ""
            if not s or not s.get("complete"):
                why = (f"{st['status']}: {st.get('why')}" if st.get("status") in ("skipped", "failed") else
                       f"not run yet (hint: make paper ONLY={exp['id']}{' PAPER=full' if args.form == 'full' else ''})")
                md += [f"- {label} (`{run}`){sets_note}: {why}"]
                ef["rows"][rid or "default"] = {"status": st.get("status", "not run"), "why": why}
                s = None
            else:
                md += [f"- {label} (`{run}`){sets_note}: {head_line(s, s['complete'])}"]
                ef["rows"][rid or "default"] = {"status": "complete", "runs": s["complete"]}
            sums[(label, key or rid, rid or "default")] = s
        md.append("")
        done = {k: s for k, s in sums.items() if s}
        if not done:
            md += ["Nothing measured yet.", ""]
            continue
        if exp["kind"] == "synthetic":
            md += report_synthetic(next(iter(done.values())), ef)
        elif exp["kind"] == "vision":
            md += report_vision(sums, ef)
            fig = plot_curves({label: s for (label, _k, _r), s in done.items()}, ["val_loss", "val_accuracy"],
                              os.path.join(pdir, f"{exp['id']}-{args.form}.png"), exp["title"], True)
            if fig:
                md += ["", f"![{exp['title']}]({os.path.basename(fig)})"]
        else:
            for (label, _key, rid), s in done.items():
                if len(sums) > 1:
                    md += [f"### {label}", ""]
                paper = PAPER_CHAR_GPT if exp["id"] == "fig5" else None
                main = exp["rank_by"]
                md += curve_rows(s, ef["rows"].setdefault(rid, {}), paper,
                                 higher_better="loss" not in main, main=main)
                md.append("")
            fig = plot_curves({label: s for (label, _k, _r), s in done.items()},
                              ["val_loss", "val_accuracy", "val_bleu", "test_bleu"],
                              os.path.join(pdir, f"{exp['id']}-{args.form}.png"),
                              exp["title"], exp.get("per_epoch", False))
            if fig:
                md += [f"![{exp['title']}]({os.path.basename(fig)})"]
        md.append("")
    write_atomic(os.path.join(pdir, "report.json"), json.dumps(facts, indent=1, default=str) + "\n")
    write_atomic(os.path.join(pdir, "report.md"), "\n".join(md) + "\n")
    say(f"paper: report in {os.path.relpath(os.path.join(pdir, 'report.md'), REPO)}")
    return 0


def main():
    for sig in (run_steps.signal.SIGINT, run_steps.signal.SIGTERM, run_steps.signal.SIGHUP):
        run_steps.signal.signal(sig, run_steps.on_stop_signal)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["run", "report"])
    ap.add_argument("--form", default="quick", choices=["quick", "full"])
    ap.add_argument("--only", default="", help="experiments, e.g. table3,fig6 (default: all)")
    ap.add_argument("--build", default=os.path.join(REPO, "build", "paper"), help="run: the rows' build folders")
    ap.add_argument("--output", default="output", help="the output folder of the runs (CONFIG_OUTPUT_DIR)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="run: set a symbol in every row (e.g. NUM_THREADS=1, DATA_DIR=...), after the row's own")
    ap.add_argument("--dry-run", action="store_true",
                    help="run: configure each row and get its data as a run would (fetching it), run nothing")
    args = ap.parse_args()
    try:
        return cmd_run(args) if args.what == "run" else cmd_report(args)
    except PaperError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
