"""Plot one or more runs' ``metrics.jsonl`` into one PNG.

    python -m nsa_flex.plot outputs/debug_nsa [outputs/other_run ...] -o runs.png

Each argument is a run's dump folder (its ``metrics.jsonl`` is read) or a ``.jsonl`` file. Panels:
training loss (and validation loss when logged), tokens/s, peak memory, and, when the run logged
NSA telemetry (``[nsa] telemetry_every``), the mean gate of each branch and the mean distance of
the selected blocks (layer means), and, when validation scored retrieval (``[validation]
retrieval_docs``), the answer loss and the share of exact answers per kind of document. A resumed run's later records of a step replace the earlier
ones. Needs matplotlib (a dependency of nsa-flex).
"""

import argparse
import json
import math
import os
import sys

from nsa_flex.errors import UserError, user_error

PROG = "python -m nsa_flex.plot"
LOSS = "loss_metrics/global_avg_loss"
VAL_LOSS = "validation_metrics/loss"
TPS = "throughput(tps)"
MEMORY = "memory/max_reserved(GiB)"
BRANCHES = ("cmp", "sel", "win")
SEL_DIST = "nsa/sel_dist_mean"
RETRIEVAL_KINDS = ("passkey", "multikey")


class PlotError(UserError):
    """A user error (no metrics file, nothing to plot, no matplotlib): printed as one line."""


def metrics_file(path: str) -> str:
    f = os.path.join(path, "metrics.jsonl") if os.path.isdir(path) else path
    if not os.path.isfile(f):
        raise PlotError(f"{path!r}: no metrics.jsonl (give a run's dump folder or a .jsonl file)")
    return f


def read_metrics(path: str) -> dict[int, dict]:
    """step -> merged record of ``path`` (a dump folder or a .jsonl file). Records of one step are
    merged (telemetry may be a record of its own); a resume record drops the later steps logged
    before it (they are logged again); a line that is not JSON (a write cut short) is skipped with
    a warning on stderr."""
    steps: dict[int, dict] = {}
    bad: list[int] = []
    with open(metrics_file(path), errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                bad.append(n)  # a write cut short (a kill, a full disk): skipped, said below
                continue
            step = rec.get("step")
            if not isinstance(step, int):
                continue
            if rec.get("event") == "resume":
                steps = {s: r for s, r in steps.items() if s <= step}
                continue
            steps.setdefault(step, {}).update(rec)
    if bad:
        print(f"nsa_flex.plot: warning: {f.name}: skipped {len(bad)} line(s) that are not JSON (a write cut "
              f"short), line {', '.join(map(str, bad[:5]))}{' ...' if len(bad) > 5 else ''}", file=sys.stderr)
    return dict(sorted(steps.items()))


def _series(run: dict[int, dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for s, r in run.items():
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(s)
            ys.append(float(v))
    return xs, ys


def _label(path: str) -> str:
    p = os.path.normpath(path)
    return os.path.basename(os.path.dirname(p)) if p.endswith(".jsonl") else os.path.basename(p)


GRID_COLS = 6  # a row of 1, 2 or 3 panels spans the figure's width


def row_sizes(n: int) -> list[int]:
    """Panels per row for ``n`` panels: at most 3 a row, the rows as even as can be, so that no
    grid cell is left empty (4 -> [2, 2], 5 -> [3, 2])."""
    rows = -(-n // 3)
    return [n // rows + (1 if i < n % rows else 0) for i in range(rows)]


def plot(paths: list[str], out: str | None = None):
    """Draw the runs ``paths`` (dump folders or .jsonl files); save to ``out`` when given. Returns
    the matplotlib Figure (one titled axis per panel)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError("matplotlib is not installed: pip install matplotlib (or pip install -e "
                        "'.[plot]')") from None
    runs = [(_label(p), read_metrics(p)) for p in paths]
    if not any(runs_ for _, runs_ in runs):
        raise PlotError(f"no step records in {', '.join(paths)}")
    panels: list[tuple[str, str, list[tuple[str, str]]]] = [
        ("loss", "loss", [(LOSS, "train"), (VAL_LOSS, "validation")]),
        ("tokens/s", "tokens/s per device", [(TPS, "")]),
        ("memory", "peak reserved (GiB)", [(MEMORY, "")]),
    ]
    has = lambda key: any(_series(r, key)[0] for _, r in runs)  # noqa: E731
    gates = [(f"nsa/gate_mean/{b}", b) for b in BRANCHES if has(f"nsa/gate_mean/{b}")]
    if gates:
        panels.append(("NSA gate mean", "gate mean (layer mean)", gates))
    if has(SEL_DIST):
        panels.append(("NSA selected-block distance", "mean distance (blocks)", [(SEL_DIST, "")]))
    for metric, title, ylabel in (("answer_loss", "retrieval: answer loss (validation)", "nats per answer token"),
                                  ("exact", "retrieval: exact answers (validation)", "share of documents")):
        keys = [(f"retrieval/{k}_{metric}{part}", k + part.replace("_", " ")) for k in RETRIEVAL_KINDS
                for part in ("", *(("_near", "_far") if metric == "exact" else ()))
                if has(f"retrieval/{k}_{metric}{part}")]
        if keys:
            panels.append((title, ylabel, keys))
    rows = row_sizes(len(panels))
    fig = plt.figure(figsize=(5.2 * max(rows), 3.6 * len(rows)))
    grid = fig.add_gridspec(len(rows), GRID_COLS)
    cells = [grid[r, i * GRID_COLS // k:(i + 1) * GRID_COLS // k] for r, k in enumerate(rows) for i in range(k)]
    for cell, (title, ylabel, keys) in zip(cells, panels):
        ax = fig.add_subplot(cell)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        drawn = [key for key, _ in keys if has(key)]
        for name, run in runs:
            for key, what in keys:
                xs, ys = _series(run, key)
                if xs:  # the run's name among several runs, the series' name among several series
                    label = " ".join(x for x in (name if len(runs) > 1 else "", what if len(drawn) > 1 else "") if x)
                    ax.plot(xs, ys, marker="." if len(xs) < 30 else None, label=label or "_nolegend_")
        if any(not l.startswith("_") for l in ax.get_legend_handles_labels()[1]):
            ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    if out:
        fig.savefig(out, dpi=100)
    return fig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", metavar="RUN", help="a run's dump folder (or its metrics.jsonl)")
    p.add_argument("-o", "--out", default="metrics.png", help="PNG to write (default: metrics.png)")
    a = p.parse_args(argv)
    try:
        fig = plot(a.runs, a.out)
    except PlotError as e:
        return user_error(str(e), prog=PROG)
    titles = [ax.get_title() for ax in fig.axes]
    print(f"wrote {a.out}: {', '.join(titles)} for {len(a.runs)} run(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
