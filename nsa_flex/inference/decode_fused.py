"""The decode step by the fused Triton kernels (`nsa_flex.ops.decode_triton`), and the choice of
backend. Same inputs, outputs and counters as `decode_reference`: five launches (write, compressed
+ window, scorer, selected, combine). No host sync: CUDA-graph capturable.
"""

import torch
from torch import Tensor

from ..compression import AvgCompress
from .cache import NSACache, check_decode_backend
from ..rules import BRANCHES
from .decode_reference import emit_compressed


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


def write_token_triton(cfg, modes: dict[str, str], kv: dict, cache: NSACache, phi_k, phi_v,
                       ) -> None:
    """`write_token` by the fused write kernel (one launch; with a learned phi the compressed
    block is emitted by `emit_compressed` after it)."""
    from ..ops.decode_triton import nsa_decode_write

    new = {b: kv[b] for b in ("cmp",) if b in kv}
    for b in ("sel", "win"):
        if modes[b] != "none":
            new[b] = kv[b]
    avg = isinstance(phi_k, AvgCompress) and isinstance(phi_v, AvgCompress)
    nsa_decode_write(cache.lengths, new, l=cfg.l, d=cfg.d, emit_avg=avg, **cache.tensors())
    if "cmp" in kv and not avg and cache.n_cmp_slots > 0:
        emit_compressed(cfg, cache, phi_k, phi_v)


def step_triton(cfg, modes: dict[str, str], q: Tensor, kv: dict, g: Tensor, cache: NSACache,
                phi_k, phi_v, **kw) -> tuple[Tensor, dict, Tensor | None]:
    """`write_token` + `attend_cached` by the fused kernels: same results as the torch path."""
    write_token_triton(cfg, modes, kv, cache, phi_k, phi_v)
    caches = {k: v for k, v in cache.tensors().items() if k not in ("k_raw", "v_raw")}
    return attend_triton(cfg, modes, q, g, caches, cache.lengths, cache.doc_start, **kw)


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
