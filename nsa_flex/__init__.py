"""nsa-flex: Native Sparse Attention (arXiv 2502.11089) on FlexAttention.

``NSAConfig``, ``NSAConfigError`` and ``NSAAttention`` are imported on first use, so that the
command-line tools (``nsa-train --help``, ``python -m nsa_flex.plot``) answer without importing torch.
"""

__all__ = ["NSAConfig", "NSAConfigError", "NSAAttention"]


def __getattr__(name: str):
    if name in ("NSAConfig", "NSAConfigError"):
        from . import config

        return getattr(config, name)
    if name == "NSAAttention":
        from .layer import NSAAttention

        return NSAAttention
    raise AttributeError(f"module 'nsa_flex' has no attribute {name!r}")
