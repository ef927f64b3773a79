"""experiments/cp_report.py: one row per cp_bench log; torchtitan's `tps` is already per GPU under
context parallelism (it divides by the context degree), so the report takes it as it is."""

import csv
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))

import cp_report  # noqa: E402


def write_run(d: Path, name: str, tps: list[int], rc: str = "0", mem: float = 7.14):
    lines = ["[titan] 2026 - root - INFO - CUDA capacity: NVIDIA H100 80GB HBM3 with 79.11GiB memory"]
    lines += [f"[titan] 2026 - root - INFO - step: {i + 1}/12  loss:  7.7  grad_norm:  1.2  "
              f"memory:  {mem}GiB(9.02%)  tps: {t:,}  tflops: 89.5" for i, t in enumerate(tps)]
    (d / f"{name}.log").write_text("\n".join(lines) + "\n")
    (d / f"{name}.rc").write_text(rc + "\n")


def test_rows_take_torchtitans_per_gpu_tps_after_the_warmup(tmp_path):
    write_run(tmp_path, "nsa_cp2_32768", [500, 900, 1000, 1100, 75_214, 75_899, 77_145])
    write_run(tmp_path, "nsa_cp1_32768", [400, 800, 900, 1000, 153_269, 153_282, 153_000], mem=13.67)
    write_run(tmp_path, "full_cp2_65536", [], rc="124")
    cp_report.main([str(tmp_path), "--warmup", "4"])
    rows = {r["attention"] + r["cp"]: r for r in csv.DictReader(open(tmp_path / "cp.csv"))}
    assert rows["nsa2"]["tokens_per_s_per_gpu"] == "75899"  # the median, not divided by 2
    assert rows["nsa1"]["tokens_per_s_per_gpu"] == "153269"
    assert rows["nsa2"]["peak_GiB"] == "7.14" and rows["nsa2"]["status"] == "ok"
    assert rows["full2"]["status"] == "timeout" and rows["full2"]["tokens_per_s_per_gpu"] == ""
    assert rows["nsa2"]["device"] == "NVIDIA H100 80GB HBM3"


def test_merge_keeps_an_earlier_csvs_other_rows(tmp_path):
    """--merge CSV: rows of an earlier cp.csv that this OUT does not measure again (another card,
    another length) are kept; a row this OUT measures again is replaced by the new one."""
    old = tmp_path / "old"
    old.mkdir()
    write_run(old, "nsa_cp2_32768", [1, 1, 1, 1, 70_000, 70_000, 70_000])
    write_run(old, "nsa_cp2_65536", [1, 1, 1, 1, 104_000, 104_000, 104_000], mem=13.26)
    cp_report.main([str(old)])
    new = tmp_path / "new"
    new.mkdir()
    write_run(new, "nsa_cp2_32768", [1, 1, 1, 1, 80_000, 80_000, 80_000])
    write_run(new, "full_cp2_131072", [1, 1, 1, 1, 28_939, 28_939, 28_939], mem=15.47)
    rows = cp_report.main([str(new), "--merge", str(old / "cp.csv")])
    got = {(r["attention"], r["seq_len"]): r["tokens_per_s_per_gpu"] for r in rows}
    assert got == {("nsa", 32768): 80_000, ("nsa", 65536): 104_000, ("full", 131072): 28_939}
    assert list(csv.DictReader(open(new / "cp.csv")))[-1]["peak_GiB"] == "13.26"
    assert (new / "cp.png").stat().st_size > 0
