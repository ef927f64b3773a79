"""metrics.jsonl integrity (nsa_flex/titan/metrics.py): a run from step 0 never appends to an
earlier run's records, a resume drops a last line cut short before appending, and a full disk
(a real tmpfs) leaves no partial line and stops with one DiskSpaceError."""

import json

import pytest

from nsa_flex.titan import metrics
from nsa_flex.titan.checkpoint import DiskSpaceError
from tests.titan.helpers import fill, tmpfs


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_run_from_step_0_moves_an_earlier_runs_records_aside(tmp_path, caplog):
    f = tmp_path / "metrics.jsonl"
    f.write_text(json.dumps({"step": 1, "loss_metrics/global_avg_loss": 5.0}) + "\n")
    for k in (1, 2):
        lg = metrics.JsonlLogger(str(f))
        lg.log({"loss_metrics/global_avg_loss": float(k)}, 1)
        lg.close()
        assert [r["loss_metrics/global_avg_loss"] for r in _lines(f)] == [float(k)]
    assert _lines(tmp_path / "metrics.1.jsonl")[0]["loss_metrics/global_avg_loss"] == 5.0
    assert _lines(tmp_path / "metrics.2.jsonl")[0]["loss_metrics/global_avg_loss"] == 1.0
    assert f"Metrics file {f} held the records of an earlier run that this run does not resume: moved to " \
           f"{tmp_path / 'metrics.1.jsonl'}" in caplog.text


def test_a_resume_drops_a_last_line_cut_short_then_appends(tmp_path, caplog):
    f = tmp_path / "metrics.jsonl"
    f.write_text(json.dumps({"step": 1, "loss_metrics/global_avg_loss": 5.0}) + '\n{"step": 2, "loss_met')
    lg = metrics.JsonlLogger(str(f))
    metrics.note_resume(1, "ckpt/step-1")
    lg.log({"loss_metrics/global_avg_loss": 4.0}, 2)
    lg.close()
    assert [(r["step"], r.get("event")) for r in _lines(f)] == [(1, None), (1, "resume"), (2, None)]
    assert f"Metrics file {f}: dropped its last line (21 bytes without a newline" in caplog.text


def test_disk_full_while_writing_leaves_no_partial_line(tmp_path):
    with tmpfs(tmp_path / "disk", "64k") as disk:
        f = disk / "metrics.jsonl"
        lg = metrics.JsonlLogger(str(f))
        lg.log({"loss_metrics/global_avg_loss": 1.0}, 1)
        fill(disk)
        (disk / "filler").write_bytes(b"")  # leave less room than one record: not a whole page
        fill(disk)
        big = {f"nsa/layer{i}/x": 0.123456789 for i in range(400)}  # a record larger than a page
        with pytest.raises(DiskSpaceError, match=f"metrics file {f}: the disk is full while writing the "
                                                 r"record of step 2 \(No space left on device\)"):
            lg.log(big, 2)
        lg.close()
        assert f.read_text().endswith("\n") and [r["step"] for r in _lines(f)] == [1]
