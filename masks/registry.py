"""Branch mask builders by name, and presets of one builder per NSA branch.

Contract of a branch mask builder (register your own with `register_mask_builder`):

    builder(ctx: MaskContext) -> MaskSpec | None      # None switches the branch off

`ctx` holds the layer's config and this step's inputs (sequence length, document ids and, for
selection builders, `ctx.topn()`, the scorer's top-n block indices [B, n_kv_heads, T, n_sel]).
A builder is called every step, so it may depend on the data. It must be strictly causal and,
for the selection branch, give every head of a GQA group the same mask (heads = n_kv_heads).
`kind` says which branch accepts it: "compressed" (kv index = compressed block), "selection"
(per-group token mask), or "token" (token mask; accepted by the selection and window branches).
"""

from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import Tensor

from .builders import (causal, compressed_causal, doc_start, document, drop_forced, forced_parts,
                       selection, sliding_window)
from .core import MaskSpec, and_masks


@dataclass
class MaskContext:
    cfg: object  # NSAConfig
    batch: int
    seq_len: int
    device: torch.device
    doc_ids: Tensor | None = None
    topn: Callable[[], Tensor] | None = None  # scorer -> [B, n_kv_heads, T, n_sel]
    # varies the random_selection draw: an int, or a tensor broadcastable to [B, H, T, Ns]
    step: Tensor | int = 0

    def with_docs(self, spec: MaskSpec, kv_stride: int = 1, kv_span: int = 1) -> MaskSpec:
        if self.doc_ids is None:
            return spec
        return and_masks(spec, document(self.doc_ids, kv_stride, kv_span))

    def doc_start(self) -> Tensor:
        if self.doc_ids is None:
            return torch.zeros(1, self.seq_len, dtype=torch.long, device=self.device)
        return doc_start(self.doc_ids.long())


_REGISTRY: dict[str, tuple[str, Callable[[MaskContext], MaskSpec | None]]] = {}


def register_mask_builder(name: str, kind: str, fn: Callable[[MaskContext], MaskSpec | None]):
    if kind not in ("compressed", "selection", "token"):
        raise ValueError(f"kind={kind!r}: allowed values are 'compressed', 'selection', 'token'")
    if name in _REGISTRY:
        raise ValueError(f"mask builder {name!r} is already registered")
    _REGISTRY[name] = (kind, fn)
    return fn


def get_mask_builder(name: str) -> Callable[[MaskContext], MaskSpec | None]:
    if name not in _REGISTRY:
        raise KeyError(f"unknown mask builder {name!r}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[name][1]


def list_mask_builders(branch: str | None = None) -> list[str]:
    """Builder names a branch accepts: "compressed", "selection" (selection + token builders),
    "token" (window branch), or all."""
    ok = {None: ("compressed", "selection", "token"), "compressed": ("compressed",),
          "selection": ("selection", "token"), "token": ("token",)}[branch]
    return sorted(n for n, (k, _) in _REGISTRY.items() if k in ok or n == "none")


# ---------------------------------------------------------------------- built-in builders
def _none(ctx):
    return None


def _causal(ctx):
    return ctx.with_docs(causal())


def _sliding(ctx):
    return ctx.with_docs(sliding_window(ctx.cfg.window))


def _compressed(ctx):
    c = ctx.cfg
    return ctx.with_docs(compressed_causal(c.l, c.d), kv_stride=c.d, kv_span=c.l)


def _topn(ctx):
    return selection_parts(ctx, ctx.topn())


def selection_parts(ctx, idx: Tensor) -> MaskSpec:
    """The selection mask of the picked blocks idx [B, H, T, n] (every forced block among them, as
    `pick_blocks` guarantees), with the same mask as disjoint parts: the forced blocks (static
    bands with ordinary q blocks and GQA, `forced_parts`) and the rest. Packed with the rest, block 0 made one dK/dV program walk every query
    (two thirds of the branch's backward at 64k, experiments/NOTES.md 21)."""
    c = ctx.cfg
    whole = ctx.with_docs(selection(idx, c.l_sel))
    starts = None if ctx.doc_ids is None else ctx.doc_start()
    forced = forced_parts(c.l_sel, c.n_init, c.n_local, starts)
    if not forced:
        return whole
    rest = selection(drop_forced(idx, c.l_sel, c.n_init, c.n_local, starts), c.l_sel)
    return replace(whole, parts=tuple(ctx.with_docs(p) for p in (*forced, rest)))


def forced_and_valid(cfg, T: int, starts: Tensor, device, t0: int = 0, t1: int | None = None
                     ) -> tuple[Tensor, Tensor]:
    """[B|1, t1-t0, Ns] masks of the blocks queries t0..t1-1 may select (start <= t, not wholly
    before the query's document) and the forced ones (the document's first block, the n_local
    most recent blocks). starts [B|1, T]: first token of each position's document."""
    t1 = T if t1 is None else t1
    ns = -(-T // cfg.l_sel)
    t = torch.arange(t0, t1, device=device).view(1, -1, 1)
    j = torch.arange(ns, device=device).view(1, 1, ns)
    s = starts[:, t0:t1].unsqueeze(-1)
    valid = (j * cfg.l_sel <= t) & ((j + 1) * cfg.l_sel - 1 >= s)
    cur = t // cfg.l_sel
    forced = (j > cur - cfg.n_local) & (j <= cur) if cfg.n_local > 0 else torch.zeros_like(valid)
    if cfg.n_init:
        forced = forced | (j == s // cfg.l_sel)
    return valid, forced & valid


def pick_blocks(scores: Tensor, valid: Tensor, forced: Tensor, n: int) -> Tensor:
    """Top-n blocks per row: forced first, then by score, ties to the lower index; -1 pads.

    scores [..., Ns] (>= 0) -> indices [..., n]. Exact and deterministic: each candidate is one
    int64 key (float bits of the score << 32 | reversed index), so a plain top-k orders by score
    and breaks ties toward the lower block, whatever the chunking or the device."""
    ns = scores.shape[-1]
    bits = scores.float().clamp_min(0).view(torch.int32).long()
    bits = torch.where(forced, 0x7F800000, bits)  # +inf: forced blocks first
    bits = torch.where(valid, bits, -1)  # never an invalid block (below every valid key)
    j = torch.arange(ns, device=scores.device)
    key = bits * (1 << 32) + (ns - 1 - j)
    if ns < n:
        key = torch.cat([key, key.new_full((*key.shape[:-1], n - ns), -(1 << 62))], -1)
    top = torch.topk(key, n, dim=-1, sorted=True).values
    return torch.where(top < 0, -1, ns - 1 - (top & 0xFFFFFFFF))


def hash_uniform(B: int, H: int, T: int, N: int, step, device) -> Tensor:
    """Reproducible uniform [0, 1) numbers [B, H, T, N] from a counter hash of (index, step):
    tensor ops only, so it traces into a compiled graph (no generator state)."""
    # every literal fits in int32: Inductor may index with int32 and Triton rejects a larger
    # scalar there ("Scalar 2654435761 is out of range for type int32", H100 ablation run)
    m = 0x7FFFFFFF
    i = torch.arange(B * H * T * N, device=device, dtype=torch.long).view(B, H, T, N)
    x = ((i + 1) * 0x1E3779B1 + torch.as_tensor(step, device=device) * 0x05EBCA77) & m
    for _ in range(2):
        x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & m
        x = ((x ^ (x >> 12)) * 0x297A2D39) & m
    return (x & 0xFFFFFF).float() / float(1 << 24)


def _random(ctx):
    c = ctx.cfg
    T = ctx.seq_len
    valid, forced = forced_and_valid(c, T, ctx.doc_start(), ctx.device)
    ns = valid.shape[-1]
    scores = hash_uniform(ctx.batch, c.n_kv_heads, T, ns, ctx.step, ctx.device)
    idx = pick_blocks(scores, valid.unsqueeze(1), forced.unsqueeze(1), c.n_sel)
    return selection_parts(ctx, idx)


def _local(ctx):
    c = ctx.cfg
    T = ctx.seq_len
    valid, forced = forced_and_valid(c, T, ctx.doc_start(), ctx.device)
    ns = valid.shape[-1]
    recency = torch.arange(ns, device=ctx.device, dtype=torch.float32).expand(valid.shape)
    idx = pick_blocks(recency, valid, forced, c.n_sel).unsqueeze(1)
    idx = idx.expand(ctx.batch, c.n_kv_heads, T, c.n_sel)
    return selection_parts(ctx, idx)


register_mask_builder("none", "token", _none)
register_mask_builder("causal", "token", _causal)
register_mask_builder("sliding_window", "token", _sliding)
register_mask_builder("compressed_causal", "compressed", _compressed)
register_mask_builder("topn", "selection", _topn)
register_mask_builder("random_selection", "selection", _random)
register_mask_builder("local_selection", "selection", _local)

# preset name -> (compressed branch, selection branch, window branch) builder names
PRESETS: dict[str, tuple[str, str, str]] = {
    "nsa": ("compressed_causal", "topn", "sliding_window"),
    "full_causal": ("none", "causal", "none"),
    "sliding_only": ("none", "none", "sliding_window"),
    "random_selection": ("compressed_causal", "random_selection", "sliding_window"),
    "local_selection": ("compressed_causal", "local_selection", "sliding_window"),
    "no_compressed": ("none", "topn", "sliding_window"),
}
