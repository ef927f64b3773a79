"""One line per run and phase of a curriculum job in progress (experiments/quality_curriculum.sh):
the last training step and loss, and the last validation's loss and retrieval metrics.

    python experiments/curriculum_status.py RUNS_DIR     (default /tmp/nsa_curriculum_runs)
"""

import glob
import json
import os
import sys


def last(path: str, key: str) -> dict | None:
    rec = None
    with open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if key in r:
                rec = r
    return rec


def main(argv=None) -> int:
    root = (argv or sys.argv[1:] or ["/tmp/nsa_curriculum_runs"])[0]
    files = sorted(glob.glob(os.path.join(root, "**", "metrics.jsonl"), recursive=True))
    if not files:
        print(f"no metrics.jsonl under {root} yet")
        return 0
    for path in files:
        name = os.path.relpath(os.path.dirname(path), root)
        train = last(path, "loss_metrics/global_avg_loss")
        val = last(path, "validation_metrics/loss")
        line = f"{name:28s}"
        if train:
            line += f" step {train['step']:5d} loss {train['loss_metrics/global_avg_loss']:.3f} tps {train.get('throughput(tps)', 0):,.0f}"
        if val:
            line += f" | val@{val['step']} {val['validation_metrics/loss']:.3f}"
            for kind in ("passkey", "multikey"):
                if f"retrieval/{kind}_exact" in val:
                    line += (f" {kind} ans.loss {val[f'retrieval/{kind}_answer_loss']:.3f}"
                             f" exact {100 * val[f'retrieval/{kind}_exact']:.0f}%")
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
