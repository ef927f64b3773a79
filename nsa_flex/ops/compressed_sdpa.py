"""The compressed branch (paper §3.3.1) as causal attention over groups of d positions.

Query t sees compressed block i iff i d + l - 1 <= t (`nsa_flex.rules`), so the d positions
t = l - 1 + m d + r (0 <= r < d) all see blocks 0..m. Read q [B, Hq, T, Dk] from position l - 1
on as [B*Hq, d, Mf, Dk] -- batch (b, h), head r, row m: a strided view, no copy (`group_rows`) --
and the mask is plain causal over the Mf full groups with the d "heads" sharing one key head (a
copy of the group's k / v per query head: Mf keys, small). The output and dQ are copied once each
from cuDNN's buffers into the layer's layout (through the same view). The last (T - l + 1) % d
positions see every key (plain math, fewer than d rows); positions before l - 1 see nothing
(output 0, lse -inf).

`torch.ops.nsa_flex.cmp_sdpa_fwd` is a torch.library custom op with autograd (its backward the op
`cmp_sdpa_bwd`); torch.compile keeps it opaque, so what the compiled graph keeps for the
backward is what the op saves -- q (the layer keeps it anyway), k, v, its output and lse -- and
cuDNN gets the layout chosen here (the traced route keeps packed copies of q and of the output,
and inductor's layouts slow cuDNN down at d_k 192). On CUDA the kernels are cuDNN's fused
attention (the private SDPA op, which also returns the lse); elsewhere fp32 math with the same
formulas on the same views (how the CPU tests check the layout, forward and backward). The lse
carries no gradient (the scorer reads it detached; cuDNN's backward has no lse input).
Its cost against the traced route (`nsa_flex.attention.attend_compressed_sdpa`): the op's Python
(host time: visible where the layer is host-bound, at short sequences)
and those two copies; hence `NSAConfig.cmp_kernel = "cudnn_lean"`, not the default.
"""

import math

import torch
from torch import Tensor
from torch.library import custom_op

from ..rules import num_cmp
from .utils import merge_parts


def group_rows(x: Tensor, d: int) -> Tensor:
    """[B, H, M*d, E] -> [B*H, d, M, E], a view: batch (b, h), head r, row m = row m d + r of x
    (x's rows 1 apart in memory: cuDNN's BSHD layout with the d rows of a group as heads)."""
    B, H, R, E = x.shape
    if x.stride(3) != 1 or x.stride(0) != H * x.stride(1):
        x = x.contiguous()
    return x.as_strided((B * H, d, R // d, E), (x.stride(1), x.stride(2), d * x.stride(2), 1),
                        x.storage_offset())


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _math_scores(q: Tensor, k: Tensor, scale: float, causal: bool):
    """fp32 (fp64 stays fp64) scores [B, H, M, S] with k repeated over the group; causal: row m
    sees keys 0..m."""
    acc = torch.promote_types(q.dtype, torch.float32)
    kk = k.repeat_interleave(q.shape[1] // k.shape[1], 1).to(acc)
    s = (q.to(acc) @ kk.transpose(-1, -2)) * scale
    if causal:
        M, S = s.shape[-2:]
        future = torch.ones(M, S, dtype=torch.bool, device=q.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return s, kk, acc


def _math_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool):
    s, _, acc = _math_scores(q, k, scale, causal)
    lse = torch.logsumexp(s, -1)
    out = torch.exp(s - lse.unsqueeze(-1)) @ v.repeat_interleave(q.shape[1] // k.shape[1], 1).to(acc)
    return out.to(q.dtype), lse.to(_lse_dtype(q))


def _math_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
              scale: float, causal: bool):
    """FlashAttention's backward from the output and lse -> (dq, dk, dv), dk / dv in the
    accumulation dtype (fp32; fp64 stays fp64)."""
    B, H = q.shape[:2]
    Hkv = k.shape[1]
    s, kk, acc = _math_scores(q, k, scale, causal)
    p = torch.exp(s - lse.to(acc).unsqueeze(-1))
    do_ = do.to(acc)
    delta = (do_ * out.to(acc)).sum(-1, keepdim=True)
    ds = p * (do_ @ v.repeat_interleave(H // Hkv, 1).to(acc).transpose(-1, -2) - delta) * scale
    dk = (ds.transpose(-1, -2) @ q.to(acc)).view(B, Hkv, H // Hkv, *k.shape[2:]).sum(2)
    dv = (p.transpose(-1, -2) @ do_).view(B, Hkv, H // Hkv, *v.shape[2:]).sum(2)
    return (ds @ kk).to(q.dtype), dk, dv


def _fused_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool = True
               ) -> tuple[Tensor, Tensor]:
    """Causal (row m sees keys 0..m) or unmasked attention with GQA -> (out [B, H, M, Dv],
    lse [B, H, M] fp32): cuDNN on CUDA, the math twin elsewhere."""
    if q.is_cuda:
        r = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale)
        return r[0], r[1].view(r[1].shape[:3])
    return _math_fwd(q, k, v, scale, causal=causal)


def _fused_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
               scale: float, causal: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """`_fused_fwd`'s backward from an output and its lse -> (dq, dk, dv). With the output and lse
    of a larger softmax (these keys and others), the gradients of this part of it."""
    if q.is_cuda:
        M, S = q.shape[2], k.shape[2]
        none = torch.zeros((), dtype=torch.int64, device=q.device)  # philox: no dropout
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            do, q, k, v, out, lse.unsqueeze(-1), none, none, None, None, None, M, S, 0.0, causal,
            scale=scale)
    return _math_bwd(do, q, k, v, out, lse, scale, causal=causal)


class PrefixCausal(torch.autograd.Function):
    """Attention of q [B, H, M, Dk] (GQA onto k's heads) over the unmasked keys k0, v0 and the
    causal keys k1, v1 (row m sees k1 rows 0..m) in one softmax -> (out [B, H, M, Dv] in q's
    dtype, lse [B, H, M] fp32, no gradient). Forward: the two parts (cuDNN on CUDA) merged by
    their lse; backward: each part's backward from the merged output and lse, which is exactly
    its share of the one softmax's gradient (FlashAttention's dS = P (dP - rowsum(dO O)) with P
    from the merged lse). Merging the parts' autograd outputs instead would lose the lse's share:
    cuDNN's lse output has no gradient."""

    @staticmethod
    def forward(ctx, q, k0, v0, k1, v1, scale: float):
        out, lse = merge_parts([_fused_fwd(q, k0, v0, scale, causal=False), _fused_fwd(q, k1, v1, scale)])
        out = out.contiguous()
        ctx.save_for_backward(q, k0, v0, k1, v1, out, lse)
        ctx.scale = scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k0, v0, k1, v1, out, lse = ctx.saved_tensors
        do = dout.to(out.dtype).contiguous()  # read with out's strides
        dq0, dk0, dv0 = _fused_bwd(do, q, k0.contiguous(), v0.contiguous(), out, lse, ctx.scale,
                                   causal=False)
        dq1, dk1, dv1 = _fused_bwd(do, q, k1.contiguous(), v1.contiguous(), out, lse, ctx.scale)
        return (dq0 + dq1).to(q.dtype), dk0.to(k0.dtype), dv0.to(v0.dtype), dk1.to(k1.dtype), \
            dv1.to(v1.dtype), None


def _per_head(x: Tensor, H: int) -> Tensor:
    """[B, Hkv, M, E] -> [B*H, 1, M, E]: one copy per query head (M keys: small)."""
    B, Hkv = x.shape[:2]
    return x.repeat_interleave(H // Hkv, 1).reshape(B * H, 1, *x.shape[2:])


@custom_op("nsa_flex::cmp_sdpa_fwd", mutates_args=())
def cmp_sdpa_fwd(q: Tensor, k: Tensor, v: Tensor, l: int, d: int, scale: float
                 ) -> tuple[Tensor, Tensor]:
    """(out [B, Hq, T, Dv], lse [B, Hq, T] fp32) of the compressed-causal mask; k, v [B, Hkv,
    M, *] with M = num_cmp(T) compressed keys."""
    B, H, T, _ = q.shape
    o = l - 1
    Mf, rt = divmod(T - o, d)
    out = q.new_empty(B, H, T, v.shape[-1])
    lse = torch.empty(B, H, T, dtype=_lse_dtype(q), device=q.device)
    out[:, :, :o] = 0
    lse[:, :, :o] = float("-inf")
    if Mf:  # the full groups: cuDNN on views of q (rows o..) and of out
        om, lm = _fused_fwd(group_rows(q[:, :, o:o + Mf * d], d), _per_head(k[:, :, :Mf], H),
                            _per_head(v[:, :, :Mf], H), scale)
        group_rows(out[:, :, o:o + Mf * d], d).copy_(om)
        lse[:, :, o:o + Mf * d].view(B * H, Mf, d).copy_(lm.transpose(1, 2))
    if rt:  # the last few rows see every key
        ot, lt = _math_fwd(q[:, :, o + Mf * d:], k, v, scale, causal=False)
        out[:, :, o + Mf * d:] = ot
        lse[:, :, o + Mf * d:] = lt
    return out, lse


@cmp_sdpa_fwd.register_fake
def _(q, k, v, l, d, scale):
    B, H, T, _ = q.shape
    return q.new_empty(B, H, T, v.shape[-1]), q.new_empty(B, H, T, dtype=_lse_dtype(q))


@custom_op("nsa_flex::cmp_sdpa_bwd", mutates_args=())
def cmp_sdpa_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, l: int,
                 d: int, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    B, H, T, _ = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    o = l - 1
    Mf, rt = divmod(T - o, d)
    do = do.contiguous()
    dq = torch.empty_like(q)
    dq[:, :, :o] = 0
    dk, dv = torch.zeros_like(k, dtype=lse.dtype), torch.zeros_like(v, dtype=lse.dtype)
    if Mf:
        rows = slice(o, o + Mf * d)
        lse_g = lse[:, :, rows].reshape(B * H, Mf, d).transpose(1, 2).contiguous()
        # dO read with out's strides (cuDNN's backward reads both with one set)
        dqm, dkm, dvm = _fused_bwd(group_rows(do[:, :, rows], d), group_rows(q[:, :, rows], d),
                                   _per_head(k[:, :, :Mf], H), _per_head(v[:, :, :Mf], H),
                                   group_rows(out[:, :, rows], d), lse_g, scale)
        group_rows(dq[:, :, rows], d).copy_(dqm)
        dk[:, :, :Mf] += dkm.view(B, Hkv, G, Mf, -1).to(dk.dtype).sum(2)
        dv[:, :, :Mf] += dvm.view(B, Hkv, G, Mf, -1).to(dv.dtype).sum(2)
    if rt:  # the last few rows
        tail = slice(o + Mf * d, T)
        gq, gk, gv = _math_bwd(do[:, :, tail], q[:, :, tail], k, v, out[:, :, tail],
                               lse[:, :, tail], scale, causal=False)
        dq[:, :, tail] = gq
        dk += gk
        dv += gv
    return dq, dk.to(k.dtype), dv.to(v.dtype)


@cmp_sdpa_bwd.register_fake
def _(do, q, k, v, out, lse, l, d, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, l, d, scale = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.extra = (l, d, scale)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.nsa_flex.cmp_sdpa_bwd(dout, q, k, v, out, lse, *ctx.extra)
    return dq, dk, dv, None, None, None


cmp_sdpa_fwd.register_autograd(_backward, setup_context=_setup)


def compressed_sdpa(q: Tensor, k: Tensor, v: Tensor, l: int, d: int, scale: float | None = None
                    ) -> tuple[Tensor, Tensor]:
    """The compressed-causal mask: q [B, Hq, T, Dk], k [B, Hkv, S, Dk], v [B, Hkv, S, Dv] with
    S >= num_cmp(T) compressed keys -> (out [B, Hq, T, Dv], lse [B, Hq, T], no gradient)."""
    T, S = q.shape[2], k.shape[2]
    M = num_cmp(T, l, d)
    if M == 0 or S < M:
        raise ValueError(f"compressed_sdpa: {S} compressed keys for T={T}, l={l}, d={d} "
                         f"(expected num_cmp(T) = {M}, at least 1)")
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return torch.ops.nsa_flex.cmp_sdpa_fwd(q.contiguous(), k[:, :, :M].contiguous(),
                                           v[:, :, :M].contiguous(), l, d, float(scale))
