"""The selected-attention op (`nsa_flex.ops.selected_attention`) against the reference backend.

On the CPU the kernels run under Triton's interpreter in a subprocess (TRITON_INTERPRET=1 must be
set before triton decorates them): forward, lse and every gradient (also through lse) equal the
dense reference on random selections, with and without documents, for G in {1, 2, 4, 8, 16}, head
dims that split into two dots (48 = 32 + 16) or pad, ragged T, and both dK/dV paths (one program
per kv block, and the most-read blocks split into shares); and a hypothesis property: no output or
gradient at position t depends on a key after t, or outside its document; also with unpadded heads
(several positions per q block, the union of their blocks). The kernels also compile
for an H100 (sm_90) with the launch arguments the wrappers pass (fp64-typed scalars, as Inductor
passes them). On CUDA (`gpu`): the same comparisons in bf16 and fp32 at the paper and 125M shapes.
"""

import contextlib
import random

import pytest
import torch

from masks import MaskContext, get_mask_builder
from masks.builders import doc_start
from nsa_flex.attention import attend_flex, attend_reference, use_selected_op
from nsa_flex.config import NSAConfig
from nsa_flex.ops import HAS_TRITON, triton_interpreted
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


def check_case(seed: int, device="cpu", dtype=torch.float32, small=True, heavy=None, shape=None):
    """Op vs reference (fp64) on one random case: out, lse, dq, dk, dv (gradients of a random
    linear function of out and lse)."""
    from nsa_flex.ops import selected_triton

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
    old = selected_triton.HEAVY, selected_triton.SPLIT_TILES
    if heavy is not None:
        selected_triton.HEAVY, selected_triton.SPLIT_TILES = heavy
    try:
        o, lse = attend_flex(*op_in, spec, sel_kernel="triton")
        ((o * do.to(dtype)).sum() + (torch.where(torch.isfinite(lse), lse, 0.0)
                                     * dl.float()).sum()).backward()
    finally:
        selected_triton.HEAVY, selected_triton.SPLIT_TILES = old
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
    o, _ = attend_flex(q, k, v, spec, sel_kernel="triton")
    o[:, :, : t0 + 1].sum().backward()
    assert k.grad[:, :, t0 + 1:].abs().max() == 0 and v.grad[:, :, t0 + 1:].abs().max() == 0
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, :, t0 + 1:] = torch.randn_like(k2[:, :, t0 + 1:]) * 100
    v2[:, :, t0 + 1:] = torch.randn_like(v2[:, :, t0 + 1:]) * 100
    o2, _ = attend_flex(q, k2, v2, spec, sel_kernel="triton")
    assert torch.equal(o2[:, :, : t0 + 1], o.detach()[:, :, : t0 + 1])


@contextlib.contextmanager
def op_settings(**kw):
    """The op's module settings (PAD_HEADS, ROWS, DQ_ATOMIC) for a block, restored after."""
    from nsa_flex.ops import selected_triton

    old = {k: getattr(selected_triton, k) for k in kw}
    for k, v in kw.items():
        setattr(selected_triton, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(selected_triton, k, v)


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
    with op_settings(PAD_HEADS=True):  # one position per 16-row q block (G heads padded)
        for seed in (9, 5):
            check_case(seed)
            n += 1
        causal()
    with op_settings(ROWS=32):  # G = 4: 8 positions a block
        check_case(7)
        n += 1
    # dQ by atomics in the dK/dV pass forced on (heavy blocks' rows added by several programs)
    # and off (the dQ kernel), whatever the shape
    with op_settings(DQ_ATOMIC=True):
        for seed in (11, 12, 13):
            check_case(seed, heavy=(None, (0, 256), (3, 1))[seed % 3])
            n += 1
        causal()
    with op_settings(DQ_ATOMIC=False):
        check_case(9, heavy=(3, 1))
        n += 1
    # the paper's group: forward on two positions' union lists, dQ on one position's (fwd_rows)
    check_case(11, shape=(16, 1, 48, 32))
    n += 1
    with op_settings(ROWS=64):  # G = 16 on 64-row q blocks (4 positions' union) in both passes
        check_case(12, shape=(16, 1, 48, 32))
        n += 1
    # the hybrid dQ pass of the paper's group with every wide block taken wide, and none
    for cost in (0, 10**6):
        with op_settings(WIDE_DQ_COST=cost):
            check_case(13, shape=(16, 1, 48, 32))
            n += 1
    print(f"OK {n} cases")


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")
def test_op_matches_reference_and_is_causal_under_interpreter():
    from tests.ops.triton_harness import run_interpreted

    r = run_interpreted(__file__, timeout=900)
    assert r.returncode == 0 and "OK 16 cases" in r.stdout, r.stdout[-3000:] + r.stderr[-6000:]


@pytest.mark.skipif(not HAS_TRITON or triton_interpreted(), reason="needs triton, not interpreted")
@pytest.mark.parametrize("shape", [(16, 2, 64, 64), (64, 4, 192, 128), (4, 2, 192, 128),
                                   (4, 4, 128, 128), (4, 4, 48, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dq_atomic", [False, True])
def test_kernels_compile_for_h100(monkeypatch, shape, dtype, dq_atomic):
    """The forward, dQ and dK/dV kernels compile for sm_90 with the wrappers' launch arguments
    (also with every Python float typed fp64, as Inductor passes it); with DQ_ATOMIC the dK/dV
    kernel also accumulates dQ and there is no dQ kernel."""
    from tests.ops.triton_harness import Launches, compile_for_h100, cuda_compiler, written_args

    cuda_compiler()
    import nsa_flex.ops.selected_triton as M

    calls = Launches()
    monkeypatch.setattr(M, "wrap_triton", calls.wrap)
    monkeypatch.setattr(M, "DQ_ATOMIC", dq_atomic)  # forced, whatever the shape
    H, Hkv, dk, dv = shape
    B, T, n, nqb, nkb = 1, 256, 4, 256, 4
    q = torch.randn(B, H, T, dk, dtype=dtype)
    k, v = torch.randn(B, Hkv, T, dk, dtype=dtype), torch.randn(B, Hkv, T, dv, dtype=dtype)
    sel = torch.zeros(B, Hkv, T, n, dtype=torch.int32)
    lo = hi = torch.zeros(B, T, dtype=torch.int64)
    i32 = lambda *s: torch.zeros(*s, dtype=torch.int32)  # noqa: E731
    lists = (i32(B, Hkv, nqb), i32(B, Hkv, nqb, n), i32(B, Hkv, nqb), i32(B, Hkv, nqb, n))
    # the layer's forward rows; where its q blocks hold several dQ blocks, the dQ pass is hybrid
    rows = M.fwd_rows(H // Hkv)
    kw = 0 if dq_atomic else M.dq_hybrid(H // Hkv, rows, M.ROWS)
    nqw = nqb // max(kw, 1)
    wide = (i32(B, Hkv, nqw), i32(B, Hkv, nqw, n), i32(B, Hkv, nqw), i32(B, Hkv, nqw, n))
    o, lse = M.selected_attention_fwd._init_fn(q, k, v, sel, lo, hi, *wide, *lists, 0.125, 64, rows,
                                               16, 16, 256)
    M.selected_attention_bwd._init_fn(torch.randn_like(o), None, q, k, v, o, lse.normal_(), sel,
                                      lo, hi, *lists, *wide, 0.125, 64, 16, rows, 16, 256)
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


def test_routing_and_errors():
    """sel_kernel: flex never runs the op, auto falls back to flex where the op cannot run, and
    triton says why it cannot."""
    cfg, B, T, spec = make_case(random.Random(0))
    q = torch.randn(B, cfg.n_heads, T, cfg.d_qk)
    k = torch.randn(B, cfg.n_kv_heads, T, cfg.d_qk)
    v = torch.randn(B, cfg.n_kv_heads, T, cfg.d_v)
    assert not use_selected_op(q, k, v, spec, "flex")
    window = get_mask_builder("sliding_window")(MaskContext(cfg, B, T, torch.device("cpu")))
    assert not use_selected_op(q, k, v, window, "triton")  # not a block selection: flex
    if not triton_interpreted():
        assert not use_selected_op(q, k, v, spec, "auto")
        with pytest.raises(RuntimeError, match="sel_kernel='triton' cannot run here: .*CUDA"):
            use_selected_op(q, k, v, spec, "triton")
    with pytest.raises(RuntimeError, match="sel_kernel='triton'.*float64"):
        use_selected_op(q.double(), k.double(), v.double(), spec, "triton")
    with pytest.raises(ValueError, match="sel_kernel='cuda': allowed values"):
        NSAConfig(sel_kernel="cuda")


def test_head_split_and_tiles():
    from nsa_flex.ops.selected_triton import head_split, padded_group, tile_positions

    assert head_split(192) == (128, 64) and head_split(64) == (64, 0)
    assert head_split(48) == (32, 16) and head_split(24) == (32, 0) and head_split(8) == (16, 0)
    with op_settings(PAD_HEADS=True):  # a position's heads padded to 16 rows: one per q block
        assert padded_group(8) == 16 and padded_group(16) == 16 and padded_group(24) == 32
        assert tile_positions(8) == 1 and tile_positions(4, 64) == 4 and tile_positions(64, 16) == 1
    with op_settings(PAD_HEADS=False):  # a power of two per position, q blocks of >= 16 rows
        assert padded_group(8) == 8 and padded_group(3) == 4 and padded_group(24) == 32
        assert tile_positions(8) == 2 and tile_positions(2) == 8 and tile_positions(8, 64) == 8
        assert tile_positions(1, 16) == 16 and tile_positions(32) == 1


def test_dq_mode_by_shape():
    """dQ by atomics where G x d_k <= ATOMIC_MAX_ROW (the 125M shape), the dQ kernel above (the
    paper's), unless DQ_ATOMIC forces one."""
    from nsa_flex.ops.selected_triton import dq_atomic

    with op_settings(DQ_ATOMIC=None):
        assert dq_atomic(8, 64) and not dq_atomic(16, 192) and not dq_atomic(16, 64)
    with op_settings(DQ_ATOMIC=True):
        assert dq_atomic(16, 192)
    with op_settings(DQ_ATOMIC=False):
        assert not dq_atomic(8, 64)


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
    from nsa_flex.ops.selected_triton import fwd_rows, tile_positions

    assert tile_positions(16, fwd_rows(16)) == 4 and tile_positions(16) == 1
    for seed in range(2):
        check_case(seed, device="cuda", dtype=dtype, small=False, shape=shape)
    for cost in (0, 10**6):
        with op_settings(WIDE_DQ_COST=cost):
            check_case(2, device="cuda", dtype=dtype, small=False, shape=shape)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(4))
def test_cuda_causal(seed):
    check_causal(seed, device="cuda")


if __name__ == "__main__":
    _interpreter_main()
