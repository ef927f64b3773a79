"""nsa-train's user errors: one short message on stderr, exit code 2, no traceback."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "titan_configs" / "debug_nsa.toml"


def _nsa_train(*args, cwd=ROOT):
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "nsa_flex.titan.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def _typo_config(tmp_path):
    p = tmp_path / "typo.toml"
    p.write_text(CONFIG.read_text().replace('masks = "nsa"', 'masks = "nsa"\nwindw = 3'))
    return p


def _broken_config(tmp_path):
    p = tmp_path / "broken.toml"
    p.write_text("[job\ndump_folder = 'x'\n")
    return p


CASES = {
    "bad value": (lambda t: ["--nsa.window", "-3"],
                  "nsa-train: error: invalid NSA settings:\n  - [nsa] window=-3: must be a positive integer"),
    "unknown flavor": (lambda t: ["--model.flavor", "7B"],
                       "nsa-train: error: [model] flavor='7B': unknown nsa_flex flavor; allowed values are "
                       "['125M', '1B', '30M', '30M_kv4', '350M', 'debugmodel']"),
    "unknown field": (lambda t: ["--job.config_file", str(_typo_config(t))],
                      "nsa-train: error: [nsa] unknown field(s) {'windw'}; valid fields: backend, builder_modules, cmp_kernel, cmp_mask"),
    "toml syntax": (lambda t: ["--job.config_file", str(_broken_config(t))], "TOML syntax error: Expected ']'"),
    "missing config": (lambda t: ["--job.config_file", str(t / "nope.toml")], "nope.toml' does not exist"),
}


def test_values_torch_or_torchtitan_reject_raw_are_user_errors(tmp_path, capsys):
    """Checked before torchtitan starts (nsa_flex.titan.train.run): one line, exit 2."""
    from nsa_flex.titan.train import run

    for args, msg in ((["--optimizer.lr", "-1"], "optimizer.lr=-1.0: must be a number >= 0"),
                      (["--checkpoint.enable", "--checkpoint.interval", "0"],
                       "checkpoint.interval=0: must be an integer >= 1"),
                      (["--job.config_file", str(tmp_path / "b.toml")], "--job.config_file given 2 times")):
        assert run(["--job.config_file", str(CONFIG), "--job.dump_folder", str(tmp_path / "d"), *args]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [f"nsa-train: error: {msg}" + (
            f" ('{CONFIG}', '{tmp_path / 'b.toml'}'): give one config file, and change its values with "
            "--section.field options" if "config_file" in msg else "")]


def test_bool_options_take_true_and_false():
    """``--section.field true|false`` of a boolean field (torchtitan's parser takes only the bare
    flag and ``--section.no_field``)."""
    from torchtitan.config import ConfigManager

    from nsa_flex.titan.train import bool_flags

    base = ["--job.custom_config_module", "nsa_flex.titan.job_config"]
    for args, want in ((["--training.skip_bad_records", "true"], (True, False)),
                       (["--training.skip_bad_records=True", "--checkpoint.enable", "false"], (True, False)),
                       (["--training.skip_bad_records", "false", "--checkpoint.enable=true"], (False, True)),
                       (["--training.skip_bad_records", "--checkpoint.enable"], (True, True))):
        jc = ConfigManager().parse_args(bool_flags(base + args))
        assert (jc.training.skip_bad_records, jc.checkpoint.enable) == want, args
    assert bool_flags(["--job.description", "true"]) == ["--job.description", "true"]  # a string field


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_user_errors_are_one_message_exit_2(tmp_path, case):
    args, expected = CASES[case]
    p = _nsa_train(*args(tmp_path), "--training.steps", "1", "--job.dump_folder", str(tmp_path / "out"))
    out = p.stdout + p.stderr
    assert p.returncode == 2, out[-3000:]
    assert expected in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in out and "run_train.sh" not in out
    assert len(p.stderr.strip().splitlines()) <= 3, p.stderr


def test_unknown_flag_is_one_line(capsys):
    from nsa_flex.titan.train import run, unknown_flag

    code = run(["--job.config_file", str(CONFIG), "--nsa.bogus", "3"])  # refused before torchtitan parses
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("nsa-train: error: unknown option '--nsa.bogus': [nsa] has no field 'bogus'; "
                          "valid fields: backend, builder_modules,"), err
    assert "no section [bogus]; sections: activation_checkpoint," in unknown_flag(["--bogus.steps=3"])
    assert unknown_flag(["--job.config-file", "x.toml", "--compile.no-enable", "--training.steps=3",
                         "--parallelism.data_parallel_shard_degree", "-1"]) is None


def test_unknown_flavor_is_refused_before_torchtitan_starts(tmp_path, capsys, monkeypatch):
    from nsa_flex.titan import train

    def started(*a):
        raise AssertionError("torchtitan's main started (and logged) before the refusal")

    monkeypatch.setattr(train, "titan_main", started)
    code = train.run(["--job.config_file", str(CONFIG), "--model.flavor", "7B", "--job.dump_folder", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("nsa-train: error: [model] flavor='7B': unknown nsa_flex flavor"), err
    assert not (tmp_path / "metrics.jsonl").exists()
