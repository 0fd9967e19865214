#!/usr/bin/python3
"""The PyTorch peer of `make bench`: kvlab's GPT-2 (the same architecture,
variants and parameter layout) written in PyTorch, so that a GPU's speed for
kvlab can be put beside PyTorch eager and torch.compile running the same
model on the same machine (issue 17; docs/cuda.md, Speed).

The model reads the variant table (kernels/attention.tbl, through
attention_tbl.py): the fused attention projection is the table's blocks side
by side, and the query, key and value roles take the blocks the table names
(QKV, KV = Q dropped, K = one projection, KV tying = K := V). Pre-LN blocks,
learned absolute positions, GELU (tanh form), layernorm eps 1e-5, a tied or
separate head, biases as the checkpoint's configuration says. +Pos, grouped
K/V heads and the other position schemes are kvlab's own and not here: such
a checkpoint or variant is refused with a message.

Two uses:
  bench_torch.py --variant qkv --shape L H C T B V [--device cuda]
      [--precision fp32|tf32|bf16] [--compile] [--steps N] [--threads N]
      Times training steps (forward, backward, AdamW) on random tokens and
      prints one JSON object (tok/s, ms/step, peak GPU memory, threads),
      like bench/bench_step.c's records. On the CPU it uses --threads
      threads (0, the default: one per core, as kvlab's backend), not
      PyTorch's own choice, which may be fewer (Debian's PyTorch takes one).
  bench_torch.py --ckpt FILE --prompt TEXT [--prompt TEXT ...] --length N
      Loads a kvlab GPT-2 checkpoint (a character vocabulary: tiny
      Shakespeare) and prints the greedy continuation of each TEXT (the
      prompt and N tokens, within the context, as a JSON string per line),
      as `train_gpt2 sample --temperature 0` does: the check that this is
      the same model (tests/run_tests.py compares the two where PyTorch is
      installed).
"""
import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attention_tbl  # noqa: E402
import mechint  # noqa: E402  (its checkpoint header check)

try:
    import numpy as np
    import torch
    import torch.nn.functional as F
except ImportError as exc:  # one line, no traceback
    sys.exit(f"error: bench_torch.py needs numpy and PyTorch: {exc} (hint: pip install torch, or the python3-torch "
             "package; on a GPU machine the CUDA build of PyTorch)")


def fail(msg):
    sys.exit(f"error: {msg}")


# ------------------------------------------------------------------ model

class Config:
    def __init__(self, L, H, C, T, V, variant, bias=True, attn_bias=True, tie=True, head_bias=False):
        self.L, self.H, self.C, self.T, self.V = L, H, C, T, V
        self.bias, self.attn_bias, self.tie, self.head_bias = bias, attn_bias, tie, head_bias
        rows = {r["name"]: r for r in attention_tbl.variants()}
        if variant not in rows:
            fail(f"unknown variant '{variant}' (hint: one of {', '.join(rows)})")
        row = rows[variant]
        self.variant = variant
        self.blocks = row["blocks"]
        self.roles = [row["query_block"], row["key_block"], row["value_block"]]
        if C % H:
            fail(f"n_embd {C} is not a multiple of n_head {H}")


def layer_norm(C, bias):
    """kvlab's layernorm: eps 1e-5; without bias, a zero bias that never trains."""
    ln = torch.nn.LayerNorm(C, eps=1e-5)
    if not bias:
        ln.bias.requires_grad_(False)
        with torch.no_grad():
            ln.bias.zero_()
    return ln


class Block(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        P = len(c.blocks)
        self.ln1 = layer_norm(c.C, c.bias)
        self.attn = torch.nn.Linear(c.C, P * c.C, bias=c.attn_bias)
        self.proj = torch.nn.Linear(c.C, c.C, bias=c.bias)
        self.ln2 = layer_norm(c.C, c.bias)
        self.fc = torch.nn.Linear(c.C, 4 * c.C, bias=c.bias)
        self.fcp = torch.nn.Linear(4 * c.C, c.C, bias=c.bias)

    def attention(self, x):
        c = self.c
        B, T, _ = x.shape
        hd = c.C // c.H
        parts = self.attn(x).split(c.C, dim=-1)  # the table's blocks, side by side
        q, k, v = (parts[i].view(B, T, c.H, hd).transpose(1, 2) for i in c.roles)
        if hasattr(F, "scaled_dot_product_attention"):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # PyTorch before 2.0
            s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            y = s.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(B, T, c.C))

    def forward(self, x):
        x = x + self.attention(self.ln1(x))
        return x + self.fcp(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.wte = torch.nn.Embedding(c.V, c.C)
        self.wpe = torch.nn.Embedding(c.T, c.C)
        self.blocks = torch.nn.ModuleList(Block(c) for _ in range(c.L))
        self.lnf = layer_norm(c.C, c.bias)
        self.head = None if c.tie else torch.nn.Linear(c.C, c.V, bias=c.head_bias)
        with torch.no_grad():  # GPT-2's initialisation (the speed does not depend on it)
            for p in self.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.02)

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for b in self.blocks:
            x = b(x)
        x = self.lnf(x)
        logits = x @ self.wte.weight.t() if self.head is None else self.head(x)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))


# ------------------------------------------------------------------ kvlab checkpoints

def model_from_checkpoint(path):
    try:
        tensors, meta, cfg, m = mechint.gpt2_checkpoint(path)
    except (OSError, ValueError) as exc:
        fail(f"{path}: {exc} (hint: a final_model_step*.safetensors of a kvlab GPT-2 run)")
    a = m["attention"]
    if a.get("pos") or a.get("kv_heads") or not cfg.get("POSITION_ABSOLUTE", True):  # absent: before the schemes
        fail(f"{path}: {a.get('label', a.get('variant'))} uses kvlab's +Pos, grouped K/V heads or another position "
             "scheme, which the PyTorch peer does not have (hint: QKV, KV, K or KV tying with absolute positions)")
    if m["activation"] != "gelu_tanh" or m.get("ln_placement", "pre") != "pre":
        fail(f"{path}: activation {m['activation']}, layernorm {m.get('ln_placement')}: the peer is pre-LN GELU")
    c = Config(m["n_layer"], m["n_head"], m["n_embd"], m["block_size"], m["vocab_size"], a["variant"], m["bias"],
               m["attn_bias"], m["tied_head"], m["head_bias"])
    model = GPT(c)
    sd = {}

    def take(name):
        if name not in tensors:
            fail(f"{path}: tensor '{name}' is missing (hint: the checkpoint's variant is {c.variant})")
        return torch.from_numpy(tensors[name].copy())

    sd["wte.weight"] = take("wte.weight")
    sd["wpe.weight"] = take("wpe.weight")
    for l in range(c.L):
        p = f"blocks.{l}."
        for mine, theirs in (("ln1", "ln1"), ("ln2", "ln2")):
            sd[p + mine + ".weight"] = take(p + theirs + ".weight")
            if c.bias:
                sd[p + mine + ".bias"] = take(p + theirs + ".bias")
        sd[p + "attn.weight"] = torch.cat([take(p + f"attn.{b}.weight") for b in c.blocks])
        if c.attn_bias:
            sd[p + "attn.bias"] = torch.cat([take(p + f"attn.{b}.bias") for b in c.blocks])
        for mine, theirs in (("proj", "attn.proj"), ("fc", "mlp.fc"), ("fcp", "mlp.proj")):
            sd[p + mine + ".weight"] = take(p + theirs + ".weight")
            if c.bias:
                sd[p + mine + ".bias"] = take(p + theirs + ".bias")
    sd["lnf.weight"] = take("lnf.weight")
    if c.bias:
        sd["lnf.bias"] = take("lnf.bias")
    if not c.tie:
        sd["head.weight"] = take("lm_head.weight")
        if c.head_bias:
            sd["head.bias"] = take("lm_head.bias")
    missing, unexpected = model.load_state_dict(sd, strict=False)
    unset = [k for k in missing if not (k.endswith(".bias") and not c.bias)]  # layer_norm's zero biases
    if unset or unexpected:
        fail(f"{path}: parameters not matched: {unset + list(unexpected)}")
    return model, meta


def greedy(model, meta, prompt, length):
    try:
        tok = json.loads(meta["tokenizer"])
    except (KeyError, ValueError):
        fail("the checkpoint has no 'tokenizer' metadata (hint: a checkpoint written by kvlab's train_gpt2)")
    if tok.get("type") != "bytes":
        fail(f"the checkpoint's tokenizer is '{tok.get('type')}': the peer decodes character vocabularies only "
             "(tiny Shakespeare)")
    chars = tok["tokens"]
    ids = []
    for ch in prompt:
        if ch not in chars:
            fail(f"prompt: character {ch!r} is not in the checkpoint's vocabulary")
        ids.append(chars.index(ch))
    model.eval()
    with torch.no_grad():
        for _ in range(length):
            ctx = torch.tensor([ids[-model.c.T:]])
            ids.append(int(model(ctx)[0, -1].argmax()))
    return "".join(chars[i] for i in ids)


# ------------------------------------------------------------------ benchmark

def bench(args):
    L, H, C, T, B, V = args.shape
    dev = torch.device(args.device)
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda: this PyTorch sees no GPU (hint: a CUDA build of PyTorch on a machine with one)")
    torch.manual_seed(1337)
    if args.device == "cpu":
        torch.set_num_threads(args.threads or os.cpu_count() or 1)
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = args.precision != "fp32"
        torch.backends.cudnn.allow_tf32 = args.precision != "fp32"
    model = GPT(Config(L, H, C, T, V, args.variant)).to(dev)
    fused = {"fused": True} if args.device == "cuda" else {}
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **fused)
    except TypeError:  # a PyTorch without fused AdamW
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    step_model = model
    if args.compile:
        if not hasattr(torch, "compile"):
            fail(f"--compile: PyTorch {torch.__version__} has no torch.compile (hint: PyTorch 2.0 or later)")
        step_model = torch.compile(model)
    x = torch.randint(0, V, (B, T), device=dev)
    y = torch.randint(0, V, (B, T), device=dev)

    def step():
        opt.zero_grad(set_to_none=True)
        if args.precision == "bf16":
            with torch.autocast(device_type=dev.type, dtype=torch.bfloat16):
                loss = step_model(x, y)
        else:
            loss = step_model(x, y)
        loss.backward()
        opt.step()
        return loss

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    for _ in range(args.warmup):
        step()
    sync()
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - t0)
    times.sort()
    ms = times[len(times) // 2] * 1e3
    rec = {"peer": "pytorch", "torch": torch.__version__, "mode": "compile" if args.compile else "eager",
           "variant": args.variant, "precision": args.precision, "device": args.device,
           "shape": {"L": L, "H": H, "C": C, "T": T, "B": B, "V": V},
           "params": sum(p.numel() for p in model.parameters()), "ms_per_step": round(ms, 3),
           "tok_per_s": round(B * T / (ms / 1e3), 1), "step_ms": [round(t * 1e3, 3) for t in times],
           "loss": round(float(loss), 4), "threads": torch.get_num_threads()}
    if args.device == "cuda":
        rec["gpu"] = torch.cuda.get_device_name()
        rec["memory_peak_mib"] = round(torch.cuda.max_memory_allocated() / 1048576.0, 1)
    print(json.dumps(rec))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", default="qkv", help="qkv, kv, k or kv_tying (kernels/attention.tbl)")
    ap.add_argument("--shape", nargs=6, type=int, metavar=("L", "H", "C", "T", "B", "V"),
                    default=[6, 6, 384, 256, 12, 65], help="as bench_step (default: its baby shape)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--precision", choices=("fp32", "tf32", "bf16"), default="fp32")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (PyTorch 2.0 or later)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: one per core, as kvlab's backend)")
    ap.add_argument("--ckpt", help="a kvlab GPT-2 checkpoint: print the greedy continuation of --prompt")
    ap.add_argument("--prompt", action="append", help="with --ckpt: a prompt (repeat for several)")
    ap.add_argument("--length", type=int, default=20)
    args = ap.parse_args()
    if args.ckpt:
        model, meta = model_from_checkpoint(args.ckpt)
        for prompt in args.prompt or ["\n"]:  # one JSON string per line: prompts hold newlines
            print(json.dumps(greedy(model, meta, prompt, args.length)))
    else:
        if min(args.shape) < 1 or args.steps < 1 or args.warmup < 0 or args.threads < 0:
            fail("--shape values and --steps must be positive, --warmup and --threads not negative")
        bench(args)


if __name__ == "__main__":
    main()
