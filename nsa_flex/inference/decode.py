"""Prefill and token-by-token decode of one NSAAttention layer with per-branch caches.

prefill(layer, x, lengths, cache)  -> the layer's own full forward for the outputs (any backend),
                                      plus the branch keys/values written into the caches
decode_step(layer, x, cache)       -> one new token per row, gather + matmul-softmax per branch:
  cmp  all compressed blocks of the stream, masked to the visible ones (i d + l <= S)
  sel  the current token's compressed scores (Eq. 8), mapped to selection blocks (Eq. 9), summed
       over each GQA group's heads (Eq. 10), top-n with the forced blocks (the document's first
       block, the n_local most recent) and ties to the lower index: `masks.pick_blocks`, the
       function `select_topn` uses; then a gather of the n selected blocks (n * l' tokens)
  win  the rolling ring of the last `window` tokens
Per-row positions (right padding, see cache.py). Decode math is the reference backend's
(fp32 scores, -inf masking, rows with no key give 0), whatever `cfg.backend` is.

Two implementations of the step (`decode_backend`: the cache's field, or the `backend` argument):
  torch   the code below (`write_token` + `attend_cached`): the naive reference, any device
  triton  `nsa_flex.ops.decode_triton`: the write in one kernel, the three branches in split-K
          flash-decoding kernels, the top-n scorer in one kernel, one combine with the gates
          (five launches, no host sync: CUDA-graph capturable); same inputs, outputs, counters
  auto    triton on CUDA tensors when triton imports, else torch (a Triton failure on the first
          step falls back to torch with a warning)
"""

import math

import torch
from torch import Tensor

from masks import doc_start as doc_start_of, pick_blocks

from ..rope import apply_rope, rope_cos_sin
from ..selection import overlap_kernel
from .cache import NSACache, check_decode_backend

BRANCHES = ("cmp", "sel", "win")
SUPPORTED = {"cmp": ("compressed_causal", "none"),
             "sel": ("topn", "local_selection", "causal", "none"),
             "win": ("sliding_window", "none")}


def branch_modes(layer) -> dict[str, str]:
    names = dict(layer.branch_names)
    for b, ok in SUPPORTED.items():
        if names[b] not in ok:
            raise NotImplementedError(f"decode supports {b} mask builders {ok}, not {names[b]!r}")
    return names


def cache_branches(modes: dict[str, str]) -> tuple[str, ...]:
    out = []
    if modes["cmp"] != "none" or modes["sel"] == "topn":
        out.append("cmp")
    if modes["sel"] != "none":
        out.append("sel")
    if modes["win"] != "none":
        out.append("win")
    return tuple(out)


def new_cache(layer, batch: int, capacity: int, device=None, dtype=None,
              lengths: Tensor | None = None, decode_backend: str = "auto") -> NSACache:
    """An empty cache sized for `layer` (only the streams its mask builders need).
    decode_backend: "auto" | "torch" | "triton" (see the module docstring)."""
    w = layer.wq.weight
    return NSACache.empty(layer.cfg, batch, capacity, device or w.device, dtype or w.dtype,
                          cache_branches(branch_modes(layer)), lengths=lengths,
                          decode_backend=decode_backend)


# ---------------------------------------------------------------------- backend choice
def _triton_module():
    """nsa_flex.ops.decode_triton, or the ImportError that keeps it from loading."""
    try:
        from ..ops import decode_triton
    except ImportError as e:  # no triton
        return e
    return decode_triton


def resolve_decode_backend(backend: str, device) -> str:
    """"torch" or "triton" for a step on `device`; a clear error for an unknown name or a
    "triton" request that cannot run (no triton, or CPU tensors outside the Triton interpreter)."""
    check_decode_backend(backend)
    dev = torch.device(device)
    if backend == "torch":
        return "torch"
    mod = _triton_module()
    if backend == "auto":
        return "triton" if dev.type == "cuda" and not isinstance(mod, Exception) else "torch"
    if isinstance(mod, Exception):
        raise RuntimeError(f"decode_backend='triton' cannot run: triton is not importable ({mod}); "
                           "use decode_backend='torch' or 'auto'")
    if dev.type != "cuda" and not mod.interpreter_active():
        raise RuntimeError(f"decode_backend='triton' needs CUDA tensors (got {dev.type}; on the "
                           "CPU only under the Triton interpreter, TRITON_INTERPRET=1 set before "
                           "triton is imported); use decode_backend='torch' or 'auto'")
    return "triton"


# ---------------------------------------------------------------------- attention helper
def _attend(s: Tensor, mask: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Masked softmax attention, the reference backend's math. s [B, Hkv, G, N] fp32 scores,
    mask broadcastable to s, v [B, Hkv, N, Dv] -> out [B, Hkv, G, Dv], lse [B, Hkv, G]."""
    s = s.masked_fill(~mask, float("-inf"))
    mx = s.amax(-1, keepdim=True)
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    e = torch.exp(s - mx)
    den = e.sum(-1, keepdim=True)
    p = e / den.clamp_min(torch.finfo(torch.float32).tiny)
    out = torch.einsum("bhgn,bhnd->bhgd", p.to(v.dtype), v)
    return out, (torch.log(den) + mx).squeeze(-1)


_OVERLAP: dict = {}


def map_to_selection_blocks(p: Tensor, n_sel_blocks: int, l: int, d: int, l_sel: int) -> Tensor:
    """Eq. 9, the same math as `nsa_flex.selection.map_to_selection_blocks` (unfold + product
    with the overlap kernel), with the kernel made once per device: building it allocates a
    host scalar, which a CUDA graph cannot capture."""
    key = (l, d, l_sel, str(p.device), p.dtype)
    if key not in _OVERLAP:
        _OVERLAP[key] = overlap_kernel(l, d, l_sel, p.device).to(p.dtype)
    c = _OVERLAP[key]
    r, M = l_sel // d, c.numel()
    left = l // d - 1
    need = (n_sel_blocks - 1) * r + M
    right = max(0, need - left - p.shape[-1])
    pp = torch.nn.functional.pad(p, (left, right))
    return pp.unfold(-1, M, r)[..., :n_sel_blocks, :] @ c


def _num_cmp(cfg, S: Tensor) -> Tensor:
    return torch.where(S >= cfg.l, torch.div(S - cfg.l, cfg.d, rounding_mode="floor") + 1, 0)


def _write(buf: Tensor, slot: Tensor, val: Tensor) -> None:
    """buf[b, :, slot[b]] = val[b, :, 0] for every row b (one scatter, no sync)."""
    B, H, _, D = buf.shape
    buf.scatter_(2, slot.view(B, 1, 1, 1).expand(B, H, 1, D), val)


def select_blocks(cfg, mode: str, p: Tensor | None, pos: Tensor, start: Tensor, ns: int,
                  Hkv: int) -> Tensor:
    """Selection block indices [B, Hkv, n_sel] (-1 unused) for tokens at positions pos [B].
    p [B, Hkv, ns] group importance (Eq. 9-10) for "topn"; recency for "local_selection"."""
    dev = pos.device
    j = torch.arange(ns, device=dev).view(1, ns)
    t, s0 = pos.view(-1, 1), start.view(-1, 1)
    valid = (j * cfg.l_sel <= t) & ((j + 1) * cfg.l_sel - 1 >= s0)
    cur = torch.div(t, cfg.l_sel, rounding_mode="floor")
    forced = (j > cur - cfg.n_local) & (j <= cur) if cfg.n_local > 0 else torch.zeros_like(valid)
    if cfg.n_init:
        forced = forced | (j == torch.div(s0, cfg.l_sel, rounding_mode="floor"))
    forced = forced & valid
    if mode == "local_selection":
        p = torch.arange(ns, device=dev, dtype=torch.float32).expand(pos.shape[0], Hkv, ns)
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
            vis = (i < _num_cmp(cfg, S).view(B, 1)) & (i * cfg.d >= start.view(B, 1))  # [B, Nc]
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
                p_slc = map_to_selection_blocks(p_cmp, ns, cfg.l, cfg.d, ls)  # Eq. 9
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


# ---------------------------------------------------------------------- triton path
def write_token_triton(cfg, modes: dict[str, str], kv: dict, cache: NSACache, phi_k, phi_v,
                       ) -> None:
    """`write_token` by the fused write kernel (one launch; with a learned phi the compressed
    block is emitted by `emit_compressed` after it)."""
    from ..compression import AvgCompress
    from ..ops.decode_triton import nsa_decode_write

    new = {b: kv[b] for b in ("cmp",) if b in kv}
    for b in ("sel", "win"):
        if modes[b] != "none":
            new[b] = kv[b]
    avg = isinstance(phi_k, AvgCompress) and isinstance(phi_v, AvgCompress)
    nsa_decode_write(cache.lengths, new, l=cfg.l, d=cfg.d, emit_avg=avg, **cache.tensors())
    if "cmp" in kv and not avg and cache.n_cmp_slots > 0:
        emit_compressed(cfg, cache, phi_k, phi_v)


def attend_triton(cfg, modes: dict[str, str], q: Tensor, g: Tensor, caches: dict, pos: Tensor,
                  start: Tensor, **kw) -> tuple[Tensor, dict, Tensor | None]:
    """`attend_cached` by the fused kernels: same arguments, same results (o [B, H, 1, Dv],
    reads, selected blocks or None). kw: `nsa_decode_attention` options (num_programs, ...)."""
    from ..ops.decode_triton import nsa_decode_attention

    B, H = q.shape[:2]
    sel = modes["sel"]
    r = nsa_decode_attention(
        q, pos, start, l=cfg.l, d=cfg.d, l_sel=cfg.l_sel, n_sel=cfg.n_sel, n_init=cfg.n_init,
        n_local=cfg.n_local, k_cmp=caches.get("k_cmp"), v_cmp=caches.get("v_cmp"),
        k_sel=caches.get("k_sel") if sel != "none" else None,
        v_sel=caches.get("v_sel") if sel != "none" else None,
        k_win=caches.get("k_win") if modes["win"] != "none" else None,
        v_win=caches.get("v_win") if modes["win"] != "none" else None,
        sel_mode=sel, use=tuple(b for b in BRANCHES if modes[b] != "none"), g=g, **kw)
    return r.o.view(B, H, 1, -1), r.reads, r.idx


_FALLBACK_WARNED: set = set()


def decode_attention(cfg, modes: dict[str, str], q: Tensor, kv: dict, g: Tensor,
                     cache: NSACache, phi_k, phi_v, attend_fn=None, backend: str | None = None,
                     triton_opts: dict | None = None) -> Tensor:
    """The attention core of one decode step (after projections and RoPE).

    q [B, H, 1, Dk]; kv[branch] = (k [B, Hkv, 1, Dk], v [B, Hkv, 1, Dv]) of the new token;
    g [B, H, 1, 3] sigmoid gates. Writes the new token into the caches (at cache.lengths, which
    it does not advance), then attends. Sets cache.reads (per-branch read counters of this step)
    and cache.last_selection. Returns o [B, H, 1, Dv] (gated sum of the branches).
    backend: "auto" | "torch" | "triton" (default: cache.decode_backend). attend_fn: a
    replacement of `attend_cached` (e.g. a compiled copy); it implies the torch path.
    triton_opts: launch options of the Triton kernels (`nsa_decode_attention`: num_programs,
    block_n, num_warps, num_stages)."""
    name = backend or cache.decode_backend
    use = "torch" if attend_fn is not None else resolve_decode_backend(name, q.device)
    if use == "triton":
        try:
            write_token_triton(cfg, modes, kv, cache, phi_k, phi_v)
            caches = {k: v for k, v in cache.tensors().items() if k not in ("k_raw", "v_raw")}
            o, cache.reads, cache.last_selection = attend_triton(
                cfg, modes, q, g, caches, cache.lengths, cache.doc_start, **(triton_opts or {}))
            return o
        except Exception as e:  # noqa: BLE001 - "auto" only: fall back to the reference
            if name != "auto":
                raise
            import warnings

            key = type(e).__name__ + str(e)[:200]
            if key not in _FALLBACK_WARNED:
                _FALLBACK_WARNED.add(key)
                warnings.warn(f"decode_backend='auto': the Triton decode failed ({e!r}); this "
                              "cache uses the torch decode from now on", RuntimeWarning,
                              stacklevel=2)
            cache.decode_backend = "torch"  # the write is idempotent: the torch path redoes it
    write_token(cfg, modes, kv, cache, phi_k, phi_v)
    caches = {k: v for k, v in cache.tensors().items() if k not in ("k_raw", "v_raw")}
    o, cache.reads, cache.last_selection = (attend_fn or attend_cached)(
        cfg, modes, q, g, caches, cache.lengths, cache.doc_start)
    return o


# ---------------------------------------------------------------------- layer level
def _project(layer, x: Tensor, positions: Tensor, branches) -> tuple[Tensor, dict]:
    """q [B, H, T, Dk] and {branch: (k, v)} with RoPE at `positions` ([T] shared or [B] per row
    for T = 1)."""
    cfg = layer.cfg
    B, T, _ = x.shape
    H, Hkv, dk, dv = cfg.n_heads, cfg.n_kv_heads, cfg.d_qk, cfg.d_v
    cos, sin = rope_cos_sin(positions, dk, cfg.rope_theta, x.dtype)
    if positions.dim() == 1 and positions.shape[0] == B and T == 1:
        cos, sin = cos.view(B, 1, 1, dk), sin.view(B, 1, 1, dk)
    q = apply_rope(layer.wq(x).view(B, T, H, dk).transpose(1, 2), cos, sin)
    kv = {}
    for b in branches:
        k = layer.wk[b](x).view(B, T, Hkv, dk).transpose(1, 2)
        v = layer.wv[b](x).view(B, T, Hkv, dv).transpose(1, 2)
        kv[b] = (apply_rope(k, cos, sin), v)
    return q, kv


@torch.no_grad()
def decode_step(layer, x: Tensor, cache: NSACache, doc_start: Tensor | None = None,
                commit: bool = True, backend: str | None = None) -> Tensor:
    """One token per row: x [B, 1, dim] at positions cache.lengths -> out [B, 1, dim].

    doc_start [B] (optional): first position of each new token's document (document masking);
    kept in the cache. commit=False leaves cache.lengths as it is (the model-level cache
    advances a length tensor shared by all layers once per step; benchmarks repeat one step).
    backend: "auto" | "torch" | "triton", default cache.decode_backend."""
    cfg = layer.cfg
    modes = branch_modes(layer)
    B = x.shape[0]
    if x.shape[1] != 1:
        raise ValueError(f"decode_step takes one token per row, got x of shape {tuple(x.shape)}")
    cache.check_room(1)
    if doc_start is not None:
        cache.doc_start.copy_(doc_start)
    q, kv = _project(layer, x, cache.lengths, cache_branches(modes))
    g = torch.sigmoid(layer.gate(x)).view(B, 1, cfg.n_heads, 3).permute(0, 2, 1, 3)
    o = decode_attention(cfg, modes, q, kv, g, cache, layer.phi_k, layer.phi_v, backend=backend)
    o = o.transpose(1, 2).reshape(B, 1, cfg.n_heads * cfg.d_v)
    if commit:
        advance(cache)
    return layer.wo(o.to(x.dtype))


def advance(cache: NSACache, n: int = 1) -> None:
    cache.lengths.add_(n)
    cache.host_max_len += n


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
    _, kv = _project(layer, x, torch.arange(T, device=dev), cache_branches(modes))

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
