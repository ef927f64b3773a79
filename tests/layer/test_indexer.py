"""The block indexer (nsa_flex/indexer.py, NSAConfig.sel_scores = "indexer"):

* its block scores equal a naive computation from the definition (per head, RoPE on q and k,
  softmax over the tokens of the query's document up to the query, summed per selection block, the mean over the
  KV group's heads), with and without documents, and the layer selects the top-n of those scores
  under the same rule (forced blocks first);
* strictly causal (hypothesis): no output, score or pick at a position moves when a later token
  changes, documents included;
* the distillation trains only the indexer (never the model or the compressed keys), lowers its
  KL when followed, and still trains it during the dense warm-up; compiled (aot_eager, fullgraph)
  equals eager;
* errors name the field: the config's, decode, context parallelism; on the GPU the flex path
  equals the reference.
"""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from nsa_flex import NSAAttention, NSAConfig
from nsa_flex import telemetry as tm
from nsa_flex.config import NSAConfigError
from nsa_flex.rules import forced_and_valid, pick_blocks
from masks import doc_start
from tests.layer.distill_helpers import gpu_kl_pair, kl_before_and_after

DBG = dict(dim=64, n_heads=4, n_kv_heads=2, d_qk=16, d_v=16, l=8, d=4, l_sel=16, n_sel=3, window=16,
           backend="reference", n_local=1, sel_scores="indexer", sel_distill=1.0, indexer_heads=2,
           indexer_dim=16)
T = 96  # 6 selection blocks, 3 selected


def _layer(seed=0, **kw):
    torch.manual_seed(seed)
    m = NSAAttention(NSAConfig(**{**DBG, **kw}))
    m.init_weights()
    with torch.no_grad():  # peaked indexer scores: the picks then depend on them
        m.indexer.wq.weight.normal_(0, 0.4)
        m.indexer.wk.weight.normal_(0, 0.4)
    return m


def _docs(B, cuts, n=T):
    d = torch.zeros(B, n, dtype=torch.long)
    for c in cuts:
        d[:, c:] += 1
    return d


def naive_scores(m, x, doc_ids):
    """[B, Hkv, T, Ns] from the definition, one head and one query at a time, float64."""
    cfg, ix = m.cfg, m.indexer
    B, n, _ = x.shape
    Hkv, h, D = cfg.n_kv_heads, cfg.indexer_heads, cfg.indexer_dim
    ns = -(-n // cfg.l_sel)
    q = (x.double() @ ix.wq.weight.double().T).view(B, n, Hkv, h, D)
    k = (x.double() @ ix.wk.weight.double().T).view(B, n, Hkv, D)
    # RoPE, rotate-half form: position s turns pair (i, i + D/2) by s / theta^(2i/D)
    ang = torch.arange(n, dtype=torch.float64).view(n, 1) / cfg.rope_theta ** (
        torch.arange(0, D, 2, dtype=torch.float64) / D)
    c, sn = ang.cos(), ang.sin()  # [n, D/2]

    def rot(v):  # [..., n, heads..., D] with positions on dim 1
        shape = (1, n) + (1,) * (v.dim() - 3) + (D // 2,)
        a, b = v[..., :D // 2], v[..., D // 2:]
        cc, ss = c.view(shape), sn.view(shape)
        return torch.cat([a * cc - b * ss, b * cc + a * ss], -1)
    q, k = rot(q), rot(k)
    docs = torch.zeros(B, n, dtype=torch.long) if doc_ids is None else doc_ids
    out = torch.zeros(B, Hkv, n, ns, dtype=torch.float64)
    for b in range(B):
        for t in range(n):
            seen = [s for s in range(t + 1) if docs[b, s] == docs[b, t]]
            for g in range(Hkv):
                for j in range(h):
                    p = torch.softmax(torch.stack([q[b, t, g, j] @ k[b, s, g] for s in seen])
                                      / math.sqrt(D), 0)
                    for s, ps in zip(seen, p):
                        out[b, g, t, s // cfg.l_sel] += ps / h
    return out


def _picks(m, x, doc_ids):
    got = {}
    orig = m.select_topn

    def wrapped(*a, **k):
        got["idx"] = orig(*a, **k)
        return got["idx"]
    m.select_topn = wrapped
    y = m(x, doc_ids)
    m.select_topn = orig
    return y, got["idx"]


@pytest.mark.parametrize("span_blocks", [128, 2])
@pytest.mark.parametrize("cuts", [(), (40,)])
def test_scores_and_picks_equal_naive(cuts, span_blocks, monkeypatch):
    """span_blocks 2: distill.token_block_mass in spans of 2 blocks (three calls, merged through
    their log-sum-exps), the path the indexer takes past 128 blocks (8192 tokens)."""
    import nsa_flex.distill as distill
    monkeypatch.setattr(distill, "MAX_VALUE_WIDTH", span_blocks)
    m = _layer()
    x = torch.randn(2, T, 64)
    doc_ids = _docs(2, cuts) if cuts else None
    want = naive_scores(m, x, doc_ids)
    _, idx = _picks(m, x, doc_ids)
    from masks import MaskContext, builder_info
    got = m.indexer(x, builder_info("causal").fn(MaskContext(m.cfg, 2, T, "cpu", doc_ids=doc_ids)), m.cfg)
    assert torch.allclose(got.double(), want, atol=1e-5)
    starts = doc_start(_docs(2, cuts))
    valid, forced = forced_and_valid(m.cfg, T, starts, "cpu")
    assert torch.equal(idx, pick_blocks(want.float(), valid.unsqueeze(1), forced.unsqueeze(1), m.cfg.n_sel))
    # the scores decide: another indexer picks other blocks
    other = _layer(seed=7)
    other.load_state_dict({**m.state_dict(), **{f"indexer.{k}": v for k, v in
                                                _layer(seed=7).indexer.state_dict().items()}})
    assert not torch.equal(_picks(other, x, doc_ids)[1], idx)


@settings(max_examples=12, deadline=None)
@given(cut=st.integers(1, T - 1), doc=st.integers(0, T - 1), seed=st.integers(0, 2**16),
       span_blocks=st.sampled_from([128, 2]))
def test_strictly_causal(cut, doc, seed, span_blocks):
    """Positions < cut see nothing of positions >= cut: outputs, scores and picks unchanged (the
    block masses in one call, or in spans of 2 blocks as past 8192 tokens)."""
    import nsa_flex.distill as distill
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(distill, "MAX_VALUE_WIDTH", span_blocks)
        _strictly_causal(cut, doc, seed)


def _strictly_causal(cut, doc, seed):
    m = _layer()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, T, 64, generator=g)
    x2 = x.clone()
    x2[:, cut:] = torch.randn(1, T - cut, 64, generator=g)
    doc_ids = _docs(1, (doc,) if doc else ())
    y1, i1 = _picks(m, x, doc_ids)
    y2, i2 = _picks(m, x2, doc_ids)
    assert torch.equal(i1[:, :, :cut], i2[:, :, :cut])
    assert torch.allclose(y1[:, :cut], y2[:, :cut], atol=1e-6)
    assert not torch.allclose(y1[:, cut:], y2[:, cut:])


def test_distillation_trains_only_the_indexer():
    m = _layer()
    x = torch.randn(2, T, 64, requires_grad=True)
    (0 * m(x)).sum().backward()  # the trainer's loss contributes nothing: only the distillation
    got = {n for n, p in m.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert got == {"indexer.wq.weight", "indexer.wk.weight"}, got
    assert x.grad is None or not x.grad.abs().sum()
    m.zero_grad()
    m.dense_selection = True  # the warm-up selects every block; the indexer learns meanwhile
    (0 * m(x)).sum().backward()
    assert m.indexer.wq.weight.grad.abs().sum() > 0


def test_following_the_gradient_lowers_the_kl():
    m = _layer(seed=3)
    with torch.no_grad():  # a peaked target: the selected branch's keys far from uniform
        m.wq.weight.normal_(0, 0.5)
        m.wk["sel"].weight.normal_(0, 0.5)
    x = torch.randn(2, T, 64)
    first, last = kl_before_and_after(m, x, m.indexer.parameters(), lr=1e-2)
    assert first > 0.05 and last < 0.5 * first, (first, last)


@pytest.mark.parametrize("span_blocks", [128, 2])
def test_eval_has_no_distillation_and_compiled_equals_eager(span_blocks, monkeypatch):
    import nsa_flex.distill as distill
    monkeypatch.setattr(distill, "MAX_VALUE_WIDTH", span_blocks)
    x = torch.randn(2, T, 64)
    m = _layer(seed=5)
    c = torch.compile(m, backend="aot_eager", fullgraph=True)
    assert torch.allclose(c(x), m(x), atol=1e-5)
    (c(x) ** 2).sum().backward()
    g = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad()
    (m(x) ** 2).sum().backward()
    for n, p in m.named_parameters():
        if p.grad is not None:
            assert torch.allclose(g[n], p.grad, atol=1e-5, rtol=1e-4), n
    m.eval()
    with torch.no_grad():
        m.telemetry = True
        m(x)
        assert float(m.telemetry_stats[tm.DISTILL]) == -1


@pytest.mark.parametrize("kw, field", [(dict(sel_scores="tokens"), "sel_scores='tokens'"),
                                       (dict(sel_distill=0.0), "sel_scores='indexer' with sel_distill=0.0"),
                                       (dict(masks="sliding_only"), "sel_scores='indexer': needs a selection that reads scores"),
                                       (dict(indexer_dim=48), "indexer_dim=48"),
                                       (dict(indexer_heads=0), "indexer_heads=0")])
def test_config_errors_name_the_field(kw, field):
    with pytest.raises(NSAConfigError, match=field):
        NSAConfig(**{**DBG, **kw})


def test_decode_and_context_parallelism_are_refused_by_name():
    from nsa_flex.context_parallel import SeqShard
    from nsa_flex.inference.decode import branch_modes

    m = _layer()
    with pytest.raises(NotImplementedError, match="sel_scores='indexer'"):
        branch_modes(m)
    m.shard = SeqShard(None, 0, 2)
    with pytest.raises(ValueError, match="sel_scores='indexer' do not run under context parallelism"):
        m(torch.randn(1, 40, 64), torch.zeros(1, 80, dtype=torch.long))


@pytest.mark.gpu
def test_flex_kl_and_gradient_equal_reference_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    shape = dict(dim=256, n_heads=8, n_kv_heads=2, d_qk=64, d_v=64, l=32, d=16, l_sel=64, n_sel=8,
                 window=256, phi="mlp", sel_scores="indexer", sel_distill=1.0, indexer_heads=2,
                 indexer_dim=64)
    ref, flex, x, doc_ids = gpu_kl_pair(shape, lambda m: (m.wq, m.wk["sel"], m.indexer.wq, m.indexer.wk))
    cos = torch.nn.functional.cosine_similarity(ref.indexer.wq.weight.grad.flatten(),
                                                flex.indexer.wq.weight.grad.flatten(), 0)
    assert cos > 0.98, float(cos)
    # the compiled layer's output, row by row against the reference: tests/layer/test_batch_rows_gpu.py


@pytest.mark.gpu
def test_indexer_and_distillation_compile_and_train_at_16k():
    """The 125M layer with quality_curriculum.toml's [nsa] selection (indexer, distillation, the
    learned compression, RoPE base 1e6) compiled by inductor at 16k tokens, forward and backward in
    bf16: 256 selection blocks, so the indexer's and the target's one-hot values are 256 wide,
    more than one flex call holds in an H100's shared memory: token_block_mass's two spans of 128
    blocks compile, their log-sum-exps with them. The KL and the indexer's gradient come out finite."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch._dynamo.reset()
    cfg = NSAConfig(dim=768, n_heads=16, n_kv_heads=2, d_qk=64, d_v=64, phi="mlp", sel_scores="indexer",
                    sel_distill=1.0, rope_theta=1e6, backend="flex")
    torch.manual_seed(0)
    m = NSAAttention(cfg).cuda()
    m.init_weights()
    m.telemetry = True
    x = torch.randn(1, 16384, 768, device="cuda")
    layer = torch.compile(m, fullgraph=True)
    with torch.autocast("cuda", torch.bfloat16):
        y = layer(x)
    (y.float().square().mean()).backward()
    kl = float(m.telemetry_stats[tm.DISTILL])
    grad = m.indexer.wq.weight.grad
    assert math.isfinite(kl) and kl > 0, kl
    assert grad is not None and bool(torch.isfinite(grad).all()) and float(grad.abs().sum()) > 0
