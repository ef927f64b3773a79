"""Issue 14 figures from the committed H100 results (experiments/results/perf/):

  layer.csv   config,T,item,fwd_ms,fwd_bwd_ms,peak_GiB,compile_s,selection,sel_kernel,run,device:
              the NSA layer (selection random / trained), the full-attention layer (same
              projections, SDPA causal with GQA), SDPA alone, flex causal and fla's parallel_nsa
              (window 0) per config (paper, titan_125M) and T
  perf.png    left: speed-up over the full-attention layer against T (NSA layer per config and
              selection, fla; fwd and fwd+bwd); right: where the paper-shape NSA layer's time goes
              at T=65536, stage by stage (each stage from the latest run that timed it)

    python experiments/perf_report.py --out experiments/results/perf \
        experiments/results/perf/run9/{l64,s8_16,st16,j8,j32,j64b,j128}.csv

Inputs are bench_attention.py CSVs (one per process), oldest first: each (config, T, item,
selection) is taken from the last file that timed it, so a re-measured row replaces an older one (session 9: the rows timed
while other processes compiled, before the shared/exclusive timing lock, were re-run).
"""

import argparse
import csv
import os

from bench_attention import LAYER_ITEMS  # experiments/ is on sys.path: a script


def read(path):
    with open(path) as f:
        run = os.path.join(os.path.basename(os.path.dirname(path)), os.path.basename(path))
        return [dict(r, run=run) for r in csv.DictReader(f)]  # run: RUN_DIR/FILE


def num(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def selection_of(r) -> str:
    """random / trained (a trace's label starts with "trained") for the NSA layer, "" else."""
    if r["stage"] != "nsa_layer":
        return ""
    return "trained" if (r.get("selection") or "").startswith("trained") else "random"


def latest(runs):
    """{(config, T, stage, selection): row} of the last run that timed the stage (fwd or
    fwd+bwd); a stage no run timed keeps its last row (its error), so a failed item stays
    visible."""
    got, timed = {}, set()
    for rows in runs:
        for r in rows:
            key = (r.get("config") or "paper", int(r["T"]), r["stage"], selection_of(r))
            if num(r.get("fwd_ms")) is not None or num(r.get("fwd_bwd_ms")) is not None:
                got[key] = r
                timed.add(key)
            elif key not in timed:
                got[key] = r
    return got


CONFIG_ORDER = ["paper", "titan_125M"]


def layer_rows(runs):
    """layer.csv rows: per config, T, layer item and selection, the last run that timed it."""
    out = []
    order = lambda kv: (CONFIG_ORDER.index(kv[0][0]) if kv[0][0] in CONFIG_ORDER else 9, kv[0][1],
                        list(LAYER_ITEMS).index(kv[0][2]) if kv[0][2] in LAYER_ITEMS else 99,
                        kv[0][3])
    for (config, T, stage, selection), r in sorted(latest(runs).items(), key=order):
        if stage not in LAYER_ITEMS:
            continue
        first = num(r.get("fwd_bwd_first_s")) or num(r.get("fwd_first_s"))
        f = lambda k: "" if num(r.get(k)) is None else f"{num(r.get(k)):.2f}"
        # runs before the selected-attention op timed the selection on flex's template
        kern = (r.get("sel_kernel") or "flex") if stage == "nsa_layer" else ""
        out.append(dict(config=config, T=T, item=LAYER_ITEMS[stage], fwd_ms=f("fwd_ms"),
                        fwd_bwd_ms=f("fwd_bwd_ms"), peak_GiB=f("peak_GiB"),
                        compile_s="" if first is None else f"{first:.1f}",
                        selection=selection, sel_kernel=kern, run=r["run"],
                        device=r.get("device", "")))
    return out


def plot(layer, runs, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))

    def speedups(config, item, mode, selection=""):
        pts = {}
        for T in sorted({r["T"] for r in layer if r["config"] == config}):
            get = lambda it, sel="": next((num(r[mode]) for r in layer if r["config"] == config
                                           and r["T"] == T and r["item"] == it
                                           and r["selection"] == sel), None)
            n, f = get(item, selection), get("full_layer")
            if n and f:
                pts[T] = f / n
        return pts

    lines = [("paper", "nsa_layer", "random", "tab:blue", "NSA layer, paper shape"),
             ("paper", "nsa_layer", "trained", "tab:cyan", "NSA layer, paper, trained sel. (125M model's)"),
             ("paper", "fla_parallel_nsa", "", "tab:green", "fla parallel_nsa (no window/proj.)"),
             ("titan_125M", "nsa_layer", "random", "tab:purple", "NSA layer, 125M shape"),
             ("titan_125M", "nsa_layer", "trained", "tab:red", "NSA layer, 125M, trained sel.")]
    for config, item, sel, color, name in lines:
        for mode, style in (("fwd_ms", "o--"), ("fwd_bwd_ms", "o-")):
            pts = speedups(config, item, mode, sel)
            if not pts:
                continue
            a.plot(list(pts), list(pts.values()), style, color=color, alpha=1 if
                   item == "nsa_layer" else 0.6, label=f"{name}, {mode[:-3].replace('_', '+')}")
            if item == "nsa_layer" and mode == "fwd_bwd_ms":
                for T, v in pts.items():  # rows timed before the op: the selection on flex
                    k = next((r["sel_kernel"] for r in layer if r["config"] == config and
                              r["T"] == T and r["item"] == "nsa_layer"), "")
                    a.annotate(f"{v:.2f}x" + (" (flex sel.)" if k == "flex" else ""), (T, v),
                               textcoords="offset points", xytext=(6, -12), fontsize=8)
    a.axhline(1, color="gray", lw=1)
    a.plot([65536, 16384, 8192], [4, 1.3, 1.0], "r*", ms=10,
           label="paper-shape targets (fwd+bwd): 4x at 64k, 1.3x at 16k, 1x at 8k")
    a.plot([32768], [1.5], "*", color="tab:purple", ms=10, label="125M-shape target: 1.5x at 32k")
    a.set_xscale("log", base=2)
    a.set_xlim(6000, 180000)
    a.set_ylim(0, 4.4)
    a.set_xlabel("sequence length T")
    a.set_ylabel("full-attention layer time / item time")
    a.set_title("speed-up over the full-attention layer (SDPA), H100, bf16, batch 1", fontsize=10)
    a.legend(fontsize=7, loc="upper left")

    # stage breakdown at 64k (fwd+bwd where the stage has a backward, else fwd) + whole layers
    got = latest(runs)
    order = ["projections", "compression", "score_topn", "mask_build", "attn_compressed",
             "attn_selected", "attn_window", "gate_out", "nsa_layer", "fla_parallel_nsa_w0",
             "full_layer"]
    bars = []
    for st in order:
        r = got.get(("paper", 65536, st, "random" if st == "nsa_layer" else ""))
        if r is None:
            continue
        fb, fw = num(r.get("fwd_bwd_ms")), num(r.get("fwd_ms"))
        bars.append((st, fb or fw, fw if fb else None))
    colors = ["tab:gray" if n in ("full_layer", "fla_parallel_nsa_w0") else
              "tab:blue" if n == "nsa_layer" else "tab:orange" for n, _, _ in bars]
    b.barh(range(len(bars)), [v for _, v, _ in bars], color=colors)
    b.barh(range(len(bars)), [w or 0 for _, _, w in bars], color="black", alpha=0.25,
           label="forward part")
    b.set_yticks(range(len(bars)), [n for n, _, _ in bars], fontsize=8)
    b.invert_yaxis()
    for i, (_, v, _) in enumerate(bars):
        b.text(v, i, f" {v:.0f}", va="center", fontsize=8)
    b.set_xlabel("ms, fwd+bwd (score_topn, mask_build: fwd only, no gradient)")
    b.set_title("paper shape, T=65536: NSA stages (orange), layers (blue/gray)", fontsize=10)
    b.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print("wrote", path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("runs", nargs="+", help="bench_attention.py CSVs, oldest first")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    runs = [read(p) for p in args.runs]
    layer = layer_rows(runs)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "layer.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["config", "T", "item", "fwd_ms", "fwd_bwd_ms", "peak_GiB",
                                           "compile_s", "selection", "sel_kernel", "run",
                                           "device"])
        w.writeheader()
        w.writerows(layer)
    plot(layer, runs, os.path.join(args.out, "perf.png"))
    return layer


if __name__ == "__main__":
    main()
