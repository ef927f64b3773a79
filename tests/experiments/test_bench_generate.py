"""experiments/bench_generate.py (issue 16 item 3) on the CPU: one row per (attention, batch,
decode mode) with the issue's columns and positive times; graph decode skipped with a note;
the decode-mode options validated."""

import csv

import pytest

from tests.experiments.scripts import load_script


@pytest.mark.usefixtures("single_thread")
def test_bench_generate_quick(tmp_path, capsys):
    mod = load_script("bench_generate")
    mod.main(["--quick", "--decode-modes", "eager,graph", "--out", str(tmp_path)])
    assert "decode mode graph needs CUDA; skipped" in capsys.readouterr().out
    with open(tmp_path / "generate.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["context", "batch", "attention", "prefill_s", "decode_tokens_per_s",
                             "device", "decode_mode"]
    assert [(r["attention"], r["batch"], r["decode_mode"]) for r in rows] == [
        ("nsa", "1", "eager"), ("nsa", "2", "eager"), ("full", "1", "eager"),
        ("full", "2", "eager")]
    assert all(float(r["prefill_s"]) > 0 and float(r["decode_tokens_per_s"]) > 0 for r in rows)
    with pytest.raises(SystemExit):
        mod.main(["--quick", "--attention", "nsa,sparse", "--out", str(tmp_path)])


@pytest.mark.parametrize("args, err", [
    (["--decode-modes", "eager,graphs"], "--decode-modes: unknown ['graphs']"),
    (["--decode-modes", ","], "--decode-modes: unknown []"),
    (["--graphs", "--decode-modes", "eager"], "--graphs is --decode-modes graph"),
])
def test_bench_generate_decode_modes_validated(tmp_path, capsys, args, err):
    mod = load_script("bench_generate")
    with pytest.raises(SystemExit):
        mod.main(["--quick", *args, "--out", str(tmp_path)])
    assert err in capsys.readouterr().err
    assert not (tmp_path / "generate.csv").exists()


def test_bench_generate_parse_modes_and_graph_only_on_cpu(tmp_path, capsys):
    mod = load_script("bench_generate")
    assert mod.parse_modes("graph,eager,graph") == ["graph", "eager"]
    assert mod.main(["--quick", "--graphs", "--out", str(tmp_path)]) == []
    assert "skipped on the CPU" in capsys.readouterr().out
