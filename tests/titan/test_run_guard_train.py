"""Run robustness through nsa-train (subprocesses, CPU debug model): one run per dump folder and
Ctrl-C, the non-finite guard's exit code, and user errors stopped before torchtitan starts."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nsa_flex.titan.ops import EXIT_HALTED
from nsa_flex.titan.runlock import LOCK_NAME
from tests.titan.helpers import launch_env

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "titan_configs" / "debug_nsa.toml"


def _cmd(dump: Path, steps: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "nsa_flex.titan.cli", "--job.config_file", str(CONFIG),
            "--job.dump_folder", str(dump), "--training.steps", str(steps), "--metrics.log_freq", "1",
            "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "2",
            "--experimental.custom_import", "tests.titan.ops_test_data", *extra]


def _steps_done(dump: Path) -> int:
    try:
        lines = (dump / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    steps = []
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "loss_metrics/global_avg_loss" in rec:
            steps.append(rec["step"])
    return max(steps, default=0)


def _wait_steps(p, dump: Path, log: Path, n: int, timeout=240):
    deadline = time.time() + timeout
    while _steps_done(dump) < n:
        assert p.poll() is None, log.read_text()[-4000:]
        assert time.time() < deadline, f"no step {n}"
        time.sleep(0.05)


@pytest.mark.slow  # training runs
def test_second_run_refused_then_ctrl_c_halts_and_a_second_ctrl_c_stops_at_once(tmp_path):
    d, log = tmp_path / "run", tmp_path / "a.txt"
    with open(log, "w") as f:
        a = subprocess.Popen(_cmd(d, 40, "--model.name", "nsa_flex_slow"), cwd=ROOT, env=launch_env(),
                             stdout=f, stderr=subprocess.STDOUT)
        try:
            _wait_steps(a, d, log, 2)
            holder = json.loads((d / LOCK_NAME).read_text())
            assert holder["pid"] == a.pid
            t0 = time.time()
            b = subprocess.run(_cmd(d, 40), cwd=ROOT, env=launch_env(), capture_output=True, text=True,
                               timeout=120)
            assert b.returncode == 2, b.stderr[-3000:]
            err = [l for l in b.stderr.splitlines() if l.strip()]
            assert err[-1].startswith(f"nsa-train: error: dump folder {d} is in use by another run (pid {a.pid} "), err
            assert "Traceback" not in b.stderr and time.time() - t0 < 60
            a.send_signal(signal.SIGINT)  # the first Ctrl-C: stop after this step, with a checkpoint
            a.wait(timeout=120)
        finally:
            if a.poll() is None:
                a.kill()
                a.wait()
    text = log.read_text()
    assert a.returncode == EXIT_HALTED, text[-4000:]  # halted with a checkpoint, not finished
    assert "Traceback" not in text and "KeyboardInterrupt" not in text
    halted = int(text.split("ops: halted after step ")[1].split()[0])
    assert 2 <= halted < 40 and "(SIGINT)" in text
    assert (d / "checkpoint" / f"step-{halted}" / ".metadata").exists()
    assert not (d / LOCK_NAME).exists()  # released

    log2 = tmp_path / "b.txt"
    with open(log2, "w") as f:  # resumes from the halt checkpoint; two Ctrl-C: stops at once
        c = subprocess.Popen(_cmd(d, 40, "--model.name", "nsa_flex_slow"), cwd=ROOT, env=launch_env(),
                             stdout=f, stderr=subprocess.STDOUT)
        try:
            _wait_steps(c, d, log2, halted + 2)
            c.send_signal(signal.SIGINT)
            time.sleep(0.05)
            c.send_signal(signal.SIGINT)
            c.wait(timeout=60)
        finally:
            if c.poll() is None:
                c.kill()
                c.wait()
    assert f"Training starts at step {halted + 1}" in log2.read_text()
    assert c.returncode == -signal.SIGINT, log2.read_text()[-3000:]


@pytest.mark.slow  # training runs
def test_nonfinite_loss_stops_with_code_3_keeping_the_last_finite_checkpoint(tmp_path):
    from tests.titan.ops_test_data import NAN_AT

    d = tmp_path / "run"
    p = subprocess.run(_cmd(d, 10, "--model.name", "nsa_flex_nan"), cwd=ROOT, env=launch_env(),
                       capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 3, out[-4000:]
    assert NAN_AT == 5  # checkpoints every 2 steps: step 4's led to the NaN step, step 2's did not
    err = [l for l in p.stderr.splitlines() if l.startswith("nsa-train: error:")]
    assert len(err) == 1 and f"step {NAN_AT}: the loss or the gradient norm is not finite" in err[0], out[-3000:]
    assert f"set aside as {d / 'checkpoint' / 'nonfinite' / 'step-4'}" in err[0]
    assert f"resume point: {d / 'checkpoint' / 'step-2'} (the last checkpoint" in err[0]
    assert sorted(os.listdir(d / "checkpoint")) == ["nonfinite", "step-2"]
    assert (d / "stalls" / f"step-{NAN_AT}-rank-0.txt").exists()
    assert "Traceback" not in out and not (d / LOCK_NAME).exists()


def test_user_errors_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cases = [
        (("--training.steps", "-1"), "training.steps=-1: must be an integer >= 1"),
        (("--training.local_batch_size", "0"), "training.local_batch_size=0: must be an integer >= 1"),
        (("--job.dump_folder", str(blocker / "run")), f"job.dump_folder {blocker}/run is not writable"),
    ]
    for extra, msg in cases:
        cmd = [sys.executable, "-m", "nsa_flex.titan.cli", "--job.config_file", str(CONFIG),
               "--job.dump_folder", str(tmp_path / "ok"), *extra]
        p = subprocess.run(cmd, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=120)
        assert p.returncode == 2, p.stderr[-3000:]
        err = [l for l in p.stderr.splitlines() if l.strip()]
        assert err[-1].startswith("nsa-train: error: ") and msg in err[-1], err
        assert "Traceback" not in p.stderr


@pytest.mark.slow  # training runs
def test_initial_load_path_is_loaded_into_a_new_dump_folder(tmp_path):
    """Training from another run's weights (checkpoint.initial_load_path, model only) loads them:
    the start-up checks must not create the new run's checkpoint folder, or torchtitan takes the
    empty folder for the run's own and trains from scratch with only a warning."""
    first, second = tmp_path / "first", tmp_path / "second"
    r = subprocess.run(_cmd(first, 2), cwd=ROOT, env=launch_env(), capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    src = first / "checkpoint" / "step-2"
    r = subprocess.run(_cmd(second, 1, "--checkpoint.initial_load_path", str(src)), cwd=ROOT,
                       env=launch_env(), capture_output=True, text=True, timeout=240)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert f"Loading the checkpoint from {src}" in out and "checkpoint.folder exists" not in out
    # weights of a model with other settings (phi = "mlp": more parameters): one error line, no load
    mlp = tmp_path / "mlp"
    r = subprocess.run(_cmd(mlp, 1, "--nsa.phi", "mlp"), cwd=ROOT, env=launch_env(), capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    r = subprocess.run(_cmd(tmp_path / "fourth", 1, "--checkpoint.initial_load_path", str(mlp / "checkpoint" / "step-1")),
                       cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=240)
    assert r.returncode != 0 and "holds model keys this model lacks" in r.stderr, (r.stdout + r.stderr)[-3000:]
    assert "Loading the checkpoint from" not in r.stdout + r.stderr
