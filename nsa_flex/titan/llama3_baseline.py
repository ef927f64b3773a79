"""The full-attention baseline for context parallelism: torchtitan's llama3 with nsa_flex's data.

TrainSpec ``"nsa_flex_llama3"`` (registered by :mod:`nsa_flex.titan.train_spec`): torchtitan's
stock llama3 ``Transformer`` (SDPA, causal) and its stock ``parallelize_llama``, which applies
context parallelism as torchtitan does (SDPA ring attention on every ``inner_attention``; the
trainer shards inputs, labels and position ids with the head-tail, i.e. zig-zag, load balancer,
``[parallelism] context_parallel_load_balancer``), with nsa_flex's tokenizers (gpt2 through
tiktoken, offline), datasets, validator and metrics. So the comparison with NSA's own context
parallelism (contiguous shards, all-gathered keys and values, `nsa_flex.context_parallel`) is
against torchtitan's ring attention, not against nsa_flex's all-gather path with full attention.

``NSATrainer`` takes torchtitan's input sharding for this model and its own for the NSA model
(:func:`nsa_flex.titan.parallelize.owns_context_parallel`).

Differences from llama3's spec: the tokenizer's vocabulary sets ``vocab_size`` (padded up to a
multiple of ``vocab_multiple_of``, as for the NSA model); ``[nsa] rope_theta``, when set, sets the
RoPE base (one TOML serves both models); no pipelining; no HF state-dict adapter. Context
parallelism runs on CUDA only: torch's SDPA ring attention has no sharding rule for the CPU
kernel. Validation with context parallelism is refused (``validation.enable``): torchtitan
0.2.2's validator shards a batch twice (``prepare_context_parallel_input``, then
``create_context_parallel_ctx`` over the already sharded inputs), and nsa_flex's validator
shards for the NSA model only.
"""

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from torchtitan.distributed import ParallelDims
from torchtitan.models.llama3 import Transformer, TransformerModelArgs, parallelize_llama

from nsa_flex.errors import UserError

from .args import Flavors
from .parallelize import cpu_data_parallel_problem
from .tokenizer import padded_vocab

NAME = "nsa_flex_llama3"


class BaselineConfigError(UserError, ValueError):
    """A setting the llama3 baseline does not run."""


@dataclass
class BaselineArgs(TransformerModelArgs):
    """llama3's ``TransformerModelArgs`` with the vocabulary and EOS from nsa_flex's tokenizer."""

    vocab_multiple_of: int = 64  # the tokenizer's vocab is padded up to a multiple of this

    def update_from_config(self, job_config, **kwargs) -> None:
        """llama3's (seq len from [training]), then vocab size and EOS from the tokenizer, the
        RoPE base from ``[nsa] rope_theta`` when set; what cannot run with context parallelism
        (`context_parallel_problems`) is a :class:`BaselineConfigError`."""
        super().update_from_config(job_config, **kwargs)
        self.vocab_size, eos = padded_vocab(job_config, self.vocab_multiple_of)
        self.eos_id = eos if eos is not None else 0
        theta = getattr(getattr(job_config, "nsa", None), "rope_theta", None)
        if theta is not None:
            self.rope_theta = theta
        problems = context_parallel_problems(job_config, torch.cuda.is_available())
        if problems:
            raise BaselineConfigError("; ".join(problems))


def context_parallel_problems(job_config, cuda: bool) -> list[str]:
    """What the baseline cannot run with context parallelism, one message per field: CPU processes
    (torch's SDPA ring attention has no sharding rule for the CPU kernel,
    ``aten._scaled_dot_product_flash_attention_for_cpu``), float32 attention (context parallelism
    wraps the model in FSDP, whose ``mixed_precision_param`` is the attention's dtype; torchtitan's
    SDPA takes the cuDNN or flash kernel, bfloat16 / float16 only, else the math kernel, which the
    ring attention cannot shard: "aten.add.Tensor got mixed torch.Tensor and DTensor") and
    validation (see the module's docstring)."""
    cp = job_config.parallelism.context_parallel_degree
    if cp <= 1:
        return []
    probs = []
    if not cuda:
        probs.append(f"parallelism.context_parallel_degree={cp}: model {NAME!r} runs context parallelism "
                     "on CUDA only (torch's SDPA ring attention has no CPU kernel); allowed on CPU: 1")
    mp = job_config.training.mixed_precision_param
    if mp not in ("bfloat16", "float16"):
        probs.append(f"training.mixed_precision_param={mp!r} with parallelism.context_parallel_degree={cp}: "
                     f"model {NAME!r}'s ring attention runs SDPA's cuDNN / flash kernels, which take "
                     "bfloat16 or float16 (float32 falls back to the math kernel, which context "
                     "parallelism cannot shard); allowed: 'bfloat16', 'float16'")
    if job_config.validation.enable:
        probs.append(f"validation.enable=True with parallelism.context_parallel_degree={cp}: model {NAME!r} "
                     "validates only without context parallelism (set validation.enable = false)")
    return probs


# The NSA model's dims (nsa_flex.titan.args): dim, layers, query heads, KV heads, the SwiGLU
# hidden size (4 * dim through multiple_of / ffn_dim_multiplier, the same formula), vocab,
# max_seq_len. llama3's head dim is dim / n_heads, so where the NSA flavor's d_qk / d_v differ from
# it the attention projections differ: "125M" has heads of 48 (dim 768 / 16 heads), the NSA model
# 64 (q and output projections 768 x 768 here, 768 x 1024 there; k and v 768 x 96 here, 768 x 128
# there). NSA's compression, selection and gate parameters have no counterpart.
baseline_args = Flavors({
    # tiny: trains on CPU in seconds (the NSA "debugmodel"'s dims; heads of 16, as its d_qk)
    "debugmodel": BaselineArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, max_seq_len=256),
    "125M": BaselineArgs(dim=768, n_layers=12, n_heads=16, n_kv_heads=2, max_seq_len=8192),
}, model=NAME)


def parallelize_baseline(model: nn.Module, parallel_dims: ParallelDims, job_config) -> nn.Module:
    """torchtitan's ``parallelize_llama`` (TP, context parallelism, AC, compile, FSDP / DDP); CPU
    processes need DDP (`cpu_data_parallel_problem`: gloo lacks FSDP's PREMUL_SUM)."""
    problem = cpu_data_parallel_problem(job_config.parallelism, parallel_dims.world_size,
                                        torch.cuda.is_available())
    if problem:
        raise UserError(problem)
    return parallelize_llama(model, parallel_dims, job_config)


def get_train_spec(base):
    """The baseline's TrainSpec from ``base``, the "nsa_flex" spec (its loss, optimizers, LR
    schedulers, tokenizer, data, validator and metrics), with llama3's model and parallelize."""
    return dataclasses.replace(base, model_cls=Transformer, model_args=baseline_args,
                               parallelize_fn=parallelize_baseline)
