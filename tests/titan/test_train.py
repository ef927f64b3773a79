"""End-to-end CPU training through torchtitan's stock trainer (nsa-train wrapper, debug_nsa.toml).

* an uninterrupted 30-step run: the loss falls by a set margin;
* the same run checkpointed every 10 steps (torchtitan DCP), SIGKILLed right after the step-10
  checkpoint is complete, then resumed by rerunning the same command: the losses and grad norms of
  steps 11-30 equal the uninterrupted run's exactly;
* [ops] on the same 30-step command with a slow data loader (tests/titan/ops_test_data.py, spec
  nsa_flex_slow: same data, 0.15 s per batch): SIGUSR1 at step 3 writes a stack dump while training
  goes on, the loader wait reaches metrics.jsonl, creating <dump_folder>/HALT stops the run after the
  current step with a checkpoint and exit code 0, and rerunning the same command resumes with the
  uninterrupted run's losses and grad norms.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nsa_flex.titan.ops import EXIT_HALTED
from tests.titan.helpers import built_once, launch_env

pytestmark = pytest.mark.slow  # training runs (python -m pytest -m slow)

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "titan_configs" / "debug_nsa.toml"
STEPS = 30
LOSS_DROP = 2.0  # 30 steps on the passkey corpus: ~6.3 -> ~2.2 on CPU; require at least this drop


def _cmd(dump: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "nsa_flex.titan.cli",
        "--job.config_file", str(CONFIG),
        "--job.dump_folder", str(dump),
        "--training.steps", str(STEPS),
        "--metrics.log_freq", "1",
        *extra,
    ]


def _records(path: Path) -> dict[int, dict]:
    out = {}
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            assert i == len(lines) - 1, f"corrupt line {i} in {path}"  # only a kill can cut the last one
            continue
        if "loss_metrics/global_avg_loss" in rec:
            out[rec["step"]] = rec
    return out


def _run(cmd, log: Path, timeout=300):
    with open(log, "w") as f:
        p = subprocess.run(cmd, cwd=ROOT, env=launch_env(), stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    assert p.returncode == 0, log.read_text()[-4000:]
    return log.read_text()


CKPT = ("--checkpoint.enable", "--checkpoint.interval", "10",
        "--checkpoint.keep_latest_k", "5")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    d = built_once(tmp_path_factory, "uninterrupted", lambda d: _run(_cmd(d), d / "log.txt"))
    return d, (d / "log.txt").read_text(), _records(d / "metrics.jsonl")


@pytest.mark.slow
def test_debug_training_loss_falls(uninterrupted):
    d, text, recs = uninterrupted
    assert sorted(recs) == list(range(1, STEPS + 1))
    losses = [recs[s]["loss_metrics/global_avg_loss"] for s in range(1, STEPS + 1)]
    assert all(l == l and l < 20 for l in losses)  # finite
    assert losses[-1] < losses[0] - LOSS_DROP, losses
    # mean of the last 5 steps well below the first 5: a trend, not a lucky batch
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - LOSS_DROP, losses
    # the CPU shim and the automatic reference backend were used, throughput was reported
    assert "no CUDA device; running torchtitan on the CPU" in text
    assert "backend=reference" in text  # "auto" resolved on the CPU, silently
    # no known noise, a short config summary, no colour codes in a file
    for noise in ("lspci", "Peak flops undefined", "set_vital", "CPU autocast", "_enforced", "\x1b[",
                  "switching to backend", "Traceback"):
        assert noise not in text, noise
    assert "mfu: n/a" in text and "mfu: nan" not in text
    start = text.index("Model nsa_flex debugmodel: dim 64")
    assert text[start:].split("\n")[1].startswith("  NSA: l=8 d=4")
    assert len(text.splitlines()) < 30 + STEPS
    assert all(recs[s]["throughput(tps)"] > 0 for s in recs)
    assert "tps:" in text and "loss:" in text


@pytest.mark.slow
def test_checkpoint_kill_resume_is_exact(uninterrupted, tmp_path):
    _, _, ref = uninterrupted
    d = tmp_path / "resumed"
    d.mkdir()
    cmd = _cmd(d, *CKPT)
    marker = d / "checkpoint" / "step-10" / ".metadata"  # DCP writes .metadata last
    with open(d / "log_killed.txt", "w") as f:
        p = subprocess.Popen(cmd, cwd=ROOT, env=launch_env(), stdout=f, stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + 240
            while not marker.exists():
                assert p.poll() is None, (d / "log_killed.txt").read_text()[-4000:]
                assert time.time() < deadline, "no step-10 checkpoint"
                time.sleep(0.005)
            assert p.poll() is None, "the run finished before it could be killed"
            os.kill(p.pid, signal.SIGKILL)
        finally:
            p.wait(timeout=60)
    assert p.returncode == -signal.SIGKILL
    before = _records(d / "metrics.jsonl")
    assert 10 <= max(before) < STEPS, sorted(before)  # killed after step 10, before the end
    for s in range(1, 11):  # identical up to the checkpoint
        assert before[s]["loss_metrics/global_avg_loss"] == ref[s]["loss_metrics/global_avg_loss"]
    assert not (d / "checkpoint" / "step-20").exists() or max(before) >= 20

    (d / "metrics.jsonl").unlink()
    # a later checkpoint may exist if the kill landed late; resume from step 10 explicitly then
    extra = () if not (d / "checkpoint" / "step-20").exists() else ("--checkpoint.load_step", "10")
    text = _run(cmd + list(extra), d / "log_resumed.txt")
    assert "Training starts at step 11" in text
    resumed = _records(d / "metrics.jsonl")
    assert sorted(resumed) == list(range(11, STEPS + 1))
    for s in range(11, STEPS + 1):
        assert resumed[s]["loss_metrics/global_avg_loss"] == ref[s]["loss_metrics/global_avg_loss"], s
        assert resumed[s]["grad_norm"] == ref[s]["grad_norm"], s


@pytest.mark.slow
def test_dataloader_worker_gives_the_same_stream_and_resumes_exactly(uninterrupted, tmp_path):
    """[training.dataloader] num_workers = 1 (tokenization off the training process, as the
    quality TOML sets it): the same losses as in-process loading, and a resume from a checkpoint
    taken with a worker continues the stream exactly (the worker's dataset state is checkpointed)."""
    _, _, ref = uninterrupted
    cmd = _cmd(tmp_path, *CKPT, "--training.dataloader.num_workers", "1")
    _run(cmd, tmp_path / "log.txt")
    first = _records(tmp_path / "metrics.jsonl")
    assert [first[s]["loss_metrics/global_avg_loss"] for s in range(1, STEPS + 1)] == \
        [ref[s]["loss_metrics/global_avg_loss"] for s in range(1, STEPS + 1)]
    (tmp_path / "metrics.jsonl").unlink()
    text = _run(cmd + ["--checkpoint.load_step", "10"], tmp_path / "log_resumed.txt")
    assert "Training starts at step 11" in text
    resumed = _records(tmp_path / "metrics.jsonl")
    assert [resumed[s]["loss_metrics/global_avg_loss"] for s in range(11, STEPS + 1)] == \
        [ref[s]["loss_metrics/global_avg_loss"] for s in range(11, STEPS + 1)]


def _short(dump: Path, steps: int) -> list[str]:
    return [sys.executable, "-m", "nsa_flex.titan.cli", "--job.config_file", str(CONFIG),
            "--job.dump_folder", str(dump), "--training.steps", str(steps), "--metrics.log_freq", "1",
            "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "3"]


@pytest.mark.slow
def test_damaged_checkpoint_is_set_aside_and_resume_is_marked(tmp_path):
    """A truncated latest .distcp is detected before loading, set aside with a
    message naming it, and the run resumes from the previous checkpoint; metrics.jsonl marks the
    resume. With every checkpoint damaged (garbage .metadata): one clear error, exit code 2."""
    d = tmp_path / "run"
    _run(_short(d, 4), tmp_path / "log1.txt")
    ck = d / "checkpoint"
    assert sorted(p.name for p in ck.iterdir()) == ["step-2", "step-4"]
    data = max((ck / "step-4").glob("*.distcp"), key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])  # truncated

    text = _run(_short(d, 6), tmp_path / "log2.txt")
    assert f"Checkpoint {ck / 'step-4'} is damaged: data file {data.name} is truncated" in text
    assert "Training starts at step 3" in text
    assert (ck / "damaged" / "step-4" / data.name).is_file()
    recs = [json.loads(l) for l in (d / "metrics.jsonl").read_text().splitlines()]
    marks = [i for i, r in enumerate(recs) if r.get("event") == "resume"]
    assert len(marks) == 1 and recs[marks[0]]["checkpoint_step"] == 2, recs
    assert recs[marks[0]]["checkpoint"].endswith("step-2")
    assert [r["step"] for r in recs[marks[0] + 1:]] == [3, 4, 5, 6]
    assert [r["step"] for r in recs[: marks[0]]] == [1, 2, 3, 4]  # the first run's records

    for meta in ck.glob("step-*/.metadata"):
        meta.write_bytes(b"garbage, not a pickle")
    p = subprocess.run(_short(d, 8), cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, (p.stdout + p.stderr)[-3000:]
    assert f"nsa-train: error: no usable checkpoint in {ck}" in p.stderr
    assert ".metadata is unreadable" in p.stderr and "Traceback" not in p.stdout + p.stderr


# ----------------------------------------------------------------------------- [ops]: SIGUSR1, data wait, HALT
SLOW = ("--experimental.custom_import", "tests.titan.ops_test_data", "--model.name", "nsa_flex_slow",
        "--ops.data_wait_warn_share", "0.02", "--ops.data_wait_warn_steps", "3")


def _wait_for(cond, p, log: Path, what: str, timeout=240):
    deadline = time.time() + timeout
    while not cond():
        assert p.poll() is None, f"run ended before {what}: " + log.read_text()[-4000:]
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _max_step(path: Path) -> int:
    return max(_records(path), default=0) if path.exists() else 0


def _halted_cmd(d: Path) -> list[str]:
    # model-only final saves (as in the ablation TOMLs): the halt checkpoint must still be full
    return _cmd(d, *CKPT, *SLOW, "--checkpoint.last_save_model_only")


def _run_halted(d: Path) -> None:
    """The slow run: SIGUSR1 after step 3, HALT after the dump; its exit code in d / "rc"."""
    log, metrics = d / "log_halted.txt", d / "metrics.jsonl"
    with open(log, "w") as f:
        p = subprocess.Popen(_halted_cmd(d), cwd=ROOT, env=launch_env(), stdout=f, stderr=subprocess.STDOUT)
        try:
            _wait_for(lambda: _max_step(metrics) >= 3, p, log, "step 3")
            p.send_signal(signal.SIGUSR1)
            dumps = d / "stalls"
            _wait_for(lambda: dumps.is_dir() and any(dumps.iterdir()) and "SIGUSR1 dump" in log.read_text(),
                      p, log, "the SIGUSR1 dump")
            at = int(next(dumps.iterdir()).name.split("-")[1])  # step-N-rank-0.txt: step N in progress
            _wait_for(lambda: _max_step(metrics) > at, p, log, "a step after the dump")  # training goes on
            (d / "HALT").write_text("")
            p.wait(timeout=240)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    (d / "rc").write_text(str(p.returncode))


@pytest.fixture(scope="module")
def halted(tmp_path_factory):
    """The slow run, halted (read-only: a test that resumes it copies it); (dir, log text, rc)."""
    d = built_once(tmp_path_factory, "halted", _run_halted)
    return d, (d / "log_halted.txt").read_text(), int((d / "rc").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stop_signal_to_the_process_group_halts_with_a_checkpoint(tmp_path, sig):
    """SIGTERM or SIGINT sent to the run's whole process group (what `timeout`, a scheduler and
    Ctrl-C in a terminal do) while a data-loader worker runs: the run halts after the step with a
    checkpoint of that step and exit code EXIT_HALTED, no traceback (a worker killed by the signal
    made torch raise in the middle of that save)."""
    cmd = _cmd(tmp_path, *CKPT, *SLOW, "--training.dataloader.num_workers", "1")
    log, metrics = tmp_path / "log.txt", tmp_path / "metrics.jsonl"
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, cwd=ROOT, env=launch_env(), stdout=f, stderr=subprocess.STDOUT,
                             start_new_session=True)
        try:
            _wait_for(lambda: _max_step(metrics) >= 3, p, log, "step 3")
            os.killpg(p.pid, sig)
            p.wait(timeout=240)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    text = log.read_text()
    assert p.returncode == EXIT_HALTED, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    halted_at = int(re.search(rf"ops: halted after step (\d+) \({sig.name}\)", text)[1])
    assert f"saving a checkpoint (signals: {sig.name} at +0.00 s" in text  # what arrived, and when
    assert 3 <= halted_at < STEPS
    assert (tmp_path / "checkpoint" / f"step-{halted_at}" / ".metadata").is_file()


@pytest.mark.slow
def test_sigusr1_dumps_while_training_continues(halted):
    d, text, rc = halted
    dumps = sorted((d / "stalls").iterdir())
    assert len(dumps) == 1, dumps
    dump = dumps[0].read_text()
    assert dumps[0].name.startswith("step-") and dumps[0].name.endswith("-rank-0.txt")
    assert "SIGUSR1 (on demand; the run goes on)" in dump and "--- Python thread stacks" in dump
    # the signal lands in the slow loader's sleep or in the step itself: a project frame either way
    assert "innermost project frame (main thread): " in dump
    assert "ops_test_data.py" in dump or "nsa_flex/" in dump
    signalled_at = int(dumps[0].name.split("-")[1])
    assert _max_step(d / "metrics.jsonl") > signalled_at  # trained on after the dump
    assert rc == EXIT_HALTED, text[-3000:]


@pytest.mark.slow
def test_loader_wait_in_metrics_and_warning(halted):
    d, text, _ = halted
    recs = _records(d / "metrics.jsonl")
    waits = [r["time_metrics/data_wait_per_step(s)"] for s, r in sorted(recs.items()) if s > 1]
    assert waits and all(0.14 < w < 1.0 for w in waits), waits  # the helper sleeps 0.15 s per batch
    assert all(r["throughput_excl_data(tps)"] > r["throughput(tps)"] for r in recs.values())
    assert "time_metrics/data_wait(%)" in recs[2]
    assert "data: 1" in text and "tps excl. data:" in text  # console step line ("data: 15xms/step")
    assert "ops: data loader stall" in text


@pytest.mark.slow
def test_halt_file_then_resume_is_exact(uninterrupted, halted, tmp_path):
    _, _, ref = uninterrupted
    src, text, rc = halted
    d = tmp_path / "halted"  # the resume writes to its dump folder: a copy, the same command on it
    shutil.copytree(src, d)
    cmd = _halted_cmd(d)
    assert rc == EXIT_HALTED, text[-3000:]  # halted, not finished: its own exit code
    before = _records(d / "metrics.jsonl")
    n = max(before)
    assert 3 < n < STEPS, sorted(before)
    assert f"ops: halt (halt file {src / 'HALT'}) on rank 0: stopping after step {n}" in text
    assert (d / "checkpoint" / f"step-{n}" / ".metadata").exists()
    assert not (d / "HALT").exists()  # consumed: the rerun does not halt again
    for s in range(1, n + 1):
        assert before[s]["loss_metrics/global_avg_loss"] == ref[s]["loss_metrics/global_avg_loss"], s

    (d / "metrics.jsonl").unlink()
    resumed_text = _run(cmd, d / "log_resumed.txt")  # the same command
    assert f"Training starts at step {n + 1}" in resumed_text
    resumed = _records(d / "metrics.jsonl")
    assert sorted(resumed) == list(range(n + 1, STEPS + 1))
    for s in range(n + 1, STEPS + 1):
        assert resumed[s]["loss_metrics/global_avg_loss"] == ref[s]["loss_metrics/global_avg_loss"], s
        assert resumed[s]["grad_norm"] == ref[s]["grad_norm"], s


@pytest.mark.slow
def test_dense_selection_warm_up_switches_at_its_step(tmp_path):
    """[nsa] sel_dense_steps = 3: steps 1-3 select every block, step 4 on the top-n rule; the log
    names both, once each, and the run finishes with a falling loss."""
    text = _run(_cmd(tmp_path, "--training.steps", "6", "--nsa.sel_dense_steps", "3"), tmp_path / "log.txt")
    assert text.count("nsa: step 1: dense selection warm-up ([nsa] sel_dense_steps)") == 1, text[-3000:]
    assert text.count("nsa: step 4: top-n selection") == 1
    assert "dense selection" not in text.split("nsa: step 4: top-n selection")[1]
    recs = _records(tmp_path / "metrics.jsonl")
    assert sorted(recs) == list(range(1, 7))
    assert recs[6]["loss_metrics/global_avg_loss"] < recs[1]["loss_metrics/global_avg_loss"]
