"""One error style for every entry point: a user error is one line ``prog: error: ...`` on
stderr, exit code 2, no traceback; ``prog`` is the command that runs it (``nsa-train`` is
tested in tests/titan/test_cli_errors.py)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "titan_configs" / "debug_nsa.toml")


def _run(module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})


def _one_error_line(r: subprocess.CompletedProcess, prog: str, says: str) -> None:
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith(f"{prog}: error: "), r.stderr[-2000:]
    assert says in r.stderr, r.stderr[-2000:]


def test_generate_user_errors(tmp_path, capsys):
    r = _run("nsa_flex.generate", "--config", "nope.toml", "--checkpoint", "c", "--prompt", "x", cwd=tmp_path)
    _one_error_line(r, "python -m nsa_flex.generate", "--config 'nope.toml': no such file")
    from nsa_flex.apps.generate import main  # the same entry point in this process, for the others

    for args, says in ((["--config", CONFIG, "--checkpoint", str(tmp_path), "--prompt", "x"],
                        f"python -m nsa_flex.generate: error: --checkpoint '{tmp_path}': neither a DCP"),
                       (["--config", CONFIG], "usage: python -m nsa_flex.generate ")):
        with pytest.raises(SystemExit) as e:
            main(args)
        err = capsys.readouterr().err
        assert e.value.code == 2 and says in err and "Traceback" not in err, err


@pytest.mark.parametrize("args, says", [
    ([], "--out is required"),
    (["--task", "bogus"], "--task: 'bogus' not in"),
])
def test_eval_user_errors(tmp_path, args, says):
    _one_error_line(_run("nsa_flex.eval", *args, cwd=tmp_path), "python -m nsa_flex.eval", says)


def test_eval_task_errors_share_the_style(tmp_path, capsys):
    from nsa_flex.apps.eval.__main__ import main

    code = main(["--task", "selection", "--quick", "--out", str(tmp_path), "--docs", "nope.parquet"])
    err = capsys.readouterr().err
    assert code == 2 and err == "python -m nsa_flex.eval: error: --docs 'nope.parquet': no such file\n"


def test_plot_user_error(tmp_path):
    _one_error_line(_run("nsa_flex.plot", "nothing", cwd=tmp_path), "python -m nsa_flex.plot", "no metrics.jsonl")
