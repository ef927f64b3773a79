"""Rotary position embedding (rotate-half form), computed from positions on the fly."""

import torch
from torch import Tensor


def min_rope_base(seq_len: int) -> float:
    """The smallest RoPE base that lets a model retrieve across ``seq_len`` tokens (Men et al.,
    arXiv 2405.14591: base >= 0.0424 * L^1.628; below it the perplexity looks fine while retrieval
    fails): ~3.1e5 at 16k, ~9.5e5 at 32k."""
    return 0.0424 * seq_len ** 1.628


def rope_cos_sin(positions: Tensor, dim: int, theta: float, dtype=torch.float32):
    """positions [T] -> cos, sin [T, dim] (fp32 math, cast to dtype)."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim))
    ang = positions.to(torch.float32).unsqueeze(-1) * inv  # [T, dim/2]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, H, T, D] rotated by position: x*cos + rotate_half(x)*sin, in x's dtype.

    cos/sin are cast to x's dtype: under autocast (torchtitan on one GPU: fp32 weights, bf16
    autocast) the residual stream is fp32 while the projections are bf16; fp32 cos/sin would
    promote q and k to fp32, and FlexAttention (not on autocast's lists) and the scorer would then
    run in fp32, several times slower."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
