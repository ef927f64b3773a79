"""Faults reproduced for real through nsa-train (subprocesses, CPU debug model, issue 45): a disk
that fills during a checkpoint save (a 3 MiB tmpfs), an exploding learning rate with a checkpoint
every step, a data loader worker killed mid-run (as the out-of-memory killer does). Each ends in
one message or recovers, with nothing lost or silently wrong. (A
same-size corruption of a real DCP checkpoint and the fallback: tests/titan/test_run_guard.py; the
fallback through a training run: tests/titan/test_train.py.)"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nsa_flex.titan.runlock import LOCK_NAME
from tests.titan.helpers import launch_env, running, tmpfs

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "titan_configs" / "debug_nsa.toml"


def _train(dump: Path, steps: int, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "nsa_flex.titan.cli", "--job.config_file", str(CONFIG),
           "--job.dump_folder", str(dump), "--training.steps", str(steps), "--checkpoint.enable",
           "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "3", *extra]
    return subprocess.run(cmd, cwd=ROOT, env={**launch_env(), **(env or {})}, capture_output=True, text=True,
                          timeout=300)


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


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return kids


@pytest.mark.slow  # two training runs
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the worker process through /proc")
def test_a_killed_data_loader_worker_is_one_message_and_a_rerun_resumes(tmp_path):
    d, log = tmp_path / "run", tmp_path / "train.log"
    cmd = [sys.executable, "-m", "nsa_flex.titan.cli", "--job.config_file", str(CONFIG), "--job.dump_folder",
           str(d), "--training.steps", "2000", "--checkpoint.enable", "--checkpoint.interval", "2",
           "--training.dataloader.num_workers", "1"]
    with running(cmd, log) as p:
        deadline = time.time() + 240
        while "step: 5/" not in log.read_text() and p.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        workers = _children(p.pid)
        assert p.poll() is None and len(workers) == 1, log.read_text()[-3000:]
        os.kill(workers[0], signal.SIGKILL)
        assert p.wait(timeout=120) == 1, log.read_text()[-3000:]
    out = log.read_text()
    err = [line for line in out.splitlines() if line.startswith("nsa-train: error:")]
    assert len(err) == 1 and "the data loader's worker process died in step" in err[0], out[-3000:]
    assert "is killed by signal" in err[0] and "out-of-memory killer" in err[0]
    newest = max(int(c.name.split("-")[1]) for c in (d / "checkpoint").glob("step-*"))
    assert newest >= 4 and f"the newest checkpoint: {d / 'checkpoint' / f'step-{newest}'}; rerun" in err[0], err
    assert "Traceback" not in out
    r = _train(d, newest + 2, "--training.dataloader.num_workers", "1")  # the same run, resumed
    resumed = f"Loading the checkpoint from {d / 'checkpoint' / f'step-{newest}'}"
    assert r.returncode == 0 and resumed in r.stdout + r.stderr, (r.stdout + r.stderr)[-3000:]


def test_crash_message_names_the_step_the_cause_and_the_checkpoint_and_nothing_else(tmp_path):
    from types import SimpleNamespace

    import torch

    from nsa_flex.titan.train import crash_message

    def trainer(enable: bool):
        ck = SimpleNamespace(enable=enable, folder="checkpoint")
        job = SimpleNamespace(dump_folder=str(tmp_path))
        return SimpleNamespace(step=9, job_config=SimpleNamespace(checkpoint=ck, job=job))

    died = RuntimeError("DataLoader worker (pid(s) 4242) exited unexpectedly")
    assert crash_message(RuntimeError("an error of ours"), trainer(True)) is None
    assert crash_message(ValueError(str(died)), trainer(True)) is None
    msg = crash_message(died, trainer(True))
    assert "died in step 9 (DataLoader worker (pid(s) 4242) exited unexpectedly)" in msg
    assert msg.endswith("no checkpoint was saved yet: a rerun starts from the beginning")
    (tmp_path / "checkpoint" / "step-6").mkdir(parents=True)  # cut while saving: no .metadata
    (tmp_path / "checkpoint" / "step-4").mkdir()
    (tmp_path / "checkpoint" / "step-4" / ".metadata").touch()
    msg = crash_message(died, trainer(True))
    newest = tmp_path / "checkpoint" / "step-4"
    assert msg.endswith(f"the newest checkpoint: {newest}; rerun the same command to resume from it")
    assert crash_message(died, trainer(False)).endswith(
        "no checkpoint ([checkpoint] enable = false): a rerun starts from the beginning")
    assert crash_message(died, None).endswith("resumes from the newest complete checkpoint, if any")
    # the worker dying while the training process writes a checkpoint: torch's SIGCHLD handler raises
    # inside the save, and DCP hands it on wrapped in a CheckpointException (no Exception)
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    def wrapped(err):
        try:
            raise err
        except RuntimeError as e:
            return CheckpointException("save", {0: _wrap_exception(e)})

    in_save = crash_message(wrapped(RuntimeError("DataLoader worker (pid 4242) is killed by signal: Killed.")),
                            trainer(True))
    assert in_save.startswith("the data loader's worker process died in step 9 (DataLoader worker (pid 4242) is "
                              "killed by signal: Killed.)") and in_save.endswith(f"{newest}; rerun the same "
                                                                                  "command to resume from it")
    assert crash_message(wrapped(RuntimeError("an error of ours")), trainer(True)) is None
    oom = crash_message(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB."), trainer(True))
    assert oom.startswith("out of memory in step 9 (CUDA out of memory. Tried to allocate 2.00 GiB.)")
    assert 'mode = "full"' in oom and "--preflight" in oom and oom.endswith(f"{newest}; rerun the same command "
                                                                            "to resume from it")


@pytest.mark.slow  # a training run
def test_a_step_out_of_memory_is_one_message_naming_the_checkpoint(tmp_path):
    """A step that runs out of memory (tests/titan/ops_test_data.py's nsa_flex_oom: its loss raises
    torch's OutOfMemoryError at step 5, as the CUDA allocator does) stops the run with one line: the
    step, torch's words, what lowers the memory, the newest checkpoint; exit 1, no traceback."""
    d = tmp_path / "run"
    p = _train(d, 8, "--experimental.custom_import", "tests.titan.ops_test_data", "--model.name", "nsa_flex_oom")
    out = p.stdout + p.stderr
    assert p.returncode == 1, out[-3000:]
    err = _errors(p)
    assert len(err) == 1 and err[0].startswith("nsa-train: error: out of memory in step 5 (CUDA out of memory."), out
    assert err[0].endswith(f"the newest checkpoint: {d / 'checkpoint' / 'step-4'}; rerun the same command to "
                           "resume from it"), err
    assert "Traceback" not in out


@pytest.mark.slow  # a training run
def test_a_failed_compile_is_one_message_naming_the_way_around(tmp_path):
    """torch.compile's backend failing (here for real: inductor with no working C++ compiler, CXX
    = /bin/false, and an empty compile cache; on a GPU e.g. no kernel config within the shared
    memory) stops the run with one line: the step, inductor's own first line, how to train
    without compiling; exit 1, no traceback."""
    p = _train(tmp_path / "run", 3, "--compile.enable",
               env={"CXX": "/bin/false", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")})
    out = p.stdout + p.stderr
    assert p.returncode == 1, out[-3000:]
    err = _errors(p)
    assert len(err) == 1 and err[0].startswith("nsa-train: error: torch.compile failed in step 1 (inductor: "
                                               "InvalidCxxCompiler: No working C++ compiler"), out[-3000:]
    assert "--compile.no-enable" in err[0] and "Traceback" not in out


def test_a_save_cut_short_leaves_no_partial_folder(tmp_path):
    """A checkpoint save that an error cuts short (here the worker's death as DCP hands it on)
    removes its step folder where DCP's .metadata, written last, is missing, and re-raises; a
    folder whose .metadata was written stays."""
    from types import SimpleNamespace

    from torch.distributed.checkpoint.api import CheckpointException

    from nsa_flex.titan.checkpoint import save_checked

    manager = SimpleNamespace(folder=str(tmp_path), states={}, _should_save=lambda step, last: True)

    def cut_short(metadata: bool):
        def original(m, step, last):
            (tmp_path / f"step-{step}").mkdir()
            (tmp_path / f"step-{step}" / "__0_0.distcp").write_bytes(b"x" * 100)
            if metadata:
                (tmp_path / f"step-{step}" / ".metadata").write_bytes(b"m")
            raise CheckpointException("save", {0: (RuntimeError("DataLoader worker (pid 1) is killed"), None)})
        return original

    with pytest.raises(CheckpointException):
        save_checked(manager, cut_short(False), 6)
    assert not (tmp_path / "step-6").exists()
    with pytest.raises(CheckpointException):
        save_checked(manager, cut_short(True), 8)
    assert (tmp_path / "step-8" / ".metadata").exists()
