#!/usr/bin/python3
"""make bench: training-step speed of every attention variant against this
machine's sgemm rate, measured in one run.

On a GPU (--target cuda, make bench TARGET=cuda; --precision tf32, bf16 (mixed
precision: bf16 activations and products) or bf16-matmul (bf16 products on
float32 activations), make bench PRECISION=..., for tensor cores)
the same programs are built for the GPU of this machine (CUDA_NATIVE); the
reference is then cuBLAS's matmul at 2048^3, and each record adds the GPU's
peak memory and its MFU: achieved model FLOP/s over the dense peak of the
GPU at the build's precision (GPU_PEAKS, named in the table and the JSON).

Builds bench/bench_step once per variant of kernels/attention.tbl (and its
+Pos form where a step fragment exists: KV+Pos, K+Pos), runs them
round-robin for a few rounds so that machine noise hits every variant alike. Every bench process also measures this machine's
2048^3 sgemm rate, before and after its steps. Interference from other
processes on a shared machine only ever slows a measurement down, so the
primary figures compare best with best: the fastest step of each variant
against the fastest sgemm of the run; medians are recorded beside them.
Writes output/bench/bench.json (one record per variant) and prints the table.

With --against DIR, another checkout's benchmark (e.g. a git worktree of an
older commit) runs beside this one's in every round, and each variant's
step time is compared: output/bench/against.json.

With --profile, the last round's steps are followed by a few more under the
backend's profile (kernels.h, kprof_start: every op of the interface timed
on the device's own clock; on a GPU also every kernel and cuBLAS product
inside them), and the table of where a step's time goes is printed for all
variants side by side: output/bench/profile.json.

With --peer torch, scripts/bench_torch.py (kvlab's model in PyTorch, eager;
with --peer-compile also torch.compile) runs each variant of the table
beside kvlab's in every round, on the same device at the same shape and
precision, and each is compared best against best: output/bench/peer.json.

Data-parallel scaling (docs/distributed.md): bench/bench_dp, built with
MPI, trains the same global batch as 1 process x 1 thread, 1 process x
2 threads and 2 processes x 1 thread (mpirun), interleaved round by round;
each step's time is split into compute, the wait for the slowest rank and
the all-reduce of the gradients (the communication cost per step); a fourth
setup sums the gradients of 2 x 1 in buckets of --bucket-kib KiB started
during the backward pass (CONFIG_DIST_BUCKET_KIB), so the all-reduce column
is what the overlap leaves.
Writes output/bench/dp.json.

Decode (make bench-decode, --only decode): bench/bench_decode, built once per
configuration of DECODE_CONFIGS (every row of kernels/attention.tbl, and
with grouped (GQA, H/2) and multi-query (MQA, 1) K/V heads where Kconfig
offers CONFIG_ATTN_KV_HEADS), generates greedily through GPT-2's KV-cache
decoder and times the tokens before context 128, 512 and the maximum; each
run checks that the cache allocates exactly kv_cache_bytes_per_token per
token. Round-robin like the others; writes output/bench/decode.json.

usage: scripts/bench.py [--rounds N] [--steps N] [--shape L H C T B V] [--profile] [--against DIR]
                        [--peer torch [--peer-compile]]
                        [--only variants|dp|decode] [--bucket-kib N]
                        [--target cpu|cuda] [--precision fp32|tf32|bf16|bf16-matmul]
                        [--decode-shape L H C T V] [--tokens N] [--reps N] [--threads N] [--configs A,B] [--out DIR] [--build DIR]
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time

import attention_tbl

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = "/usr/bin/python3"


def round_robin(rounds, names, run, describe):
    """run(name) for every name, round after round, so that machine noise hits them alike; prints
    describe(name, record) after each. Returns {name: [its records, one per round]}."""
    runs = {name: [] for name in names}
    for rnd in range(rounds):
        for name in names:
            rec = run(name)
            runs[name].append(rec)
            print(f"  round {rnd + 1}/{rounds} {describe(name, rec)}", flush=True)
    return runs


def bench_variants():
    """(name, step fragment, name without +Pos or None) of every row of kernels/attention.tbl, each followed by
    its +Pos form where defconfigs/steps/ has a fragment for it (<ID>_POS)."""
    pos = next(m for m in attention_tbl.modifiers() if m["kconfig"] == "ATTN_POS")
    out = []
    for row in attention_tbl.variants():
        out.append((row["name"], row["id"], None))
        if os.path.isfile(os.path.join(REPO, "defconfigs", "steps", row["id"] + "_POS")):
            out.append((row["name"] + pos["name"], row["id"] + "_POS", row["name"]))
    return out


VARIANTS = bench_variants()
BASELINE = attention_tbl.variants()[0]["name"]  # the first row (standard attention) is what the others are compared to


# Dense peak throughput in TFLOP/s of the GPUs kvlab knows, from NVIDIA's datasheets (their tensor-core
# figures "with sparsity" halved): fp32 on the CUDA cores (kvlab's fp32 builds keep cuBLAS off the tensor
# cores), tf32 and bf16 on the tensor cores. The first pattern that matches the device name wins.
GPU_PEAKS = [
    (r"\bH100 PCIe", "H100 PCIe", {"fp32": 51.0, "tf32": 378.0, "bf16": 756.5}),
    (r"\bH100 NVL", "H100 NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5}),
    (r"\bH100\b", "H100 SXM", {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5}),
    (r"\bH200 NVL", "H200 NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5}),
    (r"\bGH200\b", "GH200", {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5}),
    (r"\bH200\b", "H200", {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5}),
    (r"\bA100\b", "A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0}),
    (r"\bL4\b", "L4", {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0}),
]


def gpu_peak(backend):
    """(GPU, precision, TFLOP/s) of a CUDA backend_name() ("cuda (NVIDIA H100 80GB HBM3, sm_90, fp32, cuBLAS)"),
    or None for the CPU or a GPU without a known peak."""
    if not backend.startswith("cuda ("):
        return None
    precision = "tf32" if "tf32" in backend else "bf16" if "bf16" in backend else "fp32"
    for pattern, name, peaks in GPU_PEAKS:
        if re.search(pattern, backend):
            return name, precision, peaks[precision]
    return None


TARGETS = {"cpu": "", "cuda": "CONFIG_TARGET_CUDA=y\nCONFIG_CUDA_NATIVE=y\n"}
# the GPU precision choice of kernels/Kconfig per --precision: bf16 is mixed precision (bf16 activations and
# products), bf16-matmul bf16 products on float32 activations
PRECISIONS = {"fp32": "CONFIG_CUDA_FP32=y\n", "tf32": "CONFIG_CUDA_TF32=y\n", "bf16": "CONFIG_CUDA_BF16=y\n",
              "bf16-matmul": "CONFIG_CUDA_BF16_MATMUL=y\n"}


def target_name(target, precision):
    return target if target == "cpu" else f"{target}-{precision}"


def target_fragment(repo, target, precision):
    """The configuration fragment that picks the compute target (empty for the CPU, the base's) and precision."""
    text = TARGETS[target] + (PRECISIONS[precision] if target != "cpu" else "")
    path = os.path.join(repo, "build", "bench", f"target-{target_name(target, precision)}")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}"  # builds run side by side: readers see a whole file
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return path


def build(variant, fragment, repo=REPO, target="cpu", precision="fp32", jobs=None):
    """bench/bench_step of one variant, built in repo (this checkout, or the one --against names) with make -j jobs
    (default: one per core)."""
    bdir = os.path.join(repo, "build", "bench", variant if target == "cpu" else
                        f"{target_name(target, precision)}-{variant}")
    base = os.path.join(repo, "tests", "configs", "base")
    subprocess.run([PY, "scripts/kconfig.py", "step", bdir, base, os.path.join("defconfigs", "steps", fragment),
                    target_fragment(repo, target, precision)], cwd=repo, check=True)
    subprocess.run(["make", f"-j{jobs or os.cpu_count() or 2}", "-s", "-f", "scripts/Makefile.build", f"B={bdir}",
                    "BENCH=y"], cwd=repo, check=True, stdout=subprocess.DEVNULL)
    return os.path.join(bdir, "bench", "bench_step")


def build_all(jobs_list, target, precision):
    """build() of every (key, variant, fragment, repo), several side by side on a machine with many cores (two
    cores a build; a GPU machine's time is short). Returns {key: binary}."""
    import concurrent.futures
    cores = os.cpu_count() or 2
    workers = max(1, min(len(jobs_list), cores // 2))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = {key: pool.submit(build, variant, frag, repo, target, precision, max(1, cores // workers))
                   for key, variant, frag, repo in jobs_list}
        return {key: f.result() for key, f in futures.items()}


def run_bench(binary, shape, steps, profile=False):
    r = subprocess.run([binary] + (["--profile"] if profile else []) + [str(x) for x in shape] + [str(steps)], cwd=REPO,
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{binary} failed: {r.stderr.strip()}")
    return json.loads(r.stdout)


# (label, processes, threads per process, gradient buckets) of the data-parallel benchmark; the first is the
# reference. Buckets None: one gradient sum after the backward pass; "bucket": buckets of --bucket-kib KiB started
# during it (train/grad_sync.h, CONFIG_DIST_BUCKET_KIB)
DP_SETUPS = [("1 process x 1 thread", 1, 1, None), ("1 process x 2 threads", 1, 2, None),
             ("2 processes x 1 thread", 2, 1, None), ("2 x 1, overlapped buckets", 2, 1, "bucket")]


def build_dp():
    """bench/bench_dp: the first variant's configuration with MPI data parallelism."""
    bdir = os.path.join(REPO, "build", "bench", "dp")
    base = os.path.join(REPO, "tests", "configs", "base")
    subprocess.run([PY, "scripts/kconfig.py", "step", bdir, base, os.path.join("defconfigs", "steps", VARIANTS[0][1]),
                    os.path.join("tests", "configs", "mpi")], cwd=REPO, check=True)
    subprocess.run(["make", f"-j{os.cpu_count() or 2}", "-s", "-f", "scripts/Makefile.build", f"B={bdir}",
                    "BENCH=y"], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return os.path.join(bdir, "bench", "bench_dp")


def run_dp(binary, procs, threads, bucket_kib, shape, steps):
    cmd = ["mpirun"] + (["--allow-run-as-root"] if os.geteuid() == 0 else []) + \
          ["-np", str(procs), "--oversubscribe", "--bind-to", "none", "-x", f"OMP_NUM_THREADS={threads}", binary] + \
          [str(x) for x in shape] + [str(steps), str(threads), str(bucket_kib)]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def bench_dp(args):
    """Data-parallel scaling on this machine, every setup in every round (noise hits them alike)."""
    if not shutil.which("mpirun"):
        print("error: no mpirun (hint: scripts/deps.sh installs openmpi-bin)", file=sys.stderr)
        return 1
    print("  building bench_dp (MPI)", flush=True)
    binary = build_dp()
    setups = {label: (procs, threads, args.bucket_kib if buckets else 0) for label, procs, threads, buckets in DP_SETUPS}
    try:
        runs = round_robin(args.rounds, list(setups),
                           lambda label: run_dp(binary, *setups[label], args.shape, args.steps),
                           lambda label, rec: f"{label:26s} best {min(rec['step_ms']):8.1f} ms/step, all-reduce "
                                              f"median {statistics.median(rec['allreduce_ms']):7.2f} ms")
    except RuntimeError as e:
        print(f"error: data-parallel benchmark: {e}", file=sys.stderr)
        return 1
    records = []
    for label, procs, threads, _ in DP_SETUPS:
        rs = runs[label]
        steps = [x for r in rs for x in r["step_ms"]]
        comm = [x for r in rs for x in r["allreduce_ms"]]
        wait = [x for r in rs for x in r["wait_ms"]]
        comp = [x for r in rs for x in r["compute_ms"]]
        tokens = rs[0]["tokens_per_step"]
        records.append({"setup": label, "processes": procs, "threads_per_process": threads,
                        "bucket_kib": rs[0]["bucket_kib"], "buckets": rs[0]["buckets"],
                        "buckets_overlapped": rs[0]["buckets_overlapped"],
                        "ms_per_step": round(min(steps), 2), "ms_per_step_median": round(statistics.median(steps), 2),
                        "tokens_per_s": round(tokens / (min(steps) / 1e3), 1),
                        "compute_ms_median": round(statistics.median(comp), 2),
                        "wait_ms_median": round(statistics.median(wait), 3),
                        "allreduce_ms_median": round(statistics.median(comm), 3),
                        "allreduce_ms_best": round(min(comm), 3),
                        "gradient_bytes": rs[0]["gradient_bytes"], "parameters": rs[0]["parameters"],
                        "shape": rs[0]["shape"], "step_ms": steps, "allreduce_ms": comm, "wait_ms": wait})
    ref = records[0]
    for r in records:
        r["speedup_vs_1x1"] = round(ref["ms_per_step"] / r["ms_per_step"], 3)
        r["speedup_vs_1x1_median"] = round(ref["ms_per_step_median"] / r["ms_per_step_median"], 3)
        r["communication_share"] = round(r["allreduce_ms_median"] / r["ms_per_step_median"], 4)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "dp.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"cpus": len(os.sched_getaffinity(0)), "rounds": args.rounds, "steps": args.steps,
                   "setups": records}, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)
    sh = ref["shape"]
    print(f"\ndata-parallel scaling: GPT-2 L={sh['L']} H={sh['H']} C={sh['C']} T={sh['T']}, global batch "
          f"B={sh['B']}, {ref['parameters']:,} parameters ({ref['gradient_bytes'] / 2**20:.1f} MiB of gradients per "
          f"all-reduce); {len(os.sched_getaffinity(0))} cores; best step of each setup (medians in dp.json)")
    print(f"{'setup':26s} {'ms/step':>9s} {'median':>9s} {'tok/s':>9s} {'speedup':>8s} {'compute':>9s} "
          f"{'wait':>8s} {'all-reduce':>11s} {'comm share':>11s}")
    for r in records:
        print(f"{r['setup']:26s} {r['ms_per_step']:9.1f} {r['ms_per_step_median']:9.1f} {r['tokens_per_s']:9.0f} "
              f"{r['speedup_vs_1x1']:7.2f}x {r['compute_ms_median']:9.1f} {r['wait_ms_median']:8.2f} "
              f"{r['allreduce_ms_median']:11.2f} {100 * r['communication_share']:10.1f}%")
    print("compute: forward and backward of a rank's rows; wait: for the slowest rank (a one-value all-reduce); "
          "all-reduce: the gradient sum, the communication cost per step (overlapped buckets: what is left of it "
          f"after the backward pass; {args.bucket_kib} KiB buckets, {records[-1]['buckets']} of them, "
          f"{records[-1]['buckets_overlapped']} started during the backward pass)")
    print(f"written {os.path.relpath(path, REPO)}")
    return 0


# ---------------------------------------------------------------- decode (make bench-decode)

DECODE_BASE = os.path.join("bench", "decode_base")
# The decode benchmark's configurations, as data: each entry is the step fragments (defconfigs/steps/<name>) merged
# in order over DECODE_BASE and the shape, and Kconfig overrides. Every row of kernels/attention.tbl is one entry;
# another configuration (a position-scheme fragment, say) is one more line here, e.g.
#   (["QKV", "ROPE"], {}),
DECODE_CONFIGS = [([row["id"]], {}) for row in attention_tbl.variants()] + [
    # position schemes acting in attention: RoPE rotates every cached key as it is read, the biases add a term
    (["QKV_ROPE"], {}), (["KV_ROPE"], {}), (["KV_RELB"], {}),
]
# K/V head counts as functions of the head count H, added to every table row's entry whose configuration Kconfig offers
# CONFIG_ATTN_KV_HEADS in (QKV and KV tying: kernels/Kconfig); the standard count H is the entry itself.
# 1 is multi-query attention (MQA), a count between 1 and H grouped-query attention (GQA).
DECODE_KV_HEADS = [lambda H: H // 2, lambda H: 1]
DECODE_CONTEXTS = "128, 512 and the maximum context"


def kconfig_offers(fragments, symbol):
    """Whether Kconfig lets a configuration of DECODE_BASE + fragments set symbol (its prompt is visible)."""
    import kconfig as kconfig_mod  # scripts/kconfig.py: needs kconfiglib, which only this mode uses here
    cwd = os.getcwd()
    os.chdir(REPO)  # kconfiglib reads Kconfig relative to the repository root
    try:
        kconf = kconfig_mod.load_kconfig()
        kconfig_mod.load_strict(kconf, DECODE_BASE, replace=True, check_values=False)
        for frag in fragments:
            kconfig_mod.load_strict(kconf, os.path.join("defconfigs", "steps", frag), replace=False)
        return kconf.syms[symbol].visibility > 0
    finally:
        os.chdir(cwd)


def decode_configs(H):
    """The configurations for a model of H heads: dicts with name, fragments, overrides, kv_heads, kv_label."""
    out = []
    for fragments, overrides in DECODE_CONFIGS:
        name = "_".join(f.lower() for f in fragments)
        for k, v in sorted(overrides.items()):
            name += f"_{k.lower()}{v}"
        out.append({"name": name, "fragments": fragments, "overrides": dict(overrides), "kv_heads": H,
                    "kv_label": "standard"})
        rows = {r["id"] for r in attention_tbl.variants()}
        if "ATTN_KV_HEADS" in overrides or len(fragments) != 1 or fragments[0] not in rows or \
                not kconfig_offers(fragments, "ATTN_KV_HEADS"):
            continue  # grouped forms of the table's rows only (not of each position scheme)
        seen = {H}
        for count in DECODE_KV_HEADS:
            g = count(H)
            if g < 1 or H % g or g in seen:  # e.g. H/2 of an odd head count, or H = 2 where H/2 is MQA
                continue
            seen.add(g)
            label = "MQA" if g == 1 else "GQA"
            out.append({"name": f"{name}_{label.lower()}", "fragments": fragments,
                        "overrides": dict(overrides, ATTN_KV_HEADS=g), "kv_heads": g, "kv_label": label})
    return out


def build_decode(conf, shape, build_root, target="cpu", precision="fp32"):
    """bench/bench_decode of one configuration: DECODE_BASE, the shape, the fragments, then the overrides (and
    the compute target)."""
    bdir = os.path.join(build_root, "decode" if target == "cpu" else f"decode-{target_name(target, precision)}",
                        conf["name"])
    os.makedirs(bdir, exist_ok=True)
    L, H, C, T, _ = shape
    extra = os.path.join(bdir, "bench.fragment")
    with open(extra, "w") as f:
        f.write(f"# written by scripts/bench.py: the benchmark's shape and the configuration's overrides\n"
                f"CONFIG_GPT2_N_LAYER={L}\nCONFIG_GPT2_N_HEAD={H}\nCONFIG_GPT2_N_EMBD={C}\nCONFIG_GPT2_BLOCK_SIZE={T}\n")
        for k, v in conf["overrides"].items():
            f.write(f"CONFIG_{k}={v}\n")
    frags = [os.path.join("defconfigs", "steps", x) for x in conf["fragments"]]
    r = subprocess.run([PY, "scripts/kconfig.py", "step", bdir, DECODE_BASE] + frags +
                       [extra, target_fragment(REPO, target, precision)], cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"configuration {conf['name']}: {r.stderr.strip()}")
    binary = os.path.join(bdir, "bench", "bench_decode")
    r = subprocess.run(["make", f"-j{os.cpu_count() or 2}", "-s", "-f", "scripts/Makefile.build", f"B={bdir}",
                        "BENCH=y", binary], cwd=REPO, capture_output=True, text=True)  # this program only
    if r.returncode != 0:
        raise RuntimeError(f"building {binary} failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return binary


def run_decode(binary, shape, tokens, reps, threads):
    r = subprocess.run([binary] + [str(x) for x in shape] + [str(tokens), str(reps), str(threads)], cwd=REPO,
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{binary} failed: {r.stderr.strip()}")
    return json.loads(r.stdout)


def bench_decode(args):
    """Cached generation of every configuration, round-robin over the rounds (noise hits them alike)."""
    shape = args.decode_shape
    confs = decode_configs(shape[1])
    if args.configs:
        wanted = args.configs.split(",")
        unknown = [w for w in wanted if w not in {c["name"] for c in confs}]
        if unknown:
            print(f"error: --configs: no configuration {', '.join(unknown)} (hint: one of "
                  f"{', '.join(c['name'] for c in confs)})", file=sys.stderr)
            return 2
        confs = [c for c in confs if c["name"] in wanted]
    print(f"kvlab bench decode: GPT-2 L={shape[0]} H={shape[1]} C={shape[2]} max context T={shape[3]} "
          f"vocab={shape[4]}; {len(confs)} configurations x {args.rounds} rounds, {args.tokens} tokens timed before "
          f"context {DECODE_CONTEXTS} x {args.reps} repetitions", flush=True)
    try:
        binaries = {}
        for c in confs:
            print(f"  building {c['name']}", flush=True)
            binaries[c["name"]] = build_decode(c, shape, args.build, args.target, args.precision)
        runs = round_robin(args.rounds, [c["name"] for c in confs],
                           lambda name: run_decode(binaries[name], shape, args.tokens, args.reps, args.threads),
                           lambda name, rec: f"{name:16s} tok/s at context " +
                                             ", ".join(f"{x['context']}: {x['tokens_per_s']:.0f}" for x in rec["contexts"]) +
                                             f" ({rec['seconds']:.1f} s)")
    except RuntimeError as e:
        print(f"error: decode benchmark: {e}", file=sys.stderr)
        return 1
    records = []
    for c in confs:
        rs = runs[c["name"]]
        first = rs[0]
        rec = {k: first[k] for k in ("variant", "label", "heads", "kv_heads", "cache_tensors", "parameters", "threads",
                                     "shape", "kv_cache_bytes_per_token", "kv_cache_bytes_per_token_measured",
                                     "kv_cache_bytes_allocated", "decoder_bytes_allocated", "tokens_timed", "reps",
                                     "timed_positions", "backend")}
        rec.update(config=c["name"], fragments=c["fragments"], overrides=c["overrides"], kv_label=c["kv_label"],
                   rounds=len(rs), contexts=[])
        for i, ctx in enumerate(first["contexts"]):
            ms = [x for r in rs for x in r["contexts"][i]["ms_per_token"]]
            rec["contexts"].append({"context": ctx["context"], "tokens_per_s": round(1e3 / min(ms), 1),
                                    "tokens_per_s_median": round(1e3 / statistics.median(ms), 1),
                                    "ms_per_token": ms})
        records.append(rec)
    base = records[0]  # the first entry: the table's first row (standard attention), standard K/V heads
    for r in records:
        for ctx, ref in zip(r["contexts"], base["contexts"]):
            ctx["speed_vs_baseline"] = round(ctx["tokens_per_s"] / ref["tokens_per_s"], 4)
            ctx["speed_vs_baseline_median"] = round(ctx["tokens_per_s_median"] / ref["tokens_per_s_median"], 4)
        r["cache_vs_baseline"] = round(r["kv_cache_bytes_per_token"] / base["kv_cache_bytes_per_token"], 4)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "decode.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"baseline": base["config"], "cpus": len(os.sched_getaffinity(0)), "rounds": args.rounds,
                   "configurations": records}, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)

    ctxs = [x["context"] for x in base["contexts"]]
    print(f"\ncached generation (gpt2_decode, batch 1, greedy), GPT-2 L={shape[0]} H={shape[1]} C={shape[2]}, "
          f"backend {base['backend']}, {base['threads']} threads; tok/s of the {base['tokens_timed']} tokens before each context, fastest of "
          f"{args.rounds} rounds x {args.reps} repetitions (medians in decode.json); (x) = speed against "
          f"{base['label']} standard")
    head = f"{'variant':10s} {'K/V heads':>12s} {'cache B/tok':>12s} {'cache/QKV':>9s}" + \
        "".join(f" {'tok/s @' + str(c):>18s}" for c in ctxs)
    print(head)
    for r in records:
        kv = f"{r['kv_heads']}" + (f" ({r['kv_label']})" if r["kv_label"] != "standard" else "")
        cols = "".join(f" {x['tokens_per_s']:10.0f} ({x['speed_vs_baseline']:4.2f}x)" for x in r["contexts"])
        print(f"{r['label']:10s} {kv:>12s} {r['kv_cache_bytes_per_token']:12,d} {r['cache_vs_baseline']:9.3f}{cols}")
    print("cache B/tok: kv_cache_bytes_per_token, equal to the bytes kv_cache_init allocates per token (each run checks)")
    print(f"\nwritten {os.path.relpath(path, REPO) if path.startswith(REPO) else path}")
    return 0


def compare(runs, against, path, other):
    """The step time of this checkout against another, per variant, from runs interleaved round by round:
    best against best (noise only slows a run down) and median against median."""
    rows = []
    for variant, _, _ in VARIANTS:
        mine = [ms for r in runs[variant] for ms in r["step_ms"]]
        theirs = [ms for r in against[variant] for ms in r["step_ms"]]
        rows.append({"variant": variant, "label": runs[variant][0]["label"],
                     "ms_per_step": round(min(mine), 2), "ms_per_step_against": round(min(theirs), 2),
                     "time_ratio": round(min(mine) / min(theirs), 4),
                     "median_time_ratio": round(statistics.median(mine) / statistics.median(theirs), 4)})
    print(f"\nthis checkout against {other} (interleaved in every round; ratio < 1: this checkout is faster)")
    print(f"{'variant':10s} {'ms/step':>9s} {'against':>9s} {'best ratio':>11s} {'median ratio':>13s}")
    for r in rows:
        print(f"{r['label']:10s} {r['ms_per_step']:9.1f} {r['ms_per_step_against']:9.1f} {r['time_ratio']:11.3f} "
              f"{r['median_time_ratio']:13.3f}")
    with open(path + ".tmp", "w") as f:
        json.dump({"against": other, "variants": rows}, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)
    print(f"written {os.path.relpath(path, REPO)}")


def profile_table(runs, path, top=14):
    """Where a step's time goes, every variant side by side (the profile of its last round): ms per step of each
    op of the interface and, on a GPU, of the kernels inside the ops that take the most; written to path."""
    prof = {v: rs[-1]["profile"] for v, rs in runs.items() if rs and "profile" in rs[-1]}
    if not prof:
        return
    labels = {v: runs[v][-1]["label"] for v in prof}
    with open(path + ".tmp", "w") as f:
        json.dump({v: dict(label=labels[v], **p) for v, p in prof.items()}, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)
    names = list(prof)
    base = prof[names[0]]

    def ms_of(p, op, part=None):
        rows = [r["ms"] for r in p["rows"] if r["op"] == op and r.get("part") == part]
        return sum(rows) if rows else None  # None: the variant never ran this op (or part)

    def share(ms, p):
        return 100 * ms / p["step_ms"] if p["step_ms"] > 0 else 0.0

    def show(title, keys, key_label):
        print(title)
        print(f"{key_label:44s}" + "".join(f" {labels[v]:>16s}" for v in names))
        for op, part in keys:
            name = op if part is None else f"  {op} / {part}"
            cells = ""
            for v in names:
                ms = ms_of(prof[v], op, part)
                cells += f" {ms:9.2f} {share(ms, prof[v]):5.1f}%" if ms is not None else f" {'-':>16s}"
            print(f"{name[:44]:44s}{cells}")

    def largest(op, part=None):  # the most any variant spends in it: what the table is sorted by
        return max(ms_of(p, op, part) or 0.0 for p in prof.values())

    ops = sorted({r["op"] for p in prof.values() for r in p["rows"] if "part" not in r}, key=lambda op: -largest(op))
    print(f"\nwhere a step's time goes (--profile: {base['steps']} steps after the last round's, per step; ms and "
          "share of the profiled step)")
    show("", [(op, None) for op in ops[:top]], "op")
    for title, value in (("all ops", lambda p: p["ops_ms"]), ("profiled step", lambda p: p["step_ms"])):
        print(f"{title:44s}" + "".join(f" {value(prof[v]):9.2f} {share(value(prof[v]), prof[v]):5.1f}%"
                                        for v in names))
    if any(p.get("host_waits") for p in prof.values()):  # a GPU's round trips: each ends a part "host wait"
        print(f"{'host waits for the device (calls)':44s}" + "".join(f" {prof[v].get('host_waits', 0):16g}"
                                                                      for v in names))
    if len(ops) > top:
        print(f"({len(ops) - top} more ops in {os.path.relpath(path, REPO) if path.startswith(REPO) else path})")
    parts = sorted({(r["op"], r["part"]) for p in prof.values() for r in p["rows"] if "part" in r},
                   key=lambda k: -largest(*k))
    if parts:
        show("\nkernels and cuBLAS products inside the ops, each from the end of the one before", parts[:top],
             "op / kernel")
    print("ops: every call of kernels.h and attention.h, outermost only, on the device's clock (a GPU's events: "
          "its own time while work is queued ahead of it, the host's too where it waits for the host); the rest "
          "of the step is host work between calls")
    print(f"written {os.path.relpath(path, REPO) if path.startswith(REPO) else path}")


def run_peer(variant, args, compiled, threads):
    """One record of scripts/bench_torch.py: the variant in PyTorch on this run's device, shape and precision, with
    kvlab's number of threads."""
    cmd = [PY, os.path.join(REPO, "scripts", "bench_torch.py"), "--variant", variant, "--shape"] + \
        [str(x) for x in args.shape] + ["--steps", str(args.steps), "--warmup", "3", "--precision", args.precision,
                                        "--device", "cuda" if args.target == "cuda" else "cpu",
                                        "--threads", str(threads)] + \
        (["--compile"] if compiled else [])
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"bench_torch.py --variant {variant}{' --compile' if compiled else ''} failed: "
                           f"{r.stderr.strip()[-600:]}")
    return json.loads(r.stdout)


def compare_peer(runs, peer, modes, path):
    """kvlab against PyTorch running the same model, per variant of the table, best step against best step."""
    rows = []
    for variant in peer:
        mine = min(ms for r in runs[variant] for ms in r["step_ms"])
        row = {"variant": variant, "label": runs[variant][0]["label"], "kvlab_ms_per_step": round(mine, 2)}
        for mode in modes:
            theirs = min(ms for r in peer[variant][mode] for ms in r["step_ms"])
            row[f"torch_{mode}_ms_per_step"] = round(theirs, 2)
            row[f"speed_vs_torch_{mode}"] = round(theirs / mine, 4)
        row["torch"] = peer[variant][modes[0]][0]["torch"]
        row["threads"] = runs[variant][0]["threads"]
        rows.append(row)
    print("\nkvlab against PyTorch running the same model (scripts/bench_torch.py), interleaved in every round, "
          f"{rows[0]['threads']} threads each; speed > 1: kvlab is faster")
    print(f"{'variant':10s} {'kvlab ms':>9s}" + "".join(f" {'torch ' + m + ' ms':>17s} {'speed':>6s}" for m in modes))
    for r in rows:
        print(f"{r['label']:10s} {r['kvlab_ms_per_step']:9.1f}" +
              "".join(f" {r[f'torch_{m}_ms_per_step']:17.1f} {r[f'speed_vs_torch_{m}']:6.2f}" for m in modes))
    with open(path + ".tmp", "w") as f:
        json.dump({"peer": "pytorch", "variants": rows}, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)
    print(f"written {os.path.relpath(path, REPO)}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--shape", nargs=6, type=int, default=[6, 6, 384, 256, 12, 65], metavar=("L", "H", "C", "T",
                                                                                             "B", "V"))
    ap.add_argument("--profile", action="store_true", help="variants: after the last round, a few steps under the "
                    "backend's profile: where a step's time goes, op by op (and kernel by kernel on a GPU), every "
                    "variant side by side (output/bench/profile.json)")
    ap.add_argument("--against", metavar="DIR", help="another kvlab checkout (e.g. a git worktree of an older "
                    "commit): its benchmark runs beside this one's in every round, and the step times are compared "
                    "(output/bench/against.json)")
    ap.add_argument("--peer", choices=["torch"], help="variants: PyTorch running the same model "
                    "(scripts/bench_torch.py) beside kvlab in every round (output/bench/peer.json)")
    ap.add_argument("--peer-compile", action="store_true", help="--peer torch: also torch.compile (PyTorch 2.0+)")
    ap.add_argument("--target", choices=sorted(TARGETS), default="cpu", help="variants: the compute target to build "
                    "for (cuda: this machine's GPU, CUDA_NATIVE)")
    ap.add_argument("--precision", choices=sorted(PRECISIONS), help="--target cuda: the GPU precision "
                    "(kernels/Kconfig; default fp32; bf16: bf16 activations and products)")
    ap.add_argument("--only", choices=["variants", "dp", "decode"], help="run only the attention-variant benchmark, "
                    "only the data-parallel one (output/bench/dp.json) or only the decode one (make bench-decode: "
                    "output/bench/decode.json)")
    ap.add_argument("--bucket-kib", type=int, default=1024, help="dp: the gradient bucket size of the overlapped "
                    "setup (KiB, CONFIG_DIST_BUCKET_KIB)")
    ap.add_argument("--decode-shape", nargs=5, type=int, default=[6, 6, 384, 1024, 65],
                    metavar=("L", "H", "C", "T", "V"), help="decode: the GPT-2 shape, T its maximum context")
    ap.add_argument("--tokens", type=int, default=32, help="decode: tokens timed before each context")
    ap.add_argument("--reps", type=int, default=5, help="decode: repetitions of them in each round")
    ap.add_argument("--threads", type=int, default=0, help="decode: threads (0: one per core; 1 is steadier on a "
                    "busy machine, where a descheduled thread stalls the others at every parallel region)")
    ap.add_argument("--configs", help="decode: only these configurations (comma-separated names, e.g. "
                    "qkv,qkv_mqa,k)")
    ap.add_argument("--out", default=os.path.join(REPO, "output", "bench"), help="output folder of bench.json (the variants), peer.json, dp.json and decode.json")
    ap.add_argument("--build", default=os.path.join(REPO, "build", "bench"), help="decode: build folder")
    args = ap.parse_args()
    for name in ("rounds", "steps", "tokens", "reps"):
        if getattr(args, name) < 1:
            print(f"error: --{name} {getattr(args, name)}: at least 1 (hint: each measurement needs one)",
                  file=sys.stderr)
            return 2
    if args.threads < 0:
        print(f"error: --threads {args.threads}: 0 (one per core) or more (hint: 1 is steadiest)", file=sys.stderr)
        return 2
    if args.bucket_kib < 1:
        print(f"error: --bucket-kib {args.bucket_kib}: a bucket holds at least 1 KiB (hint: e.g. 1024)",
              file=sys.stderr)
        return 2
    if args.only == "dp":
        return bench_dp(args)
    if args.precision not in (None, "fp32") and args.target != "cuda":
        print(f"error: --precision {args.precision} is a GPU choice (hint: add --target cuda)", file=sys.stderr)
        return 2
    args.precision = args.precision or "fp32"
    if args.only == "decode":
        return bench_decode(args)
    if args.peer and args.precision == "bf16-matmul":
        print("error: --peer torch has no form with bf16 products on float32 activations (hint: --precision bf16, "
              "where PyTorch runs under bf16 autocast)", file=sys.stderr)
        return 2
    if args.peer_compile and not args.peer:
        print("error: --peer-compile goes with --peer torch", file=sys.stderr)
        return 2
    if args.against and not os.path.isfile(os.path.join(args.against, "scripts", "bench.py")):
        print(f"error: --against {args.against}: not a kvlab checkout (hint: git worktree add DIR COMMIT)",
              file=sys.stderr)
        return 2
    coretype = os.environ.get("OPENBLAS_CORETYPE", "(unset: OpenBLAS detects the CPU)")
    print(f"kvlab bench: shape L={args.shape[0]} H={args.shape[1]} C={args.shape[2]} T={args.shape[3]} "
          f"B={args.shape[4]} vocab={args.shape[5]}, causal; {args.rounds} rounds x {args.steps} steps; "
          f"target {target_name(args.target, args.precision)}; OPENBLAS_CORETYPE={coretype}", flush=True)
    print(f"  building {', '.join(v for v, _, _ in VARIANTS)}" + (f" (and in {args.against})" if args.against else ""),
          flush=True)
    todo = [((REPO, v), v, frag, REPO) for v, frag, _ in VARIANTS]
    if args.against:
        todo += [(("against", v), v, frag, os.path.abspath(args.against)) for v, frag, _ in VARIANTS]
    built = build_all(todo, args.target, args.precision)
    binaries = {v: built[(REPO, v)] for v, _, _ in VARIANTS}
    others = {v: built[("against", v)] for v, _, _ in VARIANTS} if args.against else {}
    runs = {v: [] for v, _, _ in VARIANTS}
    against = {v: [] for v, _, _ in VARIANTS}
    modes = ["eager"] + (["compile"] if args.peer_compile else [])
    peer = {v: {m: [] for m in modes} for v, _, base in VARIANTS if base is None} if args.peer else {}
    try:
        for rnd in range(args.rounds):
            for variant, _, _ in VARIANTS:
                rec = run_bench(binaries[variant], args.shape, args.steps, args.profile and rnd == args.rounds - 1)
                runs[variant].append(rec)
                print(f"  round {rnd + 1}/{args.rounds} {rec['label']:9s} best {min(rec['step_ms']):8.1f} ms/step, "
                      f"median {rec['ms_per_step']:8.1f} (sgemm best {max(rec['sgemm_gflops_runs']):.1f} GFLOP/s)",
                      flush=True)
                for mode in (modes if variant in peer else []):
                    rec = run_peer(variant, args, mode == "compile", runs[variant][-1]["threads"])
                    peer[variant][mode].append(rec)
                    print(f"  round {rnd + 1}/{args.rounds} {variant:9s} best {min(rec['step_ms']):8.1f} ms/step, "
                          f"median {rec['ms_per_step']:8.1f} (PyTorch {rec['torch']} {mode})", flush=True)
                if args.against:
                    rec = run_bench(others[variant], args.shape, args.steps)
                    against[variant].append(rec)
                    print(f"  round {rnd + 1}/{args.rounds} {rec['label']:9s} best {min(rec['step_ms']):8.1f} "
                          f"ms/step, median {rec['ms_per_step']:8.1f} ({args.against})", flush=True)
    except RuntimeError as e:
        print(f"error: benchmark: {e}", file=sys.stderr)
        return 1
    all_sgemm = [g for v in runs.values() for r in v for g in r["sgemm_gflops_runs"]]
    sgemm, sgemm_median = max(all_sgemm), statistics.median(all_sgemm)
    records = []
    for variant, _, _ in VARIANTS:
        rs = runs[variant]
        first = rs[0]
        steps = [ms for r in rs for ms in r["step_ms"]]
        ms, ms_median = min(steps), statistics.median(steps)
        tokens = first["shape"]["B"] * first["shape"]["T"]
        gflops = first["flops_per_token"] * tokens / (ms / 1e3) / 1e9
        gflops_median = first["flops_per_token"] * tokens / (ms_median / 1e3) / 1e9
        rec = {
            "variant": variant,
            "label": first["label"],
            "ms_per_step": round(ms, 2),
            "tokens_per_s": round(tokens / (ms / 1e3), 1),
            "gflops": round(gflops, 2),
            "sgemm_gflops": round(sgemm, 2),
            "ratio": round(gflops / sgemm, 4),
            "ms_per_step_median": round(ms_median, 2),
            "sgemm_gflops_median": round(sgemm_median, 2),
            "ratio_median": round(gflops_median / sgemm_median, 4),
            "parameters": first["parameters"],
            "flops_per_token": first["flops_per_token"],
            "flops_formula": "6*N_matmul + 12*L*T*C per token (attention over the full T x T square)",
            "step_ms": steps,
            "bidir_attention_ms": statistics.median(r["bidir_attention_ms"] for r in rs),
            "shape": first["shape"],
            "threads": first["threads"],
            "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"),
            "backend": first.get("backend"),
        }
        if "memory_peak_mib" in first:
            rec["memory_peak_mib"] = max(r["memory_peak_mib"] for r in rs)
            rec["memory_total_mib"] = first["memory_total_mib"]
        peak = gpu_peak(first.get("backend", ""))
        if peak:
            rec["peak"] = {"gpu": peak[0], "precision": peak[1], "tflops": peak[2],
                           "source": "NVIDIA datasheet, dense (scripts/bench.py GPU_PEAKS)"}
            rec["mfu"] = round(gflops / (peak[2] * 1e3), 4)
            rec["mfu_median"] = round(gflops_median / (peak[2] * 1e3), 4)
        if first["bidir_attention_ms_general_path"] > 0:
            rec["bidir_attention_ms_general_path"] = statistics.median(
                r["bidir_attention_ms_general_path"] for r in rs)
            rec["symmetric_saving"] = round(1 - rec["bidir_attention_ms"] / rec["bidir_attention_ms_general_path"], 4)
        if "causal_attention_ms" in first:  # GPT-2's attention alone; bf16 on a GPU: against the WMMA kernels
            rec["causal_attention_ms"] = statistics.median(r["causal_attention_ms"] for r in rs)
            if first["causal_attention_ms_wmma"] > 0:
                rec["causal_attention_ms_wmma"] = statistics.median(r["causal_attention_ms_wmma"] for r in rs)
                rec["mma_saving"] = round(1 - rec["causal_attention_ms"] / rec["causal_attention_ms_wmma"], 4)
        records.append(rec)
    by = {r["variant"]: r for r in records}
    for r in records:
        q = by[BASELINE]
        r["flops_vs_qkv"] = round(r["flops_per_token"] / q["flops_per_token"], 4)
        r["time_vs_qkv"] = round(r["ms_per_step"] / q["ms_per_step"], 4)
        without_pos = next(b for v, _, b in VARIANTS if v == r["variant"])
        if without_pos:
            base = by[without_pos]
            r["pos_overhead"] = round(r["ms_per_step"] / base["ms_per_step"] - 1, 4)
    out = args.out
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "bench.json")
    with open(path + ".tmp", "w") as f:
        json.dump(records, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)

    print(f"\nbackend: {records[0]['backend']}")
    print(f"matmul reference (2048^3, {records[0]['threads']} threads, {len(all_sgemm)} calls in this run): best "
          f"{sgemm:.1f} GFLOP/s, median {sgemm_median:.1f}")
    if "peak" in records[0]:
        p = records[0]["peak"]
        print(f"MFU: achieved model FLOP/s over the {p['gpu']}'s dense {p['precision']} peak, {p['tflops']} TFLOP/s "
              f"({p['source']})")
    elif args.target == "cuda":
        print("MFU: no peak known for this GPU (hint: add it to GPU_PEAKS in scripts/bench.py)")
    print("ms/step and ratio: fastest step of each variant against the fastest sgemm (medians in bench.json)")
    print("model FLOPs per token = 6*N_matmul + 12*L*T*C (training; attention counted over the full T x T)")
    head = f"{'variant':10s} {'params':>10s} {'MFLOP/tok':>10s} {'ms/step':>9s} {'tok/s':>8s} {'GFLOP/s':>8s} " \
           f"{'ratio':>6s} {'FLOPs/QKV':>9s} {'time/QKV':>9s} {'+Pos cost':>9s} {'bidir attn ms':>14s}" + \
           (f" {'MFU':>6s}" if "mfu" in records[0] else "") + (f" {'peak MiB':>9s}" if "memory_peak_mib" in records[0]
                                                                 else "")
    print(head)
    for r in records:
        pos = f"{100 * r['pos_overhead']:+.1f}%" if "pos_overhead" in r else ""
        attn = f"{r['bidir_attention_ms']:.1f}"
        if "symmetric_saving" in r:
            attn += f" ({r['bidir_attention_ms_general_path']:.1f} general, -{100 * r['symmetric_saving']:.0f}%)"
        print(f"{r['label']:10s} {r['parameters']:10,d} {r['flops_per_token'] / 1e6:10.2f} {r['ms_per_step']:9.1f} "
              f"{r['tokens_per_s']:8.0f} {r['gflops']:8.1f} {r['ratio']:6.3f} {r['flops_vs_qkv']:9.3f} "
              f"{r['time_vs_qkv']:9.3f} {pos:>9s} {attn:>14s}" + (f" {100 * r['mfu']:5.1f}%" if "mfu" in r else "") +
              (f" {r['memory_peak_mib']:9.0f}" if "memory_peak_mib" in r else ""))
    if any("mma_saving" in r for r in records):
        print("causal attention alone (forward + backward of one layer, ms): scores in registers (mma.sync) against "
              "the WMMA kernels, same run")
        for r in records:
            if "mma_saving" in r:
                print(f"  {r['label']:10s} {r['causal_attention_ms']:8.2f} against {r['causal_attention_ms_wmma']:8.2f}"
                      f" ({-100 * r['mma_saving']:+.0f}%)")
    print(f"\nwritten {os.path.relpath(path)}")
    if args.profile:
        profile_table(runs, os.path.join(out, "profile.json"))
    if args.against:
        compare(runs, against, os.path.join(out, "against.json"), args.against)
    if args.peer:
        compare_peer(runs, peer, modes, os.path.join(out, "peer.json"))
    if args.only != "variants" and args.target == "cpu":
        print("\ndata-parallel scaling", flush=True)
        return bench_dp(args)
    return 0


if __name__ == "__main__":
    t0 = time.time()
    try:
        rc = main()
    except subprocess.CalledProcessError as exc:  # a build (kconfig.py step, make) that failed: its messages are above
        cmd = exc.cmd if isinstance(exc.cmd, list) else [str(exc.cmd)]
        print(f"error: {' '.join(os.path.basename(str(x)) for x in cmd[:3])} ... failed with exit status "
              f"{exc.returncode} (hint: its messages are above; a CUDA target needs nvcc and a GPU build's "
              "libraries, docs/cuda.md)", file=sys.stderr)
        rc = 1
    print(f"bench took {time.time() - t0:.0f} s")
    sys.exit(rc)
