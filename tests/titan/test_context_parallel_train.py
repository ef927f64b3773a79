"""End-to-end context parallelism on the CPU (issue 42): `nsa-train` on debug_nsa.toml with
`[parallelism] context_parallel_degree = 2` on two torchrun processes (gloo; FSDP over the two
context ranks) gives the one-process run's losses and grad norms, and its validation loss and
retrieval metrics, both runs starting from one seed checkpoint (a sharded init draws other random
numbers than one process). Plus the config rules: what cannot be combined with context
parallelism is refused naming the field."""

import json
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from nsa_flex.titan.args import parallelism_problems
from tests.titan.helpers import launch_env

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "titan_configs" / "debug_nsa.toml"
STEPS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(args: list[str], log: Path, procs: int = 1) -> None:
    launcher = ([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}",
                 f"--master_port={_free_port()}", "-m", "nsa_flex.titan.train"] if procs > 1
                else [sys.executable, "-m", "nsa_flex.titan.cli"])
    with open(log, "w") as f:
        p = subprocess.run([*launcher, "--job.config_file", str(CONFIG), *args], cwd=ROOT,
                           env=launch_env(), stdout=f, stderr=subprocess.STDOUT, timeout=300)
    assert p.returncode == 0, log.read_text()[-4000:]


def _records(path: Path, key: str) -> dict[int, dict]:
    """The records of metrics.jsonl that hold `key`, by step."""
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    return {rec["step"]: rec for rec in recs if key in rec}


@pytest.fixture(scope="module")
def seed(tmp_path_factory) -> Path:
    """A seed checkpoint of debug_nsa.toml's model, the start of every run here."""
    folder = tmp_path_factory.mktemp("seed")
    _run(["--job.dump_folder", str(folder), "--training.steps", "1", "--checkpoint.enable",
          "--checkpoint.create_seed_checkpoint"], folder / "seed.log")
    return folder / "checkpoint" / "step-0"


def _one_and_cp(tmp_path: Path, seed: Path, steps: int, *args: str) -> tuple[Path, Path]:
    """metrics.jsonl of one process and of two context ranks, the same run from `seed`."""
    common = ["--training.steps", str(steps), "--metrics.log_freq", "1", "--checkpoint.enable",
              "--checkpoint.initial_load_path", str(seed), "--checkpoint.initial_load_model_only",
              "--checkpoint.interval", "1000", *args]
    _run(["--job.dump_folder", str(tmp_path / "one"), *common], tmp_path / "one.log")
    _run(["--job.dump_folder", str(tmp_path / "cp"), *common,
          "--parallelism.context_parallel_degree", "2",
          "--parallelism.data_parallel_shard_degree", "1"], tmp_path / "cp.log", procs=2)
    return tmp_path / "one" / "metrics.jsonl", tmp_path / "cp" / "metrics.jsonl"


@pytest.mark.slow
def test_two_context_ranks_train_as_one_process(tmp_path, seed):
    one, cp = _one_and_cp(tmp_path, seed, STEPS, "--nsa.doc_masking", "True")
    key = "loss_metrics/global_avg_loss"
    one, cp = _records(one, key), _records(cp, key)
    assert sorted(one) == sorted(cp) == list(range(1, STEPS + 1))
    for step in one:
        got, want = (cp[step][key], cp[step]["grad_norm"]), (one[step][key], one[step]["grad_norm"])
        assert got == pytest.approx(want, rel=2e-5), step


@pytest.mark.slow
def test_two_context_ranks_validate_as_one_process(tmp_path, seed):
    """Validation at steps 1 and 2: the loss of two batches of two rows, each rank its shard,
    and the retrieval metrics of three documents (a padded batch; the answers on the last rank)."""
    one, cp = _one_and_cp(tmp_path, seed, 2, "--nsa.doc_masking", "True", "--validation.enable",
                          "--validation.freq", "2", "--validation.steps", "2",
                          "--validation.local_batch_size", "2", "--validation.seq_len", "256",
                          "--validation.retrieval_docs", "3")
    key = "validation_metrics/loss"
    one, cp = _records(one, key), _records(cp, key)
    assert sorted(one) == sorted(cp) == [1, 2]
    for step in one:
        names = [k for k in one[step] if k == key or k.startswith("retrieval/")]
        assert "retrieval/passkey_answer_loss" in names and "retrieval/passkey_exact" in names
        assert sorted(k for k in cp[step] if k == key or k.startswith("retrieval/")) == sorted(names)
        for k in names:
            assert cp[step][k] == pytest.approx(one[step][k], rel=1e-5, abs=1e-6), (step, k)


def _par(cp=1, tp=1, pp=1):
    return SimpleNamespace(context_parallel_degree=cp, tensor_parallel_degree=tp,
                           pipeline_parallel_degree=pp)


def _val(enable=False, seq_len=2048):
    return SimpleNamespace(enable=enable, seq_len=seq_len)


def test_context_parallel_rules_name_the_field():
    assert parallelism_problems(_par(cp=2), 4096, 64, _val()) == []
    (msg,) = parallelism_problems(_par(cp=2), 4096 + 64, 64, _val())
    assert "training.seq_len=4160" in msg and "multiple of" in msg and "128" in msg
    assert parallelism_problems(_par(cp=2), 4096, 64, _val(True, 2048)) == []
    (msg,) = parallelism_problems(_par(cp=2), 4096, 64, _val(True, 2048 + 64))
    assert "validation.seq_len=2112" in msg and "multiple of" in msg and "128" in msg
    assert parallelism_problems(_par(cp=2), 4096, 64, _val(False, 2048 + 64)) == []
    (msg,) = parallelism_problems(_par(tp=2), 4096, 64, _val())
    assert "parallelism.tensor_parallel_degree=2" in msg and "allowed: 1" in msg
    (msg,) = parallelism_problems(_par(pp=2), 4096, 64, _val())
    assert "parallelism.pipeline_parallel_degree=2" in msg


def test_preflight_estimates_a_shard_per_rank():
    import copy

    from nsa_flex.titan import estimate as est
    from nsa_flex.titan.args import nsa_flex_args

    args = copy.deepcopy(nsa_flex_args["125M"])
    args.vocab_size = 50304
    one = est.training_bytes(args, 160_000_000, 1, 65536, 2, "full", 1)
    two = est.training_bytes(args, 160_000_000, 1, 131072, 2, "full", 2, cp=2)
    # twice the sequence on two ranks: about one rank's activations and logits at half of it,
    # plus the all-gathered k, v; the states sharded over both
    assert two["logits"] == one["logits"]
    assert one["activations"] < two["activations"] < 1.2 * one["activations"]
    assert two["states"] == one["states"] / 2
