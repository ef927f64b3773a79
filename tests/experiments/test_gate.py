"""The retrieval gate's tools: experiments/gate_report.py (curves from metrics.jsonl or, for a run
cut before its metrics were copied, the console log) and experiments/retrieval_gate.sh's checks."""

import csv
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))

import gate_report as gr  # noqa: E402


def test_report_reads_logs_and_metrics_and_finds_the_thresholds(tmp_path, capsys):
    log = tmp_path / "full" / "train.log"
    log.parent.mkdir()
    lines = []
    for step, loss, exact in ((100, 4.2, 0), (200, 2.1, 40), (300, 0.3, 96)):
        lines += [f"[titan] 2026 - root - INFO - validate step: {step}  loss:  1.5  memory: 1GiB  tps: 9",
                  f"[titan] 2026 - root - INFO - validate step: {step}  retrieval: passkey loss {loss} exact {exact}%"]
    log.write_text("\n".join(lines) + "\n")
    jl = tmp_path / "nsa" / "metrics.jsonl"
    jl.parent.mkdir()
    recs = [{"step": 100, "retrieval/passkey_answer_loss": 4.0, "retrieval/passkey_exact": 0.0},
            {"step": 100, "validation_metrics/loss": 2.0},
            {"step": 200, "retrieval/passkey_answer_loss": 1.0, "retrieval/passkey_exact": 0.6}]
    jl.write_text("\n".join(map(json.dumps, recs)) + "\n{\"step\": 3\n")  # a cut last line: skipped
    assert gr.main([str(tmp_path), "--tokens-per-step", "10"]) == 0
    out = capsys.readouterr().out
    assert "full" in out and "50% at step 300, 95% at step 300" in out
    assert "nsa" in out and "50% at step 200, 95% at step None" in out
    rows = list(csv.DictReader(open(tmp_path / "gate.csv")))
    assert [(r["variant"], r["step"], r["tokens"], r["exact"]) for r in rows] == [
        ("full", "100", "1000", "0.0000"), ("full", "200", "2000", "0.4000"), ("full", "300", "3000", "0.9600"),
        ("nsa", "100", "1000", "0.0000"), ("nsa", "200", "2000", "0.6000")]
    assert rows[0]["val_loss"] == "1.5000" and rows[3]["val_loss"] == "2.0000" and rows[4]["val_loss"] == ""
    assert (tmp_path / "gate.png").stat().st_size > 1000


def test_gate_script_needs_a_short_phase(tmp_path):
    toml = tmp_path / "x.toml"
    toml.write_text("[training]\nsteps = 1\n")
    r = subprocess.run(["bash", str(ROOT / "experiments/retrieval_gate.sh"), str(tmp_path / "o"), str(tmp_path)],
                       env={"TOML": str(toml), "PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "has no training.seq_len in [curriculum] short" in r.stderr
    r = subprocess.run(["bash", str(ROOT / "experiments/retrieval_gate.sh")], capture_output=True, text=True)
    assert r.returncode != 0 and "usage: retrieval_gate.sh OUT DATA" in r.stderr
