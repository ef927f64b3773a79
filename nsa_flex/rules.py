"""The paper's block rules, each written once (NSA, arXiv 2502.11089); training, decode and the
Triton wrappers call these. Pure torch, a leaf: this module imports nothing from nsa_flex or
masks, so `masks` imports it at its top (nsa_flex -> masks -> nsa_flex.rules).

Indices are 0-based: token t, compressed block i covers tokens [i d, i d + l), selection block j
covers tokens [j l', (j+1) l').

Branches (Eq. 5): compressed, selected, window, in the gates' order (`BRANCHES`).
Compression (§3.3.1, Eq. 7): one compressed key per block of l tokens, stride d, over the tokens
  seen so far: `num_cmp(S) = floor((S - l) / d) + 1` blocks for S >= l tokens, 0 below; token t
  sees block i once the block has ended, i d + l - 1 <= t (`cmp_visible`).
Scores (Eq. 8-10): p_cmp = softmax(q K_cmp^T) (`masked_softmax`, the one softmax of both
  reference paths); Eq. 9 maps it to selection blocks by overlap, p_slc[j] = sum_i w[i, j]
  p_cmp[i] with w[i, j] the overlap of compressed block i and selection block j in strides of d
  (`overlap_kernel`, `map_to_selection_blocks`); Eq. 10 sums p_slc over a GQA group's heads.
Selection (§3.3.2):
  valid     a query at token t may select block j when the block starts at or before t and does
            not end before the first token of t's document
  forced    the paper's "1 initial block and 2 local blocks": the first block of t's document
            (n_init = 1) and the n_local most recent blocks (the one holding t and those before)
  top-n     forced blocks first, then by score, ties to the lower block, -1 pads (`pick_blocks`)
Ablation draws (not in the paper): uniform random scores (`random_topn`), recency (`local_topn`).
The hyperparameters these rules and the mask builders read are `LayerShape`'s fields, the first
fields of `nsa_flex.NSAConfig`.
"""

from dataclasses import dataclass, field

import torch
from torch import Tensor


BRANCHES = ("cmp", "sel", "win")  # Eq. 5's three branches, in the order of the gate columns


def knob(default, help: str, paper: str | None = None):
    """An NSAConfig field with its help text (and, for a paper hyperparameter, the section of
    arXiv 2502.11089 that defines it): the titan `[nsa]` section and `--nsa.*` flags
    (`nsa_flex/titan/job_config.py`) and the model args (`titan/args.py`) are derived from these
    fields (names, types, defaults, help)."""
    return field(default=default, metadata={"help": f"{help} (paper {paper})" if paper else help})


@dataclass
class LayerShape:
    """An NSA layer's shape and the paper's hyperparameters, with the paper's values: the fields
    the rules below and the mask builders read (`ctx.cfg`). `nsa_flex.NSAConfig` extends it with
    the implementation's knobs; `masks`' causality check runs builders on a small one."""
    # model dims (a titan decoder sets them from its flavor: MODEL_DIMS)
    dim: int = knob(2560, "model width")
    n_heads: int = knob(64, "query heads")
    n_kv_heads: int = knob(4, "key/value heads (GQA groups; n_heads is a multiple)")
    d_qk: int = knob(192, "query/key head dim")
    d_v: int = knob(128, "value head dim")
    # the paper's branch hyperparameters
    l: int = knob(32, "compression block length l", paper="§3.3.1, Eq. 7")
    d: int = knob(16, "compression stride d (divides l and l_sel)", paper="§3.3.1, Eq. 7")
    l_sel: int = knob(64, "selection block length l'", paper="§3.3.2, Eq. 9")
    n_sel: int = knob(16, "number of selected blocks n (including the forced initial/local blocks)",
                      paper="§3.3.2, Eq. 11")
    n_init: int = knob(1, "forced initial blocks (0 or 1)", paper="§3.3.2")
    n_local: int = knob(2, "forced local blocks", paper="§3.3.2")
    window: int = knob(512, "sliding-window size w", paper="§3.3.3")

    @property
    def group_size(self) -> int:
        return self.n_heads // self.n_kv_heads

    def num_cmp(self, seq_len: int) -> int:
        """Number of compressed blocks over seq_len tokens (`num_cmp`, Eq. 7)."""
        return num_cmp(seq_len, self.l, self.d)


# ---------------------------------------------------------------------- compression (Eq. 7)
def cmp_visible(i, t, l: int, d: int):
    """Whether token t sees compressed block i (tokens [i d, i d + l)): the block has ended,
    i d + l - 1 <= t. Elementwise on broadcastable i, t (ints or tensors)."""
    return i * d + l - 1 <= t


def num_cmp(S, l: int, d: int):
    """Compressed blocks over S tokens (an int, or an integer tensor elementwise): blocks end at
    i d + l - 1 <= S - 1, so floor((S - l) / d) + 1 of them, 0 when S < l."""
    n = (S - l) // d + 1
    return n.clamp_min(0) if isinstance(n, Tensor) else max(n, 0)


# ---------------------------------------------------------------------- scores (Eq. 8-10)
def masked_softmax(s: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Softmax over the last dim of the scores s where mask (broadcastable) is set: -> (p, lse
    [..., 1]), in s's dtype. A row that sees nothing gives p = 0 and lse = -inf (no NaN); the max
    subtracted for stability carries no gradient (the result does not depend on it)."""
    s = s.masked_fill(~mask, float("-inf"))
    mx = s.amax(-1, keepdim=True)
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx)).detach()
    e = torch.exp(s - mx)
    den = e.sum(-1, keepdim=True)
    return e / den.clamp_min(torch.finfo(s.dtype).tiny), torch.log(den) + mx


def overlap_kernel(l: int, d: int, l_sel: int, device=None) -> Tensor:
    """Eq. 9 weights as a strided 1-D kernel. With d | l and d | l' (validated), in units of d
    compressed block i covers [i, i + l/d) and selection block j covers [j r, j r + r), r = l'/d,
    so w[i, j] depends only on m = i - j r, for m in [-(l/d - 1), r - 1]:
    c[m] = |[m, m + l/d) ∩ [0, r)|. Returns c (float32, length r + l/d - 1). For l=32, d=16,
    l'=64 this is the paper's (1, 2, 2, 2, 1) pattern."""
    r, qn = l_sel // d, l // d
    m = torch.arange(-(qn - 1), r, device=device)
    return (torch.minimum(m + qn, torch.tensor(r, device=device)) - m.clamp_min(0)).float()


_OVERLAP: dict = {}


def overlap_kernel_cached(l: int, d: int, l_sel: int, device, dtype=torch.float32) -> Tensor:
    """`overlap_kernel` made once per (device, dtype): for decode, where a CUDA graph cannot
    capture the host-scalar copy that building it takes."""
    key = (l, d, l_sel, str(device), dtype)
    if key not in _OVERLAP:
        _OVERLAP[key] = overlap_kernel(l, d, l_sel, device).to(dtype).contiguous()
    return _OVERLAP[key]


def map_to_selection_blocks(p: Tensor, n_sel_blocks: int, l: int, d: int, l_sel: int,
                            c: Tensor | None = None) -> Tensor:
    """Eq. 9: p_cmp [..., Nc] -> p_slc [..., Ns], p_slc[j] = sum_m c[m] p_cmp[j*r + m].

    A strided window sum (unfold view + one small product), O(Ns * (r + l/d)) per row. c: the
    `overlap_kernel` in p's dtype (default: made here)."""
    c = overlap_kernel(l, d, l_sel, p.device).to(p.dtype) if c is None else c
    r, M = l_sel // d, c.numel()
    left = l // d - 1
    need = (n_sel_blocks - 1) * r + M  # padded length the last window reaches
    right = max(0, need - left - p.shape[-1])
    pp = torch.nn.functional.pad(p, (left, right))
    return pp.unfold(-1, M, r)[..., :n_sel_blocks, :] @ c


# ---------------------------------------------------------------------- selection (§3.3.2)
def valid_blocks(t: Tensor, start: Tensor, ns: int, l_sel: int) -> Tensor:
    """[..., ns] blocks a query at token t may select: j l' <= t and (j+1) l' - 1 >= start.
    t, start: broadcastable [..., 1] (the query's token, its document's first token)."""
    j = torch.arange(ns, device=t.device)
    return (j * l_sel <= t) & ((j + 1) * l_sel - 1 >= start)


def is_forced(j: Tensor, t: Tensor, start, l_sel: int, n_init: int, n_local: int) -> Tensor:
    """Whether block j is forced for a query at token t whose document starts at `start` (paper
    §3.3.2): the document's first block (n_init = 1) or one of the n_local most recent blocks (t's
    own block and the n_local - 1 before it). Elementwise on broadcastable j, t, start; a forced
    block is selected only where it is also valid (`valid_blocks`)."""
    cur = torch.div(t, l_sel, rounding_mode="floor")
    forced = (j > cur - n_local) & (j <= cur)  # empty when n_local = 0
    if n_init:
        forced = forced | (j == torch.div(start, l_sel, rounding_mode="floor"))
    return forced


def block_rules(t: Tensor, start: Tensor, ns: int, l_sel: int, n_init: int, n_local: int
                ) -> tuple[Tensor, Tensor]:
    """(valid, forced) [..., ns] for queries at tokens t whose documents start at `start`
    (broadcastable [..., 1]): `valid_blocks`, and among them the forced ones, the document's first
    block (n_init = 1) and the n_local most recent blocks (t's own block and the n_local - 1
    before it)."""
    valid = valid_blocks(t, start, ns, l_sel)
    j = torch.arange(ns, device=t.device)
    return valid, is_forced(j, t, start, l_sel, n_init, n_local) & valid


def forced_and_valid(cfg, T: int, starts: Tensor, device, t0: int = 0, t1: int | None = None
                     ) -> tuple[Tensor, Tensor]:
    """`block_rules` for queries t0..t1-1 of a T-token sequence: [B|1, t1-t0, Ns] masks (valid,
    forced), Ns = ceil(T / l'). starts [B|1, T]: first token of each position's document."""
    t1 = T if t1 is None else t1
    t = torch.arange(t0, t1, device=device).view(1, -1, 1)
    return block_rules(t, starts[:, t0:t1].unsqueeze(-1), -(-T // cfg.l_sel), cfg.l_sel,
                       cfg.n_init, cfg.n_local)


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


def all_blocks(cfg, B: int, T: int, starts: Tensor, device, t0: int = 0, t1: int | None = None
               ) -> Tensor:
    """Every valid block, forced first, [B, Hkv, t1-t0, Ns]: the selection of the dense warm-up
    (`NSAConfig.sel_dense_steps`), under which the selected branch reads every earlier key."""
    valid, forced = forced_and_valid(cfg, T, starts, device, t0, t1)
    idx = pick_blocks(forced.float(), valid, forced, valid.shape[-1]).unsqueeze(1)
    return idx.expand(B, cfg.n_kv_heads, -1, -1)


# ---------------------------------------------------------------------- ablation draws
def hash_uniform(B: int, H: int, T: int, N: int, step, device) -> Tensor:
    """Reproducible uniform [0, 1) numbers [B, H, T, N] from a counter hash of (index, step):
    tensor ops only, so it traces into a compiled graph (no generator state)."""
    # every literal fits in int32: Inductor may index with int32 and Triton rejects a larger
    # scalar there ("Scalar 2654435761 is out of range for type int32")
    m = 0x7FFFFFFF
    i = torch.arange(B * H * T * N, device=device, dtype=torch.long).view(B, H, T, N)
    x = ((i + 1) * 0x1E3779B1 + torch.as_tensor(step, device=device) * 0x05EBCA77) & m
    for _ in range(2):
        x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & m
        x = ((x ^ (x >> 12)) * 0x297A2D39) & m
    return (x & 0xFFFFFF).float() / float(1 << 24)


def random_draw_step(x: Tensor, seed: int) -> Tensor:
    """The random_selection draw's step [B, 1, T, 1]: a hash of each token's own input (causal),
    so activation checkpointing's recompute and a resumed run draw the same blocks."""
    B, T = x.shape[:2]
    h = x.detach().float().sum(-1).view(torch.int32).long()  # [B, T]
    return h.view(B, 1, T, 1) + seed * 1_000_003


def random_topn(cfg, B: int, T: int, starts: Tensor, step, device) -> Tensor:
    """random_selection: the forced blocks, then blocks by `hash_uniform` scores, [B, Hkv, T, n]."""
    valid, forced = forced_and_valid(cfg, T, starts, device)
    scores = hash_uniform(B, cfg.n_kv_heads, T, valid.shape[-1], step, device)
    return pick_blocks(scores, valid.unsqueeze(1), forced.unsqueeze(1), cfg.n_sel)


def local_topn(cfg, B: int, T: int, starts: Tensor, device) -> Tensor:
    """local_selection: the forced blocks, then the most recent valid ones, [B, Hkv, T, n]."""
    valid, forced = forced_and_valid(cfg, T, starts, device)
    recency = torch.arange(valid.shape[-1], device=device, dtype=torch.float32).expand(valid.shape)
    idx = pick_blocks(recency, valid, forced, cfg.n_sel).unsqueeze(1)
    return idx.expand(B, cfg.n_kv_heads, T, cfg.n_sel)
