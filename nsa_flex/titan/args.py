"""NSAModelArgs: the torchtitan model arguments of the NSA decoder, and its flavors."""

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from torchtitan.protocols.model import BaseModelArgs
from torchtitan.tools.logging import logger

from nsa_flex.config import (MODEL_DIMS, SCORE_KNOBS_OFF, NSAConfig, NSAConfigError, inert_score_knobs,
                             resolve_backend)
from nsa_flex.errors import UserError
from nsa_flex.flops import nsa_attention_flops

from .flags import unknown_flavor
from .tokenizer import padded_vocab

# NSAConfig's fields besides the decoder's own dims (MODEL_DIMS): the attention knobs
_KNOBS = tuple(f for f in dataclasses.fields(NSAConfig) if f.name not in MODEL_DIMS)
# [nsa] section fields that override model args (None = keep the flavor's value)
NSA_SECTION_FIELDS = tuple(f.name for f in _KNOBS) + ("doc_masking",)
def parallelism_problems(par, seq_len: int, l_sel: int, validation) -> list[str]:
    """What nsa_flex cannot run of [parallelism] (one message per field, naming the allowed
    values): data parallelism (FSDP2 / HSDP / DDP) and context parallelism
    (`nsa_flex.context_parallel`: contiguous shards of seq_len / N tokens, each a whole number of
    selection blocks, for training and, when `validation.enable`, for `validation.seq_len`;
    `validation` is the [validation] section). The one place these rules live (args and
    preflight)."""
    probs = []
    for name in ("tensor_parallel_degree", "pipeline_parallel_degree"):
        if getattr(par, name) != 1:
            probs.append(f"parallelism.{name}={getattr(par, name)!r}: nsa_flex supports data and "
                         "context parallelism only (allowed: 1)")
    cp = par.context_parallel_degree
    if cp < 1:
        probs.append(f"parallelism.context_parallel_degree={cp!r}: allowed 1 (off) or N >= 2")
    elif cp > 1:
        lengths = [("training.seq_len", seq_len)]
        if validation.enable:
            lengths.append(("validation.seq_len", validation.seq_len))
        for name, n in lengths:
            if n % (cp * l_sel):
                probs.append(f"parallelism.context_parallel_degree={cp}: {name}={n} must be a "
                             f"multiple of context_parallel_degree * nsa.l_sel = {cp * l_sel} (each "
                             "rank holds a whole number of selection blocks)")
    return probs


# model-args defaults that differ from NSAConfig's (paper-sized) ones
_DEFAULTS = {"d_qk": 64, "d_v": 64}
# the knobs as model-args fields: NSAConfig's names and types, its defaults but _DEFAULTS
_NSAFields = dataclasses.make_dataclass("_NSAFields", [
    (f.name, f.type, dataclasses.field(default=_DEFAULTS.get(f.name, f.default))) for f in _KNOBS])


def apply_nsa_section(args, nsa) -> None:
    """Set the [nsa] section's values (those not None) on model args `args`. One TOML serves every
    variant (`--nsa.masks full_causal` beside NSA): where the selection reads no scores, the
    selection-training knobs it sets (sel_scores, sel_distill, sel_dense_steps) are turned off for
    this run, named in one warning, instead of failing the config."""
    for name in NSA_SECTION_FIELDS:
        v = getattr(nsa, name, None)
        if v is not None:
            setattr(args, name, v)
    inert = inert_score_knobs(args)
    if inert:
        msg = (f"[nsa] masks={args.masks!r}" + (f", sel_mask={args.sel_mask!r}" if args.sel_mask else "")
               + ": the selection reads no scores, so " + ", ".join(f"{k}={v!r}" for k, v in inert.items())
               + (" do" if len(inert) > 1 else " does") + " not apply (off for this run)")
        if msg not in _said:  # once per process (preflight and the model args apply the section again)
            _said.add(msg)
            logger.warning(msg)
        for k in inert:
            setattr(args, k, SCORE_KNOBS_OFF[k])


_said: set[str] = set()  # apply_nsa_section's warnings given in this process


@dataclass
class NSAModelArgs(BaseModelArgs, _NSAFields):
    """The decoder's fields below, and NSAConfig's attention knobs (`_NSAFields`: d_qk, l, d,
    l_sel, n_sel, window, masks, ...; see nsa_flex.config.NSAConfig for their help)."""

    # decoder
    dim: int = 768
    n_layers: int = 12
    n_heads: int = 16
    n_kv_heads: int = 2
    vocab_size: int = 50304
    vocab_multiple_of: int = 64  # the tokenizer's vocab is padded up to a multiple of this
    multiple_of: int = 256  # SwiGLU hidden size multiple
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    max_seq_len: int = 8192
    depth_init: bool = True
    # attention restricted to the current document (split at eos_id); eos_id set from the tokenizer
    doc_masking: bool = False
    eos_id: int = -1

    def nsa_config(self) -> NSAConfig:
        """The NSAConfig of every attention layer (validates; NSAConfigError names bad fields)."""
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(NSAConfig)}
        return NSAConfig(**kw)

    def update_from_config(self, job_config, **kwargs) -> None:
        """Vocab size (and EOS) from the tokenizer, seq len from [training], NSA knobs from [nsa]."""
        training = job_config.training
        self.max_seq_len = training.seq_len
        self.vocab_size, eos = padded_vocab(job_config, self.vocab_multiple_of)
        self.eos_id = eos if eos is not None else -1

        nsa = getattr(job_config, "nsa", None)
        if nsa is not None:
            apply_nsa_section(self, nsa)

        # auto -> flex on CUDA, reference on the CPU; flex on the CPU -> reference, one warning
        # (the rule lives in nsa_flex.config.resolve_backend, shared with the layer)
        self.backend = resolve_backend(self.backend, "cuda" if torch.cuda.is_available() else "cpu",
                                       training=True)

        probs = parallelism_problems(job_config.parallelism, self.max_seq_len, self.l_sel,
                                     job_config.validation)
        if probs:
            raise NotImplementedError("; ".join(probs))
        if self.doc_masking and self.eos_id < 0:
            raise ValueError("nsa.doc_masking needs a tokenizer with an EOS token")
        try:  # validate now (n_sel against seq_len too), naming the offending fields with their TOML section
            self.nsa_config().validate(seq_len=self.max_seq_len)
        except NSAConfigError as e:
            def section(rule: str) -> str:  # a rule starts with its first field: "window=-3: ..."
                field = rule.split("=", 1)[0]
                return f"[model] flavor={job_config.model.flavor!r}: " if field in MODEL_DIMS else "[nsa] "

            errs = [section(r) + r for r in e.errors]
            raise NSAConfigError("invalid NSA settings:\n  - " + "\n  - ".join(errs), errs) from None

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """(parameters, training FLOPs per token): 6 x non-embedding params for the matmuls, plus
        3 x NSA's real forward attention-core FLOPs (forward + 2x backward), not full attention's."""
        nparams = sum(p.numel() for p in model.parameters())
        nparams_embedding = sum(
            sum(p.numel() for p in m.parameters()) for m in model.children() if isinstance(m, nn.Embedding)
        )
        attn_fwd_per_token = nsa_attention_flops(self.nsa_config(), seq_len) / seq_len
        flops = 6 * (nparams - nparams_embedding) + 3 * self.n_layers * attn_fwd_per_token
        return nparams, int(flops)


class FlavorError(UserError, KeyError):
    """Unknown flavor. A KeyError (Mapping lookups), printed as its message, not its repr."""

    def __str__(self) -> str:
        return str(self.args[0])


class Flavors(Mapping):
    """Flavor name -> model args (NSAModelArgs; the llama3 baseline's, `model`). Each lookup
    returns a fresh copy (update_from_config mutates it), and an unknown flavor raises a KeyError
    that lists the choices."""

    def __init__(self, table: dict[str, BaseModelArgs], model: str | None = None):
        self._table = table
        self.model = model  # the TrainSpec's name, when not the NSA model's

    def __getitem__(self, name: str) -> BaseModelArgs:
        if name not in self._table:
            raise FlavorError(unknown_flavor(name) if self.model is None else
                              f"[model] flavor={name!r}: unknown flavor of model {self.model!r}; "
                              f"allowed values are {sorted(self._table)}")
        return copy.deepcopy(self._table[name])

    def __iter__(self):
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)

    def add(self, name: str, args: BaseModelArgs) -> None:
        """Register one more flavor (e.g. from a ``custom_import`` module); a name that exists
        keeps its args."""
        self._table.setdefault(name, args)


nsa_flex_args = Flavors(
    {
        # tiny: trains on CPU in seconds
        "debugmodel": NSAModelArgs(
            dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, d_qk=16, d_v=16,
            l=8, d=4, l_sel=16, n_sel=4, window=32, max_seq_len=256,
        ),
        # ablation size (titan_configs/ablation.toml): 29M with gpt2's vocab (3.7M without the
        # embedding/output); the paper's GQA group (16 query heads per KV head) and block sizes
        # (NSAConfig's defaults, as in every flavor below), n=8 selected blocks and a 256-token
        # window for 2k-8k contexts
        "30M": NSAModelArgs(
            dim=256, n_layers=4, n_heads=16, n_kv_heads=1, d_qk=32, d_v=32, n_sel=8, window=256,
            max_seq_len=2048,
        ),
        # the same with 4 KV heads (groups of 4 query heads): small enough to train on one GPU,
        # and it learns to copy where one KV head does not within a few thousand steps
        "30M_kv4": NSAModelArgs(
            dim=256, n_layers=4, n_heads=16, n_kv_heads=4, d_qk=32, d_v=32, n_sel=8, window=256,
            max_seq_len=2048,
        ),
        # GPT-3-small sized: 160M with gpt2's vocab (83M without the untied embedding/output)
        "125M": NSAModelArgs(dim=768, n_layers=12, n_heads=16, n_kv_heads=2, d_qk=64, d_v=64,
                             max_seq_len=8192),
        "350M": NSAModelArgs(dim=1024, n_layers=24, n_heads=16, n_kv_heads=2, d_qk=64, d_v=64,
                             max_seq_len=32768),
        "1B": NSAModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=2, d_qk=64, d_v=64,
                           ffn_dim_multiplier=1.5, multiple_of=256, max_seq_len=32768),
    }
)
