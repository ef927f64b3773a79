"""The compressed branch (paper §3.3.1) as causal attention over groups of d positions.

Query t sees compressed block i iff i d + l - 1 <= t (`nsa_flex.rules`), so the d positions
t = l - 1 + m d + r (0 <= r < d) all see blocks 0..m. Read q [B, Hq, T, Dk] from position l - 1
on as [B*Hq, d, Mf, Dk] -- batch (b, h), head r, row m: a strided view, no copy (`group_rows`) --
and the mask is plain causal over the Mf full groups with the d "heads" sharing one key head (a
copy of the group's k / v per query head: Mf keys, small). cuDNN writes the output back in q's
row order, so nothing q- or output-sized is copied. The last (T - l + 1) % d positions see every
key (plain math, fewer than d rows); positions before l - 1 see nothing (output 0, lse -inf).

`torch.ops.nsa_flex.cmp_sdpa_fwd` is a torch.library custom op with autograd (its backward the op
`cmp_sdpa_bwd`); torch.compile keeps it opaque, so what the compiled graph keeps for the
backward is what the op saves -- q (a view of the layer's q), k, v, its output and lse -- and
cuDNN gets the layout chosen here (under inductor the packed copies of q and of the output were
kept for the backward, +128 MiB a layer at the 125M shape, 32k, and the compiled call ran slower
than the eager one at d_k 192: experiments/NOTES.md 56). On CUDA the kernels are cuDNN's fused
attention (the private SDPA op, which also returns the lse); elsewhere fp32 math with the same
formulas on the same views (how the CPU tests check the layout, forward and backward). The lse
carries no gradient (the scorer reads it detached; cuDNN's backward has no lse input).
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.library import custom_op


def group_rows(x: Tensor, d: int) -> Tensor:
    """[B, H, M*d, E] -> [B*H, d, M, E], a view: batch (b, h), head r, row m = row m d + r of x
    (x's rows 1 apart in memory: cuDNN's BSHD layout with the d rows of a group as heads)."""
    B, H, R, E = x.shape
    if x.stride(3) != 1 or x.stride(0) != H * x.stride(1):
        x = x.contiguous()
    return x.as_strided((B * H, d, R // d, E), (x.stride(1), x.stride(2), d * x.stride(2), 1),
                        x.storage_offset())


def ungroup_rows(y: Tensor, B: int, H: int) -> Tensor:
    """`group_rows`' inverse -> [B, H, M*d, E] contiguous (a view where y is laid out so)."""
    BH, d, M, E = y.shape
    return y.transpose(1, 2).reshape(B, H, M * d, E).contiguous()


def _math_scores(q: Tensor, k: Tensor, scale: float):
    """fp32 (fp64 stays fp64) causal scores [B, H, M, S] with k repeated over the group."""
    acc = torch.promote_types(q.dtype, torch.float32)
    G = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(G, 1).to(acc)
    s = (q.to(acc) @ kk.transpose(-1, -2)) * scale
    M, S = s.shape[-2:]
    future = torch.ones(M, S, dtype=torch.bool, device=q.device).triu(1)
    return s.masked_fill(future, float("-inf")), kk, acc


def _fused_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Causal attention with GQA on packed tensors -> (out [B, H, M, Dv], lse [B, H, M] fp32)."""
    if q.is_cuda:
        r = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, True, False, scale=scale)
        return r[0], r[1].view(r[1].shape[:3])
    s, _, acc = _math_scores(q, k, scale)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.unsqueeze(-1))
    out = p @ v.repeat_interleave(q.shape[1] // k.shape[1], 1).to(acc)
    return out.to(q.dtype), lse.to(torch.float32 if q.dtype != torch.float64 else q.dtype)


def _fused_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
               scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """FlashAttention's backward of `_fused_fwd` from its output and lse -> (dq, dk, dv)."""
    if q.is_cuda:
        M, S = q.shape[2], k.shape[2]
        none = torch.zeros((), dtype=torch.int64, device=q.device)  # philox: no dropout
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            do, q, k, v, out, lse.unsqueeze(-1), none, none, None, None, None, M, S, 0.0, True,
            scale=scale)
    B, H, M, _ = q.shape
    Hkv = k.shape[1]
    s, kk, acc = _math_scores(q, k, scale)
    p = torch.exp(s - lse.to(acc).unsqueeze(-1))
    do_, vv = do.to(acc), v.repeat_interleave(H // Hkv, 1).to(acc)
    delta = (do_ * out.to(acc)).sum(-1, keepdim=True)
    ds = p * (do_ @ vv.transpose(-1, -2) - delta) * scale
    dq = ds @ kk
    dk = (ds.transpose(-1, -2) @ q.to(acc)).view(B, Hkv, H // Hkv, *k.shape[2:]).sum(2)
    dv = (p.transpose(-1, -2) @ do_).view(B, Hkv, H // Hkv, *v.shape[2:]).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@custom_op("nsa_flex::cmp_sdpa_fwd", mutates_args=())
def cmp_sdpa_fwd(q: Tensor, k: Tensor, v: Tensor, d: int, scale: float) -> tuple[Tensor, Tensor]:
    """Group-causal attention: q [B, Hq, M*d, Dk] (M groups of d rows), k [B, Hkv, M, Dk],
    v [B, Hkv, M, Dv]; a row of group m sees keys 0..m -> (out [B, Hq, M*d, Dv], lse [B, Hq, M*d]
    fp32). cuDNN reads q in place (`group_rows`) and writes out in q's row order; k, v get one
    copy per query head (M keys: small)."""
    B, H, R, _ = q.shape
    G = H // k.shape[1]
    kk, vv = (x.repeat_interleave(G, 1).reshape(B * H, 1, *x.shape[2:]) for x in (k, v))
    out, lse = _fused_fwd(group_rows(q, d), kk, vv, scale)
    return (ungroup_rows(out, B, H),
            lse.view(B, H, d, R // d).transpose(2, 3).reshape(B, H, R).contiguous())


@cmp_sdpa_fwd.register_fake
def _(q, k, v, d, scale):
    B, H, R, _ = q.shape
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(B, H, R, v.shape[-1]), q.new_empty(B, H, R, dtype=lse_dtype)


@custom_op("nsa_flex::cmp_sdpa_bwd", mutates_args=())
def cmp_sdpa_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, d: int,
                 scale: float) -> tuple[Tensor, Tensor, Tensor]:
    B, H, R, _ = q.shape
    Hkv, M = k.shape[1], k.shape[2]
    G = H // Hkv
    kk, vv = (x.repeat_interleave(G, 1).reshape(B * H, 1, *x.shape[2:]) for x in (k, v))
    lse_g = lse.view(B * H, M, d).transpose(1, 2).contiguous()
    # dO in out's layout (cuDNN's backward reads both with one set of strides)
    dq, dk, dv = _fused_bwd(group_rows(do.contiguous(), d), group_rows(q, d), kk, vv,
                            group_rows(out, d), lse_g, scale)
    return (ungroup_rows(dq, B, H), dk.view(B, Hkv, G, M, -1).sum(2).to(k.dtype),
            dv.view(B, Hkv, G, M, -1).sum(2).to(v.dtype))


@cmp_sdpa_bwd.register_fake
def _(do, q, k, v, out, lse, d, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, d, scale = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.extra = (d, scale)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.nsa_flex.cmp_sdpa_bwd(dout, q, k, v, out, lse, *ctx.extra)
    return dq, dk, dv, None, None


cmp_sdpa_fwd.register_autograd(_backward, setup_context=_setup)


def _dense(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Attention to every key (fp32 softmax), GQA: the last partial group's few rows."""
    acc = torch.promote_types(q.dtype, torch.float32)
    G = q.shape[1] // k.shape[1]
    s = (q.to(acc) @ k.repeat_interleave(G, 1).to(acc).transpose(-1, -2)) * scale
    lse = torch.logsumexp(s, -1)
    out = torch.exp(s - lse.unsqueeze(-1)) @ v.repeat_interleave(G, 1).to(acc)
    return out.to(q.dtype), lse.to(torch.float32 if q.dtype != torch.float64 else q.dtype)


def compressed_sdpa(q: Tensor, k: Tensor, v: Tensor, l: int, d: int, scale: float | None = None
                    ) -> tuple[Tensor, Tensor]:
    """The compressed-causal mask: q [B, Hq, T, Dk], k [B, Hkv, S, Dk], v [B, Hkv, S, Dv] with
    S >= num_cmp(T) compressed keys -> (out [B, Hq, T, Dv], lse [B, Hq, T], no gradient).
    Positions l - 1 .. l - 1 + Mf d - 1 (Mf full groups) run `cmp_sdpa_fwd` on a view of q; the
    last (T - l + 1) % d positions see all Mf + 1 keys (plain math, fewer than d rows); positions
    before l - 1 see nothing (0, lse -inf). The concatenation is left to torch.compile (fused
    into the consumer of the output)."""
    B, H, T, _ = q.shape
    o = l - 1
    Mf, rt = divmod(T - o, d) if T > o else (0, 0)
    M = Mf + (rt > 0)
    if T <= o or k.shape[2] < M:
        raise ValueError(f"compressed_sdpa: {k.shape[2]} compressed keys for T={T}, l={l}, d={d} "
                         f"(expected num_cmp(T) = {M})")
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    outs = [q.new_zeros(B, H, o, v.shape[-1])]
    lses = [q.new_full((B, H, o), float("-inf"), dtype=lse_dtype)]
    if Mf:
        out, lse = torch.ops.nsa_flex.cmp_sdpa_fwd(q[:, :, o:o + Mf * d], k[:, :, :Mf],
                                                   v[:, :, :Mf], d, float(scale))
        outs.append(out)
        lses.append(lse)
    if rt:
        out, lse = _dense(q[:, :, o + Mf * d:], k[:, :, :M], v[:, :, :M], scale)
        outs.append(out)
        lses.append(lse.detach())
    return torch.cat(outs, 2), torch.cat(lses, 2)
