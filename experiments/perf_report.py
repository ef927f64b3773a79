"""Issue 14 figures from the committed H100 results (experiments/results/perf/):

  layer.csv   T,item,fwd_ms,fwd_bwd_ms,peak_GiB,compile_s,device: the NSA layer, the full-attention
              layer (same projections, SDPA causal with GQA) and SDPA alone, each T in one process
  perf.png    left: NSA layer speed-up over the full-attention layer against T (fwd, fwd+bwd);
              right: where the NSA layer's fwd+bwd goes at T=65536, stage by stage, with the
              selection before and after the split (run 1: packed / forced+scored, run 2: the sink
              as its own part)

    python experiments/perf_report.py --out experiments/results/perf \\
        experiments/results/perf/run1_split_64k.csv experiments/results/perf/run2_layers_64k_16k.csv

Inputs are bench_attention.py CSVs (one per GPU run); layer.csv is taken from the last file that
has the layer rows of a T (rows of one T always come from one process).
"""

import argparse
import csv
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention import LAYER_ITEMS  # noqa: E402


def read(path):
    with open(path) as f:
        return [dict(r, run=os.path.basename(path)) for r in csv.DictReader(f)]


def num(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def layer_rows(runs):
    """layer.csv rows: per T, the layer items of the last run that timed the NSA layer there."""
    by_t = {}
    for rows in runs:
        for T in {r["T"] for r in rows if r["stage"] == "nsa_layer"}:
            by_t[T] = [r for r in rows if r["T"] == T and r["stage"] in LAYER_ITEMS]
    out = []
    for T in sorted(by_t, key=int):
        for r in sorted(by_t[T], key=lambda r: list(LAYER_ITEMS).index(r["stage"])):
            first = num(r.get("fwd_bwd_first_s")) or num(r.get("fwd_first_s"))
            f = lambda k: "" if num(r.get(k)) is None else f"{num(r.get(k)):.2f}"
            out.append(dict(T=int(T), item=LAYER_ITEMS[r["stage"]], fwd_ms=f("fwd_ms"),
                            fwd_bwd_ms=f("fwd_bwd_ms"), peak_GiB=f("peak_GiB"),
                            compile_s="" if first is None else f"{first:.1f}",
                            device=r.get("device", "")))
    return out


def plot(layer, runs, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))
    def speedups(mode):
        pts = {}
        for T in sorted({r["T"] for r in layer}):
            get = lambda it: next((num(r[mode]) for r in layer if r["T"] == T and r["item"] == it),
                                  None)
            n, f = get("nsa_layer"), get("full_layer")
            if n and f:
                pts[T] = f / n
        return pts

    modes = {"fwd_ms": "o--", "fwd_bwd_ms": "o-"}
    ups = {m: speedups(m) for m in modes}
    for mode, style in modes.items():
        pts = ups[mode]
        other = ups["fwd_bwd_ms" if mode == "fwd_ms" else "fwd_ms"]
        if pts:
            a.plot(list(pts), list(pts.values()), style,
                   label=mode.replace("_ms", "").replace("_", "+"))
            for T, s in pts.items():  # label above the higher of the two curves, below the other
                up = s >= other.get(T, float("-inf"))
                a.annotate(f"{s:.2f}x", (T, s), textcoords="offset points",
                           xytext=(6, 6 if up else -12))
    missing = sorted({r["T"] for r in layer if num(r["fwd_bwd_ms"]) is None})
    a.axhline(1, color="gray", lw=1)
    a.axhline(3, color="tab:red", ls=":", lw=1, label="target at 64k (3x)")
    a.set_xscale("log", base=2)
    a.set_xlim(8192, 262144)
    a.set_ylim(0, 3.5)
    a.set_xlabel("sequence length T" + (f" (no NSA time at {missing}: compile > limit)"
                                         if missing else ""))
    a.set_ylabel("full-attention layer time / NSA layer time")
    a.set_title("NSA layer vs full-attention layer (SDPA), H100, bf16, batch 1")
    a.legend(fontsize=8)

    # stage breakdown at 64k (fwd+bwd where the stage has a backward, else fwd)
    bars = []
    for rows in runs:
        for r in rows:
            if r["T"] != "65536" or r["stage"] in ("sdpa_causal", "flex_causal"):
                continue
            v = num(r.get("fwd_bwd_ms")) or num(r.get("fwd_ms"))
            if v:
                run = r["run"].split("_")[0]
                bars.append((f"{r['stage']} ({run})", v))
    names = [n for n, _ in bars]
    b.barh(range(len(bars)), [v for _, v in bars],
           color=["tab:gray" if "full_layer" in n else "tab:orange" if "packed" in n else
                  "tab:blue" for n in names])
    b.set_yticks(range(len(bars)), names, fontsize=8)
    b.invert_yaxis()
    for i, (_, v) in enumerate(bars):
        b.text(v, i, f" {v:.0f}", va="center", fontsize=8)
    b.set_xlabel("ms (fwd+bwd; score_topn: fwd, no gradient)")
    b.set_title("T=65536 per GPU run (run1: forced + scored split; run2: + sink part)",
                fontsize=9)
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
        w = csv.DictWriter(f, fieldnames=["T", "item", "fwd_ms", "fwd_bwd_ms", "peak_GiB",
                                          "compile_s", "device"])
        w.writeheader()
        w.writerows(layer)
    plot(layer, runs, os.path.join(args.out, "perf.png"))
    return layer


if __name__ == "__main__":
    main()
