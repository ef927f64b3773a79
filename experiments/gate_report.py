"""Curves of the retrieval gate (experiments/retrieval_gate.sh): per variant, the validation's
teacher-forced passkey answer loss and exact answers by step and by tokens (with the exact answers
whose needle lies beyond the model's sliding window, where NSA's window cannot reach, apart), as
one CSV and one PNG.

    python experiments/gate_report.py OUT [--tokens-per-step 32768] [--out DIR] [--reference GATE_CSV:VARIANT]

OUT: the gate's output folder (OUT/<variant>/metrics.jsonl, or, for a run cut before the copy,
the console log OUT/<variant>/train.log: its "validate step: N  retrieval: passkey loss X exact Y%
(near A%, far B%) sel recall R" lines). Writes DIR/gate.csv (variant, step, tokens, answer_loss,
exact, exact_near, exact_far, val_loss, sel_recall, sel_recall_best: the best layer's; near / far
empty where the run did not log them, the recalls where the run had no `[validation]
retrieval_recall_docs`) and DIR/gate.png
(panels for the recall and the validation loss where the runs logged them; each --reference, a
variant of an earlier run's gate.csv such as full attention under the same recipe, dashed beside),
and prints the first step where each variant reached 50% and 95% exact. Where the final evaluation
ran (OUT/<variant>/needle/needle.csv; else the newest of a run's evaluations while it trained,
needle_step-N/, named in the column "evaluated"), also DIR/gate_depth.csv: per variant and needle depth the
prompts answered right and the mean selection recall of the needle's block at the question (NSA:
whether the answers come from the selection or only from the window); where the final checkpoint
was evaluated beyond its training length too (OUT/<variant>/needle_long, retrieval_gate.sh's
LONG_LENGTHS), DIR/gate_lengths.csv: the same per variant and length. Where NSA's telemetry was
logged (`[nsa] telemetry_every`), also DIR/gate_layers.csv: per variant, step and layer the gates'
shares of the three branches, the mean selection distance (blocks back) and the distillation's KL
(the indexer's; '' without), so runs whose copy formed and runs whose did not compare layer by layer.
"""

import argparse
import csv
import os
import re

from nsa_flex.apps.plot import read_metrics

# the columns of gate.csv a run may lack (empty there), after variant, step, tokens, answer_loss, exact
OPTIONAL = ("exact_near", "exact_far", "val_loss", "sel_recall", "sel_recall_best")
_VAL = re.compile(r"validate step:\s*(\d+)\s+loss:\s*([\d.]+)")
_RET = re.compile(r"validate step:\s*(\d+)\s+retrieval: passkey loss ([\d.]+) exact (\d+)%"
                  r"(?: \(near (\d+)%, far (\d+)%\))?(?: sel recall ([\d.]+)(?: \(best layer \d+ ([\d.]+)\))?)?")


def read_variant(folder: str) -> list[dict]:
    """Validation rows {step, answer_loss, exact[, exact_near, exact_far, val_loss]} of one variant."""
    rows: dict[int, dict] = {}
    path = os.path.join(folder, "metrics.jsonl")
    if os.path.isfile(path):  # merged per step, resumes and cut lines handled as the plot does
        for step, r in read_metrics(path).items():
            if "retrieval/passkey_answer_loss" in r:
                rows[step] = {"step": step, "answer_loss": r["retrieval/passkey_answer_loss"],
                              "exact": r["retrieval/passkey_exact"]}
                for reach in ("near", "far"):
                    if f"retrieval/passkey_exact_{reach}" in r:
                        rows[step][f"exact_{reach}"] = r[f"retrieval/passkey_exact_{reach}"]
                for key in ("sel_recall", "sel_recall_best"):
                    if f"retrieval/passkey_{key}" in r:
                        rows[step][key] = r[f"retrieval/passkey_{key}"]
                if "validation_metrics/loss" in r:
                    rows[step]["val_loss"] = r["validation_metrics/loss"]
    else:
        with open(os.path.join(folder, "train.log")) as f:
            for line in f:
                if m := _RET.search(line):
                    row = rows.setdefault(int(m.group(1)), {"step": int(m.group(1))})
                    row["answer_loss"], row["exact"] = float(m.group(2)), int(m.group(3)) / 100
                    if m.group(4) is not None:
                        row["exact_near"], row["exact_far"] = int(m.group(4)) / 100, int(m.group(5)) / 100
                    if m.group(6) is not None:
                        row["sel_recall"] = float(m.group(6))
                    if m.group(7) is not None:
                        row["sel_recall_best"] = float(m.group(7))
                elif m := _VAL.search(line):
                    rows.setdefault(int(m.group(1)), {"step": int(m.group(1))})["val_loss"] = float(m.group(2))
    return [rows[s] for s in sorted(rows) if "answer_loss" in rows[s]]


def read_reference(spec: str) -> tuple[str, list[dict]]:
    """``GATE_CSV:VARIANT``: that variant's rows of an earlier run's gate.csv (a committed baseline,
    e.g. full attention under the same recipe), labelled ``VARIANT (folder of GATE_CSV)``."""
    path, sep, variant = spec.rpartition(":")
    if not sep or not os.path.isfile(path):
        raise SystemExit(f"gate_report.py: --reference {spec!r}: expected GATE_CSV:VARIANT with an existing CSV")
    rows = []
    for r in csv.DictReader(open(path)):
        if r["variant"] == variant:
            rows.append({"step": int(r["step"]), **{k: float(r[k]) for k in ("answer_loss", "exact", *OPTIONAL)
                                                      if r.get(k) not in (None, "")}})
    if not rows:
        raise SystemExit(f"gate_report.py: --reference {spec!r}: no rows of variant {variant!r} in {path}")
    return f"{variant} ({os.path.basename(os.path.dirname(os.path.abspath(path)))})", rows


def newest_evaluation(folder: str) -> tuple[str, str] | None:
    """(needle.csv, "final") of OUT/<variant>/needle, else of the newest needle_step-N (retrieval_gate.sh's
    EVAL_EACH_CKPT: a run lost before its end), as (path, "step-N"); None without one."""
    final = os.path.join(folder, "needle", "needle.csv")
    if os.path.isfile(final):
        return final, "final"
    steps = [(int(m[1]), d) for d in os.listdir(folder) if (m := re.fullmatch(r"needle_step-(\d+)", d))
             and os.path.isfile(os.path.join(folder, d, "needle.csv"))]
    if not steps:
        return None
    step, d = max(steps)
    return os.path.join(folder, d, "needle.csv"), f"step-{step}"


def tally(rows: list[dict]) -> dict:
    """Prompts, right answers and the mean sel_recall ('' without) of rows of a needle.csv."""
    rec = [float(r["sel_recall"]) for r in rows if r.get("sel_recall") not in (None, "")]
    return {"prompts": len(rows), "correct": sum(r["correct"] in ("1", "True", "true") for r in rows),
            "sel_recall": f"{sum(rec) / len(rec):.3f}" if rec else ""}


def depth_rows(folder: str, name: str) -> list[dict]:
    """Per depth of the variant's newest evaluation (`newest_evaluation`): prompts, correct, mean
    sel_recall ('' without), and which checkpoint it read ("final" or "step-N")."""
    found = newest_evaluation(folder)
    if found is None:
        return []
    path, source = found
    by: dict[float, list[dict]] = {}
    for r in csv.DictReader(open(path)):
        by.setdefault(float(r["depth"]), []).append(r)
    return [{"variant": name, "evaluated": source, "depth": f"{depth:g}", **tally(by[depth])}
            for depth in sorted(by)]


def length_rows(folder: str, name: str) -> list[dict]:
    """Per length of the variant's evaluation beyond its training length (OUT/<variant>/needle_long,
    retrieval_gate.sh's LONG_LENGTHS): prompts, correct, mean sel_recall ('' without); [] without."""
    path = os.path.join(folder, "needle_long", "needle.csv")
    if not os.path.isfile(path):
        return []
    by: dict[int, list[dict]] = {}
    for r in csv.DictReader(open(path)):
        by.setdefault(int(r["length"]), []).append(r)
    return [{"variant": name, "length": length, **tally(by[length])} for length in sorted(by)]


LAYER_KEYS = {"share_cmp": "gate_share/cmp", "share_sel": "gate_share/sel", "share_win": "gate_share/win",
              "sel_dist_mean": "sel_dist_mean", "sel_distill_kl": "sel_distill_kl"}


def layer_rows(folder: str, name: str) -> list[dict]:
    """Per telemetry step and layer of the variant's metrics.jsonl: LAYER_KEYS' values ('' where the
    run did not log one); [] without metrics.jsonl or telemetry."""
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    out = []
    for step, r in read_metrics(path).items():
        layers = sorted({int(m[1]) for k in r if (m := re.fullmatch(r"nsa/layer(\d+)/gate_share/sel", k))})
        for i in layers:
            out.append({"variant": name, "step": step, "layer": i,
                        **{col: (f"{r[f'nsa/layer{i}/{key}']:.4f}" if f"nsa/layer{i}/{key}" in r else "")
                           for col, key in LAYER_KEYS.items()}})
    return out


def write_rows(path: str, rows: list[dict]) -> None:
    """A CSV of dicts with the first row's keys as its header."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="the gate's OUT folder")
    p.add_argument("--tokens-per-step", type=int, default=2048 * 16)
    p.add_argument("--out", help="where gate.csv and gate.png go (default: the run folder)")
    p.add_argument("--reference", action="append", default=[], metavar="GATE_CSV:VARIANT",
                   help="also plot (dashed, not in gate.csv) a variant of an earlier run's gate.csv")
    a = p.parse_args(argv)
    out = a.out or a.run
    os.makedirs(out, exist_ok=True)
    names = sorted(n for n in os.listdir(a.run) if os.path.isfile(os.path.join(a.run, n, "train.log"))
                   or os.path.isfile(os.path.join(a.run, n, "metrics.jsonl")))
    curves = {n: read_variant(os.path.join(a.run, n)) for n in names}
    with open(os.path.join(out, "gate.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["variant", "step", "tokens", "answer_loss", "exact", *OPTIONAL])
        for n, rows in curves.items():
            for r in rows:
                w.writerow([n, r["step"], r["step"] * a.tokens_per_step, f"{r['answer_loss']:.4f}", f"{r['exact']:.4f}"]
                           + [f"{r[k]:.4f}" if k in r else "" for k in OPTIONAL])
    for rows_of, csv_name, cell in ((depth_rows, "gate_depth.csv", lambda r: f"({r['evaluated']}) depth {r['depth']:>4s}%"),
                                    (length_rows, "gate_lengths.csv", lambda r: f"(final) length {r['length']:>6d}")):
        rows = [r for n in names for r in rows_of(os.path.join(a.run, n), n)]
        if rows:
            write_rows(os.path.join(out, csv_name), rows)
            for r in rows:
                print(f"{r['variant']:24s} {cell(r)}: {r['correct']}/{r['prompts']} right"
                      + (f", selection recall {r['sel_recall']}" if r["sel_recall"] else ""))
    layers = [r for n in names for r in layer_rows(os.path.join(a.run, n), n)]
    if layers:
        write_rows(os.path.join(out, "gate_layers.csv"), layers)
    for n, rows in curves.items():
        first = {t: next((r["step"] for r in rows if r["exact"] >= t), None) for t in (0.5, 0.95)}
        last = rows[-1] if rows else {}
        print(f"{n:24s} last step {last.get('step')}: answer loss {last.get('answer_loss', float('nan')):.3f} "
              f"exact {100 * last.get('exact', 0):.0f}% | 50% at step {first[0.5]}, 95% at step {first[0.95]}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    refs = dict(read_reference(spec) for spec in a.reference)
    extra = [k for k in ("sel_recall", "val_loss")
             if any(k in r for rows in (*curves.values(), *refs.values()) for r in rows)]
    fig, axes = plt.subplots(1, 3 + len(extra), figsize=(17 + 5.5 * len(extra), 4.5))
    ax1, ax2, ax3 = axes[:3]
    panel = dict(zip(extra, axes[3:]))
    for n, rows in [*curves.items(), *refs.items()]:
        tok = [r["step"] * a.tokens_per_step / 1e6 for r in rows]
        ls = "--" if n in refs else "-"
        line, = ax1.plot(tok, [r["answer_loss"] for r in rows], ls, label=n)
        ax2.plot(tok, [100 * r["exact"] for r in rows], ls, label=n, color=line.get_color())
        for ax, key in [(ax3, "exact_far")] + [(ax, k) for k, ax in panel.items()]:
            scale = 1 if key == "val_loss" else 100
            pts = [(t, scale * r[key]) for t, r in zip(tok, rows) if key in r]
            if pts:
                ax.plot(*zip(*pts), ls, label=n, color=line.get_color())
        best = [(t, 100 * r["sel_recall_best"]) for t, r in zip(tok, rows) if "sel_recall_best" in r]
        if best and "sel_recall" in panel:  # the best layer's recall, dotted beside the mean
            panel["sel_recall"].plot(*zip(*best), ":", label=f"{n}, best layer", color=line.get_color())
    ax1.set(xlabel="training tokens (M)", ylabel="nats per answer token", title="passkey answer loss (teacher-forced)")
    ax2.set(xlabel="training tokens (M)", ylabel="% exact", title="passkey exact answers (held-out documents)",
            ylim=(-2, 102))
    ax3.set(xlabel="training tokens (M)", ylabel="% exact",
            title="exact, needle beyond the sliding window", ylim=(-2, 102))
    if "sel_recall" in panel:
        panel["sel_recall"].set(xlabel="training tokens (M)", ylabel="% of layers x KV groups (dotted: one layer)",
                                title="selection holds the far needle's block", ylim=(-2, 102))
    if "val_loss" in panel:  # the copy of the repeated filler: from ~4.4 before it forms to ~1.2
        lasts = [rows[-1]["val_loss"] for rows in (*curves.values(), *refs.values()) if rows and "val_loss" in rows[-1]]
        panel["val_loss"].set(xlabel="training tokens (M)", ylabel="nats per token",
                              title="validation loss", ylim=(1.1, max([1.6] + [v + 0.1 for v in lasts])))
    ax2.axhline(95, color="gray", ls=":", lw=1)
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "gate.png"), dpi=110)
    print(f"wrote {out}/gate.csv and gate.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
