"""Fused Triton kernels for one NSA decode step (one new query token per sequence).

The torch decode path (`nsa_flex.inference.decode_reference.attend_cached`) is the reference; this
module computes the same function without any host sync (static shapes: CUDA-graph capturable),
in five dependent launches (`nsa_decode_write`, then `nsa_decode_attention`):
  1. `_write_kernel`    the new token into the selection cache, the window ring and the raw
                        compression ring; with phi = "avg" also the compressed block the token
                        completes (mean of the ring; only rows that emit store: branch-free).
  2. `_attn_kernel`     flash-decoding split-K over the compressed stream and the window ring:
     (SEL=False)        one program per (row b, KV group h, split), the group's G query heads as
                        one [G_PAD >= 16, d_k] tile (tensor cores via tl.dot), online softmax,
                        partial (acc, m, l) per split; the compressed splits share the row's
                        visible blocks at run time and store their scaled scores (fp32) for 3.
  3. `_score_kernel`    per (b, h): the compressed lse from the splits' (m, l); the group-summed
                        compressed probabilities p_cmp = sum_g exp(s - lse_g) (Eq. 8, 10) from the
                        stored scores (no second pass over K); Eq. 9 overlap weights; forced
                        blocks (first block of the document, n_local most recent); top-n by one
                        int64 key per block (score bits << 32 | reversed index: ties to the lower
                        block, the keys of `nsa_flex.rules.pick_blocks`) by n max-reductions; the
                        selection read counter.
  4. `_attn_kernel`     split-K over the selected blocks, read in place by index (l' contiguous
     (SEL=True)         tokens each, no gather copy); -1 slots are skipped.
  5. `_combine_kernel`  per (b, h, head chunk): each branch's splits merged (max / sum rescale),
                        the compressed lse, the sigmoid-gate mix (Eq. 5, in the torch path's
                        order), the compressed / window read counters.

d_k need not be a power of two: the q.K product is split into two power-of-two dots
(192 = 128 + 64); other head dims are padded with masks. Layout: every cache is a contiguous
[B, Hkv, N, D] tensor (as `NSACache` allocates them); q [B, H, 1, Dk]; per-row positions `pos` [B]
(the new token's position; S = pos + 1 keys) and document starts `start` [B].

Runs on the GPU (triton >= 3.0) and on the CPU under the Triton interpreter (TRITON_INTERPRET=1
set before this module is imported).
"""

import math
import os
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..rules import overlap_kernel_cached, valid_blocks
from .rules_triton import block_keys, key_block

SEL_MODES = ("topn", "local_selection", "causal", "none")
PROGRAMS_PER_SM = 4  # default size of the split-K launches: about this many programs per SM
MAX_SPLITS = 64  # splits per (row, KV group) and branch (the combine holds them in registers)


def interpreter_active() -> bool:
    """True when Triton kernels run on the CPU interpreter (TRITON_INTERPRET set at import)."""
    try:
        return bool(triton.knobs.runtime.interpret)
    except AttributeError:  # triton < 3.4
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _np2(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


def _split_dk(dk: int) -> tuple[int, int]:
    """d_k as two power-of-two dot widths (DK1 + DK2 >= dk, DK2 = 0 when one suffices); every
    width >= 16 (tl.dot's minimum)."""
    if dk <= 16:
        return 16, 0
    p = 1 << (dk.bit_length() - 1)
    if p == dk:
        return dk, 0
    return p, max(16, _np2(dk - p))


_SM_COUNT: dict = {}


def _num_sms(device) -> int:
    if device.type != "cuda":
        return 2
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SM_COUNT:
        _SM_COUNT[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _SM_COUNT[key]


# ============================================================================ kernels
@triton.jit
def _write_kernel(pos_ptr, Hkv,
                  kc_ptr, vc_ptr, skc_b, skc_h, svc_b, svc_h,
                  ks_ptr, vs_ptr, sks_b, sks_h, svs_b, svs_h,
                  kw_ptr, vw_ptr, skw_b, skw_h, svw_b, svw_h,
                  k_raw, v_raw, k_cmp, v_cmp, NC,
                  k_sel, v_sel, CAP, k_win, v_win, W,
                  DK: tl.constexpr, DV: tl.constexpr, DK_PAD: tl.constexpr,
                  DV_PAD: tl.constexpr, L: tl.constexpr, L_PAD: tl.constexpr, D: tl.constexpr,
                  HAS_CMP: tl.constexpr, EMIT_AVG: tl.constexpr, HAS_SEL: tl.constexpr,
                  HAS_WIN: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // Hkv
    h = pid % Hkv
    pos = tl.load(pos_ptr + b)
    dk = tl.arange(0, DK_PAD)
    dv = tl.arange(0, DV_PAD)
    mk = dk < DK
    mv = dv < DV
    bh = pid.to(tl.int64)
    if HAS_SEL:
        _copy_token(ks_ptr + b * sks_b + h * sks_h, vs_ptr + b * svs_b + h * svs_h, k_sel, v_sel,
                    bh * CAP + pos, dk, dv, mk, mv, DK, DV)
    if HAS_WIN:
        _copy_token(kw_ptr + b * skw_b + h * skw_h, vw_ptr + b * svw_b + h * svw_h, k_win, v_win,
                    bh * W + pos % W, dk, dv, mk, mv, DK, DV)
    if HAS_CMP:
        slot = pos % L
        k, v = _copy_token(kc_ptr + b * skc_b + h * skc_h, vc_ptr + b * svc_b + h * svc_h, k_raw,
                           v_raw, bh * L + slot, dk, dv, mk, mv, DK, DV)
        if EMIT_AVG:
            _emit_avg(bh, pos, slot, k, v, k_raw, v_raw, k_cmp, v_cmp, NC, dk, dv, mk, mv,
                      DK, DV, L, L_PAD, D)


@triton.jit
def _copy_token(k_src, v_src, k_dst, v_dst, row, dk, dv, mk, mv, DK: tl.constexpr,
                DV: tl.constexpr):
    """The new token's (k, v) (its rows at k_src / v_src) into cache row `row`; returns them."""
    k = tl.load(k_src + dk, mask=mk)
    v = tl.load(v_src + dv, mask=mv)
    tl.store(k_dst + row * DK + dk, k, mask=mk)
    tl.store(v_dst + row * DV + dv, v, mask=mv)
    return k, v


@triton.jit
def _emit_avg(bh, pos, slot, k, v, k_raw, v_raw, k_cmp, v_cmp, NC, dk, dv, mk, mv,
              DK: tl.constexpr, DV: tl.constexpr, L: tl.constexpr, L_PAD: tl.constexpr,
              D: tl.constexpr):
    """The compressed block of the last L positions (phi = mean of the raw ring, whose slot
    `slot` now holds the new token (k, v)), stored at block (S - L) / D when the token completes
    it (d | S - L); branch-free: other rows store nothing."""
    S = pos + 1
    emit = tl.where((S >= L) & ((S - L) % D == 0), 1, 0)  # as 0/1: masks below
    dst = tl.minimum(tl.maximum(S - L, 0) // D, NC - 1)
    r = tl.arange(0, L_PAD)
    own = (r == slot)[:, None]  # the ring slot just written: take the new token
    kr = tl.load(k_raw + (bh * L + r[:, None]) * DK + dk[None, :],
                 mask=(r < L)[:, None] & mk[None, :], other=0.0)
    kr = tl.where(own, k[None, :], kr).to(tl.float32)
    vr = tl.load(v_raw + (bh * L + r[:, None]) * DV + dv[None, :],
                 mask=(r < L)[:, None] & mv[None, :], other=0.0)
    vr = tl.where(own, v[None, :], vr).to(tl.float32)
    km = tl.sum(kr, 0) / L
    vm = tl.sum(vr, 0) / L
    tl.store(k_cmp + (bh * NC + dst) * DK + dk, km.to(k_cmp.dtype.element_ty),
             mask=dk < DK * emit)
    tl.store(v_cmp + (bh * NC + dst) * DV + dv, vm.to(v_cmp.dtype.element_ty),
             mask=dv < DV * emit)


@triton.jit
def _cmp_lse(pm_ptr, pl_ptr, bh, NSPLIT, NSC, offs_g, pos, start, G: tl.constexpr,
             NSC_PAD: tl.constexpr, L: tl.constexpr, D: tl.constexpr):
    """The compressed branch's lse per head of (b, h) from its NSC splits' (m, l) (0 for a head
    without any visible block: nothing to weigh), and the row's visible compressed blocks
    [lo0, ncmp) (i d + L <= pos + 1, i d >= start)."""
    sp = tl.arange(0, NSC_PAD)
    msk = (sp < NSC)[:, None] & (offs_g < G)[None, :]
    ptr = (bh * NSPLIT + sp)[:, None] * G + offs_g[None, :]
    m = tl.load(pm_ptr + ptr, mask=msk, other=float("-inf"))
    lsum = tl.load(pl_ptr + ptr, mask=msk, other=0.0)
    mx = tl.max(m, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    den = tl.sum(lsum * tl.exp(m - mx[None, :]), 0)
    lse = tl.where(den > 0, tl.log(tl.where(den > 0, den, 1.0)) + mx, 0.0)
    S = pos + 1
    ncmp = tl.where(S >= L, tl.maximum(S - L, 0) // D + 1, 0)
    lo0 = (start + D - 1) // D
    return lse, ncmp, lo0


@triton.jit
def _score_kernel(pm_ptr, pl_ptr, NSPLIT, NSC, sc_ptr, pc_ptr, NC, c_ptr, idx_ptr, rsel_ptr,
                  pos_ptr, start_ptr, Hkv, NS,
                  G: tl.constexpr, G_PAD: tl.constexpr, NSC_PAD: tl.constexpr,
                  L: tl.constexpr, D: tl.constexpr, LS: tl.constexpr, R: tl.constexpr,
                  QN: tl.constexpr, N_SEL: tl.constexpr, N_INIT: tl.constexpr,
                  N_LOCAL: tl.constexpr, NS_PAD: tl.constexpr, CHUNK: tl.constexpr,
                  TOPN: tl.constexpr):
    """The n selection blocks of one (row, KV group) for the current token (Eq. 8-10), as
    `select_blocks` / `nsa_flex.rules.pick_blocks`: forced blocks first, then by score, ties to
    the lower block, -1 for unused slots. TOPN=False: the local_selection ablation (score = block index)."""
    pid = tl.program_id(0)
    b = pid // Hkv
    bh = pid.to(tl.int64)
    pos = tl.load(pos_ptr + b)
    start = tl.load(start_ptr + b)
    jj = tl.arange(0, NS_PAD)
    if TOPN:
        offs_g = tl.arange(0, G_PAD)
        lse, ncmp, lo0 = _cmp_lse(pm_ptr, pl_ptr, bh, NSPLIT, NSC, offs_g, pos, start, G,
                                  NSC_PAD, L, D)
        cc = tl.arange(0, CHUNK)
        # Eq. 8 + Eq. 10: p_cmp[i] = sum over the group's heads of exp(s_gi - lse_g)
        for c0 in range(lo0, ncmp, CHUNK):
            ii = c0 + cc
            vis = ii < ncmp
            s = tl.load(sc_ptr + bh * G * NC + offs_g[:, None] * NC + ii[None, :],
                        mask=(offs_g < G)[:, None] & vis[None, :], other=float("-inf"))
            p = tl.sum(tl.exp(s - lse[:, None]), 0)
            tl.store(pc_ptr + bh * NC + ii, p, mask=vis)
        tl.debug_barrier()  # p_cmp of the whole row written by this program's threads
        # Eq. 9: p_slc[j] = sum_m c[m] p_cmp[j r + m], m in [-(QN-1), R-1]
        score = tl.zeros([NS_PAD], tl.float32)
        for k in tl.static_range(R + QN - 1):
            ck = tl.load(c_ptr + k)
            i = jj * R + (k - (QN - 1))
            ok = (jj < NS) & (i >= lo0) & (i < ncmp) & (i >= 0)
            score += tl.load(pc_ptr + bh * NC + i, mask=ok, other=0.0) * ck
    else:
        score = jj.to(tl.float32)
    key = block_keys(jj, score, pos, start, NS, LS, N_LOCAL, N_INIT)
    cnt = pos * 0
    for t in range(N_SEL):
        top = tl.max(key, 0)
        blk = key_block(top, NS)
        tl.store(idx_ptr + bh * N_SEL + t, blk)
        key = tl.where(key == top, -4611686018427387904, key)  # taken: padding's key
        lo = tl.maximum(blk * LS, start)
        hi = tl.minimum(blk * LS + LS - 1, pos)
        cnt += tl.where(blk >= 0, tl.maximum(hi - lo + 1, 0), 0)
    tl.store(rsel_ptr + bh, cnt)


@triton.jit
def _load_q_group(q_ptr, b, h, sqb, sqh, offs_g, gm, d1, G: tl.constexpr, DK: tl.constexpr,
                  DK1: tl.constexpr, DK2: tl.constexpr):
    """The G query heads of (row b, KV group h) as [G_PAD, DK1] (+ [G_PAD, DK2]) tiles: d_k as
    two power-of-two slices (d2 = d1 and q2 = q1 when DK2 = 0, never used then)."""
    q_base = q_ptr + b.to(tl.int64) * sqb + (h * G + offs_g)[:, None] * sqh
    q1 = tl.load(q_base + d1[None, :], mask=gm[:, None] & (d1 < DK)[None, :], other=0.0)
    if DK2 > 0:
        d2 = DK1 + tl.arange(0, DK2)
        q2 = tl.load(q_base + d2[None, :], mask=gm[:, None] & (d2 < DK)[None, :], other=0.0)
    else:
        d2 = d1
        q2 = q1
    return q1, q2, d2


@triton.jit
def _attend_tile(q1, q2, d1, d2, dv, k_base, v_base, rows, valid, m_i, l_i, acc, sc_row, sc_hi,
                 gm, DK: tl.constexpr, DV: tl.constexpr, DK2: tl.constexpr, SCALE: tl.constexpr,
                 STORE_S: tl.constexpr):
    """One tile of keys `rows` (masked by `valid`) into the online softmax (m_i, l_i, acc) of
    the group's heads. Rows that saw no key yet keep m = -inf, l = 0, acc = 0. STORE_S: the
    tile's scaled scores of rows < sc_hi also go to sc_row (the compressed scores, Eq. 8)."""
    # the tile's keys and values, both loads issued before any use (one memory round trip)
    kt = tl.load(k_base + rows[None, :] * DK + d1[:, None],
                 mask=valid[None, :] & (d1 < DK)[:, None], other=0.0)  # [DK1, BLOCK_N]
    v = tl.load(v_base + rows[:, None] * DV + dv[None, :],
                mask=valid[:, None] & (dv < DV)[None, :], other=0.0)  # [BLOCK_N, DV_PAD]
    # scores of the tile: q.K as two power-of-two dots over d_k
    s = tl.dot(q1, kt, input_precision="ieee")
    if DK2 > 0:
        kt2 = tl.load(k_base + rows[None, :] * DK + d2[:, None],
                      mask=valid[None, :] & (d2 < DK)[:, None], other=0.0)
        s += tl.dot(q2, kt2, input_precision="ieee")
    s = tl.where(valid[None, :], s * SCALE, float("-inf"))
    if STORE_S:
        tl.store(sc_row + rows[None, :], s, mask=gm[:, None] & (rows < sc_hi)[None, :])
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _store_split(pm_ptr, pl_ptr, po_ptr, slot, offs_g, gm, dv, m_i, l_i, acc, G: tl.constexpr,
                 DV: tl.constexpr):
    """A split's partial (m, l, acc) of the group's heads into its slot (merged later)."""
    tl.store(pm_ptr + slot * G + offs_g, m_i, mask=gm)
    tl.store(pl_ptr + slot * G + offs_g, l_i, mask=gm)
    tl.store(po_ptr + (slot * G + offs_g[:, None]) * DV + dv[None, :], acc,
             mask=gm[:, None] & (dv < DV)[None, :])


@triton.jit
def _attn_kernel(q_ptr, sqb, sqh, pos_ptr, start_ptr, Hkv,
                 k_a, v_a, NA, k_w, v_w, W, NSC, WPER, idx_ptr, N_IDX, BPS, SPLIT0,
                 sc_ptr, po_ptr, pm_ptr, pl_ptr, NSPLIT,
                 G: tl.constexpr, G_PAD: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                 DK1: tl.constexpr, DK2: tl.constexpr, DV_PAD: tl.constexpr,
                 L: tl.constexpr, D: tl.constexpr, LS: tl.constexpr, BLOCK_N: tl.constexpr,
                 SEL: tl.constexpr, STORE_S: tl.constexpr,
                 SCALE: tl.constexpr):  # constexpr: under torch.compile a float arg would be fp64
    """Split-K attention of one (row b, KV group h) over one split of keys, the group's G query
    heads as one [G_PAD, d_k] tile; writes the split's (acc, m, l).

    SEL=False: splits [0, NSC) take compressed blocks (cache a = compressed stream; block i is
    visible when i d + L <= S and i d >= start; the row's visible blocks are shared evenly at run
    time), splits [NSC, ..) window ring slots (slot j holds the latest p <= pos with p = j mod W).
    SEL=True: split sid takes selected blocks [sid BPS, (sid + 1) BPS) of the index list, read in
    place from the selection cache (cache a; block j = tokens [j LS, (j + 1) LS))."""
    pid = tl.program_id(0)
    sid = tl.program_id(1)
    b = pid // Hkv
    h = pid % Hkv
    bh = pid.to(tl.int64)
    # per-row positions in int32 (vector index math stays 32-bit; the (b, h) base is 64-bit)
    pos = tl.load(pos_ptr + b).to(tl.int32)
    start = tl.load(start_ptr + b).to(tl.int32)
    offs_g = tl.arange(0, G_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    gm = offs_g < G
    d1 = tl.arange(0, DK1)
    dv = tl.arange(0, DV_PAD)
    q1, q2, d2 = _load_q_group(q_ptr, b, h, sqb, sqh, offs_g, gm, d1, G, DK, DK1, DK2)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, DV_PAD], tl.float32)
    k_base = k_a + bh * NA * DK
    v_base = v_a + bh * NA * DV
    is_cmp = sid < NSC
    b0 = sid * BPS
    b1 = tl.minimum(b0 + BPS, N_IDX)
    # window ring: slot j holds position pos - ((pos - j) mod W) = wbase + j - (j > p0 ? W : 0)
    p0 = pos % W
    wbase = pos - p0
    if SEL:
        lo = pos * 0
        hi = (b1 - b0) * LS + pos * 0
        sc_hi = lo  # selection splits store no scores (STORE_S is off)
    else:
        if is_cmp:
            S = pos + 1
            ncmp = tl.where(S >= L, tl.maximum(S - L, 0) // D + 1, 0)
            lo0 = (start + D - 1) // D
            cnt = tl.maximum(ncmp - lo0, 0)
            per = ((cnt + NSC - 1) // NSC + BLOCK_N - 1) // BLOCK_N * BLOCK_N
            lo = lo0 + sid * per
            hi = tl.minimum(lo + per, ncmp)
            lim = start * 0 - W - 1  # no window condition (slot positions are >= -W)
            sc_hi = hi
        else:
            lo = (sid - NSC) * WPER + pos * 0
            hi = tl.minimum(lo + WPER, W)
            lim = start  # the slot's position must be >= start (>= 0)
            sc_hi = lo * 0  # window splits store no scores
            k_base = k_w + bh * W * DK
            v_base = v_w + bh * W * DV
    sc_row = sc_ptr + bh * G * NA + offs_g[:, None] * NA
    for r0 in range(lo, hi, BLOCK_N):
        rr = r0 + offs_n
        if SEL:
            slot = b0 + rr // LS
            inb = rr < hi
            blk = tl.load(idx_ptr + bh * N_IDX + slot, mask=inb, other=-1).to(tl.int32)
            rows = blk * LS + rr % LS
            valid = inb & (blk >= 0) & (rows <= pos) & (rows >= start)
        else:
            rows = rr
            spos = wbase + rr - tl.where(rr > p0, W, 0)
            valid = (rr < hi) & (spos >= lim)
        m_i, l_i, acc = _attend_tile(q1, q2, d1, d2, dv, k_base, v_base, rows, valid, m_i,
                                     l_i, acc, sc_row, sc_hi, gm, DK, DV, DK2, SCALE, STORE_S)
    _store_split(pm_ptr, pl_ptr, po_ptr, bh * NSPLIT + SPLIT0 + sid, offs_g, gm, dv, m_i, l_i,
                 acc, G, DV)


@triton.jit
def _combine_kernel(po_ptr, pm_ptr, pl_ptr, NSPLIT, NSC, NSW, NSS, H, Hkv, BH,
                    g_ptr, sgb, sgh, o_ptr, br_ptr, lse_ptr, rcmp_ptr, rwin_ptr,
                    pos_ptr, start_ptr, W,
                    G: tl.constexpr, GB: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr,
                    P_PAD: tl.constexpr, L: tl.constexpr, D: tl.constexpr,
                    HAS_CMP: tl.constexpr, HAS_SEL: tl.constexpr, HAS_WIN: tl.constexpr,
                    USE_CMP: tl.constexpr, USE_SEL: tl.constexpr, USE_WIN: tl.constexpr,
                    GATED: tl.constexpr, STORE_BR: tl.constexpr):
    """GB query heads of one (row, KV group): each branch's splits merged (rescaled to the common
    max), the compressed lse, the gated sum cmp + sel + win (Eq. 5, the torch path's order)."""
    pid = tl.program_id(0)
    gc = tl.program_id(1)
    b = pid // Hkv
    h = pid % Hkv
    base = pid.to(tl.int64) * NSPLIT
    g = gc * GB + tl.arange(0, GB)
    gm = g < G
    hq = h * G + g  # query heads
    row = b.to(tl.int64) * H + hq  # [GB] rows of the [B * H] outputs
    dv = tl.arange(0, DV_PAD)
    om = gm[:, None] & (dv < DV)[None, :]
    sp = tl.arange(0, P_PAD)
    pos = tl.load(pos_ptr + b)
    start = tl.load(start_ptr + b)
    o = tl.zeros([GB, DV_PAD], tl.float32)
    for br in tl.static_range(3):
        if br == 0:
            first = base
            n = NSC
            has = HAS_CMP
            use = USE_CMP
        elif br == 1:
            first = base + NSC + NSW
            n = NSS
            has = HAS_SEL
            use = USE_SEL
        else:
            first = base + NSC
            n = NSW
            has = HAS_WIN
            use = USE_WIN
        if has:
            ok = (sp < n)[:, None] & gm[None, :]  # [P_PAD, GB]
            slot = (first + sp)[:, None] * G + g[None, :]
            m = tl.load(pm_ptr + slot, mask=ok, other=float("-inf"))
            lsum = tl.load(pl_ptr + slot, mask=ok, other=0.0)
            mx = tl.max(m, 0)
            mx = tl.where(mx == float("-inf"), 0.0, mx)
            w = tl.exp(m - mx[None, :])
            den = tl.sum(lsum * w, 0)  # [GB]
            a = tl.load(po_ptr + slot[:, :, None] * DV + dv[None, None, :],
                        mask=ok[:, :, None] & (dv < DV)[None, None, :], other=0.0)
            safe = tl.where(den > 0, den, 1.0)
            ob = tl.sum(a * w[:, :, None], 0) / safe[:, None]
            ob = tl.where((den > 0)[:, None], ob, 0.0)  # no key at all: 0
            if STORE_BR:
                tl.store(br_ptr + (br * BH + row)[:, None] * DV + dv[None, :], ob, mask=om)
            if use:
                if GATED:
                    gate = tl.load(g_ptr + b.to(tl.int64) * sgb + hq * sgh + br, mask=gm,
                                   other=0.0).to(tl.float32)
                    o = o + gate[:, None] * ob
                else:
                    o = o + ob
            if br == 0:
                lse = tl.where(den > 0, tl.log(safe) + mx, float("-inf"))
                tl.store(lse_ptr + row, lse, mask=gm)
                if (h == 0) & (gc == 0):
                    S = pos + 1
                    ncmp = tl.where(S >= L, tl.maximum(S - L, 0) // D + 1, 0)
                    tl.store(rcmp_ptr + b, tl.maximum(ncmp - (start + D - 1) // D, 0))
            if br == 2:
                if (h == 0) & (gc == 0):
                    tl.store(rwin_ptr + b, tl.minimum(W, pos + 1 - start))
    tl.store(o_ptr + row[:, None] * DV + dv[None, :], o.to(o_ptr.dtype.element_ty), mask=om)


# ============================================================================ host wrappers
def _rows(t: Tensor) -> tuple[Tensor, int, int]:
    """t [B, Hkv, 1, D] or [B, Hkv, D] -> (t, stride_b, stride_h) with a unit last stride."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t, t.stride(0), t.stride(1)


def _check_cache(name: str, t: Tensor | None, B: int, Hkv: int | None) -> None:
    if t is None:
        return
    if t.dim() != 4 or t.shape[0] != B or (Hkv is not None and t.shape[1] != Hkv):
        raise ValueError(f"{name}: expected a [B={B}, Hkv, N, D] cache, got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: the Triton decode kernels need contiguous caches")


def _new_token_args(new: dict, k_ref: Tensor, v_ref: Tensor) -> list:
    """(k, v, stride_b(k), stride_h(k), stride_b(v), stride_h(v)) of the new token for the
    branches cmp, sel, win in that order; a branch not in `new` gets a slice of the reference
    cache (never read)."""
    args = []
    for b in ("cmp", "sel", "win"):
        src = new[b] if b in new else (k_ref[:, :, :1], v_ref[:, :, :1])
        k, skb, skh = _rows(src[0])
        v, svb, svh = _rows(src[1])
        args += [k, v, skb, skh, svb, svh]
    return args


@torch.no_grad()
def nsa_decode_write(pos: Tensor, new: dict, *, l: int, d: int, k_raw=None, v_raw=None,
                     k_cmp=None, v_cmp=None, k_sel=None, v_sel=None, k_win=None, v_win=None,
                     emit_avg: bool = False) -> None:
    """Write the new token of every row (position pos [B]) into the caches, one launch.

    new[branch] = (k [B, Hkv, 1, Dk], v [B, Hkv, 1, Dv]) for branch in "cmp" (raw ring of l
    tokens, slot p % l), "sel" (slot p), "win" (ring, slot p % W). emit_avg: also emit the
    compressed block completed by the token (phi = mean, when d | S - l) into k_cmp / v_cmp,
    as `write_token` does; with a learned phi the caller emits it."""
    caches = {"cmp": (k_raw, v_raw), "sel": (k_sel, v_sel), "win": (k_win, v_win)}
    ref = next((caches[b] for b in ("sel", "win", "cmp") if b in new), None)
    if ref is None:
        return
    B, Hkv, _, Dk = ref[0].shape
    Dv = ref[1].shape[-1]
    for b in new:
        kc, vc = caches[b]
        if kc is None or vc is None:
            raise ValueError(f"new token for branch {b!r} but no {b} cache")
        _check_cache(f"k cache of {b}", kc, B, Hkv)
        _check_cache(f"v cache of {b}", vc, B, Hkv)
    args = _new_token_args(new, *ref)
    has_cmp = "cmp" in new
    nc = k_cmp.shape[2] if (has_cmp and k_cmp is not None) else 0
    emit = bool(emit_avg and has_cmp and nc > 0)
    kr, vr = (k_raw, v_raw) if has_cmp else ref
    kcm, vcm = (k_cmp, v_cmp) if emit else ref
    ks, vs = (k_sel, v_sel) if "sel" in new else ref
    kw, vw = (k_win, v_win) if "win" in new else ref
    _write_kernel[(B * Hkv,)](
        pos, Hkv, *args, kr, vr, kcm, vcm, max(nc, 1), ks, vs, ks.shape[2], kw, vw, kw.shape[2],
        DK=Dk, DV=Dv, DK_PAD=_np2(Dk), DV_PAD=_np2(Dv), L=l, L_PAD=_np2(l), D=d,
        HAS_CMP=has_cmp, EMIT_AVG=emit, HAS_SEL="sel" in new, HAS_WIN="win" in new,
        num_warps=4)


@dataclass
class DecodeResult:
    """Outputs of one fused decode step.
    o        [B, H, Dv] sum of the branches in `use`, gated when g is given (cache dtype)
    lse_cmp  [B, H] fp32 natural-log lse of the compressed branch (-inf: no visible block)
    branches {"cmp" | "sel" | "win": [B, H, Dv] fp32} (return_branches=True only)
    idx      [B, Hkv, n] int64 selected blocks, -1 unused (topn / local_selection, else None)
    reads    {"cmp": [B], "sel": [B, Hkv], "win": [B]} distinct key tokens read (int64)
    splits   (compressed, window, selection) split counts of the launch"""
    o: Tensor
    lse_cmp: Tensor | None
    idx: Tensor | None
    reads: dict
    branches: dict = field(default_factory=dict)
    splits: tuple = ()


def plan_splits(B: int, Hkv: int, n_cmp_slots: int, window: int, n_idx: int, block_n: int,
                num_programs: int) -> tuple[int, int, int, int]:
    """(compressed splits, window splits, selection splits, blocks per selection split): about
    `num_programs` programs per launch, fixed by the shapes (CUDA graphs); each compressed
    split takes an equal share of the row's visible blocks at run time."""
    per_bh = max(1, -(-num_programs // max(1, B * Hkv)))
    ct = -(-n_cmp_slots // block_n)
    wt = -(-window // block_n)
    nsc = 0 if ct == 0 else max(1, min(ct, MAX_SPLITS, round(per_bh * ct / (ct + wt))))
    nsw = 0 if wt == 0 else max(1, min(wt, MAX_SPLITS, per_bh - nsc))
    if n_idx == 0:
        return nsc, nsw, 0, 0
    nss = max(1, min(n_idx, MAX_SPLITS, per_bh))
    bps = -(-n_idx // nss)
    return nsc, nsw, -(-n_idx // bps), bps


@torch.no_grad()
def nsa_decode_attention(q: Tensor, pos: Tensor, start: Tensor, *, l: int, d: int, l_sel: int,
                         n_sel: int, n_init: int = 1, n_local: int = 2, k_cmp=None, v_cmp=None,
                         k_sel=None, v_sel=None, k_win=None, v_win=None, sel_mode: str = "topn",
                         use: tuple = ("cmp", "sel", "win"), g: Tensor | None = None,
                         scale: float | None = None, return_branches: bool = False,
                         num_programs: int | None = None, block_n: int = 32, num_warps: int = 4,
                         num_stages: int = 2) -> DecodeResult:
    """The attention reads of one NSA decode step (the caches already hold the new token).

    q [B, H, Dk] or [B, H, 1, Dk] (after RoPE); pos [B] the new token's position (S = pos + 1
    keys), start [B] its document's first position (0 without document masking); caches
    contiguous [B, Hkv, N, D]: compressed stream (slot i = block i), selection cache (slot p =
    position p, N a multiple of l_sel), window ring (slot p % W). sel_mode: "topn" (needs the
    compressed cache: Eq. 8-10 from the compressed branch's own probabilities), "local_selection"
    (the n most recent blocks), "causal" (every block: full attention), "none". use: branches in
    the output sum; g [B, H, 1, 3] or [B, H, 3] sigmoid gates (cmp, sel, win) or None (plain
    sum). No host sync, shapes fixed by the inputs' shapes: CUDA-graph capturable.

    Launch options: num_programs (about how many programs per attention launch; default
    PROGRAMS_PER_SM per SM), block_n (keys per tile, >= 16), num_warps / num_stages of the
    attention kernels."""
    if sel_mode not in SEL_MODES:
        raise ValueError(f"sel_mode={sel_mode!r}: allowed values are {SEL_MODES}")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n={block_n}: must be a power of two >= 16")
    if q.dim() == 4:
        q = q[:, :, 0]
    B, H, Dk = q.shape
    present = {"cmp": k_cmp is not None, "sel": sel_mode != "none", "win": k_win is not None}
    if sel_mode == "topn" and k_cmp is None:
        raise ValueError("sel_mode='topn' needs the compressed cache (k_cmp, v_cmp)")
    if present["sel"] and k_sel is None:
        raise ValueError(f"sel_mode={sel_mode!r} needs the selection cache (k_sel, v_sel)")
    refs = [t for t in (k_cmp, k_sel, k_win) if t is not None]
    if not refs:
        raise ValueError("no cache to attend to")
    Hkv = refs[0].shape[1]
    if H % Hkv:
        raise ValueError(f"{H} query heads are not a multiple of {Hkv} KV heads")
    G = H // Hkv
    for name, t in (("k_cmp", k_cmp), ("v_cmp", v_cmp), ("k_sel", k_sel), ("v_sel", v_sel),
                    ("k_win", k_win), ("v_win", v_win)):
        _check_cache(name, t, B, Hkv)
    vref = next(t for t in (v_cmp, v_sel, v_win) if t is not None)
    Dv = vref.shape[-1]
    kref = refs[0]
    if q.dtype != kref.dtype:
        q = q.to(kref.dtype)
    q, sqb, sqh = _rows(q)
    dev = q.device
    scale = Dk ** -0.5 if scale is None else scale
    Nc = k_cmp.shape[2] if k_cmp is not None else 0
    W = k_win.shape[2] if k_win is not None else 0
    ns = k_sel.shape[2] // l_sel if k_sel is not None else 0
    n_idx = {"topn": n_sel, "local_selection": n_sel, "causal": ns, "none": 0}[sel_mode]
    progs = num_programs or PROGRAMS_PER_SM * _num_sms(dev)
    nsc, nsw, nss, bps = plan_splits(B, Hkv, Nc, W, n_idx, block_n, progs)
    nsplit = max(1, nsc + nsw + nss)
    DK1, DK2 = _split_dk(Dk)
    DV_PAD = max(16, _np2(Dv))
    G_PAD = max(16, _np2(G))
    f32 = dict(device=dev, dtype=torch.float32)
    part_o = torch.empty(B * Hkv * nsplit * G * Dv, **f32)
    part_m = torch.empty(B * Hkv * nsplit * G, **f32)
    part_l = torch.empty(B * Hkv * nsplit * G, **f32)
    topn = sel_mode == "topn"
    scores = torch.empty(B * Hkv * G * max(Nc, 1) if topn else 1, **f32)
    kc, vc = (k_cmp, v_cmp) if Nc > 0 else (kref, vref)
    kw, vw = (k_win, v_win) if W > 0 else (kref, vref)
    common = dict(G=G, G_PAD=G_PAD, DK=Dk, DV=Dv, DK1=DK1, DK2=DK2, DV_PAD=DV_PAD, L=l, D=d,
                  LS=l_sel, BLOCK_N=block_n, SCALE=float(scale), num_warps=num_warps, num_stages=num_stages)
    if nsc + nsw > 0:  # compressed + window splits, one launch
        wper = _cdiv(_cdiv(W, nsw), block_n) * block_n if nsw else 0
        _attn_kernel[(B * Hkv, nsc + nsw)](
            q, sqb, sqh, pos, start, Hkv, kc, vc, max(Nc, 1), kw, vw, max(W, 1), nsc,
            wper, pos, 1, 1, 0, scores, part_o, part_m, part_l, nsplit, SEL=False,
            STORE_S=topn, **common)

    reads = {}
    idx = None
    if sel_mode in ("topn", "local_selection"):
        idx = torch.empty(B, Hkv, n_sel, device=dev, dtype=torch.long)
        reads["sel"] = torch.empty(B, Hkv, device=dev, dtype=torch.long)
        pc = torch.empty(B * Hkv * max(Nc, 1) if topn else 1, **f32)
        c = overlap_kernel_cached(l, d, l_sel, dev)
        _score_kernel[(B * Hkv,)](
            part_m, part_l, nsplit, nsc, scores, pc, max(Nc, 1), c, idx, reads["sel"], pos, start,
            Hkv, ns, G=G, G_PAD=G_PAD, NSC_PAD=_np2(max(nsc, 1)), L=l, D=d, LS=l_sel,
            R=l_sel // d, QN=l // d, N_SEL=n_sel, N_INIT=n_init, N_LOCAL=n_local,
            NS_PAD=_np2(max(ns, 1)), CHUNK=min(1024, _np2(max(Nc, 16))), TOPN=topn, num_warps=8)
        sel_idx = idx
    elif sel_mode == "causal":  # every block that holds a visible token
        j = torch.arange(ns, device=dev)
        ok = valid_blocks(pos.view(B, 1), start.view(B, 1), ns, l_sel)
        sel_idx = torch.where(ok, j, -1).view(B, 1, ns).expand(B, Hkv, ns).contiguous()
        reads["sel"] = (pos - start + 1).view(B, 1).expand(B, Hkv)
    if nss > 0:  # selected blocks, read in place by index
        _attn_kernel[(B * Hkv, nss)](
            q, sqb, sqh, pos, start, Hkv, k_sel, v_sel, k_sel.shape[2], kref, vref, 1, 0, 0,
            sel_idx, n_idx, bps, nsc + nsw, scores, part_o, part_m, part_l, nsplit, SEL=True,
            STORE_S=False, **common)

    o = torch.empty(B, H, Dv, device=dev, dtype=vref.dtype)
    lse = torch.empty(B, H, **f32) if present["cmp"] else None
    br = torch.empty(3, B, H, Dv, **f32) if return_branches else part_m
    rcmp = torch.empty(B, device=dev, dtype=torch.long) if present["cmp"] else None
    rwin = torch.empty(B, device=dev, dtype=torch.long) if present["win"] else None
    if g is not None:
        if g.dim() == 4:
            g = g[:, :, 0]
        if g.shape != (B, H, 3):
            raise ValueError(f"g: expected [B, H, 3] gates, got {tuple(g.shape)}")
        g, sgb, sgh = _rows(g)
    else:
        sgb = sgh = 0
    p_pad = _np2(max(nsc, nsw, nss, 1))
    # heads per combine program: a [P_PAD, GB, DV_PAD] fp32 tile of at most 4k elements (more
    # spills registers on sm_90)
    gb = min(_np2(G), 1 << max(0, (4096 // (p_pad * DV_PAD)).bit_length() - 1))
    _combine_kernel[(B * Hkv, _cdiv(G, gb))](
        part_o, part_m, part_l, nsplit, nsc, nsw, nss, H, Hkv, B * H,
        g if g is not None else part_m, sgb, sgh, o, br, lse if lse is not None else part_m,
        rcmp if rcmp is not None else pos, rwin if rwin is not None else pos, pos, start,
        max(W, 1), G=G, GB=gb, DV=Dv, DV_PAD=DV_PAD, P_PAD=p_pad, L=l, D=d,
        HAS_CMP=present["cmp"], HAS_SEL=present["sel"], HAS_WIN=present["win"],
        USE_CMP="cmp" in use, USE_SEL="sel" in use, USE_WIN="win" in use,
        GATED=g is not None, STORE_BR=return_branches, num_warps=8)
    if rcmp is not None:
        reads["cmp"] = rcmp
    if rwin is not None:
        reads["win"] = rwin
    branches = {}
    if return_branches:
        branches = {b: br[i] for i, b in enumerate(("cmp", "sel", "win")) if present[b]}
    return DecodeResult(o, lse, idx, reads, branches, (nsc, nsw, nss))
