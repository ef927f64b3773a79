"""Fused kernels beside their naive torch references (the torch code stays the reference).

`group_slc_scores`: the selection scorer (Eq. 8-10 + Eq. 9) as one Triton kernel, the fast path
of `nsa_flex.selection.block_scores`; `topn_blocks`: the top-n rule of
`nsa_flex.rules.pick_blocks` on its scores, in registers; `selected_attention`: the selection
branch's attention (forward and backward) over the selection's BlockMask lists; `gate_mix`: the
gate's mix of the branch outputs (Eq. 5), kept out of flex's epilogue. None when triton cannot be
imported (the torch path runs).
`compressed_sdpa` (its own module, no triton): the compressed branch on cuDNN as an opaque custom
op that keeps no packed copies for the backward (`NSAConfig.cmp_kernel = "cudnn_lean"`).
`SelectedTuning` (its own module, no triton): the selected op's settings as one frozen record.
"""

from .selected_tuning import DEFAULT_TUNING, SelectedTuning

try:
    from .scorer_triton import group_slc_scores, interpreted as triton_interpreted
    from .topn_triton import topn_blocks
    from .selected_triton import selected_attention, selected_lists
    from .selected_triton import supported as selected_unsupported
    from .gate_triton import gate_mix
except ImportError:  # no triton: the torch scorer only
    group_slc_scores = None
    topn_blocks = None
    gate_mix = None
    selected_attention = selected_lists = None

    def selected_unsupported(*args) -> str:
        return "triton is not importable"

    def triton_interpreted() -> bool:
        return False

HAS_TRITON = group_slc_scores is not None

__all__ = ["DEFAULT_TUNING", "HAS_TRITON", "SelectedTuning", "gate_mix", "group_slc_scores",
           "selected_attention", "selected_lists", "selected_unsupported", "topn_blocks",
           "triton_interpreted"]
