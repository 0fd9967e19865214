#!/usr/bin/python3
"""Plots and the cross-checkpoint comparison of mechint reports, from report.json alone.

  mechint_plots.py report DIR                 plots for DIR/report.json into DIR/
  mechint_plots.py compare [--no-plots] OUT DIR...   OUT/comparison.{json,md,png}
"""
import json
import math
import os
import sys



def relative_note(a, b):
    """', +12%' for a change from a to b; a factor when the change is over 10x, nothing when a is about 0 (a
    percentage of a baseline near zero, e.g. 1e-12, says nothing)."""
    if abs(a) <= 1e-9 * max(1.0, abs(b)):
        return ", from about 0"
    rel = (b - a) / abs(a)
    return f", {100 * rel:+.0f}%" if abs(rel) <= 10 else f", {b / a:.3g}x"

def load(d):
    with open(os.path.join(d, "report.json")) as f:
        return json.load(f)


def plt_module():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def grid(rep, analysis, key):
    a = rep["analyses"].get(analysis, {})
    ph = a.get("per_head")
    if not a.get("applies") or not ph:
        return None
    return [[(h.get(key) if h.get(key) is not None else float("nan")) for h in row] for row in ph]


def heat(ax, g, title, vmin, vmax, cmap):
    im = ax.imshow(g, vmin=vmin, vmax=vmax, cmap=cmap, aspect="auto")
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    if len(g) * len(g[0]) <= 256:
        for i, row in enumerate(g):
            for j, v in enumerate(row):
                if v == v:
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=6)
    return im


def plot_report(d):
    plt = plt_module()
    rep = load(d)
    label = f"{rep['family']} {rep['variant_label']} ({os.path.basename(d)})"
    L, H = rep["n_layer"], rep["n_head"]
    # attention maps on real inputs
    maps = rep.get("attention_maps")
    if maps:
        fig, axes = plt.subplots(L, H, figsize=(1.8 * H + 1, 1.8 * L + 0.6), squeeze=False)
        for l in range(L):
            for h in range(H):
                ax = axes[l][h]
                ax.imshow(maps[l][h], cmap="viridis", vmin=0, vmax=1)
                ax.set_xticks([]), ax.set_yticks([])
                ax.set_title(f"{rep['layers'][l]} h{h}", fontsize=7)
        fig.suptitle(f"attention on held-out data (first sequence, first 32 positions)\n{label}", fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(d, "attention_maps.png"), dpi=90)
        plt.close(fig)
    # QK and OV spectra
    circ = rep["analyses"].get("circuits")
    if circ and circ.get("applies"):
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
        for k, key in enumerate(("qk", "ov")):
            for l, row in enumerate(circ["per_head"]):
                for h, hd in enumerate(row):
                    s = hd[key]["top"]
                    axes[k].semilogy(range(1, len(s) + 1), [max(x, 1e-12) for x in s], color=f"C{l % 10}", alpha=0.7,
                                     label=rep["layers"][l] if h == 0 else None)
            axes[k].set_title(f"{key.upper()} singular values per head", fontsize=9)
            axes[k].set_xlabel("index")
            axes[k].legend(fontsize=7)
        fig.suptitle(label, fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(d, "spectra.png"), dpi=90)
        plt.close(fig)
    # head-level heatmaps
    panels = [("qk_symmetry", "sigma_sym", "A2 QK symmetry sigma_sym", -1, 1, "RdBu_r"),
              ("kv_alignment", "pk", "A3 K-V overlap PK", 0, 1, "viridis"),
              ("attn_asymmetry", "curl_share", "A7 curl share", 0, 1, "viridis"),
              ("head_types", "prev", "A8 previous-token", 0, 1, "viridis"),
              ("head_types", "induction", "A8 induction", 0, 1, "viridis"),
              ("composition", "max_in_z_k", "A9 strongest K-composition in (z)", None, None, "magma"),
              ("ablation", "dloss_mean", "A10 mean-ablation dloss (nats)", None, None, "magma")]
    avail = [(p, grid(rep, p[0], p[1])) for p in panels]
    avail = [(p, g) for p, g in avail if g is not None and any(v == v for row in g for v in row)]
    if avail:
        fig, axes = plt.subplots(1, len(avail), figsize=(3.2 * len(avail), 0.5 * L + 2.2), squeeze=False)
        for ax, (p, g) in zip(axes[0], avail):
            vmax = p[4] if p[4] is not None else max([v for row in g for v in row if v == v] + [1e-9])
            vmin = p[3] if p[3] is not None else 0
            heat(ax, g, p[2], vmin, vmax, p[5])
        fig.suptitle(label, fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(d, "heads.png"), dpi=90)
        plt.close(fig)
    # composition: z of every head (rows) into every later head (columns), per mode
    comp = rep["analyses"].get("composition", {})
    if comp.get("applies"):
        fig, axes = plt.subplots(1, 3, figsize=(13, 4.4), squeeze=False, layout="constrained")
        names = [f"{rep['layers'][p // H]} h{p % H}" for p in range(L * H)]
        zs = {k: [[v if v is not None else float("nan") for v in row] for row in comp["modes"][k]["z"]] for k in "qkv"}
        top = max([abs(v) for g in zs.values() for row in g for v in row if v == v] + [1e-9])
        for ax, k in zip(axes[0], "qkv"):
            im = ax.imshow(zs[k], cmap="RdBu_r", vmin=-top, vmax=top, aspect="auto")
            ax.set_title(f"A9 {k.upper()}-composition z", fontsize=9)
            ax.set_xlabel("into head", fontsize=8)
            if k == "q":
                ax.set_ylabel("from head", fontsize=8)
            if L * H <= 24:
                ax.set_xticks(range(L * H), names, rotation=90, fontsize=6)
                ax.set_yticks(range(L * H), names, fontsize=6)
        fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8)
        fig.suptitle(label, fontsize=8)
        fig.savefig(os.path.join(d, "composition.png"), dpi=90)
        plt.close(fig)
    # positional: layer-0 kernel profile and +Pos key prior
    pk, pb = rep["analyses"].get("pos_kernel", {}), rep["analyses"].get("pos_bias", {})
    if pk.get("applies") or pb.get("applies"):
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
        if pk.get("applies"):
            for h, hd in enumerate(pk["per_head"][0]):
                x0 = hd["profile_first_offset"]
                axes[0].plot(range(x0, x0 + len(hd["profile"])), [v if v is not None else float("nan") for v in hd["profile"]],
                             label=f"h{h}")
            axes[0].set_title("A5 layer-0 positional kernel t(offset) = mean K~[i, i+offset]", fontsize=9)
            axes[0].set_xlabel("key offset (negative = earlier)")
            axes[0].legend(fontsize=7)
        if pb.get("applies"):
            for l, row in enumerate(pb["per_head"]):
                axes[1].plot(row[0]["key_prior_g"], label=f"{rep['layers'][l]} alpha={row[0]['alpha']:.2f}")
            axes[1].set_title("A6 +Pos key-position prior g(j) (the part that changes attention)", fontsize=9)
            axes[1].set_xlabel("key position j")
            axes[1].legend(fontsize=7)
        fig.suptitle(label, fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(d, "positional.png"), dpi=90)
        plt.close(fig)
    # masks: faithfulness curve and one mask
    km = rep["analyses"].get("kv_masks", {})
    if km.get("applies"):
        c = km["curve"]
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
        kept = [p["kept"] for p in c]
        axes[0].plot(kept, [p["faithfulness"] for p in c], "o-", label="learned")
        axes[0].plot(kept, [p["magnitude_faithfulness"] for p in c], "s--", label="magnitude (top singular)")
        mu = [p["random_faithfulness_mean"] for p in c]
        sd = [p["random_faithfulness_sd"] or 0 for p in c]
        axes[0].fill_between(kept, [a - b for a, b in zip(mu, sd)], [a + b for a, b in zip(mu, sd)], alpha=0.3,
                             label="random (mean +- sd)")
        axes[0].set_xlabel("kept fraction of K/V directions")
        axes[0].set_ylabel("faithfulness")
        axes[0].set_title("A11 faithfulness vs sparsity", fontsize=9)
        axes[0].legend(fontsize=7)
        withmask = [p for p in c if "mask" in p]
        if withmask:
            mk = withmask[0]["mask"]
            roles = km["summary"]["roles"]
            rows = [row for r in mk for row in r]
            axes[1].imshow(rows, cmap="Greys", aspect="auto", vmin=0, vmax=1)
            axes[1].set_title(f"A11 hard masks at kept {withmask[0]['kept']:.2f}: rows = "
                              f"{' then '.join(roles)} x (layer, head), columns = singular direction", fontsize=8)
        fig.suptitle(label, fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(d, "masks.png"), dpi=90)
        plt.close(fig)


METRICS = [
    ("A1 mean erank W_QK", "circuits", "mean_erank_qk"),
    ("A1 mean erank W_OV", "circuits", "mean_erank_ov"),
    ("A2 mean QK symmetry", "qk_symmetry", "mean_sigma_sym"),
    ("A3 mean K-V overlap PK", "kv_alignment", "mean_pk"),
    ("A3 mean tieability tau_QK", "kv_alignment", "mean_tau_qk"),
    ("A5 mean prev-token margin (layer 0)", "pos_kernel", "mean_mu_prev"),
    ("A7 mean antisymmetric share", "attn_asymmetry", "mean_antisym_share"),
    ("A7 mean curl share", "attn_asymmetry", "mean_curl_share"),
    ("A8 induction loss (repeated copy)", "head_types", "induction_loss_second_copy"),
    ("A9 max K-composition z", "composition", "max_z_k"),
    ("A9 max V-composition z", "composition", "max_z_v"),
    ("A9 corr of K- and V-composition", "composition", "corr_cs_k_v"),
    ("A10 clean loss", "ablation", "clean_loss"),
    ("A10 max mean-ablation dloss", "ablation", "max_dloss_mean"),
    ("A10 heads for 90% of effect", "ablation", "heads_for_90pct_of_effect"),
]


def summary_value(rep, analysis, key):
    a = rep["analyses"].get(analysis)
    if not a or not a.get("applies"):
        return None
    v = a.get("summary", {}).get(key)
    return v if isinstance(v, (int, float)) else None


def mask_faith(rep):
    km = rep["analyses"].get("kv_masks")
    if not km or not km.get("applies"):
        return {}
    return {f"{p['target_kept']:.2f}": p["faithfulness"] for p in km["curve"]}


def census(rep):
    a = rep["analyses"].get("head_types")
    return a.get("summary", {}).get("census", {}) if a and a.get("applies") else {}


def compare(out, dirs, plots=True):
    reps = [(os.path.basename(d), load(d)) for d in dirs]
    base_name, base = reps[0]
    rows = []
    for name, rep in reps:
        rows.append({"checkpoint": name, "variant": rep["variant_label"], "step": rep.get("checkpoint_meta", {}).get("ablation_step"),
                     "metrics": {m[0]: summary_value(rep, m[1], m[2]) for m in METRICS},
                     "mask_faithfulness": mask_faith(rep), "head_census": census(rep)})
    findings = []
    for r in rows[1:]:
        for label, _, _ in METRICS:
            a, b = rows[0]["metrics"][label], r["metrics"][label]
            if a is None or b is None:
                continue
            diff = b - a
            rel = diff / abs(a) if a else float("inf")
            if abs(diff) > 1e-3 and (abs(rel) >= 0.1 or not a):
                findings.append(f"{r['variant']} ({r['step']}) vs {rows[0]['variant']} ({rows[0]['step']}): {label} "
                                f"{a:.4g} -> {b:.4g} ({diff:+.4g}{relative_note(a, b)})")
        for t, f in r["mask_faithfulness"].items():
            f0 = rows[0]["mask_faithfulness"].get(t)
            if f0 is not None and f is not None and abs(f - f0) > 0.05:
                findings.append(f"{r['variant']} vs {rows[0]['variant']}: K/V mask faithfulness at kept {t} "
                                f"{f0:.3f} -> {f:.3f} ({f - f0:+.3f})")
        if r["head_census"] != rows[0]["head_census"]:
            findings.append(f"{r['variant']} vs {rows[0]['variant']}: head census {rows[0]['head_census']} -> {r['head_census']}")
    result = {"baseline": base_name, "checkpoints": rows, "findings": findings}
    os.makedirs(out, exist_ok=True)
    tmp = os.path.join(out, "comparison.json.tmp")
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, os.path.join(out, "comparison.json"))
    lines = [f"# mechint comparison ({len(rows)} checkpoints, baseline {base_name})", ""]
    lines.append("| metric | " + " | ".join(f"{r['variant']} ({r['step']})" for r in rows) + " |")
    lines.append("|---|" + "---|" * len(rows))
    for label, _, _ in METRICS:
        vals = [r["metrics"][label] for r in rows]
        lines.append(f"| {label} | " + " | ".join("n/a" if v is None else f"{v:.4g}" for v in vals) + " |")
    targets = sorted({t for r in rows for t in r["mask_faithfulness"]}, reverse=True)
    for t in targets:
        vals = [r["mask_faithfulness"].get(t) for r in rows]
        lines.append(f"| A11 faithfulness at kept {t} | " + " | ".join("n/a" if v is None else f"{v:.3f}" for v in vals) + " |")
    lines += ["", "## What differs", ""]
    lines += [f"- {f}" for f in findings] or ["- no metric differs by more than 10%"]
    lines += ["", "Changes under 10% (relative) are not listed; docs/mechint.md says how to read each metric.", ""]
    tmp = os.path.join(out, "comparison.md.tmp")
    with open(tmp, "w") as f:
        f.write("\n".join(lines))
    os.replace(tmp, os.path.join(out, "comparison.md"))
    print("\n".join(lines))
    if plots:
        plt = plt_module()
        shown = [m for m in METRICS if all(r["metrics"][m[0]] is not None for r in rows)]
        if shown:
            n = len(shown)
            cols = min(4, n)
            fig, axes = plt.subplots((n + cols - 1) // cols, cols, figsize=(3.2 * cols, 2.6 * ((n + cols - 1) // cols)),
                                     squeeze=False)
            for ax, m in zip([a for row in axes for a in row], shown):
                ax.bar(range(len(rows)), [r["metrics"][m[0]] for r in rows], color=[f"C{i}" for i in range(len(rows))])
                ax.set_xticks(range(len(rows)))
                ax.set_xticklabels([r["step"] or r["variant"] for r in rows], fontsize=7)
                ax.set_title(m[0], fontsize=8)
            for ax in [a for row in axes for a in row][n:]:
                ax.axis("off")
            fig.tight_layout()
            fig.savefig(os.path.join(out, "comparison.png"), dpi=90)
            plt.close(fig)


def main(argv):
    if len(argv) >= 2 and argv[0] == "report":
        plot_report(argv[1])
        return 0
    if len(argv) >= 3 and argv[0] == "compare":
        plots = True
        args = argv[1:]
        if args[0] == "--no-plots":
            plots, args = False, args[1:]
        compare(args[0], args[1:], plots)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
