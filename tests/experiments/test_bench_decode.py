"""experiments/bench_decode.py in its CPU quick mode, with the per-kernel breakdown table."""

import csv

from tests.experiments.scripts import load_script


def _bench():
    return load_script("bench_decode")


def test_bench_decode_quick_breakdown(tmp_path):
    rows = _bench().main(["--quick", "--contexts", "512", "--batches", "1", "--reps", "1",
                          "--breakdown", "--out", str(tmp_path)])
    assert len(rows) == 1 and not rows[0]["errors"], rows
    with open(tmp_path / "decode_breakdown.csv") as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == ["S", "batch", "kernel", "us", "launches"]
    names = [r["kernel"] for r in table]
    assert "nsa_torch/ALL_KERNELS" in names and "nsa_torch/STEP" in names, names
    parts = [r for r in table if r["kernel"].startswith("nsa_torch/")
             and r["kernel"] not in ("nsa_torch/ALL_KERNELS", "nsa_torch/STEP")]
    total = next(r for r in table if r["kernel"] == "nsa_torch/ALL_KERNELS")
    assert parts and all(int(r["launches"]) >= 1 and float(r["us"]) >= 0 for r in parts)
    assert abs(sum(float(r["us"]) for r in parts) - float(total["us"])) < 0.01 * len(parts)
    assert int(total["launches"]) == sum(int(r["launches"]) for r in parts)


def test_kernel_breakdown_counts_launches_per_step():
    import torch

    mod = _bench()
    x = torch.randn(64, 64)

    def step():
        (x @ x).relu_()
        (x @ x).relu_()
        return x.sum()

    out = {r["kernel"]: r for r in mod.kernel_breakdown(step, torch.device("cpu"), reps=4)}
    assert out["aten::matmul"]["launches"] == 2 and out["aten::sum"]["launches"] == 1, out
    assert out["ALL_KERNELS"]["launches"] == sum(
        r["launches"] for k, r in out.items() if k != "ALL_KERNELS")
