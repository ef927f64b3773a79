"""Fused kernels beside their naive torch references (the torch code stays the reference).

`group_slc_scores`: the selection scorer (Eq. 8-10 + Eq. 9) as one Triton kernel, the fast path
of `nsa_flex.selection.block_scores`; `topn_blocks`: the top-n rule of
`nsa_flex.rules.pick_blocks` on its scores, in registers. None when triton cannot be imported (the torch path runs).
"""

try:
    from .scorer_triton import group_slc_scores, interpreted as triton_interpreted
    from .topn_triton import topn_blocks
except ImportError:  # no triton: the torch scorer only
    group_slc_scores = None
    topn_blocks = None

    def triton_interpreted() -> bool:
        return False

HAS_TRITON = group_slc_scores is not None

__all__ = ["HAS_TRITON", "group_slc_scores", "topn_blocks", "triton_interpreted"]
