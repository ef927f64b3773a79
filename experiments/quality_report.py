"""Long-context quality report: the outputs of experiments/quality_runs.sh for the variants (nsa,
full_causal, sliding_only) -> summary CSVs, figures and report.md.

    python experiments/quality_report.py OUT [--dest experiments/results/quality] [--train-len 16384]

OUT holds one folder per variant (OUT/<variant>/{metrics.jsonl, needle/, position_loss/, selection/}),
as the run script writes them (or as unpacked from its quality_<variant>.tgz). Writes to --dest:
  summary_needle.csv      variant, kind, length, n, correct, accuracy, ci_lo, ci_hi (95% Wilson)
  summary_loss.csv        variant, steps, tokens, train loss (mean of the last 5 logged), last
                          validation loss, mean loss by position (all positions / beyond the window)
  position_loss.csv       variant + the rows of its position_loss.csv
  selection_stats.csv     variant + the rows of its selection_stats.csv (variants with selection)
  gates.csv               variant, step, layer, gate_mean/<branch> of the last telemetry step
  needle_heatmap_<variant>.png, loss_by_position.png (one curve per variant), loss_vs_tokens.png,
  selection_<variant>.png, selection_traces/<variant>_L<T>.npz (int16 top-n indices)
  report.md               the tables, the goals of the study checked against the numbers, and what
                          the figures do not show
"""

import argparse
import csv
import glob
import os
import re
import shutil
import sys

from nsa_flex.apps.eval.position_loss import read_rows
from nsa_flex.apps.eval.report import (TRAIN_LOSS, loss_curves, plot_heatmap, plot_loss_vs_tokens,
                                  plot_position_loss, read_metrics, summarize)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

VARIANTS = ("nsa", "full_causal", "sliding_only")
WINDOW = 512  # the sliding window of the 125M flavor (positions beyond it need the other branches)


class ReportError(ValueError):
    """A missing or unusable input, named in the message."""


def _write(path: str, rows: list[dict]) -> None:
    if not rows:
        return
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


def _read(path: str) -> list[dict]:
    return list(csv.DictReader(open(path))) if os.path.isfile(path) else []


def collect(out: str, variants: list[str]) -> dict:
    """Per variant: needle rows, loss summary, position rows, selection stats, last gates."""
    got = {}
    for v in variants:
        d = os.path.join(out, v)
        if not os.path.isdir(d):
            continue
        recs = read_metrics(os.path.join(d, "metrics.jsonl"))
        curves = loss_curves(recs)
        train = curves["train"]
        pos = read_rows(os.path.join(d, "position_loss", "position_loss.csv")) \
            if os.path.isfile(os.path.join(d, "position_loss", "position_loss.csv")) else []
        tel = [(s, r) for s, r in sorted(recs.items()) if any(k.startswith("nsa/layer") for k in r)]
        gates = []
        if tel:
            s, r = tel[-1]
            layers = sorted({int(k.split("/")[1][5:]) for k in r if k.startswith("nsa/layer")})
            gates = [{"variant": v, "step": s, "layer": i,
                      **{f"gate_mean/{b}": r.get(f"nsa/layer{i}/gate_mean/{b}", "") for b in ("cmp", "sel", "win")},
                      "sel_dist_mean": r.get(f"nsa/layer{i}/sel_dist_mean", "")} for i in layers]

        def wmean(rows, lo=1):
            rows = [r for r in rows if r["bucket_lo"] >= lo]
            n = sum(r["n_tokens"] for r in rows)
            return round(sum(r["loss"] * r["n_tokens"] for r in rows) / n, 5) if n else ""

        logged = max((s for s, r in recs.items() if TRAIN_LOSS in r), default=0)
        steps = _trained_steps(d) or logged
        loss = {"variant": v, "steps": steps or "",
                # tokens per step from the last logged record, times the steps trained
                "tokens": round(train[-1][0] / logged * steps) if train and logged else "",
                "train_loss_last5": round(sum(x for _, x in train[-5:]) / len(train[-5:]), 5) if train else "",
                "val_loss": round(curves["validation"][-1][1], 5) if curves["validation"] else "",
                "pos_loss_all": wmean(pos), f"pos_loss_beyond_{WINDOW}": wmean(pos, WINDOW)}
        got[v] = {"dir": d, "needle": _read(os.path.join(d, "needle", "needle.csv")), "loss": loss,
                  "position": pos, "selection": _read(os.path.join(d, "selection", "selection_stats.csv")),
                  "gates": gates}
    if not got:
        raise ReportError(f"{out!r} has none of the variant folders {variants}")
    return got


def _trained_steps(d: str) -> int | None:
    """The step of the final checkpoint that quality_runs.sh recorded in timeline.txt ("train: rc=0,
    checkpoint step-N"): the steps trained, where the metrics log stops at a multiple of log_freq."""
    p = os.path.join(d, "timeline.txt")
    if not os.path.isfile(p):
        return None
    with open(p) as f:
        found = re.findall(r"train: rc=0, checkpoint step-(\d+)", f.read())
    return max(map(int, found)) if found else None


def _acc(summ: list[dict], v: str, kind: str, L: int):
    for s in summ:
        if s["variant"] == v and s["kind"] == kind and int(s["length"]) == L:
            return float(s["accuracy"])
    return None


def goals(summ: list[dict], losses: dict, train_len: int, long_len: int,
          got: dict | None = None) -> list[str]:
    """The study's goals, each as one line: met / missed (by how much) / not measured."""
    out = []
    nsa, full = losses.get("nsa", {}), losses.get("full_causal", {})
    key = "val_loss" if nsa.get("val_loss") not in ("", None) and full.get("val_loss") not in ("", None) \
        else "pos_loss_all"
    if nsa.get(key) not in ("", None) and full.get(key) not in ("", None):
        d = float(nsa[key]) - float(full[key])
        out.append(f"- Loss at equal tokens ({key}): NSA {nsa[key]} vs full attention {full[key]}, "
                   f"difference {d:+.4f} nats: goal <= +0.02 {'MET' if d <= 0.02 else f'MISSED by {d - 0.02:.4f}'}.")
    else:
        out.append("- Loss at equal tokens: not measured (NSA or full attention missing).")
    for L, target in ((train_len, 0.95), (long_len, 0.80)):
        a = _acc(summ, "nsa", "passkey", L)
        if a is None:
            out.append(f"- NSA passkey at {L}: not measured.")
            continue
        line = (f"- NSA passkey at {L}: {100 * a:.1f}%: goal >= {100 * target:.0f}% "
                f"{'MET' if a >= target else f'MISSED by {100 * (target - a):.1f} points'}")
        if L == long_len:
            others = {v: _acc(summ, v, "passkey", L) for v in ("full_causal", "sliding_only")}
            above = [f"{v} {100 * x:.1f}%" for v, x in others.items() if x is not None]
            beat = all(a > x for x in others.values() if x is not None)
            line += (f"; against {', '.join(above)}: {'above' if beat else 'NOT above'} all" if above
                     else "; no other variant measured")
        out.append(line + ".")
    d = paired(got or {}, "nsa")
    if d is None or d["out"] != d["out"]:  # no position loss, or none past the window (nan)
        out.append(f"- NSA's loss past the {WINDOW}-token window below sliding_only's: not measured.")
    else:
        out.append(f"- NSA's loss past the {WINDOW}-token window minus sliding_only's (paired, token-weighted): "
                   f"{d['out']:+.4f} nats: goal < 0 {'MET' if d['out'] < 0 else 'MISSED by %.4f' % d['out']}.")
    return out


def paired(got: dict, v: str, baseline: str = "sliding_only", first: int = 16) -> dict | None:
    """Variant v's loss minus the baseline's on the same documents and positions, token-weighted
    over the buckets inside the window (from position ``first``: the first buckets hold a few
    tokens each) and beyond it: {"in": .., "out": ..}; None when either has no position loss."""
    if not (got.get(baseline) or {}).get("position") or not (got.get(v) or {}).get("position"):
        return None
    base = {r["bucket_lo"]: float(r["loss"]) for r in got[baseline]["position"]}
    parts = {"in": [0.0, 0], "out": [0.0, 0]}
    for r in got[v]["position"]:
        lo = int(r["bucket_lo"])
        if lo < first or r["bucket_lo"] not in base:
            continue
        key = "in" if lo < WINDOW else "out"
        n = int(r["n_tokens"])
        parts[key][0] += n * (float(r["loss"]) - base[r["bucket_lo"]])
        parts[key][1] += n
    return {k: (a / n if n else float("nan")) for k, (a, n) in parts.items()}


def paired_lines(got: dict, baseline: str = "sliding_only", first: int = 16) -> list[str]:
    """Loss minus the baseline's on the same documents and positions, token-weighted over the
    buckets inside the window (from position ``first``: the first buckets hold a few tokens each)
    and beyond it: a model that uses distant context gains on the baseline beyond the window."""
    if baseline not in got or not got[baseline]["position"]:
        return []
    out = ["", f"Paired difference to {baseline} (loss minus its loss on the same documents and positions, "
           "token-weighted; < 0: better):", "",
           f"| variant | positions {first}-{WINDOW} | beyond {WINDOW} | change |", "|---|---|---|---|"]
    for v, g in got.items():
        if v == baseline or not g["position"]:
            continue
        d = paired(got, v, baseline, first)
        out.append(f"| {v} | {d['in']:+.4f} | {d['out']:+.4f} | {d['out'] - d['in']:+.4f} |")
    return out


def write_report(dest: str, got: dict, summ: list[dict], train_len: int, long_len: int,
                 notes: str = "") -> str:
    losses = {v: g["loss"] for v, g in got.items()}
    lines = ["# Long-context quality: NSA vs full attention vs sliding window", "",
             "Generated by `python experiments/quality_report.py` from the outputs of "
             "`bash experiments/quality_runs.sh VARIANT OUT DATA` (TOML titan_configs/quality_125m_16k.toml, "
             "one run per variant, equal tokens).", "", "## Goals", ""]
    lines += goals(summ, losses, train_len, long_len, got)
    if notes:  # the reading of these numbers, written by whoever ran them (--notes)
        lines += ["", open(notes).read().strip()]
    lines += ["", "## Loss", "", "| variant | steps | tokens | train loss (last 5) | validation loss | "
              f"loss by position, all | beyond {WINDOW} |", "|---|---|---|---|---|---|---|"]
    for v, r in losses.items():
        lines.append(f"| {v} | {r['steps']} | {r['tokens']} | {r['train_loss_last5']} | {r['val_loss']} | "
                     f"{r['pos_loss_all']} | {r[f'pos_loss_beyond_{WINDOW}']} |")
    lines += paired_lines(got)
    lines += ["", "Figures: loss_vs_tokens.png (training loss, validation loss dashed), loss_by_position.png "
              f"(mean loss per position bucket, log x; the dotted line is the {WINDOW}-token window; right: "
              "the paired difference to sliding_only).", "",
              "## Retrieval accuracy (passkey / multikey, % correct, 95% Wilson interval)", ""]
    lengths = sorted({int(s["length"]) for s in summ})
    if lengths:
        lines += ["| variant | kind | " + " | ".join(str(L) for L in lengths) + " |",
                  "|---|---|" + "---|" * len(lengths)]
        for v in got:
            for kind in ("passkey", "multikey"):
                cells = []
                for L in lengths:
                    s = [x for x in summ if x["variant"] == v and x["kind"] == kind and int(x["length"]) == L]
                    cells.append(f"{100 * s[0]['accuracy']:.0f} ({100 * s[0]['ci_lo']:.0f}-{100 * s[0]['ci_hi']:.0f}),"
                                 f" n={s[0]['n']}" if s else "")
                if any(cells):
                    lines.append(f"| {v} | {kind} | " + " | ".join(cells) + " |")
        lines += ["", "Heatmaps (depth x length): needle_heatmap_<variant>.png."]
    sel = [r for g in got.values() for r in g["selection"]]
    if sel:
        lines += ["", "## NSA selection (selection_stats.csv, traces in selection_traces/)", "",
                  "| length | layer | picks | adjacent share | 64-row tile union | tile density | free adjacent share |",
                  "|---|---|---|---|---|---|---|"]
        for r in sel:
            lines.append(f"| {r['length']} | {r['layer']} | {r['picks']} | {r['adjacent_share']} | {r['tile_union']} | "
                         f"{r['tile_density']} | {r['adjacent_share_free']} |")
    lines += ["", "## What these figures do not show", "",
              "- One seed per variant: differences within the Wilson intervals or within a few hundredths "
              "of a nat are not evidence either way.",
              "- Retrieval is measured on synthetic needles in real-text haystacks; it is not a measure of "
              "general long-document understanding.",
              "- Lengths above the training length test RoPE extrapolation of this recipe, not of NSA alone.",
              "- Loss by position on joined documents (when the validation documents are shorter than the "
              "sequence) measures robustness to distance, not use of distant context.", ""]
    path = os.path.join(dest, "report.md")
    open(path, "w").write("\n".join(lines))
    return path


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="quality_runs.sh output folder (one sub-folder per variant)")
    p.add_argument("--dest", default=os.path.join(ROOT, "experiments", "results", "quality"))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--train-len", type=int, default=16384, help="the training sequence length")
    p.add_argument("--long-len", type=int, default=65536, help="the extrapolation length of the goals")
    p.add_argument("--notes", default="", help="a markdown file with the reading of the results, put "
                                               "after the goals in report.md")
    a = p.parse_args(argv)
    if a.notes and not os.path.isfile(a.notes):
        raise ReportError(f"--notes {a.notes!r}: no such file")
    variants = [v for v in a.variants.split(",") if v]
    if not os.path.isdir(a.out):
        raise ReportError(f"OUT {a.out!r}: no such folder")
    got = collect(a.out, variants)
    os.makedirs(a.dest, exist_ok=True)
    summ = []
    for v, g in got.items():
        rows = [r for r in g["needle"] if r.get("correct") in ("0", "1")]
        summ += [{"variant": v, **s} for s in summarize(rows)]
        if rows:
            plot_heatmap(rows, os.path.join(a.dest, f"needle_heatmap_{v}.png"), v)
    _write(os.path.join(a.dest, "summary_needle.csv"), summ)
    _write(os.path.join(a.dest, "summary_loss.csv"), [g["loss"] for g in got.values()])
    _write(os.path.join(a.dest, "position_loss.csv"),
           [{"variant": v, **r} for v, g in got.items() for r in g["position"]])
    _write(os.path.join(a.dest, "selection_stats.csv"),
           [{"variant": v, **r} for v, g in got.items() for r in g["selection"]])
    _write(os.path.join(a.dest, "gates.csv"), [r for g in got.values() for r in g["gates"]])
    plot_position_loss({v: g["position"] for v, g in got.items() if g["position"]},
                       os.path.join(a.dest, "loss_by_position.png"), "validation loss by token position",
                       marks={f"window {WINDOW}": WINDOW}, baseline="sliding_only")
    plot_loss_vs_tokens({v: os.path.join(g["dir"], "metrics.jsonl") for v, g in got.items()},
                        os.path.join(a.dest, "loss_vs_tokens.png"))
    for v, g in got.items():
        sd = os.path.join(g["dir"], "selection")
        if os.path.isfile(os.path.join(sd, "selection.png")):
            shutil.copy(os.path.join(sd, "selection.png"), os.path.join(a.dest, f"selection_{v}.png"))
        for npz in sorted(glob.glob(os.path.join(sd, "selection_L*.npz"))):
            os.makedirs(os.path.join(a.dest, "selection_traces"), exist_ok=True)
            shutil.copy(npz, os.path.join(a.dest, "selection_traces", f"{v}_{os.path.basename(npz)[10:]}"))
    report = write_report(a.dest, got, summ, a.train_len, a.long_len, a.notes)
    print(open(report).read())
    return {"summary": summ, "losses": {v: g["loss"] for v, g in got.items()}, "report": report}


if __name__ == "__main__":
    try:
        main()
    except ReportError as e:
        print(f"quality_report: error: {e}", file=sys.stderr)
        sys.exit(2)
