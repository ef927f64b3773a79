"""A quiet, readable console for torchtitan runs of nsa_flex (installed by the trainer,
:class:`nsa_flex.titan.trainer.NSATrainer`, before torchtitan logs its first line).

:func:`setup` (idempotent) adds one ``logging.Filter`` to torchtitan's (root) logger and one
``warnings`` filter:

* "Building <model> <flavor>with {...}" (a 35-line JSON dump of the model args) becomes a
  three-line summary of the model, its NSA settings and the mask builder of each branch;
* "Peak FLOPS used for computing MFU: nan" (the CPU shim has no peak FLOPS) becomes one line
  saying MFU is unavailable, and each step line shows "mfu: n/a" instead of "mfu: nan%";
* "torchtitan version: 0.2.2 (0.0.0 means __version__ is not defined correctly)." becomes
  "torchtitan 0.2.2"; "Sleeping 2 seconds for other ranks to complete" is dropped in a single
  process, "Error running lspci ..., fallback to use device_name" always (the device name is right);
* ANSI colour codes are removed when stdout is not a terminal (a log file, a pipe);
* torchdata's "'set_vital' is deprecated" UserWarning (raised inside StatefulDataLoader, no
  action of ours can avoid it) is ignored;
* under torchrun only rank 0 logs (as torchtitan's own launcher script does with
  ``--local-ranks-filter 0``): the other ranks keep their errors, not their INFO / WARNING lines
  nor their Python warnings;
* without CUDA, what only concerns NCCL or a CUDA mesh is dropped: torchtitan's
  "ENV[TORCH_NCCL_ASYNC_ERROR_HANDLING] ... will be overridden" and DTensor's "may not have complete
  support on cpu device mesh" warnings (the CPU data-parallel runs use gloo and DDP);
* a data loader worker's death raised inside a log call (torch's SIGCHLD handler raises it
  wherever the training process is) goes on up to the trainer, which says it in one line
  (``nsa_flex.titan.train.crash_message``), instead of logging's "--- Logging error ---" traceback.
"""

import json
import logging
import os
import re
import sys
import warnings

import torch

from masks import PRESETS

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_VERSION = re.compile(r"torchtitan version: (\S+) \(0\.0\.0 means __version__ is not defined correctly\)\.?")
_BUILDING = re.compile(r"Building (\S+) (\S+?)\s*with (\{.*\})\s*$", re.S)


def branch_builders(a: dict) -> str:
    """The mask builder of each branch (preset, then the per-branch overrides) and the user's
    builder modules, e.g. "cmp=compressed_causal sel=topn win=half_window (preset nsa, modules
    my_masks)"."""
    preset = PRESETS.get(a["masks"], (None, None, None))
    names = [a.get(k) or p for k, p in zip(("cmp_mask", "sel_mask", "win_mask"), preset)]
    mods = list(a.get("builder_modules") or ())
    return (" ".join(f"{b}={n}" for b, n in zip(("cmp", "sel", "win"), names))
            + f" (preset {a['masks']}" + (f", modules {','.join(mods)})" if mods else ")"))


def model_summary(name: str, flavor: str, a: dict) -> str:
    """Three lines for the model args ``a`` of an nsa_flex model."""
    return (f"Model {name} {flavor}: dim {a['dim']}, {a['n_layers']} layers, {a['n_heads']} heads / "
            f"{a['n_kv_heads']} KV heads, d_qk {a['d_qk']}, d_v {a['d_v']}, vocab {a['vocab_size']}, "
            f"seq {a['max_seq_len']}\n  NSA: l={a['l']} d={a['d']} l'={a['l_sel']} n={a['n_sel']} "
            f"(init {a['n_init']}, local {a['n_local']}) w={a['window']} phi={a['phi']} "
            f"backend={a['backend']} scorer={a['scorer']} doc_masking={a['doc_masking']}\n"
            f"  masks: {branch_builders(a)}")


class ConsoleFilter(logging.Filter):
    def __init__(self, color: bool):
        super().__init__("nsa_flex.console")
        self.color = color

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR and not rank_zero():
            return False
        msg = record.getMessage()
        if msg.startswith("Error running lspci"):
            return False
        if msg.startswith("ENV[TORCH_NCCL_") and not torch.cuda.is_available():
            return False
        if msg.startswith("Sleeping 2 seconds for other ranks") and os.environ.get("WORLD_SIZE", "1") == "1":
            return False
        new = _VERSION.sub(r"torchtitan \1", msg)
        m = _BUILDING.match(msg)
        if m:
            try:
                args = json.loads(m.group(3))
                new = model_summary(m.group(1), m.group(2), args) if "n_sel" in args else msg
            except (ValueError, KeyError):
                pass
        elif msg.startswith("Peak FLOPS used for computing MFU: nan"):
            new = "MFU: unavailable on this device (no peak FLOPS known); shown as n/a"
        if "mfu: nan%" in new:  # no peak FLOPS: no MFU, and the TFLOPS figure says nothing either
            new = re.sub(r"tflops: [\d,.]+\s*(\x1b\[[0-9;]*m)?mfu: nan%", r"\1mfu: n/a", new)
            new = new.replace("mfu: nan%", "mfu: n/a")
        if not self.color:
            new = _ANSI.sub("", new)
        if new != msg:
            record.msg, record.args = new, None
        return True


def rank_zero() -> bool:
    """This process is rank 0 (or the only one)."""
    return os.environ.get("RANK", "0") == "0"


# torch's DataLoader on a worker's death: "DataLoader worker (pid 123) is killed by signal: Killed." /
# "DataLoader worker (pid(s) 123) exited unexpectedly"
_WORKER_DIED = re.compile(r"DataLoader worker \(pid")


def worker_died(e: BaseException) -> bool:
    """Whether ``e`` is torch's error for a data loader worker process that died."""
    return isinstance(e, RuntimeError) and bool(_WORKER_DIED.search(str(e)))


def _handle_error(original):
    def handleError(self, record):  # inside emit's except: sys.exc_info() is the emit's error
        err = sys.exc_info()[1]
        if err is not None and worker_died(err):
            raise err
        return original(self, record)

    handleError.nsa_flex = True
    return handleError


def setup() -> None:
    """Install the filters (idempotent)."""
    if not getattr(logging.Handler.handleError, "nsa_flex", False):
        logging.Handler.handleError = _handle_error(logging.Handler.handleError)
    root = logging.getLogger()
    if not any(isinstance(f, ConsoleFilter) for f in root.filters):
        root.addFilter(ConsoleFilter(color=sys.stdout.isatty()))
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
    # [compile] cudagraphs: inductor's graph trees warn once when a compiled block runs again while
    # outputs of the step still await their backward, which a training step's blocks do by design
    # (the next block's forward, activation checkpointing's recompute); the graphs still replay
    warnings.filterwarnings("ignore", message="Unable to hit fast path of CUDAGraphs", category=UserWarning)
    if not torch.cuda.is_available():
        warnings.filterwarnings("ignore", message=r"DTensor .* may not have complete support on cpu device mesh",
                                category=UserWarning)
    if not rank_zero():
        warnings.simplefilter("ignore")
