"""Needle-evaluation outputs: per-(kind, length) summary, the depth x length heatmap, and the
ablation table of several runs (`collect`: needle summaries + metrics.jsonl of each run)."""

import csv
import glob
import json
import os
import sys

from .prompts import KINDS, digit_score

# ---------------------------------------------------------------------- outputs
def summarize(rows: list[dict]) -> list[dict]:
    """Per-prompt rows -> one row per (kind, length): n, correct, accuracy, digits (right, mean),
    the Wilson interval and, for a selecting model, the mean selection recall at the question."""
    agg: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        agg.setdefault((r["kind"], int(r["length"])), []).append(r)
    out = []
    for (k, L), v in sorted(agg.items()):
        c = sum(int(r["correct"]) for r in v)
        rec = [float(r["sel_recall"]) for r in v if r.get("sel_recall") not in (None, "")]
        out.append({"kind": k, "length": L, "n": len(v), "correct": c, "accuracy": c / len(v),
                    "digits": round(sum(digit_score(r["answer"], str(r["expected"])) for r in v) / len(v), 4),
                    **dict(zip(("ci_lo", "ci_hi"), (round(x, 4) for x in wilson(c, len(v))))),
                    "sel_recall": round(sum(rec) / len(rec), 4) if rec else ""})
    return out


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval (95% for z = 1.96) of a proportion k / n."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    c = (p + z * z / (2 * n)) / (1 + z * z / n)
    h = z * (p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5 / (1 + z * z / n)
    return max(0.0, c - h), min(1.0, c + h)


def write_summary(rows: list[dict], out: str) -> list[dict]:
    summ = summarize(rows)
    with open(os.path.join(out, "summary.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["kind", "length", "n", "correct", "accuracy", "digits",
                                          "ci_lo", "ci_hi", "sel_recall"])
        w.writeheader()
        w.writerows(summ)
    return summ


def plot_heatmap(rows: list[dict], path: str, title: str = "") -> bool:
    """Depth x length accuracy heatmap, one panel per kind, cells annotated. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"# matplotlib missing: no {path}", file=sys.stderr)
        return False
    kinds = [k for k in KINDS if any(r["kind"] == k for r in rows)]
    lengths = sorted({int(r["length"]) for r in rows})
    depths = sorted({int(r["depth"]) for r in rows})
    fig, axes = plt.subplots(1, len(kinds), figsize=(2.2 + (1.6 + 0.9 * len(lengths)) * len(kinds),
                                                     1.4 + 0.4 * len(depths)), squeeze=False)
    for n, (ax, kind) in enumerate(zip(axes[0], kinds)):
        acc = [[float("nan")] * len(lengths) for _ in depths]
        for i, d in enumerate(depths):
            for j, L in enumerate(lengths):
                cell = [int(r["correct"]) for r in rows
                        if r["kind"] == kind and int(r["depth"]) == d and int(r["length"]) == L]
                if cell:
                    acc[i][j] = sum(cell) / len(cell)
        im = ax.imshow(acc, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        for i in range(len(depths)):
            for j in range(len(lengths)):
                if acc[i][j] == acc[i][j]:
                    ax.text(j, i, f"{100 * acc[i][j]:.0f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(lengths)), [f"{L // 1024}k" if L % 1024 == 0 else str(L) for L in lengths])
        ax.set_yticks(range(len(depths)), [f"{d}%" for d in depths])
        ax.set_xlabel("context length (tokens)")
        if n == 0:
            ax.set_ylabel("needle depth")
        ax.set_title(f"{kind} {title}".strip(), fontsize=9)
    fig.colorbar(im, ax=axes[0].tolist(), label="accuracy", shrink=0.8)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return True


# ---------------------------------------------------------------------- ablation table
def read_metrics(path: str) -> dict:
    """step -> merged record of a metrics.jsonl (or, when only that exists, its committed .gz)."""
    recs = {}
    if not os.path.isfile(path) and os.path.isfile(path + ".gz"):
        import gzip

        path, opener = path + ".gz", gzip.open
    else:
        opener = open
    if os.path.isfile(path):
        for line in opener(path, "rt"):
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            recs.setdefault(r["step"], {}).update(r)
    return recs


def collect(out: str) -> list[dict]:
    """<out>/<run>/{needle/summary.csv, metrics.jsonl, train_seconds} -> <out>/ablation.csv (one
    row per run, kind and length: accuracy; and per run: last logged loss, mean of the last 5 logged
    losses, mean tokens/s after the first two logged steps, training seconds, last telemetry gate
    means per branch) and <out>/ablation.png (loss curves, accuracy vs length)."""
    table = []
    runs = sorted(d for d in os.listdir(out) if os.path.isdir(os.path.join(out, d)))
    for run in runs:
        rd = os.path.join(out, run)
        recs = read_metrics(os.path.join(rd, "metrics.jsonl"))
        losses = [(s, r["loss_metrics/global_avg_loss"]) for s, r in sorted(recs.items())
                  if "loss_metrics/global_avg_loss" in r]
        tps = [r["throughput(tps)"] for s, r in sorted(recs.items()) if "throughput(tps)" in r and s > 1]
        gates = {b: [r[f"nsa/gate_mean/{b}"] for _, r in sorted(recs.items()) if f"nsa/gate_mean/{b}" in r]
                 for b in ("cmp", "sel", "win")}
        base = {"run": run, "steps": losses[-1][0] if losses else "",
                "final_loss": round(losses[-1][1], 5) if losses else "",
                "loss_last5": round(sum(v for _, v in losses[-5:]) / len(losses[-5:]), 5) if losses else "",
                **{f"gate_{b}": round(g[-1], 4) if g else "" for b, g in gates.items()},
                "tps": round(sum(tps[1:]) / len(tps[1:])) if len(tps) > 1 else "",
                "train_s": open(os.path.join(rd, "train_seconds")).read().strip()
                if os.path.isfile(os.path.join(rd, "train_seconds")) else ""}
        summ = os.path.join(rd, "needle", "summary.csv")
        got = list(csv.DictReader(open(summ))) if os.path.isfile(summ) else []
        if not got:  # partial eval (killed): recount from the rows written so far
            rows_path = os.path.join(rd, "needle", "needle.csv")
            if os.path.isfile(rows_path):
                rows = [r for r in csv.DictReader(open(rows_path)) if r.get("correct") in ("0", "1")]
                if rows:
                    got = write_summary(rows, os.path.join(rd, "needle"))
        if not got:
            table.append({**base, "kind": "", "length": "", "n": 0, "correct": "", "accuracy": "", "digits": ""})
        for s in got:
            table.append({**base, "kind": s["kind"], "length": int(s["length"]), "n": int(s["n"]),
                          "correct": int(s["correct"]), "accuracy": round(float(s["accuracy"]), 4),
                          "digits": round(float(s["digits"]), 4) if s.get("digits") not in (None, "") else ""})
    fields = ["run", "kind", "length", "n", "correct", "accuracy", "digits", "steps", "final_loss", "loss_last5", "tps",
              "train_s", "gate_cmp", "gate_sel", "gate_win"]
    with open(os.path.join(out, "ablation.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(table)
    _plot_ablation(out, runs, table)
    for r in table:
        print(",".join(str(r[k]) for k in fields))
    return table


def _plot_ablation(out: str, runs: list[str], table: list[dict]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    kinds = [k for k in KINDS if any(r["kind"] == k for r in table)]
    fig, axes = plt.subplots(1, len(kinds) + 1, figsize=(4.2 * (len(kinds) + 1), 3.6), squeeze=False)
    axes = axes[0]
    for run in runs:
        recs = read_metrics(os.path.join(out, run, "metrics.jsonl"))
        pts = [(s, r["loss_metrics/global_avg_loss"]) for s, r in sorted(recs.items())
               if "loss_metrics/global_avg_loss" in r]
        if pts:
            axes[0].plot(*zip(*pts), label=run)
        for ax, kind in zip(axes[1:], kinds):
            pts = sorted((r["length"], r["accuracy"]) for r in table if r["run"] == run and r["kind"] == kind)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=run)
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("training loss")
    axes[0].legend(fontsize=7)
    for ax, kind in zip(axes[1:], kinds):
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(f"{kind} accuracy")
        ax.legend(fontsize=7)
    _save(plt, fig, os.path.join(out, "ablation.png"))


# ---------------------------------------------------------------------- quality figures
def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# matplotlib missing: no figure", file=sys.stderr)
        return None
    return plt


def _save(plt, fig, path: str) -> bool:
    """Lays out ``fig``, writes it to ``path`` (110 dpi) and closes it; True (the figure is written)."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_position_loss(runs: dict[str, list[dict]], path: str, title: str = "",
                       marks: dict[str, int] | None = None, baseline: str | None = None) -> bool:
    """Loss by token position, one curve per run (rows of position_loss.csv: pos_mid, loss,
    loss_sem), log x axis, +-1 standard error band; ``marks``: label -> position of a vertical
    line (e.g. the sliding window). ``baseline`` (a run's name): a second panel with each other
    run's loss minus the baseline's per bucket -- the runs score the same documents, so the
    difference is paired and shows what the absolute curves hide (who gains with distance).
    False without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return False
    paired = baseline in runs and len(runs) > 1
    fig, axes = plt.subplots(1, 2 if paired else 1, figsize=(12.0 if paired else 6.4, 4.0), squeeze=False)
    ax = axes[0][0]
    colours = {}
    for name, rows in runs.items():
        x = [float(r["pos_mid"]) for r in rows]
        y = [float(r["loss"]) for r in rows]
        colours[name] = ax.plot(x, y, marker=".", label=name)[0].get_color()
        sem = [float(r["loss_sem"]) if r.get("loss_sem") not in ("", None) else 0.0 for r in rows]
        if any(sem):
            ax.fill_between(x, [a - s for a, s in zip(y, sem)], [a + s for a, s in zip(y, sem)], alpha=0.2)
    ax.set_ylabel("validation loss (nats)")
    ax.set_title(title or "loss by position", fontsize=9)
    if paired:
        dx = axes[0][1]
        base = {r["pos_mid"]: float(r["loss"]) for r in runs[baseline]}
        seen = []
        for name, rows in runs.items():
            pts = [(float(r["pos_mid"]), float(r["loss"]) - base[r["pos_mid"]]) for r in rows
                   if name != baseline and r["pos_mid"] in base]
            if pts:
                dx.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=name, color=colours[name])
                seen += [p[1] for p in pts if p[0] >= 16]
        if seen:  # the first buckets hold a few tokens each: scale to the rest
            pad = 0.1 * (max(seen) - min(seen)) + 0.01
            dx.set_ylim(min(min(seen), 0) - pad, max(max(seen), 0) + pad)
        dx.axhline(0, color="black", lw=0.8)
        dx.set_ylabel(f"loss minus {baseline}'s (nats; < 0: better)")
        dx.set_title(f"paired difference to {baseline} (same documents, same positions)", fontsize=9)
    for a in axes[0]:
        for label, pos in (marks or {}).items():
            a.axvline(pos, color="grey", ls=":", lw=1)
            a.text(pos, a.get_ylim()[1], f" {label}", va="top", fontsize=7, color="grey")
        a.set_xscale("log", base=2)
        a.set_xlabel("token position (context tokens before it)")
        a.legend(fontsize=7)
    return _save(plt, fig, path)


TRAIN_LOSS = "loss_metrics/global_avg_loss"
VAL_LOSS = "validation_metrics/loss"


def loss_curves(recs: dict) -> dict[str, list[tuple[int, float]]]:
    """step -> record (read_metrics) -> {"train": [(tokens seen, loss)], "validation": [...]}.
    Tokens seen: the record's n_tokens_seen; a step without it (e.g. a validation-only line)
    gets step x tokens per step of the nearest earlier step that has it."""
    per_step = None
    out: dict[str, list[tuple[int, float]]] = {"train": [], "validation": []}
    for s, r in sorted(recs.items()):
        if "n_tokens_seen" in r and s > 0:
            per_step = r["n_tokens_seen"] / s
        tokens = r.get("n_tokens_seen", None if per_step is None else round(per_step * s))
        if tokens is None:
            continue
        for key, name in ((TRAIN_LOSS, "train"), (VAL_LOSS, "validation")):
            if key in r:
                out[name].append((int(tokens), float(r[key])))
    return out


def plot_loss_vs_tokens(runs: dict[str, str], path: str, title: str = "") -> bool:
    """Training loss (and validation loss, dashed, when logged) against tokens seen, one colour per
    run; ``runs``: name -> metrics.jsonl path. (Built here until a general metrics.jsonl plotter
    exists in the library; the quality report calls only this function.)"""
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for i, (name, mpath) in enumerate(runs.items()):
        c = loss_curves(read_metrics(mpath))
        color = f"C{i}"
        if c["train"]:
            ax.plot(*zip(*c["train"]), color=color, lw=1, label=f"{name} train")
        if c["validation"]:
            ax.plot(*zip(*c["validation"]), color=color, ls="--", marker="o", ms=3, label=f"{name} validation")
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("loss (nats)")
    ax.set_title(title or "loss vs tokens seen", fontsize=9)
    ax.legend(fontsize=7)
    return _save(plt, fig, path)


def plot_selection(stats: list[dict], blocks: list[dict], path: str, title: str = "") -> bool:
    """Selection figure: per length and layer, the share of picks per distance bin (left) and the
    picks per absolute block index (right)."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(11, 3.8))
    for r in stats:
        bins = [k for k in r if k.startswith("dist/")]
        a0.plot(range(len(bins)), [r[k] for k in bins], marker=".", label=f"L={r['length']} layer {r['layer']}")
        a0.set_xticks(range(len(bins)), [k[5:] for k in bins], rotation=60, fontsize=7)
        pts = [(b["block"], b["picks"]) for b in blocks if b["length"] == r["length"] and b["layer"] == r["layer"]]
        a1.plot(*zip(*pts), lw=0.8, label=f"L={r['length']} layer {r['layer']}")
    a0.set_xlabel("distance from the query's block (blocks)")
    a0.set_ylabel("share of picks")
    a1.set_yscale("log")
    a1.set_xlabel("selection block index")
    a1.set_ylabel("picks")
    for ax in (a0, a1):
        ax.legend(fontsize=6)
    fig.suptitle(title or "top-n selection", fontsize=9)
    return _save(plt, fig, path)
