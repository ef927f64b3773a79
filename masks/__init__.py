"""NSA mask builders: tiny pure mask factories, one MaskSpec type for both backends, a registry.

    from masks import get_mask_builder, causal, sliding_window, and_masks
"""

from .builders import (causal, compressed_causal, doc_start, document, drop_forced, key_range,
                       forced_blocks, forced_parts, selection, selection_block_flags, sliding_window)
from .core import MaskSpec, Selection, and_masks, at_offset, band_block_flags, block_mask_from_flags, or_masks
from .registry import (PRESETS, BuilderInfo, MaskBuilderError, MaskContext, builder_info,
                       check_causal, get_mask_builder, import_builder_modules, list_mask_builders,
                       register_mask_builder)

__all__ = [
    "MaskSpec", "Selection", "at_offset", "MaskContext", "BuilderInfo", "builder_info", "and_masks", "or_masks", "band_block_flags", "forced_blocks",
    "forced_parts", "drop_forced", "block_mask_from_flags",
    "causal", "sliding_window", "compressed_causal", "selection", "selection_block_flags",
    "document", "doc_start", "key_range", "PRESETS", "get_mask_builder", "list_mask_builders",
    "register_mask_builder", "MaskBuilderError", "check_causal", "import_builder_modules",
]
