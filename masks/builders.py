"""Tiny pure mask factories (attention-gym style). Each returns a MaskSpec.

Index conventions: `q_idx` is a query token position. `kv_idx` is a key token position, except
for `compressed_causal`, whose kv index is a compressed block i covering tokens
[i*d, i*d + l - 1]. Every mask is strictly causal: no key after the query is ever visible.
"""

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from nsa_flex.rules import cmp_visible, is_forced

from .core import MaskSpec, Selection, captured, or_masks, transpose_lists


def causal() -> MaskSpec:
    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    def interval(q):
        return torch.zeros_like(q).unsqueeze(0), q.unsqueeze(0)

    return MaskSpec(mask_mod, interval=interval, name="causal")


def sliding_window(window: int) -> MaskSpec:
    """Query t sees keys t - window + 1 .. t."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

    def interval(q):
        return (q - window + 1).unsqueeze(0), q.unsqueeze(0)

    return MaskSpec(mask_mod, interval=interval, name=f"sliding_window({window})")


def compressed_causal(l: int, d: int) -> MaskSpec:
    """Query t sees compressed block i only when the block has ended (`rules.cmp_visible`)."""

    def mask_mod(b, h, q_idx, kv_idx):
        return cmp_visible(kv_idx, q_idx, l, d)

    def interval(q):
        # the last visible block is floor((t - l + 1) / d) (cmp_visible solved for i); negative: none
        hi = torch.div(q - l + 1, d, rounding_mode="floor")
        return torch.zeros_like(q).unsqueeze(0), hi.unsqueeze(0)

    return MaskSpec(mask_mod, interval=interval, name=f"compressed_causal({l},{d})")


def document(doc_ids: Tensor, kv_stride: int = 1, kv_span: int = 1) -> MaskSpec:
    """Keys only from the query's own document (packed sequences).

    doc_ids: [B, T], non-decreasing along T (documents are contiguous). A kv index k covers tokens
    [k*kv_stride, k*kv_stride + kv_span - 1] (1, 1 for token keys; d, l for compressed blocks); it
    is visible only when its whole span lies in the query's document. With causality the span's
    end is <= t, so it is enough that its first token is in the query's document."""
    doc_ids = captured(doc_ids.long())
    T = doc_ids.shape[1]
    starts = doc_start(doc_ids)  # [B, T]: first token of each position's document

    def mask_mod(b, h, q_idx, kv_idx):
        first = (kv_idx * kv_stride).clamp_max(T - 1)
        last = (kv_idx * kv_stride + kv_span - 1).clamp_max(T - 1)
        dq = doc_ids[b, q_idx]
        return (doc_ids[b, first] == dq) & (doc_ids[b, last] == dq)

    def interval(q):
        lo = torch.div(starts[:, q] + kv_stride - 1, kv_stride, rounding_mode="floor")
        return lo, torch.full_like(lo, torch.iinfo(torch.long).max // 4)

    return MaskSpec(mask_mod, interval=interval, name="document")


def key_range(lo: int, hi: int) -> MaskSpec:
    """Keys lo .. hi - 1 only, for every query: one span of the keys, for attention split by key
    span (and-ed with a causal mask; alone it is not causal)."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx >= lo) & (kv_idx < hi)

    def interval(q):
        return torch.full_like(q, lo).unsqueeze(0), torch.full_like(q, hi - 1).unsqueeze(0)

    return MaskSpec(mask_mod, interval=interval, name=f"key_range({lo},{hi})")


def doc_start(doc_ids: Tensor) -> Tensor:
    """[B, T] -> first position of each token's document (doc_ids non-decreasing along T)."""
    B, T = doc_ids.shape
    pos = torch.arange(T, device=doc_ids.device).expand(B, T)
    new = torch.ones_like(doc_ids, dtype=torch.bool)
    new[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return torch.cummax(torch.where(new, pos, 0), dim=1).values


def selection(sel_idx: Tensor, l_sel: int, q_offset: int = 0) -> MaskSpec:
    """Query t of group h sees key s <= t when s's block s // l_sel is among sel_idx[b, h, t, :].

    sel_idx: [B, H_groups, T, n] block indices, -1 for unused slots; row r is the query at
    position r + q_offset (a sequence shard: `MaskSpec.q_offset`). The mask is per GQA group
    (paper Eq. 10): every query head of a group shares it. Its block lists come straight from
    sel_idx (no dense [T, T] evaluation) when l_sel is a multiple of the kv block size.
    A block listed twice in a row counts once (repeats become -1 here: block lists and the
    "full" test count each selected block once per position)."""
    B, H, T, n = sel_idx.shape
    sel_idx = sel_idx.sort(dim=-1).values
    slot = torch.arange(n, device=sel_idx.device)
    repeat = (sel_idx == sel_idx.roll(1, dims=-1)) & (slot > 0)
    sel_idx = torch.where(repeat, -1, sel_idx)
    m = min(n, -(-(T + q_offset) // l_sel))  # causal: at most this many distinct blocks, the other slots are -1
    if m < n:  # keep the last m slots (valid ones sort after -1): mask_mod's cost stops at m
        sel_idx, n = sel_idx.sort(dim=-1).values[..., n - m:], m
    unique = sel_idx
    sel_idx = captured(unique)

    def mask_mod(b, h, q_idx, kv_idx):
        # kv_idx lies in block j iff j l' <= kv_idx < (j + 1) l' (an unused slot, -1, matches no
        # key >= 0). Not `kv_idx // l_sel == j`: Inductor's CPU loop split (torch 2.13,
        # CppScheduling.try_loop_split) turns a pointwise kernel indexed by kv // c, c > 8, into
        # loops of KV_LEN // c x c and drops the last KV_LEN % c keys: the compiled training
        # graph's dense mask (reference backend) kept uninitialized memory there
        # (pytorch/pytorch#195582)
        hit = None
        row = q_idx - q_offset  # q_idx is a position
        for i in range(n):
            start = sel_idx[b, h, row, i] * l_sel
            m = (kv_idx >= start) & (kv_idx < start + l_sel)
            hit = m if hit is None else hit | m
        return hit & (kv_idx <= q_idx)

    def kv_blocks(Bq, Q_LEN, KV_LEN, block_size, q_pack, device, lo, hi):
        return selection_block_flags(sel_idx, l_sel, Q_LEN, KV_LEN, block_size, q_pack, lo, hi,
                                     q_offset)

    def compact(Q_LEN, KV_LEN, block_size, q_pack, device, lo, hi, mod, kv_major=True):
        return selection_block_mask_compact(sel_idx, l_sel, Q_LEN, KV_LEN, block_size, q_pack,
                                            mod, lo, hi, kv_major, q_offset)

    return MaskSpec(mask_mod, heads=H, kv_blocks=kv_blocks, name=f"selection(n={n},l'={l_sel})",
                    kv_block=l_sel, compact=compact, selection=Selection(unique, l_sel),
                    q_offset=q_offset)


def forced_blocks(l_sel: int, n_init: int, n_local: int, starts: Tensor | None = None
                  ) -> MaskSpec | None:
    """The selection blocks every query attends whatever the scores (paper §3.3.2): the first
    block of the query's document (n_init = 1) and its n_local most recent blocks, as a token
    mask: key s <= t with s // l_sel == starts[t] // l_sel or s // l_sel > t // l_sel - n_local.
    One mask (the union of `forced_parts`); None when nothing is forced."""
    parts = forced_parts(l_sel, n_init, n_local, starts)
    return None if not parts else parts[0] if len(parts) == 1 else or_masks(*parts,
                                                                            name="forced_blocks")


def forced_parts(l_sel: int, n_init: int, n_local: int, starts: Tensor | None = None
                 ) -> tuple[MaskSpec, ...]:
    """`forced_blocks` as disjoint band masks with ordinary q blocks and GQA: the local band
    (the n_local most recent blocks) and, without documents, the sink (block 0 where it is not
    local), which reads only keys 0..l_sel-1 (kv_len: the flex backend slices K/V, so block 0's
    gradient is one short program per query head instead of one that walks every query). With
    documents (starts [B|1, T]: first token of each position's document) the sink moves with the
    document and the two bands are one mask (or_masks)."""
    parts = []
    if n_local:
        def local_mod(b, h, q_idx, kv_idx):
            return (kv_idx // l_sel > q_idx // l_sel - n_local) & (kv_idx <= q_idx)

        def local_band(q):
            return ((q // l_sel - n_local + 1) * l_sel).unsqueeze(0), q.unsqueeze(0)

        parts.append(MaskSpec(local_mod, interval=local_band, name=f"local({n_local}x{l_sel})"))
    if n_init and starts is None:
        def sink_mod(b, h, q_idx, kv_idx):  # block 0, once it is no longer a local block
            return (kv_idx < l_sel) & (kv_idx <= q_idx) & (q_idx // l_sel >= n_local)

        def sink_band(q):
            far = q // l_sel >= n_local
            hi = torch.where(far, torch.clamp(q, max=l_sel - 1), -1)
            return torch.zeros_like(q).unsqueeze(0), hi.unsqueeze(0)

        parts.append(MaskSpec(sink_mod, interval=sink_band, name=f"sink({l_sel})", kv_len=l_sel))
    elif n_init:
        st = captured(starts.long())

        def doc_sink_mod(b, h, q_idx, kv_idx):
            return (kv_idx // l_sel == st[b, q_idx] // l_sel) & (kv_idx <= q_idx)

        def doc_sink_band(q):
            lo = torch.div(st[:, q], l_sel, rounding_mode="floor") * l_sel
            return lo, torch.minimum(lo + l_sel - 1, q.unsqueeze(0))

        sink = MaskSpec(doc_sink_mod, interval=doc_sink_band, name=f"doc_sink({l_sel})")
        parts = [or_masks(*parts, sink, name="forced_blocks") if parts else sink]
    return tuple(parts)


def drop_forced(sel_idx: Tensor, l_sel: int, n_init: int, n_local: int,
                starts: Tensor | None = None, q_offset: int = 0) -> Tensor:
    """sel_idx [B, H, T, n] with the blocks `forced_blocks` covers set to -1: the scored part of
    the selection. Every picked block is valid, so a picked block is forced exactly when it is
    the document's first block or one of the n_local most recent (nsa_flex.rules.is_forced).
    Row r is position r + q_offset; starts [B|1, T]: its rows are sel_idx's."""
    T = sel_idx.shape[2]
    t = torch.arange(q_offset, q_offset + T, device=sel_idx.device).view(1, 1, T, 1)
    start = 0 if starts is None else starts.long()[:, None, :, None]
    return torch.where(is_forced(sel_idx, t, start, l_sel, n_init, n_local), -1, sel_idx)


def _slot_classes(sel_idx, l_sel, KB, KV_LEN, lo, hi, q_offset=0):
    """Per (token, selected kv block) slot: (kv block index, listed?, full?), [B, H, T, n*r];
    row r is position r + q_offset."""
    B, H, T, n = sel_idx.shape
    dev = sel_idx.device
    r = l_sel // KB  # kv blocks per selection block
    t = torch.arange(q_offset, q_offset + T, device=dev)
    if lo is None:
        lo = torch.zeros(1, T, dtype=torch.long, device=dev)
        hi = torch.full((1, T), torch.iinfo(torch.long).max // 4, dtype=torch.long, device=dev)
    hi = torch.minimum(hi, t.unsqueeze(0))  # causal
    lo, hi = lo.unsqueeze(1).unsqueeze(-1), hi.unsqueeze(1).unsqueeze(-1)  # [B|1, 1, T, 1]
    kvb = (sel_idx.unsqueeze(-1) * r + torch.arange(r, device=dev)).flatten(-2)
    valid = (sel_idx >= 0).repeat_interleave(r, dim=-1)
    k0 = kvb * KB
    k1 = k0 + KB - 1
    any_tok = valid & (k0 <= hi) & (k1 >= lo) & (k0 < KV_LEN)
    full_tok = valid & (k0 >= lo) & (k1 <= hi) & (k1 < KV_LEN)
    return kvb, any_tok, full_tok


def _compact_lists(kvb, listed):
    """Row-wise lists of the listed kv blocks, ascending, fixed width (= slots): (num, idx)."""
    big = torch.iinfo(torch.int32).max
    key = torch.where(listed, kvb, big).sort(-1).values
    num = listed.sum(-1, dtype=torch.int32)
    return num, torch.where(key == big, 0, key).to(torch.int32)


def _union_slots(kvb, any_tok, full_tok, P: int):
    """Per-token slots [B, H, T, W] -> per-q-block slots [B, H, NQB, P*W] of P positions:
    (blocks, partial, full) with each block listed once -- partial: some position sees some of
    its keys, full: all P positions see all of them (the flags path's rule). Sorts only: static
    shapes, no [NQB, NKB] table."""
    B, H, T, W = kvb.shape
    nqb = -(-T // P)
    pad = nqb * P - T
    if pad:  # positions past the end list nothing (so no block is full for their q block)
        z = lambda x, v: torch.cat([x, x.new_full((B, H, pad, W), v)], 2)  # noqa: E731
        kvb, any_tok, full_tok = z(kvb, 0), z(any_tok, False), z(full_tok, False)
    L = P * W
    big = torch.iinfo(torch.int32).max

    def runs(listed, need):  # sorted blocks; True at the first of each run of >= need equal ones
        key = torch.where(listed, kvb, big).reshape(B, H, nqb, L).sort(-1).values
        first = torch.ones_like(key, dtype=torch.bool)
        first[..., 1:] = key[..., 1:] != key[..., :-1]
        hit = first & (key != big)
        if need > 1:  # a block appears at most once per position: P equal in a row = all P
            whole = key[..., : L - need + 1] == key[..., need - 1:]
            hit = hit & torch.cat([whole, whole.new_zeros(B, H, nqb, need - 1)], -1)
        return key, hit

    anyk, any_first = runs(any_tok, 1)
    fullk, full_first = runs(full_tok, P)
    full_set = torch.where(full_first, fullk, big).sort(-1).values
    at = torch.searchsorted(full_set, anyk).clamp_max(L - 1)
    partial = any_first & (full_set.gather(-1, at) != anyk)
    return anyk, partial, fullk, full_first


def selection_block_mask_compact(sel_idx, l_sel, Q_LEN, KV_LEN, block_size, q_pack, mask_mod,
                                 lo=None, hi=None, kv_major=True, q_offset=0):
    """BlockMask of the selection mask in the packed layout, q block = P positions (P * q_pack
    rows): kv lists straight from sel_idx (width P * n * l'/KB; P > 1: the union of the
    positions' blocks, each once), kv-major lists by a sort. Never builds the dense [NQB, NKB]
    table that from_kv_blocks would. kv_major=False: without the kv-major lists (None)."""
    QB, KB = block_size
    if QB % q_pack or l_sel % KB:
        raise ValueError("compact selection masks need q_pack | q block and KB | l_sel")
    P = QB // q_pack
    nkb = -(-KV_LEN // KB)
    kvb, any_tok, full_tok = _slot_classes(sel_idx, l_sel, KB, KV_LEN, lo, hi, q_offset)
    if P == 1:
        kv_num, kv_idx = _compact_lists(kvb, any_tok & ~full_tok)
        f_num, f_idx = _compact_lists(kvb, full_tok)
    else:
        anyk, partial, fullk, full = _union_slots(kvb, any_tok, full_tok, P)
        kv_num, kv_idx = _compact_lists(anyk, partial)
        f_num, f_idx = _compact_lists(fullk, full)
    q_num = q_idx = fq_num = fq_idx = None
    if kv_major:
        q_num, q_idx = transpose_lists(kv_num, kv_idx, nkb)
        fq_num, fq_idx = transpose_lists(f_num, f_idx, nkb)
    packed = (lambda b, h, q, kv: mask_mod(b, h, q // q_pack, kv)) if q_pack > 1 else mask_mod
    return BlockMask(seq_lengths=(Q_LEN * q_pack, KV_LEN), kv_num_blocks=kv_num,
                     kv_indices=kv_idx, full_kv_num_blocks=f_num, full_kv_indices=f_idx,
                     q_num_blocks=q_num, q_indices=q_idx, full_q_num_blocks=fq_num,
                     full_q_indices=fq_idx, BLOCK_SIZE=(QB, KB), mask_mod=packed)


def selection_block_flags(sel_idx, l_sel, Q_LEN, KV_LEN, block_size, q_pack, lo=None, hi=None,
                          q_offset=0):
    """[B, H, NQB, NKB] (any, full) flags of the selection mask in the q-packed layout."""
    QB, KB = block_size
    if l_sel % KB:
        raise ValueError(f"selection block l_sel={l_sel} must be a multiple of the kv block size {KB}")
    if QB % q_pack:
        raise ValueError(f"q block size {QB} must be a multiple of the packing {q_pack}")
    B, H, T, n = sel_idx.shape
    dev = sel_idx.device
    P = QB // q_pack  # token positions per q block
    nqb = -(-Q_LEN // P)
    nkb = -(-KV_LEN // KB)
    r = l_sel // KB
    kvb, any_tok, full_tok = _slot_classes(sel_idx, l_sel, KB, KV_LEN, lo, hi, q_offset)
    valid = (sel_idx >= 0).repeat_interleave(r, dim=-1)
    col = torch.where(valid, kvb, nkb).clamp(0, nkb)  # unused slots go to a dummy column
    pad = nqb * P - T
    if pad:
        any_tok = torch.cat([any_tok, any_tok.new_zeros(B, H, pad, n * r)], 2)
        full_tok = torch.cat([full_tok, full_tok.new_zeros(B, H, pad, n * r)], 2)
        col = torch.cat([col, col.new_full((B, H, pad, n * r), nkb)], 2)
    qb = (torch.arange(nqb * P, device=dev) // P).view(1, 1, -1, 1)
    flat = (qb * (nkb + 1) + col).reshape(B, H, -1)
    cnt_any = torch.zeros(B, H, nqb * (nkb + 1), dtype=torch.int32, device=dev)
    cnt_full = torch.zeros_like(cnt_any)
    cnt_any.scatter_add_(2, flat, any_tok.reshape(B, H, -1).to(torch.int32))
    cnt_full.scatter_add_(2, flat, full_tok.reshape(B, H, -1).to(torch.int32))
    cnt_any = cnt_any.view(B, H, nqb, nkb + 1)[..., :nkb]
    cnt_full = cnt_full.view(B, H, nqb, nkb + 1)[..., :nkb]
    # full: every one of the P positions of the q block sees the whole kv block
    q_rows = (torch.arange(nqb, device=dev) * P).view(1, 1, -1, 1)
    complete = (q_rows + P <= Q_LEN)
    return cnt_any > 0, (cnt_full == P) & complete
