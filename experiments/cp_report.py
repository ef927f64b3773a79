"""cp.csv and cp.png from experiments/cp_bench.sh's logs: one row per OUT/ATTN_cpN_SEQ.log.

tokens_per_s_per_gpu: median of torchtitan's per-step `tps` after the first --warmup steps:
torchtitan counts a step's whole batch on every rank (its labels before the context-parallel
split) and divides by the non-data-parallel size (the context degree N), so `tps` is already per
GPU (a 32k sequence over 2 GPUs at 0.218 s a step logs 75k: 32768 / 0.218 / 2); peak_GiB: the largest `memory:` figure (max reserved, per GPU); status: ok,
oom, timeout, failed or skipped (OUT/NAME.rc holds the run's exit code).

    python experiments/cp_report.py OUT [--warmup 4] [--merge CSV]   # writes OUT/cp.csv, OUT/cp.png

--merge CSV keeps the rows of an earlier cp.csv (e.g. experiments/results/perf/cp.csv, measured on
another machine) that OUT's logs do not measure again (same attention, degree, length and card).
"""

import argparse
import csv
import glob
import os
import re
import statistics

from titan_perf_csv import ANSI, STEP

NAME = re.compile(r"^(?P<attn>[a-z]+)_cp(?P<cp>\d+)_(?P<seq>\d+)$")
FIELDS = ["attention", "flavor", "seq_len", "cp", "tokens_per_s_per_gpu", "peak_GiB", "status",
          "device"]


def status_of(text: str, rc: str) -> str:
    if rc == "skipped (budget)":
        return "skipped"
    if "OutOfMemoryError" in text or "CUDA out of memory" in text:
        return "oom"
    if rc == "124":
        return "timeout"
    return "ok" if rc == "0" else "failed"


def summarize(path: str, warmup: int) -> dict | None:
    m = NAME.match(os.path.basename(path).removesuffix(".log"))
    if not m:
        return None
    rc_path = path.removesuffix(".log") + ".rc"
    rc = open(rc_path).read().strip() if os.path.exists(rc_path) else "running"
    text = ANSI.sub("", open(path, errors="replace").read()) if os.path.exists(path) else ""
    steps = [(int(s.group(1)), float(s.group(2)), int(s.group(3).replace(",", "")))
             for s in STEP.finditer(text)]
    cp = int(m["cp"])
    timed = [tps for s, _, tps in steps if s > warmup]
    device = next((line.split(" capacity: ")[1].split(" with ")[0].strip()
                   for line in text.splitlines() if " capacity: " in line), "GPU")
    status = status_of(text, rc)
    if status == "ok" and not timed:
        status = "failed"
    return dict(attention=m["attn"], flavor="125M", seq_len=int(m["seq"]), cp=cp,
                tokens_per_s_per_gpu=round(statistics.median(timed)) if timed else "",
                peak_GiB=max((mem for _, mem, _ in steps), default=""), status=status,
                device=device)


def _key(r: dict) -> tuple:
    return r["attention"], r["cp"], r["seq_len"], r["device"]


def read_csv(path: str) -> list[dict]:
    """Rows of a cp.csv with their numbers as numbers (empty cells stay empty)."""
    def num(v: str, kind):
        return kind(v) if v != "" else ""
    with open(path, newline="") as f:
        return [dict(r, seq_len=int(r["seq_len"]), cp=int(r["cp"]),
                     tokens_per_s_per_gpu=num(r["tokens_per_s_per_gpu"], int), peak_GiB=num(r["peak_GiB"], float))
                for r in csv.DictReader(f)]


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    several = len({r["device"] for r in rows}) > 1  # rows from several cards: each line names its card
    for key in sorted({(r["attention"], r["cp"], r["device"]) for r in rows}):
        ok = sorted((r for r in rows if (r["attention"], r["cp"], r["device"]) == key and r["status"] == "ok"),
                    key=lambda r: r["seq_len"])
        if not ok:
            continue
        label = f"{key[0]}, {key[1]} GPU{'s' if key[1] > 1 else ''}" + (f" ({key[2]})" if several else "")
        x = [r["seq_len"] // 1024 for r in ok]
        a.plot(x, [r["tokens_per_s_per_gpu"] / 1e3 for r in ok], "o-", label=label)
        b.plot(x, [r["peak_GiB"] for r in ok], "o-", label=label)
    for ax, y in ((a, "tokens/s per GPU (k)"), (b, "peak memory per GPU (GiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (k tokens)")
        ax.set_ylabel(y)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("torchtitan 125M, context parallelism (one sequence over N GPUs)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--merge", metavar="CSV", help="an earlier cp.csv whose other rows to keep")
    args = ap.parse_args(argv)
    # a run the budget skipped has an .rc and no log
    names = {os.path.splitext(p)[0] for ext in ("log", "rc")
             for p in glob.glob(os.path.join(args.out, f"*.{ext}"))}
    rows = [r for r in (summarize(n + ".log", args.warmup) for n in sorted(names)) if r]
    if args.merge:
        rows += [r for r in read_csv(args.merge) if _key(r) not in {_key(m) for m in rows}]
    rows.sort(key=lambda r: (r["attention"], r["cp"], r["seq_len"]))
    with open(os.path.join(args.out, "cp.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    for r in rows:
        print(f"{r['attention']:4s} cp{r['cp']} {r['seq_len']:7d} {r['status']:7s} "
              f"{r['tokens_per_s_per_gpu']!s:>8} tok/s/GPU {r['peak_GiB']!s:>6} GiB")
    if any(r["status"] == "ok" for r in rows):
        plot(rows, os.path.join(args.out, "cp.png"))
    return rows


if __name__ == "__main__":
    main()
