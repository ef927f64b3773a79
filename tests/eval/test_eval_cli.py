"""The options the evaluation tasks share: one parser helper and one resolution of --quick."""

import pytest

from nsa_flex.apps.eval import needle, position_loss, selection_stats
from nsa_flex.apps.eval.cli import DEFAULT_CONFIG, DEFAULT_DOCS, resolve_common
from nsa_flex.apps.eval.prompts import EvalError

TASKS = (needle, position_loss, selection_stats)


@pytest.mark.parametrize("task", TASKS)
def test_quick_resolves_shared_defaults(task):
    a = task.parse_args(["--quick", "--out", "o"])
    assert (a.config, a.device, a.random_init, a.dtype, a.backend, a.seed, a.override) == \
        (DEFAULT_CONFIG, "cpu", True, "float32", "auto", 0, [])
    a = task.parse_args(["--quick", "--out", "o", "--checkpoint", "ck", "--device", "meta", "--seed", "3",
                         "--override=--nsa.window=8"])
    assert (a.random_init, a.device, a.seed, a.override) == (False, "meta", 3, ["--nsa.window=8"])


@pytest.mark.parametrize("task", TASKS)
def test_out_and_config_required(task):
    with pytest.raises(EvalError, match="--out is required"):
        task.parse_args(["--quick"])
    with pytest.raises(EvalError, match=r"--config is required \(or --quick\)"):
        task.parse_args(["--out", "o"])


def test_task_defaults_with_and_without_quick():
    assert position_loss.parse_args(["--quick", "--out", "o"]).seq_len == 256
    assert position_loss.parse_args(["--quick", "--out", "o"]).max_docs == 4
    a = position_loss.parse_args(["--config", "c.toml", "--out", "o"])
    assert (a.seq_len, a.max_docs, a.random_init, a.docs) == (16384, 16, False, DEFAULT_DOCS)
    assert selection_stats.parse_args(["--quick", "--out", "o"]).lengths == "256"
    assert selection_stats.parse_args(["--config", "c.toml", "--out", "o"]).lengths == "32768,65536"
    a = needle.parse_args(["--quick", "--out", "o"])
    assert (a.lengths, a.depths, a.trials, a.n_keys) == ("256,512", "0,50,100", 1, 2)
    a = needle.parse_args(["--config", "c.toml", "--out", "o", "--device", "cpu"])
    assert (a.trials, a.n_keys, a.depths.split(",")[-1], a.device) == (2, 4, "100", "cpu")
    assert needle.parse_args(["--collect", "d"]).collect == "d"  # no --out needed to collect


def test_resolve_common_fills_in_place():
    import argparse

    a = argparse.Namespace(out="o", quick=False, config="c.toml", checkpoint=None, random_init=False, device="cpu")
    assert resolve_common(a) is a and (a.config, a.device, a.random_init) == ("c.toml", "cpu", False)
