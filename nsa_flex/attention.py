"""Attention executors, and the per-branch plan that picks one when the layer is built.

Every executor takes (q, k, v, spec: MaskSpec, scale) and computes the same function of the mask:
- `attend_reference`: dense masked attention from `spec.dense(...)`; runs anywhere, with autograd
  (CPU training and CPU gradient tests use it). Rows that see no key give 0 and lse = -inf.
- `attend_flex`: FlexAttention driven by `spec.block_mask(...)`, compiled. Per-group masks (the
  selection branch) use group-centric packing: q [B, Hq, T, D] -> [B, Hkv, T*G, D] with row
  t*G + g, so one q block holds one position's G heads (NSA's own kernel tile) and every selected
  kv block is a *full* block; only the query's own block runs the mask_mod. On GPU a mask split
  into disjoint `parts` (the selection: local band, sink block 0, scored blocks) is one flex call
  per part, merged exactly through the parts' log-sum-exps (`merge_parts`); few keys for many
  queries (compressed keys, the 64-key sink) get one K/V copy per query head (`expand_kv_heads`):
  flex's dK/dV pass then has G times the programs, each G times shorter.
- `attend_causal_sdpa`: the plain causal mask on SDPA, what full attention would run.
- `attend_compressed_sdpa` / `attend_compressed_lean`: the compressed-causal mask is plain causal
  attention once the d positions that see the same compressed blocks share one row: cuDNN's fused
  SDPA kernels (traced; or our op `ops/compressed_sdpa.py`, which keeps no packed copies for the
  backward); flex's template pads d_k 192 to 256 and runs its dK/dV pass over few, long kv tiles.
- `attend_selected`: a per-position block selection (`spec.selection`) on our Triton op
  (`ops/selected_triton.py`), fed by `selected_lists` beside it.

`plan_branch` chooses a branch's executor once, from the config and what the mask builder's
registry entry says its mask is (`masks.builder_info`): a `BranchPlan` holds the executor for a
step without documents and for one with them (documents make the causal and compressed-causal
masks ones only flex runs), and the selected op's tuning. What only a call knows stays there: the
backend "auto" resolves per device (reference on CPU), and an executor that cannot run these
tensors (device, dtype, head dims) hands them to flex, or raises where the config named it.

Shapes: q [B, Hq, T, Dk], k [B, Hkv, S, Dk], v [B, Hkv, S, Dv] -> out [B, Hq, T, Dv],
lse [B, Hq, T] (fp32, natural log; None from compiled CPU flex, which cannot return it: the
scorer then computes it itself; None from SDPA, which every caller of a token branch ignores).
"""

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import flex_attention
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from masks import MaskSpec, builder_info, causal

from .config import resolve_backend
from .ops.compressed_sdpa import PrefixCausal, compressed_sdpa as attend_compressed_lean
from .ops.utils import merge_parts
from .ops import (DEFAULT_TUNING, HAS_TRITON, SelectedTuning, gate_mix, selected_attention,
                  selected_lists, selected_unsupported, triton_interpreted)
from .kernel_options import (band_kernel_options, flex_kernel_options, install_flex_patches,
                             packed_block_size)
from .rules import masked_softmax

_compiled_flex = None
# Shapes one process may compile flex for outside a compiled model (eager prefill: every part of
# the selection, the compressed and window calls, each batch size and prompt length). dynamo's
# default (8) is reached by one 125M prefill at two batch sizes; past the limit dynamo would run
# flex eagerly, which materializes the full score matrix (an OOM at 32k): we fail instead.
FLEX_RECOMPILE_LIMIT = 64


def _flex(*args, **kwargs):
    global _compiled_flex
    if torch.compiler.is_compiling():
        return flex_attention(*args, **kwargs)
    install_flex_patches()  # before the first compile; a no-op once done
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    try:
        with torch._dynamo.config.patch(recompile_limit=FLEX_RECOMPILE_LIMIT,
                                        fail_on_recompile_limit_hit=True):
            return _compiled_flex(*args, **kwargs)
    except torch._dynamo.exc.FailOnRecompileLimitHit as e:
        raise RuntimeError(
            f"flex_attention was compiled for {FLEX_RECOMPILE_LIMIT} shapes in this process "
            "(nsa_flex.attention.FLEX_RECOMPILE_LIMIT); past it dynamo would run flex eagerly, "
            "materializing the full score matrix. Raise FLEX_RECOMPILE_LIMIT, or compile the "
            "model (one graph per layer shape)") from e


def _flex_lse(q, k, v, block_mask, scale, enable_gqa, kernel_options):
    if q.device.type == "cpu":  # compiled CPU flex supports neither lse nor backward
        out = _flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)
        return out, None
    try:
        from torch.nn.attention.flex_attention import AuxRequest

        out, aux = _flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                         kernel_options=kernel_options, return_aux=AuxRequest(lse=True))
        return out, aux.lse
    except ImportError:  # older torch
        return _flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                     kernel_options=kernel_options, return_lse=True)


def empty_attention(q: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """No keys at all (e.g. T < l for the compressed branch): output 0, lse = -inf."""
    B, H, T, _ = q.shape
    out = q.new_zeros(B, H, T, v.shape[-1]) + 0 * q.sum() + 0 * v.sum()  # keep the graph
    return out, q.new_full((B, H, T), float("-inf"), dtype=torch.float32)


def _dims(q: Tensor, k: Tensor, scale: float | None):
    B, Hq, T, Dk = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    return B, Hq, T, Dk, Hkv, S, Hq // Hkv, scale if scale is not None else 1.0 / math.sqrt(Dk)


def attend_reference(q: Tensor, k: Tensor, v: Tensor, spec: MaskSpec,
                     scale: float | None = None) -> tuple[Tensor, Tensor]:
    if k.shape[2] == 0:
        return empty_attention(q, v)
    B, Hq, T, Dk, Hkv, S, G, scale = _dims(q, k, scale)
    mask = spec.dense(B, T, S, device=q.device)
    # [Bm, Hm, T, S] with Hm in {1, Hkv} -> [Bm, Hm, 1, T, S] broadcasts over the group's heads
    mask = mask.unsqueeze(2)
    qg = q.view(B, Hkv, G, T, Dk)
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32 softmax, fp64 stays fp64
    s = torch.einsum("bhgtd,bhsd->bhgts", qg, k).to(acc) * scale
    p, lse = masked_softmax(s, mask)
    out = torch.einsum("bhgts,bhsd->bhgtd", p.to(v.dtype), v)
    return out.reshape(B, Hq, T, -1), lse.reshape(B, Hq, T)


def compressed_sdpa_unsupported(q: Tensor, v: Tensor) -> str | None:
    """Why cuDNN's fused attention cannot run the compressed branch on these tensors (None: it
    can): CUDA on an sm_80+ GPU, bf16 / fp16, head dims multiples of 8 up to 256 (cuDNN's
    limits)."""
    dims = (q.shape[-1], v.shape[-1])
    if not q.is_cuda:
        return f"it needs CUDA tensors (got {q.device.type})"
    cap = torch.cuda.get_device_capability(q.device)  # a constant to torch.compile
    if cap < (8, 0):
        return f"cuDNN's fused attention needs an sm_80+ GPU (this one is sm_{cap[0]}{cap[1]})"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {q.dtype} (bf16 and fp16 only)"
    # torch._C._has_cudnn: a constant that torch.compile traces (cudnn.is_available() it cannot)
    if not torch._C._has_cudnn:
        return "this torch build has no cuDNN"
    if not all(x % 8 == 0 and x <= 256 for x in dims):
        return f"head dims {dims} (multiples of 8 up to 256)"
    return None


def _sdpa_lse(q: Tensor, k: Tensor, v: Tensor, scale: float,
              is_causal: bool = True) -> tuple[Tensor, Tensor]:
    """Causal (or, is_causal False, unmasked) attention with GQA (q heads a multiple of k's) and
    its lse [B, H, M] (natural log): cuDNN's fused kernels on CUDA (the private op returns the lse
    that SDPA's public call does not), the reference backend elsewhere (CPU tests of the
    packing)."""
    if q.is_cuda:
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, is_causal, False, scale=scale)
        return out[0], out[1].squeeze(-1)
    return attend_reference(q, k, v, causal() if is_causal else ALL_KEYS, scale)


# every query sees every key (the reference twin of unmasked SDPA)
ALL_KEYS = MaskSpec(lambda b, h, q_idx, kv_idx: (q_idx >= 0) & (kv_idx >= 0), name="all_keys")


@dataclass(frozen=True)
class CmpPacking:
    """Where query rows at positions q_offset .. q_offset + T - 1 fall in the compressed branch's
    groups: position t = l - 1 + m d + r (0 <= r < d) is row r of group m and sees compressed
    blocks 0..m. skip: rows before l - 1 (they see nothing); the other rows are groups g0 ..
    g0 + M - 1, the first starting `lead` positions before the first such row (padding), the last
    padded to d rows."""
    skip: int
    g0: int
    lead: int
    M: int

    @staticmethod
    def of(T: int, l: int, d: int, q_offset: int = 0) -> "CmpPacking":
        first = max(q_offset, l - 1)  # the first position that sees a block
        last = q_offset + T - 1
        if last < first:
            return CmpPacking(T, 0, 0, 0)
        g0, lead = divmod(first - (l - 1), d)
        return CmpPacking(first - q_offset, g0, lead, (last - (l - 1)) // d - g0 + 1)


def attend_compressed_sdpa(q: Tensor, k: Tensor, v: Tensor, l: int, d: int,
                           scale: float | None = None, q_offset: int = 0) -> tuple[Tensor, Tensor]:
    """The compressed-causal mask (query t sees compressed block i iff i d + l - 1 <= t) as plain
    causal attention, traced (cmp_kernel cudnn). Position t = l - 1 + m d + r (0 <= r < d) sees
    blocks 0..m, so the d positions of group m become d query rows at causal index m: q ->
    [B, Hq*d, M, Dk] (head h*d + r; GQA onto the Hkv key heads keeps head h's group), M groups
    (the first and last padded; `CmpPacking`), key i at index i. Positions before l - 1 see
    nothing (0, lse -inf). torch.compile fuses the packing into its neighbours; the backward keeps
    cuDNN's packed output and rebuilds the packed q from q (`repack_in_backward`; the layer keeps q
    anyway), `attend_compressed_lean` (cmp_kernel cudnn_lean) keeps neither packed copy.
    A sequence shard (q_offset > 0: row r is position r + q_offset, k and v the whole sequence's
    compressed keys): its groups g0 .. g0 + M - 1 see the keys before g0 all (one unmasked call)
    and keys g0 .. g0 + M - 1 causally (a causal call), merged exactly through their lse
    (`PrefixCausal`: the backward of each part from the merged output and lse)."""
    B, Hq, T, Dk, Hkv, S, G, scale = _dims(q, k, scale)
    pk = CmpPacking.of(T, l, d, q_offset)
    if pk.M == 0:  # no row sees a block yet
        out, lse = empty_attention(q, v)
        return out + 0 * k.sum(), lse  # k stays in the graph: its gradient is 0, not None
    if S < pk.g0 + pk.M:
        raise ValueError(f"attend_compressed_sdpa: {S} compressed keys for positions "
                         f"{q_offset}..{q_offset + T - 1}, l={l}, d={d} (expected at least "
                         f"{pk.g0 + pk.M})")
    n = T - pk.skip  # rows that see a block

    def packed(q, k, v):  # the packed q [B, Hq*d, M, Dk] and its attention (packed)
        qp = F.pad(q[:, :, pk.skip:], (0, 0, pk.lead, pk.M * d - pk.lead - n))
        qp = qp.view(B, Hq, pk.M, d, Dk).transpose(2, 3).reshape(B, Hq * d, pk.M, Dk)
        diag = slice(pk.g0, pk.g0 + pk.M)
        if pk.g0 == 0:
            return _sdpa_lse(qp, k[:, :, diag], v[:, :, diag], scale)
        return PrefixCausal.apply(qp, k[:, :, :pk.g0], v[:, :, :pk.g0], k[:, :, diag],
                                  v[:, :, diag], scale)

    out, lse = repack_in_backward(packed, q, k, v)

    def unpack(x, fill):  # [B, Hq*d, M, E] -> [B, Hq, T, E], rows before l - 1: fill
        x = x.view(B, Hq, d, pk.M, -1).transpose(2, 3).reshape(B, Hq, pk.M * d, -1)
        return F.pad(x[:, :, pk.lead: pk.lead + n], (0, 0, pk.skip, 0), value=fill)

    return unpack(out, 0.0), unpack(lse.unsqueeze(-1), float("-inf")).squeeze(-1)


# the packing's ops (slice, pad, views, the reshape's copy): what `repack_in_backward` recomputes
PACK_OPS = frozenset({torch.ops.aten.slice.Tensor, torch.ops.aten.constant_pad_nd.default,
                      torch.ops.aten.view.default, torch.ops.aten.transpose.int,
                      torch.ops.aten.permute.default, torch.ops.aten.expand.default,
                      torch.ops.aten.clone.default, torch.ops.aten._unsafe_view.default})


def _pack_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.PREFER_RECOMPUTE if op in PACK_OPS else CheckpointPolicy.MUST_SAVE


def repack_in_backward(fn, q: Tensor, *rest: Tensor):
    """fn(q, *rest) whose backward rebuilds what `PACK_OPS` made from its inputs (a packed copy of
    q: one copy kernel) instead of keeping it, and keeps every other op's output (the attention's
    output and lse): selective activation checkpointing. The same ops on the same inputs: outputs
    and gradients are bit for bit those of fn. Without grad: fn itself."""
    if not (torch.is_grad_enabled() and q.requires_grad):
        return fn(q, *rest)
    return checkpoint(fn, q, *rest, use_reentrant=False, preserve_rng_state=False,
                      context_fn=partial(create_selective_checkpoint_contexts, _pack_policy))


def shard_keys_missing(q: Tensor, k: Tensor, spec: MaskSpec) -> str | None:
    """Why k cannot be the keys of `spec`'s query rows (None: it can): a shard's rows at positions
    q_offset .. q_offset + T - 1 need the keys from position 0 through its last position."""
    need = spec.q_offset + q.shape[2]
    if k.shape[2] < need:
        return f"{k.shape[2]} keys for query positions up to {need - 1} (keys start at position 0)"
    return None


def triton_runs_on(x: Tensor) -> bool:
    """Whether our Triton ops can run on x's device: CUDA, or the CPU under TRITON_INTERPRET=1."""
    return HAS_TRITON and (x.is_cuda or triton_interpreted())


def selected_op_unsupported(q: Tensor, k: Tensor, v: Tensor, spec: MaskSpec) -> str | None:
    """Why our selected-attention op cannot run `spec` on these tensors (None: it can)."""
    if not HAS_TRITON:
        return "triton is not importable"
    why = selected_unsupported(q, k, v, spec.selection.l_sel) or shard_keys_missing(q, k, spec)
    if why is None and not triton_runs_on(q):
        why = f"it needs CUDA tensors (got {q.device.type}; on CPU only under TRITON_INTERPRET=1)"
    return why


def attend_selected(q: Tensor, k: Tensor, v: Tensor, spec: MaskSpec, scale: float | None = None,
                    tuning: SelectedTuning = DEFAULT_TUNING) -> tuple[Tensor, Tensor]:
    """A per-position block selection (`spec.selection`) through our Triton op
    (`nsa_flex.ops.selected_lists` builds its inputs from the mask)."""
    B, Hq, T, Dk, Hkv, S, G, scale = _dims(q, k, scale)
    return selected_attention(q, k, v, scale=scale,
                              **selected_lists(spec, B, T, S, G, Dk, q.device, tuning))


def attend_causal_sdpa(q: Tensor, k: Tensor, v: Tensor, spec: MaskSpec,
                       scale: float | None = None) -> tuple[Tensor, Tensor | None]:
    """The plain causal mask (`spec` is `masks.causal()`) on SDPA's fused kernels, on CUDA with as
    many keys as queries; elsewhere flex. No lse from SDPA: None."""
    B, Hq, T, Dk, Hkv, S, G, scale = _dims(q, k, scale)
    if not (q.is_cuda and S == T):
        return attend_flex(q, k, v, spec, scale)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                         enable_gqa=Hq != Hkv)
    return out, None


# flex's q and kv block size for a mask that is not per group (one BlockMask for every head)
FLEX_BLOCK = 128


def attend_flex(q: Tensor, k: Tensor, v: Tensor, spec: MaskSpec, scale: float | None = None
                ) -> tuple[Tensor, Tensor]:
    """Any mask on FlexAttention (see the module docstring)."""
    if k.shape[2] == 0:
        return empty_attention(q, v)
    if spec.parts is not None and q.is_cuda:  # CPU flex returns no lse: one call on the whole
        return merge_parts([attend_flex(q, k, v, p, scale) for p in spec.parts])
    if spec.kv_len is not None and spec.kv_len < k.shape[2]:  # keys past kv_len are never seen
        k, v = k[:, :, :spec.kv_len], v[:, :, :spec.kv_len]
    B, Hq, T, Dk, Hkv, S, G, scale = _dims(q, k, scale)
    if spec.per_group:
        # group-centric packing: [B, Hkv, G, T, D] -> [B, Hkv, T*G, D], row = t*G + g
        bs = packed_block_size(G, spec)
        qp = q.view(B, Hkv, G, T, Dk).transpose(2, 3).reshape(B, Hkv, T * G, Dk).contiguous()
        bm = spec.block_mask(B, T, S, device=q.device, block_size=bs, q_pack=G)
        out, lse = _flex_lse(qp, k, v, bm, scale, False, flex_kernel_options(q, bs))
        out = out.view(B, Hkv, T, G, -1).transpose(2, 3).reshape(B, Hq, T, -1)
        if lse is not None:
            lse = lse.view(B, Hkv, T, G).transpose(2, 3).reshape(B, Hq, T)
        return out, lse
    bm = spec.block_mask(B, T, S, device=q.device, block_size=FLEX_BLOCK)
    if expand_kv_heads(T, S, G, q.device):
        # few keys for many queries (the compressed branch, S ~ T/d): one K/V copy per query
        # head instead of GQA. flex's dK/dV pass runs one program per (kv tile, kv head) that
        # loops over the group's G heads; per query head there are G times the programs, each G
        # times shorter. The copies are small (S keys) and autograd sums their gradients.
        k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
        return _flex_lse(q, k, v, bm, scale, False, band_kernel_options(q))
    return _flex_lse(q, k, v, bm, scale, Hq != Hkv, band_kernel_options(q))


def expand_kv_heads(T: int, S: int, G: int, device) -> bool:
    """Whether attend_flex gives every query head its own copy of K/V (see there): on GPU, for
    grouped heads and at most a quarter as many keys as queries."""
    return G > 1 and torch.device(device).type == "cuda" and S * 4 <= T


def gate_mix_reference(g: Tensor, outs: list[Tensor]) -> Tensor:
    """Eq. 5 in torch: g [B, T, H, n] (sigmoid gates, one column per output), outs n x
    [B, H, T, Dv] -> [B, T, H*Dv]."""
    B, T = g.shape[:2]
    gh = g.permute(0, 2, 1, 3)  # [B, H, T, n]
    o = sum(gh[..., i: i + 1] * x for i, x in enumerate(outs))
    return o.transpose(1, 2).reshape(B, T, -1)


def mix_branches(g: Tensor, outs: list[Tensor], backend: str) -> Tensor:
    """The gate's mix (paper Eq. 5): g [B, T, H, n] sigmoid gates, one column per output, outs n x
    [B, H, T, Dv] -> [B, T, H*Dv], the output projection's layout. The flex backend on CUDA runs
    the fused op (`nsa_flex.ops.gate_triton`: torch.compile would otherwise fuse the sum into the
    window's flex forward, which is slower than both apart); the reference backend the torch
    math (`gate_mix_reference`)."""
    if resolve_backend(backend, outs[0].device) == "flex" and triton_runs_on(outs[0]):
        return gate_mix(g, outs)
    return gate_mix_reference(g, outs)


# ---------------------------------------------------------------------- the per-branch plan
def _run_flex(plan, q, k, v, spec, scale):
    return attend_flex(q, k, v, spec, scale)


def _run_sdpa(plan, q, k, v, spec, scale):
    return attend_causal_sdpa(q, k, v, spec, scale)


def _run_selected(plan, q, k, v, spec, scale):
    if spec.selection is None:  # the builder's mask is not a block selection this step
        return attend_flex(q, k, v, spec, scale)
    why = selected_op_unsupported(q, k, v, spec)
    if why is None:
        return attend_selected(q, k, v, spec, scale, plan.tuning)
    if plan.strict:
        raise RuntimeError(f"NSAConfig.sel_kernel='triton' cannot run here: {why}; use "
                           "sel_kernel='auto' or 'flex'")
    return attend_flex(q, k, v, spec, scale)


def _run_cudnn(plan, q, k, v, spec, scale):
    why = compressed_sdpa_unsupported(q, v)
    if why is None and plan.executor == "cudnn_lean" and not spec.q_offset:
        return attend_compressed_lean(q, k, v, *plan.cmp, scale)
    if why is None:  # the lean op takes rows as positions: a shard (q_offset > 0) runs traced
        return attend_compressed_sdpa(q, k, v, *plan.cmp, scale, spec.q_offset)
    if plan.strict:
        raise RuntimeError(f"NSAConfig.cmp_kernel={plan.executor!r} cannot run here: {why}; use "
                           "cmp_kernel='auto' or 'flex'")
    return attend_flex(q, k, v, spec, scale)


# executor name -> how the flex backend runs it (each falls back to flex where it cannot run)
EXECUTORS = {"flex": _run_flex, "sdpa": _run_sdpa, "selected": _run_selected,
             "cudnn": _run_cudnn, "cudnn_lean": _run_cudnn}


@dataclass(frozen=True)
class BranchPlan:
    """How one branch attends, chosen when the layer is built (`plan_branch`).

    backend: NSAConfig.backend ("auto": flex on CUDA, reference elsewhere, per call); executor /
    docs_executor: what runs on the flex backend in a step without / with documents (a name of
    EXECUTORS); strict: an executor other than flex that cannot run the call's tensors raises
    (the config named it: sel_kernel "triton", cmp_kernel "cudnn" / "cudnn_lean") instead of
    handing them to flex; cmp: (l, d) of the compressed-causal mask the cuDNN executors run;
    tuning: the selected op's settings."""
    backend: str = "auto"
    executor: str = "flex"
    docs_executor: str = "flex"
    strict: bool = False
    cmp: tuple[int, int] | None = None
    tuning: SelectedTuning = DEFAULT_TUNING

    def attend(self, q: Tensor, k: Tensor, v: Tensor, spec: MaskSpec, docs: bool = False,
               scale: float | None = None):
        """The branch's attention of q to (k, v) under `spec` (docs: the step has documents)."""
        if resolve_backend(self.backend, q.device) == "reference":
            return attend_reference(q, k, v, spec, scale)
        if k.shape[2] == 0:
            return empty_attention(q, v)
        return EXECUTORS[self.docs_executor if docs else self.executor](self, q, k, v, spec, scale)

    def prebuild(self, spec: MaskSpec, B: int, T: int, S: int, device, docs: bool) -> MaskSpec:
        """`spec` with the BlockMask that `attend` will read built now (`MaskSpec.with_block_mask`,
        the geometry `attend_flex` asks for: S keys, or the mask's kv_len), where this plan runs
        flex on `device` in a step with / without documents and the mask is one BlockMask for
        every head (not per group, not split into parts); else `spec` unchanged (the executor
        builds what it needs, as without a prebuild). For the masks every layer of a step shares
        (`nsa_flex.layer.step_masks`)."""
        flex = (resolve_backend(self.backend, device) == "flex"
                and (self.docs_executor if docs else self.executor) == "flex")
        if not flex or spec.per_group or spec.parts is not None or S == 0:
            return spec
        S = S if spec.kv_len is None else min(S, spec.kv_len)
        return spec.with_block_mask(B, T, S, device, FLEX_BLOCK)


def plan_branch(cfg, builder: str, tuning: SelectedTuning = DEFAULT_TUNING) -> BranchPlan:
    """The plan of a branch whose mask comes from builder `builder` (a registered name) under
    `cfg` (an NSAConfig): a selection builder's mask on our op unless sel_kernel is "flex"; the
    compressed-causal mask on cuDNN unless cmp_kernel is "flex", the plain causal mask on SDPA,
    each without documents only (`masks.builder_info(...).native`); every other mask on flex."""
    info = builder_info(builder)
    base = dict(backend=cfg.backend, tuning=tuning)
    if info.kind == "selection" and cfg.sel_kernel != "flex":
        return BranchPlan(**base, executor="selected", docs_executor="selected",
                          strict=cfg.sel_kernel == "triton")
    if info.native == "compressed_causal" and cfg.cmp_kernel != "flex":
        name = "cudnn_lean" if cfg.cmp_kernel == "cudnn_lean" else "cudnn"
        return BranchPlan(**base, executor=name, strict=cfg.cmp_kernel != "auto",
                          cmp=(cfg.l, cfg.d))
    if info.native == "causal":
        return BranchPlan(**base, executor="sdpa")
    return BranchPlan(**base)
