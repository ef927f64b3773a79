"""Selection scorer (paper Eq. 8-10): Eq. 9 mapping against brute-force overlap counting, Eq. 8
probabilities against a dense softmax, Eq. 10 group sums (every head of a group gets the same
indices, head order inside a group is irrelevant), top-n rules (forced blocks present, never a
block starting after the query, ties to the lower index), chunked == unchunked exactly."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import masks
from masks import MaskContext, register_mask_builder, selection
from nsa_flex import NSAAttention, NSAConfig
from nsa_flex.rules import map_to_selection_blocks, overlap_kernel
from nsa_flex.selection import block_scores, select_topn

pytestmark = pytest.mark.usefixtures("single_thread")

N_EX = max(40, settings.default.max_examples // 4)


def brute_map(p, ns, l, d, l_sel):
    """p_slc[j] = sum_i (|[i*d, i*d+l) ∩ [j*l', (j+1)*l')| / d) * p_cmp[i], counted token by token."""
    nc = len(p)
    out = []
    for j in range(ns):
        acc = 0.0
        for i in range(nc):
            ov = sum(1 for tok in range(i * d, i * d + l) if j * l_sel <= tok < (j + 1) * l_sel)
            acc += ov / d * p[i]
        out.append(acc)
    return out


def test_overlap_kernel_paper_pattern():
    assert overlap_kernel(32, 16, 64).tolist() == [1.0, 2.0, 2.0, 2.0, 1.0]
    assert overlap_kernel(16, 16, 64).tolist() == [1.0, 1.0, 1.0, 1.0]  # l = d: partition
    assert overlap_kernel(64, 16, 32).tolist() == [1.0, 2.0, 2.0, 2.0, 1.0]


@settings(max_examples=N_EX)
@given(d=st.integers(1, 4), lq=st.integers(1, 5), rq=st.integers(1, 5), T=st.integers(1, 70),
       seed=st.integers(0, 2**31))
def test_eq9_mapping_vs_brute(d, lq, rq, T, seed):
    l, l_sel = d * lq, d * rq
    nc = 0 if T < l else (T - l) // d + 1
    ns = -(-T // l_sel)
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(2, 3, max(nc, 0), generator=g, dtype=torch.float64)
    got = map_to_selection_blocks(p, ns, l, d, l_sel)
    assert got.shape == (2, 3, ns)
    for a in range(2):
        for b in range(3):
            want = brute_map(p[a, b].tolist(), ns, l, d, l_sel)
            assert torch.allclose(got[a, b], torch.tensor(want, dtype=torch.float64), atol=1e-12)
    if nc:  # each compressed block distributes exactly l/d of weight over the selection blocks
        one = map_to_selection_blocks(torch.ones(nc, dtype=torch.float64), ns, l, d, l_sel)
        assert abs(float(one.sum()) - nc * l / d) < 1e-9


# ---------------------------------------------------------------------- scorer vs brute force
def tiny_cfg(**kw):
    base = dict(dim=8, n_heads=4, n_kv_heads=2, d_qk=4, d_v=4, l=4, d=2, l_sel=4, n_sel=3,
                window=5, backend="reference", score_chunk=1024)
    return NSAConfig(**{**base, **kw})


def brute_scores(q, k_cmp, cfg, starts):
    """[B, Hkv, T, Ns] in float64: dense per-head softmax over the visible compressed blocks
    (block fully in [doc start, t]), Eq. 9 by overlap counting, Eq. 10 sum over group heads."""
    B, Hq, T, Dk = q.shape
    Hkv, Nc = k_cmp.shape[1], k_cmp.shape[2]
    G = Hq // Hkv
    ns = -(-T // cfg.l_sel)
    out = torch.zeros(B, Hkv, T, ns, dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            for t in range(T):
                vis = [i for i in range(Nc) if i * cfg.d + cfg.l - 1 <= t and i * cfg.d >= starts[b][t]]
                if not vis:
                    continue
                s = torch.tensor([float(q[b, h, t].double() @ k_cmp[b, h // G, i].double())
                                  for i in vis]) / Dk ** 0.5
                pr = torch.softmax(s, 0).tolist()
                p = [0.0] * Nc
                for i, v in zip(vis, pr):
                    p[i] = v
                out[b, h // G, t] += torch.tensor(brute_map(p, ns, cfg.l, cfg.d, cfg.l_sel),
                                                  dtype=torch.float64)
    return out


def random_docs(B, T, rng):
    rows = []
    for _ in range(B):
        cuts = set(rng.sample(range(1, T), min(T - 1, rng.randint(0, 3)))) if T > 1 else set()
        doc, row = 0, []
        for t in range(T):
            doc += t in cuts
            row.append(doc)
        rows.append(row)
    return torch.tensor(rows)


cfg_st = st.fixed_dictionaries(dict(
    d=st.integers(1, 3), lq=st.integers(1, 3), rq=st.integers(1, 3), n_init=st.integers(0, 1),
    n_local=st.integers(0, 2), extra=st.integers(0, 2), Hkv=st.integers(1, 2), G=st.integers(1, 3)))


def make_cfg(c):
    return tiny_cfg(d=c["d"], l=c["d"] * c["lq"], l_sel=c["d"] * c["rq"], n_init=c["n_init"],
                    n_local=c["n_local"], n_sel=max(1, c["n_init"] + c["n_local"] + c["extra"]),
                    n_kv_heads=c["Hkv"], n_heads=c["Hkv"] * c["G"])


def inputs(cfg, B, T, seed, docs):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, cfg.n_heads, T, cfg.d_qk, generator=g)
    nc = cfg.num_cmp(T)
    k_cmp = torch.randn(B, cfg.n_kv_heads, nc, cfg.d_qk, generator=g)
    doc_ids = random_docs(B, T, random.Random(seed)) if docs else None
    starts = masks.doc_start(doc_ids) if docs else None
    return q, k_cmp, doc_ids, starts


@settings(max_examples=N_EX)
@given(c=cfg_st, B=st.integers(1, 2), T=st.integers(1, 30), seed=st.integers(0, 2**31),
       docs=st.booleans())
def test_block_scores_vs_brute(c, B, T, seed, docs):
    cfg = make_cfg(c)
    q, k_cmp, doc_ids, starts = inputs(cfg, B, T, seed, docs)
    st_list = starts.tolist() if docs else [[0] * T for _ in range(B)]
    got = block_scores(q, k_cmp, None, cfg, starts, 0, T)
    want = brute_scores(q, k_cmp, cfg, st_list)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), want, atol=1e-5, rtol=1e-5)


def brute_topn(scores, cfg, starts, T):
    """Forced blocks (the document's first block if n_init, the n_local most recent) first in
    index order, then valid blocks by descending score, ties to the lower index; -1 pads."""
    B, Hkv, _, ns = scores.shape
    out = torch.full((B, Hkv, T, cfg.n_sel), -1, dtype=torch.long)
    for b in range(B):
        for h in range(Hkv):
            for t in range(T):
                s0 = starts[b][t]
                valid = [j for j in range(ns) if j * cfg.l_sel <= t and (j + 1) * cfg.l_sel > s0]
                forced = [j for j in valid if (cfg.n_init and j == s0 // cfg.l_sel)
                          or t // cfg.l_sel - cfg.n_local < j <= t // cfg.l_sel]
                sc = scores[b, h, t].tolist()
                rest = sorted((j for j in valid if j not in forced), key=lambda j: (-sc[j], j))
                pick = (forced + rest)[: cfg.n_sel]
                out[b, h, t, : len(pick)] = torch.tensor(pick, dtype=torch.long)
    return out


@settings(max_examples=N_EX)
@given(c=cfg_st, B=st.integers(1, 2), T=st.integers(1, 40), seed=st.integers(0, 2**31),
       docs=st.booleans(), chunk=st.integers(1, 9))
def test_select_topn_rules(c, B, T, seed, docs, chunk):
    cfg = make_cfg(c)
    q, k_cmp, doc_ids, starts = inputs(cfg, B, T, seed, docs)
    st_list = starts.tolist() if docs else [[0] * T for _ in range(B)]
    idx = select_topn(q, k_cmp, None, cfg, starts, chunk=T)
    assert idx.shape == (B, cfg.n_kv_heads, T, cfg.n_sel) and idx.dtype == torch.long
    # the rules, brute force, on the scorer's own scores (exact ties stay ties)
    scores = block_scores(q, k_cmp, None, cfg, starts, 0, T)
    assert torch.equal(idx, brute_topn(scores, cfg, st_list, T))
    # invariants, stated directly
    for b in range(B):
        for h in range(cfg.n_kv_heads):
            for t in range(T):
                row = idx[b, h, t].tolist()
                got = [j for j in row if j >= 0]
                assert row == got + [-1] * (len(row) - len(got))  # -1 only pads the tail
                assert len(set(got)) == len(got)
                assert all(j * cfg.l_sel <= t for j in got)  # never a block after the query
                s0 = st_list[b][t]
                own = t // cfg.l_sel
                for j in range(max(0, own - cfg.n_local + 1), own + 1):
                    if (j + 1) * cfg.l_sel > s0:
                        assert j in got  # the local blocks
                if cfg.n_init:
                    assert s0 // cfg.l_sel in got  # the document's first block
    # chunked and unchunked agree exactly, with and without the backend's lse
    assert torch.equal(idx, select_topn(q, k_cmp, None, cfg, starts, chunk=chunk))
    assert torch.equal(idx, select_topn(q, k_cmp, None, tiny_cfg(**{**cfg.to_dict(),
                                                                   "score_chunk": chunk}), starts))


def test_ties_to_lower_index():
    """All-equal keys: every visible compressed block gets the same probability, so selection
    blocks with equal overlap tie; the lower indices must win."""
    cfg = tiny_cfg(l=2, d=2, l_sel=2, n_sel=3, n_init=0, n_local=0, n_heads=2, n_kv_heads=1)
    T = 20
    # small integers: every q.k is exact, so the tie is exact whatever the matmul's summation order
    # (random normal q made this flaky: blocked fp32 sums rounded differently per key)
    q = torch.randint(-2, 3, (1, 2, T, cfg.d_qk)).float()
    k_cmp = torch.ones(1, 1, cfg.num_cmp(T), cfg.d_qk)
    idx = select_topn(q, k_cmp, None, cfg)
    for t in range(T):
        n_vis = (t + 1) // 2  # compressed (= selection) blocks ending at or before t
        want = list(range(min(3, n_vis))) + [-1] * (3 - min(3, n_vis))
        if n_vis < 3 and t // 2 == n_vis:  # the query's own, incomplete block: valid, score 0
            want[n_vis] = n_vis
        assert idx[0, 0, t].tolist() == want, t


def test_no_gradient_and_lse_reuse():
    cfg = tiny_cfg()
    B, T = 2, 33
    q, k_cmp, doc_ids, starts = inputs(cfg, B, T, 5, True)
    q.requires_grad_(True)
    k_cmp.requires_grad_(True)
    idx = select_topn(q, k_cmp, None, cfg, starts)
    assert not idx.requires_grad
    # with the compressed branch's lse (what the reference backend returns) the result is equal
    from masks import compressed_causal, and_masks, document
    from nsa_flex.attention import attend_reference

    spec = and_masks(compressed_causal(cfg.l, cfg.d),
                     document(doc_ids, kv_stride=cfg.d, kv_span=cfg.l))
    v = torch.randn(B, cfg.n_kv_heads, k_cmp.shape[2], cfg.d_v)
    _, lse = attend_reference(q.detach(), k_cmp.detach(), v, spec)
    s_none = block_scores(q, k_cmp, None, cfg, starts, 0, T)
    s_lse = block_scores(q, k_cmp, lse, cfg, starts, 0, T)
    assert torch.allclose(s_none, s_lse, atol=1e-5)
    assert torch.isfinite(s_lse).all()


def test_head_order_within_group_is_irrelevant():
    """Eq. 10: the group's score is a sum over its heads, so permuting heads inside a group leaves
    the selection unchanged, while the per-group result differs between groups."""
    cfg = tiny_cfg(n_heads=6, n_kv_heads=2, n_sel=4)
    B, T = 2, 40
    q, k_cmp, doc_ids, starts = inputs(cfg, B, T, 11, False)
    idx = select_topn(q, k_cmp, None, cfg)
    perm = torch.tensor([2, 0, 1, 4, 5, 3])  # within group 0 (heads 0-2) and group 1 (3-5)
    assert torch.equal(idx, select_topn(q[:, perm], k_cmp, None, cfg))
    # moving a head to the other group does change it (the test can fail)
    swap = torch.tensor([3, 1, 2, 0, 4, 5])
    assert not torch.equal(idx, select_topn(q[:, swap], k_cmp, None, cfg))


# ---------------------------------------------------------------------- through the layer
RECORDED: list = []


def _record_topn(ctx: MaskContext):
    idx = ctx.topn()
    RECORDED.append(idx)
    return ctx.with_docs(selection(idx, ctx.cfg.l_sel))


register_mask_builder("test_record_topn", "selection", _record_topn)


def test_layer_selection_is_per_group_and_head_order_free():
    cfg = tiny_cfg(dim=12, n_heads=6, n_kv_heads=2, n_sel=4, sel_mask="test_record_topn")
    torch.manual_seed(0)
    layer = NSAAttention(cfg)
    layer.init_weights()
    with torch.no_grad():  # make the scorer's inputs non-trivial
        layer.wq.weight.normal_()
        layer.wk["cmp"].weight.normal_()
    x = torch.randn(2, 37, cfg.dim)
    doc_ids = torch.tensor([[0] * 15 + [1] * 22, [0] * 37])
    RECORDED.clear()
    y = layer(x, doc_ids)
    idx = RECORDED[-1]
    assert idx.shape == (2, cfg.n_kv_heads, 37, cfg.n_sel)  # one selection per GQA group
    # the layer's selection equals the scorer run on the layer's own q / compressed keys
    spec = layer.builders["sel"](MaskContext(cfg, 2, 37, torch.device("cpu"), doc_ids=doc_ids,
                                             topn=lambda: idx))
    assert spec.heads == cfg.n_kv_heads
    # permute the query heads inside each group (q projection rows): same selection
    G, dk = cfg.group_size, cfg.d_qk
    perm = torch.tensor([[1, 2, 0], [2, 0, 1]])
    W = layer.wq.weight.detach().view(cfg.n_kv_heads, G, dk, cfg.dim)
    Wp = torch.stack([W[h, perm[h]] for h in range(cfg.n_kv_heads)]).reshape(-1, cfg.dim)
    with torch.no_grad():
        layer.wq.weight.copy_(Wp)
    RECORDED.clear()
    layer(x, doc_ids)
    assert torch.equal(RECORDED[-1], idx)
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("cmp", ["none", "compressed_causal"])
def test_custom_selection_builder_gets_the_scorer(cmp):
    """Registry contract: a selection builder may call ctx.topn() even when the compressed branch
    is off; it gets the same top-n as the built-in "topn" builder."""
    kw = dict(dim=12, n_heads=6, n_kv_heads=2, n_sel=3, cmp_mask=cmp, win_mask="none")
    torch.manual_seed(1)
    a = NSAAttention(tiny_cfg(**kw, sel_mask="test_record_topn"))
    b = NSAAttention(tiny_cfg(**kw, sel_mask="topn"))
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 29, 12)
    doc_ids = torch.tensor([[0] * 11 + [1] * 18, [0] * 29])
    RECORDED.clear()
    torch.testing.assert_close(a(x, doc_ids), b(x, doc_ids), atol=1e-6, rtol=1e-6)
    assert len(RECORDED) == 1 and RECORDED[0].shape == (2, 2, 29, 3)


@pytest.mark.parametrize("Hkv, T, chunks", [(2, 8192, 1), (2, 32768, 2), (4, 65536, 8)])
def test_fused_scorer_chunks_fill_the_buffer(monkeypatch, Hkv, T, chunks):
    """The fused scorer's path (each chunk one scorer and one top-n launch) takes as few chunks
    as SCORE_BUFFER_MAX allows for its fp32 [B, Hkv, chunk, Ns] buffer, at most MAX_CHUNKS, and
    covers every query once: one chunk at the 125M shape (2 KV heads) at 8k, two at 32k, eight
    at the paper shape (4 KV heads) at 64k."""
    import nsa_flex.selection as S

    cfg = NSAConfig(dim=64, n_heads=4 * Hkv, n_kv_heads=Hkv, d_qk=4, d_v=4, backend="reference")
    spans = []

    def scores(q, k_cmp, lse, cfg, doc_starts, t0, t1, *shard):
        spans.append((t0, t1))
        return torch.zeros(1, Hkv, t1 - t0, 1)

    monkeypatch.setattr(S, "use_triton_scorer", lambda *a: True)
    monkeypatch.setattr(S, "block_scores", scores)
    monkeypatch.setattr(S, "topn_blocks", lambda p, *a: torch.zeros(*p.shape[:3], cfg.n_sel,
                                                                    dtype=torch.long))
    q = torch.zeros(1, 4 * Hkv, T, 1)
    idx = select_topn(q, torch.zeros(1, Hkv, (T - cfg.l) // cfg.d + 1, 1), torch.zeros(1), cfg)
    assert len(spans) == chunks and spans[0][0] == 0 and spans[-1][1] == T
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])) and idx.shape[2] == T
