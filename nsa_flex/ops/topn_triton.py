"""Top-n selection blocks (the rule of `nsa_flex.rules.pick_blocks`) as one Triton kernel.

Same function as `pick_blocks(scores, valid, forced, n)` with `valid, forced` from
`nsa_flex.rules.forced_and_valid` (forced: the document's first block and the n_local most
recent blocks; valid: starts at or before the query, not wholly before its document), computed in
registers instead of as [B, Hkv, C, Ns] int64 tensors: each row's candidates get the same int64
key (float bits of the score << 32 | reversed block index, +inf bits for forced blocks, negative
for invalid ones), and n max-reductions pick them in order (keys are unique per row, so removing
the maximum by equality is exact). One program = BLOCK_R rows of one (batch, KV group).

`torch.ops.nsa_flex.topn_blocks` is a `triton_op` (no graph break under torch.compile). Under
TRITON_INTERPRET=1 it runs on CPU tensors through the interpreter (how the CPU tests check it).
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from .rules_triton import block_keys, key_block


@triton.jit
def _topn_kernel(P, DS, OUT,
                 sp_b, sp_h, sp_t, sd_b, sd_t, so_b, so_h, so_t,
                 Hkv, C, NS, t0,
                 LS: tl.constexpr, N_SEL: tl.constexpr, N_INIT: tl.constexpr,
                 N_LOCAL: tl.constexpr, NS_PAD: tl.constexpr, BLOCK_R: tl.constexpr,
                 HAS_DOCS: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // Hkv
    h = pid_bh % Hkv
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < C
    t = (t0 + rows).to(tl.int64)
    if HAS_DOCS:
        start = tl.load(DS + b * sd_b + t * sd_t, mask=row_ok, other=0).to(tl.int64)
    else:
        start = t * 0
    jj = tl.arange(0, NS_PAD).to(tl.int64)
    score = tl.load(P + b * sp_b + h * sp_h + rows[:, None].to(tl.int64) * sp_t + jj[None, :],
                    mask=row_ok[:, None] & (jj < NS)[None, :], other=0.0)
    key = block_keys(jj[None, :], score, t[:, None], start[:, None], NS, LS, N_LOCAL, N_INIT)
    lowest = -4611686018427387904  # -(1 << 62): padding columns (and picked keys)
    o_ptr = OUT + b * so_b + h * so_h + rows.to(tl.int64) * so_t
    for i in range(N_SEL):
        top = tl.max(key, 1)
        blk = key_block(top, NS)
        tl.store(o_ptr + i, blk, mask=row_ok)
        key = tl.where(key == top[:, None], lowest, key)


@triton_op("nsa_flex::topn_blocks", mutates_args=())
def topn_blocks(scores: Tensor, doc_starts: Optional[Tensor], t0: int, l_sel: int, n_sel: int,
                n_init: int, n_local: int, block_r: int = 0, num_warps: int = 0) -> Tensor:
    """Top-n block indices [B, Hkv, C, n_sel] int64 (-1 pads) of scores p_slc [B, Hkv, C, Ns]
    (fp32, >= 0) for query positions t0..t0+C-1; doc_starts [B|1, T] or None.
    block_r / num_warps: rows per program and warps (performance only; 0: the defaults below)."""
    B, Hkv, C, ns = scores.shape
    out = torch.empty(B, Hkv, C, n_sel, device=scores.device, dtype=torch.int64)
    if C == 0:
        return out
    ns_pad = max(16, triton.next_power_of_2(ns))
    # ~64 int64 keys per thread: the n max-reductions are latency-bound, few warps per program
    # sync least (more keys per thread spill; experiments/tune_scorer.py --topn-configs)
    block_r = block_r or max(1, min(16, 2048 // ns_pad))
    num_warps = num_warps or max(1, block_r * ns_pad // 2048)
    if doc_starts is None:
        ds, sd_b, sd_t = scores, 0, 0  # never read (HAS_DOCS=False)
    else:
        ds = doc_starts
        sd_b = 0 if doc_starts.shape[0] == 1 else doc_starts.stride(0)
        sd_t = doc_starts.stride(1)
    grid = (triton.cdiv(C, block_r), B * Hkv)
    wrap_triton(_topn_kernel)[grid](
        scores, ds, out,
        scores.stride(0), scores.stride(1), scores.stride(2), sd_b, sd_t,
        out.stride(0), out.stride(1), out.stride(2),
        Hkv, C, ns, t0,
        LS=l_sel, N_SEL=n_sel, N_INIT=n_init, N_LOCAL=n_local, NS_PAD=ns_pad, BLOCK_R=block_r,
        HAS_DOCS=doc_starts is not None, num_warps=num_warps,
    )
    return out
