"""experiments/ablation_report.py: several ablation_runs.sh tables -> one table, CSV and plot."""

import csv
import os
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))

import ablation_report as ar  # noqa: E402

FIELDS = ["run", "kind", "length", "n", "correct", "accuracy", "digits", "steps", "final_loss", "loss_last5",
          "tps", "train_s", "gate_cmp", "gate_sel", "gate_win"]


def table(folder: Path, rows: list[dict], fields=FIELDS):
    folder.mkdir(parents=True)
    with open(folder / "ablation.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def row(run, kind, length, correct, steps=6000, digits="0.5", **kw):
    return {"run": run, "kind": kind, "length": length, "n": 11, "correct": correct,
            "accuracy": round(correct / 11, 4), "digits": digits, "steps": steps, "final_loss": 0.3,
            "loss_last5": 0.31, "tps": 1000, "train_s": 10, "gate_cmp": kw.get("g", ""), "gate_sel": 0.2,
            "gate_win": 0.3}


def test_report_joins_folders_and_labels_duplicates(tmp_path):
    table(tmp_path / "a", [row("nsa", "passkey", 1024, 0, g=0.1), row("nsa", "passkey", 2048, 0, g=0.1),
                           row("full_causal", "passkey", 1024, 11, digits="1.0")])
    table(tmp_path / "b", [row("nsa", "passkey", 1024, 11, steps=12000, digits="1.0", g=0.1)])
    table(tmp_path / "c", [row("nsa", "passkey", 1024, 5, g=0.1)])
    assert ar.main([str(tmp_path / d) for d in "abc"] + ["--out", str(tmp_path / "r")]) == 0
    md = (tmp_path / "r" / "report.md").read_text().splitlines()
    assert md[0].startswith("| run | loss (last 5 logs) | passkey 1k | passkey 2k |")
    assert any(l.startswith("| full_causal (6000 steps) |") and "**11/11 (1.00)**" in l for l in md)
    assert any(l.startswith("| nsa (12000 steps) |") and "**11/11 (1.00)**" in l for l in md)
    # the same run and steps in two folders: both kept, each labelled with its folder
    assert sum(l.startswith("| nsa (6000 steps) [a] |") for l in md) == 1
    assert any(l.startswith("| nsa (6000 steps) [c] |") and "5/11 (0.50)" in l for l in md)
    assert any("0.10/0.20/0.30" in l for l in md) and any("-/0.20/0.30" in l for l in md)
    rows = list(csv.DictReader(open(tmp_path / "r" / "report.csv")))
    assert len(rows) == 4 and rows[0]["passkey_1024_acc"] == "0.0" and rows[0]["passkey_2048_digits"] == "0.5"
    assert rows[1]["passkey_2048_acc"] == ""  # not evaluated there


def test_digits_from_per_prompt_rows_for_old_tables(tmp_path):
    old = [f for f in FIELDS if f != "digits"]
    table(tmp_path / "a", [row("nsa", "passkey", 1024, 1)], fields=old)
    (tmp_path / "a" / "nsa" / "needle").mkdir(parents=True)
    with open(tmp_path / "a" / "nsa" / "needle" / "needle.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["kind", "length", "depth", "trial", "correct", "answer", "expected"])
        w.writerow(["passkey", 1024, 0, 0, 1, " 12345.", "12345"])
        w.writerow(["passkey", 1024, 50, 0, 0, " 12000.", "12345"])
        w.writerow(["passkey", 2048, 50, 0, 0, " 12345.", "12345"])
    import gzip
    import json

    with gzip.open(tmp_path / "a" / "nsa" / "metrics.jsonl.gz", "wt") as f:
        for step, loss in [(1, 5.0), (2, 4.0), (2, 3.5), (3, 3.0)]:  # a resumed run logs step 2 twice
            f.write(json.dumps({"step": step, "loss_metrics/global_avg_loss": loss}) + "\n")
        f.write("{not json\n")
    runs = ar.read_runs([str(tmp_path / "a")])
    assert runs[0]["acc"][("passkey", 1024)][3] == 0.7
    assert runs[0]["curve"] == [(1, 5.0), (2, 3.5), (3, 3.0)]
    assert ar.main([str(tmp_path / "a"), "--out", str(tmp_path / "r")]) == 0
    assert (tmp_path / "r" / "report.png").stat().st_size > 0


def test_report_errors(tmp_path, capsys):
    assert ar.main([str(tmp_path / "nope"), "--out", str(tmp_path / "r")]) == 2
    assert "no ablation.csv" in capsys.readouterr().err
    table(tmp_path / "empty", [])
    assert ar.main([str(tmp_path / "empty"), "--out", str(tmp_path / "r")]) == 2
    assert "no runs in" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "r")


def test_plot_says_when_matplotlib_is_missing(tmp_path, monkeypatch, capsys):
    """Plots are a feature: without matplotlib, plot() says so (and the test extra has it)."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert ar.plot([], [("passkey", 1024)], str(tmp_path / "report.png")) is False
    err = capsys.readouterr().err
    assert "matplotlib is not installed" in err and "report.png" in err
    with open(ROOT / "pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert "matplotlib" in extras["test"]
