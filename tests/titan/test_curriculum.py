"""Short-then-long training from one TOML ([curriculum], nsa_flex/titan/curriculum.py): each
phase's flags, the errors, and (slow) the two phases end to end on the CPU: the long phase starts
from the short phase's weights, both log retrieval at validation, and the same command resumes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tests.titan.helpers import launch_env

from nsa_flex.errors import UserError
from nsa_flex.titan import curriculum

ROOT = Path(__file__).resolve().parents[2]
DEBUG = (ROOT / "titan_configs" / "debug_nsa.toml").read_text()


def _toml(tmp_path, short='["training.seq_len=192", "training.steps=3", "validation.seq_len=192"]'):
    text = DEBUG.replace('dump_folder = "./outputs/debug_nsa"', f'dump_folder = "{tmp_path / "run"}"')
    text = text.replace("steps = 50", "steps = 3")
    text += ("\n[validation]\nenable = true\ndataset = \"passkey\"\nseq_len = 256\nlocal_batch_size = 4\n"
             f"freq = 3\nsteps = 1\nretrieval_docs = 4\nretrieval_recall_docs = 4\n\n[curriculum]\nshort = {short}\n")
    path = tmp_path / "cur.toml"
    path.write_text(text)
    return str(path)


def test_phase_flags_and_errors(tmp_path):
    cfg = _toml(tmp_path)
    base = ["--job.config_file", cfg]
    assert curriculum.wants_driver(base)
    assert not curriculum.wants_driver(base + ["--curriculum.phase", "short"])
    assert not curriculum.wants_driver(["--job.config_file", str(ROOT / "titan_configs" / "debug_nsa.toml")])
    assert curriculum.phase_args(base) == base
    short = curriculum.phase_args(base + ["--curriculum.phase", "short"])
    assert short[short.index("--job.dump_folder") + 1] == str(tmp_path / "run" / "short")
    assert short[-3:] == ["--training.seq_len=192", "--training.steps=3", "--validation.seq_len=192"]
    assert "--checkpoint.enable" in short
    with pytest.raises(UserError, match=r"short phase has not finished .*has no step-3"):
        curriculum.phase_args(base + ["--curriculum.phase", "long"])
    (tmp_path / "run" / "short" / "checkpoint" / "step-3").mkdir(parents=True)
    long = curriculum.phase_args(base + ["--curriculum.phase=long"])
    assert long[-2:] == ["--checkpoint.initial_load_path", str(tmp_path / "run" / "short" / "checkpoint" / "step-3")]
    assert "--checkpoint.enable" in long and "--job.dump_folder" not in long
    with pytest.raises(UserError, match=r"curriculum.phase='mid': must be one of short, long"):
        curriculum.phase_args(base + ["--curriculum.phase", "mid"])
    with pytest.raises(UserError, match=r"curriculum.short\[1\]='seq 2048': must look like section.field=value"):
        curriculum.short_items(["training.seq_len=2048", "seq 2048"])
    assert curriculum.short_items(["validation.enable", "training.no-x"]) == ["--validation.enable", "--training.no-x"]


def test_bad_item_is_one_line_from_nsa_train(tmp_path):
    cfg = _toml(tmp_path, short='["training.seq_len 192"]')
    p = subprocess.run([sys.executable, "-m", "nsa_flex.titan.cli", "--job.config_file", cfg], cwd=ROOT,
                       env=launch_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("nsa-train: error: curriculum.short[0]=")


@pytest.mark.slow
def test_two_phases_end_to_end_and_resume(tmp_path):
    cfg = _toml(tmp_path)
    cmd = [sys.executable, "-m", "nsa_flex.titan.cli", "--job.config_file", cfg]
    p = subprocess.run(cmd, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    run = tmp_path / "run"
    short_ck = run / "short" / "checkpoint" / "step-3"
    assert short_ck.is_dir() and (run / "checkpoint" / "step-3").is_dir()
    assert f"Loading the checkpoint from {short_ck}" in out
    recs = lambda f: [json.loads(x) for x in f.read_text().splitlines()]  # noqa: E731
    short, long = recs(run / "short" / "metrics.jsonl"), recs(run / "metrics.jsonl")
    first = lambda rs: next(r["loss_metrics/global_avg_loss"] for r in rs if "loss_metrics/global_avg_loss" in r)  # noqa: E731
    assert first(long) < first(short) - 0.2  # the long phase starts from trained weights
    for rs in (short, long):  # the selection's recall of far needles beside (retrieval_recall_docs)
        assert any("retrieval/passkey_answer_loss" in r and 0 <= r["retrieval/passkey_sel_recall"] <= 1
                   for r in rs)
    again = subprocess.run(cmd, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "curriculum: short phase done" in again.stdout


def test_command_line_fields_the_short_phase_sets_again_are_named(tmp_path, capsys):
    """The short phase's items come after the command line (they define the phase): a field both
    set is named in a warning, so --training.steps 100 does not silently run the items' steps."""
    base = ["--job.config_file", _toml(tmp_path), "--training.steps", "100", "--training.seq-len=64",
            "--debug.seed", "1"]
    curriculum.phase_args(base + ["--curriculum.phase", "short"])
    err = capsys.readouterr().err
    assert "sets training.seq_len, training.steps;" in err and "long phase only" in err
    assert "debug.seed" not in err
    (tmp_path / "run" / "short" / "checkpoint" / "step-3").mkdir(parents=True)
    curriculum.phase_args(base + ["--curriculum.phase", "long"])
    assert capsys.readouterr().err == ""
    assert curriculum.shadowed_flags(["--compile.no-enable"], ["--compile.enable"]) == ["compile.enable"]


TIKTOKEN_CACHE = ROOT.parent / "shared" / "data" / "tiktoken_cache"


@pytest.mark.skipif(not TIKTOKEN_CACHE.is_dir(), reason=f"needs the gpt2 tokenizer's cache at {TIKTOKEN_CACHE}")
def test_shipped_curriculum_short_phase_draws_its_documents(monkeypatch):
    """titan_configs/quality_curriculum.toml's short phase as the trainer reads it: the gate's recipe
    (indexer top-n after a dense warm-up; in half of the single-key documents every answer >= 512
    tokens after its key's earlier copy, in the others anywhere) and a first batch of its documents
    that fits seq_len with that gap (a layout that does not fit is an error at the first batch,
    after the model is built)."""
    from torchtitan.config import ConfigManager

    from nsa_flex.titan.data import build_dataloader
    from nsa_flex.titan.tokenizer import build_tokenizer_from_name

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(TIKTOKEN_CACHE))
    toml = str(ROOT / "titan_configs" / "quality_curriculum.toml")
    job = ConfigManager().parse_args(curriculum.phase_args(["--job.config_file", toml, "--curriculum.phase", "short"]))
    long = ConfigManager().parse_args(curriculum.phase_args(["--job.config_file", toml]))
    assert (job.nsa.sel_scores, job.nsa.sel_distill, job.nsa.sel_dense_steps) == ("indexer", 1.0, 3500)
    assert (long.nsa.sel_scores, long.nsa.sel_dense_steps, long.training.passkey_min_gap) == ("indexer", None, 0)
    assert (job.training.passkey_min_gap, job.training.passkey_questions, job.training.seq_len) == (512, 3, 2048)
    assert job.training.passkey_min_gap_share == 0.5
    tok = build_tokenizer_from_name("gpt2")
    batch, _ = next(iter(build_dataloader(1, 0, tok, job)))
    assert batch["input"].shape == (16, 2048)
    smallest = []  # each single-key document's smallest gap
    for row in batch["input"].tolist():
        text = tok.decode(row)
        if "What is the pass key? The pass key is:" in text:  # a single-key document
            key = text.split("The pass key is: ")[1][:5]
            copies = [i for i in range(len(text)) if text.startswith(f": {key}", i)]
            smallest.append(min(len(tok.encode(text[a:b])) for a, b in zip(copies[1:], copies[2:])))
    assert min(smallest) < 512 <= max(smallest), smallest
