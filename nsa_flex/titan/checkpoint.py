"""Checkpoint integrity before a resume: a damaged latest checkpoint is set aside, not loaded.

torchtitan 0.2.2's ``CheckpointManager.load`` takes the highest ``step-N`` folder holding a
``.metadata`` file and loads it; a truncated ``.distcp`` or a garbage ``.metadata`` then fails deep
inside DCP (a bare EOFError naming no file). :func:`install` wraps ``load`` (from the
``custom_import`` hook, idempotent): for a resume from the latest checkpoint (``load_step = -1``)
each candidate, newest first, is checked without loading any tensor (:func:`check_dcp_folder`:
the metadata unpickles, every storage file it names exists and is long enough); a damaged one is
moved to ``<checkpoint folder>/damaged/step-N`` with a warning naming it and why, and the next
older one is tried. If every one is damaged: one :class:`CheckpointError`. An explicit
``load_step`` that is damaged is an error too (never silently another step).
"""

import os
import re

from torchtitan.tools.logging import logger

from nsa_flex.config import UserError

DAMAGED = "damaged"  # sub-folder of the checkpoint folder (no "step-N" name: torchtitan ignores it)


class CheckpointError(UserError, RuntimeError):
    """No usable checkpoint to resume from (each damaged folder named, with why)."""


def check_dcp_folder(path: str) -> str | None:
    """Why the DCP checkpoint folder ``path`` cannot be loaded, or None if it looks complete."""
    from torch.distributed.checkpoint import FileSystemReader

    if not os.path.isfile(os.path.join(path, ".metadata")):
        return "no .metadata file (an unfinished save)"
    try:
        meta = FileSystemReader(path).read_metadata()
    except Exception as e:
        return f".metadata is unreadable ({type(e).__name__}: {e})"
    need: dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is not None:
            need[rel] = max(need.get(rel, 0), info.offset + info.length)
    for rel, size in sorted(need.items()):
        f = os.path.join(path, rel)
        if not os.path.isfile(f):
            return f"data file {rel} is missing"
        have = os.path.getsize(f)
        if have < size:
            return f"data file {rel} is truncated ({have} of {size} bytes)"
    return None


def _steps(folder: str) -> list[int]:
    out = []
    for name in os.listdir(folder):
        m = re.fullmatch(r"step-(\d+)", name)
        if m and os.path.isfile(os.path.join(folder, name, ".metadata")):
            out.append(int(m.group(1)))
    return sorted(out, reverse=True)


def _set_aside(folder: str, step: int, why: str) -> str:
    import torch.distributed as dist

    src = os.path.join(folder, f"step-{step}")
    dst = os.path.join(folder, DAMAGED, f"step-{step}")
    rank0 = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    if rank0:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        k = 1
        while os.path.exists(dst):
            dst = os.path.join(folder, DAMAGED, f"step-{step}.{k}")
            k += 1
        os.rename(src, dst)
        logger.warning(f"Checkpoint {src} is damaged: {why}. Set aside as {dst}; trying the previous one")
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return dst


def _load(manager, original, step: int) -> bool:
    loaded = original(manager, step)
    if loaded and step > 0:  # mark the resume in metrics.jsonl: the replayed steps follow
        from .metrics import note_resume

        note_resume(step, os.path.join(manager.folder, f"step-{step}"))
    return loaded


def load_checked(manager, original, step: int = -1) -> bool:
    """``CheckpointManager.load`` with the integrity check (see the module docstring)."""
    folder = getattr(manager, "folder", None)
    if not getattr(manager, "enable", False) or not folder or not os.path.isdir(folder):
        return original(manager, step)
    if step != -1:
        why = check_dcp_folder(os.path.join(folder, f"step-{step}"))
        if why and os.path.isdir(os.path.join(folder, f"step-{step}")):
            raise CheckpointError(f"checkpoint.load_step={step}: {os.path.join(folder, f'step-{step}')} is "
                                  f"damaged: {why}")
        return _load(manager, original, step)
    damaged = []
    for s in _steps(folder):
        why = check_dcp_folder(os.path.join(folder, f"step-{s}"))
        if why is None:
            return _load(manager, original, s)
        damaged.append(f"step-{s}: {why}")
        _set_aside(folder, s, why)
    if damaged:
        raise CheckpointError(f"no usable checkpoint in {folder} to resume from (set aside under "
                              f"{os.path.join(folder, DAMAGED)}): " + "; ".join(damaged))
    return original(manager, step)


def install() -> None:
    """Wrap torchtitan's CheckpointManager.load with :func:`load_checked` (idempotent)."""
    from torchtitan.components.checkpoint import CheckpointManager

    original = CheckpointManager.load
    if getattr(original, "_nsa_checked", False):
        return

    def load(self, step: int = -1) -> bool:
        return load_checked(self, original, step)

    load._nsa_checked = True
    load.__doc__ = original.__doc__
    CheckpointManager.load = load
