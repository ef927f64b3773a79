"""A quiet, readable console for torchtitan runs of nsa_flex (installed by the trainer,
:class:`nsa_flex.titan.trainer.NSATrainer`, before torchtitan logs its first line).

:func:`setup` (idempotent) adds one ``logging.Filter`` to torchtitan's (root) logger and one
``warnings`` filter:

* "Building <model> <flavor>with {...}" (a 35-line JSON dump of the model args) becomes a
  two-line summary of the model and its NSA settings;
* "Peak FLOPS used for computing MFU: nan" (the CPU shim has no peak FLOPS) becomes one line
  saying MFU is unavailable, and each step line shows "mfu: n/a" instead of "mfu: nan%";
* ANSI colour codes are removed when stdout is not a terminal (a log file, a pipe);
* torchdata's "'set_vital' is deprecated" UserWarning (raised inside StatefulDataLoader, no
  action of ours can avoid it) is ignored.
"""

import json
import logging
import re
import sys
import warnings

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_BUILDING = re.compile(r"Building (\S+) (\S+?)\s*with (\{.*\})\s*$", re.S)


def model_summary(name: str, flavor: str, a: dict) -> str:
    """Two lines for the model args ``a`` of an nsa_flex model."""
    return (f"Model {name} {flavor}: dim {a['dim']}, {a['n_layers']} layers, {a['n_heads']} heads / "
            f"{a['n_kv_heads']} KV heads, d_qk {a['d_qk']}, d_v {a['d_v']}, vocab {a['vocab_size']}, "
            f"seq {a['max_seq_len']}\n  NSA: l={a['l']} d={a['d']} l'={a['l_sel']} n={a['n_sel']} "
            f"(init {a['n_init']}, local {a['n_local']}) w={a['window']} phi={a['phi']} "
            f"masks={a['masks']} backend={a['backend']} scorer={a['scorer']} "
            f"doc_masking={a['doc_masking']}")


class ConsoleFilter(logging.Filter):
    def __init__(self, color: bool):
        super().__init__("nsa_flex.console")
        self.color = color

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        new = msg
        m = _BUILDING.match(msg)
        if m:
            try:
                args = json.loads(m.group(3))
                new = model_summary(m.group(1), m.group(2), args) if "n_sel" in args else msg
            except (ValueError, KeyError):
                pass
        elif msg.startswith("Peak FLOPS used for computing MFU: nan"):
            new = "MFU: unavailable on this device (no peak FLOPS known); shown as n/a"
        if "mfu: nan%" in new:
            new = new.replace("mfu: nan%", "mfu: n/a")
        if not self.color:
            new = _ANSI.sub("", new)
        if new != msg:
            record.msg, record.args = new, None
        return True


def setup() -> None:
    """Install the filters (idempotent)."""
    root = logging.getLogger()
    if not any(isinstance(f, ConsoleFilter) for f in root.filters):
        root.addFilter(ConsoleFilter(color=sys.stdout.isatty()))
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
