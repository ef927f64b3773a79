"""Every GPU path at batch size > 1, each batch row against its own single-row reference (marked
`gpu`: skipped without one). Training runs B = 16 sequences a step while the kernel tests beside
this file run one: a kernel, block list or inductor lowering that reads row 0's data, strides or
mask for every row passes them all. Rows differ in content and in documents, so any row that
borrows another's shows.

The pieces one by one (the top-n rule, the block masses, each branch's executor), then the whole
layer as configured and with each of its routes swapped in turn, so a failure names its piece.

fp32 (tf32 off) except the last test (training's bf16 routes, on a recorded selection): the compiled paths then agree with the reference to ~1e-5 where they
are right, so a bound of 1e-3 separates a wrong row from rounding, and a near-tie of the top-n
(which bf16 would flip) is not a concern at these scales except where a test says so."""

from dataclasses import replace

import pytest
import torch
import torch._dynamo

from masks import MaskContext, get_mask_builder
from masks.builders import doc_start
from nsa_flex import NSAAttention, NSAConfig
from nsa_flex.attention import attend_reference, plan_branch
import nsa_flex.distill as distill
import nsa_flex.indexer as indexer_module
from nsa_flex.distill import block_mass, block_onehot, value_width
from nsa_flex.rules import forced_and_valid, pick_blocks
from nsa_flex.selection import select_topn

pytestmark = pytest.mark.gpu

B, T = 3, 1024
SHAPE = dict(n_heads=8, n_kv_heads=2, d_qk=64, d_v=64, dim=256, l=32, d=16, l_sel=64, n_sel=8,
             window=256)
DEV = torch.device("cuda")
TOL = 1e-3


@pytest.fixture(autouse=True)
def _cuda_fp32():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch._dynamo.reset()
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def row_errors(got, want) -> list[float]:
    """Per batch row: max |got - want| over the row / max |want| over the row."""
    return [float((g.float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-30))
            for g, w in zip(got, want)]


def docs() -> torch.Tensor:
    """[B, T] document ids, a different layout per row (row 0: one document)."""
    d = torch.zeros(B, T, dtype=torch.long, device=DEV)
    d[1, 300:] = 1
    d[2, 100:] = 1
    d[2, 700:] = 2
    return d


def test_pick_blocks_compiled_per_row():
    """The top-n rule compiled (the indexer's path and the non-Triton scorer's) picks what it
    picks in eager, row by row, on scores that differ per row."""
    cfg = NSAConfig(**SHAPE)
    ns = -(-T // cfg.l_sel)
    torch.manual_seed(0)
    p = torch.rand(B, cfg.n_kv_heads, T, ns, device=DEV)
    starts = doc_start(docs())
    valid, forced = forced_and_valid(cfg, T, starts, DEV)
    args = (p, valid.unsqueeze(1), forced.unsqueeze(1), cfg.n_sel)
    want = pick_blocks(*args)
    got = torch.compile(pick_blocks, fullgraph=True, dynamic=False)(*args)
    assert [bool(torch.equal(g, w)) for g, w in zip(got, want)] == [True] * B


@pytest.mark.parametrize("onehot", [False, True], ids=["dense_v", "onehot_v"])
def test_block_mass_compiled_per_row(onehot):
    """block_mass (the distillation's target, the indexer's scores) on the flex backend, compiled:
    each row equals that row alone on the reference backend. onehot_v: the values the layer gives
    it, one [S, width] one-hot expanded over batch and heads (stride 0)."""
    cfg = NSAConfig(**SHAPE)
    torch.manual_seed(0)
    q = torch.randn(B, cfg.n_heads, T, cfg.d_qk, device=DEV)
    k = torch.randn(B, cfg.n_kv_heads, T, cfg.d_qk, device=DEV)
    ns = -(-T // cfg.l_sel)
    values = block_onehot(T, cfg.l_sel, value_width(ns), DEV, q.dtype)
    if not onehot:
        values = torch.randn_like(values)
    d = docs()
    spec = get_mask_builder("causal")(MaskContext(cfg, B, T, DEV, doc_ids=d))
    got = torch.compile(lambda q_, k_: block_mass(q_, k_, values, spec, "flex"), fullgraph=True,
                        dynamic=False)(q, k)
    want = [block_mass(q[b:b + 1], k[b:b + 1], values,
                       get_mask_builder("causal")(MaskContext(cfg, 1, T, DEV, doc_ids=d[b:b + 1])),
                       "reference")[0] for b in range(B)]
    errs = row_errors(got, want)
    assert max(errs) < TOL, errs


@pytest.mark.parametrize("builder", ["causal", "compressed_causal", "sliding_window", "topn"])
def test_branch_call_compiled_per_row(builder):
    """Each branch's planned executor (the layer's route: cuDNN / flex / the selected op / SDPA)
    compiled at B rows with documents: each row equals that row alone on the reference."""
    cfg = NSAConfig(**SHAPE, backend="flex")
    torch.manual_seed(0)
    H, Hkv, dk, dv = cfg.n_heads, cfg.n_kv_heads, cfg.d_qk, cfg.d_v
    compressed = builder == "compressed_causal"
    S = cfg.num_cmp(T) if compressed else T
    q = torch.randn(B, H, T, dk, device=DEV)
    k, v = torch.randn(B, Hkv, S, dk, device=DEV), torch.randn(B, Hkv, S, dv, device=DEV)
    d = docs()
    idx = None
    if builder == "topn":  # the real scorer's picks on compressed keys, per row
        nc = cfg.num_cmp(T)
        kc, vc = torch.randn(B, Hkv, nc, dk, device=DEV), torch.randn(B, Hkv, nc, dv, device=DEV)
        cctx = MaskContext(cfg, B, T, DEV, doc_ids=d)
        lse = attend_reference(q, kc, vc, get_mask_builder("compressed_causal")(cctx))[1]
        idx = select_topn(q, kc, lse, cfg, doc_start(d))

    def spec(rows):
        sub = d[rows]
        return get_mask_builder(builder)(MaskContext(
            cfg, sub.shape[0], T, DEV, doc_ids=sub,
            topn=None if idx is None else (lambda: idx[rows])))

    plan = plan_branch(cfg, builder)
    every = slice(None)
    got = torch.compile(lambda q_, k_, v_: plan.attend(q_, k_, v_, spec(every), docs=True)[0],
                        fullgraph=True, dynamic=False)(q, k, v)
    want = [attend_reference(q[b:b + 1], k[b:b + 1], v[b:b + 1], spec(slice(b, b + 1)))[0][0]
            for b in range(B)]
    seen = [torch.isfinite(w) for w in want]  # rows with no key (a compressed branch's first
    errs = row_errors([torch.where(s, g, 0) for g, s in zip(got, seen)],  # positions) are 0
                      [torch.where(s, w, 0) for w, s in zip(want, seen)])
    assert max(errs) < TOL, (plan.executor, errs)


def materialized_block_mass(q, k, values, spec, backend):
    """block_mass with its values copied out per batch row and head (the layer's one-hot
    is otherwise expanded over both, stride 0): a route swap of `test_layer_compiled_per_row`."""
    full = values.expand(q.shape[0], k.shape[1], *values.shape).contiguous()
    return block_mass(q, k, full, spec, backend)


def layer_pair(sel_scores: str, sharpen: bool, **route) -> tuple[NSAAttention, NSAAttention]:
    """(reference, flex) layers of SHAPE (phi mlp; the block indexer for sel_scores "indexer";
    `route`: NSAConfig fields) with the same weights, in eval mode. sharpen: the scoring projections
    drawn at std 2 / sqrt(dim), block masses far from uniform; else init 0.02 with gates that
    differ per head."""
    extra = dict(sel_scores="indexer", sel_distill=1.0, indexer_heads=2, indexer_dim=64) \
        if sel_scores == "indexer" else {}
    cfg = NSAConfig(**SHAPE, phi="mlp", **extra, **route)
    torch.manual_seed(0)
    ref = NSAAttention(replace(cfg, backend="reference")).to(DEV)
    ref.init_weights(0.02)
    with torch.no_grad():
        if sharpen:
            for lin in [ref.wq, ref.wk["sel"]] + ([ref.indexer.wq, ref.indexer.wk] if ref.indexer
                                                  else [ref.wk["cmp"]]):
                lin.weight.normal_(0, 2 * cfg.dim ** -0.5)
        else:
            ref.gate.weight.normal_(0, 0.02)
    flex = NSAAttention(replace(cfg, backend="flex")).to(DEV)
    flex.load_state_dict(ref.state_dict())
    return ref.eval(), flex.eval()


# the layer's routes, each swapped for another in turn: where "as configured" fails and a swap
# passes, the swapped-out piece is the faulty one
ROUTES = {"as_configured": {}, "cmp_kernel_flex": {"cmp_kernel": "flex"},
          "sel_kernel_flex": {"sel_kernel": "flex"}, "materialized_block_mass": {}}


@pytest.mark.parametrize("sel_scores", ["cmp", "indexer"])
@pytest.mark.parametrize("route,with_docs", [(r, True) for r in ROUTES] + [("as_configured", False)])
def test_layer_compiled_per_row(sel_scores, route, with_docs, monkeypatch):
    """The whole layer compiled (flex backend), B rows (with or without documents), against each
    row alone on the reference backend (same weights; scores sharpened so the block masses are
    far from uniform). Each row's selection is its own computation, so a near-tie may flip a pick
    in a few positions: at most 0.5% of a row's positions may differ by more than TOL, and its
    median error stays under TOL / 10."""
    if route == "materialized_block_mass":
        monkeypatch.setattr(distill, "block_mass", materialized_block_mass)
        monkeypatch.setattr(indexer_module, "block_mass", materialized_block_mass)
    ref, flex = layer_pair(sel_scores, sharpen=True, **ROUTES[route])
    x = torch.randn(B, T, SHAPE["dim"], device=DEV)
    d = docs() if with_docs else None
    with torch.no_grad():
        got = torch.compile(flex, fullgraph=True, dynamic=False)(x, d)
        want = [ref(x[b:b + 1], None if d is None else d[b:b + 1])[0] for b in range(B)]
    report = []
    for b in range(B):
        pos = (got[b] - want[b]).abs().amax(-1) / want[b].abs().max()
        report.append((b, round(float((pos > TOL).float().mean()), 4), float(pos.median())))
    assert all(off <= 5e-3 and med < TOL / 10 for _, off, med in report), report


@pytest.mark.parametrize("sel_scores", ["cmp", "indexer"])
def test_layer_bf16_routes_per_row(sel_scores):
    """The routes training runs (bf16: the compressed branch on cuDNN, the selected op in bf16),
    compiled at B rows with documents, each row against the fp32 reference's same row; both on the
    reference's selection (bf16 would break near-ties of the scores differently)."""
    ref, flex = layer_pair(sel_scores, sharpen=False)
    flex = flex.to(torch.bfloat16)
    recorded = {}

    def record(*a, **k):
        recorded["idx"] = select_topn(*a, **k)
        return recorded["idx"]

    ref.select_topn = record
    x, d = torch.randn(B, T, SHAPE["dim"], device=DEV), docs()
    with torch.no_grad():
        want = ref(x, d)
        flex.select_topn = lambda *a, **k: recorded["idx"]
        got = torch.compile(flex, fullgraph=True, dynamic=False)(x.to(torch.bfloat16), d)
    errs = [float((g.float() - w).norm() / w.norm()) for g, w in zip(got, want)]
    assert max(errs) < 2e-2, errs
