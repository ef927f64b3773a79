"""experiments/tune_flex_options.py on CPU: one bench process per option set side by side, rows
per (set, item) in tune.csv, option sets passed through to bench_attention.py, bad set names
refused."""

import csv
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "experiments", "tune_flex_options.py")


def run(tmp_path, sets, *extra):
    path = tmp_path / "sets.json"
    path.write_text(json.dumps(sets))
    return subprocess.run([sys.executable, SCRIPT, "--sets", str(path), "--out", str(tmp_path / "out"),
                           "--T", "128", *extra], capture_output=True, text=True, timeout=600, cwd=ROOT)


@pytest.mark.slow
def test_sets_side_by_side(tmp_path):
    sets = [{"name": "a", "only": "attn_compressed", "modes": "fwd", "band": {}},
            {"name": "b", "only": "attn_window", "modes": "fwd", "packed": {"bwd_num_stages": 3}}]
    p = run(tmp_path, sets, "--par", "2", "--budget", "500")
    assert p.returncode == 0, p.stdout + p.stderr
    rows = list(csv.DictReader(open(tmp_path / "out" / "tune.csv")))
    assert [(r["set"], r["item"]) for r in sorted(rows, key=lambda r: r["set"])] == \
        [("a", "attn_compressed"), ("b", "attn_window")]
    assert all(float(r["fwd_ms"]) > 0 and not r["error"] for r in rows)
    assert json.loads(rows[[r["set"] for r in rows].index("b")]["packed"]) == {"bwd_num_stages": 3}
    log = (tmp_path / "out" / "b.log").read_text()
    assert "packed {192: {'bwd_num_stages': 3}}" in log  # reached bench_attention's kernel_options


@pytest.mark.slow
@pytest.mark.parametrize("names", [["a", "a"], ["a/b"]])
def test_bad_set_names(tmp_path, names):
    p = run(tmp_path, [{"name": n, "only": "attn_window"} for n in names])
    assert p.returncode != 0 and "names must be unique" in p.stderr
