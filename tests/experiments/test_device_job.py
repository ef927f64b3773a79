"""experiments/device_job.sh, the long job across device calls, run here on a tiny tree: a side
command started beside a running job leaves its output and exit status in the job's output, which
the next poll prints and returns in job.tgz."""

import os
import subprocess
import tarfile

from tests.experiments.scripts import ROOT

SCRIPT = ROOT / "experiments" / "device_job.sh"


def _run(args, tree, env):
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=120)


def test_side_command_output_comes_back_with_the_next_poll(tmp_path):
    tree, out = tmp_path / "tree", tmp_path / "out"
    tree.mkdir()
    (tree / "hello.txt").write_text("hi\n")
    env = {**os.environ, "JOB_DIR": str(tmp_path / "job"), "OUT": str(out)}
    refused = _run(["side", "echo early"], tree, env)
    assert refused.returncode == 4 and "no job on this machine" in refused.stderr
    started = _run(["start", "1", "sleep 4; cat hello.txt > $JOB_OUT/main.txt"], tree, env)
    assert "== job: running" in started.stdout, started.stdout + started.stderr
    side = _run(["side", "echo side-ran; exit 3"], tree, env)
    assert side.returncode == 0 and "side 1 started" in side.stdout
    polled = _run(["poll", "60"], tree, env)
    assert "== job: ended, rc 0" in polled.stdout, polled.stdout + polled.stderr
    assert "side-ran" in polled.stdout and "side 1: rc 3" in polled.stdout
    with tarfile.open(out / "job.tgz") as t:
        log = t.extractfile("out/side-1.log").read().decode()
        main = t.extractfile("out/main.txt").read().decode()
    assert log.splitlines() == ["side 1: echo side-ran; exit 3", "side-ran", "side 1: rc 3"]
    assert main == "hi\n"
