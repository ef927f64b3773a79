"""The compressed branch's cuDNN packing on a sequence shard (context parallelism, issue 42):
`attend_compressed_sdpa` with q rows at positions q0 .. q0 + Tq - 1 and the whole sequence's
compressed keys equals the reference backend's rows q0 .. q0 + Tq - 1 of the whole sequence
(output, lse, and the gradients of q, k, v of those rows), for shards that start before l - 1,
inside a group of d positions or on its boundary, and end anywhere; on the CPU with fp32 math in
place of cuDNN, as tests/layer/test_compressed_sdpa.py. Also the route: a shard on the cudnn and
cudnn_lean plans runs the packing at its offset (the lean op takes rows as positions)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from masks.builders import compressed_causal
from masks.core import at_offset
from nsa_flex import NSAConfig
from nsa_flex.attention import CmpPacking, attend_compressed_sdpa, attend_reference, plan_branch
from nsa_flex.rules import num_cmp

pytestmark = pytest.mark.usefixtures("single_thread")


def compare_shard(T, q0, Tq, l, d, Hkv, G, seed):
    g = torch.Generator().manual_seed(seed)
    S = num_cmp(T, l, d)
    R = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    q, k, v = R(1, Hkv * G, T, 8), R(1, Hkv, S, 8), R(1, Hkv, S, 4)
    w = R(1, Hkv * G, Tq, 4)
    rows = slice(q0, q0 + Tq)
    res = []
    for shard, fn in ((True, lambda q, k, v: attend_compressed_sdpa(q, k, v, l, d, q_offset=q0)),
                      (False, lambda q, k, v: attend_reference(q, k, v, compressed_causal(l, d)))):
        leaves = [t.clone().requires_grad_(True) for t in (q[:, :, rows] if shard else q, k, v)]
        out, lse = fn(*leaves)
        if not shard:
            out, lse = out[:, :, rows], lse[:, :, rows]
        gq, gk, gv = torch.autograd.grad((out * w).sum(), leaves)
        res.append((out, lse, gq if shard else gq[:, :, rows], gk, gv))
    (out, lse, *gs), (ro, rl, *rgs) = res
    torch.testing.assert_close(out, ro)
    assert torch.equal(torch.isfinite(lse), torch.isfinite(rl))  # rows before l - 1: -inf
    seen = torch.isfinite(rl)
    torch.testing.assert_close(lse[seen], rl[seen].to(lse.dtype))  # no row sees a block: fp32
    for a, b in zip(gs, rgs):
        torch.testing.assert_close(a, b)


@settings(deadline=None, max_examples=60)
@given(l_over_d=st.integers(1, 3), d=st.sampled_from([1, 2, 4, 16]), T=st.integers(1, 90),
       a=st.floats(0, 1), b=st.floats(0, 1), Hkv=st.integers(1, 2), G=st.sampled_from([1, 3]),
       seed=st.integers(0, 2**16))
def test_shard_equals_the_whole_sequence_rows(l_over_d, d, T, a, b, Hkv, G, seed):
    l = l_over_d * d
    T = l + T
    q0 = int(a * (T - 1))
    Tq = 1 + int(b * (T - q0 - 1))
    compare_shard(T, q0, Tq, l, d, Hkv, G, seed)


@pytest.mark.parametrize("q0,Tq", [(0, 512), (512, 512), (1024, 512), (500, 37), (31, 16)])
def test_shard_paper_blocks(q0, Tq):
    """l = 32, d = 16: the shards of 2 and 3 ranks, and ones not on a group boundary."""
    compare_shard(1536, q0, Tq, 32, 16, 2, 2, q0)


def test_packing_of_a_shard():
    """Groups of positions l - 1 + m d .. (l = 8, d = 4: group m starts at 7 + 4 m)."""
    assert CmpPacking.of(64, 8, 4) == CmpPacking(skip=7, g0=0, lead=0, M=15)
    assert CmpPacking.of(32, 8, 4, 32) == CmpPacking(skip=0, g0=6, lead=1, M=9)  # groups at 31, 35, ..
    assert CmpPacking.of(32, 8, 4, 35) == CmpPacking(skip=0, g0=7, lead=0, M=8)
    assert CmpPacking.of(4, 8, 4, 2) == CmpPacking(skip=4, g0=0, lead=0, M=0)  # sees nothing


def test_a_shard_on_the_cudnn_plans_runs_the_packing_at_its_offset(monkeypatch):
    import nsa_flex.attention as A

    calls = []
    monkeypatch.setattr(A, "compressed_sdpa_unsupported", lambda q, v: None)
    monkeypatch.setattr(A, "attend_compressed_sdpa", lambda *a: calls.append(("traced", a[-1])))
    monkeypatch.setattr(A, "attend_compressed_lean", lambda *a: calls.append(("lean", 0)))
    monkeypatch.setattr(A, "attend_flex", lambda *a: calls.append(("flex", 0)))
    cfg = dict(dim=16, n_heads=4, n_kv_heads=2, d_qk=8, d_v=8, l=8, d=4, l_sel=16, n_sel=3,
               window=12, backend="flex")
    q, k, v = torch.randn(1, 4, 32, 8), torch.randn(1, 2, 15, 8), torch.randn(1, 2, 15, 8)
    for kernel in ("cudnn", "cudnn_lean"):
        plan = plan_branch(NSAConfig(**cfg, cmp_kernel=kernel), "compressed_causal")
        for q0 in (0, 32):
            plan.attend(q, k, v, at_offset(compressed_causal(8, 4), q0))
    assert calls == [("traced", 0), ("traced", 32), ("lean", 0), ("traced", 32)]


@pytest.mark.gpu
@pytest.mark.parametrize("q0", [0, 2048, 2040])
def test_cuda_shard_bf16_on_cudnn_matches_reference(q0):
    """cuDNN's packing of a shard in bf16 at the paper's blocks and the 125M heads (G = 8, d 64)
    against the fp32 reference of the whole sequence's rows."""
    T, Tq, l, d = 4096, 2048, 32, 16
    g = torch.Generator(device="cuda").manual_seed(q0)
    S = num_cmp(T, l, d)
    q, k, v = (torch.randn(*s, generator=g, device="cuda") for s in
               ((1, 16, T, 64), (1, 2, S, 64), (1, 2, S, 64)))
    rows = slice(q0, q0 + Tq)
    w = torch.randn(1, 16, Tq, 64, generator=g, device="cuda")
    res = []
    for shard in (True, False):
        leaves = [t.clone().to(torch.bfloat16 if shard else torch.float32).requires_grad_(True)
                  for t in (q[:, :, rows] if shard else q, k, v)]
        out, _ = (attend_compressed_sdpa(*leaves, l, d, q_offset=q0) if shard else
                  attend_reference(*leaves, compressed_causal(l, d)))
        out = out if shard else out[:, :, rows]
        gq, gk, gv = torch.autograd.grad((out.float() * w).sum(), leaves)
        res.append([out.float(), (gq if shard else gq[:, :, rows]).float(), gk.float(), gv.float()])
    for a, b in zip(*res):
        assert ((a - b).norm() / b.norm()).item() <= 2e-2


def test_shard_gradients_need_no_gradient_of_the_parts_lse(monkeypatch):
    """cuDNN's lse output has no gradient: the shard's merge of its unmasked and causal parts must
    not differentiate through it (each part's backward runs from the merged output and lse).
    Here the CPU twin of the causal call returns its lse detached, as cuDNN does."""
    import nsa_flex.attention as A

    real = A._sdpa_lse
    monkeypatch.setattr(A, "_sdpa_lse", lambda *a, **k: (lambda o, s: (o, s.detach()))(*real(*a, **k)))
    compare_shard(160, 64, 64, 32, 16, 2, 2, 7)  # g0 > 0: the prefix and the causal part
