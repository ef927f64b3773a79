"""Helpers the attention paths share (torch only)."""

import torch
from torch import Tensor


def lse_weights(lses: list[Tensor], acc: torch.dtype) -> tuple[Tensor, Tensor]:
    """The shares of attention calls over disjoint key sets in one softmax over their union, from
    the calls' log-sum-exps: w [P, ...] with w_i = exp(lse_i - lse), lse = log sum_i exp(lse_i),
    both in dtype acc. A call a row does not see (lse -inf) weighs 0; a row that sees nothing gets
    every weight 0 and lse -inf. Differentiable in every lse_i."""
    lse = torch.stack(lses).to(acc)  # [P, B, H, T]
    m = lse.amax(0).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse - m)
    den = w.sum(0)
    return w / den.clamp_min(torch.finfo(acc).tiny), torch.log(den) + m


def merge_parts(parts: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Attention over a union of disjoint key sets from the attention over each set:
    out = sum_i exp(lse_i - lse) out_i with lse = log sum_i exp(lse_i) (`lse_weights`). Exact (no
    key is counted twice), differentiable in every out_i and lse_i; a part a row does not see
    (lse -inf) gets weight 0, a row that sees nothing gives 0 and lse -inf, as a single call would."""
    acc = torch.promote_types(parts[0][0].dtype, torch.float32)  # fp32, fp64 stays fp64
    w, lse = lse_weights([p[1] for p in parts], acc)
    out = sum(w[i].unsqueeze(-1) * o.to(acc) for i, (o, _) in enumerate(parts))
    return out.to(parts[0][0].dtype), lse
