"""A debug run's console holds none of the known noise, and a halted run says so instead of
"Training completed" (nsa_flex.titan.console, nsa_flex.titan.metrics, nsa_flex.titan.trainer)."""

import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nsa_flex.titan.ops import EXIT_HALTED
from tests.titan.helpers import running

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "titan_configs" / "debug_nsa.toml"

DENYLIST = (
    "0.0.0 means __version__",  # torchtitan's version line
    "Sleeping 2 seconds",  # a single process has no other ranks
    "tflops:",  # 0.00 without peak FLOPS, beside mfu: n/a
    " - WARNING - ",  # nothing to warn about on the documented CPU path
    "Warning",  # Python warnings (UserWarning, TyroWarning, ...)
    "lspci",
    "passkey corpus",  # the description of a run on other data
    "\x1b[",  # colour codes in a pipe
)


def _run(tmp_path, *extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "nsa_flex.titan.cli", "--job.config_file", str(CONFIG),
                           "--training.steps", "3", "--lr_scheduler.warmup_steps", "1",
                           "--job.dump_folder", str(tmp_path), *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_debug_run_console_is_quiet(tmp_path):
    r = _run(tmp_path)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    lines = (r.stdout + r.stderr).splitlines()
    noisy = [(bad, l) for l in lines for bad in DENYLIST if bad in l]
    assert not noisy, noisy
    assert any(l.endswith(" - INFO - torchtitan 0.2.2") for l in lines), lines[:3]
    steps = [l for l in lines if " - INFO - step: " in l]
    assert [l.split("step: ")[1].split()[0] for l in steps] == ["1/3", "2/3", "3/3"], steps
    assert all("mfu: n/a" in l for l in steps)
    assert any(l.endswith("Training completed") for l in lines)
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]  # no empty comm_traces/ (nor stalls/)


@pytest.mark.slow  # a training run
def test_halted_run_does_not_say_completed(tmp_path):
    """A HALT file left from before the run is removed at its start (one warning); one created
    during the run halts it: "Training halted after step N", never "Training completed", exit 4."""
    (tmp_path / "HALT").write_text("")
    log, metrics = tmp_path.parent / f"{tmp_path.name}.log", tmp_path / "metrics.jsonl"
    cmd = [sys.executable, "-m", "nsa_flex.titan.cli", "--job.config_file", str(CONFIG), "--training.steps", "40",
           "--lr_scheduler.warmup_steps", "1", "--job.dump_folder", str(tmp_path),
           "--experimental.custom_import", "tests.titan.ops_test_data", "--model.name", "nsa_flex_slow"]
    with running(cmd, log) as p:
        deadline = time.time() + 240
        while '"step": 1,' not in (metrics.read_text() if metrics.exists() else ""):
            assert p.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        (tmp_path / "HALT").write_text("")
        p.wait(timeout=120)
    out = log.read_text()
    assert p.returncode == EXIT_HALTED, out[-3000:]
    assert f"ops: halt file {tmp_path / 'HALT'} was left from before this run" in out
    assert "Training completed" not in out
    m = re.search(rf"Training halted after step (\d+) of 40 \(halt file {re.escape(str(tmp_path / 'HALT'))}\)", out)
    assert m and 1 <= int(m.group(1)) < 40, out[-2000:]



def test_a_run_with_nothing_left_to_do_says_how_to_go_on():
    from nsa_flex.titan.trainer import _EndOfRun

    trainer = SimpleNamespace(halted_at=None, steps_run=0, step=50,
                              job_config=SimpleNamespace(training=SimpleNamespace(steps=50)))
    end = lambda: logging.LogRecord("torchtitan", logging.INFO, __file__, 0, "Training completed", None, None)
    r = end()
    assert _EndOfRun(trainer).filter(r) and r.getMessage() == (
        "Nothing to train: the run is at step 50 of --training.steps 50; raise --training.steps "
        "(e.g. --training.steps 100) to train further")
    trainer.steps_run = 50  # a run that trained keeps torchtitan's line
    r = end()
    assert _EndOfRun(trainer).filter(r) and r.getMessage() == "Training completed"


def test_only_rank_zero_logs_and_cpu_runs_drop_nccl_notes(monkeypatch):
    from nsa_flex.titan import console

    record = lambda level, msg: logging.LogRecord("root", level, __file__, 0, msg, None, None)
    f = console.ConsoleFilter(color=False)
    monkeypatch.setenv("RANK", "1")  # a torchrun worker other than rank 0: its errors only
    assert not f.filter(record(logging.INFO, "step: 1/2  loss: 6.2"))
    assert not f.filter(record(logging.WARNING, "Warmup steps (5) exceed total steps (2)."))
    assert f.filter(record(logging.ERROR, "rank 1 failed"))
    monkeypatch.setenv("RANK", "0")
    assert f.filter(record(logging.INFO, "step: 1/2  loss: 6.2"))
    nccl = "ENV[TORCH_NCCL_ASYNC_ERROR_HANDLING] = 1 will be overridden to 3 based on job config"
    assert f.filter(record(logging.WARNING, nccl)) == torch.cuda.is_available()


def test_a_worker_death_inside_a_log_call_reaches_the_trainer(capsys):
    """torch's SIGCHLD handler raises a dead data loader worker's error wherever the training
    process is, inside a log call too, where logging would print "--- Logging error ---" with a
    traceback and go on: under the console's setup that error goes on up (to the trainer's one-line
    message); any other error inside a log call is logging's as before."""
    import io

    from nsa_flex.titan import console

    class Failing(io.StringIO):
        def __init__(self, err):
            super().__init__()
            self.err = err

        def write(self, s):
            raise self.err

    console.setup()
    console.setup()  # idempotent: one wrapper
    log = logging.getLogger("nsa_flex.tests.worker_death")
    log.propagate = False
    died = RuntimeError("DataLoader worker (pid 7) is killed by signal: Killed. ")
    for err, raises in ((died, True), (ValueError("a bug in a handler"), False)):
        handler = logging.StreamHandler(Failing(err))
        log.addHandler(handler)
        try:
            if raises:
                with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid 7\) is killed"):
                    log.warning("step 5")
            else:
                log.warning("step 5")
                assert "--- Logging error ---" in capsys.readouterr().err
        finally:
            log.removeHandler(handler)
