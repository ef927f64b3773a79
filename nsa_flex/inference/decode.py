"""Token-by-token decode of one NSAAttention layer with per-branch caches.

decode_step(layer, x, cache)  -> one new token per row: projections + RoPE, then
                                 `decode_attention` (write the token, attend, gate), then wo
prefill (prefill.py)          -> the layer's own full forward plus the caches filled

Two implementations of the attention core (`decode_backend`: the cache's field, or the `backend`
argument):
  torch   `decode_reference` (`write_token` + `attend_cached`): the naive path, any device
  triton  `decode_fused` (`nsa_flex.ops.decode_triton`): fused kernels, same results
  auto    triton on CUDA tensors when triton imports, else torch. A Triton failure on a step
          warns once with the reason and switches that cache to torch (`cache.fallback_reason`);
          an explicit "triton" raises instead
"""

import warnings

import torch
from torch import Tensor

from masks import builder_info, list_mask_builders

from ..rope import rope_cos_sin
from .cache import NSACache
from .decode_fused import resolve_decode_backend, step_triton
from .decode_reference import attend_cached, write_token

def branch_modes(layer) -> dict[str, str]:
    """The layer's builder per branch, each one the decode step supports on its branch (the
    registry says which: `masks.builder_info(...).decode`)."""
    names = dict(layer.branch_names)
    if layer.cfg.sel_scores != "cmp":
        raise NotImplementedError(f"decode scores blocks from the compressed keys (sel_scores='cmp'), "
                                  f"not sel_scores={layer.cfg.sel_scores!r}; the full-sequence "
                                  "forward runs it")
    for b, name in names.items():
        if b not in builder_info(name).decode:
            raise NotImplementedError(f"decode supports {b} mask builders "
                                      f"{tuple(list_mask_builders(decode=b))}, not {name!r}")
    return names


def cache_branches(modes: dict[str, str]) -> tuple[str, ...]:
    """The cache streams the builders read: the compressed keys also for a scoring selection."""
    out = []
    if modes["cmp"] != "none" or builder_info(modes["sel"]).scores:
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


_FALLBACK_WARNED: set = set()  # reasons already warned about, once per process


def _fall_back(cache: NSACache, e: Exception) -> None:
    """decode_backend="auto" after a failed Triton step: the cache switches to the torch path
    for good (its reason in `cache.fallback_reason`); a RuntimeWarning names the reason, once
    per distinct reason. The Triton write is idempotent, so the torch path redoes it."""
    reason = f"{type(e).__name__}: {str(e)[:200]}"
    cache.decode_backend, cache.fallback_reason = "torch", reason
    if reason not in _FALLBACK_WARNED:
        _FALLBACK_WARNED.add(reason)
        warnings.warn(f"decode_backend='auto': the Triton decode failed ({reason}); this cache "
                      "uses the torch decode from now on", RuntimeWarning, stacklevel=3)


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
            o, cache.reads, cache.last_selection = step_triton(
                cfg, modes, q, kv, g, cache, phi_k, phi_v, **(triton_opts or {}))
            return o
        except Exception as e:  # noqa: BLE001 - any kernel / compiler failure; see _fall_back
            if name != "auto":
                raise
            _fall_back(cache, e)
    write_token(cfg, modes, kv, cache, phi_k, phi_v)
    caches = {k: v for k, v in cache.tensors().items() if k not in ("k_raw", "v_raw")}
    o, cache.reads, cache.last_selection = (attend_fn or attend_cached)(
        cfg, modes, q, g, caches, cache.lengths, cache.doc_start)
    return o


def project(layer, x: Tensor, positions: Tensor, branches) -> tuple[Tensor, dict]:
    """q [B, H, T, Dk] and {branch: (k, v)} with RoPE at `positions` ([T] shared or [B] per row
    for T = 1): the layer's own `project_q` / `project_kv`."""
    cfg = layer.cfg
    B, T, _ = x.shape
    cos, sin = rope_cos_sin(positions, cfg.d_qk, cfg.rope_theta, x.dtype)
    if positions.dim() == 1 and positions.shape[0] == B and T == 1:
        cos, sin = cos.view(B, 1, 1, cfg.d_qk), sin.view(B, 1, 1, cfg.d_qk)
    return layer.project_q(x, cos, sin), {b: layer.project_kv(x, b, cos, sin) for b in branches}


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
    q, kv = project(layer, x, cache.lengths, cache_branches(modes))
    g = torch.sigmoid(layer.gate(x)).view(B, 1, cfg.n_heads, 3).permute(0, 2, 1, 3)
    o = decode_attention(cfg, modes, q, kv, g, cache, layer.phi_k, layer.phi_v, backend=backend)
    o = o.transpose(1, 2).reshape(B, 1, cfg.n_heads * cfg.d_v)
    if commit:
        advance(cache)
    return layer.wo(o.to(x.dtype))


def advance(cache: NSACache, n: int = 1) -> None:
    cache.lengths.add_(n)
    cache.host_max_len += n
