"""Selection distillation (optional, `NSAConfig.sel_distill > 0`; not in the paper).

The top-n selection (Eq. 8-11) has no gradient: the compressed keys learn where a query should
look only through the compressed branch's own blurred output. DeepSeek's DSA trains its indexer
with a KL loss toward the main attention's mass; here the same for NSA's scorer, per layer:

    target[j] = what q and the selected branch's keys would put on selection block j under dense
                causal attention (softmax over every visible key, summed over the block's keys,
                Eq. 10's mean over the group's heads) -- no gradient;
    pred[j]   = Eq. 8-10's p_slc from the compressed keys (q detached, the keys recomputed from the
                layer's detached input: only the compressed keys' projection and phi learn from it),
                or, with `sel_scores = "indexer"`, the indexer's block masses (nsa_flex/indexer.py:
                only the indexer learns from it);
    loss      = KL(target || pred) over the blocks the scores choose among (valid, not forced:
                block 0 and the local blocks are picked whatever the scores), each renormalized,
                averaged over the (position, KV group) rows that have such blocks.

Both sides are attention calls: block masses are an attention output whose values are each key's
one-hot selection block (target; keys -> blocks) or Eq. 9's overlap weights (pred; compressed
blocks -> blocks), so the flex backend runs them fused and never holds a [T, T] score matrix.
The dense target costs about one causal attention forward over the sequence (values: the one-hot
selection blocks, at most MAX_VALUE_WIDTH of them a call, each call over its blocks' keys alone:
`token_block_mass`), so at long context it takes back part of NSA's speed in training (never in
evaluation or decoding).

The loss enters through the layer's output (`attach_loss`: an identity whose backward also seeds
the loss), so the trainer's loss, its logs and validation are unchanged.
"""

import torch
from torch import Tensor

from masks import MaskSpec, and_masks, key_range

from .attention import attend_flex, attend_reference
from .config import resolve_backend
from .ops.utils import lse_weights
from .rules import forced_and_valid, map_to_selection_blocks

EPS = 1e-6  # floor of pred's renormalized probabilities inside the log (bf16 underflow)


def value_width(ns: int) -> int:
    """The values' head dim for ns selection blocks: a power of two >= 16 (flex's tiles)."""
    return max(16, 1 << (ns - 1).bit_length())


# The widest values one attention call of block_mass takes: flex's forward keeps a q tile and, per
# pipeline stage, a k and a v tile in shared memory. Its H100 / H200 default at d_qk 64 in bf16
# (128 x 128 tiles, 3 stages) needs 262144 bytes at 256 value columns (16k tokens: 256 selection
# blocks), over the card's 232448, so inductor finds no config; at 128 columns 163840.
MAX_VALUE_WIDTH = 128


def block_onehot(S: int, l_sel: int, width: int, device, dtype) -> Tensor:
    """[S, width]: key s -> one-hot of its selection block s // l_sel."""
    return torch.nn.functional.one_hot(torch.arange(S, device=device) // l_sel, width).to(dtype)


def overlap_values(nc: int, ns: int, cfg, width: int, device, dtype) -> Tensor:
    """[nc, width]: compressed block i -> Eq. 9's weights w[i, j] on the selection blocks j."""
    w = map_to_selection_blocks(torch.eye(nc, device=device), ns, cfg.l, cfg.d, cfg.l_sel)
    return torch.nn.functional.pad(w, (0, width - ns)).to(dtype)


def block_mass(q: Tensor, k: Tensor, values: Tensor, spec: MaskSpec, backend: str) -> Tensor:
    """Each query head's attention mass on the columns of `values` ([S, width], shared by every
    batch row and KV head) -> [B, Hkv, T, width] fp32, the mean over each GQA group's heads.
    Wider values than MAX_VALUE_WIDTH go in column slices, one attention call each (an output
    column depends on its value column alone, so the slices' outputs are the whole call's)."""
    B, H, T, _ = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    attend = attend_reference if resolve_backend(backend, q.device) == "reference" else attend_flex
    outs = [attend(q, k, values[:, c:c + MAX_VALUE_WIDTH].contiguous().expand(B, Hkv, S, -1), spec)[0]
            for c in range(0, values.shape[-1], MAX_VALUE_WIDTH)]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, -1)
    return out.float().view(B, Hkv, H // Hkv, T, -1).mean(2)


def token_block_mass(q: Tensor, k: Tensor, spec: MaskSpec, l_sel: int, backend: str) -> Tensor:
    """Each query head's attention mass on the selection blocks of its token keys (key s in block
    s // l_sel) -> [B, Hkv, T, Ns] fp32, the mean over each GQA group's heads: `block_mass` of the
    one-hot values. Over MAX_VALUE_WIDTH blocks, one attention call per span of that many blocks
    over the span's keys alone (`key_range`; a block's mass depends on its own keys only), each
    rescaled to the whole softmax by the spans' log-sum-exps: about one causal pass at any length,
    where a call per column slice over every key costs a pass each. CPU flex returns no
    log-sum-exp: there the column slices."""
    B, H, T, _ = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    ns, W = -(-S // l_sel), MAX_VALUE_WIDTH
    reference = resolve_backend(backend, q.device) == "reference"
    if value_width(ns) <= W or not (reference or q.is_cuda):
        return block_mass(q, k, block_onehot(S, l_sel, value_width(ns), q.device, q.dtype), spec,
                          backend)[..., :ns]
    attend = attend_reference if reference else attend_flex
    span = W * l_sel
    onehot = block_onehot(span, l_sel, W, q.device, q.dtype)
    outs, lses = [], []
    for lo in range(0, S, span):
        hi = min(lo + span, S)
        v = torch.nn.functional.pad(onehot[:hi - lo], (0, 0, lo, 0))  # keys before the span: 0
        out, lse = attend(q, k[:, :, :hi], v.expand(B, Hkv, hi, W), and_masks(spec, key_range(lo, hi)))
        outs.append(out)
        lses.append(lse)
    w, _ = lse_weights(lses, torch.promote_types(q.dtype, torch.float32))  # a span unseen: 0
    out = torch.cat([o.to(w.dtype) * w[i].unsqueeze(-1) for i, o in enumerate(outs)], -1)
    return out.float().view(B, Hkv, H // Hkv, T, -1).mean(2)[..., :ns]


def selected_target(q: Tensor, k_sel: Tensor, cfg, causal_spec: MaskSpec) -> Tensor:
    """The target (module docstring): the mass q [B, H, T, d_qk] and the selected branch's keys
    k_sel [B, Hkv, T, d_qk] put on each selection block under dense causal attention (causal_spec,
    documents included), the mean over each GQA group's heads -> [B, Hkv, T, Ns] fp32, no gradient."""
    with torch.no_grad():
        return token_block_mass(q.detach(), k_sel.detach(), causal_spec, cfg.l_sel, cfg.backend)


def block_kl(target: Tensor, pred: Tensor, cfg, starts: Tensor | None) -> Tensor:
    """KL(target || pred) over the blocks the scores choose among (valid, not forced), each side
    renormalized there, averaged over the (position, KV group) rows that have such blocks; target,
    pred [B, Hkv, T, Ns] block masses, starts [B, T] each position's document start (None: one
    document). A scalar fp32 with pred's gradient."""
    T = target.shape[2]
    if starts is None:
        starts = torch.zeros(1, T, dtype=torch.long, device=target.device)
    valid, forced = forced_and_valid(cfg, T, starts, target.device)
    free = (valid & ~forced).unsqueeze(1).float()  # [B|1, 1, T, Ns]
    target, pred = target * free, pred * free
    tz = target.sum(-1, keepdim=True)
    rows = (tz > 0).float()  # rows with free blocks (the target then puts mass on them)
    t = target / tz.clamp_min(torch.finfo(torch.float32).tiny)
    p = pred / pred.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    kl = (torch.special.xlogy(t, t) - t * torch.log(p.clamp_min(EPS))).sum(-1, keepdim=True)
    return (kl * rows).sum() / rows.sum().clamp_min(1.0)


def distill_kl(q: Tensor, k_cmp: Tensor, k_sel: Tensor, cfg, cmp_spec: MaskSpec,
               causal_spec: MaskSpec, starts: Tensor | None) -> Tensor:
    """The layer's selection-distillation loss for the compressed keys (module docstring), a
    scalar fp32.

    q [B, H, T, d_qk] (after RoPE; detached here), k_cmp [B, Hkv, Nc, d_qk] (the one input with
    a gradient), k_sel [B, Hkv, T, d_qk] the selected branch's keys (detached here); cmp_spec: the
    compressed branch's mask (its documents included), causal_spec: causal over the selected branch's
    keys (documents included); starts [B, T] each position's document start, None without documents."""
    T = q.shape[2]
    ns, nc = -(-T // cfg.l_sel), k_cmp.shape[2]
    if nc == 0:  # no compressed block yet: nothing to learn, and k_cmp stays in the graph
        return k_cmp.sum().float() * 0
    q = q.detach()
    target = selected_target(q, k_sel, cfg, causal_spec)
    pred = block_mass(q, k_cmp, overlap_values(nc, ns, cfg, value_width(ns), q.device, q.dtype),
                      cmp_spec, cfg.backend)[..., :ns]
    return block_kl(target, pred, cfg, starts)


class _AttachLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: Tensor, loss: Tensor) -> Tensor:
        ctx.save_for_backward(loss)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss)


def attach_loss(y: Tensor, loss: Tensor) -> Tensor:
    """y unchanged; its backward also seeds `loss` (a scalar) with gradient 1, as if `loss` were
    added to the trainer's loss (not scaled by a gradient accumulation's 1 / steps)."""
    return _AttachLoss.apply(y, loss)
