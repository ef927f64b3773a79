"""block_mask_from_flags builds kv- and q-major block lists without a sort (cumsum + scatter);
they must equal what a stable sort / torch's from_kv_blocks gives. band_block_flags against the
flags of the dense band."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import BlockMask

from masks import core
from masks.core import _flags_to_indices, block_mask_from_flags


@pytest.mark.parametrize("shape", [(1, 1, 7, 5), (2, 1, 16, 33), (1, 1, 128, 128), (3, 1, 1, 1)])
@pytest.mark.parametrize("p", [0.0, 0.3, 1.0])
def test_flags_to_indices_equals_stable_sort(shape, p):
    g = torch.Generator().manual_seed(0)
    flags = torch.rand(shape, generator=g) < p
    num, idx = _flags_to_indices(flags)
    assert num.dtype == idx.dtype == torch.int32
    assert torch.equal(num, flags.sum(-1, dtype=torch.int32))
    want = torch.sort((~flags).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
    assert torch.equal(idx, want)


def test_block_mask_from_flags_equals_from_kv_blocks():
    g = torch.Generator().manual_seed(1)
    any_ = torch.rand(2, 1, 12, 9, generator=g) < 0.5
    full = any_ & (torch.rand(2, 1, 12, 9, generator=g) < 0.5)
    mod = lambda b, h, q, kv: q >= kv
    got = block_mask_from_flags(any_, full, (16, 32), mod, (12 * 16, 9 * 32))
    partial = any_ & ~full
    lists = [_flags_to_indices(f) for f in (partial, full)]
    want = BlockMask.from_kv_blocks(*lists[0], *lists[1], BLOCK_SIZE=(16, 32), mask_mod=mod,
                                    seq_lengths=(12 * 16, 9 * 32))
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.BLOCK_SIZE == want.BLOCK_SIZE and got.seq_lengths == want.seq_lengths


# ---------------------------------------------------------------------- band_block_flags
def brute_band_flags(lo, hi, Q_LEN, KV_LEN, block_size, q_pack):
    """The flags by definition, from the dense [rows, KV_LEN] band (row r is position r // q_pack):
    "any" = some visible key in the tile, "full" = every element of the tile inside the lengths
    and visible."""
    QB, KB = block_size
    B, rows = lo.shape[0], Q_LEN * q_pack
    nqb, nkb = -(-rows // QB), max(1, -(-KV_LEN // KB))
    pos = torch.arange(rows) // q_pack
    kv = torch.arange(nkb * KB)
    inside = torch.zeros(nqb * QB, nkb * KB, dtype=torch.bool)
    inside[:rows, :KV_LEN] = True
    dense = torch.zeros(B, nqb * QB, nkb * KB, dtype=torch.bool)
    dense[:, :rows] = (kv >= lo[:, pos, None]) & (kv <= hi[:, pos, None])
    dense &= inside
    tiles = dense.view(B, nqb, QB, nkb, KB)
    any_ = tiles.any(-1).any(-2)
    full = tiles.all(-1).all(-2) & inside.view(nqb, QB, nkb, KB).all(-1).all(-2)
    return any_.unsqueeze(1), full.unsqueeze(1)


@settings(max_examples=200, deadline=None)
@given(B=st.integers(1, 3), Q_LEN=st.integers(1, 60), KV_LEN=st.integers(1, 60),
       QB=st.sampled_from([1, 2, 3, 4, 5, 8, 12, 16, 24]), KB=st.sampled_from([1, 2, 3, 5, 8, 16]),
       q_pack=st.sampled_from([1, 2, 3, 8, 16]), chunk=st.sampled_from([None, 1, 7]),
       seed=st.integers(0, 2 ** 16))
def test_band_block_flags_equal_the_dense_band(B, Q_LEN, KV_LEN, QB, KB, q_pack, chunk, seed):
    """Exact flags for any band (runs with gaps across documents, empty rows, bounds outside the
    lengths), block sizes that q_pack divides or not, and the eager chunking over kv blocks."""
    g = torch.Generator().manual_seed(seed)
    lo = torch.randint(-3, KV_LEN + 3, (B, Q_LEN), generator=g)
    hi = lo + torch.randint(-4, KV_LEN, (B, Q_LEN), generator=g)  # hi < lo: an empty row
    default = core.BAND_FLAGS_CHUNK
    try:
        core.BAND_FLAGS_CHUNK = chunk or default
        got = core.band_block_flags(lo, hi, Q_LEN, KV_LEN, (QB, KB), q_pack)
    finally:
        core.BAND_FLAGS_CHUNK = default
    want = brute_band_flags(lo, hi, Q_LEN, KV_LEN, (QB, KB), q_pack)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


LIST_NAMES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
              "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def band_specs() -> dict:
    """Band masks with documents that differ per batch row (row 0 one document), as the layer
    builds them: name -> (spec, KV_LEN, q_pack) at B = 3, T = 1024."""
    from masks import MaskContext, get_mask_builder
    from masks.builders import forced_parts
    from nsa_flex import NSAConfig

    cfg = NSAConfig(n_heads=8, n_kv_heads=2, d_qk=64, d_v=64, dim=256, l=32, d=16, l_sel=64,
                    n_sel=8, window=256)
    docs = torch.zeros(3, 1024, dtype=torch.long)
    docs[1, 300:] = 1
    docs[2, 100:] = 1
    docs[2, 700:] = 2
    ctx = MaskContext(cfg, 3, 1024, "cpu", doc_ids=docs)
    forced = forced_parts(cfg.l_sel, 1, 2, ctx.doc_start())[0]  # a union of bands (or_masks)
    assert forced.bands is not None
    return {"compressed_causal": (get_mask_builder("compressed_causal")(ctx), cfg.num_cmp(1024), 1),
            "sliding_window": (get_mask_builder("sliding_window")(ctx), 1024, 1),
            "causal_packed": (get_mask_builder("causal")(ctx), 1024, 4),
            "forced_blocks": (forced, 1024, 4)}


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("case", ["compressed_causal", "sliding_window", "causal_packed",
                                  "forced_blocks"])
def test_band_block_mask_traced_equals_eager(case, backend):
    """A band mask's BlockMask built inside a compiled graph (the `band_lists` op) has the lists
    of the eager build, every batch row its own: traced lists were wrong for rows > 0 on a GPU
    (the op's docstring)."""
    spec, S, q_pack = band_specs()[case]
    bs = (16 * q_pack, 16) if q_pack > 1 else (64, 16)

    def lists():
        bm = spec.block_mask(3, 1024, S, "cpu", bs, q_pack)
        return tuple(getattr(bm, n) for n in LIST_NAMES)

    want = lists()
    torch._dynamo.reset()
    got = torch.compile(lists, backend=backend, fullgraph=True, dynamic=False)()
    assert want[0].shape[0] == 3  # per-row lists, rows that differ
    assert any(not torch.equal(w[0], w[1]) for w in want)
    for name, g, w in zip(LIST_NAMES, got, want):
        assert g.dtype == w.dtype and torch.equal(g, w), name


def test_band_lists_op_fake_matches_real():
    """The op's fake (shapes, dtypes under tracing) agrees with what it returns (opcheck)."""
    from masks.core import band_lists

    q = torch.arange(100)
    lo = torch.stack([torch.zeros(2, 100, dtype=torch.long), (q - 7).expand(2, 100)])
    hi = torch.stack([q.expand(2, 100), q.expand(2, 100).clone()])
    for args in [(lo, hi, 100, 40, 32, 16, 1), (lo, hi, 100, 100, 32, 16, 4),
                 (lo[:1], hi[:1], 100, 7, 128, 128, 1)]:
        torch.library.opcheck(band_lists, args)
