"""Minimal CPU device shim so torchtitan's stock trainer runs single-process on a machine without GPU.

torchtitan 0.2.2 assumes an accelerator: ``tools.utils.device_type`` falls back to "cuda",
``torch.cuda.set_device`` is called, the device mesh is built on "cuda", and ``DeviceMemoryMonitor``
reads CUDA memory stats. :func:`apply` points every module-level copy of ``device_type`` /
``device_module`` at "cpu" and a small stand-in module (memory = the process's peak RSS). The process
group then uses gloo (torch's default for cpu). It is applied by the trainer
(:class:`nsa_flex.titan.trainer.NSATrainer`, before torchtitan reads the device) only when
``torch.cuda.is_available()`` is False: torchtitan 0.2.2 has no CPU device path (version-gated by
:func:`nsa_flex.titan.trainer.check_versions`).

On CPU use ``[training] mixed_precision_param = "float32"`` (bf16 autocast is ~25x slower there) and
the ``reference`` NSA backend (switched automatically from ``flex``, whose CPU backward does not exist).
Multi-process CPU runs work with DDP (``data_parallel_replicate_degree``), not FSDP (gloo lacks
PREMUL_SUM).
"""

import contextlib
import importlib
import os
import platform
import resource
import sys
from types import SimpleNamespace

import torch
from torchtitan.tools.logging import logger

_PATCHED_MODULES = (
    "torchtitan.tools.utils",
    "torchtitan.distributed.utils",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.components.metrics",
    "torchtitan.tools.profiling",
)


def _total_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


class CPUDeviceModule:
    """The subset of ``torch.cuda`` torchtitan's trainer calls, for the CPU."""

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def set_device(self, device) -> None:
        pass

    def current_device(self) -> int:
        return 0

    def synchronize(self, device=None) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_name(self, device=None) -> str:
        return f"CPU {platform.machine()} ({os.cpu_count()} cores)"

    def get_device_properties(self, device=None):
        return SimpleNamespace(total_memory=_total_memory(), name=self.get_device_name())

    def reset_peak_memory_stats(self, device=None) -> None:
        pass  # the process's peak RSS cannot be reset

    def memory_stats(self, device=None) -> dict:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak *= 1 if sys.platform == "darwin" else 1024  # KiB on Linux
        return {
            "active_bytes.all.peak": peak,
            "reserved_bytes.all.peak": peak,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }


cpu_device_module = CPUDeviceModule()
_applied = False


def _no_peak_flops(device_name: str) -> float:
    return float("nan")


def _amp_unless_float32(maybe_enable_amp):
    def wrapped(parallel_dims, mixed_precision_param: str, device_type: str):
        if mixed_precision_param == "float32":
            return contextlib.nullcontext()
        return maybe_enable_amp(parallel_dims, mixed_precision_param, device_type)

    wrapped._nsa_cpu = True
    return wrapped


def apply() -> None:
    """Point torchtitan at the CPU (idempotent)."""
    global _applied
    for name in _PATCHED_MODULES:
        mod = importlib.import_module(name)
        if hasattr(mod, "device_type"):
            mod.device_type = "cpu"
        if hasattr(mod, "device_module"):
            mod.device_module = cpu_device_module
    # no peak FLOPS for a CPU: NaN ("mfu: n/a" on the console, nsa_flex.titan.console), instead of
    # torchtitan's lspci call and "fallback to A100" warnings (twice per run)
    utils = importlib.import_module("torchtitan.tools.utils")
    utils.get_peak_flops = _no_peak_flops
    # float32 "mixed precision": no autocast at all (CPU autocast rejects float32 with a warning)
    dist_utils = importlib.import_module("torchtitan.distributed.utils")
    if not getattr(dist_utils.maybe_enable_amp, "_nsa_cpu", False):
        dist_utils.maybe_enable_amp = _amp_unless_float32(dist_utils.maybe_enable_amp)
    if not _applied:
        logger.warning("nsa_flex: no CUDA device; running torchtitan on the CPU (nsa_flex.titan.cpu shim)")
    _applied = True


def maybe_apply() -> bool:
    """Apply the shim when there is no CUDA device; True if applied."""
    if torch.cuda.is_available():
        return False
    apply()
    return True
