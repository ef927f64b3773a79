"""Selection distillation (nsa_flex/distill.py, NSAConfig.sel_distill):

* the loss equals a naive computation written from its definition (per-head dense softmaxes over
  tokens and compressed blocks, Eq. 9 by overlap, forced blocks out, KL), with and without
  documents;
* its gradient reaches only the compressed keys' projection and phi (never q, the other branches,
  the gate or the layer's input), it lowers the loss when followed, and it is absent where the
  setting is 0, in eval mode and under no_grad (outputs bit-identical);
* compiled (fullgraph, aot_eager) it gives the eager gradients; telemetry logs the KL; context
  parallelism is refused by name;
* the config's errors name the field; the flex path on the GPU equals the reference path;
* block masses of token keys over many blocks: one call per span of blocks over its own keys,
  merged through the log-sum-exps, equal to the dense softmax's.
"""

import math

import pytest
import torch

from nsa_flex import NSAAttention, NSAConfig
from nsa_flex import telemetry as tm
from nsa_flex.config import NSAConfigError
from tests.layer.distill_helpers import gpu_kl_pair, kl_before_and_after
from nsa_flex.distill import attach_loss, distill_kl
from nsa_flex.rules import cmp_visible, forced_and_valid, map_to_selection_blocks
from masks import builder_info, doc_start, MaskContext

DBG = dict(dim=64, n_heads=4, n_kv_heads=2, d_qk=16, d_v=16, l=8, d=4, l_sel=16, n_sel=4, window=32,
           backend="reference", n_local=1)


def _layer(seed=0, **kw):
    torch.manual_seed(seed)
    m = NSAAttention(NSAConfig(**{**DBG, **kw}))
    m.init_weights()
    return m


def _docs(B, T, cuts):
    d = torch.zeros(B, T, dtype=torch.long)
    for c in cuts:
        d[:, c:] += 1
    return d


def naive_kl(q, k_cmp, k_sel, cfg, doc_ids):
    """The loss from its definition, dense, one head at a time."""
    B, H, T, D = q.shape
    Hkv, Nc = k_sel.shape[1], k_cmp.shape[2]
    G, ns = H // Hkv, -(-T // cfg.l_sel)
    docs = torch.zeros(B, T, dtype=torch.long) if doc_ids is None else doc_ids
    starts = doc_start(docs)
    t = torch.arange(T).view(T, 1)
    s_ = torch.arange(T).view(1, T)
    i = torch.arange(Nc).view(1, Nc)
    total, rows = 0.0, 0
    valid, forced = forced_and_valid(cfg, T, starts, "cpu")
    for b in range(B):
        tok_vis = (s_ <= t) & (docs[b].view(1, T) == docs[b].view(T, 1))
        cmp_vis = cmp_visible(i, t, cfg.l, cfg.d) & (i * cfg.d >= starts[b].view(T, 1))
        for h in range(Hkv):
            tgt = torch.zeros(T, ns, dtype=torch.float64)
            prd = torch.zeros(T, ns, dtype=torch.float64)
            for g in range(G):
                qq = q[b, h * G + g].double()
                st = (qq @ k_sel[b, h].double().T) / math.sqrt(D)
                p = torch.softmax(st.masked_fill(~tok_vis, -math.inf), -1)
                tgt += torch.stack([p[:, j * cfg.l_sel:(j + 1) * cfg.l_sel].sum(-1) for j in range(ns)], -1)
                sc = (qq @ k_cmp[b, h].double().T) / math.sqrt(D)
                pc = torch.softmax(sc.masked_fill(~cmp_vis, -math.inf), -1).nan_to_num(0.0)
                prd += map_to_selection_blocks(pc, ns, cfg.l, cfg.d, cfg.l_sel)
            free = valid[min(b, valid.shape[0] - 1)] & ~forced[min(b, forced.shape[0] - 1)]
            for r in range(T):
                f = free[r]
                if not f.any():
                    continue
                tt = tgt[r][f] / tgt[r][f].sum()
                pp = prd[r][f] / prd[r][f].sum()
                total += float((tt * (tt.log() - pp.clamp_min(1e-6).log())).sum())
                rows += 1
    return total / max(rows, 1)


@pytest.mark.parametrize("span_blocks", [128, 4])
@pytest.mark.parametrize("cuts", [(), (45, 110)])
def test_loss_equals_naive(cuts, span_blocks, monkeypatch):
    """span_blocks 4: the target's block masses in spans of 4 blocks (three calls), the path past
    128 blocks; the prediction's over 10 blocks in column slices of 4 (block_mass)."""
    import nsa_flex.distill as distill
    monkeypatch.setattr(distill, "MAX_VALUE_WIDTH", span_blocks)
    cfg = NSAConfig(**DBG, sel_distill=1.0)
    B, H, Hkv, T, D = 2, 4, 2, 160, 16
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, H, T, D, generator=g) * 2
    k_sel = torch.randn(B, Hkv, T, D, generator=g) * 2
    Nc = cfg.num_cmp(T)
    k_cmp = torch.randn(B, Hkv, Nc, D, generator=g) * 2
    doc_ids = _docs(B, T, cuts) if cuts else None
    ctx = MaskContext(cfg, B, T, "cpu", doc_ids=doc_ids)
    cmp_spec = builder_info("compressed_causal").fn(ctx)
    causal_spec = builder_info("causal").fn(ctx)
    starts = None if doc_ids is None else doc_start(doc_ids)
    got = distill_kl(q, k_cmp, k_sel, cfg, cmp_spec, causal_spec, starts)
    want = naive_kl(q, k_cmp, k_sel, cfg, doc_ids)
    assert want > 0.05  # random scores: the two distributions differ
    assert abs(float(got) - want) < 1e-4 * max(1.0, want), (float(got), want)


@pytest.mark.parametrize("phi", ["avg", "mlp"])
def test_gradient_reaches_only_the_compressed_keys(phi):
    m = _layer(sel_distill=1.0, phi=phi)
    m.train()
    x = torch.randn(2, 80, 64, requires_grad=True)
    y = m(x)
    (0 * y).sum().backward()  # the trainer's loss contributes nothing: only the distillation
    got = {n for n, p in m.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    allowed = {"wk.cmp.weight"} | {f"phi_k.{n}" for n, _ in m.phi_k.named_parameters()}
    assert "wk.cmp.weight" in got and got <= allowed, got
    assert x.grad is None or not x.grad.abs().sum()


def test_off_eval_and_no_grad_leave_the_layer_unchanged():
    x = torch.randn(2, 80, 64)
    base, on = _layer(), _layer(sel_distill=2.0)
    on.load_state_dict(base.state_dict())
    assert torch.equal(base(x), on(x))  # training forward: the output is unchanged
    on.eval()
    with torch.no_grad():
        assert torch.equal(base(x), on(x))
    on.train()
    xb = x.clone().requires_grad_(True)
    (base(xb) ** 2).sum().backward()
    assert base.wk["cmp"].weight.grad is not None
    g_base = base.wk["cmp"].weight.grad.clone()
    xo = x.clone().requires_grad_(True)
    (on(xo) ** 2).sum().backward()
    assert not torch.allclose(on.wk["cmp"].weight.grad, g_base)  # the distillation adds its own
    assert torch.allclose(on.wq.weight.grad, base.wq.weight.grad, atol=1e-6)
    assert torch.allclose(xo.grad, xb.grad, atol=1e-6)


def test_following_the_gradient_lowers_the_loss():
    m = _layer(seed=3, sel_distill=1.0, phi="mlp")
    x = torch.randn(2, 96, 64)
    params = [m.wk["cmp"].weight, *m.phi_k.parameters()]
    first, last = kl_before_and_after(m, x, params, lr=3e-3)
    assert last < 0.7 * first, (first, last)


@pytest.mark.parametrize("span_blocks", [128, 2])
def test_compiled_gradients_equal_eager(span_blocks, monkeypatch):
    """span_blocks 2: the target's block masses in spans (nsa_flex.distill.token_block_mass)."""
    import nsa_flex.distill as distill
    monkeypatch.setattr(distill, "MAX_VALUE_WIDTH", span_blocks)
    x = torch.randn(2, 80, 64)
    eager, comp = _layer(seed=5, sel_distill=1.0), _layer(seed=5, sel_distill=1.0)
    (eager(x) ** 2).sum().backward()
    c = torch.compile(comp, backend="aot_eager", fullgraph=True)
    (c(x) ** 2).sum().backward()
    for (n, a), (_, b) in zip(eager.named_parameters(), comp.named_parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-5, rtol=1e-4), n


def test_context_parallelism_is_refused_by_name():
    from nsa_flex.context_parallel import SeqShard

    m = _layer(sel_distill=1.0)
    m.shard = SeqShard(None, 0, 2)
    with pytest.raises(ValueError, match="sel_distill > 0 and sel_scores=.indexer. do not run under context parallelism"):
        m(torch.randn(1, 40, 64), torch.zeros(1, 80, dtype=torch.long))


def test_attach_loss_seeds_the_loss():
    y = torch.randn(3, requires_grad=True)
    w = torch.tensor(2.0, requires_grad=True)
    out = attach_loss(y * 1.0, (w - 1) ** 2 * 3)
    assert torch.equal(out, y)
    out.sum().backward()
    assert torch.equal(y.grad, torch.ones(3)) and float(w.grad) == 6.0


def test_telemetry_logs_the_kl():
    m = _layer(sel_distill=1.0)
    m.telemetry = True
    m(torch.randn(1, 80, 64))
    kl = float(m.telemetry_stats[tm.DISTILL])
    assert kl > 0
    on = (True, True, True)
    metrics = tm.telemetry_metrics(m.telemetry_stats.view(1, -1), [on])
    assert metrics["nsa/layer0/sel_distill_kl"] == pytest.approx(kl)
    assert "distill KL" in tm.format_layer_line(0, m.telemetry_stats, on)
    off = _layer()
    off.telemetry = True
    off(torch.randn(1, 80, 64))
    assert float(off.telemetry_stats[tm.DISTILL]) == -1
    assert not any("distill" in k for k in tm.telemetry_metrics(off.telemetry_stats.view(1, -1), [on]))


@pytest.mark.parametrize("kw, field", [(dict(sel_distill=-0.5), "sel_distill=-0.5"),
                                       (dict(sel_distill=float("inf")), "sel_distill=inf"),
                                       (dict(sel_distill=1.0, masks="sliding_only"), "sel_distill=1.0")])
def test_config_errors_name_the_field(kw, field):
    with pytest.raises(NSAConfigError, match=field):
        NSAConfig(**{**DBG, **kw})


@pytest.mark.gpu
def test_flex_equals_reference_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    shape = dict(dim=256, n_heads=8, n_kv_heads=2, d_qk=64, d_v=64, l=32, d=16, l_sel=64, n_sel=8,
                 window=256, sel_distill=1.0, phi="mlp")
    ref, flex, x, doc_ids = gpu_kl_pair(shape, lambda m: (m.wq, m.wk["sel"], m.wk["cmp"]))
    kl_ref = float(ref.telemetry_stats[tm.DISTILL])
    gr, gf = ref.wk["cmp"].weight.grad, flex.wk["cmp"].weight.grad
    cos = torch.nn.functional.cosine_similarity(gr.flatten(), gf.flatten(), 0)
    assert cos > 0.98, float(cos)
    c = torch.compile(flex, fullgraph=True)
    flex.zero_grad()
    with torch.autocast("cuda", torch.bfloat16):
        (0 * c(x, doc_ids)).sum().backward()
    assert abs(float(flex.telemetry_stats[tm.DISTILL]) - kl_ref) < 0.03 * kl_ref


@pytest.mark.parametrize("width", [16, 128, 256, 512])
def test_block_mass_passes_at_most_128_value_columns_to_one_call(monkeypatch, width):
    """block_mass: an attention call takes at most MAX_VALUE_WIDTH value columns (flex's forward at
    256 columns -- 16k tokens of 64-token selection blocks -- needs more shared memory than an H100
    has: no config compiles), and the slices' masses are the dense softmax's, document masks too."""
    import nsa_flex.distill as distill
    from nsa_flex.attention import attend_reference

    widths = []

    def spy(q, k, v, spec):
        widths.append(v.shape[-1])
        return attend_reference(q, k, v, spec)

    monkeypatch.setattr(distill, "attend_reference", spy)
    cfg = NSAConfig(**DBG)
    B, H, Hkv, T, D = 2, 4, 2, 40, 16
    g = torch.Generator().manual_seed(width)
    q, k = torch.randn(B, H, T, D, generator=g), torch.randn(B, Hkv, T, D, generator=g)
    values = torch.randn(T, width, generator=g)
    docs = _docs(B, T, [13])
    spec = builder_info("causal").fn(MaskContext(cfg, B, T, "cpu", doc_ids=docs))
    got = distill.block_mass(q, k, values, spec, "reference")
    assert max(widths) <= distill.MAX_VALUE_WIDTH == 128 and len(widths) == -(-width // 128)
    vis = (torch.arange(T).view(T, 1) >= torch.arange(T)) & (docs.view(B, 1, T, 1) == docs.view(B, 1, 1, T))
    s = (q.view(B, Hkv, H // Hkv, T, D) @ k.unsqueeze(2).transpose(-1, -2)) / math.sqrt(D)
    p = s.masked_fill(~vis.unsqueeze(1), float("-inf")).softmax(-1)
    torch.testing.assert_close(got, (p @ values).mean(2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T,cuts", [(40, []), (40, [13]), (37, [5, 30]), (8, [])])
def test_token_block_mass_spans_read_their_own_keys_and_equal_the_dense_softmax(monkeypatch, T, cuts):
    """token_block_mass over more blocks than one call's values take: one call per span of
    MAX_VALUE_WIDTH blocks, each reading only its span's keys (none after it: K/V cut there; none
    before it: masked), and the spans' masses rescaled by their log-sum-exps are the dense
    softmax's masses, with documents (a row that sees no key of a span) too; the gradients to q and
    k are the column-slice path's. (MAX_VALUE_WIDTH is 4 here so that 40 tokens in blocks of 2 make
    five spans.)"""
    import nsa_flex.distill as distill
    from nsa_flex.attention import attend_reference

    calls = []

    def spy(q, k, v, spec):
        vis = spec.dense(q.shape[0], q.shape[2], k.shape[2], device="cpu")  # [B|1, 1, T, S]
        keys = vis.any(0).any(0).any(0).nonzero().flatten()
        calls.append((v.shape[-1], k.shape[2], int(keys.min()) if len(keys) else None))
        return attend_reference(q, k, v, spec)

    monkeypatch.setattr(distill, "attend_reference", spy)
    monkeypatch.setattr(distill, "MAX_VALUE_WIDTH", 4)
    cfg = NSAConfig(**DBG)
    B, H, Hkv, D, l_sel = 2, 4, 2, 16, 2
    g = torch.Generator().manual_seed(T + len(cuts))
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, Hkv, T, D, generator=g, dtype=torch.float64, requires_grad=True)
    docs = _docs(B, T, cuts)
    spec = builder_info("causal").fn(MaskContext(cfg, B, T, "cpu", doc_ids=docs))
    got = distill.token_block_mass(q, k, spec, l_sel, "reference")
    ns, span = -(-T // l_sel), 4 * l_sel
    if ns > 4:
        assert [c[0] for c in calls] == [4] * len(calls) and len(calls) == -(-T // span)
        assert [c[1] for c in calls] == [min(lo + span, T) for lo in range(0, T, span)]
        assert all(c[2] is None or c[2] >= lo for c, lo in zip(calls, range(0, T, span)))
    vis = (torch.arange(T).view(T, 1) >= torch.arange(T)) & (docs.view(B, 1, T, 1) == docs.view(B, 1, 1, T))
    s = (q.view(B, Hkv, H // Hkv, T, D) @ k.unsqueeze(2).transpose(-1, -2)) / math.sqrt(D)
    p = s.masked_fill(~vis.unsqueeze(1), float("-inf")).softmax(-1)
    onehot = torch.nn.functional.one_hot(torch.arange(T) // l_sel, ns).double()
    want = (p @ onehot).mean(2)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    w = torch.randn(want.shape, generator=g, dtype=torch.float64)
    gq, gk = torch.autograd.grad((got * w).sum(), (q, k))
    monkeypatch.setattr(distill, "MAX_VALUE_WIDTH", 128)  # one call, the whole softmax
    cq, ck = torch.autograd.grad((distill.token_block_mass(q, k, spec, l_sel, "reference") * w).sum(), (q, k))
    torch.testing.assert_close(gq, cq, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(gk, ck, rtol=1e-6, atol=1e-8)


@pytest.mark.gpu
def test_token_block_mass_spans_on_flex_equal_reference_on_gpu(monkeypatch):
    """The spans' flex calls (each with its log-sum-exp, compiled by attend_flex) and their merge
    against the reference backend, fp32, with documents: masses and the gradients to q and k.
    (Spans of 4 blocks: 1024 tokens in 64-token blocks make four.)"""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import nsa_flex.distill as distill

    monkeypatch.setattr(distill, "MAX_VALUE_WIDTH", 4)
    cfg = NSAConfig(**{**DBG, "l_sel": 64})
    B, H, Hkv, T, D = 2, 4, 2, 1024, 64
    g = torch.Generator().manual_seed(0)
    q0, k0 = torch.randn(B, H, T, D, generator=g), torch.randn(B, Hkv, T, D, generator=g)
    docs = _docs(B, T, [300, 700])
    w = torch.randn(B, Hkv, T, T // 64, generator=g).cuda()
    res = {}
    for backend in ("reference", "flex"):
        q, k = q0.cuda().requires_grad_(), k0.cuda().requires_grad_()
        spec = builder_info("causal").fn(MaskContext(cfg, B, T, "cuda", doc_ids=docs.cuda()))
        got = distill.token_block_mass(q, k, spec, 64, backend)
        res[backend] = (got.detach(), *torch.autograd.grad((got * w).sum(), (q, k)))
    for a, b in zip(res["flex"], res["reference"]):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-4)


def test_block_mass_slices_fit_flex_forward_tiles_on_h100():
    """The shared memory of flex's default forward tiles on an H100 / H200 (inductor's own table)
    for a block_mass call at d_qk 64 in bf16: the q tile and, per pipeline stage, a k and a v tile.
    At 256 value columns that is 262144 bytes, what inductor reported for the indexer at 16k (no
    config compiled, the card has 232448); at MAX_VALUE_WIDTH it fits."""
    heuristics = pytest.importorskip("torch._inductor.template_heuristics.triton")
    import nsa_flex.distill as distill

    conf = heuristics.CUDAConfigHeuristic().h100_default_flex_config[(torch.bfloat16, 64)]

    def shared_bytes(width):
        return 2 * (conf.block_m * 64 + conf.num_stages * conf.block_n * (64 + width))

    assert shared_bytes(256) == 262144
    assert shared_bytes(distill.MAX_VALUE_WIDTH) <= 232448
