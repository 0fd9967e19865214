#!/usr/bin/python3
"""make cuda-resources: what each CUDA kernel of the backend holds on the GPU, read off the compiler.

Every nvcc compile of scripts/Makefile.build keeps ptxas's resource report beside its object
(<object>.ptxas: registers, stack, spill stores and loads, static shared memory of every kernel). This script
builds the CUDA backend (kernels/cuda/*.cu, objects only: no GPU needed, only nvcc and cuBLAS) for one GPU
architecture and precision in the configuration of every benchmark variant (scripts/bench.py VARIANTS: the
attention kernels change with the variant, +Pos most), reads the reports and prints, for the attention
kernels that the tensor-core builds run (the tc_ and mma_ kernels, by head dim) and every kernel that spills,
the registers per thread in each variant, the bytes spilled, and the warps an SM keeps by its registers:
64K registers an SM, handed out 256 per warp, warps in groups of 4, at most 64 warps an SM (48 on sm_86 and
sm_89): the CUDA occupancy calculator's rule. Shared memory and block size can lower that further (the
launches set the dynamic shared memory at run time: docs/cuda.md states each kernel's).
Writes output/bench/resources-<precision>-sm<arch>.json (every kernel of every variant) and prints the table.

usage: scripts/cuda_resources.py [--precision fp32|tf32|bf16|bf16-matmul] [--arch 80|86|89|90|100]
                                 [--variants qkv,kv_pos] [--out DIR] [--build DIR]
"""
import argparse
import json
import os
import re
import subprocess
import sys

import bench

REPO = bench.REPO
PY = bench.PY

# per architecture of kernels/Kconfig: the most warps an SM keeps (CUDA C Programming Guide, "Compute
# Capabilities"); each has 64K 32-bit registers an SM and at most 255 a thread
SM_WARPS = {"80": 64, "86": 48, "89": 48, "90": 64, "100": 64}
SM_REGISTERS = 65536
REG_UNIT = 256    # registers are handed out per warp in units of 256
WARP_GROUP = 4    # and warps in groups of 4


def warps_by_registers(registers, arch):
    """The most warps of a kernel with this many registers per thread that an SM of arch keeps at once."""
    per_warp = -(-registers * 32 // REG_UNIT) * REG_UNIT
    return min(SM_WARPS[arch], SM_REGISTERS // per_warp // WARP_GROUP * WARP_GROUP)


def demangle(names):
    """The C++ names of mangled symbols, in order (binutils' c++filt; the mangled names where it is missing)."""
    try:
        r = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True)
        out = r.stdout.splitlines()
        return out if len(out) == len(names) else names
    except (OSError, subprocess.CalledProcessError):
        return names


def short_name(cxx):
    """'mma_dkv_kernel<4, bf16, true>' from 'void mma_dkv_kernel<4, __nv_bfloat16, true>(AttnIO<...>, ...)'."""
    name = re.sub(r"^void ", "", cxx)
    depth, end = 0, len(name)
    for i, ch in enumerate(name):  # cut the parameter list: the first '(' outside the template arguments
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            end = i
            break
    return name[:end].replace("__nv_bfloat16", "bf16").replace("unsigned long", "size_t")


def parse_ptxas(text):
    """[{kernel, registers, stack, spill_stores, spill_loads, shared}] of one ptxas --resource-usage report: one
    record per entry function ('Compiling entry function ...' then its properties and 'Used N registers')."""
    kernels, cur = [], None
    for ln in text.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", ln)
        if m:
            cur = {"mangled": m.group(1), "stack": 0, "spill_stores": 0, "spill_loads": 0, "shared": 0}
            kernels.append(cur)
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", ln)
        if m:
            cur["stack"], cur["spill_stores"], cur["spill_loads"] = map(int, m.groups())
            continue
        m = re.search(r"Used (\d+) registers", ln)
        if m:
            cur["registers"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", ln)
            cur["shared"] = int(s.group(1)) if s else 0
    kernels = [k for k in kernels if "registers" in k]
    for k, cxx in zip(kernels, demangle([k["mangled"] for k in kernels])):
        k["kernel"] = short_name(cxx)
    return kernels


def read_build(bdir):
    """{source file: parse_ptxas of its report} of a build tree's CUDA objects; raises OSError naming a missing
    report (an object built before reports were kept: make rebuilds it, the flags having changed)."""
    out = {}
    for src in sorted(os.listdir(os.path.join(REPO, "kernels", "cuda"))):
        if src.endswith(".cu") and src != "nccl.cu":  # nccl.cu only with MPI data parallel
            path = os.path.join(bdir, "kernels", "cuda", src[:-3] + ".o.ptxas")
            with open(path) as f:
                out[src] = parse_ptxas(f.read())
    return out


def head_dim(kernel):
    """The head dims a tensor-core attention kernel serves (tc_ and mma_ kernels: the first template argument NT,
    the head dim padded to 16 NT), as 'hd N'; None for the others."""
    m = re.match(r"(?:tc|mma)_\w+_kernel<(\d+)", kernel)
    return 16 * int(m.group(1)) if m else None


def build(variant, fragment, precision, arch, root, jobs):
    """The CUDA backend's objects in the configuration of one variant; returns the build folder."""
    bdir = os.path.join(root, f"resources-{precision}-sm{arch}-{variant}")
    frag = os.path.join(root, f"target-cuda-{precision}-sm{arch}")
    os.makedirs(root, exist_ok=True)
    with open(frag + ".tmp", "w") as f:
        f.write(f"CONFIG_TARGET_CUDA=y\nCONFIG_CUDA_SM{arch}=y\n" + bench.PRECISIONS[precision])
    os.replace(frag + ".tmp", frag)
    base = os.path.join(REPO, "tests", "configs", "base")
    subprocess.run([PY, "scripts/kconfig.py", "step", bdir, base, os.path.join("defconfigs", "steps", fragment), frag],
                   cwd=REPO, check=True)
    objs = [os.path.join(bdir, "kernels", "cuda", s[:-3] + ".o") for s in sorted(os.listdir(
        os.path.join(REPO, "kernels", "cuda"))) if s.endswith(".cu") and s != "nccl.cu"]
    subprocess.run(["make", f"-j{jobs}", "-s", "-f", "scripts/Makefile.build", f"B={bdir}"] + objs, cwd=REPO,
                   check=True, stdout=subprocess.DEVNULL)
    return bdir


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--precision", choices=sorted(bench.PRECISIONS), default="bf16")
    ap.add_argument("--arch", choices=sorted(SM_WARPS, key=int), default="90")
    ap.add_argument("--variants", help="only these variants (comma-separated names of scripts/bench.py VARIANTS, e.g. "
                    "qkv,kv_pos); default all")
    ap.add_argument("--out", default=os.path.join(REPO, "output", "bench"))
    ap.add_argument("--build", default=os.path.join(REPO, "build", "bench"))
    args = ap.parse_args()
    variants = bench.VARIANTS
    if args.variants:
        want = args.variants.split(",")
        unknown = [v for v in want if v not in [name for name, _, _ in variants]]
        if unknown:
            print(f"error: --variants: unknown variant {unknown[0]} (hint: one of "
                  f"{', '.join(name for name, _, _ in variants)})", file=sys.stderr)
            return 2
        variants = [v for v in variants if v[0] in want]
    print(f"kvlab cuda-resources: the CUDA backend for sm_{args.arch} in {args.precision}, "
          f"{len(variants)} variants (objects only, no GPU)", flush=True)
    import concurrent.futures
    cores = os.cpu_count() or 2
    workers = max(1, min(len(variants), cores // 2))
    try:
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            dirs = dict(zip([v for v, _, _ in variants], pool.map(
                lambda v: build(v[1].lower(), v[1], args.precision, args.arch, args.build,
                                max(1, cores // workers)), variants)))
        reports = {v: read_build(d) for v, d in dirs.items()}
    except (subprocess.CalledProcessError, OSError) as e:
        print(f"error: cuda-resources: {e} (hint: the CUDA target needs nvcc and cuBLAS: docs/cuda.md, Building)",
              file=sys.stderr)
        return 1
    records = []
    for v, files in reports.items():
        for src, kernels in files.items():
            for k in kernels:
                records.append({"variant": v, "source": src, "kernel": k["kernel"], "head_dim": head_dim(k["kernel"]),
                                "registers": k["registers"], "stack": k["stack"], "spill_stores": k["spill_stores"],
                                "spill_loads": k["spill_loads"], "shared_static": k["shared"],
                                "warps_per_sm_by_registers": warps_by_registers(k["registers"], args.arch)})
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"resources-{args.precision}-sm{args.arch}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"arch": args.arch, "precision": args.precision, "sm_warps": SM_WARPS[args.arch],
                   "kernels": records}, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)
    print_table(records, [v for v, _, _ in variants], args.arch)
    print(f"\nwrote {os.path.relpath(path, REPO)}")
    return 0


def print_table(records, variants, arch):
    """The tensor-core attention kernels by head dim, and every other kernel with a stack frame in some variant:
    registers per variant, the warps an SM keeps by them, stack and spilled bytes."""
    by = {}
    for r in records:
        by.setdefault((r["source"], r["kernel"]), {})[r["variant"]] = r
    rows = [k for k, per in by.items() if per[next(iter(per))]["head_dim"] or any(r["stack"] for r in per.values())]
    rows.sort(key=lambda k: (by[k][next(iter(by[k]))]["head_dim"] or 0, k[1]))
    width = max([len(k[1]) for k in rows] + [6])
    colw = max([len(cell(r)) for r in records] + [len(v) for v in variants])
    print(f"\nregisters a thread (the warps an SM keeps by them, of {SM_WARPS[arch]}); st: stack frame bytes a thread "
          f"(local memory: spills and arrays the compiler could not keep in registers), sp: bytes spilled (stores + "
          f"loads)")
    print(f"{'kernel':{width}s} {'hd':>4s}  " + "  ".join(f"{v:>{colw}s}" for v in variants))
    for key in rows:
        per = by[key]
        hd = per[next(iter(per))]["head_dim"]
        cells = []
        for v in variants:
            r = per.get(v)
            if not r:
                cells.append(f"{'-':>14s}")
                continue
            cells.append(f"{cell(r):>{colw}s}")
        print(f"{key[1]:{width}s} {hd if hd else '':>4}  " + "  ".join(cells))
    print(f"{len(records)} kernels over {len(variants)} variants; {sum(1 for r in records if r['stack'])} with a "
          f"stack frame, {sum(1 for r in records if r['spill_stores'] or r['spill_loads'])} of them spilling")


def cell(r):
    """'132 (12)', or '64 (32) st96 sp88': registers, warps an SM keeps by them, stack frame, spilled bytes."""
    spill = r["spill_stores"] + r["spill_loads"]
    return f"{r['registers']} ({r['warps_per_sm_by_registers']})" + (f" st{r['stack']}" if r["stack"] else "") + \
        (f" sp{spill}" if spill else "")


if __name__ == "__main__":
    sys.exit(main())
