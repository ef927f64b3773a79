"""Tile options (kernel_options) of NSA's flex calls on the GPU: one bench_attention.py process
per option set, several side by side. Their compiles (CPU-bound) overlap; their GPU timings never
do: every process takes the same file lock while it times (`bench_attention.py --timing-lock`).

    python experiments/tune_flex_options.py --sets experiments/tune_sets_64k.json --out OUT [--par 3]

The sets file is a JSON list of {"name", "only" (bench items), "band" (BAND_OPTIONS for the paper
head dim, {} = inductor's defaults), "packed" (PACKED_OPTIONS overrides)}. Each process runs
`--T` (default 65536) with --modes fwd_bwd unless the set gives "modes". Writes OUT/tune.csv
(set, item, fwd_ms, fwd_bwd_ms, compile_s, band, packed, error) as sets finish, OUT/<name>.log per
set; a set that fails or times out keeps its error line. The winners go into
`nsa_flex/kernel_options.py` by hand, with the measurement cited in experiments/NOTES.md.
"""

import argparse
import csv
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
FIELDS = ["set", "item", "fwd_ms", "fwd_bwd_ms", "compile_s", "band", "packed", "error"]


def command(s: dict, T: int, out: str, lock: str, item_limit: float) -> list[str]:
    cmd = [sys.executable, os.path.join(HERE, "bench_attention.py"), "--configs", "paper",
           "--T", str(T), "--stages-at", str(T), "--no-baselines", "--only", s["only"],
           "--modes", s.get("modes", "fwd_bwd"), "--item-limit", str(item_limit),
           "--timing-lock", lock, "--out", os.path.join(out, s["name"])]
    for flag, key in (("--band-options", "band"), ("--packed-options", "packed")):
        if key in s:
            cmd += [flag, json.dumps(s[key])]
    return cmd


def rows_of(s: dict, out: str) -> list[dict]:
    path = os.path.join(out, s["name"], "bench.csv")
    base = {"set": s["name"], "band": json.dumps(s["band"]) if "band" in s else "",
            "packed": json.dumps(s["packed"]) if "packed" in s else ""}
    if not os.path.exists(path):
        return [dict(base, item=s["only"], error="no bench.csv (see the set's log)")]
    rows = []
    for r in csv.DictReader(open(path)):
        first = [r.get(k) for k in ("fwd_first_s", "fwd_bwd_first_s") if r.get(k)]
        rows.append(dict(base, item=r["stage"], fwd_ms=r.get("fwd_ms", ""),
                         fwd_bwd_ms=r.get("fwd_bwd_ms", ""),
                         compile_s=f"{max(map(float, first)):.1f}" if first else "",
                         error=r.get("error", "")))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", required=True, help="JSON file: list of option sets")
    ap.add_argument("--out", required=True)
    ap.add_argument("--T", type=int, default=65536)
    ap.add_argument("--par", type=int, default=3, help="processes side by side")
    ap.add_argument("--item-limit", type=float, default=200)
    ap.add_argument("--budget", type=float, default=0, help="seconds; 0: none. Sets not started "
                    "with less than 60 s left are skipped, running ones are killed at the end")
    args = ap.parse_args(argv)
    sets = json.load(open(args.sets))
    names = [s["name"] for s in sets]
    if len(set(names)) != len(names) or not all(n.replace("_", "").isalnum() for n in names):
        raise SystemExit(f"--sets: names must be unique and alphanumeric (or _), got {names}")
    os.makedirs(args.out, exist_ok=True)
    lock = os.path.join(args.out, "timing.lock")
    t0, pending, running, done = time.time(), list(sets), {}, []
    left = lambda: args.budget - (time.time() - t0) if args.budget else float("inf")

    def write():
        with open(os.path.join(args.out, "tune.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            w.writeheader()
            for s in done:
                w.writerows(rows_of(s, args.out))

    while pending or running:
        while pending and len(running) < args.par and left() > 60:
            s = pending.pop(0)
            log = open(os.path.join(args.out, s["name"] + ".log"), "w")
            running[s["name"]] = (s, subprocess.Popen(
                command(s, args.T, args.out, lock, args.item_limit), stdout=log,
                stderr=subprocess.STDOUT), log)
            print(f"[{time.time() - t0:6.1f}s] start {s['name']}: {s.get('band', '')} "
                  f"{s.get('packed', '')}", flush=True)
        if pending and left() <= 60:
            print(f"skipped (budget): {[s['name'] for s in pending]}", flush=True)
            pending = []
        time.sleep(1)
        for name, (s, p, log) in list(running.items()):
            if p.poll() is None and left() <= 5:
                p.kill()
            if p.poll() is not None:
                log.close()
                del running[name]
                done.append(s)
                write()
                for r in rows_of(s, args.out):
                    print(f"[{time.time() - t0:6.1f}s] {name:10s} {r['item']:22s} fwd "
                          f"{r['fwd_ms'] or '-':>8.8s} fwd+bwd {r['fwd_bwd_ms'] or '-':>8.8s} ms "
                          f"compile {r['compile_s'] or '-'} s {r['error']}", flush=True)
    write()


if __name__ == "__main__":
    main()
