"""When each retrieval-gate run formed its copies: one row per run and variant of the committed
gate runs (experiments/results/quality/gate_run*/gate.csv, experiments/gate_report.py's tables),
the first validation step where

  - the filler's copy formed: validation loss below 2.5 nats (the generated documents repeat a
    passage of pseudo-words; ~4.4 before the copy, ~1.2 once every repeat is copied, the far ones
    too),
  - the near passkey copy: >= 50% exact where the needle lies within 512 tokens of the answer,
  - the far passkey copy: >= 20% exact where it lies beyond (the copy the gate needs from NSA),

and the run's last step with its far exact. A table without the near / far columns, and a variant
whose rows repeat an earlier table's (an earlier run plotted beside a later one), are left out.

    python experiments/gate_formation.py [--results experiments/results/quality] [--out CSV]
"""

import argparse
import csv
import glob
import os
import re

FILLER_LOSS, NEAR, FAR = 2.5, 0.5, 0.2


def first(rows: list[dict], key: str, test) -> int | None:
    return next((int(r["step"]) for r in rows if r.get(key) not in (None, "") and test(float(r[key]))), None)


def formation_rows(results: str) -> list[dict]:
    runs = []
    for path in glob.glob(os.path.join(results, "gate_run*", "gate.csv")):
        m = re.search(r"gate_run(\d+)", path)
        runs.append((int(m[1]), path))
    out, seen = [], set()
    for run, path in sorted(runs):
        by: dict[str, list[dict]] = {}
        for r in csv.DictReader(open(path)):
            by.setdefault(r["variant"], []).append(r)
        for variant, rows in by.items():
            curve = tuple((r["step"], r["exact"], r.get("val_loss")) for r in rows)
            if not any(r.get("exact_far") for r in rows) or curve in seen:
                continue  # no near / far split logged, or an earlier run's rows again
            seen.add(curve)
            last = rows[-1]
            out.append({"run": run, "variant": variant,
                        "filler_copy_step": first(rows, "val_loss", lambda v: v < FILLER_LOSS) or "",
                        "near_copy_step": first(rows, "exact_near", lambda v: v >= NEAR) or "",
                        "far_copy_step": first(rows, "exact_far", lambda v: v >= FAR) or "",
                        "last_step": last["step"], "last_exact_far": last.get("exact_far", "")})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default="experiments/results/quality")
    p.add_argument("--out", help="write the table as CSV here (default: print it)")
    a = p.parse_args(argv)
    rows = formation_rows(a.results)
    if not rows:
        raise SystemExit(f"gate_formation.py: no gate_run*/gate.csv with near / far columns under {a.results}")
    if a.out:
        with open(a.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    cols = list(rows[0])
    print("  ".join(f"{c:>16s}" for c in cols))
    for r in rows:
        print("  ".join(f"{str(r[c]):>16s}" for c in cols))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
