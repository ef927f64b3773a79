"""titan.csv from torchtitan run logs (experiments/titan_perf_runs.sh): one row per log named
ATTN_FLAVOR_SEQ.log, columns seq_len,flavor,attention,tokens_per_s,peak_GiB,device.

tokens_per_s: median of torchtitan's per-step `tps` after the first --warmup steps (compile and
warm-up excluded); peak_GiB: the largest `memory:` figure it printed (max reserved).

    python experiments/titan_perf_csv.py OUT/*.log --out OUT/titan.csv [--warmup 10]
"""

import argparse
import csv
import os
import re
import statistics

STEP = re.compile(r"step:\s*(\d+).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def summarize(path: str, warmup: int) -> dict | None:
    name = os.path.basename(path).removesuffix(".log")
    parts = name.split("_")
    if len(parts) != 3:
        return None
    attn, flavor, seq = parts
    steps = []
    device = ""
    with open(path, errors="replace") as f:
        for line in f:
            line = ANSI.sub("", line)
            m = STEP.search(line)
            if m:
                steps.append((int(m.group(1)), float(m.group(2)), int(m.group(3).replace(",", ""))))
            if not device and " capacity: " in line:  # "CUDA capacity: NVIDIA H100 ... with 79.11GiB"
                device = line.split(" capacity: ")[1].split(" with ")[0].strip()
    timed = [tps for s, _, tps in steps if s > warmup]
    if not timed:
        print(f"{name}: no step after warm-up {warmup} (steps logged: {len(steps)})")
        return None
    return dict(seq_len=int(seq), flavor=flavor, attention=attn,
                tokens_per_s=round(statistics.median(timed)),
                peak_GiB=max(m for _, m, _ in steps), device=device or "GPU",
                steps_timed=len(timed))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--device", default="", help="device name for the rows (default: from the log)")
    args = ap.parse_args(argv)
    rows = [r for r in (summarize(p, args.warmup) for p in args.logs) if r]
    if args.device:
        for r in rows:
            r["device"] = args.device
    rows.sort(key=lambda r: (r["seq_len"], r["flavor"], r["attention"]))
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["seq_len", "flavor", "attention", "tokens_per_s",
                                          "peak_GiB", "device"], extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    for r in rows:
        print(f"{r['seq_len']:6d} {r['flavor']:5s} {r['attention']:4s} {r['tokens_per_s']:>9,} tok/s "
              f"{r['peak_GiB']:6.2f} GiB  ({r['steps_timed']} steps)")
    return rows


if __name__ == "__main__":
    main()
