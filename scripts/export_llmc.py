#!/usr/bin/python3
"""Writes a kvlab GPT-2 checkpoint in llm.c's model format, so that llm.c
(train_gpt2.c on the CPU, train_gpt2_fp32.cu on a GPU) starts from the same
weights as kvlab: the losses of one batch then agree, and a side-by-side
timing compares the same model.

llm.c's format (version 3, float32): a header of 256 int32 (magic 20240326,
version 3, max sequence length, vocabulary, layers, heads, channels, padded
vocabulary), then 16 tensors one after the other: wte (Vp, C) with rows
V..Vp-1 zero, wpe (T, C), and per tensor kind every layer's in turn: ln1 weight
and bias, the fused query/key/value weight (3C, C) and bias, the attention
output projection, ln2, the MLP's fc (4C, C) and projection (C, 4C), then the
final layernorm. kvlab keeps the query, key and value blocks as tensors of
their own; they are stacked in that order.

Only the models llm.c's GPT-2 is: standard attention (QKV) with learned
absolute positions, no +Pos and no grouped K/V heads, pre-LN, GELU (tanh),
biases everywhere, the head tied to the token embedding and without a bias.
Anything else is refused in one line naming what differs.

A model trained with a padded vocabulary (CONFIG_GPT2_VOCAB_MULTIPLE: the model
description's "vocab_padding" tokens at the end of "vocab_size") is written with
the data's vocabulary as llm.c's V: its padding rows become llm.c's zero rows.

usage: scripts/export_llmc.py --ckpt CKPT --out OUT.bin [--padded-vocab N]
       (N: llm.c's padded vocabulary, default V rounded up to a multiple of 128)
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mechint  # noqa: E402  (gpt2_checkpoint: the checkpoint reader every script shares)

try:
    import numpy as np
except ImportError as exc:  # one line, no traceback
    sys.exit(f"error: export_llmc.py needs numpy: {exc} (hint: the python3-numpy package)")

MAGIC, VERSION = 20240326, 3


def fail(msg):
    sys.exit(f"error: {msg}")


def llmc_tensors(tensors, m, vp):
    """llm.c's 16 tensors in its order, as float32 arrays, from a kvlab GPT-2 model description m."""
    L, C, V = m["n_layer"], m["n_embd"], data_vocab(m)

    def take(name):
        if name not in tensors:
            raise ValueError(f"tensor {name!r} is missing")
        return tensors[name]

    def layers(fmt):
        return np.stack([take(fmt.format(l)) for l in range(L)])

    wte = np.zeros((vp, C), dtype=np.float32)
    wte[:V] = take("wte.weight")[:V]  # kvlab's padding rows (never a token of the data) stay zero
    qkvw = np.stack([np.concatenate([take(f"blocks.{l}.attn.{b}.weight") for b in "qkv"]) for l in range(L)])
    qkvb = np.stack([np.concatenate([take(f"blocks.{l}.attn.{b}.bias") for b in "qkv"]) for l in range(L)])
    return [wte, take("wpe.weight"), layers("blocks.{}.ln1.weight"), layers("blocks.{}.ln1.bias"), qkvw, qkvb,
            layers("blocks.{}.attn.proj.weight"), layers("blocks.{}.attn.proj.bias"), layers("blocks.{}.ln2.weight"),
            layers("blocks.{}.ln2.bias"), layers("blocks.{}.mlp.fc.weight"), layers("blocks.{}.mlp.fc.bias"),
            layers("blocks.{}.mlp.proj.weight"), layers("blocks.{}.mlp.proj.bias"), take("lnf.weight"),
            take("lnf.bias")]


def data_vocab(m):
    """The tokens of the data set: the model's vocabulary less its padding (CONFIG_GPT2_VOCAB_MULTIPLE)."""
    return m["vocab_size"] - m.get("vocab_padding", 0)


def unlike_llmc(m, cfg):
    """What makes the kvlab model m not llm.c's GPT-2, or None."""
    a = m.get("attention", {})
    checks = [
        (a.get("variant") == "qkv", f"attention {a.get('label', a.get('variant'))}: llm.c has standard attention "
                                    "(QKV) only"),
        (not a.get("pos"), "+Pos: llm.c has no positional term in its scores"),
        (not a.get("kv_heads"), f"{a.get('kv_heads')} K/V heads: llm.c has one K/V head per query head"),
        (cfg.get("POSITION_ABSOLUTE", True), "the position scheme: llm.c has learned absolute positions only"),
        (m.get("activation") == "gelu_tanh", f"activation {m.get('activation')}: llm.c's MLP is GELU (tanh)"),
        (m.get("ln_placement", "pre") == "pre", "post-LN: llm.c is pre-LN"),
        (m.get("bias") and m.get("attn_bias"), "linear layers without biases: llm.c has them everywhere"),
        (m.get("tied_head") and not m.get("head_bias"), "an untied head or a head bias: llm.c ties the head to wte"),
    ]
    return next((why for ok, why in checks if not ok), None)


def main():
    ap = argparse.ArgumentParser(description="a kvlab GPT-2 checkpoint in llm.c's model format (version 3, float32)")
    ap.add_argument("--ckpt", required=True, help="a kvlab GPT-2 checkpoint (final_model_step*.safetensors)")
    ap.add_argument("--out", required=True, help="the llm.c model file to write (e.g. gpt2_124M.bin)")
    ap.add_argument("--padded-vocab", type=int, help="llm.c's padded vocabulary (default: V rounded up to 128)")
    args = ap.parse_args()
    try:
        tensors, meta, cfg, m = mechint.gpt2_checkpoint(args.ckpt)
    except (OSError, ValueError) as exc:
        fail(f"{args.ckpt}: {exc} (hint: a final_model_step*.safetensors of a kvlab GPT-2 run)")
    why = unlike_llmc(m, cfg)
    if why:
        fail(f"{args.ckpt}: not a model llm.c has: {why} (hint: export a V0/QKV step of a GPT-2 run with the "
             "default biases and tied head)")
    V = data_vocab(m)
    vp = args.padded_vocab if args.padded_vocab is not None else (V + 127) // 128 * 128
    if not V <= vp <= 16 * V:
        fail(f"--padded-vocab {vp} is outside [{V}, {16 * V}] (hint: llm.c pads the vocabulary ({V}) up to a multiple "
             f"of 128, {(V + 127) // 128 * 128} here, the default)")
    try:
        parts = llmc_tensors(tensors, m, vp)
    except ValueError as exc:
        fail(f"{args.ckpt}: {exc} (hint: the checkpoint of a QKV step of kvlab's GPT-2)")
    header = np.zeros(256, dtype=np.int32)
    header[:8] = [MAGIC, VERSION, m["block_size"], V, m["n_layer"], m["n_head"], m["n_embd"], vp]
    tmp = f"{args.out}.tmp.{os.getpid()}"  # this export's own: two at once must not write into one
    try:
        with open(tmp, "wb") as f:
            header.tofile(f)
            for t in parts:
                np.ascontiguousarray(t, dtype=np.float32).tofile(f)
        os.replace(tmp, args.out)
    except OSError as exc:
        if os.path.exists(tmp):
            os.remove(tmp)  # no half-written file is left behind
        fail(f"{args.out}: cannot write: {exc.strerror} (hint: --out names a file in a folder you can write, with room "
             "for the model)")
    n = sum(t.size for t in parts)
    print(f"wrote {args.out}: llm.c model version {VERSION}, {n:,} floats (V {V} padded to {vp}, L {m['n_layer']}, "
          f"H {m['n_head']}, C {m['n_embd']}, T {m['block_size']})")


if __name__ == "__main__":
    main()
