"""Selection scorer (paper Eq. 8-10): compressed attention probabilities -> block importance ->
top-n blocks per (position, GQA group).

Eq. 8  p_cmp = softmax(q . K_cmp^T) over the compressed blocks visible to the query. We reuse
       the compressed branch's log-sum-exp: p = exp(s - lse), no second softmax pass.
Eq. 9  p_slc[j] = sum_i w[i, j] p_cmp[i], with w[i, j] = |cmp block i ∩ sel block j| / d, the
       overlap in tokens of compressed block i = [i*d, i*d+l) and selection block j =
       [j*l', (j+1)*l') counted in strides. For l=32, d=16, l'=64 this is the paper's
       (1, 2, 2, 2, 1) pattern; for general l, d, l' the weights are fractional overlaps.
Eq. 10 summed over the heads of each GQA group, so a group shares one selection.
Top-n: block 0 (of the query's document) and the n_local most recent blocks always; ties to the
lower index; never a block that starts after the query; -1 pads rows with fewer valid blocks.

Memory: queries are processed in chunks of `chunk`, so the largest temporary is
[B, H, chunk, num_cmp], never [B, H, T, num_cmp]. The result has no gradient.
"""

import torch
from torch import Tensor

from masks import forced_and_valid, pick_blocks


def overlap_weights(n_cmp: int, n_sel: int, l: int, d: int, l_sel: int, device=None) -> Tensor:
    """w [n_cmp, n_sel]: tokens shared by compressed block i and selection block j, over d."""
    i = torch.arange(n_cmp, device=device, dtype=torch.float32).view(-1, 1)
    j = torch.arange(n_sel, device=device, dtype=torch.float32).view(1, -1)
    lo = torch.maximum(i * d, j * l_sel)
    hi = torch.minimum(i * d + l, (j + 1) * l_sel)
    return (hi - lo).clamp_min(0) / d


@torch.no_grad()
def block_scores(q: Tensor, k_cmp: Tensor, lse: Tensor | None, cfg, doc_starts: Tensor | None,
                 t0: int, t1: int, w: Tensor) -> Tensor:
    """Group importance p_slc [B, Hkv, t1-t0, Ns] of the selection blocks for queries t0..t1-1.

    q [B, Hq, T, Dk] (after RoPE), k_cmp [B, Hkv, Nc, Dk], lse [B, Hq, T] (natural log) of the
    compressed attention of the same queries."""
    B, Hq, T, Dk = q.shape
    Hkv, Nc = k_cmp.shape[1], k_cmp.shape[2]
    G = Hq // Hkv
    ns = w.shape[1]
    C = t1 - t0
    if Nc == 0:
        return q.new_zeros(B, Hkv, C, ns, dtype=torch.float32)
    qc = q[:, :, t0:t1].float().view(B, Hkv, G, C, Dk)
    s = torch.einsum("bhgtd,bhnd->bhgtn", qc, k_cmp.float()) * (Dk ** -0.5)
    t = torch.arange(t0, t1, device=q.device).view(C, 1)
    i = torch.arange(Nc, device=q.device).view(1, Nc)
    vis = (i * cfg.d + cfg.l - 1 <= t)  # compressed causal
    if doc_starts is not None:
        vis = vis.unsqueeze(0) & (i * cfg.d >= doc_starts[:, t0:t1].unsqueeze(-1))  # [B, C, Nc]
        vis = vis.view(-1, 1, 1, C, Nc)
    if lse is None:  # backend gave no lse: compute it (same rows, same mask)
        l_ = torch.logsumexp(s.masked_fill(~vis, float("-inf")), dim=-1, keepdim=True)
    else:
        l_ = lse[:, :, t0:t1].float().view(B, Hkv, G, C, 1)
    # rows that see no block have lse = -inf: exp(s - lse) would be inf, masked to 0 here
    p = torch.where(vis, torch.exp(s - torch.where(torch.isfinite(l_), l_, 0.0)), 0.0)
    p = p.sum(2)  # Eq. 10: sum over the heads of each group -> [B, Hkv, C, Nc]
    return p @ w  # Eq. 9


@torch.no_grad()
def select_topn(q: Tensor, k_cmp: Tensor, lse: Tensor | None, cfg, doc_starts: Tensor | None = None,
                chunk: int | None = None) -> Tensor:
    """Top-n selection block indices [B, Hkv, T, n_sel] (int64, -1 for unused slots)."""
    B, Hq, T, _ = q.shape
    Hkv, Nc = k_cmp.shape[1], k_cmp.shape[2]
    ns = -(-T // cfg.l_sel)
    w = overlap_weights(Nc, ns, cfg.l, cfg.d, cfg.l_sel, q.device)
    starts = doc_starts if doc_starts is not None else torch.zeros(1, T, dtype=torch.long,
                                                                   device=q.device)
    chunk = chunk or cfg.score_chunk
    out = []
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        p = block_scores(q, k_cmp, lse, cfg, doc_starts, t0, t1, w)
        valid, forced = forced_and_valid(cfg, T, starts, q.device, t0, t1)
        out.append(pick_blocks(p, valid.unsqueeze(1), forced.unsqueeze(1), cfg.n_sel))
    return torch.cat(out, dim=2)
