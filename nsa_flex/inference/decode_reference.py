"""The decode step's reference: torch ops, any device (the naive path beside the fused op in
`decode_fused.py`, as `attention.attend_reference` is for training).

One new token per row at positions `pos` (right padding, see cache.py), after its keys and values
are written (`write_token`), then the reads (`attend_cached`), per branch:
  cmp  all compressed blocks of the stream, masked to the visible ones (i d + l <= S)
  sel  the current token's compressed scores (Eq. 8), mapped to selection blocks (Eq. 9), summed
       over each GQA group's heads (Eq. 10), top-n with the forced blocks (the document's first
       block, the n_local most recent) and ties to the lower index: `nsa_flex.rules.pick_blocks`,
       the function `select_topn` uses; then a gather of the n selected blocks (n * l' tokens)
  win  the rolling ring of the last `window` tokens
The math is the reference backend's (fp32 scores, -inf masking, rows with no key give 0),
whatever `cfg.backend` is.
"""

import math

import torch
from torch import Tensor

from ..rules import (BRANCHES, block_rules, map_to_selection_blocks, masked_softmax, num_cmp,
                     overlap_kernel_cached, pick_blocks)
from .cache import NSACache


def _attend(s: Tensor, mask: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Masked softmax attention, the reference backend's math. s [B, Hkv, G, N] fp32 scores,
    mask broadcastable to s, v [B, Hkv, N, Dv] -> out [B, Hkv, G, Dv], lse [B, Hkv, G]."""
    p, lse = masked_softmax(s, mask)
    return torch.einsum("bhgn,bhnd->bhgd", p.to(v.dtype), v), lse.squeeze(-1)


def _write(buf: Tensor, slot: Tensor, val: Tensor) -> None:
    """buf[b, :, slot[b]] = val[b, :, 0] for every row b (one scatter, no sync)."""
    B, H, _, D = buf.shape
    buf.scatter_(2, slot.view(B, 1, 1, 1).expand(B, H, 1, D), val)


def select_blocks(cfg, mode: str, p: Tensor | None, pos: Tensor, start: Tensor, ns: int,
                  Hkv: int) -> Tensor:
    """Selection block indices [B, Hkv, n_sel] (-1 unused) for tokens at positions pos [B].
    p [B, Hkv, ns] group importance (Eq. 9-10) for "topn"; recency for "local_selection"."""
    valid, forced = block_rules(pos.view(-1, 1), start.view(-1, 1), ns, cfg.l_sel, cfg.n_init,
                                cfg.n_local)
    if mode == "local_selection":
        p = torch.arange(ns, device=pos.device, dtype=torch.float32).expand(pos.shape[0], Hkv, ns)
    return pick_blocks(p, valid.unsqueeze(1), forced.unsqueeze(1), cfg.n_sel)


def _qk(qg: Tensor, k: Tensor) -> Tensor:
    """Scores q.K [B, Hkv, G, N] in the inputs' dtype, then fp32 (as the reference backend).
    On CUDA as K @ q^T (a tall-skinny GEMM; the [G, N] orientation picks a slow kernel)."""
    if qg.is_cuda:
        return torch.matmul(k, qg.transpose(-1, -2)).transpose(-1, -2).float()
    return torch.einsum("bhgd,bhnd->bhgn", qg, k).float()


def emit_compressed(cfg, cache: NSACache, phi_k, phi_v) -> None:
    """Emit the compressed block completed by the token at cache.lengths (already in the raw
    ring): block (S - l) / d for S = pos + 1, when S >= l and d | S - l; other rows rewrite the
    slot's old value (branch-free, no host sync)."""
    pos = cache.lengths
    B = pos.shape[0]
    S = pos + 1
    l, d, Nc = cfg.l, cfg.d, cache.n_cmp_slots
    order = (S.view(B, 1) - l + torch.arange(l, device=pos.device)) % l  # ring slots, in order
    emit = (S >= l) & ((S - l) % d == 0)
    dst = torch.div(S - l, d, rounding_mode="floor").clamp(0, Nc - 1)
    for raw, buf, phi in ((cache.k_raw, cache.k_cmp, phi_k), (cache.v_raw, cache.v_cmp, phi_v)):
        Hkv, D = raw.shape[1], raw.shape[-1]
        blk = raw.gather(2, order.view(B, 1, l, 1).expand(B, Hkv, l, D))
        idx = dst.view(B, 1, 1, 1).expand(B, Hkv, 1, buf.shape[-1])
        val = torch.where(emit.view(B, 1, 1, 1), phi(blk).to(buf.dtype), buf.gather(2, idx))
        buf.scatter_(2, idx, val)


def write_token(cfg, modes: dict[str, str], kv: dict, cache: NSACache, phi_k, phi_v) -> None:
    """Write the new token (kv[branch] = (k [B, Hkv, 1, Dk], v [B, Hkv, 1, Dv])) at positions
    cache.lengths into every stream; emit the compressed block that the token completes (block
    (S - l) / d for S = pos + 1, when S >= l and d | S - l; other rows rewrite the slot's old
    value: branch-free, no host sync). All cache mutation of a decode step happens here."""
    pos = cache.lengths
    if "cmp" in kv:
        k, v = kv["cmp"]
        _write(cache.k_raw, pos % cfg.l, k)
        _write(cache.v_raw, pos % cfg.l, v)
        if cache.n_cmp_slots > 0:
            emit_compressed(cfg, cache, phi_k, phi_v)
    if modes["sel"] != "none":
        k, v = kv["sel"]
        _write(cache.k_sel, pos, k)
        _write(cache.v_sel, pos, v)
    if modes["win"] != "none":
        k, v = kv["win"]
        W = cache.k_win.shape[2]
        _write(cache.k_win, pos % W, k)
        _write(cache.v_win, pos % W, v)


def _sdpa(qg: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Masked attention by F.scaled_dot_product_attention (one fused kernel on CUDA); only for
    branches where every row sees at least one key (selection, window)."""
    return torch.nn.functional.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)


def attend_cached(cfg, modes: dict[str, str], q: Tensor, g: Tensor, caches: dict, pos: Tensor,
                  start: Tensor, sdpa: bool | None = None) -> tuple[Tensor, dict, Tensor | None]:
    """The reads of one decode step, a pure function of the caches (after `write_token`):
    -> (o [B, H, 1, Dv] gated sum of the branches, reads {branch: counts}, selected blocks
    [B, Hkv, n] or None). caches: NSACache.tensors() (k_cmp, v_cmp, k_sel, v_sel, k_win, v_win).
    sdpa (default: on CUDA): the selection and window branches by SDPA with a boolean mask
    instead of the reference backend's explicit softmax (same function, fewer kernels)."""
    sdpa = q.is_cuda if sdpa is None else sdpa
    B, H, _, Dk = q.shape
    Hkv = cfg.n_kv_heads
    G = H // Hkv
    dev = q.device
    S = pos + 1
    qg = q.reshape(B, Hkv, G, Dk)
    scale = 1.0 / math.sqrt(Dk)
    out, reads = {}, {}
    p_cmp = idx = None

    if "k_cmp" in caches:  # --------------------------------------------- compressed
        kc, vc = caches["k_cmp"], caches["v_cmp"]
        Nc = kc.shape[2]
        if Nc > 0:
            i = torch.arange(Nc, device=dev).view(1, Nc)
            vis = (i < num_cmp(S, cfg.l, cfg.d).view(B, 1)) & (i * cfg.d >= start.view(B, 1))
            raw = _qk(qg, kc)
            o, lse = _attend(raw * scale, vis.view(B, 1, 1, Nc), vc)
            reads["cmp"] = vis.sum(-1)
            if modes["sel"] == "topn":
                # Eq. 8 from the compressed attention's own lse, Eq. 10 sum over the group's heads
                lse_ = torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(-1)
                p_cmp = torch.where(vis.view(B, 1, 1, Nc), torch.exp(raw * (Dk ** -0.5) - lse_),
                                    0.0).sum(2)
        else:
            o = q.new_zeros(B, Hkv, G, vc.shape[-1])
            reads["cmp"] = torch.zeros(B, dtype=torch.long, device=dev)
            p_cmp = q.new_zeros(B, Hkv, 0, dtype=torch.float32)
        if modes["cmp"] != "none":
            out["cmp"] = o.reshape(B, H, 1, -1)

    if modes["sel"] != "none":  # ---------------------------------------- selection
        k_sel, v_sel = caches["k_sel"], caches["v_sel"]
        cap, ls = k_sel.shape[2], cfg.l_sel
        if modes["sel"] == "causal":  # full attention over the cache (full_causal preset)
            ks, vs = k_sel, v_sel
            tok = torch.arange(cap, device=dev).view(1, 1, cap)
            ok = (tok <= pos.view(B, 1, 1)) & (tok >= start.view(B, 1, 1))  # [B, 1, cap]
            reads["sel"] = ok.sum(-1).expand(B, Hkv)
        else:
            ns = cap // ls
            p_slc = None
            if modes["sel"] == "topn":
                c = overlap_kernel_cached(cfg.l, cfg.d, ls, dev, p_cmp.dtype)
                p_slc = map_to_selection_blocks(p_cmp, ns, cfg.l, cfg.d, ls, c)  # Eq. 9
            idx = select_blocks(cfg, modes["sel"], p_slc, pos, start, ns, Hkv)  # [B, Hkv, n]
            n = idx.shape[-1]
            blk = idx.clamp_min(0)
            # gather whole selection blocks: rows of a [B*Hkv*ns, l'*D] view, index_select
            bh = torch.arange(B * Hkv, device=dev).view(B, Hkv, 1)
            flat = (bh * ns + blk).reshape(-1)
            ks = k_sel.view(B * Hkv * ns, -1).index_select(0, flat).view(B, Hkv, n * ls, -1)
            vs = v_sel.view(B * Hkv * ns, -1).index_select(0, flat).view(B, Hkv, n * ls, -1)
            tok = (blk.unsqueeze(-1) * ls + torch.arange(ls, device=dev)).reshape(B, Hkv, n * ls)
            ok = ((idx >= 0).repeat_interleave(ls, dim=-1) & (tok <= pos.view(B, 1, 1))
                  & (tok >= start.view(B, 1, 1)))  # [B, Hkv, n*l']
            reads["sel"] = ok.sum(-1)
        if sdpa:
            o = _sdpa(qg, ks, vs, ok.unsqueeze(2).expand(B, Hkv, 1, ok.shape[-1]), scale)
        else:
            o, _ = _attend(_qk(qg, ks) * scale, ok.unsqueeze(2), vs)
        out["sel"] = o.reshape(B, H, 1, -1)

    if modes["win"] != "none":  # ---------------------------------------- sliding window
        k_win, v_win = caches["k_win"], caches["v_win"]
        W = k_win.shape[2]
        # position held by slot j: the latest p <= pos with p = j (mod W)
        spos = pos.view(B, 1) - (pos.view(B, 1) - torch.arange(W, device=dev)) % W
        ok = (spos >= 0) & (spos >= start.view(B, 1))  # [B, W]
        if sdpa:
            o = _sdpa(qg, k_win, v_win, ok.view(B, 1, 1, W), scale)
        else:
            o, _ = _attend(_qk(qg, k_win) * scale, ok.view(B, 1, 1, W), v_win)
        out["win"] = o.reshape(B, H, 1, -1)
        reads["win"] = ok.sum(-1)

    # gate (Eq. 5), same order and summation as NSAAttention.forward
    o = sum(g[..., i : i + 1] * out[b] for i, b in enumerate(BRANCHES) if b in out)
    return o, reads, idx
