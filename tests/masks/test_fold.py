"""Query folding (masks.core.fold_block_mask, attention._flex_folded): queries split into C batch
chunks give a BlockMask whose block lists are exactly the original's rows of each chunk (kv side
and the transposed q side), whose mask_mod is the original's at the shifted row, and attention
through it equals attention without folding."""

import pytest
import torch

from masks import and_masks, causal, compressed_causal, document, selection
from masks.core import fold_block_mask
from nsa_flex.attention import attend_flex, attend_reference
from nsa_flex.kernel_options import query_chunks

from tests.masks.test_compact_blockmask import _dense


def _sel_idx(B, H, T, l_sel, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    ns = -(-T // l_sel)
    idx = torch.stack([torch.randperm(ns, generator=g)[: min(n, ns)] for _ in range(B * H * T)])
    idx = torch.cat([idx, idx.new_full((B * H * T, n - idx.shape[1]), -1)], 1).view(B, H, T, n)
    t = torch.arange(T).view(1, 1, T, 1)
    return torch.where(idx * l_sel <= t, idx, -1)


def _check_fold(bm, C, B):
    fb = fold_block_mask(bm, C, B)
    Q, KV = bm.seq_lengths
    nkb = -(-KV // bm.BLOCK_SIZE[1])
    nqb = bm.kv_num_blocks.shape[-1]
    H = bm.kv_num_blocks.shape[1]
    for kind in ("", "full_"):
        num, idx = getattr(bm, f"{kind}kv_num_blocks"), getattr(bm, f"{kind}kv_indices")
        d = _dense(num, idx, nkb).expand(B, H, nqb, nkb)
        d = d.reshape(B, H, C, nqb // C, nkb).transpose(1, 2).reshape(B * C, H, nqb // C, nkb)
        fnum, fidx = getattr(fb, f"{kind}kv_num_blocks"), getattr(fb, f"{kind}kv_indices")
        assert torch.equal(_dense(fnum, fidx, nkb), d)
        qnum, qidx = getattr(fb, f"{kind}q_num_blocks"), getattr(fb, f"{kind}q_indices")
        assert torch.equal(_dense(qnum, qidx, nqb // C), d.transpose(-1, -2))
    assert fb.seq_lengths == (Q // C, KV)
    # the folded mask_mod is the original at the shifted row
    b = torch.arange(B * C).view(-1, 1, 1, 1)
    h = torch.arange(H).view(1, -1, 1, 1)
    q = torch.arange(Q // C).view(1, 1, -1, 1)
    kv = torch.arange(KV).view(1, 1, 1, -1)
    want = bm.mask_mod(b // C, h, (b % C) * (Q // C) + q, kv)
    assert torch.equal(fb.mask_mod(b, h, q, kv), want)
    assert want.any() and not want.all()
    return fb


@pytest.mark.parametrize("C", [2, 4])
def test_fold_band_mask(C):
    B, T, l, d = 2, 512, 32, 16
    S = (T - l) // d + 1
    spec = and_masks(compressed_causal(l, d), document(torch.tensor([[0] * 300 + [1] * 212,
                                                                     [0] * 512])))
    bm = spec.block_mask(B, T, S, block_size=64)
    _check_fold(bm, C, B)


@pytest.mark.parametrize("C", [2, 4])
def test_fold_compact_selection(C):
    B, H, T, G, l_sel, n = 2, 2, 256, 4, 16, 4
    spec = selection(_sel_idx(B, H, T, l_sel, n), l_sel)
    bm = spec.compact(T, T, (G, 16), G, None, None, None, spec.mask_mod)
    fb = _check_fold(bm, C, B)
    assert fb.kv_indices.shape[-1] == bm.kv_indices.shape[-1]  # compact width kept


def test_fold_rejects_partial_blocks():
    bm = causal().block_mask(1, 256, 256, block_size=64)
    with pytest.raises(ValueError, match="cannot fold 256 query rows into 8 chunks"):
        fold_block_mask(bm, 8, 1)


@pytest.mark.parametrize("which", ["compressed", "selection"])
def test_folded_flex_equals_unfolded_and_reference(which):
    torch.manual_seed(0)
    B, Hq, Hkv, T, D = 1, 4, 2, 512, 16
    q = torch.randn(B, Hq, T, D)
    if which == "compressed":
        l, d = 32, 16
        S = (T - l) // d + 1
        spec = compressed_causal(l, d)
    else:
        S = T
        spec = selection(_sel_idx(B, Hkv, T, 64, 3, seed=1), 64)
    k, v = torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    ref, _ = attend_reference(q, k, v, spec)
    o1, _ = attend_flex(q, k, v, spec, q_chunks=1)
    o4, _ = attend_flex(q, k, v, spec, q_chunks=4)
    torch.testing.assert_close(o4, o1, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(o4, ref, atol=1e-4, rtol=1e-4)


def test_query_chunks_heuristic():
    qc = lambda *a, **k: query_chunks(*a, max_chunks=16, **k)  # noqa: E731
    assert qc(65536, 128, "cpu", kv_len=4095) == 1  # CPU: never
    assert qc(65536, 128, "cuda", kv_len=4095) == 16  # compressed keys at 64k
    assert qc(65536, 128, "cuda", kv_len=65536) == 1  # window / causal: no
    assert qc(65536 * 16, 16, "cuda", per_group=True) == 16  # selection, G=16
    assert qc(8192, 128, "cuda", kv_len=511) == 2
    assert qc(4096, 128, "cuda", kv_len=255) == 1
    assert query_chunks(65536, 128, "cuda", kv_len=4095) == 1  # default: off


@pytest.mark.parametrize("B", [1, 2])
def test_fold_kv_is_a_real_copy(B):
    from nsa_flex.attention import _fold_kv
    k = torch.randn(B, 2, 8, 4)
    f = _fold_kv(k, 4)
    assert f.shape == (B * 4, 2, 8, 4) and f.is_contiguous() and f.stride(0) == 2 * 8 * 4
    assert torch.equal(f.view(B, 4, 2, 8, 4)[:, 3], k)
