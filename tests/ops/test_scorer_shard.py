"""The Triton scorer and top-n on a sequence shard (context parallelism, issue 42): q rows at
positions q0 .. q0 + Tq - 1, the whole sequence's compressed keys, document starts and lse rows of
the shard. Under Triton's interpreter (a subprocess, as tests/ops/test_scorer_triton.py) the
shard's scores equal the torch scorer's on the whole sequence's rows, and its picks equal them
exactly (the int64 top-n key: ties, here many from query rows of zeros, break identically);
offsets 0 (fewer queries than keys), inside and at the end of a selection block, documents
crossing q0, several score chunks.
"""

import pytest
import torch

from nsa_flex.ops import HAS_TRITON, triton_interpreted
from nsa_flex.selection import block_scores, select_topn
from tests.ops.test_scorer_triton import case_inputs, make_cfg


def check_shard(q0: int, Tq: int, T: int, docs, seed: int, chunk: int = 1024):
    kw = dict(l=8, d=4, l_sel=16, n_heads=8, n_kv_heads=2, d_qk=24, n_sel=3, n_local=1,
              score_chunk=chunk)
    ref, tri = make_cfg("torch", **kw), make_cfg("triton", **kw)
    q, k, lse, starts = case_inputs(ref, 2, T, docs, seed)
    q[:, :, q0 + Tq // 3: q0 + Tq // 2] = 0  # rows of equal scores (ties); the same lse for both
    rows = slice(q0, q0 + Tq)
    qs, ls = q[:, :, rows], lse[:, :, rows]
    shard = dict(q_offset=q0, seq_len=T)
    want = block_scores(q, k, lse, ref, starts, q0, q0 + Tq)
    got = block_scores(qs, k, ls, tri, starts, 0, Tq, **shard)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(block_scores(qs, k, ls, ref, starts, 0, Tq, **shard), want)
    whole = select_topn(q, k, lse, ref, starts)[:, :, rows]
    assert torch.equal(select_topn(qs, k, ls, tri, starts, **shard), whole), (q0, Tq, T)
    assert torch.equal(select_topn(qs, k, ls, ref, starts, **shard), whole), (q0, Tq, T)


def _interpreter_main():
    torch.set_num_threads(1)
    assert triton_interpreted(), "run with TRITON_INTERPRET=1"
    cases = [(0, 32, 64, False, 1), (32, 32, 64, [20, 40], 2), (21, 27, 48, [25], 3),
             (40, 24, 96, True, 4), (48, 48, 96, [50, 70], 5, 16)]
    for c in cases:
        check_shard(*c)
    print(f"OK {len(cases)} shards")


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")
def test_shard_scores_and_picks_match_whole_sequence_under_interpreter():
    from tests.ops.triton_harness import assert_interpreted_ok

    assert_interpreted_ok(__file__, "OK 5 shards", timeout=300)


if __name__ == "__main__":
    _interpreter_main()
