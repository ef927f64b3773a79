"""Test-only torchtitan custom_import module (tests/titan/test_ops.py): the nsa_flex TrainSpec under
two more names whose training data loader misbehaves, to exercise [ops] on CPU.

    --experimental.custom_import tests.titan.ops_test_data   (with the project root on PYTHONPATH)
    --model.name nsa_flex_block    the loader blocks forever when batch BLOCK_AT is requested
    --model.name nsa_flex_slow     the loader sleeps SLOW_S before every batch (same data, same losses)
    --model.name nsa_flex_nan      the loss is NaN from training step NAN_AT on (the non-finite guard)
    --model.name nsa_flex_oom      training step OOM_AT raises torch's out-of-memory error (as the CUDA
                                   allocator does when a step does not fit)
"""

import dataclasses
import threading
import time

import torch
from torchtitan.protocols.train_spec import _extra_train_specs, register_train_spec

from nsa_flex.titan import train_spec  # registers "nsa_flex"
from nsa_flex.titan.data import build_dataloader

BLOCK_AT = 3  # 1-based batch index: step 3 never gets its data
NAN_AT = 5  # 1-based training step whose loss (and so its gradients) is NaN
OOM_AT = 5  # 1-based training step that runs out of memory
SLOW_S = 0.15


def wait_for_data_forever() -> None:
    """Stands for a data source that never answers (a hung network read)."""
    threading.Event().wait()


def slow_read() -> None:
    time.sleep(SLOW_S)


class MisbehavingLoader:
    """Wraps the real loader (its checkpoint state included); ``mode`` = "block" | "slow"."""

    def __init__(self, inner, mode: str):
        self.inner, self.mode = inner, mode

    def __iter__(self):
        for i, batch in enumerate(self.inner, start=1):
            if self.mode == "block" and i == BLOCK_AT:
                wait_for_data_forever()
            if self.mode == "slow":
                slow_read()
            yield batch

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, sd):
        self.inner.load_state_dict(sd)


def _spec(mode: str):
    def build(dp_world_size, dp_rank, tokenizer, job_config, infinite=True):
        return MisbehavingLoader(build_dataloader(dp_world_size, dp_rank, tokenizer, job_config, infinite), mode)

    return dataclasses.replace(train_spec.get_train_spec(), build_dataloader_fn=build)


def _loss_spec(fault: str):
    base = train_spec.get_train_spec()

    def build_loss(job_config, **kw):
        inner, calls = base.build_loss_fn(job_config, **kw), [0]

        def loss(pred, labels):
            calls[0] += 1  # one call per training step (no gradient accumulation, no validation)
            out = inner(pred, labels)
            if fault == "oom" and calls[0] == OOM_AT:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                                             "capacity of 79.19 GiB of which 1.06 GiB is free.")
            return out * float("nan") if fault == "nan" and calls[0] >= NAN_AT else out

        return loss

    return dataclasses.replace(base, build_loss_fn=build_loss)


for _mode in ("block", "slow"):
    if f"nsa_flex_{_mode}" not in _extra_train_specs:
        register_train_spec(f"nsa_flex_{_mode}", _spec(_mode))
for _fault in ("nan", "oom"):
    if f"nsa_flex_{_fault}" not in _extra_train_specs:
        register_train_spec(f"nsa_flex_{_fault}", _loss_spec(_fault))
