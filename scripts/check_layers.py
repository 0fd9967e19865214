#!/usr/bin/python3
"""Checks that every C file includes only headers of its own folder and of the
folders its layer may import (docs/architecture.md draws the same picture),
and reads only the Kconfig symbols of those folders and of the top-level
Kconfig (a symbol belongs to the folder whose Kconfig defines it): a kernel
that tested CONFIG_GPT2_N_HEAD would know a model family as surely as one
that included its header.

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
SYMBOL_RE = re.compile(r"\bCONFIG_([A-Z0-9_]+)")
COMMENT_RE = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)


def kconfig_owners(repo):
    """{Kconfig symbol: the folder whose Kconfig defines it ("" for the top-level Kconfig)}"""
    owners = {}
    for folder in [""] + list(MAY_IMPORT):
        path = os.path.join(repo, folder, "Kconfig")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                for m in re.finditer(r"^\s*(?:menu)?config\s+([A-Z0-9_]+)", f.read(), re.M):
                    owners[m.group(1)] = folder
    return owners


def code_lines(text):
    """The lines of a C source with its comments blanked (newlines kept, so line numbers stay)."""
    return COMMENT_RE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text).splitlines()


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
    owners = kconfig_owners(repo)
    problems = []
    for folder, allowed in MAY_IMPORT.items():
        for name in sorted(os.listdir(os.path.join(repo, folder))):
            if not name.endswith((".c", ".h", ".cu", ".cuh")):
                continue
            path = os.path.join(folder, name)
            with open(os.path.join(repo, path), encoding="utf-8") as f:
                text = f.read()
            for lineno, line in enumerate(code_lines(text), 1):
                for m in SYMBOL_RE.finditer(line):
                    owner = owners.get(m.group(1))  # None: not a Kconfig symbol (a macro of lib/runconfig.h)
                    if owner is None or owner == "" or owner == folder or owner in allowed or \
                            folder.startswith(owner + "/"):
                        continue
                    problems.append(f"{path}:{lineno}: reads CONFIG_{m.group(1)} of {owner}/, but {folder}/ may "
                                    f"import only {', '.join(allowed) or 'nothing'} (hint: layers import downward, "
                                    "docs/architecture.md; have scripts/kconfig.py derive what this layer needs "
                                    "into include/generated/, as it does attn_head_dim.h)")
            for lineno, line in enumerate(text.splitlines(), 1):
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
        print(f"layers: {len(MAY_IMPORT)} folders import only downward (headers and Kconfig symbols)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
