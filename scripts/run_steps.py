#!/usr/bin/python3
"""Runs the ablation steps that `make build` compiled, then summarises them.

For every step (and every model family the step enables) it fetches the data
the step needs, skips the step when it already completed with the same
resolved configuration, otherwise runs the step's own binary with its log
captured to train_step<STEP>.log, and carries on with the next step when one
fails. Afterwards it writes ablation_summary.json and ablation_summary.md,
prints the comparison table and plots every step's curves overlaid.

SIGINT, SIGTERM and SIGHUP (to the whole process group, as Ctrl-C sends
them, or to this process alone) stop the run: the trainer gets the signal,
saves its state at its current iteration and exits; this runner keeps
relaying its output until then, starts nothing more, prints one line and
exits with 128 + the signal (docs/build.md, "Signals").

Called by `make`; see `make help`.
"""
import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import attention_tbl

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Model families: Kconfig symbol -> binary (inside a step's build tree) and data sets.
FAMILIES = {
    "GPT2": {
        "name": "gpt2",
        "binary": "gpt2/train_gpt2",
        "data": lambda c: (["tinyshakespeare-bpe"] if c.get("GPT2_DATA_BPE") else
                           [] if c.get("GPT2_DATA_NUMBERS") else ["tinyshakespeare"]),
        "tokenizer": "gpt2/tokenize",
    },
    "VIT": {
        "name": "vit",
        "binary": "vit/train_vit",
        # Fashion-MNIST comes from a Debian package that scripts/deps.sh installs
        "data": lambda c: (["mnist"] if c.get("VIT_DATA_MNIST") else ["cifar10"] if c.get("VIT_DATA_CIFAR10") else
                           ["cifar100"] if c.get("VIT_DATA_CIFAR100") else []),
        "tokenizer": None,
    },
    "SEQ2SEQ": {
        "name": "seq2seq",
        "binary": "seq2seq/train_seq2seq",
        "data": lambda c: ["multi30k"] if c.get("SEQ2SEQ_TASK_TRANSLATION") else [],
        "tokenizer": None,
    },
}

# The paper's test accuracies (attention-variants.md section 6, vision table).
PAPER = {
    ("vit", "mnist"): {"QKV": .981, "KV": .981, "KV+Pos": .982, "KV tying": .976, "K": .978, "K+Pos": .977},
    ("vit", "fashion-mnist"): {"QKV": .887, "KV": .885, "KV+Pos": .884, "KV tying": .883, "K": .877, "K+Pos": .875},
    ("vit", "cifar10"): {"QKV": .663, "KV": .666, "KV+Pos": .662, "KV tying": .659, "K": .672, "K+Pos": .669},
    ("vit", "cifar100"): {"QKV": .363, "KV": .369, "KV+Pos": .366, "KV tying": .358, "K": .376, "K+Pos": .364},
}


# The paper's synthetic table (attention-variants.md section 6): test per-token accuracy.
SYNTH_TASKS = ["reverse", "sort", "copy", "swap", "sub"]
SYNTH_VARIANTS = ["QKV", "KV", "KV+Pos", "KV tying", "K", "K+Pos"]
PAPER_SYNTH = {
    "reverse": [.698, .705, .718, .701, .514, .581],
    "sort": [.971, .967, .963, .958, .939, .957],
    "copy": [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
    "swap": [.588, .597, .671, .590, .446, .576],
    "sub": [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
}


def say(msg):
    try:
        print(msg, flush=True)
    except OSError:  # the terminal is gone (SIGHUP) or make stopped reading: the logs still get everything
        pass


class Stop:
    """The first of SIGINT, SIGTERM, SIGHUP received, the trainer (or mpirun) running now, and the signal that
    asks it to stop: the same one, or SIGUSR1 for mpirun, which forwards that one to every rank (it answers
    SIGINT, SIGTERM and SIGHUP with SIGTERM to the ranks and SIGKILL a second later)."""
    signal = 0
    child = None
    child_signal = None


# The steps (runs) that failed, in order: (step id, its output folder, where to look), for make's closing line
FAILED = []


def failed_line(root, limit=6):
    """Names each failed step (with its folder under root, for a sweep's runs) and where its error is: the
    trainer's log when the trainer ran, else the line printed above (data preparation or mpirun failed before
    any log was written)."""
    def name(sid, out):
        sub = os.path.relpath(out, root)
        return sid if sub == "." else f"{sub}/{sid}"
    parts = [f"{name(sid, out)} ({where})" for sid, out, where in FAILED[:limit]]
    if len(FAILED) > limit:
        parts.append(f"and {len(FAILED) - limit} more above")
    return "; ".join(parts)


def on_stop_signal(sig, _frame):
    Stop.signal = Stop.signal or sig
    child = Stop.child
    if child is not None and child.returncode is None:
        try:  # the trainer may have the signal already (the whole group got it); a second one changes nothing
            os.kill(child.pid, Stop.child_signal or sig)
        except OSError:
            pass


def stopped_message(sid, files, status):
    m = load_json(files["metrics"]) or {}
    if status == "not started":
        what = f"step {sid} had not started"
    elif m.get("status") == "stopped":
        what = f"step {sid} saved its state at iteration {m.get('final_iteration')}"
    elif m.get("status") == "complete":
        what = f"step {sid} is complete"
    else:
        what = f"step {sid} had not started training"
    return f"kvlab: stopped by {signal.Signals(Stop.signal).name}: {what}; run make again to continue from there"


def load_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def read_text(path):
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None


def training_identity(text):
    """The configuration that decides a step's training: every line but the MECHINT_* analysis options, which
    the trainers never read (changing how checkpoints are analysed must not retrain them), and the DIST_*
    options of the Distributed menu (how many processes train a step does not change its results, and its
    state file continues with any number of them), and the SWEEP* options (a run of a sweep has its point and seed
    in its own configuration; growing the grid or the seed count must not redo the runs already done)."""
    if text is None:
        return None
    # prefixes, not symbols (check-symbols reads this file)
    ignored = re.compile(r"^(# )?CONFIG_(" + "MECHINT_" + "|" + "DIST_" + "|" + "SWEEP" + ")")
    return [x for x in text.splitlines() if not ignored.match(x)]


TEMP_RE = re.compile(r"\.tmp\.(\d+)$")  # NAME.tmp.<pid>: how the trainers, mechint and this script write files


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_stale_temp_files(out, only=None):
    """Removes the temporary files that writes killed midway left in the run folder (those of processes that no
    longer exist; a live one may still be writing); only: just the temporary files of these file names."""
    for folder, _dirs, names in os.walk(out):
        for name in names:
            m = TEMP_RE.search(name)
            if m and (only is None or name[:m.start()] in only) and not pid_alive(int(m.group(1))):
                os.remove(os.path.join(folder, name))
                say(f"removed {os.path.relpath(os.path.join(folder, name), REPO)}: left by a write that was killed")


def write_atomic(path, text):
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def variant_label(cfg):
    return attention_tbl.label(cfg)


def step_files(out, sid, family):
    return {
        "final": os.path.join(out, f"final_model_step{sid}.safetensors"),
        "best": os.path.join(out, f"best_model_step{sid}.safetensors"),
        "state": os.path.join(out, f"state_step{sid}.safetensors"),
        "metrics": os.path.join(out, f"training_metrics_step{sid}.json"),
        "log": os.path.join(out, f"train_step{sid}.log"),
        "config": os.path.join(out, f"config_step{sid}"),
        "binary": os.path.join(out, f"train_{family}_step{sid}"),
    }


def archive(out, sid, files):
    """Moves a step's earlier outputs aside instead of overwriting them."""
    present = [p for p in files.values() if os.path.exists(p)]
    if not present:
        return None
    dest = os.path.join(out, "previous", f"{sid}-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(dest, exist_ok=True)
    for p in present:
        shutil.move(p, os.path.join(dest, os.path.basename(p)))
    return dest


def unarchive(moved, files):
    """Puts the outputs archive() moved back in place of those of a run that failed before it trained anything;
    the log keeps the failed attempt at its end."""
    attempt = read_text(files["log"]) or ""
    for p in files.values():
        kept = os.path.join(moved, os.path.basename(p))
        if os.path.exists(kept):
            os.replace(kept, p)
        elif os.path.exists(p):
            os.remove(p)  # the failed attempt's own file (its metrics, say), where the earlier run had none
    if attempt:
        with open(files["log"], "a", encoding="utf-8") as log:
            log.write(attempt)
    os.rmdir(moved)
    try:
        os.rmdir(os.path.dirname(moved))  # previous/, when it holds nothing else
    except OSError:
        pass


def trained_anything(files):
    m = load_json(files["metrics"]) or {}
    return os.path.exists(files["state"]) or os.path.exists(files["final"]) or (m.get("final_iteration") or 0) > 0


def fetch_data(cfg, family, build_dir):
    names = family["data"](cfg)
    if not names:
        return True
    cmd = [os.path.join(REPO, "scripts", "get_data.sh"), "--data", cfg.get("DATA_DIR", "data")]
    # CONFIG_DATA_MIRROR when the folder exists, else $KVLAB_DATA_MIRROR when set, else download; empty: download
    mirror = cfg.get("DATA_MIRROR", "")
    if mirror and not os.path.isdir(os.path.join(REPO, mirror)):
        other = os.environ.get("KVLAB_DATA_MIRROR", "")
        say(f"data: the mirror {mirror} (CONFIG_DATA_MIRROR) does not exist; " +
            (f"using $KVLAB_DATA_MIRROR ({other})" if other else "downloading"))
        mirror = other
    cmd += ["--mirror", mirror]
    if family["tokenizer"]:
        cmd += ["--tokenizer", os.path.join(build_dir, family["tokenizer"])]
    return subprocess.call(cmd + names, cwd=REPO) == 0


def distributed_command(cfg, cmd):
    """The trainer's command line under mpirun when the Distributed menu asks for MPI (docs/distributed.md):
    CONFIG_DIST_PROCS_PER_NODE ranks on this machine, or on every machine of CONFIG_DIST_HOSTFILE. An argument
    list, never a shell line. Returns (command, note for the log) or (None, error)."""
    if not cfg.get("DIST_MPI"):
        return cmd, None
    mpirun = shutil.which("mpirun")
    if not mpirun:
        return None, "CONFIG_DIST_MPI is on but there is no mpirun (hint: scripts/deps.sh installs openmpi-bin)"
    n = int(cfg.get("DIST_PROCS_PER_NODE", 1))
    hostfile = cfg.get("DIST_HOSTFILE", "")
    launch = [mpirun]
    if os.geteuid() == 0:
        launch.append("--allow-run-as-root")  # OpenMPI refuses root otherwise; CI and containers run as root
    if hostfile:
        path = hostfile if os.path.isabs(hostfile) else os.path.join(REPO, hostfile)
        if not os.path.isfile(path):
            return None, f"CONFIG_DIST_HOSTFILE={hostfile}: no such file (hint: an OpenMPI hostfile, one machine " \
                         "per line, e.g. 'node1 slots=2'; empty runs on this machine)"
        launch += ["--hostfile", path, "--npernode", str(n)]
    else:
        # one machine: more ranks than cores is allowed (and makes OpenMPI yield instead of spinning)
        launch += ["-np", str(n), "--oversubscribe"]
    # no binding: each rank runs its own OpenMP threads; with "Threads" at 0 this machine's cores are shared
    # out (the ranks of another machine share theirs the same way, train/dist.c)
    launch += ["--bind-to", "none"]
    threads = int(cfg.get("NUM_THREADS", 0))
    if threads == 0 and not hostfile:
        threads = max(1, len(os.sched_getaffinity(0)) // n)
    if threads:
        launch += ["-x", f"OMP_NUM_THREADS={threads}"]
    if "KVLAB_PROFILE_STEPS" in os.environ:  # the op profile of a run's steps (train/profile.c), on every machine
        launch += ["-x", "KVLAB_PROFILE_STEPS"]
    return launch + cmd, f"{n} processes{' per machine of ' + hostfile if hostfile else ''}" + \
        (f", {threads} threads each" if threads else "")


# mpirun's boxed messages: kept in the log, summed up in one line on failure
MPI_BOX = re.compile(r"^-{40,}$")
MPI_SIGNALLED = re.compile(r"process rank (\d+) with PID \d+ on node (\S+) exited on signal (\d+)(?: \(([^)]*)\))?")
MPI_ABORTED = re.compile(r"MPI_ABORT was invoked on rank (\d+)")
MPI_EXITED = re.compile(r"Process name: \[\[\d+,\d+\],(\d+)\]\s*\n\s*Exit code:\s*(\d+)")
MPI_NOISE = re.compile(r"^\[[^\]]*\] \[\[\d+,\d+\],\d+\] ORTE_ERROR_LOG")  # OpenMPI 4.1 after an MPI_Abort
MPI_SSH = re.compile(r"ssh: (?:Could not resolve hostname|connect to host) ([^\s:]+)[^\n]*")


def mpi_failure(text):
    """One line naming the rank (and its machine) that ended an MPI job, from mpirun's messages, or None."""
    m = MPI_SIGNALLED.search(text)
    if m:
        name = m.group(4) or f"signal {m.group(3)}"
        return f"rank {m.group(1)} on {m.group(2)} died ({name}, signal {m.group(3)}); mpirun stopped the other ranks"
    m = MPI_ABORTED.search(text)
    if m:
        return f"rank {m.group(1)} stopped the job with an error (its line above)"
    m = MPI_EXITED.search(text)
    if m:
        return f"rank {m.group(1)} exited with status {m.group(2)}; mpirun stopped the other ranks"
    m = MPI_SSH.search(text)
    if m:
        return f"mpirun could not start the ranks on {m.group(1)}: {m.group(0)}"
    if "unable to" in text or "not able to" in text or "could not" in text.lower():
        first = next((x.strip() for x in text.splitlines() if x.strip() and not MPI_BOX.match(x.strip())), "")
        return f"mpirun could not start every rank: {first}"
    return None


def run_step(step, sid, family, build_dir, cfg, cfg_text, out, force, extra=()):
    """Runs one step's trainer (extra: more arguments, scripts/sweep.py's --set NAME=VALUE) unless complete;
    returns "done", "skipped", "failed", "stopped" or "not started"."""
    files = step_files(out, sid, family["name"])
    metrics = load_json(files["metrics"]) or {}
    same_config = training_identity(read_text(files["config"])) == training_identity(cfg_text)
    if same_config and not force and metrics.get("status") == "complete" and os.path.exists(files["final"]):
        say(f"step {sid}: already complete for this configuration, skipped (make FORCE=1 redoes it)")
        return "skipped"
    fresh = force or not same_config
    if not fresh and os.path.exists(files["state"]):
        say(f"step {sid}: continuing from {os.path.relpath(files['state'], REPO)}")
    if not fetch_data(cfg, family, build_dir):
        say(f"step {sid}: FAILED: data preparation failed (see the error above)")
        FAILED.append((sid, out, "data preparation, its error is above; no trainer log"))
        return "failed"
    if Stop.signal:
        return "not started"
    moved = None
    if fresh:  # moved back below if the new run fails before it trains anything
        moved = archive(out, sid, files)
        if moved:
            why = "forced" if force else "configuration changed"
            say(f"step {sid}: {why}; earlier outputs moved to {os.path.relpath(moved, REPO)}")
    write_atomic(files["config"], cfg_text)
    binary = os.path.join(build_dir, family["binary"])
    tmp = f"{files['binary']}.tmp.{os.getpid()}"
    try:  # a hard link where it can (a sweep has many runs of one build; the linker writes a new file, never
        os.link(binary, tmp)  # into this one), else a copy
    except OSError:
        shutil.copy2(binary, tmp)
    os.replace(tmp, files["binary"])
    if os.path.lexists(tmp):  # both names were links to one file already: rename() leaves them as they are
        os.remove(tmp)
    cmd, note = distributed_command(cfg, [files["binary"], "train", "--out", out, "--step", sid] + list(extra))
    if cmd is None:
        say(f"step {sid}: FAILED: {note}")
        FAILED.append((sid, out, "not started: " + note.split(" (hint")[0]))
        return "failed"
    distributed = cmd[0] != files["binary"]
    say(f"step {sid}: {variant_label(cfg)} -> {os.path.relpath(out, REPO)}/ (log: train_step{sid}.log)" +
        (f"; mpirun, {note}" if distributed else ""))
    mpi_text = []
    with open(files["log"], "a", encoding="utf-8") as log:
        log.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n")
        log.flush()
        # mpirun in a session of its own: Ctrl-C reaches this runner alone, which asks mpirun to stop the ranks
        # (SIGUSR1) and lets them save
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1, start_new_session=distributed)
        Stop.child_signal = signal.SIGUSR1 if distributed else None
        Stop.child = proc  # a stop signal is passed on to it; we relay its output until it has saved and exited
        if Stop.signal:  # arrived while it started
            on_stop_signal(Stop.signal, None)
        in_box = False
        for line in proc.stdout:
            log.write(line)
            log.flush()
            text = line.rstrip("\n")
            if distributed and (in_box or MPI_BOX.match(text) or MPI_NOISE.match(text) or
                                text.startswith(("mpirun: Forwarding signal", "ssh: "))):
                in_box = in_box != bool(MPI_BOX.match(text))  # mpirun's boxes: the log has them, one line below
                mpi_text.append(text)
                continue
            say(f"[{sid}] " + text)
        rc = proc.wait()
        Stop.child = None
        Stop.child_signal = None
    if rc != 0 and moved and not trained_anything(files):
        unarchive(moved, files)
        say(f"step {sid}: the new run failed before it trained anything; the earlier outputs are back in place")
    if Stop.signal:
        return "stopped"
    if rc != 0:
        why = mpi_failure("\n".join(mpi_text)) if distributed else None
        say(f"step {sid}: FAILED with exit status {rc}{': ' + why if why else ''}; see "
            f"{os.path.relpath(files['log'], REPO)} (the other steps' results are kept"
            f"{'; make continues from its last checkpoint' if distributed and os.path.exists(files['state']) else ''})")
        FAILED.append((sid, out, f"exit status {rc}; log {os.path.relpath(files['log'], REPO)}"))
        return "failed"
    return "done"


# ---------------------------------------------------------------- summary

def last(xs):
    return xs[-1] if xs else None


def fmt(v, spec):
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return format(v, spec)


def summarise(out, rows):
    steps = []
    for sid, status, cfg in rows:
        m = load_json(os.path.join(out, f"training_metrics_step{sid}.json")) or {}
        s = m.get("metrics", {})
        vals = s.get("val_losses", [])
        accs = s.get("val_accuracies", [])
        unit = m.get("unit", "tokens")
        steps.append({
            "step": sid,
            "status": m.get("status", status) if status != "failed" else "failed",
            "family": m.get("family"),
            "variant": m.get("variant_label", variant_label(cfg)),
            "parameters": m.get("parameters"),
            "flops_per_token": m.get("flops_per_token"),
            "kv_cache_bytes_per_token": m.get("kv_cache_bytes_per_token"),
            "decode_tokens_per_s": m.get("decode_tokens_per_s"),
            "decode_tokens": m.get("decode_tokens"),
            "decode_context": m.get("decode_context"),
            "best_val_loss": m.get("best_val_loss"),
            "best_val_iteration": m.get("best_val_iteration"),
            "final_val_loss": last(vals),
            "final_val_accuracy": last(accs),
            "final_train_loss": last(s.get("train_losses", [])),
            "iterations": m.get("final_iteration"),
            "unit": unit,
            "per_s": m.get(f"{unit}_per_s"),
            "test_accuracy": m.get("test_accuracy"),
            "test_bleu": m.get("test_bleu"),
            "test_bleu_greedy": m.get("test_bleu_greedy"),
            "synthetic": m.get("synthetic_test_accuracy"),
            "ms_per_step": m.get("ms_per_iter"),
            "peak_memory_mib": m.get("peak_memory_mib"),
            "gpu_memory_peak_mib": m.get("gpu_memory_peak_mib"),
            "train_seconds": m.get("train_seconds"),
            "dataset": m.get("dataset"),
        })
    base = next((s for s in steps if s["parameters"]), None)
    for s in steps:
        if base and s["parameters"] and s is not base:
            s["parameters_vs_first"] = s["parameters"] / base["parameters"] - 1.0
            s["flops_vs_first"] = s["flops_per_token"] / base["flops_per_token"] - 1.0
            if s["best_val_loss"] is not None and base["best_val_loss"] is not None:
                s["best_val_loss_vs_first"] = s["best_val_loss"] - base["best_val_loss"]
    summary = {"run": os.path.basename(os.path.normpath(out)), "steps": steps,
               "created_unix": time.time()}
    fronts = pareto_groups(steps)
    if fronts:
        summary["pareto"] = [{"family": g["family"], "dataset": g["dataset"], "x": "kv_cache_bytes_per_token",
                              "y": "best_val_loss", "front": [s["step"] for s in g["front"]],
                              "dominated": {s["step"]: [d["step"] for d in by] for s, by in g["dominated"]}}
                             for g in fronts]
    write_atomic(os.path.join(out, "ablation_summary.json"), json.dumps(summary, indent=1) + "\n")

    has_test = any(s["test_accuracy"] is not None for s in steps)
    has_bleu = any(s["test_bleu"] is not None for s in steps)
    has_cache = any(s["kv_cache_bytes_per_token"] is not None for s in steps)
    has_decode = any(s["decode_tokens_per_s"] is not None for s in steps)
    has_gpu = any(s["gpu_memory_peak_mib"] is not None for s in steps)
    head = (["step", "variant", "params", "MFLOP/tok", "best val", "final val", "val acc"] +
            (["test acc"] if has_test else []) + (["test BLEU"] if has_bleu else []) +
            ["speed", "ms/step", "peak MiB"] + (["GPU MiB"] if has_gpu else []) +
            (["cache B/tok"] if has_cache else []) + (["decode tok/s"] if has_decode else []) + ["status"])
    short = {"tokens": "tok/s", "images": "img/s", "sequences": "seq/s"}
    table = []
    for s in steps:
        params = fmt(s["parameters"], ",d")
        flops = fmt(s["flops_per_token"] and s["flops_per_token"] / 1e6, ".2f")
        if "parameters_vs_first" in s:
            params += f" ({100 * s['parameters_vs_first']:+.1f}%)"
            flops += f" ({100 * s['flops_vs_first']:+.1f}%)"
        speed = fmt(s["per_s"], ",.0f") + (f" {short.get(s['unit'], s['unit'] + '/s')}" if s["per_s"] else "")
        table.append([s["step"], s["variant"], params, flops, fmt(s["best_val_loss"], ".4f"),
                      fmt(s["final_val_loss"], ".4f"), fmt(s["final_val_accuracy"], ".3f")] +
                     ([fmt(s["test_accuracy"], ".4f")] if has_test else []) +
                     ([fmt(s["test_bleu"], ".2f")] if has_bleu else []) +
                     [speed, fmt(s["ms_per_step"], ".1f"), fmt(s["peak_memory_mib"], ".0f")] +
                     ([fmt(s["gpu_memory_peak_mib"], ",.0f" if (s["gpu_memory_peak_mib"] or 0) >= 100 else ".1f")]
                      if has_gpu else []) +
                     ([fmt(s["kv_cache_bytes_per_token"], ",.0f")] if has_cache else []) +
                     ([fmt(s["decode_tokens_per_s"], ",.0f")] if has_decode else []) + [s["status"]])
    widths = [max(len(str(r[i])) for r in [head] + table) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in [head] + table]
    md = ["# Ablation summary: " + summary["run"], "",
          "| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    md += ["| " + " | ".join(str(c) for c in r) + " |" for r in table]
    md += ["", "Parameters and training FLOPs per token in parentheses relative to the first step; val = validation "
               "loss in nats" + ("; peak MiB = the process's peak RSS, GPU MiB = the most GPU memory held at once in kvlab's buffers (the CUDA context and cuBLAS workspace come on top)"
                                 if has_gpu else "") + ("; cache = KV-cache bytes per generated token" if has_cache else "") +
               ("; decode = tokens/s of greedy generation with the KV cache, batch 1, from one token until the "
                "context is full, timed once at the end of training" if has_decode else "") + ".",
           "Curves: ablation_curves.png (loss against training examples and against wall time)."]
    pareto_md, pareto_lines = pareto_report(fronts)
    md += pareto_md
    paper_lines = paper_comparison(steps)
    if paper_lines:
        summary["paper"] = [dict(zip(("step", "variant", "measured", "paper"), row[:4])) for row in paper_lines]
        write_atomic(os.path.join(out, "ablation_summary.json"), json.dumps(summary, indent=1) + "\n")
        md += ["", "## Test accuracy next to the paper's (attention-variants.md section 6)", "",
               "| step | variant | measured | paper | difference |", "|---|---|---|---|---|"]
        md += [f"| {r[0]} | {r[1]} | {fmt(r[2], '.4f')} | {r[3]:.3f} | {fmt(r[4], '+.4f')} |" for r in paper_lines]
    synth_md, synth_lines = synthetic_table(steps, summary)
    if synth_md:
        write_atomic(os.path.join(out, "ablation_summary.json"), json.dumps(summary, indent=1) + "\n")
        md += [""] + synth_md
    write_atomic(os.path.join(out, "ablation_summary.md"), "\n".join(md) + "\n")
    say("")
    say(f"Ablation summary ({os.path.relpath(out, REPO)}/ablation_summary.md):")
    for line in lines:
        say("  " + line)
    if synth_lines:
        say("")
        for line in synth_lines:
            say("  " + line)
    if paper_lines:
        say("  test accuracy vs the paper: " + ", ".join(
            f"{r[1]} {fmt(r[2], '.4f')} (paper {r[3]:.3f})" for r in paper_lines))
    for line in pareto_lines:
        say("  " + line)
    return steps


def pareto_front(points):
    """The points (x, y, ...) that no other point dominates, x and y both costs (lower is better): a point is
    dominated by one that is as low in both and lower in at least one. Equal points do not dominate each other, so
    all of them stay on the front; of two with equal x only the lower y does. Returned by increasing x (then y),
    so the front's losses decrease as its cost grows."""
    def dominates(a, b):
        return a[0] <= b[0] and a[1] <= b[1] and (a[0], a[1]) != (b[0], b[1])
    front = [p for p in points if not any(dominates(q, p) for q in points)]
    return sorted(front, key=lambda p: (p[0], p[1]))


def finite(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


PARETO_PLOT = "ablation_pareto.png"


def pareto_groups(steps):
    """Best validation loss against KV-cache bytes per token, per model family and data set (losses of different
    data do not compare), for groups of at least two steps with both numbers: [{family, dataset, points (steps),
    front (steps, by increasing bytes), dominated [(step, [steps that dominate it])]}]."""
    groups = {}
    for s in steps:
        if finite(s.get("kv_cache_bytes_per_token")) and finite(s.get("best_val_loss")):
            groups.setdefault((s.get("family"), s.get("dataset")), []).append(s)
    out = []
    for (family, dataset), members in groups.items():
        if len(members) < 2:
            continue
        points = [(s["kv_cache_bytes_per_token"], s["best_val_loss"], i) for i, s in enumerate(members)]
        front = pareto_front(points)
        on = {p[2] for p in front}
        dominated = []
        for x, y, i in points:
            if i not in on:
                by = [members[j] for bx, by_, j in front if bx <= x and by_ <= y]
                dominated.append((members[i], by))
        out.append({"family": family, "dataset": dataset, "points": members,
                    "front": [members[p[2]] for p in front], "dominated": dominated})
    return out


def pareto_report(fronts):
    """The markdown section and the console lines of the Pareto fronts (none: nothing to compare)."""
    if not fronts:
        return [], []
    md = ["", "## Pareto front: loss vs KV-cache bytes per token", "",
          "Steps that no other step beats on both best validation loss and KV-cache bytes per token (plot: "
          f"{PARETO_PLOT}), by increasing cache size:"]
    lines = []
    for g in fronts:
        where = f"{g['family'] or '?'} on {g['dataset'] or '?'}"
        if len(fronts) > 1:
            md += ["", f"### {where}"]
        decode = any(s.get("decode_tokens_per_s") is not None for s in g["front"])
        head = ["step", "variant", "cache B/tok", "best val"] + (["decode tok/s"] if decode else [])
        md += ["", "| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        for s in g["front"]:
            md.append(f"| {s['step']} | {s['variant']} | {fmt(s['kv_cache_bytes_per_token'], ',.0f')} | "
                      f"{fmt(s['best_val_loss'], '.4f')} |" +
                      (f" {fmt(s.get('decode_tokens_per_s'), ',.0f')} |" if decode else ""))
        md += ["", "Dominated (another step has as little cache and as low a loss, and less of one):" +
               ("" if g["dominated"] else " none.")]
        md += [f"- {s['step']} {s['variant']}: by " + ", ".join(f"{d['step']} {d['variant']}" for d in by)
               for s, by in g["dominated"]]
        lines.append(f"Pareto front, loss vs KV-cache bytes/token ({where}): " +
                     ", ".join(f"{s['step']} {s['variant']}" for s in g["front"]) +
                     ("; dominated: " + ", ".join(f"{s['step']} {s['variant']}" for s, _ in g["dominated"])
                      if g["dominated"] else ""))
    return md, lines


def synthetic_table(steps, summary):
    """The paper's layout: tasks x variants of mean test token accuracy (over seeds), the
    paper's number beside each, and the mean over tasks. Returns (markdown, text lines)."""
    cols = [s for s in steps if isinstance(s.get("synthetic"), dict) and s["synthetic"]]
    if not cols:
        return [], []
    tasks = [t for t in SYNTH_TASKS if any(t in s["synthetic"] for s in cols)]
    head = ["task"] + [s["variant"] for s in cols]
    rows, table = [], {}
    for t in tasks + ["average"]:
        row = [t]
        for s in cols:
            if t == "average":
                vals = [s["synthetic"][k] for k in tasks if s["synthetic"].get(k) is not None]
                got = sum(vals) / len(vals) if len(vals) == len(tasks) else None
                ref_vals = [PAPER_SYNTH[k][SYNTH_VARIANTS.index(s["variant"])] for k in tasks] \
                    if s["variant"] in SYNTH_VARIANTS else []
                ref = sum(ref_vals) / len(ref_vals) if ref_vals else None
            else:
                got = s["synthetic"].get(t)
                ref = PAPER_SYNTH[t][SYNTH_VARIANTS.index(s["variant"])] if s["variant"] in SYNTH_VARIANTS else None
            table.setdefault(s["step"], {})[t] = {"measured": got, "paper": ref}
            row.append(fmt(got, ".3f") + (f" ({ref:.3f})" if ref is not None else ""))
        rows.append(row)
    summary["synthetic_table"] = table
    md = ["## Synthetic tasks: mean test token accuracy over seeds (the paper's Table 1 in parentheses)", "",
          "| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    md += ["| " + " | ".join(r) + " |" for r in rows]
    md += ["", "The paper averages over its sweep of model sizes and lengths (attention-variants.md 7.1); "
               "this run uses one configuration, so compare rankings more than absolute values."]
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    lines = ["Synthetic tasks: test token accuracy, mean over seeds (paper in parentheses)"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in [head] + rows]
    return md, lines


def paper_comparison(steps):
    """(step, variant, measured, paper, difference) for steps the paper reports."""
    rows = []
    for s in steps:
        ref = PAPER.get((s.get("family"), s.get("dataset")), {})
        if s["variant"] in ref:
            got = s["test_accuracy"]
            rows.append((s["step"], s["variant"], got, ref[s["variant"]],
                         None if got is None else got - ref[s["variant"]]))
    return rows


_PYPLOT = []


def pyplot():
    """matplotlib.pyplot with the Agg backend, or None (one warning) when matplotlib is missing."""
    if not _PYPLOT:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            say("warning: matplotlib is missing, no plots (hint: apt-get install python3-matplotlib)")
            plt = None
        _PYPLOT.append(plt)
    return _PYPLOT[0]


def save_figure(plt, fig, path):
    tmp = f"{path}.tmp.{os.getpid()}"
    fig.savefig(tmp, dpi=110, format="png")
    os.replace(tmp, path)
    plt.close(fig)


def legend(ax, **kw):
    """The axes' legend, when something on them has a label (matplotlib warns about an empty one)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kw)


def plot(out, rows):
    """ablation_curves.png: training and validation loss of every step that has a curve, against training
    units and wall time. None when no step has one (all failed before they logged)."""
    runs = [(i, sid, cfg, load_json(os.path.join(out, f"training_metrics_step{sid}.json")))
            for i, (sid, _status, cfg) in enumerate(rows)]
    runs = [r for r in runs if r[3] and (r[3].get("metrics", {}).get("train_losses") or
                                         r[3].get("metrics", {}).get("val_losses"))]
    if not runs:
        say("Plots: none, no step has a loss curve")
        return
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    unit = "tokens"
    for i, sid, cfg, m in runs:
        s = m.get("metrics", {})
        unit = m.get("unit", "tokens")
        color = f"C{i % 10}"
        label = f"{sid} ({m.get('variant_label', variant_label(cfg))})"
        for ax, key_train, key_val in ((axes[0], unit, "val_" + unit),
                                       (axes[1], "timestamps", "val_timestamps")):
            xs, ys = s.get(key_train, []), s.get("train_losses", [])
            if xs and ys:
                ax.plot(xs, ys, color=color, alpha=0.35, linewidth=1)
            xs, ys = s.get(key_val, []), s.get("val_losses", [])
            if xs and ys:
                ax.plot(xs, ys, color=color, marker="o", markersize=3, linewidth=1.8, label=label + " val")
    axes[0].set_xlabel(f"training {unit}")
    axes[1].set_xlabel("wall time (s)")
    for ax in axes:
        ax.set_ylabel("loss (nats)")
        ax.grid(alpha=0.3)
        legend(ax, fontsize=8)
    fig.suptitle(f"{os.path.basename(os.path.normpath(out))}: training (thin) and validation (dots) loss")
    fig.tight_layout()
    path = os.path.join(out, "ablation_curves.png")
    save_figure(plt, fig, path)
    say(f"Plots: {os.path.relpath(path, REPO)}")


def plot_pareto(out, steps):
    """ablation_pareto.png: best validation loss against KV-cache bytes per token, one point per step labelled
    with its variant, the Pareto front as a step line; one panel per family and data set. Nothing when no group
    has two steps with both numbers. Returns the path written, or None."""
    fronts = pareto_groups(steps)
    if not fronts:
        return None
    plt = pyplot()
    if plt is None:
        return None
    from matplotlib.ticker import FuncFormatter, NullFormatter
    fig, axes = plt.subplots(1, len(fronts), figsize=(6.5 * len(fronts), 4.8), squeeze=False)
    for ax, g in zip(axes[0], fronts):
        labels = [s["variant"] for s in g["points"]]
        on = {id(s) for s in g["front"]}
        for s in g["points"]:
            x, y = s["kv_cache_bytes_per_token"], s["best_val_loss"]
            front = id(s) in on
            ax.plot([x], [y], marker="o", markersize=7, linestyle="none", color="C0" if front else "0.55",
                    markerfacecolor="C0" if front else "none")
            label = s["variant"] if labels.count(s["variant"]) == 1 else f"{s['variant']} ({s['step']})"
            right = x == max(p["kv_cache_bytes_per_token"] for p in g["points"])  # its label to the left
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(-6 if right else 6, 5), fontsize=9,
                        ha="right" if right else "left", color="black" if front else "0.4")
        fx = [s["kv_cache_bytes_per_token"] for s in g["front"]]
        fy = [s["best_val_loss"] for s in g["front"]]
        ax.step(fx, fy, where="post", color="C0", linewidth=1.5, label="Pareto front")
        xs = [s["kv_cache_bytes_per_token"] for s in g["points"]]
        if min(xs) > 0 and max(xs) / min(xs) > 4:  # a wide range: equal ratios, equal distances
            ax.set_xscale("log")
        ax.set_xticks(sorted(set(xs)))  # the sizes the steps have, written out
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _p: f"{v:,.0f}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.margins(x=0.15, y=0.15)
        ax.set_xlabel("KV-cache bytes per token")
        ax.set_ylabel("best validation loss (nats)")
        ax.set_title(f"{g['family'] or '?'} on {g['dataset'] or '?'}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{os.path.basename(os.path.normpath(out))}: loss against KV-cache size (filled: on the front)")
    fig.tight_layout()
    path = os.path.join(out, PARETO_PLOT)
    save_figure(plt, fig, path)
    say(f"Pareto plot: {os.path.relpath(path, REPO)}")
    return path


def main():
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_stop_signal)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", required=True, help="build/<run name>")
    ap.add_argument("--out", required=True, help="<output folder>/<run name>")
    ap.add_argument("--steps", required=True)
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    remove_stale_temp_files(out)
    steps = args.steps.split()
    plan = []
    for step in steps:
        build_dir = os.path.abspath(os.path.join(args.build, step))
        cfg = load_json(os.path.join(build_dir, "include", "generated", "config.json"))
        cfg_text = read_text(os.path.join(build_dir, ".config"))
        if cfg is None or cfg_text is None:
            say(f"error: step {step} has no build in {build_dir} (hint: run make build first)")
            return 1
        families = [f for sym, f in FAMILIES.items() if cfg.get(sym)]
        if not families:
            say(f"error: step {step} enables no model family (hint: enable one under 'Model families' in "
                "make menuconfig)")
            return 1
        for fam in families:
            sid = step if len(families) == 1 else f"{step}-{fam['name']}"
            plan.append((step, sid, fam, build_dir, cfg, cfg_text))
    say(f"kvlab run '{os.path.basename(out)}': {len(plan)} step(s) -> {os.path.relpath(out, REPO)}/")
    for step, sid, fam, _b, cfg, _t in plan:
        say(f"  {sid}: {fam['name']}, attention {variant_label(cfg)}")
    rows, failed = [], 0
    t0 = time.time()
    for step, sid, fam, build_dir, cfg, cfg_text in plan:
        status = "not started" if Stop.signal else run_step(step, sid, fam, build_dir, cfg, cfg_text, out, args.force)
        if Stop.signal:
            say(stopped_message(sid, step_files(out, sid, fam["name"]), status))
            return 128 + Stop.signal
        failed += status == "failed"
        rows.append((sid, status, cfg))
    steps = summarise(out, rows)
    plot(out, rows)
    plot_pareto(out, steps)
    say(f"Run time {time.time() - t0:.0f} s; outputs in {os.path.relpath(out, REPO)}/")
    if failed:
        say(f"error: {failed} of {len(rows)} step(s) failed: {failed_line(out)}")
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except OSError as e:  # e.g. a read-only or full output folder: one line, not a traceback
        print(f"error: {e.filename or 'output'}: {e.strerror} (hint: CONFIG_OUTPUT_DIR must be a folder you can "
              "write to, with space left)", file=sys.stderr)
        sys.exit(1)
