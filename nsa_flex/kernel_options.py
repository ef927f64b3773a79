"""Block sizes and Triton tile options for FlexAttention's NSA masks.

The selection runs on our own op (`nsa_flex.ops.selected_triton`) by default; on flex's template
(`sel_kernel = "flex"`, or where the op does not run) group-centric packing makes the selection
branch's q block small (one position's G heads, e.g. 16 rows) and its kv block the selection
block (64). Default Triton tiles (fwd 128x64, bwd 64x64 and up) do not divide a 16-row block, so
we pass explicit tiles through `kernel_options` (fwd BLOCK_M/BLOCK_N, bwd BLOCK_M1/N1/M2/N2 with
N1 % M1 == 0 and M2 % N2 == 0).

Workaround for pytorch #176025 (fixed upstream by PR #184797): torch <= 2.13 filters the
backward configs by the sparse block size *before* applying kernel_options, so a 16-row block
finds no backward config on GPU. `install_small_block_bwd_configs()` wraps
`InductorChoices.get_flex_attention_bwd_configs` (the hook inductor documents for custom
heuristics): when none of inductor's own candidates divides the mask's sparse block sizes, it adds
the first small config that does, and nothing otherwise -- adding them unconditionally would make
every flex backward (compressed, window, the flex baseline) autotune over small-tile candidates
too, minutes of compile at 64k. The block sizes are read from the calling lowering's locals
(SPARSE_Q_BLOCK_SIZE / SPARSE_KV_BLOCK_SIZE, guarded ints by then); where they are not found
(another torch layout) all small configs are appended after inductor's own.

Nothing happens at import. The wrapper is installed, once per process and only on the torch
versions that need it (`needs_small_block_bwd_configs`), by the code that calls flex: the
NSAAttention constructor for a flex / auto backend, and `attention._flex` before an eager call.
It must be installed outside any traced region (dynamo cannot trace the patching).
"""

import math

import torch

# Rows of a packed q block at least (16: the tensor-core minimum for a q tile). A q block holds
# P = lcm(G, PACK_ROWS) / G positions: with P > 1 its kv list is the union of the P positions'
# selections (the mask_mod keeps each row exact), so larger blocks trade more kv blocks per q
# block for bigger tiles, which loses: 16 rows, the fewest positions per block, is the default
# (`bench_attention.py --pack-rows` measures the others).
PACK_ROWS = 16


def packed_block_size(G: int, spec, rows: int | None = None) -> tuple[int, int]:
    """(q block, kv block) of the packed layout: q block = P positions x G heads, a multiple of
    `rows` (default PACK_ROWS); kv block = largest of 64/32/16 dividing the mask's block length."""
    rows = rows or PACK_ROWS
    P = rows // math.gcd(G, rows)
    lsel = spec.kv_block or 64
    kb = next((b for b in (64, 32, 16) if lsel % b == 0), lsel)
    return G * P, kb


def _largest_tile(n: int) -> int:
    return next((b for b in (64, 32, 16) if n % b == 0), 16)


def flex_kernel_options(q: torch.Tensor, block_size: tuple[int, int]) -> dict | None:
    if q.device.type != "cuda":
        return None
    QB, KB = block_size
    bm, bn = _largest_tile(QB), _largest_tile(KB)
    # dK/dV pass: 16 q rows per step; dQ pass: the q block against N2 keys per step (the
    # template asserts M2 % N2 == 0)
    n2 = min(bm, bn)
    opts = {"fwd_BLOCK_M": bm, "fwd_BLOCK_N": bn,
            "bwd_BLOCK_M1": 16, "bwd_BLOCK_N1": bn, "bwd_BLOCK_M2": bm, "bwd_BLOCK_N2": n2}
    if q.dtype.itemsize > 2:
        # 4/8-byte elements: the tiles take 2-4x the shared memory of the measured 2-byte ones
        # (fp32 at d_k 192 needed 262656 bytes of 232448): narrower kv steps, no pipelining
        opts.update(fwd_BLOCK_N=min(bn, 32), bwd_BLOCK_N1=min(bn, 32), bwd_BLOCK_N2=min(n2, 16),
                    fwd_num_stages=1, bwd_num_stages=1)
        return opts
    opts.update(PACKED_OPTIONS.get(q.shape[-1], {}))
    return opts


# Overrides of the packed call's options above, by q/k head dim; every tile must divide the
# packed block sizes. Filled only from H100 measurements (`bench_attention.py --packed-options`,
# `PLAN=packtune` in experiments/perf_gpu_run.sh). d_k 192: the backward otherwise runs the small
# fallback config's num_stages 1 (no load pipelining); 3 stages pipeline the loads.
PACKED_OPTIONS: dict[int, dict] = {192: {"bwd_num_stages": 3}}


# Triton options of the flex calls with ordinary 128-row q blocks (compressed keys, the forced
# selection bands, the window), by q/k head dim; a head dim not listed gets inductor's defaults.
# Filled only from H100 measurements (experiments/tune_flex_options.py). d_k 192 (paper config):
# inductor's sm90 default for head dims > 128 is fwd 64x64 / 4 warps and bwd 64x64 tiles / 4 warps
# / 2 stages, small for this head dim; dK/dV over 128 keys per program (N1 = M2 = 128), 32-row q
# steps, 8 warps, 3 stages and a 128x64 / 8-warp forward are faster for the compressed and window
# calls.
BAND_OPTIONS: dict[int, dict] = {
    192: {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_warps": 8, "fwd_num_stages": 2,
          "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 32,
          "bwd_num_warps": 8, "bwd_num_stages": 3},
}


# 4- and 8-byte elements above head dim 64: small tiles, no pipelining. torch 2.11's default fp32
# forward config at d_k 192 (64x64, 3 stages) needs 278784 bytes of shared memory with the q
# prologue fused (H100 limit 232448; tests/layer/test_flex_gpu.py); fp32 is for checks, not
# speed. d_k 64 compiles with inductor's own configs.
WIDE_ELEMENT_OPTIONS = {"fwd_BLOCK_M": 32, "fwd_BLOCK_N": 32, "fwd_num_warps": 4, "fwd_num_stages": 1,
                        "bwd_BLOCK_M1": 16, "bwd_BLOCK_N1": 16, "bwd_BLOCK_M2": 16, "bwd_BLOCK_N2": 16,
                        "bwd_num_warps": 4, "bwd_num_stages": 1}


def band_kernel_options(q: torch.Tensor) -> dict | None:
    """kernel_options of a non-packed flex call for queries q (None: inductor's own choice).
    BAND_OPTIONS were measured for 2-byte elements; wider elements above head dim 64 take
    WIDE_ELEMENT_OPTIONS (the bf16 tiles and inductor's fp32 default do not fit shared memory at
    d_k 192)."""
    if q.device.type != "cuda":
        return None
    if q.dtype.itemsize > 2:
        return dict(WIDE_ELEMENT_OPTIONS) if q.shape[-1] > 64 else None
    return dict(BAND_OPTIONS[q.shape[-1]]) if q.shape[-1] in BAND_OPTIONS else None


_installed = False


def _small_block_configs(head_dim: int):
    from torch._inductor.template_heuristics.triton import FlexBwDConfig
    stages = 1 if head_dim > 128 else 2
    return [FlexBwDConfig(16, 64, 16, 16, stages, 4), FlexBwDConfig(16, 32, 16, 16, stages, 4),
            FlexBwDConfig(16, 16, 16, 16, 1, 4)]


def _fits(conf, q_block: int, kv_block: int) -> bool:
    return (kv_block % conf.block_n1 == 0 and q_block % conf.block_m1 == 0
            and kv_block % conf.block_n2 == 0 and q_block % conf.block_m2 == 0)


def _caller_block_sizes(frame) -> tuple[int, int] | None:
    """(SPARSE_Q_BLOCK_SIZE, SPARSE_KV_BLOCK_SIZE) from inductor's flex backward lowering."""
    while frame is not None:
        loc = frame.f_locals
        if "SPARSE_Q_BLOCK_SIZE" in loc and "SPARSE_KV_BLOCK_SIZE" in loc:
            try:
                return int(loc["SPARSE_Q_BLOCK_SIZE"]), int(loc["SPARSE_KV_BLOCK_SIZE"])
            except (TypeError, ValueError):  # still symbolic: cannot decide here
                return None
        frame = frame.f_back
    return None


def with_small_block_configs(confs: list, head_dim: int, block_sizes: tuple[int, int] | None):
    """inductor's candidates, plus one small config only when none of them fits the blocks
    (block_sizes None: unknown, so all small configs are appended after the defaults)."""
    small = _small_block_configs(head_dim)
    if block_sizes is None:
        return confs + [c for c in small if c not in confs]
    qb, kb = block_sizes
    if any(_fits(c, qb, kb) for c in confs):
        return confs
    return confs + [next(c for c in small if _fits(c, qb, kb))]


def needs_small_block_bwd_configs(version: str | None = None) -> bool:
    """Whether this torch filters flex backward configs before kernel_options (#176025): <= 2.13."""
    major, minor = (int(x) for x in (version or torch.__version__).split(".")[:2])
    return (major, minor) <= (2, 13)


def install_small_block_bwd_configs() -> bool:
    """Wrap inductor's flex backward candidates where this torch needs it (on InductorChoices
    itself, once: the backward graph is compiled on autograd's thread, where a thread-local
    choices handler set here would not be seen). Returns whether the wrapper is installed."""
    global _installed
    if _installed or not needs_small_block_bwd_configs():
        return _installed
    import sys

    from torch._inductor.choices import InductorChoices

    original = InductorChoices.get_flex_attention_bwd_configs

    def get_flex_attention_bwd_configs(self, head_dim, dtype, device_type="cuda"):
        confs = list(original(self, head_dim, dtype, device_type))
        return with_small_block_configs(confs, head_dim, _caller_block_sizes(sys._getframe(1)))

    InductorChoices.get_flex_attention_bwd_configs = get_flex_attention_bwd_configs
    _installed = True
    return True


def install_flex_patches() -> None:
    """This module's patch of inductor's flex backward, where this torch needs it (once)."""
    install_small_block_bwd_configs()
