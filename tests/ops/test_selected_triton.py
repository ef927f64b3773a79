"""The selected-attention op (`nsa_flex.ops.selected_attention`) against the reference backend.

On the CPU the kernels run under Triton's interpreter in a subprocess (TRITON_INTERPRET=1 must be
set before triton decorates them): forward, lse and every gradient (also through lse) equal the
dense reference on random selections, with and without documents, for G in {1, 2, 4, 8, 16}, head
dims that split into two dots (48 = 32 + 16) or pad, ragged T, and both dK/dV paths (one program
per kv block, and the most-read blocks split into shares); and a hypothesis property: no output or
gradient at position t depends on a key after t, or outside its document; with several positions
per q block (the union of their blocks) and other tunings (`SelectedTuning`: rows, dQ by atomics
or its own pass, the hybrid dQ rule). The kernels also compile
for an H100 (sm_90) with the launch arguments the wrappers pass (fp64-typed scalars, as Inductor
passes them). On CUDA (`gpu`): the same comparisons in bf16 and fp32 at the paper and 125M shapes.
"""

import dataclasses
import random

import pytest
import torch

from masks import MaskContext, get_mask_builder
from masks.builders import doc_start
from nsa_flex.attention import BranchPlan, attend_reference, plan_branch
from nsa_flex.config import NSAConfig
from nsa_flex.ops import DEFAULT_TUNING, HAS_TRITON, SelectedTuning, triton_interpreted
from nsa_flex.rules import random_topn


def make_case(rng: random.Random, device="cpu", small=True, shape=None):
    """A random case; shape (G, Hkv, d_k, d_v) fixes the heads and dims."""
    G = rng.choice([1, 2, 4, 8, 16])
    Hkv = rng.choice([1, 2])
    dk, dv = rng.choice([(16, 16), (32, 16), (48, 32), (24, 16)] if small else
                        [(64, 64), (192, 128), (128, 128)])
    if shape is not None:
        G, Hkv, dk, dv = shape
    l_sel = rng.choice([16, 32]) if small else 64
    T = rng.randint(l_sel + 1, 3 * l_sel + 7) if small else rng.randint(600, 1100)
    B = rng.choice([1, 2])
    cfg = NSAConfig(dim=16, n_heads=G * Hkv, n_kv_heads=Hkv, d_qk=dk, d_v=dv, l=l_sel // 2,
                    d=l_sel // 4, l_sel=l_sel, n_sel=rng.choice([3, 4, 6]) if small else 16,
                    n_local=rng.choice([0, 1, 2]), n_init=rng.choice([0, 1]), window=32)
    docs = None
    if rng.random() < 0.5:
        cuts = sorted(rng.sample(range(1, T), rng.randint(1, 3)))
        docs = torch.tensor([[sum(c <= t for c in cuts) for t in range(T)]] * B, device=device)
    starts = doc_start(docs) if docs is not None else torch.zeros(1, T, dtype=torch.long,
                                                                 device=device)
    idx = random_topn(cfg, B, T, starts, rng.randint(0, 1000), device)
    ctx = MaskContext(cfg, B, T, torch.device(device), doc_ids=docs, topn=lambda: idx)
    spec = get_mask_builder("topn")(ctx)
    return cfg, B, T, spec


def rel(a, b):
    a, b = a.double(), b.double()
    fin = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), fin), "non-finite entries differ"
    return ((a[fin] - b[fin]).norm() / b[fin].norm().clamp_min(1e-30)).item()


def op_plan(**tuning) -> BranchPlan:
    """The selection branch on our op, strictly (an error where it cannot run), with these
    `SelectedTuning` settings over the defaults."""
    return BranchPlan("flex", "selected", "selected", strict=True,
                      tuning=dataclasses.replace(DEFAULT_TUNING, **tuning))


def check_case(seed: int, device="cpu", dtype=torch.float32, small=True, heavy=None, shape=None,
               **tuning):
    """Op vs reference (fp64) on one random case: out, lse, dq, dk, dv (gradients of a random
    linear function of out and lse). heavy: (heavy, split_tiles) of the dK/dV pass; tuning: other
    `SelectedTuning` settings."""
    rng = random.Random(seed)
    cfg, B, T, spec = make_case(rng, device, small, shape)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    shapes = [(B, cfg.n_heads, T, cfg.d_qk), (B, cfg.n_kv_heads, T, cfg.d_qk),
              (B, cfg.n_kv_heads, T, cfg.d_v)]
    x = [torch.randn(s, generator=gen, dtype=torch.float64).to(device) for s in shapes]
    ref_in = [t.clone().requires_grad_() for t in x]
    ro, rl = attend_reference(*ref_in, spec)
    do = torch.randn(ro.shape, generator=gen, dtype=torch.float64).to(device)
    dl = torch.randn(rl.shape, generator=gen, dtype=torch.float64).to(device)
    dl = torch.where(torch.isfinite(rl), dl, 0.0)
    ((ro * do).sum() + (torch.where(torch.isfinite(rl), rl, 0.0) * dl).sum()).backward()
    op_in = [t.to(dtype).requires_grad_() for t in x]
    if heavy is not None:
        tuning.update(heavy=heavy[0], split_tiles=heavy[1])
    o, lse = op_plan(**tuning).attend(*op_in, spec)
    ((o * do.to(dtype)).sum() + (torch.where(torch.isfinite(lse), lse, 0.0)
                                 * dl.float()).sum()).backward()
    errs = dict(out=rel(o, ro), lse=rel(lse, rl), dq=rel(op_in[0].grad, ref_in[0].grad),
                dk=rel(op_in[1].grad, ref_in[1].grad), dv=rel(op_in[2].grad, ref_in[2].grad))
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    assert all(e <= tol for e in errs.values()), (seed, errs)
    return errs


def check_causal(seed: int, device="cpu"):
    """Outputs and gradients at positions <= t0 never depend on keys after t0 (nor on keys outside
    the query's document): perturbing k/v after t0 leaves out[:t0+1] bit-equal, and the gradient of
    out[:t0+1] reaches no key after t0."""
    rng = random.Random(seed)
    cfg, B, T, spec = make_case(rng, device)
    t0 = rng.randint(0, T - 2)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, cfg.n_heads, T, cfg.d_qk, generator=gen).to(device)
    k = torch.randn(B, cfg.n_kv_heads, T, cfg.d_qk, generator=gen).to(device).requires_grad_()
    v = torch.randn(B, cfg.n_kv_heads, T, cfg.d_v, generator=gen).to(device).requires_grad_()
    o, _ = op_plan().attend(q, k, v, spec)
    o[:, :, : t0 + 1].sum().backward()
    assert k.grad[:, :, t0 + 1:].abs().max() == 0 and v.grad[:, :, t0 + 1:].abs().max() == 0
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, :, t0 + 1:] = torch.randn_like(k2[:, :, t0 + 1:]) * 100
    v2[:, :, t0 + 1:] = torch.randn_like(v2[:, :, t0 + 1:]) * 100
    o2, _ = op_plan().attend(q, k2, v2, spec)
    assert torch.equal(o2[:, :, : t0 + 1], o.detach()[:, :, : t0 + 1])


def _interpreter_main():
    torch.set_num_threads(1)
    assert triton_interpreted(), "run with TRITON_INTERPRET=1"
    from hypothesis import given, settings, strategies as st

    n = 0
    # the defaults (G < 16 heads unpadded: 16 // G positions per q block, the union of their
    # blocks; dQ by atomics where G x d_k is small): default dK/dV split, every block its own
    # program, tiny shares
    for seed in range(5):
        check_case(seed, heavy=(None, (0, 256), (3, 1))[seed % 3])
        n += 1

    @settings(max_examples=4, deadline=None, derandomize=True)
    @given(st.integers(0, 10**6))
    def causal(seed):
        check_causal(seed)

    causal()
    check_case(7, rows=32)  # G = 4: 8 positions a block
    n += 1
    # dQ by atomics in the dK/dV pass forced on (heavy blocks' rows added by several programs)
    # and off (the dQ kernel), whatever the shape
    for seed in (11, 12, 13):
        check_case(seed, heavy=(None, (0, 256), (3, 1))[seed % 3], dq_atomic=True)
        n += 1
    check_case(9, heavy=(3, 1), dq_atomic=False)
    n += 1
    # the paper's group: forward on four positions' union lists, dQ on one position's (fwd_rows)
    check_case(11, shape=(16, 1, 48, 32))
    n += 1
    check_case(12, shape=(16, 1, 48, 32), rows=64)  # 64-row q blocks in both passes
    n += 1
    # the hybrid dQ pass of the paper's group with every wide block taken wide, and none
    for cost in (0, 10**6):
        check_case(13, shape=(16, 1, 48, 32), wide_dq_cost=cost)
        n += 1
    # launch options and dK/dV rows as data: a config of the tuning sweep
    check_case(5, dkv_rows=16, fwd_launch=(2, 1), dq_launch=(4, 1), dkv_launch=(4, 1),
               dq_atomic=False)
    n += 1
    print(f"OK {n} cases")


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")
def test_op_matches_reference_and_is_causal_under_interpreter():
    from tests.ops.triton_harness import assert_interpreted_ok

    assert_interpreted_ok(__file__, "OK 15 cases", timeout=900)


@pytest.mark.skipif(not HAS_TRITON or triton_interpreted(), reason="needs triton, not interpreted")
@pytest.mark.parametrize("shape", [(16, 2, 64, 64), (64, 4, 192, 128), (4, 2, 192, 128),
                                   (4, 4, 128, 128), (4, 4, 48, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dq_atomic", [False, True])
def test_kernels_compile_for_h100(monkeypatch, shape, dtype, dq_atomic):
    """The forward, dQ and dK/dV kernels compile for sm_90 with the wrappers' launch arguments
    (also with every Python float typed fp64, as Inductor passes it); with dq_atomic the dK/dV
    kernel also accumulates dQ and there is no dQ kernel."""
    from tests.ops.triton_harness import Launches, compile_for_h100, cuda_compiler, written_args

    cuda_compiler()
    import nsa_flex.ops.selected_triton as M

    calls = Launches()
    monkeypatch.setattr(M, "wrap_triton", calls.wrap)
    tuning = SelectedTuning(dq_atomic=dq_atomic)  # forced, whatever the shape
    H, Hkv, dk, dv = shape
    B, T, n, nqb, nkb = 1, 256, 4, 256, 4
    q = torch.randn(B, H, T, dk, dtype=dtype)
    k, v = torch.randn(B, Hkv, T, dk, dtype=dtype), torch.randn(B, Hkv, T, dv, dtype=dtype)
    sel = torch.zeros(B, Hkv, T, n, dtype=torch.int32)
    lo = hi = torch.zeros(B, T, dtype=torch.int64)
    i32 = lambda *s: torch.zeros(*s, dtype=torch.int32)  # noqa: E731
    lists = (i32(B, Hkv, nqb), i32(B, Hkv, nqb, n), i32(B, Hkv, nqb), i32(B, Hkv, nqb, n))
    # the layer's forward rows; where its q blocks hold several dQ blocks, the dQ pass is hybrid
    rows = tuning.fwd_rows(H // Hkv)
    kw = 0 if dq_atomic else tuning.dq_hybrid(H // Hkv, rows, tuning.rows)
    nqw = nqb // max(kw, 1)
    wide = (i32(B, Hkv, nqw), i32(B, Hkv, nqw, n), i32(B, Hkv, nqw), i32(B, Hkv, nqw, n))
    o, lse = M.selected_attention_fwd._init_fn(q, k, v, sel, lo, hi, *wide, *lists, 0.125, 64, rows,
                                               16, tuning.encode())
    M.selected_attention_bwd._init_fn(torch.randn_like(o), None, q, k, v, o, lse.normal_(), sel,
                                      lo, hi, *lists, *wide, 0.125, 64, 16, rows, tuning.encode())
    names = ["_sel_fwd_kernel", "_delta_kernel", "_sel_dkv_kernel"] if dq_atomic else \
        ["_sel_fwd_kernel", "_delta_kernel"] + ["_sel_dq_kernel"] * (2 if kw else 1) + ["_sel_dkv_kernel"]
    assert [c[0].__name__ for c in calls] == names
    assert kw == (4 if H // Hkv == 16 and not dq_atomic else 0)  # the paper's group: hybrid dQ
    for c in calls:
        compile_for_h100(*c)
    # torch's mutation analysis sees only the outputs written (else compile copies inputs back)
    writes = [["LSE", "O"], ["DELTA"], ["DKA", "DK_", "DQA", "DVA", "DV_"]] if dq_atomic else \
        [["LSE", "O"], ["DELTA"]] + [["DQ"]] * (2 if kw else 1) + [["DKA", "DK_", "DVA", "DV_"]]
    assert [written_args(*c) for c in calls] == writes


def test_routing_and_errors(monkeypatch):
    """sel_kernel: flex plans flex for the selection, auto and triton our op; where the op cannot
    run, auto hands the call to flex and triton says why; a mask that is no block selection goes
    to flex whatever the plan."""
    import nsa_flex.attention as A

    cfg, B, T, spec = make_case(random.Random(0))
    q = torch.randn(B, cfg.n_heads, T, cfg.d_qk)
    k = torch.randn(B, cfg.n_kv_heads, T, cfg.d_qk)
    v = torch.randn(B, cfg.n_kv_heads, T, cfg.d_v)
    plans = {kern: plan_branch(dataclasses.replace(cfg, backend="flex", sel_kernel=kern), "topn")
             for kern in ("flex", "auto", "triton")}
    assert [(p.executor, p.strict) for p in plans.values()] == \
        [("flex", False), ("selected", False), ("selected", True)]
    monkeypatch.setattr(A, "attend_flex", lambda *a: "flex")
    window = get_mask_builder("sliding_window")(MaskContext(cfg, B, T, torch.device("cpu")))
    assert plans["triton"].attend(q, k, v, window) == "flex"  # not a block selection: flex
    if not triton_interpreted():
        assert plans["auto"].attend(q, k, v, spec) == "flex"
        with pytest.raises(RuntimeError, match="sel_kernel='triton' cannot run here: .*CUDA"):
            plans["triton"].attend(q, k, v, spec)
    with pytest.raises(RuntimeError, match="sel_kernel='triton'.*float64"):
        plans["triton"].attend(q.double(), k.double(), v.double(), spec)
    with pytest.raises(ValueError, match="sel_kernel='cuda': allowed values"):
        NSAConfig(sel_kernel="cuda")


def test_head_split_and_tiles():
    from nsa_flex.ops.selected_triton import head_split
    from nsa_flex.ops.selected_tuning import padded_group, tile_positions

    assert head_split(192) == (128, 64) and head_split(64) == (64, 0)
    assert head_split(48) == (32, 16) and head_split(24) == (32, 0) and head_split(8) == (16, 0)
    # a power of two per position, q blocks of >= 16 rows
    assert padded_group(8) == 8 and padded_group(3) == 4 and padded_group(24) == 32
    assert padded_group(1) == 1 and padded_group(16) == 16
    assert tile_positions(8, 16) == 2 and tile_positions(2, 16) == 8 and tile_positions(8, 64) == 8
    assert tile_positions(1, 16) == 16 and tile_positions(32, 16) == 1


def test_dq_mode_by_shape():
    """dQ by atomics where G x d_k <= atomic_max_row (the 125M shape), the dQ kernel above (the
    paper's), unless dq_atomic forces one."""
    t = DEFAULT_TUNING
    assert t.fuse_dq(8, 64) and not t.fuse_dq(16, 192) and not t.fuse_dq(16, 64)
    assert SelectedTuning(dq_atomic=True).fuse_dq(16, 192)
    assert not SelectedTuning(dq_atomic=False).fuse_dq(8, 64)


def test_tuning_crosses_the_op_as_ints():
    """The record the op gets back from its int list is the one passed (every field, None
    included), and it is frozen: a script changes the op's settings by passing another record."""
    for t in (DEFAULT_TUNING, SelectedTuning(rows=32, dq_atomic=False, heavy=3, split_tiles=1,
                                             dkv_rows=64, fwd_launch=(2, 1), dkv_launch=(4, 3)),
              SelectedTuning(dq_atomic=True, wide_dq_cost=0, dq_launch=(8, 2))):
        assert all(isinstance(x, int) for x in t.encode())
        assert SelectedTuning.decode(t.encode()) == t
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT_TUNING.rows = 32
    import nsa_flex.ops.selected_triton as M

    assert not [n for n in ("ROWS", "HEAVY", "SPLIT_TILES", "DKV_ROWS", "DKV_ORDER", "LAUNCH",
                            "PAD_HEADS", "DQ_ATOMIC", "FWD_WIDE_ROWS", "WIDE_DQ_COST")
                if hasattr(M, n)]


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_matches_reference(seed, dtype):
    check_case(seed, device="cuda", dtype=dtype, small=False)
    check_case(seed, device="cuda", dtype=dtype, small=False, heavy=(3, 1))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(16, 4, 192, 128), (16, 2, 64, 64)], ids=["paper", "1B"])
def test_cuda_paper_shape(dtype, shape):
    """The paper's group (G = 16, d_k 192, d_v 128): a forward of four positions per q block on the
    union lists (`fwd_rows`), the hybrid dQ pass (one position per q block on its own lists, or
    the forward's blocks), also with every block taken wide and none; also at torchtitan's 1B
    flavor's group (G = 16, d 64)."""
    from nsa_flex.ops.selected_tuning import tile_positions

    assert tile_positions(16, DEFAULT_TUNING.fwd_rows(16)) == 4 and tile_positions(16, 16) == 1
    for seed in range(2):
        check_case(seed, device="cuda", dtype=dtype, small=False, shape=shape)
    for cost in (0, 10**6):
        check_case(2, device="cuda", dtype=dtype, small=False, shape=shape, wide_dq_cost=cost)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(4))
def test_cuda_causal(seed):
    check_causal(seed, device="cuda")


if __name__ == "__main__":
    _interpreter_main()
