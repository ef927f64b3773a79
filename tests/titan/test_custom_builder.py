"""Your own mask builder in a TOML run: ``[nsa] builder_modules`` imports the user's module (from
the working directory, as the ``nsa-train`` console script runs: no script directory on sys.path)
before the mask names are checked; the run prints and uses the builder."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nsa_flex.config import NSAConfig, NSAConfigError

ROOT = Path(__file__).resolve().parents[2]

USER_MODULE = '''
import os
from masks import register_mask_builder, sliding_window

def half_window(ctx):
    with open(os.path.join(os.environ["BUILDER_LOG_DIR"], "half_window_calls.txt"), "a") as f:
        f.write(f"{ctx.seq_len}\\n")
    return ctx.with_docs(sliding_window(max(1, ctx.cfg.window // 2)))

register_mask_builder("half_window", "token", half_window)
'''


def _env(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    # the project's packages alone, not its root: a user's own my_masks.py there (where the README
    # puts it) must not replace the test's module in the working directory
    packages = tmp_path / "packages"
    packages.mkdir(exist_ok=True)
    for name in ("nsa_flex", "masks"):
        if not (packages / name).exists():
            (packages / name).symlink_to(ROOT / name, target_is_directory=True)
    env["PYTHONPATH"] = str(packages)
    env["BUILDER_LOG_DIR"] = str(tmp_path)
    return env


def _toml(tmp_path) -> Path:
    text = (ROOT / "titan_configs" / "debug_nsa.toml").read_text()
    text = text.replace('masks = "nsa"', 'masks = "nsa"\nbuilder_modules = ["my_masks"]\nwin_mask = "half_window"')
    assert "builder_modules" in text
    path = tmp_path / "my_run.toml"
    path.write_text(text.replace("./outputs/debug_nsa", str(tmp_path / "out")))
    return path


def test_custom_builder_in_a_toml_run(tmp_path):
    (tmp_path / "my_masks.py").write_text(USER_MODULE)
    toml = _toml(tmp_path)
    # -P: no working directory / script directory on sys.path, as for the nsa-train console script
    r = subprocess.run([sys.executable, "-P", "-m", "nsa_flex.titan.cli", "--job.config_file", str(toml),
                        "--training.steps", "2"], cwd=tmp_path, env=_env(tmp_path), capture_output=True,
                       text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "masks: cmp=compressed_causal sel=topn win=half_window (preset nsa, modules my_masks)" in out
    calls = (tmp_path / "half_window_calls.txt").read_text().split()
    # the registration's causality check (T=19, twice), then at the run's seq_len: a window mask
    # is the same in every layer and, without documents, every step (the model builds it once,
    # nsa_flex.layer.StepMasks)
    assert calls.count("256") >= 1 and set(calls) == {"19", "256"}, calls


def test_custom_builder_preflight_sees_the_module(tmp_path):
    (tmp_path / "my_masks.py").write_text(USER_MODULE)
    toml = _toml(tmp_path)
    r = subprocess.run([sys.executable, "-P", "-m", "nsa_flex.titan.cli", "--preflight", "--job.config_file",
                        str(toml)], cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert "[ ok ] config: valid" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
    assert r.returncode == 0, r.stdout[-3000:]
    assert "Warning" not in r.stdout + r.stderr, r.stderr[-2000:]  # torchdata's set_vital one included


def test_missing_builder_module_is_one_message(tmp_path):
    toml = _toml(tmp_path)  # no my_masks.py in the working directory
    r = subprocess.run([sys.executable, "-P", "-m", "nsa_flex.titan.cli", "--job.config_file", str(toml),
                        "--training.steps", "1"], cwd=tmp_path, env=_env(tmp_path), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "builder_modules=['my_masks']: no module 'my_masks' in the working directory" in r.stderr
    assert "Traceback" not in r.stderr


def test_builder_module_in_nsaconfig(tmp_path, monkeypatch):
    (tmp_path / "my_masks_cfg.py").write_text(USER_MODULE.replace('"half_window"', '"half_window_cfg"'))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("BUILDER_LOG_DIR", str(tmp_path))
    for name in ("my_masks_cfg", "broken_masks"):
        monkeypatch.delitem(sys.modules, name, raising=False)  # removed again after the test
    with pytest.raises(NSAConfigError, match="win_mask='half_window_cfg'"):
        NSAConfig(win_mask="half_window_cfg")  # not imported: unknown name
    cfg = NSAConfig(builder_modules=["my_masks_cfg"], win_mask="half_window_cfg")
    assert cfg.builder_modules == ("my_masks_cfg",)
    assert cfg.branch_masks()["win"] == "half_window_cfg"
    (tmp_path / "broken_masks.py").write_text("raise RuntimeError('oops')\n")
    with pytest.raises(NSAConfigError, match=r"builder module 'broken_masks' fails to import: RuntimeError: oops"):
        NSAConfig(builder_modules=("broken_masks",))
