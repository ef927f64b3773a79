"""Shared by the titan tests that launch a training process."""

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def launch_env() -> dict:
    """The environment of a fresh single-process run: no inherited rank variables, the project
    root first on PYTHONPATH (so `tests.titan.ops_test_data` imports), one intra-op thread: the
    exact-resume tests compare the losses of two processes bit for bit, and with several threads
    MKL's split of a product can differ from process to process on a busy machine (the suite runs
    two test files side by side)."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = "1"
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


@contextlib.contextmanager
def tmpfs(folder: Path, size: str):
    """A real small filesystem at ``folder`` (``mount -t tmpfs``), for disk-full faults; the test
    skips where it cannot be mounted (not root, no mount command, a container without the right)."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                           capture_output=True, text=True, timeout=30)
    except OSError as e:
        pytest.skip(f"cannot mount a tmpfs for a disk-full fault: {e}")
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs for a disk-full fault (needs root): {r.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True, timeout=30)


def fill(folder: Path) -> None:
    """Fill the filesystem of ``folder`` to the last byte (``folder/filler``)."""
    fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        for chunk in (b"\0" * 65536, b"\0" * 512, b"\0"):
            try:
                while True:
                    os.write(fd, chunk)
            except OSError:
                pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def running(cmd: list[str], log: Path):
    """A training process started from the project root (output to ``log``), killed if still
    running when the block ends."""
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, cwd=ROOT, env=launch_env(), stdout=f, stderr=subprocess.STDOUT)
        try:
            yield p
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()


def built_once(tmp_path_factory, name: str, build) -> Path:
    """A folder made by ``build(folder)`` once per test session, also when pytest-xdist's workers
    both run tests that need it (``--dist worksteal`` spreads a module's tests over the workers,
    and each would build its module fixtures again): the first worker builds it under a file lock,
    the others wait for it and read it. Tests must treat the folder as read-only."""
    import fcntl

    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run:  # one process: nothing to share
        folder = tmp_path_factory.mktemp(name)
        build(folder)
        return folder
    root = tmp_path_factory.getbasetemp().parent / f"built-once-{run}"  # the workers' common parent
    root.mkdir(exist_ok=True)
    folder = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (folder / ".built").exists():
            shutil.rmtree(folder, ignore_errors=True)  # a build that failed on another worker
            folder.mkdir()
            build(folder)
            (folder / ".built").write_text("")
    return folder


DEBUG_CONFIG = ROOT / "titan_configs" / "debug_nsa.toml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_debug_trainer(args: list[str], log: Path, procs: int = 1) -> None:
    """debug_nsa.toml's run with `args` (`nsa-train` in one process, torchrun for several), its
    console in `log`; asserts that it ends with exit code 0."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}",
                 f"--master_port={free_port()}", "-m", "nsa_flex.titan.train"] if procs > 1
                else [sys.executable, "-m", "nsa_flex.titan.cli"])
    with open(log, "w") as f:
        p = subprocess.run([*launcher, "--job.config_file", str(DEBUG_CONFIG), *args], cwd=ROOT,
                           env=launch_env(), stdout=f, stderr=subprocess.STDOUT, timeout=300)
    assert p.returncode == 0, log.read_text()[-4000:]


def metrics_by_step(path: Path, key: str) -> dict[int, dict]:
    """The records of metrics.jsonl that hold `key`, by step."""
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    return {rec["step"]: rec for rec in recs if key in rec}


def seed_checkpoint(folder: Path, *args: str) -> Path:
    """A seed checkpoint of debug_nsa.toml's model (with `args`) in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    run_debug_trainer(["--job.dump_folder", str(folder), "--training.steps", "1", "--checkpoint.enable",
                       "--checkpoint.create_seed_checkpoint", *args], folder / "seed.log")
    return folder / "checkpoint" / "step-0"
