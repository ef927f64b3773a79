"""Faults reproduced for real through nsa-train (subprocesses, CPU debug model, issue 45): a disk
that fills during a checkpoint save (a 3 MiB tmpfs), an exploding learning rate with a checkpoint
every step. Each ends in one message or recovers, with nothing lost or silently wrong. (A
same-size corruption of a real DCP checkpoint and the fallback: tests/titan/test_run_guard.py; the
fallback through a training run: tests/titan/test_train.py.)"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nsa_flex.titan.runlock import LOCK_NAME
from tests.titan.helpers import launch_env, tmpfs

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "titan_configs" / "debug_nsa.toml"


def _train(dump: Path, steps: int, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "nsa_flex.titan.cli", "--job.config_file", str(CONFIG),
           "--job.dump_folder", str(dump), "--training.steps", str(steps), "--checkpoint.enable",
           "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "3", *extra]
    return subprocess.run(cmd, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=300)


def _errors(p) -> list[str]:
    return [line for line in p.stderr.splitlines() if line.startswith("nsa-train: error:")]


@pytest.mark.slow  # a training run
def test_disk_full_during_a_checkpoint_save_is_one_message(tmp_path):
    with tmpfs(tmp_path / "disk", "3m") as disk:  # holds one checkpoint (2.6 MiB), not two
        p = _train(disk, 4)  # saves step 2, fills the disk at step 4
        out = p.stdout + p.stderr
        assert p.returncode == 2, out[-4000:]
        err = _errors(p)
        assert len(err) == 1 and f"checkpoint folder {disk / 'checkpoint'}: the disk is full" in err[0] \
            and "while saving step 4" in err[0], out[-3000:]
        assert "Traceback" not in out and "CheckpointException" not in out
        assert (disk / "checkpoint" / "step-2" / ".metadata").exists() and not (disk / "checkpoint" / "step-4").exists()
        for line in (disk / "metrics.jsonl").read_text().splitlines():
            json.loads(line)
        assert not (disk / LOCK_NAME).exists()


@pytest.mark.slow  # two training runs
def test_an_exploding_lr_keeps_a_checkpoint_a_lower_lr_resumes_from(tmp_path):
    """lr 1e6, a checkpoint every step: the step before the non-finite one already holds the
    exploding update; it is set aside, so the recommended rerun with a lower lr trains on."""
    d = tmp_path / "run"
    p = _train(d, 6, "--optimizer.lr", "1e6", "--checkpoint.interval", "1")
    out = p.stdout + p.stderr
    assert p.returncode == 3, out[-4000:]
    err = _errors(p)
    bad = int(err[0].split("nsa-train: error: step ")[1].split(":")[0])
    aside = d / "checkpoint" / "nonfinite" / f"step-{bad - 1}"
    assert len(err) == 1 and f"set aside as {aside}" in err[0] and (aside / ".metadata").exists(), err
    assert not (d / "checkpoint" / f"step-{bad - 1}").exists()
    p = _train(d, 6, "--checkpoint.interval", "1")  # the default lr
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "step: 6/6" in out
