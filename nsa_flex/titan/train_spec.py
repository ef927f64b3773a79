"""The ``nsa_flex`` TrainSpec and the llama3 baseline's (``nsa_flex_llama3``,
:mod:`nsa_flex.titan.llama3_baseline`), registered with torchtitan on import (its only side effect).

Import this module through torchtitan's own hook: ``[experimental] custom_import =
"nsa_flex.titan.train_spec"`` (the default once ``[job] custom_config_module =
"nsa_flex.titan.job_config"``). The CPU device shim, the console filter and the checkpoint checks
belong to the trainer (:mod:`nsa_flex.titan.trainer`), not to this import.

Starts from llama3's spec (optimizers, LR schedulers, cross-entropy loss) and swaps in the NSA model,
its parallelize_fn, tokenizers, datasets, validator and metrics processor. No pipelining, no HF
state-dict adapter.
"""

import dataclasses

from torchtitan.models.llama3 import get_train_spec as llama3_train_spec
from torchtitan.protocols.train_spec import TrainSpec, register_train_spec

from . import llama3_baseline
from .args import nsa_flex_args
from .data import build_dataloader
from .metrics import build_metrics_processor
from .model import NSATransformer
from .parallelize import parallelize_nsa
from .tokenizer import build_tokenizer
from .validate import build_validator

NAME = "nsa_flex"


def get_train_spec() -> TrainSpec:
    return dataclasses.replace(
        llama3_train_spec(),
        model_cls=NSATransformer,
        model_args=nsa_flex_args,
        parallelize_fn=parallelize_nsa,
        pipelining_fn=None,
        build_dataloader_fn=build_dataloader,
        build_tokenizer_fn=build_tokenizer,
        build_validator_fn=build_validator,
        build_metrics_processor_fn=build_metrics_processor,
        state_dict_adapter=None,
    )


def register() -> None:
    """Register the specs as "nsa_flex" and "nsa_flex_llama3" through torchtitan's public API;
    idempotent (torchtitan raises ValueError "already registered" on a second registration, e.g. a
    re-import)."""
    spec = get_train_spec()
    for name, s in ((NAME, spec), (llama3_baseline.NAME, llama3_baseline.get_train_spec(spec))):
        try:
            register_train_spec(name, s)
        except ValueError as e:
            if "already registered" not in str(e):
                raise


register()
