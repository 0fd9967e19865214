#!/usr/bin/python3
"""Checks that every C file includes only headers of its own folder and of the
folders its layer may import (docs/architecture.md draws the same picture).

Layers only import downward: the kernels know nothing of the model families,
the families nothing of each other, and only mechint (which analyses every
family's checkpoints) sits above them. A violation is one line naming the
file, the line and the rule; the exit status is 1 if there is any.

usage: scripts/check_layers.py [REPO]
"""
import os
import re
import sys

# folder -> the folders its files may include from (besides their own and include/generated/).
# Read from the bottom up; tests/ and bench/ may use anything below them.
MAY_IMPORT = {
    "lib": [],
    "kernels": ["lib"],
    "kernels/cpu": ["kernels", "lib"],
    "kernels/cuda": ["kernels", "lib"],
    "nn": ["kernels", "lib"],
    "wandb": ["lib"],
    "train": ["nn", "kernels", "wandb", "lib"],
    "gpt2": ["train", "nn", "kernels", "lib"],
    "vit": ["train", "nn", "kernels", "lib"],
    "seq2seq": ["train", "nn", "kernels", "lib"],
    "mechint": ["gpt2", "vit", "seq2seq", "train", "nn", "kernels", "lib"],
    "bench": ["gpt2", "train", "nn", "kernels", "lib"],
}
# Headers of a layer that only some folders above it may use: the backends' own bookkeeping, and the device
# collectives that only the trainer's transport calls (model code never sees either).
HEADER_USERS = {
    "kernels/backend.h": ["kernels", "kernels/cpu", "kernels/cuda"],
    "kernels/comm.h": ["kernels/cuda", "train"],
}
INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


def headers(repo):
    """{header file name: [folders that have it]} over the folders above."""
    found = {}
    for folder in MAY_IMPORT:
        for name in os.listdir(os.path.join(repo, folder)):
            if name.endswith((".h", ".cuh")):
                found.setdefault(name, []).append(folder)
    return found


def check(repo):
    where = headers(repo)
    problems = []
    for folder, allowed in MAY_IMPORT.items():
        for name in sorted(os.listdir(os.path.join(repo, folder))):
            if not name.endswith((".c", ".h", ".cu", ".cuh")):
                continue
            path = os.path.join(folder, name)
            with open(os.path.join(repo, path), encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    m = INCLUDE_RE.match(line)
                    if not m:
                        continue
                    inc = m.group(1)
                    if inc.startswith("generated/") or inc == "kconfig.h":
                        continue
                    if "/" in inc:  # "gpt2/model.h": the folder is named
                        target = os.path.dirname(os.path.normpath(os.path.join(folder, inc))) \
                            if inc.startswith("..") else os.path.dirname(inc)
                        targets = [target]
                    elif os.path.isfile(os.path.join(repo, folder, inc)):
                        continue  # a header of its own folder
                    else:
                        targets = where.get(inc, [])
                    if not targets:
                        continue  # a system or library header
                    users = HEADER_USERS.get(f"{targets[0]}/{os.path.basename(inc)}") if len(targets) == 1 else None
                    if users is not None and folder not in users:
                        problems.append(f"{path}:{lineno}: includes \"{inc}\", which only {', '.join(users)}/ may "
                                        "use (hint: model code goes through kernels.h and attention.h, data "
                                        "parallelism through train/dist.h)")
                    elif not any(t == folder or t in allowed for t in targets):
                        problems.append(f"{path}:{lineno}: includes \"{inc}\" from {' or '.join(targets)}/, but "
                                        f"{folder}/ may import only {', '.join(allowed) or 'nothing'} (hint: layers "
                                        "import downward, docs/architecture.md; move the code or the header)")
    return problems


def main():
    repo = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    problems = check(repo)
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    if not problems:
        print(f"layers: {len(MAY_IMPORT)} folders import only downward")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
