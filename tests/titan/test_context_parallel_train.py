"""End-to-end context parallelism on the CPU (issue 42): `nsa-train` on debug_nsa.toml with
`[parallelism] context_parallel_degree = 2` on two torchrun processes (gloo; FSDP over the two
context ranks) gives the one-process run's losses and grad norms, and its validation loss and
retrieval metrics, both runs starting from one seed checkpoint (a sharded init draws other random
numbers than one process). Plus the config rules: what cannot be combined with context
parallelism is refused naming the field.

The full-attention baseline ("nsa_flex_llama3", `nsa_flex.titan.llama3_baseline`): it trains in
one CPU process; the trainer and the validator shard its inputs as torchtitan does (ours for the
NSA model); its two context ranks (torchtitan's SDPA ring attention, which has no CPU kernel: two
GPUs, `gpu`) give the one-process losses.
"""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nsa_flex.titan.args import parallelism_problems
from tests.titan.helpers import metrics_by_step as _records
from tests.titan.helpers import run_debug_trainer as _run
from tests.titan.helpers import seed_checkpoint as _seed

STEPS = 4


@pytest.fixture(scope="module")
def seed(tmp_path_factory) -> Path:
    """A seed checkpoint of debug_nsa.toml's model, the start of every NSA run here."""
    return _seed(tmp_path_factory.mktemp("seed"))


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


def _assert_same_training(one: Path, cp: Path, rel: float) -> None:
    """The context-parallel run's losses and grad norms at every step equal one process's."""
    key = "loss_metrics/global_avg_loss"
    one, cp = _records(one, key), _records(cp, key)
    assert sorted(one) == sorted(cp) == list(range(1, STEPS + 1))
    for step in one:
        got, want = (cp[step][key], cp[step]["grad_norm"]), (one[step][key], one[step]["grad_norm"])
        assert got == pytest.approx(want, rel=rel), step


@pytest.mark.slow
def test_two_context_ranks_train_and_validate_as_one_process(tmp_path, seed):
    """The losses and grad norms of every step; validation at steps 1, 2 and 4: the loss of two
    batches of two rows, each rank its shard, and the retrieval metrics of three documents (a
    padded batch; the answers on the last rank)."""
    one, cp = _one_and_cp(tmp_path, seed, STEPS, "--nsa.doc_masking", "True", "--validation.enable",
                          "--validation.freq", "2", "--validation.steps", "2",
                          "--validation.local_batch_size", "2", "--validation.seq_len", "256",
                          "--validation.retrieval_docs", "3")
    _assert_same_training(one, cp, rel=2e-5)
    key = "validation_metrics/loss"
    one, cp = _records(one, key), _records(cp, key)
    assert sorted(one) == sorted(cp) == [1, 2, 4]  # the first step, then every validation.freq
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


# ----------------------------------------------------------------------------- llama3 baseline
BASELINE = ("--model.name", "nsa_flex_llama3")


@pytest.mark.slow
def test_llama3_baseline_trains_in_one_cpu_process(tmp_path):
    """The baseline's spec builds torchtitan's llama3 on nsa_flex's byte tokenizer and passkey
    data, and trains."""
    _run(["--job.dump_folder", str(tmp_path), *BASELINE, "--training.steps", "3"], tmp_path / "run.log")
    log = (tmp_path / "run.log").read_text()
    assert "Model nsa_flex_llama3 debugmodel" in log
    losses = _records(tmp_path / "metrics.jsonl", "loss_metrics/global_avg_loss")
    assert sorted(losses) == [1, 2, 3]
    assert all(0 < rec["loss_metrics/global_avg_loss"] < 10 for rec in losses.values())


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_llama3_baseline_two_context_ranks_train_as_one_process(tmp_path):
    """torchtitan's context parallelism (zig-zag shards, SDPA ring attention) on two GPUs gives
    the one-process losses and grad norms, both in bfloat16 (mixed_precision_param: FSDP's under
    context parallelism, whose ring attention shards only SDPA's bf16 / fp16 kernels; autocast in
    the one process), to 2e-2 (bf16 attention merged by the ring in another order)."""
    seed = _seed(tmp_path / "seed", *BASELINE)
    _assert_same_training(*_one_and_cp(tmp_path, seed, STEPS, *BASELINE,
                                       "--training.mixed_precision_param", "bfloat16"), rel=2e-2)


def _llama3_and_nsa_models():
    from torchtitan.models.llama3 import Transformer

    from nsa_flex.titan.args import nsa_flex_args
    from nsa_flex.titan.llama3_baseline import baseline_args
    from nsa_flex.titan.model import NSATransformer

    return Transformer(baseline_args["debugmodel"]), NSATransformer(nsa_flex_args["debugmodel"])


def test_trainer_and_validator_shard_the_baseline_as_torchtitan_and_nsa_as_nsa_flex(monkeypatch):
    """With context parallelism on, the llama3 baseline's batches go through torchtitan's
    post_dataloading_process (its zig-zag shards for the ring attention), the NSA model's
    through nsa_flex's `shard_batch`; without it both take torchtitan's."""
    import torchtitan.components.validate as titan_validate
    import torchtitan.train as titan_train

    from nsa_flex.titan import trainer as nsa_trainer
    from nsa_flex.titan import validate as nsa_validate
    from nsa_flex.titan.parallelize import owns_context_parallel

    llama, nsa = _llama3_and_nsa_models()
    assert not owns_context_parallel(llama) and owns_context_parallel(nsa)
    monkeypatch.setattr(titan_train.Trainer, "post_dataloading_process", lambda self, d, lab: "torchtitan")
    monkeypatch.setattr(titan_validate.Validator, "post_dataloading_process",
                        lambda self, d, lab, parts: "torchtitan")
    monkeypatch.setattr(nsa_trainer, "shard_batch", lambda m, d, lab: "nsa_flex")
    monkeypatch.setattr(nsa_validate, "shard_batch", lambda m, d, lab: "nsa_flex")
    for cp, model, want in ((True, llama, "torchtitan"), (True, nsa, "nsa_flex"), (False, nsa, "torchtitan")):
        tr = nsa_trainer.NSATrainer.__new__(nsa_trainer.NSATrainer)
        tr.parallel_dims, tr.model_parts = SimpleNamespace(cp_enabled=cp), [model]
        assert tr.post_dataloading_process({}, None) == want, (cp, type(model).__name__)
        val = nsa_validate.NSAValidator.__new__(nsa_validate.NSAValidator)
        val.parallel_dims = SimpleNamespace(cp_enabled=cp)
        assert val.post_dataloading_process({}, None, [model]) == want, (cp, type(model).__name__)


def _baseline_config(cp=1, validation=False, flavor="debugmodel", mp="bfloat16"):
    return SimpleNamespace(model=SimpleNamespace(name="nsa_flex_llama3", flavor=flavor, tokenizer="byte"),
                           training=SimpleNamespace(seq_len=256, mixed_precision_param=mp),
                           nsa=SimpleNamespace(rope_theta=None),
                           parallelism=_par(cp=cp), validation=_val(validation))


def test_llama3_baseline_spec_and_its_rules():
    """The registered spec is torchtitan's llama3 with nsa_flex's data; "125M" has the NSA
    125M's decoder dims; what it cannot run with context parallelism names the field."""
    import copy

    import torchtitan.protocols.train_spec as ts
    from torchtitan.models.llama3 import Transformer

    import nsa_flex.titan.train_spec  # noqa: F401  registers the specs
    from nsa_flex.titan import llama3_baseline as bl
    from nsa_flex.titan.args import FlavorError, nsa_flex_args
    from nsa_flex.titan.data import build_dataloader
    from nsa_flex.titan.tokenizer import build_tokenizer

    spec = ts.get_train_spec("nsa_flex_llama3")
    assert spec.model_cls is Transformer and spec.parallelize_fn is bl.parallelize_baseline
    assert spec.build_dataloader_fn is build_dataloader and spec.build_tokenizer_fn is build_tokenizer
    nsa, base = nsa_flex_args["125M"], spec.model_args["125M"]
    for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "multiple_of", "ffn_dim_multiplier",
                 "norm_eps", "max_seq_len", "rope_theta", "vocab_multiple_of"):
        assert getattr(base, name) == getattr(nsa, name), name
    with pytest.raises(FlavorError, match=r"flavor='1B'.*'nsa_flex_llama3'.*\['125M', 'debugmodel'\]"):
        spec.model_args["1B"]

    args = copy.deepcopy(bl.baseline_args["debugmodel"])
    args.update_from_config(_baseline_config())
    assert (args.vocab_size, args.eos_id) == (320, build_tokenizer(_baseline_config()).eos_id)
    assert bl.context_parallel_problems(_baseline_config(cp=2), cuda=True) == []
    (msg,) = bl.context_parallel_problems(_baseline_config(cp=2), cuda=False)
    assert "parallelism.context_parallel_degree=2" in msg and "CUDA only" in msg
    (msg,) = bl.context_parallel_problems(_baseline_config(cp=2, validation=True), cuda=True)
    assert "validation.enable=True" in msg
    (msg,) = bl.context_parallel_problems(_baseline_config(cp=2, mp="float32"), cuda=True)
    assert "training.mixed_precision_param='float32'" in msg and "'bfloat16'" in msg
    assert bl.context_parallel_problems(_baseline_config(validation=True, mp="float32"), cuda=False) == []
