"""The compact selection BlockMask (GPU path: index width P * n, kv-major lists by sort) lists
exactly the blocks of the dense-flag construction, on the kv side and the transposed q side, for
q blocks of one position and of P positions (the union of their blocks)."""

import pytest
import torch

from masks import and_masks, document, selection


def _dense(num, ind, n_cols):
    lst = torch.arange(ind.shape[-1]) < num.unsqueeze(-1)
    m = torch.zeros(*num.shape, n_cols + 1, dtype=torch.bool)
    m.scatter_(-1, torch.where(lst, ind.long(), n_cols), True)
    return m[..., :n_cols]


@pytest.mark.parametrize("P", [1, 2, 4])
@pytest.mark.parametrize("with_docs", [False, True])
@pytest.mark.parametrize("T,G,l_sel,n", [(200, 4, 16, 4), (97, 2, 32, 3), (64, 8, 16, 5)])
def test_compact_equals_flags(with_docs, T, G, l_sel, n, P):
    torch.manual_seed(T + G)
    B, H = 2, 3
    ns = -(-T // l_sel)
    idx = torch.stack([torch.randperm(ns)[: min(n, ns)] for _ in range(B * H * T)])
    idx = torch.cat([idx, idx.new_full((B * H * T, n - idx.shape[1]), -1)], 1).view(B, H, T, n)
    t = torch.arange(T).view(1, 1, T, 1)
    idx = torch.where(idx * l_sel <= t, idx, -1)
    spec = selection(idx, l_sel)
    if with_docs:
        doc = torch.zeros(B, T, dtype=torch.long)
        doc[0, T // 3:] = 1
        doc[1, T // 2:] = 2
        spec = and_masks(spec, document(doc))
    kb = 16
    any_, full = spec.block_flags(B, T, T, (P * G, kb), q_pack=G)
    bm = spec.compact(T, T, (P * G, kb), G, None, None, None, spec.mask_mod)
    nqb, nkb = any_.shape[-2:]
    assert (any_ & ~full).any() and (full.any() or P > 1)
    assert torch.equal(_dense(bm.kv_num_blocks, bm.kv_indices, nkb), any_ & ~full)
    assert torch.equal(_dense(bm.full_kv_num_blocks, bm.full_kv_indices, nkb), full)
    assert torch.equal(_dense(bm.q_num_blocks, bm.q_indices, nqb), (any_ & ~full).transpose(-1, -2))
    assert torch.equal(_dense(bm.full_q_num_blocks, bm.full_q_indices, nqb), full.transpose(-1, -2))
    # without the kv-major lists (the selected op makes its own inverse index): same q-major lists
    lean = spec.compact(T, T, (P * G, kb), G, None, None, None, spec.mask_mod, kv_major=False)
    assert lean.q_num_blocks is None and lean.full_q_indices is None
    assert torch.equal(lean.kv_indices, bm.kv_indices) and torch.equal(lean.full_kv_num_blocks, bm.full_kv_num_blocks)
    # compact width, fixed per config: n slots per position, capped at the sequence's block count
    assert bm.kv_indices.shape[-1] == P * min(n, ns) * (l_sel // kb)


def test_kv_major_csr_holds_the_transposed_lists():
    """kv_major_csr (the selected op's backward index): kv block j's CSR row, from the exclusive
    cumsum of q_num, lists exactly transpose_lists' q blocks of j, in the same order; its flat width
    is NQB * W (the q-major entries), not NKB * NQB."""
    from masks.core import kv_major_csr, transpose_lists

    torch.manual_seed(0)
    B, H, nqb, W, nkb = 2, 3, 37, 5, 11
    num = torch.randint(0, W + 1, (B, H, nqb))
    idx = torch.stack([torch.randperm(nkb)[:W] for _ in range(B * H * nqb)]).view(B, H, nqb, W)
    q_num, q_flat = kv_major_csr(num, idx, nkb)
    d_num, d_idx = transpose_lists(num, idx, nkb)
    assert torch.equal(q_num, d_num) and q_flat.shape == (B, H, nqb * W) and q_flat.dtype == torch.int32
    start = torch.cumsum(q_num, -1) - q_num
    for b in range(B):
        for h in range(H):
            for j in range(nkb):
                s, c = int(start[b, h, j]), int(q_num[b, h, j])
                assert q_flat[b, h, s:s + c].tolist() == d_idx[b, h, j, :c].tolist()
    assert int(q_num.sum()) == int(num.sum())


def test_kv_major_csr_of_a_selection_lists_the_positions_that_picked_each_block():
    """num None (the selected op's backward index): from a selection [B, H, T, n] with -1 for
    unused slots anywhere in a row, kv block j's CSR row is every position that picked j, ascending."""
    from masks.core import kv_major_csr

    torch.manual_seed(1)
    B, H, T, n, nkb = 2, 2, 29, 4, 7
    sel = torch.stack([torch.randperm(nkb)[:n] for _ in range(B * H * T)]).view(B, H, T, n)
    sel = torch.where(torch.rand(B, H, T, n) < 0.3, -1, sel)
    p_num, p_idx = kv_major_csr(None, sel, nkb)
    start = torch.cumsum(p_num, -1) - p_num
    for b in range(B):
        for h in range(H):
            for j in range(nkb):
                want = [t for t in range(T) if j in sel[b, h, t].tolist()]
                s = int(start[b, h, j])
                assert p_idx[b, h, s:s + int(p_num[b, h, j])].tolist() == want
    assert int(p_num.sum()) == int((sel >= 0).sum())
