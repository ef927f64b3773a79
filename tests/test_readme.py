"""The README's snippets run as written: the layer example (forward + backward, on the CPU
through backend "auto"), the quick-start training command followed by the generate example and the
plot command, your own mask builder in a run (the module and the TOML lines as printed), and the
test command that CI runs."""

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _block(after: str, lang: str) -> str:
    """The first ```lang block after the heading / text ``after``."""
    i = README.index(after)
    m = re.compile(rf"```{lang}\n(.*?)```", re.S).search(README, i)
    return m.group(1)


def test_readme_stays_short():
    assert len(README.splitlines()) <= 250


def test_layer_example_runs_as_written():
    code = _block("## The NSA layer and its masks", "python")
    assert "NSAAttention(NSAConfig())" in code and "backward()" in code
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 (the README's own code)
    x, y = scope["x"], scope["y"]
    assert y.shape == x.shape and torch.isfinite(y).all()
    assert all(p.grad is not None for p in scope["layer"].parameters())


def _shell(line: str) -> list[str]:
    """A README command line -> argv, with `nsa-train` / `python` as this interpreter."""
    argv = shlex.split(line)
    if argv[0] == "nsa-train":
        return [sys.executable, "-m", "nsa_flex.titan.cli", *argv[1:]]
    assert argv[0] == "python", line
    return [sys.executable, *argv[1:]]


def test_quick_start_then_generate_run_as_written(tmp_path):
    quick = _block("## Quick start", "bash").strip().split(" && ")[-1]
    assert quick == "nsa-train --job.config_file titan_configs/debug_nsa.toml"
    lines = [l for l in _block("## Inference", "bash").strip().splitlines() if l.strip()]
    assert lines[0] == quick + " --checkpoint.enable", lines
    shutil.copytree(ROOT / "titan_configs", tmp_path / "titan_configs")  # a fresh clone's layout
    env = _env()
    train = subprocess.run(_shell(lines[0]), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert train.returncode == 0, (train.stdout + train.stderr)[-3000:]
    assert (tmp_path / "outputs" / "debug_nsa" / "checkpoint" / "step-50" / ".metadata").is_file()
    gen = subprocess.run(_shell(lines[1]), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert gen.returncode == 0, (gen.stdout + gen.stderr)[-3000:]
    assert "--- prompt: 'The pass key is'" in gen.stdout and "step-50" in gen.stdout
    assert "needs a GPU" not in gen.stdout + gen.stderr and "switching to backend" not in gen.stdout + gen.stderr
    assert "# warm-up " in gen.stderr and "Warning" not in gen.stderr, gen.stderr[-2000:]
    # the plot command of the quick start's "Then:" line, on this run
    plot_cmd = re.search(r"`(python -m nsa_flex\.plot outputs/debug_nsa -o debug\.png)`", README).group(1)
    plot = subprocess.run(_shell(plot_cmd), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert plot.returncode == 0, plot.stderr[-2000:]
    assert (tmp_path / "debug.png").is_file() and "loss, tokens/s, memory" in plot.stdout


def test_own_builder_in_a_run_as_written(tmp_path):
    section = README[README.index("**Your own builder in a training run:**"):]
    module = re.search(r"```python\n# (\w+)\.py[^\n]*\n(.*?)```", section, re.S)
    toml_lines = re.search(r"```toml\n(.*?)```", section, re.S).group(1)
    summary = re.search(r"`(masks: cmp=[^`]*)`", section.replace("\n", " ")).group(1)
    (tmp_path / f"{module.group(1)}.py").write_text(module.group(2))
    config = (ROOT / "titan_configs" / "debug_nsa.toml").read_text()
    config = config.replace("[nsa]\n", toml_lines.strip() + "\n", 1)
    assert toml_lines.strip().splitlines()[1] in config
    (tmp_path / "run.toml").write_text(config)
    run = subprocess.run([sys.executable, "-P", "-m", "nsa_flex.titan.cli", "--job.config_file", "run.toml",
                          "--training.steps", "2", "--job.dump_folder", str(tmp_path / "out")],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    assert summary in run.stdout + run.stderr, summary


def test_ci_runs_the_readme_test_command():
    tests = _block("Tests (see", "bash").strip()
    install, command = tests.rsplit(" && ", 1)
    ci = (ROOT / ".ci" / "run").read_text()
    assert ci.rstrip().splitlines()[-1] == command
    assert f"`{command}`" in README[README.index("## Tests"):]
    # the whole suite (slow tests included), with the slowest tests listed at the end
    assert command.startswith("python -m pytest ") and " -m " not in command[len("python -m "):]
    assert "--durations" in command and command.endswith(" tests")
