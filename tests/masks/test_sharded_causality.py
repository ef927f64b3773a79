"""Masks of a sequence shard (context parallelism, issue 42; hypothesis, the profile's examples):
for every registered builder, random configs, shard counts and document boundaries, the mask of
the queries of shard r (rows at `q_offset` = r T/N, `masks.at_offset`) is exactly those rows of
the whole sequence's mask -- in the reference backend's dense form and in flex's BlockMask (block
lists + mask_mod, packed rows of per-group masks, each part of a split mask) -- and no row of the
shard sees a key that ends after its global position."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from masks import MaskContext, at_offset, builder_info, doc_start, list_mask_builders
from masks.registry import _first_leak, _random_topn, flex_allowed
from nsa_flex.rules import LayerShape

pytestmark = pytest.mark.usefixtures("single_thread")

BUILDERS = [n for n in list_mask_builders() if n != "none"]


@st.composite
def cases(draw):
    d = draw(st.integers(1, 3))
    Hkv = draw(st.integers(1, 2))
    n_init, n_local = draw(st.integers(0, 1)), draw(st.integers(0, 2))
    cfg = LayerShape(dim=4, n_heads=Hkv * draw(st.integers(1, 3)), n_kv_heads=Hkv, d_qk=4, d_v=2,
                     l=d * draw(st.integers(1, 3)), d=d, l_sel=d * draw(st.integers(1, 3)),
                     n_sel=max(1, n_init + n_local + draw(st.integers(0, 2))), n_init=n_init,
                     n_local=n_local, window=draw(st.integers(1, 20)))
    N = draw(st.integers(2, 4))
    Tq = draw(st.integers(1, 12))
    B = draw(st.integers(1, 2))
    docs = draw(st.booleans())
    return cfg, B, N, Tq, draw(st.integers(0, N - 1)), docs, draw(st.integers(0, 2**31 - 1))


def both_forms(spec, cfg, B, T, S):
    """(dense [B, H, T, S], [(flex's allowed [.., rows, S], rows per position G)] of the mask and
    of each of its parts)."""
    return spec.dense(B, T, S), [(flex_allowed(p, cfg, B, T, S), cfg.group_size if p.per_group else 1)
                                 for p in (spec, *(spec.parts or ()))]


@settings()
@given(case=cases(), name=st.sampled_from(BUILDERS))
def test_a_shard_sees_its_rows_of_the_whole_mask(case, name):
    cfg, B, N, Tq, r, docs, seed = case
    T, o = N * Tq, r * Tq
    gen = torch.Generator().manual_seed(seed)
    doc_ids = torch.sort(torch.randint(0, 3, (B, T), generator=gen), -1).values if docs else None
    starts = doc_start(doc_ids) if docs else torch.zeros(1, T, dtype=torch.long)
    idx = _random_topn(cfg, B, T, starts, gen)
    step = torch.randint(0, 1000, (B, 1, T, 1), generator=gen)
    info = builder_info(name)
    whole = info.fn(MaskContext(cfg, B, T, torch.device("cpu"), doc_ids=doc_ids,
                                topn=lambda: idx, step=step))
    shard = at_offset(info.fn(MaskContext(cfg, B, T, torch.device("cpu"), doc_ids=doc_ids,
                                          topn=lambda: idx[:, :, o:o + Tq], step=step,
                                          q_offset=o, q_len=Tq)), o)
    if whole is None:
        assert shard is None
        return
    compressed = info.kind == "compressed"
    S = cfg.num_cmp(T) if compressed else T
    key_end = torch.arange(S) * (cfg.d if compressed else 1) + (cfg.l - 1 if compressed else 0)
    dense_w, flex_w = both_forms(whole, cfg, B, T, S)
    dense_s, flex_s = both_forms(shard, cfg, B, Tq, S)
    assert torch.equal(dense_s.expand(B, -1, -1, -1), dense_w.expand(B, -1, -1, -1)[:, :, o:o + Tq])
    assert _first_leak(dense_s, torch.arange(o, o + Tq), key_end) is None
    for (fw, G), (fs, _) in zip(flex_w, flex_s, strict=True):
        assert torch.equal(*torch.broadcast_tensors(fs, fw[..., o * G:(o + Tq) * G, :]))
        assert _first_leak(fs, torch.arange(Tq * G) // G + o, key_end) is None
    for p in (shard, *(shard.parts or ())):  # a GPU's compact BlockMask of a selection
        if p.compact is not None:
            fc, ff = flex_allowed(p, cfg, B, Tq, S, compact=True), flex_allowed(p, cfg, B, Tq, S)
            assert torch.equal(*torch.broadcast_tensors(fc, ff))


def test_at_offset_refuses_a_selection_built_elsewhere():
    from masks import selection
    idx = torch.zeros(1, 1, 4, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="build its selection with q_offset=4"):
        at_offset(selection(idx, 2), 4)
