"""The selection's dense warm-up (NSAConfig.sel_dense_steps; nsa_flex.rules.all_blocks, the layer's
`dense_selection`, nsa_flex.titan.model.set_dense_selection):

* `all_blocks` lists exactly the valid blocks of every query (forced first), with documents;
* a training forward with the flag on equals the same weights with n_sel = every block (the top-n
  rule then keeps every valid block), differs from the top-n forward, and the flag is ignored in
  eval mode and off; compiled (aot_eager) it follows the flag both ways;
* set_dense_selection switches every layer by the step; the config's errors name the field.
"""

import pytest
import torch
from torch import nn

from nsa_flex import NSAAttention, NSAConfig
from nsa_flex.config import NSAConfigError
from nsa_flex.rules import all_blocks, forced_and_valid
from nsa_flex.titan.model import set_dense_selection
from masks import doc_start

DBG = dict(dim=64, n_heads=4, n_kv_heads=2, d_qk=16, d_v=16, l=8, d=4, l_sel=16, n_sel=3, window=16,
           backend="reference", n_local=1)
T = 96  # 6 selection blocks, 3 selected: the top-n rule drops some


def _layer(**kw):
    torch.manual_seed(0)
    m = NSAAttention(NSAConfig(**{**DBG, **kw}))
    m.init_weights()
    with torch.no_grad():  # peaked scores, so the top-n picks differ from "every block"
        for lin in (m.wq, m.wk["cmp"], m.wk["sel"]):
            lin.weight.normal_(0, 0.5)
        m.gate.bias.fill_(0.0)
    return m


def _docs(B, cuts):
    d = torch.zeros(B, T, dtype=torch.long)
    for c in cuts:
        d[:, c:] += 1
    return d


@pytest.mark.parametrize("cuts", [(), (40,)])
def test_all_blocks_are_the_valid_blocks_forced_first(cuts):
    cfg = NSAConfig(**DBG)
    starts = doc_start(_docs(2, cuts))
    idx = all_blocks(cfg, 2, T, starts, "cpu")
    valid, forced = forced_and_valid(cfg, T, starts, "cpu")
    assert idx.shape == (2, cfg.n_kv_heads, T, -(-T // cfg.l_sel))
    for b in range(2):
        for t in range(T):
            row = [j for j in idx[b, 0, t].tolist() if j >= 0]
            assert sorted(row) == valid[b, t].nonzero().flatten().tolist()
            nf = int(forced[b, t].sum())
            assert set(row[:nf]) == set(forced[b, t].nonzero().flatten().tolist())
            assert idx[b, 0, t, len(row):].eq(-1).all()  # pads last


@pytest.mark.parametrize("cuts", [(), (40,)])
def test_dense_forward_equals_every_block_selected(cuts):
    x = torch.randn(2, T, 64)
    doc_ids = _docs(2, cuts)
    warm, every = _layer(sel_dense_steps=10), _layer(n_sel=T // 16)
    every.load_state_dict(warm.state_dict())
    topn = warm(x, doc_ids)
    warm.dense_selection = True
    dense = warm(x, doc_ids)
    assert torch.allclose(dense, every(x, doc_ids), atol=1e-5)
    assert not torch.allclose(dense, topn, atol=1e-3)  # the warm-up changes what the branch reads
    warm.eval()  # evaluation measures the top-n model
    with torch.no_grad():
        assert torch.equal(warm(x, doc_ids), topn)
    warm.train()
    xg = x.clone().requires_grad_(True)
    warm(xg, doc_ids).sum().backward()
    xe = x.clone().requires_grad_(True)
    every(xe, doc_ids).sum().backward()
    assert torch.allclose(xg.grad, xe.grad, atol=1e-5)
    assert torch.allclose(warm.wk["sel"].weight.grad, every.wk["sel"].weight.grad, atol=1e-5)


def test_compiled_layer_follows_the_flag():
    x = torch.randn(1, T, 64)
    m = _layer(sel_dense_steps=10)
    c = torch.compile(m, backend="aot_eager", fullgraph=True)
    for dense in (True, False, True):
        m.dense_selection = dense
        assert torch.allclose(c(x), m(x), atol=1e-5)


def test_set_dense_selection_follows_the_step():
    layers = nn.ModuleList([_layer(sel_dense_steps=3), _layer(sel_dense_steps=3)])
    assert [set_dense_selection(layers, s) for s in (1, 3, 4, 9)] == [True, True, False, False]
    assert not any(m.dense_selection for m in layers)
    assert set_dense_selection(layers, 2) and all(m.dense_selection for m in layers)
    assert not set_dense_selection(nn.ModuleList([_layer()]), 1)  # off: 0 steps
    assert not set_dense_selection(nn.Linear(2, 2), 1)  # no NSA layer


@pytest.mark.parametrize("kw, field", [(dict(sel_dense_steps=-1), "sel_dense_steps=-1"),
                                       (dict(sel_dense_steps=2.5), "sel_dense_steps=2.5"),
                                       (dict(sel_dense_steps=True), "sel_dense_steps=True"),
                                       (dict(sel_dense_steps=5, masks="sliding_only"), "sel_dense_steps=5")])
def test_config_errors_name_the_field(kw, field):
    with pytest.raises(NSAConfigError, match=field):
        NSAConfig(**{**DBG, **kw})


@pytest.mark.gpu
def test_flex_dense_selection_equals_reference_on_gpu():
    """The selected-attention op and flex read the warm-up's block lists (every earlier block, 16
    a query at 1024 tokens against n_sel = 8) as the reference does; compiled, the flag switches the
    layer both ways."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    shape = dict(dim=256, n_heads=8, n_kv_heads=2, d_qk=64, d_v=64, l=32, d=16, l_sel=64, n_sel=8,
                 window=256, sel_dense_steps=100, phi="mlp")
    torch.manual_seed(0)
    ref = NSAAttention(NSAConfig(**shape, backend="reference")).cuda()
    ref.init_weights()
    flex = NSAAttention(NSAConfig(**shape, backend="flex")).cuda()
    flex.load_state_dict(ref.state_dict())
    x = torch.randn(2, 1024, 256, device="cuda")
    doc_ids = torch.zeros(2, 1024, dtype=torch.long, device="cuda")
    doc_ids[:, 300:] = 1
    c = torch.compile(flex)
    for dense in (True, False, True):
        ref.dense_selection = flex.dense_selection = dense
        with torch.autocast("cuda", torch.bfloat16):
            want = ref(x, doc_ids).float()
            got = c(x, doc_ids).float()
        err = (got - want).abs().max() / want.abs().max()
        assert err < 2e-2, (dense, float(err))
