#!/usr/bin/python3
"""make mechint: analyse every checkpoint of a run folder.

For each final_model_step*.safetensors and best_model_step*.safetensors in
the run folder (MODELS=<folder>, default: the most recent run under the
configured output folder), this
  1. reads the checkpoint's own resolved configuration from its metadata,
  2. builds mechint/mechint with it (plus the MECHINT_* options of the
     current .config) in build/mechint/<config hash>/, so the analysis runs
     the trainer's own specialised model code,
  3. runs `mechint analyze`, writing <run>/mechint/<checkpoint>/report.json
     and report.md, then draws the plots from report.json,
  4. when the step was trained with W&B tracking, attaches the summary
     numbers and the report files to that step's W&B run (`mechint attach`),
and finally writes <run>/mechint/comparison.{md,json,png} across the
checkpoints (final models), relative to the first step (e.g. V0).
A file that is not a kvlab checkpoint gets a one-line error; the others are
still analysed, and the exit status says something failed.
"""
import argparse
import hashlib
import json
import math
import os
import re
import struct
import subprocess
import sys
import zlib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = "/usr/bin/python3"
KCONFIG = [PY, os.path.join(REPO, "scripts", "kconfig.py")]


def err(msg):
    print(f"error: {msg}", file=sys.stderr)


def with_hint(msg, hint):
    """msg with hint added: into msg's own "(hint: ...)" at its end, so that a line carries one (lib/common.h's
    err_with_hint)."""
    if msg.endswith(")") and "(hint: " in msg:
        return f"{msg[:-1]}; {hint})"
    return f"{msg} (hint: {hint})"


def read_config(path):
    """.config values by name; a bool switched off (an "is not set" comment line) reads as "n"."""
    vals = {}
    if os.path.exists(path):
        for line in open(path):
            m = re.match(r"^CONFIG_(\w+)=(.*)$", line.strip())
            off = re.match(r"^# CONFIG_(\w+) is not set$", line.strip())
            if m:
                vals[m.group(1)] = m.group(2)
            elif off:
                vals[off.group(1)] = "n"
    return vals


def st_metadata(path):
    """The safetensors header's __metadata__ and its parsed "config", or raise ValueError naming the problem."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("truncated (shorter than a safetensors header)")
        n = struct.unpack("<Q", head)[0]
        if n == 0 or n > size - 8 or n > 100_000_000:
            raise ValueError(f"header length {n} does not fit in the file ({size} bytes): not safetensors or corrupt")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError):
            raise ValueError("header is not JSON: not safetensors or corrupt")
    if not isinstance(header, dict):
        raise ValueError(f"header is a JSON {type(header).__name__}, not an object: not safetensors or corrupt")
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError("__metadata__ is not an object of strings: not safetensors or corrupt")
    if meta.get("framework") != "kvlab":
        raise ValueError("not a kvlab checkpoint (no kvlab metadata)")
    end = 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        offsets = t.get("data_offsets") if isinstance(t, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(x) is int for x in offsets)):
            raise ValueError(f"tensor {name!r} has no valid data_offsets: corrupt")
        end = max(end, offsets[1])
    if 8 + n + end > size:
        raise ValueError(f"truncated: tensors end at byte {8 + n + end}, the file has {size}")
    try:
        cfg = json.loads(meta.get("config", ""))
    except ValueError:
        raise ValueError("metadata 'config' is not valid JSON: the file is damaged (hint: use another checkpoint "
                         "of the step)")
    if not isinstance(cfg, dict):
        raise ValueError("metadata 'config' is not a JSON object: corrupt")
    return meta, cfg


def st_tensors(path):
    """The tensors of a kvlab checkpoint as numpy arrays by name, its metadata and its build configuration; the
    header is checked by st_metadata. Raises ValueError (naming the problem) or OSError."""
    import numpy as np  # only the readers of tensors need it
    meta, cfg = st_metadata(path)
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    # each tensor against its CRC-32 in metadata tensor_crc32 and for finite values, as the C loader does
    # (train/checkpoint.c): a flipped bit must not reach an export
    crcs = None
    if "tensor_crc32" in meta:
        try:
            crcs = json.loads(meta["tensor_crc32"])
        except ValueError:
            pass
        if not isinstance(crcs, dict):
            raise ValueError("metadata 'tensor_crc32' is not a JSON object: the header was damaged or edited")
    tensors = {}
    for name, e in header.items():
        if e.get("dtype") != "F32":
            raise ValueError(f"tensor {name!r} is {e.get('dtype')}, kvlab writes F32")
        shape = e.get("shape")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise ValueError(f"tensor {name!r} has no valid shape: corrupt")
        b, end = e["data_offsets"]
        data = raw[8 + n + b:8 + n + end]
        if len(data) != 4 * math.prod(shape):
            raise ValueError(f"tensor {name!r}: {len(data)} bytes for shape {shape}: corrupt")
        if crcs is not None:
            want, got = crcs.get(name), f"{zlib.crc32(data):08x}"
            if want != got:
                raise ValueError(f"tensor {name!r} does not match its checksum (CRC-32 {got}, the file says {want}): "
                                 "its bytes changed after the checkpoint was written")
        t = np.frombuffer(data, dtype=np.float32).reshape(shape)
        if not np.isfinite(t).all():
            raise ValueError(f"tensor {name!r} holds a non-finite value at index {int(np.argmin(np.isfinite(t)))}: "
                             "the run that wrote it diverged")
        tensors[name] = t
    return tensors, meta, cfg


def gpt2_checkpoint(path):
    """A kvlab GPT-2 checkpoint: its tensors (st_tensors), metadata, build configuration and model description
    (metadata "model"). Raises ValueError naming what is wrong, or OSError."""
    tensors, meta, cfg = st_tensors(path)
    if meta.get("family") != "gpt2":
        raise ValueError(f"not a kvlab GPT-2 checkpoint (metadata family '{meta.get('family')}')")
    try:
        model = json.loads(meta["model"])
    except (KeyError, ValueError):
        raise ValueError("metadata 'model' is missing or not JSON") from None
    return tensors, meta, cfg, model


def config_lines(cfg_json):
    out = []
    for k, v in sorted(cfg_json.items()):
        if isinstance(v, bool):
            out.append(f"CONFIG_{k}=y" if v else f"# CONFIG_{k} is not set")
        elif isinstance(v, (int, float)):
            out.append(f"CONFIG_{k}={v}")
        elif isinstance(v, str):  # .config's escaping (kconfiglib's), not JSON's: free text arrives as it was
            out.append(f"CONFIG_{k}=\"" + v.replace("\\", "\\\\").replace('"', '\\"') + '"')
        else:
            out.append(f"CONFIG_{k}=" + json.dumps(v))  # not a configuration value: kconfig.py refuses it
    return out


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def latest_run(outdir):
    best, when = None, -1
    if not os.path.isdir(outdir):
        return None
    for name in os.listdir(outdir):
        d = os.path.join(outdir, name)
        if not os.path.isdir(d):
            continue
        cks = [f for f in os.listdir(d) if f.endswith(".safetensors") and re.match(r"(final|best)_model_step", f)]
        if not cks:
            continue
        t = max(os.path.getmtime(os.path.join(d, f)) for f in cks)
        if t > when:
            best, when = d, t
    return best


def passthrough_stderr(cmd):
    """Runs cmd (its stdout is ours), copying its stderr to ours as it comes, bytes as they are (a progress line
    rewritten with \\r stays one line); returns (exit status, the stderr text)."""
    p = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.PIPE)
    seen = []
    while True:
        chunk = os.read(p.stderr.fileno(), 65536)
        if not chunk:
            break
        sys.stderr.buffer.write(chunk)
        sys.stderr.buffer.flush()
        seen.append(chunk)
    p.stderr.close()
    return p.wait(), b"".join(seen).decode("utf-8", "replace")


def build(cfg, cur, sanitize):
    """Builds mechint for a checkpoint's configuration; returns the binary path."""
    cfg = {k: v for k, v in cfg.items() if not k.startswith("MECHINT_")}
    base = "\n".join(config_lines(cfg)) + "\n"
    # switched-off analyses must reach the build too, or they fall back to their default (on)
    frag = "".join(f"# CONFIG_{k} is not set\n" if v == "n" else f"CONFIG_{k}={v}\n"
                   for k, v in sorted(cur.items()) if k.startswith("MECHINT_"))
    key = hashlib.sha256((base + frag + str(sanitize)).encode()).hexdigest()[:16]
    bdir = os.path.join(REPO, "build", "mechint", key)
    os.makedirs(bdir, exist_ok=True)
    for name, text in (("base.config", base), ("mechint.fragment", frag)):
        p = os.path.join(bdir, name)
        if not os.path.exists(p) or open(p).read() != text:
            with open(p, "w") as f:
                f.write(text)
    r = subprocess.run(KCONFIG + ["step", bdir, os.path.join(bdir, "base.config"), os.path.join(bdir, "mechint.fragment")],
                       cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        why = re.sub(r"^error: ", "", r.stderr.strip())
        raise RuntimeError(with_hint(f"the checkpoint's configuration does not resolve with this Kconfig: {why}",
                                     "it was written by another kvlab version"))
    cmd = ["make", "-s", "-f", "scripts/Makefile.build", f"B={bdir}", "MECHINT=y", f"{bdir}/mechint/mechint"]
    if sanitize:
        cmd.append("SANITIZE=1")
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError("building mechint failed:\n" + r.stdout[-2000:] + r.stderr[-3000:])
    return os.path.join(bdir, "mechint", "mechint")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=os.environ.get("MODELS", ""))
    ap.add_argument("--config", default=os.environ.get("KCONFIG_CONFIG", os.path.join(REPO, ".config")))
    ap.add_argument("--sanitize", action="store_true", default=os.environ.get("SANITIZE") == "1")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args()
    cur = read_config(args.config)
    outdir = json.loads(cur.get("OUTPUT_DIR", '"output"')) if cur.get("OUTPUT_DIR") else "output"
    if not os.path.isabs(outdir):
        outdir = os.path.join(REPO, outdir)
    run = args.models or latest_run(outdir)
    if not run or not os.path.isdir(run):
        err(f"no run folder to analyse ({args.models or outdir}) (hint: train first with make, or pass MODELS=<folder>)")
        return 1
    files = sorted(f for f in os.listdir(run) if f.endswith(".safetensors") and not f.startswith("state_step"))
    if not files:
        err(f"{run}: no checkpoints (*.safetensors) (hint: MODELS=<a run folder under output/>)")
        return 1
    print(f"mechint: {len(files)} checkpoint(s) in {run}")
    failed, reports = 0, []
    for name in files:
        path = os.path.join(run, name)
        stem = name[:-len(".safetensors")]
        try:
            meta, cfg = st_metadata(path)
        except (ValueError, OSError) as e:
            err(with_hint(f"{path}: {e}", "mechint reads the checkpoints kvlab writes; move other .safetensors files "
                          "out of the folder, or train again for a damaged one"))
            failed += 1
            continue
        out = os.path.join(run, "mechint", stem)
        try:
            binary = build(cfg, cur, args.sanitize)
        except (RuntimeError, OSError) as e:
            err(f"{path}: {e}")
            failed += 1
            continue
        try:
            os.makedirs(out, exist_ok=True)
        except OSError as e:
            err(f"{path}: cannot create the report folder {out}: {e.strerror} (hint: the run folder must be writable; "
                "copy the checkpoints elsewhere and pass MODELS=<that folder>)")
            failed += 1
            continue
        print(f"== {name}: {meta.get('family')} {meta.get('variant')} (step {meta.get('ablation_step', '-')})", flush=True)
        # its stderr (progress included) passes through as it comes; where the analyzer's own error line names the
        # checkpoint, that line is the failure's one line, else (a crash, say) ours follows it
        rc, said = passthrough_stderr([binary, "analyze", "--ckpt", path, "--out", out, "--sha256", sha256(path)])
        if rc != 0:
            if not any(x.startswith("error:") and path in x for x in said.splitlines()):
                err(f"{path}: analysis failed (exit {rc}) (hint: its messages are above; make mechint "
                    "SANITIZE=1 finds a crash's cause)")
            failed += 1
            continue
        try:
            with open(os.path.join(out, "report.json")) as f:
                rep = json.load(f)
        except (OSError, ValueError) as e:
            err(f"{path}: the analysis wrote no readable report.json ({e})")
            failed += 1
            continue
        reports.append((stem, rep))
        if not args.no_plots:
            subprocess.run([PY, os.path.join(REPO, "scripts", "mechint_plots.py"), "report", out], cwd=REPO)
        print(f"   -> {out}/report.md")
        m = re.match(r"(final|best)_model_step(.+)$", stem)
        if m:  # the step's W&B run, when it was tracked, gets the numbers and plots
            r = subprocess.run([binary, "attach", "--run-dir", run, "--step", m.group(2), "--report", out,
                                "--kind", m.group(1)], cwd=REPO)
            if r.returncode != 0:
                err(f"{path}: the results could not be attached to the W&B run (the reports are written)")
    finals = [(s, r) for s, r in reports if s.startswith("final_model")] or reports
    if len(finals) >= 2:
        cmd = [PY, os.path.join(REPO, "scripts", "mechint_plots.py"), "compare", os.path.join(run, "mechint")]
        cmd += [os.path.join(run, "mechint", s) for s, _ in finals]
        if args.no_plots:
            cmd.insert(3, "--no-plots")
        subprocess.run(cmd, cwd=REPO, check=False)
        print(f"comparison: {os.path.join(run, 'mechint', 'comparison.md')}")
    if failed:
        done = f"reports written for the other {len(reports)}" if reports else "no report was written"
        err(f"{failed} of {len(files)} checkpoint(s) could not be analysed ({done}; each one's error is above)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
