"""Fused selection scorer (paper Eq. 8-10 and Eq. 9) in one Triton kernel.

For queries t0..t1-1 it returns the group importance of every selection block,
p_slc [B, Hkv, t1-t0, Ns] fp32, the same function as the torch path of
`nsa_flex.selection.block_scores` (the naive reference kept beside it), without ever writing the
per-head probabilities [B, Hkv, G, C, Nc] (nor the group sums [B, Hkv, C, Nc]) to memory.

One program = (tile of BJ selection blocks, tile of BLOCK_M query positions, batch x KV group).
Selection blocks j0..j0+BJ-1 take their scores from compressed blocks i = j*r + m,
m in [-(l/d - 1), r - 1] (r = l'/d), so the program loads the BLOCK_N compressed keys
i_lo = j0*r - (l/d - 1) .. i_lo + BLOCK_N - 1 (BJ = (BLOCK_N - l/d + 1) // r, so every
contributing block is in the tile; consecutive tiles recompute an l/d - 1 block halo) and

  for each head g of the group:               (Eq. 8, the group sum of Eq. 10 in registers)
      s = q_g . k_i * Dk^-0.5                 (fp32 accumulation; bf16 operands on tensor cores)
      acc += visible(t, i) ? exp(s - lse_g[t]) : 0
  out[:, j] = sum_i acc[:, i] * c[i - j*r]    (Eq. 9, one small matmul with the overlap weights)

visible(t, i): i*d + l - 1 <= t (compressed causal) and i*d >= doc_start[t] (documents); rows
whose lse is not finite (no visible block) count as lse = 0, exactly as the torch path. Tiles
that no query of the program can see only store zeros. Eq. 9 is exact: acc is split into three
parts that are exact in tf32 (hi + mid + lo == acc bit for bit), the weights c are small
integers, so every tensor-core product is exact and only the fp32 accumulation rounds, as in any
fp32 sum.

Head dims that are not a power of two (d_k = 192) are split in two power-of-two slices
(128 + 64; masked when the second is padded, e.g. 24 = 16 + 16 with 8 masked).

The op `torch.ops.nsa_flex.group_slc_scores` is a `torch.library.triton_op`: callable inside
`torch.compile(fullgraph=True)` graphs without a graph break, no gradient (the scorer runs under
no_grad on detached inputs). Under TRITON_INTERPRET=1 (set before this module is imported) the
kernel runs on CPU tensors through Triton's interpreter: that is how the CPU tests check it.
"""

import math
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from .rules_triton import cmp_visible, overlap_weight

LOG2E = 1.4426950408889634


@triton.jit
def _group_slc_scores_kernel(
    Q, K, LSE, DS, OUT,
    sq_b, sq_h, sq_t, sq_d,
    sk_b, sk_h, sk_n, sk_d,
    sl_b, sl_h, sl_t,
    sd_b, sd_t,
    so_b, so_h, so_t,
    Hkv, C, Nc, Ns, t0, Q0,
    G: tl.constexpr, D: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
    L: tl.constexpr, STRIDE: tl.constexpr, R: tl.constexpr, QN: tl.constexpr,
    BJ: tl.constexpr, BJP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_DOCS: tl.constexpr, IEEE: tl.constexpr,
    QK_SCALE: tl.constexpr,  # Dk^-0.5 * log2(e); constexpr: Inductor would pass a float arg as fp64
):
    # selection-block tiles vary fastest: the programs running at once share one query tile, so
    # its G heads of q come from L2 instead of being re-read from memory once per j tile
    pid_j = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_bh = tl.program_id(2).to(tl.int64)
    b = pid_bh // Hkv
    h = pid_bh % Hkv

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # row in the chunk
    row_ok = offs_m < C
    t64 = (t0 + offs_m).to(tl.int64)  # query row (of q, lse); t * stride may pass 2^31 at long T
    t = t0 + Q0 + offs_m  # its position (Q0: a sequence shard's first position)
    j0 = pid_j * BJ
    i_lo = j0 * R - (QN - 1)
    offs_i = i_lo + tl.arange(0, BLOCK_N)  # compressed block index
    jj = tl.arange(0, BJP)

    # can any query of this program see a compressed block that feeds these selection blocks?
    t_max = t0 + Q0 + tl.minimum(pid_m * BLOCK_M + BLOCK_M, C) - 1
    has_work = cmp_visible(tl.maximum(i_lo, 0), t_max, L, STRIDE)
    if HAS_DOCS:
        ds = tl.load(DS + b * sd_b + t.to(tl.int64) * sd_t, mask=row_ok, other=0)
        ds_min = tl.min(tl.where(row_ok, ds, 2147483647), axis=0)
        has_work = has_work & ((j0 * R + BJ * R - 1) * STRIDE >= ds_min)

    if has_work:
        i_ok = (offs_i >= 0) & (offs_i < Nc)
        vis = cmp_visible(offs_i[None, :], t[:, None], L, STRIDE) & (offs_i[None, :] >= 0)
        vis = vis & row_ok[:, None]
        if HAS_DOCS:
            vis = vis & (offs_i[None, :] * STRIDE >= ds[:, None])
        # K^T slices [D1, BLOCK_N] (+ [D2, BLOCK_N]), loaded once for the G heads
        k_base = K + b * sk_b + h * sk_h
        d1 = tl.arange(0, D1)
        kt1 = tl.load(k_base + offs_i[None, :] * sk_n + d1[:, None] * sk_d,
                      mask=i_ok[None, :] & (d1[:, None] < D), other=0.0)
        if D2 > 0:
            d2 = D1 + tl.arange(0, D2)
            kt2 = tl.load(k_base + offs_i[None, :] * sk_n + d2[:, None] * sk_d,
                          mask=i_ok[None, :] & (d2[:, None] < D), other=0.0)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for g in range(G):
            hq = h * G + g
            q_base = Q + b * sq_b + hq * sq_h + t64[:, None] * sq_t
            q1 = tl.load(q_base + d1[None, :] * sq_d, mask=row_ok[:, None] & (d1[None, :] < D),
                         other=0.0)
            if IEEE:
                s = tl.dot(q1, kt1, input_precision="ieee")
            else:
                s = tl.dot(q1, kt1)
            if D2 > 0:
                q2 = tl.load(q_base + d2[None, :] * sq_d,
                             mask=row_ok[:, None] & (d2[None, :] < D), other=0.0)
                if IEEE:
                    s = tl.dot(q2, kt2, s, input_precision="ieee")
                else:
                    s = tl.dot(q2, kt2, s)
            lse = tl.load(LSE + b * sl_b + hq * sl_h + t64 * sl_t, mask=row_ok, other=0.0)
            lse = lse.to(tl.float32)
            lse = tl.where(tl.abs(lse) < float("inf"), lse, 0.0) * 1.4426950408889634
            p = tl.exp2(s * QK_SCALE - lse[:, None])
            acc += tl.where(vis, p, 0.0)
        # Eq. 9: out[:, jj] = sum_a acc[:, a] * c[a - (QN - 1) - jj*R], c[m] = |[m, m+QN) ∩ [0, R)|
        a = tl.arange(0, BLOCK_N)
        m = a[:, None] - (QN - 1) - jj[None, :] * R
        w = overlap_weight(m, R, QN)
        w = tl.where((w > 0) & (jj[None, :] < BJ), w, 0).to(tl.float32)
        # acc == hi + mid + lo exactly, each part exact in tf32 (<= 11 significant bits): the
        # tensor-core products are exact and only the fp32 accumulation rounds
        hi = (acc.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
        r1 = acc - hi
        mid = (r1.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
        lo = r1 - mid
        res = tl.dot(lo, w, input_precision="tf32")
        res = tl.dot(mid, w, res, input_precision="tf32")
        res = tl.dot(hi, w, res, input_precision="tf32")
    else:
        res = tl.zeros([BLOCK_M, BJP], dtype=tl.float32)

    j = j0 + jj
    o_ptr = OUT + b * so_b + h * so_h + offs_m[:, None] * so_t + j[None, :]
    tl.store(o_ptr, res, mask=row_ok[:, None] & (jj[None, :] < BJ) & (j[None, :] < Ns))


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def head_dim_split(D: int) -> tuple[int, int]:
    """(D1, D2): power-of-two slices (>= 16, the smallest dot) covering D; D2 = 0 for one slice.
    192 -> (128, 64), 128 -> (128, 0), 48 -> (32, 16), 24 -> (16, 16), 8 -> (16, 0)."""
    if D <= 16:
        return 16, 0
    d1 = 1 << (D.bit_length() - 1)  # largest power of two <= D
    rest = D - d1
    return d1, (0 if rest == 0 else max(16, _pow2_at_least(rest)))


def tile_shape(l: int, d: int, l_sel: int, block_n: int) -> tuple[int, int, int]:
    """(BLOCK_N, BJ, BJP): compressed keys per tile, selection blocks it completes, BJ padded to a
    power of two >= 16. BLOCK_N grows when one selection block needs more than block_n keys."""
    r, qn = l_sel // d, l // d
    bn = max(16, _pow2_at_least(block_n), _pow2_at_least(r + qn - 1))
    bj = (bn - qn + 1) // r
    return bn, bj, max(16, _pow2_at_least(bj))


# (block_m, block_n, num_warps, num_stages) by head dim, from H100 measurements
# (experiments/tune_scorer.py, results/perf/run9/tune_scorer_*.csv): at d_k 192, 128 query rows
# per program run the scorer in about half the time of 64: q is re-read once per
# tile of block_n compressed keys, K once per tile of block_m queries, and 64 x 128 was bound by
# the latter's program count; wider key tiles (256, 512) exceed shared memory at 8 warps.
TILES: dict[int, tuple[int, int, int, int]] = {192: (128, 128, 8, 2)}
DEFAULT_TILES = (64, 128, 8, 2)


@triton_op("nsa_flex::group_slc_scores", mutates_args=())
def group_slc_scores(q: Tensor, k_cmp: Tensor, lse: Tensor, doc_starts: Optional[Tensor], t0: int,
                     t1: int, l: int, d: int, l_sel: int, block_m: int = 0, block_n: int = 0,
                     num_warps: int = 0, num_stages: int = 0, q_offset: int = 0,
                     seq_len: int = 0) -> Tensor:
    """p_slc [B, Hkv, t1-t0, ceil(seq_len/l_sel)] fp32 for query rows t0..t1-1 (see module
    docstring). A sequence shard (context parallelism): row t is position t + q_offset of a
    seq_len-token sequence (0: T, no shard), k_cmp and doc_starts [B|1, seq_len] the whole
    sequence's.

    q [B, Hq, T, Dk] (bf16/fp16/fp32, any strides), k_cmp [B, Hkv, Nc, Dk] (same dtype as q),
    lse [B, Hq, T] natural-log lse of the compressed attention, doc_starts [B|1, T] int or None.
    block_m/block_n/num_warps/num_stages: tile shape and launch (performance only; 0: TILES for
    this head dim, else DEFAULT_TILES)."""
    B, Hq, T, D = q.shape
    tiles = TILES.get(D, DEFAULT_TILES)
    block_m, block_n = block_m or tiles[0], block_n or tiles[1]
    num_warps, num_stages = num_warps or tiles[2], num_stages or tiles[3]
    Hkv, Nc = k_cmp.shape[1], k_cmp.shape[2]
    G = Hq // Hkv
    C = t1 - t0
    ns = -(-(seq_len or T) // l_sel)
    out = torch.empty(B, Hkv, C, ns, device=q.device, dtype=torch.float32)
    if C == 0 or ns == 0:
        return out
    bn, bj, bjp = tile_shape(l, d, l_sel, block_n)
    bm = max(16, _pow2_at_least(block_m))
    d1, d2 = head_dim_split(D)
    if doc_starts is None:
        ds, sd_b, sd_t = lse, 0, 0  # any pointer: never read (HAS_DOCS=False)
    else:
        ds = doc_starts
        sd_b = 0 if doc_starts.shape[0] == 1 else doc_starts.stride(0)
        sd_t = doc_starts.stride(1)
    grid = (triton.cdiv(ns, bj), triton.cdiv(C, bm), B * Hkv)
    wrap_triton(_group_slc_scores_kernel)[grid](
        q, k_cmp, lse, ds, out,
        q.stride(0), q.stride(1), q.stride(2), q.stride(3),
        k_cmp.stride(0), k_cmp.stride(1), k_cmp.stride(2), k_cmp.stride(3),
        lse.stride(0), lse.stride(1), lse.stride(2),
        sd_b, sd_t,
        out.stride(0), out.stride(1), out.stride(2),
        Hkv, C, Nc, ns, t0, q_offset,
        G=G, D=D, D1=d1, D2=d2, L=l, STRIDE=d, R=l_sel // d, QN=l // d,
        BJ=bj, BJP=bjp, BLOCK_M=bm, BLOCK_N=bn,
        HAS_DOCS=doc_starts is not None, IEEE=q.dtype == torch.float32,
        QK_SCALE=LOG2E / math.sqrt(D),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def interpreted() -> bool:
    """True when the kernel was built for Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return not isinstance(_group_slc_scores_kernel, triton.runtime.jit.JITFunction)
