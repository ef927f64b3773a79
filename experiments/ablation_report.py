"""One table and one picture from several ablation runs (README "Results").

Each ``experiments/ablation_runs.sh`` call writes ``OUT/ablation.csv`` (one row per run, kind and
length). This joins several of them, labels each run ``<run> (<steps> steps)`` and writes:

    OUT/report.csv   run, steps, loss, tokens/s, gates, then accuracy and digits per kind x length
    OUT/report.md    the same as a markdown table (pasted into the README)
    OUT/report.png   passkey exact-match accuracy (bars) and digits right (dots) per run and length

    python experiments/ablation_report.py --out experiments/results/ablation/report \\
        experiments/results/ablation/run5_byte1024_6000steps experiments/results/ablation/run6_...

A folder may hold runs that another folder also has (the same name): all are kept, labelled with the
folder, so a rerun never silently replaces a number.
"""

import argparse
import csv
import os
import sys

from nsa_flex.apps.eval.report import read_metrics, summarize


class ReportError(ValueError):
    pass


def digits_from_rows(path: str, kind: str, length: int) -> float | None:
    """Digits right from a run's per-prompt needle.csv (tables written before that column existed)."""
    if not os.path.isfile(path):
        return None
    rows = [r for r in csv.DictReader(open(path, newline="")) if r.get("correct") in ("0", "1")]
    got = [x["digits"] for x in summarize(rows) if x["kind"] == kind and x["length"] == length]
    return got[0] if got else None


def loss_curve(run_dir: str) -> list[tuple[int, float]]:
    """(step, loss) from a run's metrics.jsonl (or the .gz committed under experiments/results)."""
    return [(s, r["loss_metrics/global_avg_loss"]) for s, r in
            sorted(read_metrics(os.path.join(run_dir, "metrics.jsonl")).items())
            if "loss_metrics/global_avg_loss" in r]


def read_runs(folders: list[str]) -> list[dict]:
    """[{label, folder, run, steps, loss, tps, gates, acc: {(kind, L): (correct, n, acc, digits)}}]."""
    runs: dict[tuple[str, str], dict] = {}
    for folder in folders:
        path = os.path.join(folder, "ablation.csv")
        if not os.path.isfile(path):
            raise ReportError(f"{folder!r}: no ablation.csv (an experiments/ablation_runs.sh OUT folder)")
        for r in csv.DictReader(open(path, newline="")):
            key = (folder, r["run"])
            d = runs.setdefault(key, {
                "folder": os.path.basename(os.path.normpath(folder)), "run": r["run"], "steps": r["steps"],
                "loss": r["loss_last5"], "tps": r["tps"],
                "gates": "/".join(f"{float(r[g]):.2f}" if r.get(g) else "-" for g in ("gate_cmp", "gate_sel", "gate_win")),
                "acc": {}, "curve": loss_curve(os.path.join(folder, r["run"]))})
            if r.get("kind"):
                digits = float(r["digits"]) if r.get("digits") not in (None, "") else \
                    digits_from_rows(os.path.join(folder, r["run"], "needle", "needle.csv"), r["kind"], int(r["length"]))
                d["acc"][(r["kind"], int(r["length"]))] = (int(r["correct"]), int(r["n"]), float(r["accuracy"]), digits)
    if not runs:
        raise ReportError("no runs in " + ", ".join(folders))
    out = list(runs.values())
    for d in out:
        d["label"] = f"{d['run']} ({d['steps']} steps)"
    labels = [d["label"] for d in out]
    for d in out:  # the same run and steps in two folders: name the folder too
        if labels.count(d["label"]) > 1:
            d["label"] += f" [{d['folder']}]"
    return out


def columns(runs: list[dict]) -> list[tuple[str, int]]:
    return sorted({k for d in runs for k in d["acc"]}, key=lambda k: (k[0] != "passkey", k[0], k[1]))


def write_report(runs: list[dict], out: str) -> None:
    os.makedirs(out, exist_ok=True)
    cols = columns(runs)
    head = ["run", "folder", "steps", "loss_last5", "tps", "gates_cmp_sel_win"]
    with open(os.path.join(out, "report.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(head + [f"{k}_{L}_{m}" for k, L in cols for m in ("acc", "digits")])
        for d in runs:
            row = [d["run"], d["folder"], d["steps"], d["loss"], d["tps"], d["gates"]]
            for c in cols:
                a = d["acc"].get(c)
                row += [a[2], "" if a[3] is None else a[3]] if a else ["", ""]
            w.writerow(row)
    lines = ["| run | loss (last 5 logs) | " + " | ".join(f"{k} {L // 1024}k" if L % 1024 == 0 else f"{k} {L}"
                                                         for k, L in cols) + " | gates cmp / sel / win | from |",
             "| --- " * (len(cols) + 4) + "|"]
    for d in runs:
        cells = []
        for c in cols:
            a = d["acc"].get(c)
            if a is None:
                cells.append("-")
            else:
                s = f"{a[0]}/{a[1]}" + (f" ({a[3]:.2f})" if a[3] is not None else "")
                cells.append(f"**{s}**" if a[2] == 1.0 else s)
        loss = f"{float(d['loss']):.3f}" if d["loss"] else "-"
        lines.append(f"| {d['label']} | {loss} | " + " | ".join(cells) + f" | {d['gates']} | `{d['folder']}` |")
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    plot(runs, cols, os.path.join(out, "report.png"))


def plot(runs: list[dict], cols: list[tuple[str, int]], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # a feature, not an option: say why there is no plot
        print(f"ablation_report: cannot plot {path}: matplotlib is not installed ({e}); "
              "install it with pip install -e '.[plot]' (the test extra has it too)", file=sys.stderr)
        return False
    kinds = sorted({k for k, _ in cols}, key=lambda k: k != "passkey")
    curves = any(d["curve"] for d in runs)
    fig, axes = plt.subplots(len(kinds) + curves, 1,
                             figsize=(max(7.0, 0.75 * len(runs) + 2), 3.6 * (len(kinds) + curves)), squeeze=False)
    if curves:  # training loss, smoothed over 25 logs (single-batch losses are noisy)
        ax = axes[-1, 0]
        shown = []  # y range: all but the first 5% of each curve (the initial drop)
        for d in runs:
            if d["curve"]:
                steps, loss = zip(*d["curve"])
                k = min(25, len(loss))
                smooth = [sum(loss[max(0, i - k + 1): i + 1]) / len(loss[max(0, i - k + 1): i + 1])
                          for i in range(len(loss))]
                ax.plot(steps, smooth, label=d["label"], lw=1)
                shown += smooth[len(smooth) // 20:]
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (25-log mean)")
        if shown:
            ax.set_ylim(0.95 * min(shown), 1.05 * max(shown))
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    for ax, kind in zip(axes[:, 0], kinds):
        lengths = [L for k, L in cols if k == kind]
        width = 0.8 / max(1, len(lengths))
        for j, L in enumerate(lengths):
            xs = [i + (j - (len(lengths) - 1) / 2) * width for i in range(len(runs))]
            acc = [d["acc"].get((kind, L), (0, 0, float("nan"), None))[2] for d in runs]
            dig = [d["acc"].get((kind, L), (0, 0, 0, None))[3] for d in runs]
            ax.bar(xs, acc, width * 0.9, label=f"{L} tokens: exact")
            ax.plot(xs, [float("nan") if v is None else v for v in dig], "k.", ms=6,
                    label="digits right" if j == 0 else None)
        ax.set_xticks(range(len(runs)))
        ax.set_xticklabels([d["label"] for d in runs], rotation=35, ha="right", fontsize=7)
        ax.set_ylim(0, 1.05)
        ax.set_ylabel(f"{kind} accuracy")
        ax.set_title(f"{kind}: exact match (bars), digits right (dots)", fontsize=9)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folders", nargs="+", help="ablation_runs.sh OUT folders (each with ablation.csv)")
    p.add_argument("--out", required=True, help="folder for report.csv, report.md, report.png")
    args = p.parse_args(argv)
    try:
        runs = read_runs(args.folders)
    except ReportError as e:
        print(f"ablation_report: {e}", file=sys.stderr)
        return 2
    write_report(runs, args.out)
    print(open(os.path.join(args.out, "report.md")).read(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
