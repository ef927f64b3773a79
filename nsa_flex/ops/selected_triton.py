"""Selected attention (paper §3.3.2) as our own Triton op, driven by the selection's BlockMask.

Inputs: q [B, Hq, T, Dk], the branch's k [B, Hkv, T, Dk] and v [B, Hkv, T, Dv], the selection
`sel` [B, Hkv, T, n] (block indices of l' keys, -1 unused; one list per position and GQA group,
Eq. 10), a per-position key band `lo`, `hi` [B|1, T] (e.g. the document's first token; keys are
also never after the query) and the selection BlockMask in the packed layout (query row r = token
r // G, head r % G; q block = P positions x G heads, P = `tile_positions(G, rows)`: 16 rows'
worth by default, 2 positions at G = 8; kv block = l'). Its settings are one frozen record passed
with the inputs (`SelectedTuning`, `selected_tuning.py`):
  * forward and dQ are query-centric: one program per (q block, batch, KV head) holds the G heads of
    its P positions (G heads as next_power_of_2(G) rows) and walks the block's q-major lists
    (partial and full blocks: the union of the P positions' selections), loading each selected
    K/V block once for all its rows. The forward walks the two lists as one, in increasing block
    order: a row adds its own blocks in the order of its own selection and a block it does not
    see is an exact no-op (p = 0, its running max and sum unchanged), so a position's output and
    lse are bit-identical whatever the later positions of its q block pick or hold (a later
    position dropping a block turns it from full to partial for the q block, which under
    partial-then-full changed the order: tests/ops/test_selected_prefix.py). The dQ pass walks
    partial, then full (its rounding still depends on the q block's other positions). The
    forward's q blocks may hold more positions than the dQ pass's (`SelectedTuning.fwd_rows`);
    then the dQ pass is hybrid (`SelectedTuning.dq_hybrid`): each of the forward's blocks runs as
    one wide tile or as its narrow blocks, whichever walks fewer steps;
  * dK/dV is KV-block-centric: one program per (kv block, batch, KV head), the KV heads
    interleaved, walks the inverse of the per-position selection (for each kv block, the
    positions that selected it: CSR, built from `sel` in the backward) and gathers `dkv_rows`
    rows of them per MMA step (each position's G heads unpadded there: 16 positions a step at
    G = 8). The most-read blocks (block 0, popular blocks: `heavy` of them per head) are split
    into equal shares of their list; each share adds its dK/dV into the block's fp32 accumulator
    by atomics (fp32 adds in arrival order: a heavy block's dK/dV is not bit-reproducible run to
    run). With atomics for dQ (`SelectedTuning.fuse_dq`) the same pass also adds each tile's
    dQ = dS @ K into an fp32 buffer and the dQ kernel does not run.
Inside a partial block every row keeps exactly its own selection: row r sees key s iff s's block
is in sel[t] and lo[t] <= s <= min(hi[t], t). d_k that is not a power of two (192) runs as two
dots (128 + 64), not padded to 256.

A sequence shard (context parallelism): q, sel, lo, hi and the lists hold T rows at positions
q_offset .. q_offset + T - 1, k and v the whole sequence's S >= q_offset + T keys; the kernels
take the rows' positions (row + q_offset) for the causal bound and the default band, and dK/dV
cover all S keys.

`torch.ops.nsa_flex.selected_attention_fwd` is a `triton_op` with autograd (its backward the
`triton_op` `selected_attention_bwd`) (no graph break, no host
sync, static shapes); under TRITON_INTERPRET=1 it runs on CPU tensors through Triton's
interpreter (how the CPU tests compare it with the reference backend). lse (natural log, -inf for a
row that sees nothing) is differentiable too.
"""

import math
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from masks import MaskSpec
from masks.core import captured, kv_major_csr

from .selected_tuning import DEFAULT_TUNING, SelectedTuning, padded_group, tile_positions

LOG2E = 1.4426950408889634


def head_split(d: int) -> tuple[int, int]:
    """(D1, D2): a head dim as two power-of-two dot widths (D2 = 0: one dot, padded to D1)."""
    p = triton.next_power_of_2(d)
    if p == d:
        return max(d, 16), 0
    lo = p // 2
    if d - lo >= 16 and triton.next_power_of_2(d - lo) == d - lo:
        return lo, d - lo
    return max(p, 16), 0


def supported(q: Tensor, k: Tensor, v: Tensor, l_sel: int) -> str | None:
    """Why the op cannot run these inputs (None: it can)."""
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"dtype {q.dtype} (bf16, fp16 and fp32 only)"
    if l_sel not in (16, 32, 64, 128):
        return f"selection block l_sel={l_sel} (16, 32, 64 or 128)"
    if q.shape[-1] < 16 or v.shape[-1] < 16:
        return "head dims below 16"
    if q.shape[-1] > 256 or v.shape[-1] > 256:
        return "head dims above 256"
    return None


# ---------------------------------------------------------------------- Triton helpers
@triton.jit
def _rows(tile, BT: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BM: tl.constexpr, T):
    """Row r of q block `tile`: token tile * BT + r // GP, head r % GP (heads >= G: padding)."""
    r = tl.arange(0, BM)
    t = tile * BT + r // GP
    g = r % GP
    return t.to(tl.int64), g.to(tl.int64), (t < T) & (g < G)


@triton.jit
def _load_q(ptr, off, ok, D: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr):
    """Rows at offsets off [R] of a tensor with a contiguous last dim: ([R, D1], [R, D2])."""
    d1 = tl.arange(0, D1)
    a = tl.load(ptr + off[:, None] + d1[None, :], mask=ok[:, None] & (d1 < D)[None, :], other=0.0)
    if D2 > 0:
        d2 = D1 + tl.arange(0, D2)
        b = tl.load(ptr + off[:, None] + d2[None, :], mask=ok[:, None], other=0.0)
    else:
        b = a
    return a, b


@triton.jit
def _dot2(a1, a2, b1, b2, D2: tl.constexpr, PREC: tl.constexpr):
    """a @ b^T over a head dim held as two pieces (a1|a2, b1|b2)."""
    s = tl.dot(a1, tl.trans(b1), input_precision=PREC)
    if D2 > 0:
        s += tl.dot(a2, tl.trans(b2), input_precision=PREC)
    return s


@triton.jit
def _visible(kk, t, lo, hi, sel, j, row_ok):
    """[R, BLOCK] visibility of keys kk of block j for rows at tokens t with bands lo..hi and
    selections sel [R, NP]: the row selected j, and lo <= key <= min(hi, t)."""
    hit = tl.max((sel == j).to(tl.int32), 1) > 0
    top = tl.minimum(hi, t)
    return (hit & row_ok)[:, None] & (kk[None, :] <= top[:, None]) & (kk[None, :] >= lo[:, None])


@triton.jit
def _row_state(SEL, LO, HI, bh, b, t, row_ok, T, s_lb, Q0, NSEL: tl.constexpr, NP: tl.constexpr,
               HAS_BAND: tl.constexpr):
    """The rows' selections [R, NP] (int32, -1 pads) and key bands lo, hi [R] (rows t of T, at
    positions t + Q0: without a band, keys 0 .. the position)."""
    n = tl.arange(0, NP)
    sel = tl.load(SEL + (bh * T + t)[:, None] * NSEL + n[None, :],
                  mask=row_ok[:, None] & (n < NSEL)[None, :], other=-1)
    if HAS_BAND:
        lo = tl.load(LO + b * s_lb + t, mask=row_ok, other=0)
        hi = tl.load(HI + b * s_lb + t, mask=row_ok, other=0)
    else:
        lo = t * 0
        hi = t + Q0
    return sel, lo, hi


@triton.jit
def _keys(j, S, BLOCK: tl.constexpr):
    """The keys kk of selection block j and which exist (S keys)."""
    kk = j.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    return kk, kk < S


@triton.jit
def _kv_block(K, V, koff, voff, kk, k_ok, DK: tl.constexpr, DK1: tl.constexpr,
              DK2: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr):
    """The K ([BLOCK, DK1], [BLOCK, DK2]) and V rows of keys kk."""
    k1, k2 = _load_q(K + koff, kk * DK, k_ok, DK, DK1, DK2)
    dv = tl.arange(0, DVP)
    v = tl.load(V + voff + kk[:, None] * DV + dv[None, :], mask=k_ok[:, None] & (dv < DV)[None, :],
                other=0.0)
    return k1, k2, v


# Output addresses are computed from program ids and the block lists only, never from what a helper
# that takes an input pointer returns: torch's Triton mutation analysis (TTIR) follows a store's
# address back through such a call and would count that input as written (functionalization then
# copies the inputs back, and a leaf input that requires grad fails to compile).
@triton.jit
def _q_rows(T, HKV, G: tl.constexpr, GP: tl.constexpr, BT: tl.constexpr, BM: tl.constexpr):
    """This program's q block (grid: q block, batch x KV head): tile, bh, b, its rows' tokens t,
    which exist, and their rows of q [B, Hq, T, *]."""
    tile = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // HKV
    h = bh % HKV
    t, g, row_ok = _rows(tile, BT, G, GP, BM, T)
    return tile, bh, b, t, row_ok, ((b * HKV + h) * G + g) * T + t


@triton.jit
def _q_state(Q, SEL, LO, HI, qrow, bh, b, t, row_ok, T, s_lb, Q0, NSEL: tl.constexpr,
             NP: tl.constexpr, DK: tl.constexpr, DK1: tl.constexpr, DK2: tl.constexpr,
             HAS_BAND: tl.constexpr):
    """The q block's loaded state: q ([R, DK1], [R, DK2]), selections [R, NP] and key bands."""
    q1, q2 = _load_q(Q, qrow * DK, row_ok, DK, DK1, DK2)
    sel, lo, hi = _row_state(SEL, LO, HI, bh, b, t, row_ok, T, s_lb, Q0, NSEL, NP, HAS_BAND)
    return q1, q2, sel, lo, hi


@triton.jit
def _grad_rows(DO, LSE, DELTA, qrow, row_ok, DV: tl.constexpr, DVP: tl.constexpr):
    """dO, lse (log2 units; +inf for a row that sees nothing, so its p is 0) and delta of rows."""
    dv = tl.arange(0, DVP)
    do = tl.load(DO + (qrow * DV)[:, None] + dv[None, :], mask=row_ok[:, None] & (dv < DV)[None, :],
                 other=0.0)
    lse = tl.load(LSE + qrow, mask=row_ok, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(DELTA + qrow, mask=row_ok, other=0.0)
    return do, lse2, delta


# ---------------------------------------------------------------------- forward
@triton.jit
def _merged_next(KVI, FKVI, base, ip, jf, n_part, n_full):
    """The next kv block of a q block's partial (KVI) and full (FKVI) lists, both increasing,
    walked as one increasing list from positions ip, jf: (j, whether it is partial, ip, jf
    after it). A q block never lists a block in both."""
    bp = tl.load(KVI + base + ip, mask=ip < n_part, other=2147483647)
    bf = tl.load(FKVI + base + jf, mask=jf < n_full, other=2147483647)
    partial = bp < bf
    step = partial.to(tl.int32)
    return tl.minimum(bp, bf), partial, ip + step, jf + 1 - step


@triton.jit
def _fwd_step(acc, m_i, l_i, q1, q2, K, V, koff, voff, j, pos, lo, hi, sel, row_ok, S, qk_scale,
              partial, BLOCK: tl.constexpr, DK: tl.constexpr, DK1: tl.constexpr,
              DK2: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr, PREC: tl.constexpr):
    """One kv block j of the online softmax (`partial`: masked per row). For a row that does not
    see the block every step is exact: s = -inf, so m_i stays, alpha = 1, p = 0, acc and l_i
    unchanged bit for bit. pos: the rows' positions; S keys."""
    kk, k_ok = _keys(j, S, BLOCK)
    k1, k2, v = _kv_block(K, V, koff, voff, kk, k_ok, DK, DK1, DK2, DV, DVP)
    s = _dot2(q1, q2, k1, k2, DK2, PREC) * qk_scale
    if partial:
        s = tl.where(_visible(kk, pos, lo, hi, sel, j, row_ok), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.where(m_new == m_i, 1.0, tl.math.exp2(m_i - m_use))  # exactly 1 where m stays
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return acc, m_new, l_i


@triton.jit
def _sel_fwd_kernel(Q, K, V, SEL, LO, HI, KVN, KVI, FKVN, FKVI, O, LSE,
                    T, S, Q0, HKV, NQB, W, s_lb,
                    QK_SCALE: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BT: tl.constexpr, BM: tl.constexpr, NSEL: tl.constexpr,
                    NP: tl.constexpr, BLOCK: tl.constexpr, DK: tl.constexpr, DK1: tl.constexpr,
                    DK2: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr,
                    HAS_BAND: tl.constexpr, PREC: tl.constexpr):
    # T query rows at positions Q0 .. Q0 + T - 1 (a sequence shard: Q0 > 0) against S keys
    tile, bh, b, t, row_ok, qrow = _q_rows(T, HKV, G, GP, BT, BM)
    q1, q2, sel, lo, hi = _q_state(Q, SEL, LO, HI, qrow, bh, b, t, row_ok, T, s_lb, Q0, NSEL, NP,
                                   DK, DK1, DK2, HAS_BAND)
    koff = bh * S * DK
    voff = bh * S * DV
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, DVP], tl.float32)
    lst = bh * NQB + tile
    n_part = tl.load(KVN + lst)
    n_full = tl.load(FKVN + lst)
    # the partial and full lists as one walk in increasing block order: each row then adds its
    # own blocks in the order of its own selection, whichever of the two lists the q block's
    # other positions put them in (partial-then-full made the order depend on them)
    ip = 0
    jf = 0
    for _ in range(n_part + n_full):
        j, partial, ip, jf = _merged_next(KVI, FKVI, lst * W, ip, jf, n_part, n_full)
        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q1, q2, K, V, koff, voff, j, t + Q0, lo, hi,
                                  sel, row_ok, S, QK_SCALE, partial, BLOCK, DK, DK1, DK2, DV, DVP, PREC)
    seen = l_i > 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    dv = tl.arange(0, DVP)
    tl.store(O + (qrow * DV)[:, None] + dv[None, :], o.to(O.dtype.element_ty),
             mask=row_ok[:, None] & (dv < DV)[None, :])
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) / 1.4426950408889634,
                   float("-inf"))
    tl.store(LSE + qrow, lse, mask=row_ok)


# ---------------------------------------------------------------------- dQ
@triton.jit
def _dq_step(dq1, dq2, q1, q2, do, lse2, delta, K, V, koff, voff, j, pos, lo, hi, sel, row_ok, S,
             qk_scale, MASKED: tl.constexpr, BLOCK: tl.constexpr, DK: tl.constexpr,
             DK1: tl.constexpr, DK2: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr,
             PREC: tl.constexpr):
    kk, k_ok = _keys(j, S, BLOCK)
    k1, k2, v = _kv_block(K, V, koff, voff, kk, k_ok, DK, DK1, DK2, DV, DVP)
    s = _dot2(q1, q2, k1, k2, DK2, PREC) * qk_scale
    p = tl.math.exp2(s - lse2[:, None])
    if MASKED:
        p = tl.where(_visible(kk, pos, lo, hi, sel, j, row_ok), p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PREC)
    ds = (p * (dp - delta[:, None])).to(k1.dtype)
    dq1 += tl.dot(ds, k1, input_precision=PREC)
    if DK2 > 0:
        dq2 += tl.dot(ds, k2, input_precision=PREC)
    return dq1, dq2


@triton.jit
def _wide_wins(NKVN, NFKVN, WKVN, WFKVN, bh, wtile, NQB_N, NQB_W, KW: tl.constexpr,
               WCOST: tl.constexpr):
    """Whether wide q block `wtile` (KW narrow blocks' positions) runs its dQ as one wide tile over
    the union of their lists rather than as KW narrow tiles over their own: a wide block step costs
    about WCOST narrow ones."""
    u = tl.load(WKVN + bh * NQB_W + wtile) + tl.load(WFKVN + bh * NQB_W + wtile)
    n = wtile * KW + tl.arange(0, KW)
    ok = n < NQB_N
    s = tl.sum(tl.load(NKVN + bh * NQB_N + n, mask=ok, other=0)
               + tl.load(NFKVN + bh * NQB_N + n, mask=ok, other=0))
    return u * WCOST <= s


@triton.jit
def _sel_dq_kernel(Q, K, V, DO, LSE, DELTA, SEL, LO, HI, KVN, KVI, FKVN, FKVI, NKVN, NFKVN, WKVN,
                   WFKVN, DQ, T, S, Q0, HKV, NQB, W, NQB_N, NQB_W, s_lb,
                   QK_SCALE: tl.constexpr, SM_SCALE: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BT: tl.constexpr, BM: tl.constexpr, NSEL: tl.constexpr,
                   NP: tl.constexpr, BLOCK: tl.constexpr, DK: tl.constexpr, DK1: tl.constexpr,
                   DK2: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr,
                   HAS_BAND: tl.constexpr, PREC: tl.constexpr, MODE: tl.constexpr,
                   KW: tl.constexpr, WCOST: tl.constexpr):
    """dQ of q blocks walking KVN..FKVI. MODE 0: every block. Hybrid:
    MODE 1 (narrow blocks) skips the positions whose wide block `_wide_wins`, MODE 2 (wide blocks)
    runs only those; NKVN / NFKVN and WKVN / WFKVN are the narrow and wide lists' counts."""
    tile, bh, b, t, row_ok, qrow = _q_rows(T, HKV, G, GP, BT, BM)
    if MODE == 1:
        run = not _wide_wins(NKVN, NFKVN, WKVN, WFKVN, bh, tile // KW, NQB_N, NQB_W, KW, WCOST)
    elif MODE == 2:
        run = _wide_wins(NKVN, NFKVN, WKVN, WFKVN, bh, tile, NQB_N, NQB_W, KW, WCOST)
    else:
        run = True
    if run:
        _dq_tile(Q, K, V, DO, LSE, DELTA, SEL, LO, HI, KVN, KVI, FKVN, FKVI, DQ, T, S, Q0, NQB, W,
                 s_lb,
                 tile, bh, b, t, row_ok, qrow, QK_SCALE, SM_SCALE, NSEL, NP, BLOCK, DK, DK1, DK2,
                 DV, DVP, HAS_BAND, PREC, BM)


@triton.jit
def _dq_tile(Q, K, V, DO, LSE, DELTA, SEL, LO, HI, KVN, KVI, FKVN, FKVI, DQ, T, S, Q0, NQB, W, s_lb,
             tile, bh, b, t, row_ok, qrow, QK_SCALE: tl.constexpr, SM_SCALE: tl.constexpr,
             NSEL: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr, DK: tl.constexpr,
             DK1: tl.constexpr, DK2: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr,
             HAS_BAND: tl.constexpr, PREC: tl.constexpr, BM: tl.constexpr):
    q1, q2, sel, lo, hi = _q_state(Q, SEL, LO, HI, qrow, bh, b, t, row_ok, T, s_lb, Q0, NSEL, NP,
                                   DK, DK1, DK2, HAS_BAND)
    koff = bh * S * DK
    voff = bh * S * DV
    do, lse2, delta = _grad_rows(DO, LSE, DELTA, qrow, row_ok, DV, DVP)
    dq1 = tl.zeros([BM, DK1], tl.float32)
    dq2 = tl.zeros([BM, DK2 if DK2 > 0 else DK1], tl.float32)
    lst = bh * NQB + tile
    n_part = tl.load(KVN + lst)
    for i in range(n_part):
        j = tl.load(KVI + lst * W + i)
        dq1, dq2 = _dq_step(dq1, dq2, q1, q2, do, lse2, delta, K, V, koff, voff, j, t + Q0, lo, hi,
                            sel, row_ok, S, QK_SCALE, True, BLOCK, DK, DK1, DK2, DV, DVP, PREC)
    n_full = tl.load(FKVN + lst)
    for i in range(n_full):
        j = tl.load(FKVI + lst * W + i)
        dq1, dq2 = _dq_step(dq1, dq2, q1, q2, do, lse2, delta, K, V, koff, voff, j, t + Q0, lo, hi,
                            sel, row_ok, S, QK_SCALE, False, BLOCK, DK, DK1, DK2, DV, DVP, PREC)
    d1 = tl.arange(0, DK1)
    tl.store(DQ + (qrow * DK)[:, None] + d1[None, :], (dq1 * SM_SCALE).to(DQ.dtype.element_ty),
             mask=row_ok[:, None] & (d1 < DK)[None, :])
    if DK2 > 0:
        d2 = DK1 + tl.arange(0, DK2)
        tl.store(DQ + (qrow * DK)[:, None] + d2[None, :], (dq2 * SM_SCALE).to(DQ.dtype.element_ty),
                 mask=row_ok[:, None])


# ---------------------------------------------------------------------- dK / dV
@triton.jit
def _delta_kernel(O, DO, DLSE, DELTA, N, DV: tl.constexpr, DVP: tl.constexpr,
                  HAS_DLSE: tl.constexpr, R: tl.constexpr):
    """delta = rowsum(dO * O) in fp32 (FlashAttention's D_i), minus dlse when lse has a gradient."""
    r = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)
    d = tl.arange(0, DVP)
    ok = r < N
    m = ok[:, None] & (d < DV)[None, :]
    o = tl.load(O + (r * DV)[:, None] + d[None, :], mask=m, other=0.0).to(tl.float32)
    do = tl.load(DO + (r * DV)[:, None] + d[None, :], mask=m, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + r, mask=ok, other=0.0).to(tl.float32)
    tl.store(DELTA + r, delta, mask=ok)


@triton.jit
def _dkv_step(dk1, dk2, dv_acc, k1, k2, v, kk, e, e_end, qi, Q, DO, LSE, DELTA, LO, HI, DQA, b, h,
              T, Q0, HKV, s_lb, qk_scale, sm_scale, NG: tl.constexpr, G: tl.constexpr,
              GP: tl.constexpr, DK: tl.constexpr, DK1: tl.constexpr, DK2: tl.constexpr,
              DV: tl.constexpr, DVP: tl.constexpr, HAS_BAND: tl.constexpr, PREC: tl.constexpr,
              FUSE_DQ: tl.constexpr):
    """Entries e .. e + NG of this kv block's list (positions that selected it; qi points at its
    CSR row) gathered into one NG*GP-row tile: row r is head r % GP of the position of entry
    e + r // GP. Every listed position selected the block, so only its key band masks (keys
    after it, outside its document). FUSE_DQ: the tile's dQ = dS @ K is added to the fp32 DQA
    [B, Hq, T, DK] (rows are distinct within a tile; other kv blocks' programs add to the same
    rows). Entries are rows of T; a row's position is row + Q0."""
    r = tl.arange(0, NG * GP)
    ent = e + r // GP
    ok = ent < e_end
    t = tl.load(qi + ent, mask=ok, other=0).to(tl.int64)
    g = (r % GP).to(tl.int64)
    row_ok = ok & (g < G)
    qrow = ((b * HKV + h) * G + g) * T + t
    q1, q2 = _load_q(Q, qrow * DK, row_ok, DK, DK1, DK2)
    do, lse2, delta = _grad_rows(DO, LSE, DELTA, qrow, row_ok, DV, DVP)
    s = _dot2(q1, q2, k1, k2, DK2, PREC) * qk_scale  # [NG*GP, BLOCK]
    p = tl.math.exp2(s - lse2[:, None])
    if HAS_BAND:
        lo = tl.load(LO + b * s_lb + t, mask=row_ok, other=0)
        top = tl.minimum(tl.load(HI + b * s_lb + t, mask=row_ok, other=0), t + Q0)
        vis = row_ok[:, None] & (kk[None, :] <= top[:, None]) & (kk[None, :] >= lo[:, None])
    else:
        vis = row_ok[:, None] & (kk[None, :] <= (t + Q0)[:, None])
    p = tl.where(vis, p, 0.0)
    pt = tl.trans(p.to(do.dtype))  # [BLOCK, NG*GP]
    dv_acc += tl.dot(pt, do, input_precision=PREC)
    dp = tl.dot(do, tl.trans(v), input_precision=PREC)  # [NG*GP, BLOCK]
    ds = (p * (dp - delta[:, None])).to(q1.dtype)
    dst = tl.trans(ds)
    dk1 += tl.dot(dst, q1, input_precision=PREC)
    if DK2 > 0:
        dk2 += tl.dot(dst, q2, input_precision=PREC)
    if FUSE_DQ:
        d1 = tl.arange(0, DK1)
        tl.atomic_add(DQA + (qrow * DK)[:, None] + d1[None, :],
                      tl.dot(ds, k1, input_precision=PREC) * sm_scale,
                      mask=row_ok[:, None] & (d1 < DK)[None, :], sem="relaxed")
        if DK2 > 0:
            d2 = DK1 + tl.arange(0, DK2)
            tl.atomic_add(DQA + (qrow * DK)[:, None] + d2[None, :],
                          tl.dot(ds, k2, input_precision=PREC) * sm_scale,
                          mask=row_ok[:, None], sem="relaxed")
    return dk1, dk2, dv_acc


@triton.jit
def _sel_dkv_kernel(Q, K, V, DO, LSE, DELTA, LO, HI, QN, QOFF, QI, HSLOT, HEAVY, DK_, DV_, DKA,
                    DVA, DQA, T, S, Q0, TP, HKV, BHKV, NKB, WP, NH, NSPLIT, s_lb,
                    QK_SCALE: tl.constexpr, SM_SCALE: tl.constexpr, NG: tl.constexpr,
                    G: tl.constexpr, GP: tl.constexpr, BLOCK: tl.constexpr, DK: tl.constexpr,
                    DK1: tl.constexpr, DK2: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr,
                    HAS_BAND: tl.constexpr, PREC: tl.constexpr, FUSE_DQ: tl.constexpr):
    # program (pid, bh) is BHKV * pid + bh: the KV heads interleaved, so no head's long lists
    # start last and run alone at the end
    pid = tl.program_id(0) // BHKV
    bh = (tl.program_id(0) % BHKV).to(tl.int64)
    b = bh // HKV
    h = bh % HKV
    if pid < NKB:  # one program per kv block; a heavy block is left to its shares
        j = pid
        slot = tl.load(HSLOT + bh * NKB + j)
        share = slot * 0
    else:
        w = pid - NKB
        slot = w // NSPLIT
        share = w % NSPLIT
        j = tl.load(HEAVY + bh * NH + slot)
    lst = bh * NKB + j
    n_all = tl.load(QN + lst)
    qi = QI + bh * WP + tl.load(QOFF + lst)  # this kv block's CSR row: the positions that chose it
    if pid < NKB:
        e0 = n_all * 0
        e1 = tl.where(slot >= 0, 0, n_all)
    else:
        per = tl.cdiv(tl.cdiv(n_all, NSPLIT), NG) * NG  # whole gathers per share
        e0 = tl.minimum(share * per, n_all)
        e1 = tl.minimum(e0 + per, n_all)
    koff = bh * S * DK
    voff = bh * S * DV
    kk, k_ok = _keys(j, S, BLOCK)
    k1, k2, v = _kv_block(K, V, koff, voff, kk, k_ok, DK, DK1, DK2, DV, DVP)
    dv = tl.arange(0, DVP)
    dk1 = tl.zeros([BLOCK, DK1], tl.float32)
    dk2 = tl.zeros([BLOCK, DK2 if DK2 > 0 else DK1], tl.float32)
    dv_acc = tl.zeros([BLOCK, DVP], tl.float32)
    for e in range(e0, e1, NG):
        dk1, dk2, dv_acc = _dkv_step(dk1, dk2, dv_acc, k1, k2, v, kk, e, e1, qi, Q, DO, LSE, DELTA,
                                     LO, HI, DQA, b, h, T, Q0, HKV, s_lb, QK_SCALE, SM_SCALE, NG, G,
                                     GP, DK, DK1, DK2, DV, DVP, HAS_BAND, PREC, FUSE_DQ)
    d1 = tl.arange(0, DK1)
    if pid < NKB:  # dK/dV are [B, HKV, TP, D]: the S keys padded to whole blocks
        ooff_k = bh * TP * DK
        ooff_v = bh * TP * DV
        ok = k_ok & ((kk * 0 + slot) < 0)
        tl.store(DK_ + ooff_k + (kk * DK)[:, None] + d1[None, :],
                 (dk1 * SM_SCALE).to(DK_.dtype.element_ty), mask=ok[:, None] & (d1 < DK)[None, :])
        if DK2 > 0:
            d2 = DK1 + tl.arange(0, DK2)
            tl.store(DK_ + ooff_k + (kk * DK)[:, None] + d2[None, :],
                     (dk2 * SM_SCALE).to(DK_.dtype.element_ty), mask=ok[:, None])
        tl.store(DV_ + ooff_v + (kk * DV)[:, None] + dv[None, :], dv_acc.to(DV_.dtype.element_ty),
                 mask=ok[:, None] & (dv < DV)[None, :])
    else:  # a share: added into its block's zeroed fp32 accumulators [B*HKV, NH, BLOCK, D]
        r = (bh * NH + slot) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        ok = (r * 0 + e0) < e1  # an empty share (a short list split NSPLIT ways) adds nothing
        tl.atomic_add(DKA + (r * DK)[:, None] + d1[None, :], dk1 * SM_SCALE,
                      mask=ok[:, None] & (d1 < DK)[None, :], sem="relaxed")
        if DK2 > 0:
            d2 = DK1 + tl.arange(0, DK2)
            tl.atomic_add(DKA + (r * DK)[:, None] + d2[None, :], dk2 * SM_SCALE,
                          mask=ok[:, None], sem="relaxed")
        tl.atomic_add(DVA + (r * DV)[:, None] + dv[None, :], dv_acc,
                      mask=ok[:, None] & (dv < DV)[None, :], sem="relaxed")


# ---------------------------------------------------------------------- launchers
def _band(lo, hi, B: int, T: int, device):
    if lo is None:
        z = torch.zeros(1, T, dtype=torch.int64, device=device)
        return z, z, 0, False
    lo = lo.to(torch.int64).expand(-1, T).contiguous()
    hi = hi.to(torch.int64).expand(-1, T).contiguous()
    return lo, hi, (T if lo.shape[0] > 1 else 0), True


def _prec(dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _q_block_consts(q: Tensor, v: Tensor, sel: Tensor, l_sel: int, rows: int,
                    has_band: bool, name: str, tuning: SelectedTuning) -> dict:
    """The constexprs and launch options of the query-centric kernel `name` (fwd, dq)."""
    G, Dk, Dv = q.shape[1] // v.shape[1], q.shape[-1], v.shape[-1]
    BT, gp = tile_positions(G, rows), padded_group(G)
    dk1, dk2 = head_split(Dk)
    return dict(G=G, GP=gp, BT=BT, BM=BT * gp, NSEL=sel.shape[-1],
                NP=max(2, triton.next_power_of_2(sel.shape[-1])), BLOCK=l_sel, DK=Dk, DK1=dk1,
                DK2=dk2, DV=Dv, DVP=max(16, triton.next_power_of_2(Dv)), HAS_BAND=has_band,
                PREC=_prec(q.dtype), **tuning.launch_opts(name, q.dtype, BT * gp))


@triton_op("nsa_flex::selected_attention_fwd", mutates_args=())
def selected_attention_fwd(q: Tensor, k: Tensor, v: Tensor, sel: Tensor, lo: Optional[Tensor],
                           hi: Optional[Tensor], kv_num: Tensor, kv_idx: Tensor, full_num: Tensor,
                           full_idx: Tensor, dq_num: Tensor, dq_idx: Tensor, dq_full_num: Tensor,
                           dq_full_idx: Tensor, scale: float, l_sel: int, rows: int, rows_dq: int,
                           tuning: list[int], q_offset: int = 0) -> tuple[Tensor, Tensor]:
    """(out [B, Hq, T, Dv], lse [B, Hq, T]) from the selection's q-major lists (q blocks of `rows`
    rows); dq_*: the lists of the dQ pass's q blocks (`rows_dq` rows), read by the backward;
    tuning: `SelectedTuning.encode()`; q_offset: the position of query row 0 (k, v hold S >=
    q_offset + T keys from position 0)."""
    B, Hq, T, _ = q.shape
    Hkv, Dv = k.shape[1], v.shape[-1]
    nqb = kv_num.shape[-1]
    o = torch.empty(B, Hq, T, Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, T, dtype=torch.float32, device=q.device)
    if T == 0 or B == 0:
        return o, lse
    lo_, hi_, s_lb, has_band = _band(lo, hi, B, T, q.device)
    wrap_triton(_sel_fwd_kernel)[(nqb, B * Hkv)](
        q, k, v, sel, lo_, hi_, kv_num, kv_idx, full_num, full_idx, o, lse,
        T, k.shape[2], q_offset, Hkv, nqb, kv_idx.shape[-1], s_lb, QK_SCALE=scale * LOG2E,
        **_q_block_consts(q, v, sel, l_sel, rows, has_band, "fwd", SelectedTuning.decode(tuning)))
    return o, lse


@triton_op("nsa_flex::selected_attention_bwd", mutates_args=())
def selected_attention_bwd(do: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor,
                           o: Tensor, lse: Tensor, sel: Tensor, lo: Optional[Tensor],
                           hi: Optional[Tensor], kv_num: Tensor, kv_idx: Tensor, full_num: Tensor,
                           full_idx: Tensor, w_num: Tensor, w_idx: Tensor, w_full_num: Tensor,
                           w_full_idx: Tensor, scale: float, l_sel: int, rows: int, rows_wide: int,
                           tuning: list[int], q_offset: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv; kv_num .. full_idx: the dQ pass's q-major lists (q blocks of `rows` rows);
    w_num .. w_full_idx: the forward's (`rows_wide` rows). Where the forward's q blocks hold several
    of the dQ pass's (`SelectedTuning.dq_hybrid`), each of its blocks runs its dQ either as one wide
    tile over their union list or as its narrow blocks over their own lists, whichever is fewer
    steps by the tuning's wide_dq_cost (`_wide_wins`): trained picks share most blocks between
    adjacent positions (wide wins), random ones few (narrow wins). q_offset: as the forward's; dk,
    dv cover all S keys (0 where no row reads)."""
    tuning = SelectedTuning.decode(tuning)
    B, Hq, T, Dk = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[-1]
    G = Hq // Hkv
    nqb = kv_num.shape[-1]
    nkb = -(-S // l_sel)
    dq = torch.empty_like(q)
    dk_pad = torch.empty(B, Hkv, nkb * l_sel, Dk, dtype=k.dtype, device=k.device)
    dv_pad = torch.empty(B, Hkv, nkb * l_sel, Dv, dtype=v.dtype, device=v.device)
    if T == 0 or B == 0:
        return dq, dk_pad[:, :, :S].zero_(), dv_pad[:, :, :S].zero_()
    do = do.contiguous()
    # D_i = rowsum(dO * O) (FlashAttention's delta); a gradient on lse enters as -dlse
    delta = torch.empty(B, Hq, T, dtype=torch.float32, device=q.device)
    n_rows = B * Hq * T
    dvp = max(16, triton.next_power_of_2(Dv))
    wrap_triton(_delta_kernel)[(triton.cdiv(n_rows, 64),)](
        o, do, dlse.float().contiguous() if dlse is not None else lse, delta, n_rows, DV=Dv, DVP=dvp,
        HAS_DLSE=dlse is not None, R=64, num_warps=4)
    lo_, hi_, s_lb, has_band = _band(lo, hi, B, T, q.device)
    dk1, dk2 = head_split(Dk)
    fuse_dq = tuning.fuse_dq(G, Dk)
    if fuse_dq:  # accumulated by the dK/dV pass
        dqa = torch.zeros(B, Hq, T, Dk, dtype=torch.float32, device=q.device)
    else:
        dqa = dq  # not written by the dK/dV pass
        kw = tuning.dq_hybrid(G, rows_wide, rows)
        nqb_w = w_num.shape[-1]
        args = (do, lse, delta, sel, lo_, hi_)
        counts = (kv_num, full_num, w_num, w_full_num)
        wrap_triton(_sel_dq_kernel)[(nqb, B * Hkv)](
            q, k, v, *args, kv_num, kv_idx, full_num, full_idx, *counts, dq, T, S, q_offset, Hkv, nqb,
            kv_idx.shape[-1], nqb, nqb_w, s_lb, QK_SCALE=scale * LOG2E, SM_SCALE=scale,
            MODE=1 if kw else 0, KW=max(kw, 1), WCOST=tuning.wide_dq_cost,
            **_q_block_consts(q, v, sel, l_sel, rows, has_band, "dq", tuning))
        if kw:
            wrap_triton(_sel_dq_kernel)[(nqb_w, B * Hkv)](
                q, k, v, *args, w_num, w_idx, w_full_num, w_full_idx, *counts, dq, T, S, q_offset, Hkv,
                nqb_w,
                w_idx.shape[-1], nqb, nqb_w, s_lb, QK_SCALE=scale * LOG2E, SM_SCALE=scale,
                MODE=2, KW=kw, WCOST=tuning.wide_dq_cost,
                **_q_block_consts(q, v, sel, l_sel, rows_wide, has_band, "dq", tuning))
    # dK/dV walk the inverse of the per-position selection (whatever the forward's q blocks):
    # for each kv block, the positions that selected it (CSR), so no gathered row is wasted on a
    # position that did not choose the block and no row needs the selection test
    p_num, p_idx = kv_major_csr(None, sel, nkb)
    # the tuning's `heavy` most-read kv blocks of each head are split into NSPLIT shares of their
    # lists
    nh = max(1, min(tuning.heavy, nkb))  # at least one slot: the shapes stay static
    nsplit = max(1, min(64, -(-T // tuning.split_tiles)))
    count = p_num.view(B * Hkv, nkb)
    heavy_idx = torch.topk(count, nh, dim=-1).indices.to(torch.int32).contiguous()  # [BH, nh]
    hslot = torch.full((B * Hkv, nkb), -1, dtype=torch.int32, device=q.device)
    hslot.scatter_(1, heavy_idx.long(), torch.arange(nh, dtype=torch.int32, device=q.device)
                   .expand(B * Hkv, nh).contiguous())
    # their shares add into one fp32 accumulator per heavy block (NSPLIT times less memory than a
    # partial per share, and no sum over shares)
    dka = torch.zeros(B * Hkv, nh, l_sel, Dk, dtype=torch.float32, device=q.device)
    dva = torch.zeros(B * Hkv, nh, l_sel, Dv, dtype=torch.float32, device=q.device)
    p_off = (torch.cumsum(p_num, -1) - p_num).to(torch.int32)  # CSR row starts
    # a position's G heads take next_power_of_2(G) rows of the gathered tile (no tensor-core
    # minimum per position there: the tile is NG positions deep), so at G = 8 a 128-row step holds
    # 16 positions
    gd = triton.next_power_of_2(G)
    # 128 rows where measured (d_k <= 64, or dQ not fused: the fused dQ's extra tiles at d_k 192
    # need more shared memory than an H100 has); fp32 tiles take twice the registers: 64
    wide_ok = q.dtype != torch.float32 and (Dk <= 64 or not fuse_dq)
    rows_dkv = tuning.dkv_rows if wide_ok else min(tuning.dkv_rows, 64)
    wrap_triton(_sel_dkv_kernel)[((nkb + nh * nsplit) * B * Hkv,)](
        q, k, v, do, lse, delta, lo_, hi_, p_num, p_off, p_idx, hslot, heavy_idx, dk_pad, dv_pad,
        dka, dva, dqa, T, S, q_offset, nkb * l_sel, Hkv, B * Hkv, nkb, p_idx.shape[-1], nh, nsplit, s_lb,
        QK_SCALE=scale * LOG2E, SM_SCALE=scale, NG=max(1, rows_dkv // gd), G=G, GP=gd,
        BLOCK=l_sel, DK=Dk, DK1=dk1, DK2=dk2, DV=Dv, DVP=dvp, HAS_BAND=has_band,
        PREC=_prec(q.dtype), FUSE_DQ=fuse_dq, **tuning.launch_opts("dkv", q.dtype))
    if fuse_dq:
        dq = dqa.to(q.dtype)
    idx = heavy_idx.long().view(B * Hkv, nh, 1, 1)
    dk_pad.view(B * Hkv, nkb, l_sel, Dk).scatter_(
        1, idx.expand(-1, -1, l_sel, Dk), dka.to(k.dtype))
    dv_pad.view(B * Hkv, nkb, l_sel, Dv).scatter_(
        1, idx.expand(-1, -1, l_sel, Dv), dva.to(v.dtype))
    return dq, dk_pad[:, :, :S], dv_pad[:, :, :S]


def _setup(ctx, inputs, output):
    q, k, v, sel, lo, hi = inputs[:6]
    fwd_lists, dq_lists = inputs[6:10], inputs[10:14]  # the dQ pass's, and the forward's (hybrid)
    scale, l_sel, rows, rows_dq, tuning, q_offset = inputs[14:]
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, sel, lo, hi, *dq_lists, *fwd_lists)
    ctx.extra = (scale, l_sel, rows_dq, rows, tuning, q_offset)


def _backward(ctx, do, dlse):
    q, k, v, o, lse, sel, lo, hi, *lists = ctx.saved_tensors
    dq, dk, dv = torch.ops.nsa_flex.selected_attention_bwd(
        do, dlse, q, k, v, o, lse, sel, lo, hi, *lists, *ctx.extra)
    return (dq, dk, dv) + (None,) * 17


selected_attention_fwd.register_autograd(_backward, setup_context=_setup)


def selected_attention(q: Tensor, k: Tensor, v: Tensor, sel: Tensor, l_sel: int, block_mask,
                       lo: Tensor | None = None, hi: Tensor | None = None,
                       scale: float | None = None, rows: int | None = None,
                       dq_block_mask=None, rows_dq: int | None = None,
                       tuning: SelectedTuning = DEFAULT_TUNING,
                       q_offset: int = 0) -> tuple[Tensor, Tensor]:
    """Attention of q to the selected blocks: (out [B, Hq, T, Dv], lse [B, Hq, T] fp32, natural
    log). sel [B, Hkv, T, n] block indices (-1: unused; a position lists a block at most once);
    lo, hi [B|1, T]: the keys each position may see at most (None: all up to itself); block_mask:
    the selection's BlockMask in the packed layout with q blocks of `tile_positions(G, rows)`
    positions and kv blocks of l_sel (`masks.MaskSpec.block_mask(..., block_size=(P * G, l_sel),
    q_pack=G)`), or its four q-major lists (kv_num_blocks, kv_indices, full_kv_*): the forward's;
    dq_block_mask likewise with q blocks of `tile_positions(G, rows_dq)` positions for the dQ pass
    (None: block_mask and rows). rows / rows_dq default to tuning.rows. The backward's kv-major
    index is the inverse of `sel` itself (`masks.core.kv_major_csr`), built there. tuning: the
    passes' settings (`SelectedTuning`); `selected_lists` builds every other argument from a
    MaskSpec. A sequence shard (context parallelism): q's row t is position t + q_offset, k and v
    hold the whole sequence's S >= q_offset + T keys (block ids in sel are theirs), sel, lo, hi
    and the lists have q's rows; dk, dv cover all S keys."""
    def lists(bm):
        if not isinstance(bm, (list, tuple)):
            bm = (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices)
        return [x.to(torch.int32).contiguous() for x in bm]

    rows = rows or tuning.rows
    fwd = lists(block_mask)
    dq = fwd if dq_block_mask is None else lists(dq_block_mask)
    rows_dq = rows if dq_block_mask is None else (rows_dq or tuning.rows)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return torch.ops.nsa_flex.selected_attention_fwd(
        q.contiguous(), k.contiguous(), v.contiguous(), sel.to(torch.int32).contiguous(), lo, hi,
        *fwd, *dq, scale, l_sel, rows, rows_dq, tuning.encode(), q_offset)


def selected_lists(spec: MaskSpec, B: int, T: int, S: int, G: int, d_qk: int, device,
                   tuning: SelectedTuning = DEFAULT_TUNING, rows: int | None = None,
                   rows_dq: int | None = None) -> dict:
    """What the op reads of a mask that is a per-position block selection (`spec.selection`), as
    `selected_attention`'s keyword arguments: sel, l_sel, lo, hi, tuning and the selection's
    BlockMask in the packed layout (kv block = l') as q-major lists, without kv-major lists (the
    op's backward inverts `sel` itself, per position): the forward's (q blocks of
    `tile_positions(G, rows)` positions x G heads; rows default `tuning.fwd_rows(G)`) and, where
    the dQ pass runs with q blocks of another size (`rows_dq`, default tuning.rows), the dQ
    pass's. A shard's spec (`MaskSpec.q_offset`): T rows of S keys, the op told the offset."""
    picks = spec.selection

    def lists(rows):
        P = tile_positions(G, rows)
        bm = spec.block_mask(B, T, S, device=device, block_size=(P * G, picks.l_sel), q_pack=G,
                             kv_major=False)
        # through an opaque op: saved for the backward, never recomputed there
        return [captured(x) for x in (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks,
                                      bm.full_kv_indices)]

    rows = rows or tuning.fwd_rows(G)
    out = dict(sel=picks.idx, l_sel=picks.l_sel, block_mask=lists(rows), rows=rows, lo=None,
               hi=None, tuning=tuning, q_offset=spec.q_offset)
    if not tuning.fuse_dq(G, d_qk) and \
            tile_positions(G, rows_dq or tuning.rows) != tile_positions(G, rows):
        out.update(dq_block_mask=lists(rows_dq or tuning.rows), rows_dq=rows_dq)
    if picks.band is not None:
        out["lo"], out["hi"] = picks.band(spec.positions(T, device))  # bands take positions
    return out
