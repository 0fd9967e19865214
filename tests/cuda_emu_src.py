#!/usr/bin/python3
"""A CUDA source of the backend (kernels/cuda/*.cu) as C++ for the emulated
CUDA backend (make CUDA_EMU=1; tests/cuda_emu_runtime.h):

  tests/cuda_emu_src.py SRC.cu > OUT.cpp

Two rewrites, each keeping every line where it was (a `#line` directive
names SRC, so compiler messages point into it):
- a launch `KERNEL<<<GRID, BLOCK[, SMEM[, STREAM]]>>>(ARGS)` becomes
  `emu::launch_config(GRID, BLOCK[, SMEM[, STREAM]]).run(KERNEL, ARGS)`: the
  arguments are evaluated once, on the host, and passed by value as a launch
  passes them; every emulated thread then calls the kernel with them, and
  the kernel's address tells the emulation what shared memory
  cudaFuncSetAttribute gave it;
- a static `__shared__` array (not `extern`: those are the dynamic shared
  memory, global arrays of the emulation) becomes a `static` one, registered
  once with emu::shared_array so that it is filled with NaN before every
  block as the dynamic shared memory is: one array per program as a block's
  is one per block (blocks run one after the other).
The headers beside SRC (*.cuh) are not rewritten, so a static `__shared__`
array in one of them stops it (the emulation would make it one per thread).
Anything it cannot parse stops it with the line number."""
import os
import re
import sys


def fail(path, text, pos, msg):
    sys.exit(f"error: {path}:{text.count(chr(10), 0, pos) + 1}: {msg} (hint: tests/cuda_emu_src.py rewrites "
             f"launches written as NAME<<<grid, block, smem, stream>>>(args))")


def match_close(text, i, open_ch, close_ch):
    """Index just past the bracket that closes the one at text[i]."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == open_ch:
            depth += 1
        elif text[j] == close_ch:
            depth -= 1
            if depth == 0:
                return j + 1
    return -1


def callee_start(text, end):
    """Start of the kernel expression that ends at end: NAME or NAME<template args>."""
    i = end
    if text[i - 1] == ">":
        depth = 0
        while i > 0:
            i -= 1
            depth += {">": 1, "<": -1}.get(text[i], 0)
            if depth == 0:
                break
    while i > 0 and (text[i - 1].isalnum() or text[i - 1] in "_:"):
        i -= 1
    return i


def rewrite(path, text):
    out, pos = [], 0
    for m in re.finditer(r"<<<", text):
        if m.start() < pos:
            continue
        start = callee_start(text, m.start())
        callee = text[start:m.start()]
        if not re.match(r"[A-Za-z_]", callee):
            fail(path, text, m.start(), "a launch without a kernel name before <<<")
        cfg_end = text.find(">>>", m.end())
        if cfg_end < 0:
            fail(path, text, m.start(), "<<< without >>>")
        cfg = text[m.end():cfg_end]
        p = cfg_end + 3
        while p < len(text) and text[p] in " \t\\\n":
            p += 1
        if p >= len(text) or text[p] != "(":
            fail(path, text, m.start(), "a launch without its arguments after >>>")
        args_end = match_close(text, p, "(", ")")
        if args_end < 0:
            fail(path, text, p, "unbalanced parentheses in a launch's arguments")
        out.append(text[pos:start])
        inner = text[p + 1:args_end - 1]
        out.append(f"emu::launch_config({cfg}).run({text[cfg_end + 3:p]}{callee}"
                   f"{', ' + inner if inner.strip() else ''})")
        pos = args_end
    out.append(text[pos:])
    text = "".join(out)

    def shared(m):  # __shared__ T name[N]; -> static T name[N]; registered once
        return (f"static {m.group(1)}{m.group(2)}{m.group(3)}; [[maybe_unused]] static const bool "
                f"{m.group(2)}_emu_ = emu::shared_array({m.group(2)}, sizeof {m.group(2)});")
    text = re.sub(r"(?<!extern )\b__shared__\s+([^;\[\]]*?)\b(\w+)\s*(\[[^;]*\])\s*;", shared, text)
    left = re.search(r"(?<!extern )\b__shared__\b", text)
    if left:
        fail(path, text, left.start(), "a static __shared__ declaration other than 'TYPE NAME[N];'")
    return text


def check_headers(path):
    """The headers beside path: no static __shared__ arrays (they are compiled as they are)."""
    folder = os.path.dirname(path) or "."
    for name in sorted(os.listdir(folder)):
        if name.endswith(".cuh"):
            with open(os.path.join(folder, name)) as f:
                code = re.sub(r"/\*.*?\*/|//[^\n]*", "", f.read(), flags=re.S)
            if re.search(r"(?<!extern )\b__shared__\b", code):
                sys.exit(f"error: {os.path.join(folder, name)}: a static __shared__ array in a header (hint: the "
                         f"emulation of make CUDA_EMU=1 rewrites only .cu files; declare it in the .cu, or use the "
                         f"dynamic shared memory)")


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: tests/cuda_emu_src.py SRC.cu > OUT.cpp")
    path = sys.argv[1]
    check_headers(path)
    with open(path) as f:
        text = f.read()
    sys.stdout.write(f'#line 1 "{path}"\n' + rewrite(path, text))


if __name__ == "__main__":
    main()
