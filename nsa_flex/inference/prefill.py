"""Prefill of one NSAAttention layer: right-padded prompts through the layer's own forward, and
the branch keys / values written into its decode caches."""

import torch
from torch import Tensor

from masks import doc_start as doc_start_of

from .cache import NSACache
from .decode import branch_modes, cache_branches, project


@torch.no_grad()
def prefill(layer, x: Tensor, cache: NSACache, lengths: Tensor | list[int] | None = None,
            doc_ids: Tensor | None = None) -> Tensor:
    """Right-padded prompts x [B, T, dim] with per-row lengths (default: all T) -> the layer's
    outputs [B, T, dim] (positions >= lengths[b] are padding: ignore them) and filled caches.

    The outputs are the layer's own forward (every mask is causal, so padding after a row's last
    token changes nothing before it). doc_ids [B, T]: document masking as in the forward; the
    cache's doc_start is set to the document of each row's last prompt token (the caller moves
    it on when that token ends a document: see the model-level cache)."""
    cfg = layer.cfg
    modes = branch_modes(layer)
    B, T, _ = x.shape
    dev = x.device
    if lengths is None:
        lengths = torch.full((B,), T, dtype=torch.long, device=dev)
    lengths = torch.as_tensor(lengths, dtype=torch.long, device=dev)
    if T > cache.capacity:
        raise RuntimeError(f"prompt of {T} tokens > cache capacity {cache.capacity}")
    out = layer(x, doc_ids)
    _, kv = project(layer, x, torch.arange(T, device=dev), cache_branches(modes))

    def ring_fill(buf, src, size):
        # the last `size` positions before each row's length, position p into slot p % size
        p = lengths.view(B, 1) - size + torch.arange(size, device=dev)  # [B, size]
        H, D = src.shape[1], src.shape[-1]
        vals = src.gather(2, p.clamp(0, T - 1).view(B, 1, size, 1).expand(B, H, size, D))
        buf.scatter_(2, (p % size).view(B, 1, size, 1).expand(B, H, size, D), vals.to(buf.dtype))

    if "cmp" in kv:
        k, v = kv["cmp"]
        ring_fill(cache.k_raw, k, cfg.l)
        ring_fill(cache.v_raw, v, cfg.l)
        kc, vc = layer.phi_k(k), layer.phi_v(v)  # blocks past a row's length: masked, overwritten
        n = min(kc.shape[2], cache.n_cmp_slots)
        cache.k_cmp[:, :, :n] = kc[:, :, :n].to(cache.k_cmp.dtype)
        cache.v_cmp[:, :, :n] = vc[:, :, :n].to(cache.v_cmp.dtype)
    if "sel" in kv:
        k, v = kv["sel"]
        cache.k_sel[:, :, :T] = k.to(cache.k_sel.dtype)
        cache.v_sel[:, :, :T] = v.to(cache.v_sel.dtype)
    if "win" in kv:
        k, v = kv["win"]
        ring_fill(cache.k_win, k, cache.k_win.shape[2])
        ring_fill(cache.v_win, v, cache.v_win.shape[2])
    cache.lengths.copy_(lengths)
    cache.host_max_len = T
    if doc_ids is not None:
        last = (lengths - 1).clamp_min(0).view(B, 1)
        cache.doc_start.copy_(doc_start_of(doc_ids.long()).gather(1, last).view(B))
    else:
        cache.doc_start.zero_()
    return out
