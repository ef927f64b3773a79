"""nsa-flex: Native Sparse Attention (arXiv 2502.11089) on FlexAttention.

Importing the package runs nothing (no torch either: `nsa-train --help` answers without it):
`NSAConfig`, `NSAConfigError` and `NSAAttention` resolve on first use. That keeps `nsa_flex.rules` a leaf that `masks` imports at its top (`nsa_flex` ->
`masks` -> `nsa_flex.rules`) without importing the layer, which imports `masks`.
"""

import importlib

_LAZY = {"NSAConfig": "config", "NSAConfigError": "config", "NSAAttention": "layer"}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'nsa_flex' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
