"""The Triton top-n kernel (`nsa_flex.ops.topn_blocks`) compiles for an H100 with the launch
arguments its wrapper passes, at the row widths of 16k, 64k and 128k tokens (Ns = 256, 1024,
2048 selection blocks of 64), with and without documents, quickly (no unrolled per-row work).
Its results are checked against `masks.pick_blocks` under the interpreter
(tests/ops/test_scorer_triton.py) and on CUDA."""

import time

import pytest
import torch

from nsa_flex.ops import HAS_TRITON, triton_interpreted


@pytest.mark.skipif(not HAS_TRITON or triton_interpreted(), reason="needs triton, not interpreted")
@pytest.mark.parametrize("T", [16384, 65536, 131072])
@pytest.mark.parametrize("docs", [False, True])
def test_topn_compiles_for_h100(monkeypatch, T, docs):
    from tests.ops.triton_harness import Launches, compile_for_h100, cuda_compiler

    cuda_compiler()
    import nsa_flex.ops.topn_triton as M

    calls = Launches()
    monkeypatch.setattr(M, "wrap_triton", calls.wrap)
    ns = T // 64
    scores = torch.rand(1, 4, 8, ns)  # 8 rows stand in for a chunk: the launch is the same
    starts = torch.zeros(1, T, dtype=torch.int64) if docs else None
    M.topn_blocks._init_fn(scores, starts, T - 8, 64, 16, 1, 2)
    assert len(calls) == 1
    t0 = time.perf_counter()
    compile_for_h100(*calls[0])
    assert time.perf_counter() - t0 < 60
