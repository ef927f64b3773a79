"""The fused Triton selection scorer (`nsa_flex.ops.group_slc_scores`) against the torch scorer,
its naive reference.

On the CPU the kernel runs under Triton's interpreter, in a subprocess (TRITON_INTERPRET=1 must be
set before the kernel is decorated): random small configs (l != 2d, l' != 4d, G in {1, 2, 4},
head dims that are not powers of two, T not a multiple of anything, documents, rows that see no
compressed block, several query / key tiles per launch) agree with the torch path to 1e-5 in
fp32 and give the same top-n. The interpreter cannot check bf16 dots (triton 3.9's interpreter
multiplies the raw bf16 bits); bf16 and torch.compile are checked by the CUDA tests here (marked
gpu); experiments/tune_scorer.py times the kernel. Also: the `scorer` config field, the dispatch, the tile arithmetic.
"""

import random
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script (the interpreter subprocess)
    sys.path.insert(0, str(ROOT))

import masks  # noqa: E402
from nsa_flex import NSAConfig, NSAConfigError  # noqa: E402
from nsa_flex.attention import attend_reference  # noqa: E402
from nsa_flex.ops import HAS_TRITON, triton_interpreted  # noqa: E402
from nsa_flex.rules import forced_and_valid, pick_blocks  # noqa: E402
from nsa_flex.selection import block_scores, select_topn, use_triton_scorer  # noqa: E402

CUDA = torch.cuda.is_available() and HAS_TRITON


def make_cfg(scorer="torch", **kw):
    base = dict(dim=8, n_heads=4, n_kv_heads=2, d_qk=8, d_v=4, l=8, d=4, l_sel=16, n_sel=3,
                window=5, backend="reference", scorer=scorer)
    return NSAConfig(**{**base, **kw})


def case_inputs(cfg, B, T, docs, seed, device="cpu", dtype=torch.float32, spike=1.0):
    """q, k_cmp, doc starts and the compressed branch's lse (reference attention, fp32)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, cfg.n_heads, T, cfg.d_qk, generator=g) * spike
    nc = cfg.num_cmp(T)
    k = torch.randn(B, cfg.n_kv_heads, nc, cfg.d_qk, generator=g)
    doc_ids = None
    if docs:  # True: random document cuts, or a list: these cuts
        rng = random.Random(seed)
        rows = []
        for _ in range(B):
            cuts = set(rng.sample(range(1, T), min(T - 1, rng.randint(1, 3)))) if T > 1 else set()
            rows.append([sum(c <= t for c in (docs if isinstance(docs, list) else cuts))
                         for t in range(T)])
        doc_ids = torch.tensor(rows)
    spec = masks.compressed_causal(cfg.l, cfg.d)
    if doc_ids is not None:
        spec = masks.and_masks(spec, masks.document(doc_ids, kv_stride=cfg.d, kv_span=cfg.l))
    v = torch.zeros(B, cfg.n_kv_heads, nc, cfg.d_v)
    _, lse = attend_reference(q, k, v, spec)
    starts = masks.doc_start(doc_ids) if doc_ids is not None else None
    mv = (lambda x: None if x is None else x.to(device))
    return q.to(device, dtype), k.to(device, dtype), mv(lse), mv(starts)


# ---------------------------------------------------------------------- config and dispatch
def test_scorer_field_validated():
    assert NSAConfig().scorer == "auto"
    for ok in ("auto", "torch", "triton"):
        assert make_cfg(ok).scorer == ok
    with pytest.raises(NSAConfigError, match=r"scorer='cuda': allowed values are "
                                             r"\('auto', 'torch', 'triton'\)"):
        make_cfg("cuda")


def test_titan_nsa_section_has_scorer():
    import dataclasses

    pytest.importorskip("torchtitan", reason="torchtitan not installed")

    from nsa_flex.titan.args import NSA_SECTION_FIELDS, NSAModelArgs
    from nsa_flex.titan.job_config import NSA

    assert "scorer" in {f.name for f in dataclasses.fields(NSA)}
    assert "scorer" in NSA_SECTION_FIELDS
    a = NSAModelArgs(d_qk=8, d_v=8, dim=16, n_heads=4, n_kv_heads=2, scorer="torch")
    assert a.nsa_config().scorer == "torch"
    a.scorer = "fast"
    with pytest.raises(NSAConfigError, match="scorer='fast'"):
        a.nsa_config()


@pytest.mark.skipif(triton_interpreted(), reason="the kernel is interpreted in this process")
def test_dispatch_on_cpu():
    cfg = make_cfg()
    q, k, lse, _ = case_inputs(cfg, 1, 20, False, 0)
    assert not use_triton_scorer(make_cfg("torch"), q, lse)
    assert not use_triton_scorer(make_cfg("auto"), q, lse)  # CPU tensors: torch path
    with pytest.raises(RuntimeError, match=r"scorer='triton' cannot run here: .*(CUDA|triton)"):
        block_scores(q, k, lse, make_cfg("triton"), None, 0, 20)
    with pytest.raises(RuntimeError, match=r"scorer='triton' cannot run here: .*lse"):
        use_triton_scorer(make_cfg("triton"), q, None)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")
def test_tile_arithmetic():
    from nsa_flex.ops.scorer_triton import head_dim_split, tile_shape

    assert [head_dim_split(D) for D in (192, 128, 48, 24, 16, 8, 200)] == \
        [(128, 64), (128, 0), (32, 16), (16, 16), (16, 0), (16, 0), (128, 128)]
    for D in range(1, 300):
        d1, d2 = head_dim_split(D)
        assert d1 + d2 >= D and d1 >= 16 and (d2 == 0 or d2 >= 16)
        assert d1 & (d1 - 1) == 0 and d2 & (d2 - 1) == 0
    assert tile_shape(32, 16, 64, 128) == (128, 31, 32)  # paper: r = 4, l/d = 2
    assert tile_shape(32, 16, 64, 64) == (64, 15, 16)
    for l, d, ls, bn in [(4, 1, 5, 16), (3, 1, 40, 16), (64, 16, 32, 16), (8, 8, 8, 16)]:
        BN, bj, bjp = tile_shape(l, d, ls, bn)
        r, qn = ls // d, l // d
        assert bj >= 1 and bj * r + qn - 1 <= BN and (bj + 1) * r + qn - 1 > BN and bjp >= bj


# ---------------------------------------------------------------------- interpreter vs torch
def random_cases(n, seed):
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        d = rng.choice([1, 2, 4])
        G = [1, 2, 4][i % 3]
        cases.append(dict(
            d=d, l=d * rng.randint(1, 3), l_sel=d * rng.choice([1, 2, 3, 5]), G=G,
            Hkv=rng.choice([1, 2]), Dk=rng.choice([24, 48, 8, 40]), T=rng.randint(5, 61),
            B=rng.choice([1, 2]), docs=i % 2 == 1, chunk=rng.choice([16, 1024]),
            tile=rng.choice([(16, 16), (16, 32), (32, 64)]), seed=rng.randint(0, 2**31),
            spike=rng.choice([1.0, 1.0, 6.0])))
    # T < l (no compressed block at all) and a chunk whose rows see nothing yet
    cases.append(dict(d=4, l=8, l_sel=8, G=2, Hkv=1, Dk=24, T=7, B=1, docs=False, chunk=4,
                      tile=(16, 16), seed=1, spike=1.0))
    cases.append(dict(d=2, l=6, l_sel=4, G=4, Hkv=2, Dk=48, T=37, B=1, docs=True, chunk=13,
                      tile=(16, 16), seed=2, spike=1.0))
    # a 16-row query tile whose document starts exactly at the last key of a 16-key tile
    cases.append(dict(d=1, l=1, l_sel=1, G=2, Hkv=1, Dk=24, T=40, B=1, docs=[15], chunk=1024,
                      tile=(16, 16), seed=3, spike=1.0, t0=0))
    return cases


def check_case(c, device="cpu", dtype=torch.float32, rtol=1e-5):
    """Kernel == torch reference: block_scores per chunk (the op with a small tile too, so launches
    have several query and key tiles), and select_topn indices."""
    from nsa_flex.ops import group_slc_scores

    kw = dict(l=c["l"], d=c["d"], l_sel=c["l_sel"], n_heads=c["G"] * c["Hkv"],
              n_kv_heads=c["Hkv"], d_qk=c["Dk"], score_chunk=c["chunk"],
              n_sel=3, n_local=1)
    ref, tri = make_cfg("torch", **kw), make_cfg("triton", **kw)
    T = c["T"]
    q, k, lse, starts = case_inputs(ref, c["B"], T, c["docs"], c["seed"], device, dtype,
                                    c["spike"])
    for t0 in range(0, T, c["chunk"]):
        t1 = min(T, t0 + c["chunk"])
        want = block_scores(q, k, lse, ref, starts, t0, t1)
        got = block_scores(q, k, lse, tri, starts, t0, t1)
        assert got.shape == want.shape and got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * 1e-1, msg=lambda m: f"{c}: {m}")
    if k.shape[2]:  # small tiles: several query and key tiles per launch, halos, skipped tiles
        bm, bn = c["tile"]
        t0 = c.get("t0", T // 3)
        want = block_scores(q, k, lse, ref, starts, t0, T)
        small = group_slc_scores(q, k, lse, starts, t0, T, c["l"], c["d"], c["l_sel"],
                                 block_m=bm, block_n=bn, num_warps=4, num_stages=1)
        torch.testing.assert_close(small, want, rtol=rtol, atol=rtol * 1e-1,
                                   msg=lambda m: f"{c} tile {bm}x{bn}: {m}")
    a = select_topn(q, k, lse, ref, starts)
    b = select_topn(q, k, lse, tri, starts)
    assert torch.equal(a, b), c


def check_topn(seed, device="cpu"):
    """topn_blocks == pick_blocks on forced_and_valid: scores with many exact ties (small
    integers), zeros, documents, n_init / n_local of 0, more slots than blocks, a chunk offset."""
    from nsa_flex.ops import topn_blocks

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    l_sel, T = rng.choice([1, 4, 16]), rng.randint(1, 90)
    n_init, n_local = rng.choice([0, 1]), rng.choice([0, 1, 2])
    n_sel = rng.choice([max(1, n_init + n_local), 3, 7, 40])
    cfg = make_cfg("torch", l=l_sel, d=l_sel, l_sel=l_sel, n_sel=n_sel, n_init=n_init,
                   n_local=n_local)
    B, Hkv, ns = rng.choice([1, 2]), rng.choice([1, 3]), -(-T // l_sel)
    t0 = rng.randint(0, T - 1)
    p = torch.randint(0, 4, (B, Hkv, T - t0, ns), generator=g).float() * rng.choice([1.0, 0.37])
    docs = None
    if rng.random() < 0.5 and T > 2:
        cuts = sorted(rng.sample(range(1, T), rng.randint(1, min(3, T - 1))))
        docs = masks.doc_start(torch.tensor([[sum(c <= t for c in cuts) for t in range(T)]] * B))
    starts = docs if docs is not None else torch.zeros(1, T, dtype=torch.long)
    valid, forced = forced_and_valid(cfg, T, starts, "cpu", t0, T)
    want = pick_blocks(p, valid.unsqueeze(1), forced.unsqueeze(1), n_sel)
    mv = (lambda x: None if x is None else x.to(device))
    got = topn_blocks(p.to(device), mv(docs), t0, l_sel, n_sel, n_init, n_local).cpu()
    assert torch.equal(got, want), (seed, l_sel, T, t0, n_sel, n_init, n_local, got, want)


def _interpreter_main():
    torch.set_num_threads(1)
    assert triton_interpreted(), "run with TRITON_INTERPRET=1"
    cases = random_cases(8, 1234)
    for c in cases:
        check_case(c)
    for seed in range(40):
        check_topn(seed)
    print(f"OK {len(cases)} cases")


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")
def test_kernel_matches_torch_under_interpreter():
    from tests.ops.triton_harness import assert_interpreted_ok

    assert_interpreted_ok(__file__, "OK 11 cases", timeout=300)


# ---------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA and triton")
def test_cuda_topn_matches_pick_blocks():
    for seed in range(40):
        check_topn(seed, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA and triton")
@pytest.mark.parametrize("i", range(6))
def test_cuda_fp32_matches_torch(i):
    check_case(random_cases(6, 99)[i], device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA and triton")
def test_cuda_bf16_close_and_compiled():
    """bf16 q/k (tensor-core dot, fp32 accumulation) vs the fp32 torch scorer of the same bf16
    values; the op inside torch.compile(fullgraph=True) gives the eager result."""
    ref = make_cfg("torch", n_heads=16, n_kv_heads=2, d_qk=192, l=32, d=16, l_sel=64, n_sel=16,
                   n_local=2, score_chunk=512)
    tri = make_cfg("triton", **{k: v for k, v in ref.to_dict().items() if k != "scorer"})
    q, k, lse, starts = case_inputs(ref, 2, 1500, True, 7, "cuda", torch.bfloat16)
    want = block_scores(q.float(), k.float(), lse, ref, starts, 0, 1500)
    got = block_scores(q, k, lse, tri, starts, 0, 1500)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    f = torch.compile(lambda q, k, lse, s: select_topn(q, k, lse, tri, s), fullgraph=True)
    torch.testing.assert_close(f(q, k, lse, starts), select_topn(q, k, lse, tri, starts),
                               rtol=0, atol=0)


if __name__ == "__main__":
    _interpreter_main()


@pytest.mark.skipif(triton_interpreted(), reason="the kernel is interpreted in this process")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_compiles_for_h100_as_inductor_launches_it(monkeypatch, dtype):
    """The kernel compiles (front end, TTGIR, PTX, ptxas) for sm_90 with the launch arguments the
    wrapper passes, every Python float typed fp64 as Inductor types it inside torch.compile (eager
    Triton says fp32): a float argument multiplied into the fp32 accumulator would make it fp64
    and fail to compile, so the scale is a constexpr."""
    from tests.ops.triton_harness import Launches, compile_for_h100, cuda_compiler, written_args

    cuda_compiler()
    import nsa_flex.ops.scorer_triton as M

    calls = Launches()
    monkeypatch.setattr(M, "wrap_triton", calls.wrap)
    B, Hq, Hkv, T, D = 1, 8, 2, 300, 192
    q = torch.randn(B, Hq, T, D, dtype=dtype)
    k = torch.randn(B, Hkv, (T - 32) // 16 + 1, D, dtype=dtype)
    lse = torch.randn(B, Hq, T)
    docs = torch.zeros(1, T, dtype=torch.int32)
    M.group_slc_scores._init_fn(q, k, lse, docs, 0, T, 32, 16, 64)
    assert len(calls) == 1
    compile_for_h100(*calls[0])
    assert written_args(*calls[0]) == ["OUT"]  # torch's mutation analysis: only the output
