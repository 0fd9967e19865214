#!/usr/bin/python3
"""A CUDA source of the backend (kernels/cuda/*.cu) as C++ for the emulated
CUDA backend (make CUDA_EMU=1; tests/cuda_emu_runtime.h):

  tests/cuda_emu_src.py SRC.cu > OUT.cpp

Two rewrites, each keeping every line where it was (a `#line` directive
names SRC, so compiler messages point into it):
- a launch `KERNEL<<<GRID, BLOCK[, SMEM[, STREAM]]>>>(ARGS)` becomes
  `emu::kernel_launch([&] { KERNEL(ARGS); }, (const void *)(KERNEL), GRID,
  BLOCK[, SMEM[, STREAM]])`: the kernel as a function every emulated thread
  calls, and its address, by which the emulation knows the shared memory
  cudaFuncSetAttribute gave it;
- a static `__shared__` array (not `extern`: those are the dynamic shared
  memory, global arrays of the emulation) becomes `static`, one per program
  as a block's is one per block (blocks run one after the other).
Anything it cannot parse stops it with the line number."""
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
        out.append(f"emu::kernel_launch([&] {{ {callee}{text[cfg_end + 3:p]}{text[p:args_end]}; }}, "
                   f"(const void *)({callee}), {cfg})")
        pos = args_end
    out.append(text[pos:])
    text = "".join(out)
    return re.sub(r"(?<!extern )\b__shared__\b", "static", text)


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: tests/cuda_emu_src.py SRC.cu > OUT.cpp")
    path = sys.argv[1]
    with open(path) as f:
        text = f.read()
    sys.stdout.write(f'#line 1 "{path}"\n' + rewrite(path, text))


if __name__ == "__main__":
    main()
