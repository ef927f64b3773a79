"""nsa-flex: Native Sparse Attention (arXiv 2502.11089) on FlexAttention."""

from .config import NSAConfig, NSAConfigError
from .layer import NSAAttention

__all__ = ["NSAConfig", "NSAConfigError", "NSAAttention"]
