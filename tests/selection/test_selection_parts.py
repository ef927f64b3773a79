"""The selection mask split into forced blocks + scored blocks (masks.registry.selection_parts),
attended as two calls and merged through their log-sum-exps (nsa_flex.attention.merge_parts).

The parts must be disjoint and their union the whole selection mask, for any scorer-made
selection (forced blocks always picked), with and without documents; the forced part's
BlockMask (a union of two bands) must list every visible element; and merging the two parts'
attention must give the whole mask's attention, values, lse and gradients (fp64 reference)."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from masks import MaskContext, forced_blocks, get_mask_builder, or_masks, sliding_window
from masks.registry import selection_parts
from nsa_flex import NSAConfig
from nsa_flex.attention import attend_reference, merge_parts
from nsa_flex.rules import forced_and_valid, pick_blocks
from tests.masks.test_masks import check_block_mask, random_docs

pytestmark = pytest.mark.usefixtures("single_thread")

N_EX = max(40, settings.default.max_examples // 4)


def scorer_like_selection(cfg, B, T, doc_ids, rng):
    """Top-n of random scores under the scorer's rules: forced blocks first, valid ones only."""
    starts = (torch.zeros(1, T, dtype=torch.long) if doc_ids is None else
              MaskContext(cfg, B, T, "cpu", doc_ids=doc_ids).doc_start())
    valid, forced = forced_and_valid(cfg, T, starts, "cpu")
    ns = valid.shape[-1]
    g = torch.Generator().manual_seed(rng.randint(0, 2**31))
    scores = torch.randint(0, 3, (B, cfg.n_kv_heads, T, ns), generator=g).float()
    return pick_blocks(scores, valid.unsqueeze(1), forced.unsqueeze(1), cfg.n_sel)


def make_cfg(l_sel, n_init, n_local, n_sel, Hkv=2, G=2):
    return NSAConfig(dim=8, n_heads=Hkv * G, n_kv_heads=Hkv, d_qk=8, d_v=4, l=l_sel, d=l_sel,
                     l_sel=l_sel, n_sel=n_sel, n_init=n_init, n_local=n_local, window=4,
                     backend="reference")


@settings(max_examples=N_EX)
@given(B=st.integers(1, 2), T=st.integers(1, 50), l_sel=st.sampled_from([1, 2, 4, 8]),
       n_init=st.integers(0, 1), n_local=st.integers(0, 3), extra=st.integers(0, 3),
       seed=st.integers(0, 2**31), docs=st.booleans())
def test_parts_are_a_disjoint_cover(B, T, l_sel, n_init, n_local, extra, seed, docs):
    rng = random.Random(seed)
    cfg = make_cfg(l_sel, n_init, n_local, max(1, n_init + n_local + extra))
    doc_ids = random_docs(B, T, rng) if docs else None
    idx = scorer_like_selection(cfg, B, T, doc_ids, rng)
    ctx = MaskContext(cfg, B, T, torch.device("cpu"), doc_ids=doc_ids, topn=lambda: idx)
    spec = get_mask_builder("topn")(ctx)
    whole = spec.dense(B, T, T)
    if n_init + n_local == 0:
        assert spec.parts is None
        return
    dense = [p.dense(B, T, T).expand_as(whole) for p in spec.parts]
    seen = torch.zeros_like(whole)
    for d in dense:
        assert not bool((seen & d).any()), "a key is in two parts"
        seen = seen | d
    assert torch.equal(seen, whole), "the parts do not cover the selection"
    # without documents the sink is its own part, with keys 0..l_sel-1 only
    n_forced = (n_local > 0) + (n_init > 0) if not docs else 1
    assert len(spec.parts) == 1 + n_forced
    forced = dense[:-1]
    # the forced parts hold every visible key of the forced blocks: never empty for a query
    assert bool(torch.stack(forced).any(0).any(-1).all())
    for p in spec.parts[:-1]:
        if p.kv_len is not None:
            assert not bool(p.dense(B, T, T)[..., p.kv_len:].any())
        for bs in [(4, 4), (8, 4), (3, 5), (128, 128)]:
            check_block_mask(p.block_mask(B, T, T, block_size=bs), p.dense(B, T, T))


def test_selection_parts_used_by_every_selection_builder():
    cfg = make_cfg(4, 1, 2, 5)
    T = 24
    idx = scorer_like_selection(cfg, 1, T, None, random.Random(0))
    ctx = MaskContext(cfg, 1, T, torch.device("cpu"), topn=lambda: idx)
    for name in ("topn", "random_selection", "local_selection"):
        spec = get_mask_builder(name)(ctx)
        assert spec.parts is not None and len(spec.parts) == 3, name  # local, sink, scored
        union = torch.stack([p.dense(1, T, T).expand(1, 2, T, T) for p in spec.parts]).any(0)
        assert torch.equal(union, spec.dense(1, T, T)), name


def test_forced_blocks_rule():
    """Query t sees the first block of its document and its n_local most recent blocks."""
    l_sel, T = 4, 20
    starts = torch.tensor([[0] * 7 + [7] * 13])
    spec = forced_blocks(l_sel, 1, 2, starts)
    dense = spec.dense(1, T, T)[0, 0]
    for t in range(T):
        s = int(starts[0, t])
        want = {k for k in range(t + 1)
                if k // l_sel == s // l_sel or k // l_sel > t // l_sel - 2}
        assert {k for k in range(T) if dense[t, k]} == want, t
    assert forced_blocks(4, 0, 0) is None
    with pytest.raises(ValueError, match="band masks"):
        or_masks(sliding_window(3), get_mask_builder("topn")(MaskContext(
            make_cfg(4, 1, 1, 3), 1, 8, torch.device("cpu"),
            topn=lambda: torch.zeros(1, 2, 8, 3, dtype=torch.long))))


@pytest.mark.parametrize("docs", [False, True])
def test_merged_parts_equal_whole_attention(docs):
    """attend(whole) == merge_parts(attend(forced), attend(rest)): values, lse, gradients."""
    rng = random.Random(7)
    B, T, Hkv, G = 2, 37, 2, 3
    cfg = make_cfg(4, 1, 2, 6, Hkv=Hkv, G=G)
    doc_ids = random_docs(B, T, rng) if docs else None
    idx = scorer_like_selection(cfg, B, T, doc_ids, rng)
    ctx = MaskContext(cfg, B, T, torch.device("cpu"), doc_ids=doc_ids, topn=lambda: idx)
    spec = get_mask_builder("topn")(ctx)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, Hkv * G, T, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, Hkv, T, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, Hkv, T, 4, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(B, Hkv * G, T, 4, generator=g, dtype=torch.float64)
    wl = torch.randn(B, Hkv * G, T, generator=g, dtype=torch.float64)

    def run(f):
        o, lse = f()
        loss = (o * w).sum() + (lse * wl).sum()
        grads = torch.autograd.grad(loss, (q, k, v))
        return o.detach(), lse.detach(), grads

    want = run(lambda: attend_reference(q, k, v, spec))
    got = run(lambda: merge_parts([attend_reference(q, k, v, p) for p in spec.parts]))
    torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=1e-10, atol=1e-12)
    for a, b in zip(got[2], want[2]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


def test_merge_parts_row_that_sees_one_part_only():
    o1, o2 = torch.ones(1, 1, 2, 3), torch.full((1, 1, 2, 3), 5.0)
    lse1 = torch.tensor([[[0.0, float("-inf")]]])
    lse2 = torch.tensor([[[float("-inf"), float("-inf")]]])
    o, lse = merge_parts([(o1, lse1), (o2, lse2)])
    assert torch.equal(o[0, 0, 0], torch.ones(3)) and torch.equal(o[0, 0, 1], torch.zeros(3))
    assert lse[0, 0, 0] == 0 and lse[0, 0, 1] == float("-inf")


@pytest.mark.gpu  # flex's split route runs on CUDA only
@pytest.mark.parametrize("docs", [False, True])
def test_cuda_flex_split_matches_reference(docs):
    """The GPU route (one flex call per part, merged by lse; the sink with sliced K/V and one
    copy per query head) against the fp32 reference of the whole mask: output and gradients."""
    from nsa_flex.attention import attend_flex

    rng = random.Random(11)
    B, T, Hkv, G = 1, 700, 2, 4
    cfg = make_cfg(16, 1, 2, 6, Hkv=Hkv, G=G)
    doc_ids = random_docs(B, T, rng).cuda() if docs else None
    idx = scorer_like_selection(cfg, B, T, None if doc_ids is None else doc_ids.cpu(), rng).cuda()
    ctx = MaskContext(cfg, B, T, torch.device("cuda"), doc_ids=doc_ids, topn=lambda: idx)
    spec = get_mask_builder("topn")(ctx)
    assert spec.parts is not None
    q = torch.randn(B, Hkv * G, T, 64, device="cuda", requires_grad=True)
    k = torch.randn(B, Hkv, T, 64, device="cuda", requires_grad=True)
    v = torch.randn(B, Hkv, T, 64, device="cuda", requires_grad=True)
    w = torch.randn(B, Hkv * G, T, 64, device="cuda")
    got, _ = attend_flex(q, k, v, spec)
    g_got = torch.autograd.grad((got * w).sum(), (q, k, v))
    want, _ = attend_reference(q, k, v, spec)
    g_want = torch.autograd.grad((want * w).sum(), (q, k, v))
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=5e-3, atol=5e-3)
