"""block_mask_from_flags builds kv- and q-major block lists without a sort (cumsum + scatter);
they must equal what a stable sort / torch's from_kv_blocks gives."""

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask

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
