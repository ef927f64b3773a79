"""experiments/bench_generate.py (issue 16 item 3) on the CPU: one row per (attention, batch) with
the issue's columns and positive times."""

import csv

import pytest

from tests.experiments.scripts import load_script


@pytest.mark.usefixtures("single_thread")
def test_bench_generate_quick(tmp_path):
    mod = load_script("bench_generate")
    mod.main(["--quick", "--out", str(tmp_path)])
    with open(tmp_path / "generate.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["context", "batch", "attention", "prefill_s", "decode_tokens_per_s",
                             "device"]
    assert [(r["attention"], r["batch"]) for r in rows] == [("nsa", "1"), ("nsa", "2"),
                                                            ("full", "1"), ("full", "2")]
    assert all(float(r["prefill_s"]) > 0 and float(r["decode_tokens_per_s"]) > 0 for r in rows)
    with pytest.raises(SystemExit):
        mod.main(["--quick", "--attention", "nsa,sparse", "--out", str(tmp_path)])
