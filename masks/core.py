"""The one mask type both backends consume, and how it turns into a BlockMask or a dense mask.

A `MaskSpec` is built by a tiny pure factory (see `masks/builders.py`). It always carries a
`mask_mod(b, h, q_idx, kv_idx) -> bool` that describes the *whole* mask (eager FlexAttention
evaluates only the mask_mod and ignores block lists, so a mask held only in block lists would be
silently wrong there). Two optional descriptions let us build BlockMasks without evaluating the
mask_mod over a dense [Q, KV] grid:

- `interval`: the mask is a band. For query tokens `q` (a 1-D LongTensor) it returns inclusive
  `(lo, hi)` kv bounds of shape [B or 1, len(q)]: kv is visible iff lo <= kv <= hi (hi < lo: the
  row sees nothing). Causal, sliding-window, compressed-causal and document masks are bands.
- `kv_blocks`: the mask's own block lists (the selection mask): a function
  `(B, Q_LEN, KV_LEN, block_size, q_pack, device, lo, hi) -> (any, full)` of [B, H, NQB, NKB]
  bool block flags, where (lo, hi) is an extra band restriction from `and_masks` (or None).

`q_pack` is the group-centric packing used by the flex backend for per-group masks: query row
`r` of the packed layout is token `r // q_pack` (one row per head of a GQA group).

`q_offset` (context parallelism, `nsa_flex.context_parallel`): query row `r` is the token at
position `r + q_offset` of the whole sequence, keys are indexed from position 0. mask_mod and
intervals always take positions; only the row -> position map moves (`at_offset`).
"""

from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


@torch.library.custom_op("nsa_masks::captured", mutates_args=())
def captured(x: Tensor) -> Tensor:
    """Identity (a copy) for a tensor a mask_mod reads. Under torch.compile an opaque op, so the
    tensor is a realized buffer when flex_attention's template inlines the mask_mod. Without it
    Inductor may inline the pointwise chain that computes the tensor into the attention kernel;
    with a masked op in that chain (slice assignment, cat, pad) the template failed to lower
    (torch 2.11, selection mask at T=64k: "'function' object has no attribute 'graph'": triton
    codegen of the inlined `ops.masked` expects a LoopBody). Costs one copy of the captured
    tensor ([B, H, T, n] int64 for the selection). No upstream issue is filed; whether a later
    torch still needs it is checked on a GPU only (compile the 64k layer with one builder's
    `captured` removed)."""
    return x.clone()


@captured.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("nsa_masks::row_cumsum", mutates_args=())
def row_cumsum(x: Tensor) -> Tensor:
    """x.cumsum(-1) (int64) of an integer tensor; under torch.compile an opaque op that runs
    aten's scan. Inductor lowers a scan of few rows over a long axis to its split-scan kernel,
    whose codegen fails on the block lists' cumsum (torch 2.11: the compressed mask's kv-major
    lists at T=32k, rows [1, 1, 16] x 256 q blocks, in the fwd+bwd graph raise "TypeError: list
    indices must be integers or slices, not NoneType")."""
    assert not x.is_floating_point(), "row_cumsum: integer tensors only"
    return x.cumsum(-1)


@row_cumsum.register_fake
def _(x):
    return x.new_empty(x.shape, dtype=torch.int64)


Interval = Callable[[Tensor], tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class Selection:
    """A mask given as a per-(position, group) block selection (the `selection` factory): key s is
    visible to query t of group h iff s's block s // l_sel is in idx[b, h, t, :] (-1: unused slot),
    s <= t and, when `band` is set (the bands of an `and_masks`), lo <= s <= hi with (lo, hi) =
    band(t). The form the selected-attention op reads (`nsa_flex.ops.selected_lists`)."""
    idx: Tensor  # [B, H, T, n]
    l_sel: int
    band: Interval | None = None


@dataclass(frozen=True)
class MaskSpec:
    mask_mod: MaskMod
    # number of heads the mask depends on: 1 (head-agnostic) or the number of KV groups
    # (per-group, e.g. the selection mask: all heads of a GQA group share it, paper Eq. 10)
    heads: int = 1
    interval: Interval | None = None
    kv_blocks: Callable | None = None
    name: str = "mask"
    # kv block size the block lists are made for (the selection mask: its block length l')
    kv_block: int | None = None
    # optional direct BlockMask builder for q blocks of whole positions (GPU: compact index width):
    # (Q_LEN, KV_LEN, block_size, q_pack, device, lo, hi, mask_mod, kv_major=True) -> BlockMask
    compact: Callable | None = None
    # a union of bands (`or_masks`): kv is visible iff it lies in one of them; the block flags are
    # the union of the bands' flags (one call, one BlockMask)
    bands: tuple[Interval, ...] | None = None
    # the same mask split into disjoint parts (the selection: forced blocks + scored blocks), which
    # the flex backend on GPU attends with one call each and merges exactly through the calls'
    # log-sum-exps (nsa_flex.attention.merge_parts). mask_mod and the lists above describe the
    # whole mask: the reference backend and CPU flex use them and ignore the parts.
    parts: tuple["MaskSpec", ...] | None = None
    # no key at or beyond this index is visible (the selection's sink block 0): the flex backend
    # attends K/V[:kv_len] only
    kv_len: int | None = None
    # the mask as a per-position block selection (`Selection`), None for any other mask
    selection: Selection | None = None
    # a BlockMask built ahead (`with_block_mask`: a mask every layer of a step shares is built once,
    # outside the layers' compiled graphs); `block_mask` returns it for the same geometry
    built: BlockMask | None = None
    # query row r is position r + q_offset (a sequence shard; see the module docstring)
    q_offset: int = 0

    def positions(self, Q_LEN: int, device=None) -> Tensor:
        """The positions of query rows 0..Q_LEN-1."""
        return torch.arange(self.q_offset, self.q_offset + Q_LEN, device=device)

    @property
    def per_group(self) -> bool:
        return self.kv_blocks is not None or self.heads > 1

    # ------------------------------------------------------------------ dense
    def dense(self, B: int, Q_LEN: int, KV_LEN: int, device=None) -> Tensor:
        """Dense boolean mask [B, heads, Q_LEN, KV_LEN], evaluated element-wise from mask_mod."""
        b = torch.arange(B, device=device).view(B, 1, 1, 1)
        h = torch.arange(self.heads, device=device).view(1, self.heads, 1, 1)
        q = self.positions(Q_LEN, device).view(1, 1, Q_LEN, 1)
        kv = torch.arange(KV_LEN, device=device).view(1, 1, 1, KV_LEN)
        m = self.mask_mod(b, h, q, kv)
        return m.expand(B, self.heads, Q_LEN, KV_LEN)

    # ------------------------------------------------------------------ block mask
    def with_block_mask(self, B: int, Q_LEN: int, KV_LEN: int, device=None,
                        block_size: int | tuple[int, int] = 128) -> "MaskSpec":
        """This mask with its BlockMask (`block_mask` of the same arguments) built now."""
        return replace(self, built=self.block_mask(B, Q_LEN, KV_LEN, device, block_size))

    def built_for(self, B: int, rows: int, KV_LEN: int, block_size: tuple[int, int]) -> bool:
        """Whether the BlockMask built ahead has this geometry (rows: packed query rows); shapes
        and ints only, no tensor values read."""
        bm = self.built
        return (tuple(bm.seq_lengths) == (rows, KV_LEN) and tuple(bm.BLOCK_SIZE) == block_size
                and bm.kv_num_blocks.shape[0] in (1, B))

    def block_flags(self, B: int, Q_LEN: int, KV_LEN: int, block_size: tuple[int, int],
                    q_pack: int = 1, device=None) -> tuple[Tensor, Tensor]:
        """(any, full) block flags [B', H', NQB, NKB] of the (packed) layout."""
        if self.kv_blocks is not None:
            return self.kv_blocks(B, Q_LEN, KV_LEN, block_size, q_pack, device, None, None)
        return band_union_flags(*self.band_bounds(Q_LEN, device), Q_LEN, KV_LEN, block_size,
                                q_pack)

    def band_bounds(self, Q_LEN: int, device=None) -> tuple[Tensor, Tensor]:
        """(lo, hi) [bands, B|1, Q_LEN] of a band mask: its interval, or each band of a union."""
        if self.interval is None and self.bands is None:
            raise ValueError(f"mask {self.name!r} has neither an interval nor block lists; "
                             "use create_block_mask on its mask_mod")
        q = self.positions(Q_LEN, device)
        bounds = torch.broadcast_tensors(*(x for band in (self.bands or (self.interval,))
                                           for x in band(q)))
        return torch.stack(bounds[0::2]), torch.stack(bounds[1::2])

    def block_mask(self, B: int, Q_LEN: int, KV_LEN: int, device=None,
                   block_size: int | tuple[int, int] = 128, q_pack: int = 1,
                   kv_major: bool = True) -> BlockMask:
        """BlockMask over `Q_LEN * q_pack` (packed) query rows and KV_LEN keys.
        kv_major=False: the compact builder may leave the kv-major lists out (q_num_blocks None;
        a caller that makes its own inverse index, as the selected op does).

        Head dim of the result: 1 for head-agnostic masks, `heads` for per-group masks (in the
        packed layout those are the query heads, as FlexAttention requires)."""
        bs = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
        if self.built is not None and self.built_for(B, Q_LEN * q_pack, KV_LEN, bs):
            return self.built
        mod = offset_mask_mod(self.mask_mod, self.q_offset)  # flex passes rows, not positions
        if self.interval is None and self.kv_blocks is None and self.bands is None:
            return create_block_mask(packed_mask_mod(mod, q_pack), B, self.heads, Q_LEN * q_pack,
                                     KV_LEN, device=device, BLOCK_SIZE=bs)
        if self.compact is not None and bs[0] % q_pack == 0 and device is not None \
                and torch.device(device).type == "cuda":
            return self.compact(Q_LEN, KV_LEN, bs, q_pack, device, None, None, mod,
                                kv_major=kv_major)
        if self.kv_blocks is None and torch.compiler.is_compiling():  # a band mask, traced
            lists = band_lists(*self.band_bounds(Q_LEN, device), Q_LEN, KV_LEN, *bs, q_pack)
            return block_mask_from_lists(lists, bs, packed_mask_mod(mod, q_pack),
                                         (Q_LEN * q_pack, KV_LEN))
        any_, full = self.block_flags(B, Q_LEN, KV_LEN, bs, q_pack, device)
        return block_mask_from_flags(any_, full, bs, packed_mask_mod(mod, q_pack),
                                     (Q_LEN * q_pack, KV_LEN))


def offset_mask_mod(mask_mod: MaskMod, q_offset: int) -> MaskMod:
    """mask_mod of query rows whose position is row + q_offset."""
    if q_offset == 0:
        return mask_mod

    def shifted(b, h, q_idx, kv_idx):
        return mask_mod(b, h, q_idx + q_offset, kv_idx)

    return shifted


def at_offset(spec: MaskSpec | None, q_offset: int) -> MaskSpec | None:
    """`spec` for query rows that start at position q_offset (a sequence shard), its parts too.
    A band mask is a function of positions, so only the row map moves; a selection's rows are
    tied to its picks and carry their offset from `masks.selection` (it must agree)."""
    if spec is None:
        return None
    if spec.q_offset != q_offset and (spec.q_offset != 0 or spec.kv_blocks is not None):
        raise ValueError(f"mask {spec.name!r} has its query rows at offset {spec.q_offset}, "
                         f"not {q_offset}: build its selection with q_offset={q_offset}")
    parts = None if spec.parts is None else tuple(at_offset(p, q_offset) for p in spec.parts)
    return replace(spec, q_offset=q_offset, parts=parts)


def _kv_major_sorted(num, idx, nkb):
    """The (kv block, q block) pairs of q-major lists sorted kv-major: (row [B, H, NQB*W] kv
    block of each pair, nkb for unlisted slots (sorted last), col [.., NQB*W] int32 q block,
    counts [B, H, nkb + 1] pairs per kv block). num None: the listed slots are those >= 0."""
    B, H, nqb, W = idx.shape
    dev = idx.device
    listed = idx >= 0 if num is None else torch.arange(W, device=dev) < num.unsqueeze(-1)
    # a stable sort of the kv block alone, on the narrowest integer that holds it (a radix sort's
    # passes go with the key's width): the slots are in q-block order and a q block lists a kv
    # block at most once, so each kv block's q blocks come out ascending
    narrow = torch.int16 if nkb < torch.iinfo(torch.int16).max else torch.int32
    j = torch.where(listed, idx, nkb).to(narrow).reshape(B, H, -1)  # unlisted -> dummy row nkb
    srt = j.sort(dim=-1, stable=True)
    # pairs per kv block: where each block's run starts in the sorted keys (a binary search per
    # block), not a scatter_add of ones onto nkb + 1 counters (one atomic per slot, all on a few
    # addresses: slow on a GPU)
    bounds = torch.arange(nkb + 2, dtype=narrow, device=dev).expand(B, H, nkb + 2).contiguous()
    counts = torch.searchsorted(srt.values, bounds).diff(dim=-1)
    return srt.values.long(), (srt.indices // W).to(torch.int32), counts


def kv_major_csr(num, idx, nkb):
    """The kv-major (inverse) index of q-major lists in CSR form: (q_num [B, H, NKB] int32, the q
    blocks listing each kv block; q_flat [B, H, NQB*W] int32, those q blocks kv block by kv block,
    ascending within one; a kv block's entries start at the exclusive cumsum of q_num, entries
    past sum(q_num) are padding). O(NQB * W) memory where a BlockMask's q_indices take
    [NKB, NQB]. num None: idx's entries >= 0 are listed (e.g. a selection [B, H, T, n], -1
    unused: then the q blocks are positions; the selected op's backward index)."""
    _, col, counts = _kv_major_sorted(num, idx, nkb)
    return counts[..., :nkb].to(torch.int32), col


def transpose_lists(num, idx, nkb):
    """kv-major lists from q-major lists, without a dense [NQB, NKB] table.

    num [B, H, NQB], idx [B, H, NQB, W] -> q_num [B, H, NKB], q_idx [B, H, NKB, NQB]. Static
    shapes only (sort + scatter), so it traces into a compiled graph."""
    B, H, nqb, W = idx.shape
    dev = idx.device
    row, col, counts = _kv_major_sorted(num, idx, nkb)
    starts = torch.cumsum(counts, -1) - counts
    rank = torch.arange(row.shape[-1], device=dev).expand_as(row) - starts.gather(2, row)
    rank = torch.where(row == nkb, 0, rank).clamp_max(nqb - 1)  # dummy row: discarded
    q_idx = torch.zeros(B, H, (nkb + 1) * nqb, dtype=torch.int32, device=dev)
    q_idx.scatter_(2, row * nqb + rank, col)
    q_idx = q_idx.view(B, H, nkb + 1, nqb)[:, :, :nkb]
    return counts[..., :nkb].to(torch.int32), q_idx.contiguous()


def packed_mask_mod(mask_mod: MaskMod, q_pack: int) -> MaskMod:
    if q_pack == 1:
        return mask_mod

    def packed(b, h, q_idx, kv_idx):
        return mask_mod(b, h, q_idx // q_pack, kv_idx)

    return packed


BAND_FLAGS_CHUNK = 2 ** 24  # band_block_flags' eager temporaries, elements


def band_block_flags(lo: Tensor, hi: Tensor, Q_LEN: int, KV_LEN: int,
                     block_size: tuple[int, int], q_pack: int = 1) -> tuple[Tensor, Tensor]:
    """Block flags of a band mask given per-token inclusive kv bounds lo, hi [B, Q_LEN].

    A kv block is listed ("any") when some row of the q block sees some key in it, and "full"
    when every row of the q block sees every key of it (and both lie wholly inside the lengths).
    Flags are [B, 1, NQB, NKB]; cost is O(Q_LEN * NKB) compares (a q block's QB // q_pack
    positions, not QB packed rows, when q_pack divides QB); compiled, nothing of that size is
    stored; eager, it is computed in chunks of kv blocks.
    """
    QB, KB = block_size
    R, n = _band_rows(Q_LEN, QB, q_pack)
    if n != Q_LEN:  # rows of one position may straddle q blocks: one entry per packed row
        lo = lo.repeat_interleave(q_pack, dim=-1)
        hi = hi.repeat_interleave(q_pack, dim=-1)
    nqb = -(-n // R)
    nkb = max(1, -(-KV_LEN // KB))
    pad = nqb * R - n
    Bm = lo.shape[0]
    lo = lo.clamp_min(0)
    hi = hi.clamp_max(KV_LEN - 1)
    empty = hi < lo
    big = torch.iinfo(torch.long).max // 4
    # per row: the run of kv blocks it sees (first > last when empty); padded rows see nothing
    first = torch.where(empty, big, lo // KB)
    last = torch.where(empty, -1, hi // KB)
    lo_full = torch.where(empty, big, lo)  # "full": padded or empty rows make no block full
    hi_full = torch.where(empty, -1, hi)
    if pad:
        fill = lambda t, v: torch.cat([t, t.new_full((Bm, pad), v)], dim=-1)
        first, last, lo_full, hi_full = (fill(first, big), fill(last, -1), fill(lo_full, big),
                                         fill(hi_full, -1))
    kb = torch.arange(nkb, device=lo.device).view(1, 1, nkb)
    # "any", exactly: some row's run contains the block (rows of one q block in different
    # documents can see runs with a gap between them: no [min lo, max hi] hull). A reduction over
    # the block's rows (compiled: one fused kernel, nothing of size rows x NKB is stored)
    first, last = first.view(Bm, nqb, R, 1), last.view(Bm, nqb, R, 1)

    def covered(k: Tensor) -> Tensor:  # [Bm, nqb, len(k)]: some row's run holds block k
        return ((first <= k) & (last >= k)).any(-2)

    # eager: kv blocks in chunks, so no temporary exceeds BAND_FLAGS_CHUNK elements (long prefills)
    step = nkb if torch.compiler.is_compiling() else max(1, BAND_FLAGS_CHUNK // (Bm * nqb * R))
    any_ = torch.cat([covered(kb[..., k0:k0 + step].unsqueeze(-2)) for k0 in range(0, nkb, step)],
                     dim=-1)
    f0 = lo_full.view(Bm, nqb, R).amax(-1)
    f1 = hi_full.view(Bm, nqb, R).amin(-1)
    k_start = kb * KB
    k_end = k_start + KB - 1  # inclusive
    full = (k_start >= f0.unsqueeze(-1)) & (k_end <= f1.unsqueeze(-1)) & (k_end < KV_LEN)
    return any_.unsqueeze(1), full.unsqueeze(1)


def band_union_flags(lo: Tensor, hi: Tensor, Q_LEN: int, KV_LEN: int,
                     block_size: tuple[int, int], q_pack: int = 1) -> tuple[Tensor, Tensor]:
    """(any, full) flags of a union of bands, lo / hi [bands, B|1, Q_LEN]: each band's
    `band_block_flags`, or-ed."""
    any_ = full = None
    for i in range(lo.shape[0]):
        a, f = band_block_flags(lo[i], hi[i], Q_LEN, KV_LEN, block_size, q_pack)
        any_, full = (a, f) if any_ is None else (any_ | a, full | f)
    return any_, full


def _band_rows(Q_LEN: int, QB: int, q_pack: int) -> tuple[int, int]:
    """(entries per q block, entries) of `band_block_flags`: a q block is QB // q_pack whole
    positions where q_pack divides QB, else one entry per packed row."""
    return (QB // q_pack, Q_LEN) if q_pack > 1 and QB % q_pack == 0 else (QB, Q_LEN * q_pack)


def block_mask_from_flags(any_: Tensor, full: Tensor, block_size: tuple[int, int],
                          mask_mod: MaskMod, seq_lengths: tuple[int, int]) -> BlockMask:
    """BlockMask from [B, H, NQB, NKB] flags: full blocks skip mask_mod, the rest are partial.

    Index tensors are padded to the full KV-block width, so the shapes (and the compiled kernels)
    stay the same from step to step while the selection changes."""
    return block_mask_from_lists(flag_lists(any_, full), block_size, mask_mod, seq_lengths)


def flag_lists(any_: Tensor, full: Tensor) -> list[Tensor]:
    """A BlockMask's eight lists from [B, H, NQB, NKB] flags: (kv_num, kv_idx, full_kv_num,
    full_kv_idx, q_num, q_idx, full_q_num, full_q_idx)."""
    partial = any_ & ~full
    # q-major lists from the same flags (what from_kv_blocks derives through an argsort)
    return [*_flags_to_indices(partial), *_flags_to_indices(full),
            *_flags_to_indices(partial.transpose(-2, -1)), *_flags_to_indices(full.transpose(-2, -1))]


def block_mask_from_lists(lists, block_size: tuple[int, int], mask_mod: MaskMod,
                          seq_lengths: tuple[int, int]) -> BlockMask:
    """BlockMask from `flag_lists`' eight lists."""
    kv_num, kv_idx, full_num, full_idx, q_num, q_idx, fq_num, fq_idx = lists
    return BlockMask(seq_lengths=seq_lengths, kv_num_blocks=kv_num, kv_indices=kv_idx,
                     full_kv_num_blocks=full_num, full_kv_indices=full_idx, q_num_blocks=q_num,
                     q_indices=q_idx, full_q_num_blocks=fq_num, full_q_indices=fq_idx,
                     BLOCK_SIZE=block_size, mask_mod=mask_mod)


@torch.library.custom_op("nsa_masks::band_lists", mutates_args=())
def band_lists(lo: Tensor, hi: Tensor, Q_LEN: int, KV_LEN: int, QB: int, KB: int,
               q_pack: int) -> list[Tensor]:
    """`flag_lists` of `band_union_flags`; under torch.compile an opaque op (the eager code
    inside the graph): traced into a compiled graph, Inductor on a GPU (torch 2.11) made a
    batch-dependent band mask wrong for batch rows > 0 (the compressed-causal mask with
    documents; torch's own create_block_mask traced alike), where the same lists built eagerly
    are exact."""
    flags = band_union_flags(lo, hi, Q_LEN, KV_LEN, (QB, KB), q_pack)
    return [x.contiguous() for x in flag_lists(*flags)]


@band_lists.register_fake
def _(lo, hi, Q_LEN, KV_LEN, QB, KB, q_pack):
    R, n = _band_rows(Q_LEN, QB, q_pack)
    Bm, nqb, nkb = lo.shape[1], -(-n // R), max(1, -(-KV_LEN // KB))
    i32 = dict(dtype=torch.int32, device=lo.device)
    kv = [torch.empty(Bm, 1, nqb, **i32), torch.empty(Bm, 1, nqb, nkb, **i32)]
    qm = [torch.empty(Bm, 1, nkb, **i32), torch.empty(Bm, 1, nkb, nqb, **i32)]
    return kv + [torch.empty_like(x) for x in kv] + qm + [torch.empty_like(x) for x in qm]


def _flags_to_indices(flags: Tensor) -> tuple[Tensor, Tensor]:
    """Row-wise (count, indices) of the set flags: the set blocks first in increasing order, then
    the unset ones (what a stable sort of ~flags gives), by cumsum + scatter. No sort: inductor
    lowers a sort of a few hundred columns to a Triton sort network that takes minutes to compile."""
    f = flags.to(torch.int32)
    num = f.sum(-1, dtype=torch.int32)
    cols = torch.arange(flags.shape[-1], device=flags.device, dtype=torch.int32)
    before_set = row_cumsum(f) - f  # set flags left of each column
    before_unset = cols - before_set  # unset flags left of it
    dest = torch.where(flags, before_set, num.unsqueeze(-1).long() + before_unset)
    idx = torch.empty(flags.shape, device=flags.device, dtype=torch.int32)
    idx.scatter_(-1, dest, cols.expand(flags.shape).contiguous())
    return num.contiguous(), idx


def or_masks(*specs: MaskSpec, name: str | None = None) -> MaskSpec:
    """Union of band masks (like flex_attention.or_masks, for MaskSpecs): one mask whose block
    lists are the union of the bands' lists. Bands may overlap."""
    if any(s.interval is None and s.bands is None for s in specs):
        raise ValueError("or_masks takes band masks (an interval or bands) only; got "
                         + ", ".join(s.name for s in specs))
    mods = [s.mask_mod for s in specs]

    def mask_mod(b, h, q_idx, kv_idx):
        m = mods[0](b, h, q_idx, kv_idx)
        for f in mods[1:]:
            m = m | f(b, h, q_idx, kv_idx)
        return m

    bands = tuple(band for s in specs for band in (s.bands or (s.interval,)))
    return MaskSpec(mask_mod, heads=max(s.heads for s in specs), bands=bands,
                    name=name or "|".join(s.name for s in specs),
                    q_offset=max(s.q_offset for s in specs))


def and_masks(*specs: MaskSpec, name: str | None = None) -> MaskSpec:
    """Intersection of masks (like flex_attention.and_masks, for MaskSpecs).

    Bands intersect as bands; one block-list mask combines with any number of bands."""
    specs = tuple(s for s in specs if s is not None)
    if len(specs) == 1:
        return specs[0]
    mods = [s.mask_mod for s in specs]

    def mask_mod(b, h, q_idx, kv_idx):
        m = mods[0](b, h, q_idx, kv_idx)
        for f in mods[1:]:
            m = m & f(b, h, q_idx, kv_idx)
        return m

    heads = max(s.heads for s in specs)
    q_offset = max(s.q_offset for s in specs)  # a selection's; bands take positions
    if any(s.q_offset not in (0, q_offset) for s in specs):
        raise ValueError("and_masks: masks at different query offsets "
                         + ", ".join(f"{s.name}@{s.q_offset}" for s in specs))
    bands = [s.interval for s in specs if s.interval is not None]
    lists = [s.kv_blocks for s in specs if s.kv_blocks is not None]
    unions = [s.bands for s in specs if s.bands is not None]
    interval = kv_blocks = compact = union = None

    def band(q):
        lo, hi = bands[0](q)
        for f in bands[1:]:
            l2, h2 = f(q)
            lo, hi = torch.maximum(lo, l2), torch.minimum(hi, h2)
        return lo, hi

    def clip(u):  # one band of a union, intersected with the other specs' bands
        def clipped(q):
            lo, hi = u(q)
            l2, h2 = band(q)
            return torch.maximum(lo, l2), torch.minimum(hi, h2)

        return clipped

    if len(lists) == 0 and len(bands) == len(specs):
        interval = band
    elif len(lists) == 0 and len(unions) == 1 and len(bands) == len(specs) - 1:
        union = tuple(clip(u) for u in unions[0])
    elif len(lists) == 1 and len(bands) == len(specs) - 1:
        inner = lists[0]

        def kv_blocks(B, Q_LEN, KV_LEN, block_size, q_pack, device, lo, hi):
            l2, h2 = band(torch.arange(q_offset, q_offset + Q_LEN, device=device))
            if lo is not None:
                l2, h2 = torch.maximum(lo, l2), torch.minimum(hi, h2)
            return inner(B, Q_LEN, KV_LEN, block_size, q_pack, device, l2, h2)

        inner_compact = next(s.compact for s in specs if s.kv_blocks is not None)
        if inner_compact is not None:
            def compact(Q_LEN, KV_LEN, block_size, q_pack, device, lo, hi, mod, kv_major=True):
                l2, h2 = band(torch.arange(q_offset, q_offset + Q_LEN, device=device))
                if lo is not None:
                    l2, h2 = torch.maximum(lo, l2), torch.minimum(hi, h2)
                return inner_compact(Q_LEN, KV_LEN, block_size, q_pack, device, l2, h2, mod,
                                     kv_major=kv_major)

    kv_block = next((s.kv_block for s in specs if s.kv_block is not None), None)
    selection = None
    if kv_blocks is not None:
        picks = next(s for s in specs if s.kv_blocks is not None).selection
        if picks is not None and picks.band is None:
            selection = Selection(picks.idx, picks.l_sel, band)
    return MaskSpec(mask_mod, heads=heads, interval=interval, kv_blocks=kv_blocks,
                    name=name or "&".join(s.name for s in specs), kv_block=kv_block,
                    compact=compact, bands=union, selection=selection, q_offset=q_offset)
