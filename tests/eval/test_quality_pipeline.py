"""experiments/quality_runs.sh + experiments/quality_report.py end to end on the CPU at a tiny
scale (debug model, seq 256, 4 steps, 2 trials per cell) on the TOML's corpus (pysource: the Python
source of this machine's packages), and their argument checks."""

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data"
SCRIPT = ROOT / "experiments" / "quality_runs.sh"
TINY = ("--model.flavor=debugmodel --training.seq_len=256 --training.steps=4 "
        "--training.local_batch_size=2 --checkpoint.interval=2 --compile.no-enable --nsa.backend=reference "
        "--training.mixed_precision_param=float32 --validation.seq_len=256 --validation.freq=2 "
        "--validation.steps=1 --metrics.log_freq=1 --nsa.telemetry_every=2 --lr_scheduler.warmup_steps=1 "
        "--optimizer.implementation=foreach")


def _env(tmp_path, **kw):
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "PYTHON": sys.executable, "RUNS_DIR": str(tmp_path / "runs"), "TRAIN_ARGS": TINY,
            "LENGTHS": "400", "DEPTHS": "0,100", "TRIALS": "2", "POS_SEQ": "256", "POS_DOCS": "2",
            "SEL_LENGTHS": "256", "OMP_NUM_THREADS": "1", **kw}


def test_quality_runs_checks_its_arguments(tmp_path):
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    run = lambda *a, **kw: subprocess.run(["bash", str(SCRIPT), *a], cwd=ROOT, capture_output=True, text=True,
                                          env=_env(tmp_path, **kw))
    DATA = tmp_path / "data"  # the checks stop before DATA is read: any folder does
    r = run("nsa", str(tmp_path / "o"), str(DATA))
    assert r.returncode == 2 and f"DATA={DATA} is not a folder" in r.stderr
    DATA.mkdir()
    r = run("bogus", str(tmp_path / "o"), str(DATA))
    assert r.returncode == 2 and "VARIANT must be one of nsa, full_causal, sliding_only; got 'bogus'" in r.stderr
    r = run("nsa", str(tmp_path / "o"), str(DATA), TRAIN_DATA=str(tmp_path / "none.parquet"))
    assert r.returncode == 2 and f"TRAIN_DATA={tmp_path / 'none.parquet'}: no such file" in r.stderr
    r = run("nsa", str(tmp_path / "o"), str(DATA), VAL_DOCS="val.jsonl")
    assert r.returncode == 2 and "VAL_DOCS=val.jsonl: no such file" in r.stderr
    r = run("nsa", str(tmp_path / "o"), str(DATA), SEGMENT="ten")
    assert r.returncode == 2 and "SEGMENT must be a number of seconds, got 'ten'" in r.stderr
    r = run("nsa", str(tmp_path / "o"), str(DATA), TRAIN_ARGS="steps=3")
    assert r.returncode == 2 and "TRAIN_ARGS: flag 'steps=3' must look like" in r.stderr


@pytest.mark.slow
@pytest.mark.skipif(not (DATA / "fineweb_edu_sample_150.parquet").is_file(), reason=f"no {DATA}")
def test_quality_pipeline_end_to_end(tmp_path):
    out, export = tmp_path / "out", tmp_path / "export"
    cmd = ["bash", str(SCRIPT), "nsa", str(out), str(DATA), str(export)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=_env(tmp_path), timeout=300)
    assert r.returncode == 0 and "nsa: DONE (all stages)" in r.stdout, r.stdout + r.stderr
    d = out / "nsa"
    assert (d / "stages.txt").read_text().split() == ["train", "position", "selection", "needle"]
    assert (tmp_path / "runs" / "nsa" / "checkpoint" / "step-4").is_dir()
    summ = list(csv.DictReader(open(d / "needle" / "summary.csv")))
    assert [(s["kind"], s["length"], s["n"]) for s in summ] == [("multikey", "400", "4"), ("passkey", "400", "4")]
    pos = list(csv.DictReader(open(d / "position_loss" / "position_loss.csv")))
    assert pos[-1]["bucket_hi"] == "256" and all(float(p["loss"]) > 0 for p in pos)
    tr = np.load(d / "selection" / "selection_L256.npz")
    assert tr["layer0"].shape == (2, 256, 4) and tr["layer0"].dtype == np.int16
    assert (export / "quality_nsa.tgz").stat().st_size > 1000
    # the same command again: every stage is done, nothing is recomputed
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=_env(tmp_path), timeout=60)
    assert r.returncode == 0 and "DONE" in r.stdout and not (d / "train_1.log").exists()

    # the report over two variants (the second: a copy of the first with its losses moved up 0.1)
    shutil.copytree(d, out / "full_causal")
    shutil.rmtree(out / "full_causal" / "selection")
    p = out / "full_causal" / "position_loss" / "position_loss.csv"
    rows = list(csv.DictReader(open(p)))
    for row in rows:
        row["loss"] = str(float(row["loss"]) + 0.1)
    with open(p, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    # steps and tokens come from the final checkpoint (the metrics log ends at a multiple of log_freq)
    with open(out / "full_causal" / "timeline.txt", "a") as f:
        f.write("[2026-01-01T00:00:00Z +1s] full_causal: train: rc=0, checkpoint step-5\n")
    dest = tmp_path / "report"
    r = subprocess.run([sys.executable, "experiments/quality_report.py", str(out), "--dest", str(dest),
                        "--train-len", "400", "--long-len", "400"], cwd=ROOT, capture_output=True, text=True,
                       env=_env(tmp_path), timeout=60)
    assert r.returncode == 0, r.stderr
    for f in ("summary_needle.csv", "summary_loss.csv", "position_loss.csv", "selection_stats.csv", "gates.csv",
              "needle_heatmap_nsa.png", "needle_heatmap_full_causal.png", "loss_by_position.png",
              "loss_vs_tokens.png", "selection_nsa.png", "selection_traces/nsa_L256.npz", "report.md"):
        assert (dest / f).is_file(), f
    losses = {r["variant"]: r for r in csv.DictReader(open(dest / "summary_loss.csv"))}
    assert set(losses) == {"nsa", "full_causal"} and losses["nsa"]["tokens"] == "2048"
    assert (losses["nsa"]["steps"], losses["full_causal"]["steps"], losses["full_causal"]["tokens"]) == ("4", "5", "2560")
    assert float(losses["full_causal"]["pos_loss_all"]) - float(losses["nsa"]["pos_loss_all"]) == pytest.approx(0.1, abs=1e-4)
    needle = list(csv.DictReader(open(dest / "summary_needle.csv")))
    assert {(n["variant"], n["kind"]) for n in needle} == {(v, k) for v in ("nsa", "full_causal")
                                                         for k in ("passkey", "multikey")}
    md = (dest / "report.md").read_text()
    assert "| nsa | 4 | 2048 |" in md and "## What these figures do not show" in md
    if losses["nsa"]["val_loss"]:  # both variants logged the same validation loss: difference 0
        assert "difference +0.0000 nats: goal <= +0.02 MET" in md
    assert "NSA passkey at 400:" in md
    assert "window below sliding_only's: not measured" in md
    r = subprocess.run([sys.executable, "experiments/quality_report.py", str(tmp_path / "none")], cwd=ROOT,
                       capture_output=True, text=True, env=_env(tmp_path))
    assert r.returncode == 2 and "quality_report: error: OUT" in r.stderr
