"""[ops] (nsa_flex/titan/ops.py) and nsa-train --preflight on CPU.

* unit: [ops] validation names every bad field; the faulthandler-dump parser finds the innermost
  project frame of the main thread; the data-stall warning needs K consecutive slow steps; the
  compile clock's console line;
* a run whose data loader blocks (tests/titan/ops_test_data.py, spec nsa_flex_block) is caught by the stall
  watchdog within the timeout: the dump names the blocking frame, the process exits with the code;
* preflight passes on debug_nsa.toml and lists every problem of a broken config.

SIGUSR1 dumps, the loader-wait metrics and HALT + resume are in tests/titan/test_train.py (they
share its uninterrupted reference run).
"""

import faulthandler
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from nsa_flex.titan import ops
from nsa_flex.titan.job_config import Ops
from tests.titan.helpers import launch_env

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "titan_configs" / "debug_nsa.toml"


# ----------------------------------------------------------------------------- unit
def test_validate_names_every_bad_field():
    assert ops.validate(Ops()) == []
    bad = replace(Ops(), stall_timeout_s=-1.0, stall_exit_code=300, halt_file="a/b", data_wait_warn_share=0.0,
                  data_wait_warn_steps=0, long_run_steps=-5)
    errs = ops.validate(bad)
    for field in ("stall_timeout_s", "stall_exit_code", "halt_file", "data_wait_warn_share",
                  "data_wait_warn_steps", "long_run_steps"):
        assert any(e.startswith(f"ops.{field}=") for e in errs), (field, errs)
    errs = ops.validate(replace(Ops(), stall_timeout_s=100.0, stall_timeout_first_s=10.0))
    assert len(errs) == 1 and "stall_timeout_first_s" in errs[0] and ">=" in errs[0]


def _project_function_that_dumps(f):
    faulthandler.dump_traceback(file=f, all_threads=True)


def test_innermost_project_frame_of_main_thread():
    with tempfile.TemporaryFile("w+") as f:
        _project_function_that_dumps(f)
        f.seek(0)
        text = f.read()
    where = ops.innermost_project_frame(text, threading.main_thread().ident, root=str(ROOT))
    assert where.startswith("tests/titan/test_ops.py:") and where.endswith("in _project_function_that_dumps"), where
    # a frame outside the root is skipped; a thread that is not in the dump is said so
    assert "no project frame" in ops.innermost_project_frame(text, threading.main_thread().ident, root="/nonexistent")
    assert "not in the dump" in ops.innermost_project_frame(text, 12345)


def test_data_stall_warning_needs_k_consecutive_steps():
    m = ops.DataStallMonitor(share=0.5, steps=3)
    assert m.update(1, 0.6, 1.0) is None and m.update(2, 0.6, 1.0) is None
    assert m.update(3, 0.1, 1.0) is None  # one fast step resets the run
    assert [m.update(s, 0.9, 1.0) for s in (4, 5)] == [None, None]
    msg = m.update(6, 0.9, 1.0)
    assert msg and "data loader stall" in msg and "50%" in msg and "3 steps" in msg
    assert m.update(7, 0.9, 1.0) is None  # once per episode


def test_compile_clock_names_what_compiled_for_how_long_and_where():
    t = iter([{}, {"total": 0.4, "tracing": 0.4},  # at the start, after a cheap lap
              {"total": 70.4, "tracing": 10.4, "entire_backward_compile": 20.0, "async_compile.wait": 30.2},
              {"total": 70.4, "tracing": 10.4, "entire_backward_compile": 20.0, "async_compile.wait": 30.2},
              {"total": 72.0, "tracing": 11.9}])
    clock = ops.CompileClock(min_s=1.0, clock=lambda: next(t))
    assert clock.lap("step 1") is None  # 0.4 s: below min_s
    assert clock.lap("step 2") == ("compile: step 2 compiled for 70 s (dynamo tracing 10 s, backward graphs 20 s, "
                                   "waiting for kernel compiles 30 s; torch.compile in this process: 70 s)")
    assert clock.lap("step 3") is None
    # a phase torch did not time (another version) or that took under half a second is left out
    assert clock.lap("step 4") == "compile: step 4 compiled for 2 s (dynamo tracing 2 s; torch.compile in this process: 72 s)"


def test_compile_seconds_counts_this_process_compiles_forward_and_backward():
    import torch

    before = ops.compile_seconds()
    x = torch.randn(4, requires_grad=True)
    y = torch.compile(lambda x: (x * 3).sin() + 1, backend="aot_eager")(x)
    mid = ops.compile_seconds()
    assert mid["total"] > before.get("total", 0.0) and mid["tracing"] > before.get("tracing", 0.0)
    y.sum().backward()  # AOT autograd compiles the backward graph now, counted in the total
    after = ops.compile_seconds()
    assert after["total"] - mid["total"] == pytest.approx(
        after.get("entire_backward_compile", 0.0) - mid.get("entire_backward_compile", 0.0))
    assert after["total"] > mid["total"]  # torch >= 2.11 compiles the backward graph lazily


# ----------------------------------------------------------------------------- stall watchdog
@pytest.mark.slow
def test_blocked_data_source_triggers_watchdog(tmp_path):
    timeout, code = 6.0, 75  # well above a CPU debug step (<1.5 s on a busy 2-core box)
    cmd = [sys.executable, "-m", "nsa_flex.titan.cli", "--job.config_file", str(CONFIG),
           "--job.dump_folder", str(tmp_path), "--training.steps", "6",
           "--experimental.custom_import", "tests.titan.ops_test_data", "--model.name", "nsa_flex_block",
           "--ops.stall_timeout_s", str(timeout), "--ops.stall_timeout_first_s", "120",
           "--ops.stall_exit_code", str(code)]
    p = subprocess.run(cmd, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=240)
    out = p.stdout + p.stderr
    assert p.returncode == code, out[-4000:]
    dump = tmp_path / "stalls" / "step-3-rank-0.txt"  # ops_test_data blocks the 3rd batch
    assert dump.exists(), (sorted(os.listdir(tmp_path)), out[-3000:])
    text = dump.read_text()
    frame = "tests/titan/ops_test_data.py"
    assert f"innermost project frame (main thread): {frame}:" in text and "in wait_for_data_forever" in text
    assert "--- Python thread stacks" in text and "--- memory (cpu) ---" in text
    assert "last completed: 2" in text
    idle = float(text.split("seconds since the last completed step (or start): ")[1].split()[0])
    # fired soon after the limit (the poll interval is < 1 s; slack for a loaded 2-core CI box);
    # the dump rounds to 0.1 s, so a fire just past the limit reads back as the limit itself
    assert timeout <= idle < timeout + 10.0, idle
    line = [l for l in out.splitlines() if "ops: STALL on rank 0" in l]
    assert len(line) == 1 and str(dump) in line[0] and "wait_for_data_forever" in line[0], out[-3000:]


# ----------------------------------------------------------------------------- preflight
def _preflight(*extra: str, timeout=240):
    cmd = [sys.executable, "-m", "nsa_flex.titan.cli", "--preflight", "--job.config_file", str(CONFIG), *extra]
    return subprocess.run(cmd, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_preflight_passes_on_debug_config(tmp_path):
    t0 = time.time()
    p = _preflight("--job.dump_folder", str(tmp_path / "dump"))
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    lines = p.stdout.splitlines()
    for name in ("config", "tokenizer", "dataset", "dump folder", "checkpoint", "long run", "device", "NSA layer"):
        assert any(l.startswith(f"[ ok ] {name}:") for l in lines), (name, p.stdout)
    assert "one batch input [4, 256] int64" in p.stdout
    assert "1 block forward+backward at [4, 256, 64]" in p.stdout and "first call" in p.stdout
    assert "PASS" in lines[-1] and "0 failed" in lines[-1]
    assert time.time() - t0 < 120
    assert not (tmp_path / "dump" / "metrics.jsonl").exists()  # it checked, it did not train


@pytest.mark.slow
def test_preflight_lists_every_problem(tmp_path):
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("x")  # a file where the dump folder should be: not writable as a folder
    p = _preflight("--nsa.d", "3", "--nsa.window", "0", "--ops.stall_timeout_s", "-1",
                   "--ops.data_wait_warn_share", "2", "--training.dataset", "nope", "--model.tokenizer", "nope",
                   "--job.dump_folder", str(blocker / "dump"), "--training.steps", "5000")
    out = p.stdout
    assert p.returncode == 1, out + p.stderr[-3000:]
    for problem in ("window=0", "d=3: the stride d must divide the compression block l", "ops.stall_timeout_s=-1",
                    "ops.data_wait_warn_share=2", "training.dataset='nope'", "unknown tokenizer 'nope'",
                    "is not writable", "5000 steps >= ops.long_run_steps=1000 without checkpoints"):
        assert problem in out, (problem, out)
    assert "[FAIL] config: 6 problem(s)" in out
    assert "[skip] NSA layer" in out and "[skip] dataset" in out
    assert out.splitlines()[-1].startswith("preflight: ") and "-> FAIL" in out.splitlines()[-1]


@pytest.mark.slow
def test_preflight_reports_resume_point_and_halt_file(tmp_path):
    ck = tmp_path / "checkpoint" / "step-20"
    ck.mkdir(parents=True)
    (ck / ".metadata").write_bytes(b"")  # complete marker, unreadable content
    (tmp_path / "checkpoint" / "step-30").mkdir()  # incomplete: no .metadata
    (tmp_path / "HALT").write_text("")
    p = _preflight("--job.dump_folder", str(tmp_path), "--checkpoint.enable")
    assert p.returncode == 1
    assert f"would resume from {ck}" in p.stdout, p.stdout
    assert "halt file" in p.stdout and "exists" in p.stdout
