"""The gate's mix of the branch outputs (paper Eq. 5) as one Triton op, forward and backward.

o[b, t, h*Dv + e] = sum_i g[b, t, h, i] * out_i[b, h, t, e], written straight in the layout the
output projection reads ([B, T, H*Dv]). Why an op of its own: torch.compile fuses this pointwise
sum into the epilogue of the last attention call that produces one of its inputs (the window
branch's flex forward), and that fused kernel is much slower than the two apart. A user-defined Triton kernel is a node inductor does not fuse into
flex's template.

Backward: d out_i = g_i * do (in [B, H, T, Dv]) and dg_i = rowsum(do * out_i) (fp32 sums).
`torch.ops.nsa_flex.gate_mix_fwd` / `gate_mix_bwd` are `triton_op`s with autograd (traced by
torch.compile, no host sync); under TRITON_INTERPRET=1 they run on CPU tensors (the CPU tests
compare them with `nsa_flex.attention.gate_mix_reference`, the torch math the reference backend
runs).
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

BT = 32  # positions per program (one head); the tile is BT x next_power_of_2(Dv)


@triton.jit
def _tile(X, sx_b, sx_h, sx_t, b, h, t, e, m):
    return tl.load(X + b * sx_b + h * sx_h + t[:, None] * sx_t + e[None, :], mask=m,
                   other=0.0).to(tl.float32)


@triton.jit
def _program(T, H, DV: tl.constexpr, DVP: tl.constexpr, BT: tl.constexpr):
    """This program's batch, head, BT positions and value columns, with their masks. (No pointer
    goes through a helper's return: torch's mutation analysis would count it as written.)"""
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    e = tl.arange(0, DVP)
    tm = t < T
    return b, h, t, e, tm, tm[:, None] & (e < DV)[None, :]


@triton.jit
def _mix_fwd_kernel(G, A, Bo, C, O, T, H, sg_b, sg_t, sg_h, sg_i,
                    sa_b, sa_h, sa_t, sb_b, sb_h, sb_t, sc_b, sc_h, sc_t,
                    N: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr, BT: tl.constexpr):
    b, h, t, e, tm, m = _program(T, H, DV, DVP, BT)
    gp = G + b * sg_b + t * sg_t + h * sg_h
    acc = tl.load(gp, mask=tm, other=0.0).to(tl.float32)[:, None] * _tile(A, sa_b, sa_h, sa_t, b, h, t, e, m)
    if N > 1:
        g1 = tl.load(gp + sg_i, mask=tm, other=0.0).to(tl.float32)
        acc += g1[:, None] * _tile(Bo, sb_b, sb_h, sb_t, b, h, t, e, m)
    if N > 2:
        g2 = tl.load(gp + 2 * sg_i, mask=tm, other=0.0).to(tl.float32)
        acc += g2[:, None] * _tile(C, sc_b, sc_h, sc_t, b, h, t, e, m)
    op = O + (b * T + t[:, None]) * (H * DV) + h * DV + e[None, :]
    tl.store(op, acc.to(O.dtype.element_ty), mask=m)


@triton.jit
def _mix_bwd_one(DO_tile, gp, X, sx_b, sx_h, sx_t, DX, DG, b, h, t, e, m, tm, T, H, i,
                 N: tl.constexpr, DV: tl.constexpr):
    g = tl.load(gp, mask=tm, other=0.0).to(tl.float32)
    x = _tile(X, sx_b, sx_h, sx_t, b, h, t, e, m)
    tl.store(DG + ((b * T + t) * H + h) * N + i, tl.sum(DO_tile * x, 1).to(DG.dtype.element_ty),
             mask=tm)
    dx = DX + ((b * H + h) * T + t[:, None]) * DV + e[None, :]
    tl.store(dx, (g[:, None] * DO_tile).to(DX.dtype.element_ty), mask=m)


@triton.jit
def _mix_bwd_kernel(DO, G, A, Bo, C, DA, DB, DC, DG, T, H, sdo_b, sdo_t, sg_b, sg_t, sg_h, sg_i,
                    sa_b, sa_h, sa_t, sb_b, sb_h, sb_t, sc_b, sc_h, sc_t,
                    N: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr, BT: tl.constexpr):
    b, h, t, e, tm, m = _program(T, H, DV, DVP, BT)
    do = tl.load(DO + b * sdo_b + t[:, None] * sdo_t + h * DV + e[None, :], mask=m,
                 other=0.0).to(tl.float32)
    gp = G + b * sg_b + t * sg_t + h * sg_h
    _mix_bwd_one(do, gp, A, sa_b, sa_h, sa_t, DA, DG, b, h, t, e, m, tm, T, H, 0, N, DV)
    if N > 1:
        _mix_bwd_one(do, gp + sg_i, Bo, sb_b, sb_h, sb_t, DB, DG, b, h, t, e, m, tm, T, H, 1, N, DV)
    if N > 2:
        _mix_bwd_one(do, gp + 2 * sg_i, C, sc_b, sc_h, sc_t, DC, DG, b, h, t, e, m, tm, T, H, 2,
                     N, DV)


def _strides(x: Optional[Tensor], like: Tensor) -> tuple[int, int, int]:
    """(batch, head, time) strides of an output [B, H, T, Dv] (its last stride is 1)."""
    x = like if x is None else x
    return x.stride(0), x.stride(1), x.stride(2)


def _consts(g: Tensor, a: Tensor, n: int) -> dict:
    dv = a.shape[-1]
    return dict(N=n, DV=dv, DVP=max(16, triton.next_power_of_2(dv)), BT=BT, num_warps=4)


@triton_op("nsa_flex::gate_mix_fwd", mutates_args=())
def gate_mix_fwd(g: Tensor, a: Tensor, b: Optional[Tensor], c: Optional[Tensor]) -> Tensor:
    """g [B, T, H, n] (any strides), a, b, c [B, H, T, Dv] (last stride 1; b, c None past n)
    -> [B, T, H*Dv]."""
    B, H, T, Dv = a.shape
    n = 1 + (b is not None) + (c is not None)
    o = torch.empty(B, T, H * Dv, dtype=a.dtype, device=a.device)
    if B * T * H == 0:
        return o
    wrap_triton(_mix_fwd_kernel)[(triton.cdiv(T, BT), B * H)](
        g, a, a if b is None else b, a if c is None else c, o, T, H, *g.stride(),
        *_strides(a, a), *_strides(b, a), *_strides(c, a), **_consts(g, a, n))
    return o


@triton_op("nsa_flex::gate_mix_bwd", mutates_args=())
def gate_mix_bwd(do: Tensor, g: Tensor, a: Tensor, b: Optional[Tensor], c: Optional[Tensor]
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> (dg [B, T, H, n] in g's dtype, da, db, dc [B, H, T, Dv]; db / dc empty when absent)."""
    B, H, T, Dv = a.shape
    n = 1 + (b is not None) + (c is not None)
    if do.stride(-1) != 1 or do.stride(1) != H * Dv:
        do = do.contiguous()
    dg = torch.empty(B, T, H, n, dtype=g.dtype, device=g.device)
    da = torch.empty(B, H, T, Dv, dtype=a.dtype, device=a.device)
    db = torch.empty_like(da) if b is not None else a.new_empty(0)
    dc = torch.empty_like(da) if c is not None else a.new_empty(0)
    if B * T * H == 0:
        return dg, da, db, dc
    wrap_triton(_mix_bwd_kernel)[(triton.cdiv(T, BT), B * H)](
        do, g, a, a if b is None else b, a if c is None else c, da, da if b is None else db,
        da if c is None else dc, dg, T, H, do.stride(0), do.stride(1), *g.stride(),
        *_strides(a, a), *_strides(b, a), *_strides(c, a), **_consts(g, a, n))
    return dg, da, db, dc


def _setup(ctx, inputs, output):
    g, a, b, c = inputs
    ctx.save_for_backward(g, a, b, c)


def _backward(ctx, do):
    g, a, b, c = ctx.saved_tensors
    dg, da, db, dc = torch.ops.nsa_flex.gate_mix_bwd(do, g, a, b, c)
    return dg, da, db if b is not None else None, dc if c is not None else None


gate_mix_fwd.register_autograd(_backward, setup_context=_setup)


def gate_mix(g: Tensor, outs: list[Tensor]) -> Tensor:
    """Eq. 5 fused: g [B, T, H, n] (n = len(outs), 1 to 3), outs [B, H, T, Dv] -> [B, T, H*Dv]
    (the same function as `nsa_flex.attention.gate_mix_reference`)."""
    if not 1 <= len(outs) <= 3 or g.shape[-1] != len(outs):
        raise ValueError(f"gate_mix: 1 to 3 outputs and one gate column each, got {len(outs)} "
                         f"outputs and g of shape {tuple(g.shape)}")
    outs = [x if x.stride(-1) == 1 else x.contiguous() for x in outs]
    a, b, c = (list(outs) + [None, None])[:3]
    return torch.ops.nsa_flex.gate_mix_fwd(g, a, b, c)
