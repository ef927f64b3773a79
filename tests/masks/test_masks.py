"""Mask builders: each dense mask against a brute-force per-element definition written here in
plain Python loops, each BlockMask against its dense mask (every True element lies in a listed
block; full blocks are all True), the selection mask also in the packed layout (q_pack = group
size) and with documents; the registry and presets."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import masks
from masks import (PRESETS, MaskContext, and_masks, causal, compressed_causal, document,
                   get_mask_builder, list_mask_builders, register_mask_builder, selection,
                   sliding_window)
from nsa_flex import NSAConfig

pytestmark = pytest.mark.usefixtures("single_thread")

N_EX = max(40, settings.default.max_examples // 4)


# ---------------------------------------------------------------------- brute force (loops)
def doc_lists(doc_ids, B, T):
    return [[0] * T for _ in range(B)] if doc_ids is None else doc_ids.tolist()


def brute_causal(B, T, S, doc_ids=None):
    docs = doc_lists(doc_ids, B, T)
    return [[[kv <= q and docs[b][kv] == docs[b][q] for kv in range(S)] for q in range(T)]
            for b in range(B)]


def brute_window(B, T, S, w, doc_ids=None):
    docs = doc_lists(doc_ids, B, T)
    return [[[kv <= q and q - kv < w and docs[b][kv] == docs[b][q] for kv in range(S)]
             for q in range(T)] for b in range(B)]


def brute_compressed(B, T, S, l, d, doc_ids=None):
    """kv index i = compressed block of tokens i*d .. i*d+l-1: visible when it ends at or before
    the query and all of its tokens lie in the query's document."""
    docs = doc_lists(doc_ids, B, T)
    out = []
    for b in range(B):
        rows = []
        for q in range(T):
            row = []
            for i in range(S):
                toks = range(i * d, i * d + l)
                row.append(all(tok <= q and docs[b][tok] == docs[b][q] for tok in toks))
            rows.append(row)
        out.append(rows)
    return out


def brute_selection(sel_idx, l_sel, S, doc_ids=None):
    """[B][H][T][S]: key s visible to (b, h, t) when s <= t and block s // l_sel is selected."""
    B, H, T, n = sel_idx.shape
    sel = sel_idx.tolist()
    docs = doc_lists(doc_ids, B, T)
    return [[[[s <= t and (s // l_sel) in [j for j in sel[b][h][t] if j >= 0]
               and docs[b][s] == docs[b][t] for s in range(S)] for t in range(T)]
             for h in range(H)] for b in range(B)]


def as_tensor4(x):  # [B][T][S] -> [B, 1, T, S] or [B][H][T][S] -> [B, H, T, S]
    t = torch.tensor(x, dtype=torch.bool)
    return t.unsqueeze(1) if t.dim() == 3 else t


# ---------------------------------------------------------------------- block mask checks
def check_block_mask(bm, dense_rows, exact=False):
    """bm against the dense mask of its (packed) layout, dense_rows [B, H, R, S].

    Every True element lies in a listed (partial or full) block; every full block is all True
    and lies inside the lengths; partial and full lists are disjoint; the BlockMask's mask_mod
    describes the whole mask. With exact=True listed blocks are exactly the non-empty ones."""
    B, H, R, S = dense_rows.shape
    QB, KB = bm.BLOCK_SIZE
    assert bm.seq_lengths == (R, S)
    Bm, Hm, nqb = bm.kv_num_blocks.shape
    assert Bm in (1, B) and Hm in (1, H)
    assert nqb == -(-R // QB)
    nkb = -(-S // KB)
    kv_num, kv_idx = bm.kv_num_blocks.tolist(), bm.kv_indices.tolist()
    f_num, f_idx = bm.full_kv_num_blocks.tolist(), bm.full_kv_indices.tolist()
    for b in range(B):
        for h in range(H):
            bb, hh = b % Bm, h % Hm
            for qb in range(nqb):
                part = kv_idx[bb][hh][qb][: kv_num[bb][hh][qb]]
                full = f_idx[bb][hh][qb][: f_num[bb][hh][qb]]
                assert len(set(part)) == len(part) and len(set(full)) == len(full)
                assert not set(part) & set(full)
                assert all(0 <= k < nkb for k in part + full)
                rows = dense_rows[b, h, qb * QB:(qb + 1) * QB]
                for kb in range(nkb):
                    blk = rows[:, kb * KB:(kb + 1) * KB]
                    if kb in full:
                        assert blk.shape == (QB, KB) and bool(blk.all()), (b, h, qb, kb)
                    elif kb not in part:
                        assert not bool(blk.any()), ("unlisted block has True", b, h, qb, kb)
                    elif exact:
                        assert bool(blk.any()), ("listed block is empty", b, h, qb, kb)
    # mask_mod describes the whole mask (eager flex and partial blocks use it)
    bi = torch.arange(B).view(B, 1, 1, 1)
    hi = torch.arange(H).view(1, H, 1, 1)
    qi = torch.arange(R).view(1, 1, R, 1)
    ki = torch.arange(S).view(1, 1, 1, S)
    mm = bm.mask_mod(bi, hi, qi, ki).expand(B, H, R, S)
    assert torch.equal(mm, dense_rows)


def random_docs(B, T, rng, max_docs=4):
    rows = []
    for _ in range(B):
        cuts = sorted(rng.sample(range(1, T), min(T - 1, rng.randint(0, max_docs - 1)))) if T > 1 else []
        row, doc = [], 0
        for t in range(T):
            if t in cuts:
                doc += rng.randint(1, 3)  # ids need not be consecutive, only non-decreasing
            row.append(doc)
        rows.append(row)
    return torch.tensor(rows)


def random_sel_idx(B, H, T, n, l_sel, rng, dups=False):
    """Arbitrary (not scorer-made) selections: any blocks, possibly after the query, -1 pads;
    with dups=True a row may list a block more than once (a custom builder may do that)."""
    ns = -(-T // l_sel)
    out = torch.full((B, H, T, n), -1, dtype=torch.long)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                k = rng.randint(0, min(n, ns))
                pick = [rng.randrange(ns) for _ in range(k)] if dups else rng.sample(range(ns), k)
                out[b, h, t, :k] = torch.tensor(pick, dtype=torch.long)
    return out


# ---------------------------------------------------------------------- dense vs brute force
@settings(max_examples=N_EX)
@given(B=st.integers(1, 2), T=st.integers(1, 29), w=st.integers(1, 33), seed=st.integers(0, 2**31),
       docs=st.booleans())
def test_token_masks_dense_vs_brute(B, T, w, seed, docs):
    rng = random.Random(seed)
    doc_ids = random_docs(B, T, rng) if docs else None
    wrap = (lambda s: and_masks(s, document(doc_ids))) if docs else (lambda s: s)
    for spec, ref in [(causal(), brute_causal(B, T, T, doc_ids)),
                      (sliding_window(w), brute_window(B, T, T, w, doc_ids))]:
        spec = wrap(spec)
        dense = spec.dense(B, T, T)
        assert dense.dtype == torch.bool and dense.shape == (B, 1, T, T)
        assert torch.equal(dense, as_tensor4(ref).expand(B, 1, T, T))
        assert not dense.triu(1).any()  # strictly causal


@settings(max_examples=N_EX)
@given(B=st.integers(1, 2), T=st.integers(1, 40), dq=st.integers(1, 4), lq=st.integers(1, 4),
       seed=st.integers(0, 2**31), docs=st.booleans())
def test_compressed_dense_vs_brute(B, T, dq, lq, seed, docs):
    d, l = dq, dq * lq
    S = 0 if T < l else (T - l) // d + 1
    rng = random.Random(seed)
    doc_ids = random_docs(B, T, rng) if docs else None
    spec = compressed_causal(l, d)
    if docs:
        spec = and_masks(spec, document(doc_ids, kv_stride=d, kv_span=l))
    if S == 0:
        return
    dense = spec.dense(B, T, S)
    assert torch.equal(dense, as_tensor4(brute_compressed(B, T, S, l, d, doc_ids)).expand(B, 1, T, S))


@settings(max_examples=N_EX)
@given(B=st.integers(1, 2), H=st.integers(1, 3), T=st.integers(1, 40), n=st.integers(1, 4),
       l_sel=st.sampled_from([2, 3, 4, 8]), seed=st.integers(0, 2**31), docs=st.booleans())
def test_selection_dense_vs_brute(B, H, T, n, l_sel, seed, docs):
    rng = random.Random(seed)
    sel = random_sel_idx(B, H, T, n, l_sel, rng)
    doc_ids = random_docs(B, T, rng) if docs else None
    spec = selection(sel, l_sel)
    if docs:
        spec = and_masks(spec, document(doc_ids))
    assert spec.per_group and spec.heads == H
    dense = spec.dense(B, T, T)
    assert torch.equal(dense, as_tensor4(brute_selection(sel, l_sel, T, doc_ids)))


# ---------------------------------------------------------------------- BlockMask vs dense
@settings(max_examples=N_EX)
@given(B=st.integers(1, 2), T=st.integers(1, 45), w=st.integers(1, 20),
       bs=st.sampled_from([(4, 4), (8, 4), (4, 8), (16, 16), (3, 5), (128, 128)]),
       seed=st.integers(0, 2**31), docs=st.booleans())
def test_band_block_masks_vs_dense(B, T, w, bs, seed, docs):
    rng = random.Random(seed)
    doc_ids = random_docs(B, T, rng) if docs else None
    specs = [causal(), sliding_window(w)]
    if docs:
        specs = [and_masks(s, document(doc_ids)) for s in specs]
    for spec in specs:
        bm = spec.block_mask(B, T, T, block_size=bs)
        check_block_mask(bm, spec.dense(B, T, T), exact=True)


@settings(max_examples=N_EX)
@given(B=st.integers(1, 2), T=st.integers(1, 60), dq=st.integers(1, 4), lq=st.integers(1, 3),
       bs=st.sampled_from([(4, 2), (8, 4), (16, 16), (5, 3), (128, 128)]),
       seed=st.integers(0, 2**31), docs=st.booleans())
def test_compressed_block_mask_vs_dense(B, T, dq, lq, bs, seed, docs):
    d, l = dq, dq * lq
    S = 0 if T < l else (T - l) // d + 1
    if S == 0:
        return
    rng = random.Random(seed)
    doc_ids = random_docs(B, T, rng) if docs else None
    spec = compressed_causal(l, d)
    if docs:
        spec = and_masks(spec, document(doc_ids, kv_stride=d, kv_span=l))
    check_block_mask(spec.block_mask(B, T, S, block_size=bs), spec.dense(B, T, S), exact=True)


@settings(max_examples=N_EX)
@given(B=st.integers(1, 2), Hkv=st.integers(1, 2), G=st.sampled_from([1, 2, 3, 4]),
       T=st.integers(1, 40), n=st.integers(1, 4), l_sel=st.sampled_from([4, 8]),
       kb=st.sampled_from([4, 2]), P=st.sampled_from([1, 2, 3]), seed=st.integers(0, 2**31),
       docs=st.booleans(), dups=st.booleans())
def test_selection_block_mask_packed_vs_dense(B, Hkv, G, T, n, l_sel, kb, P, seed, docs, dups):
    """Packed layout: row r = token r // G (one row per head of the group), q block = P*G rows."""
    rng = random.Random(seed)
    sel = random_sel_idx(B, Hkv, T, n, l_sel, rng, dups)
    doc_ids = random_docs(B, T, rng) if docs else None
    spec = selection(sel, l_sel)
    if docs:
        spec = and_masks(spec, document(doc_ids))
    bm = spec.block_mask(B, T, T, block_size=(P * G, kb), q_pack=G)
    assert bm.kv_num_blocks.shape[:2] == (B, Hkv)
    packed = spec.dense(B, T, T).repeat_interleave(G, dim=2)  # [B, Hkv, T*G, S]
    check_block_mask(bm, packed, exact=True)
    # the compact construction (GPU path: P whole positions per q block), built here on CPU
    assert spec.compact is not None
    cbm = spec.compact(T, T, (P * G, kb), G, None, None, None, spec.mask_mod)
    check_block_mask(cbm, packed, exact=True)


def test_selection_duplicate_index_is_not_a_full_block():
    """Regression: position 8 lists block 1 twice, position 9 never; the q block holding both
    must not mark block 1 full (compiled flex would skip the mask_mod and let 9 see it)."""
    T, l_sel = 16, 4
    sel = torch.full((1, 1, T, 2), -1)
    sel[0, 0, 8] = torch.tensor([1, 1])
    sel[0, 0, 9] = torch.tensor([2, -1])
    spec = selection(sel, l_sel)
    bm = spec.block_mask(1, T, T, block_size=(2, 4))
    assert 1 not in bm.full_kv_indices[0, 0, 4, : bm.full_kv_num_blocks[0, 0, 4]].tolist()
    check_block_mask(bm, spec.dense(1, T, T), exact=True)
    # compact lists (one position per q block) must not list block 1 twice for position 8
    cbm = spec.compact(T, T, (1, 4), 1, None, None, None, spec.mask_mod)
    check_block_mask(cbm, spec.dense(1, T, T), exact=True)


def test_selection_block_mask_rejects_bad_block_sizes():
    sel = torch.zeros(1, 1, 8, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="multiple of the kv block size"):
        selection(sel, 6).block_mask(1, 8, 8, block_size=(4, 4))
    with pytest.raises(ValueError, match="multiple of the packing"):
        selection(sel, 4).block_mask(1, 8, 8, block_size=(3, 4), q_pack=2)


def test_layer_style_block_sizes_selection_full_blocks():
    """With kv block = l_sel (the flex backend's choice) every selected block strictly before the
    query's own block is a *full* block: only the query's own block runs the mask_mod."""
    T, l_sel, G = 40, 8, 2
    sel = torch.tensor([[[[t // l_sel, 0 if t >= l_sel else -1] for t in range(T)]]])
    bm = selection(sel, l_sel).block_mask(1, T, T, block_size=(G, l_sel), q_pack=G)
    for t in range(T):
        full = set(bm.full_kv_indices[0, 0, t, : bm.full_kv_num_blocks[0, 0, t]].tolist())
        part = set(bm.kv_indices[0, 0, t, : bm.kv_num_blocks[0, 0, t]].tolist())
        own = t // l_sel
        expect_full = {0} if own > 0 else set()
        if t % l_sel == l_sel - 1:
            expect_full |= {own}
        assert full == expect_full, t
        assert part == {own} - expect_full, t


# ---------------------------------------------------------------------- registry and builders
CFG = dict(dim=8, n_heads=4, n_kv_heads=2, d_qk=4, d_v=4, l=4, d=2, l_sel=4, n_sel=3,
           window=5, backend="reference")


def _builtin(names):  # other test modules register their own builders ("test_*")
    return {n for n in names if not n.startswith("test_")}


def test_registry_names_and_kinds():
    assert _builtin(list_mask_builders()) == {"none", "causal", "sliding_window",
                                              "compressed_causal", "topn", "random_selection",
                                              "local_selection"}
    assert _builtin(list_mask_builders("compressed")) == {"compressed_causal", "none"}
    assert _builtin(list_mask_builders("token")) == {"none", "causal", "sliding_window"}
    assert _builtin(list_mask_builders("selection")) == {"none", "causal", "sliding_window",
                                                         "topn", "random_selection",
                                                         "local_selection"}
    assert set(PRESETS) >= {"nsa", "full_causal", "sliding_only", "random_selection",
                            "local_selection"}
    assert PRESETS["nsa"] == ("compressed_causal", "topn", "sliding_window")
    for cmp, sel, win in PRESETS.values():
        assert cmp in list_mask_builders("compressed")
        assert sel in list_mask_builders("selection")
        assert win in list_mask_builders("token")
    with pytest.raises(KeyError, match="unknown mask builder 'nope'"):
        get_mask_builder("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_mask_builder("causal", "token", lambda ctx: None)
    with pytest.raises(ValueError, match="kind="):
        register_mask_builder("test_bad_kind", "weird", lambda ctx: None)
    assert get_mask_builder("none")(MaskContext(NSAConfig(**CFG), 1, 4, "cpu")) is None


def _ctx(cfg, B, T, doc_ids, topn=None):
    return MaskContext(cfg, B, T, torch.device("cpu"), doc_ids=doc_ids, topn=topn)


@pytest.mark.parametrize("docs", [False, True])
def test_registered_builders_vs_brute(docs):
    rng = random.Random(3)
    B, T = 2, 23
    cfg = NSAConfig(**CFG)
    doc_ids = torch.tensor([[0] * 9 + [1] * 14, [5] * 23]) if docs else None
    fixed = random_sel_idx(B, cfg.n_kv_heads, T, cfg.n_sel, cfg.l_sel, rng)
    ctx = _ctx(cfg, B, T, doc_ids, topn=lambda: fixed)
    S = cfg.num_cmp(T)
    cases = {
        "causal": (T, brute_causal(B, T, T, doc_ids)),
        "sliding_window": (T, brute_window(B, T, T, cfg.window, doc_ids)),
        "compressed_causal": (S, brute_compressed(B, T, S, cfg.l, cfg.d, doc_ids)),
        "topn": (T, brute_selection(fixed, cfg.l_sel, T, doc_ids)),
    }
    for name, (kv_len, ref) in cases.items():
        spec = get_mask_builder(name)(ctx)
        dense = spec.dense(B, T, kv_len)
        ref = as_tensor4(ref)
        assert torch.equal(dense, ref.expand_as(dense)), name


@pytest.mark.parametrize("name", ["random_selection", "local_selection"])
@pytest.mark.parametrize("docs", [False, True])
def test_data_free_selection_builders(name, docs):
    """random_selection / local_selection: causal, forced blocks present, the right count of
    blocks; local_selection takes the most recent valid blocks; random is reproducible per step
    and changes with the step."""
    B, T = 2, 37
    cfg = NSAConfig(**{**CFG, "n_sel": 4})
    doc_ids = torch.tensor([[0] * 14 + [1] * 23, [2] * 37]) if docs else None
    starts = masks.doc_start(doc_ids) if docs else torch.zeros(B, T, dtype=torch.long)
    spec = get_mask_builder(name)(MaskContext(cfg, B, T, torch.device("cpu"), doc_ids=doc_ids,
                                              step=torch.tensor(7)))
    dense = spec.dense(B, T, T)
    assert dense.shape == (B, cfg.n_kv_heads, T, T) and not dense.triu(1).any()
    ls = cfg.l_sel
    for b in range(B):
        for h in range(cfg.n_kv_heads):
            for t in range(T):
                s0 = int(starts[b, t])
                vis = [s for s in range(T) if dense[b, h, t, s]]
                blocks = {s // ls for s in vis}
                valid = [j for j in range(-(-T // ls)) if j * ls <= t and (j + 1) * ls - 1 >= s0]
                forced = {j for j in valid if j == s0 // ls or t // ls - cfg.n_local < j <= t // ls}
                assert forced <= blocks
                assert blocks <= set(valid)
                assert len(blocks) == min(cfg.n_sel, len(valid))
                # visible keys: exactly the document's tokens <= t of the chosen blocks
                assert vis == [s for s in range(s0, t + 1) if s // ls in blocks]
                if name == "local_selection":  # forced, then the most recent others
                    others = [j for j in valid if j not in forced]
                    k = cfg.n_sel - len(forced)
                    assert blocks == forced | set(others[len(others) - k:] if k else [])
    if name == "random_selection":
        again = get_mask_builder(name)(MaskContext(cfg, B, T, torch.device("cpu"), doc_ids=doc_ids,
                                                   step=torch.tensor(7))).dense(B, T, T)
        other = get_mask_builder(name)(MaskContext(cfg, B, T, torch.device("cpu"), doc_ids=doc_ids,
                                                   step=torch.tensor(8))).dense(B, T, T)
        assert torch.equal(dense, again)
        assert not torch.equal(dense, other)
