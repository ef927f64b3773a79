"""Causality property test (hypothesis; >= 200 examples in the "ci" profile, thousands in
"thorough"): random configs (l, d, l', n, n_init, n_local, w, heads, groups, phi, T including
non-multiples of every block size, document boundaries). Changing any input at positions > t --
the hidden states and the document ids -- leaves every output at positions <= t unchanged
(fp32, <= 1e-6), for each branch alone under every registered mask builder of that branch, and
for the whole layer under every preset; the gradient of the outputs <= t with respect to the
inputs > t is exactly zero (reference backend)."""

import pytest
import torch
from hypothesis import example, given, note, settings
from hypothesis import strategies as st

from masks import PRESETS, list_mask_builders, register_mask_builder
from nsa_flex import NSAAttention, NSAConfig

pytestmark = pytest.mark.usefixtures("single_thread")


def variants():
    """(label, config overrides): one branch alone per registered builder, then each preset."""
    out = []
    for name in list_mask_builders("compressed"):
        if name != "none":
            out.append((f"cmp:{name}", dict(cmp_mask=name, sel_mask="none", win_mask="none")))
    for name in list_mask_builders("selection"):
        if name != "none":
            out.append((f"sel:{name}", dict(cmp_mask="none", sel_mask=name, win_mask="none")))
    for name in list_mask_builders("token"):
        if name != "none":
            out.append((f"win:{name}", dict(cmp_mask="none", sel_mask="none", win_mask=name)))
    for preset in sorted(PRESETS):
        out.append((f"preset:{preset}", dict(masks=preset)))
    return out


@st.composite
def cases(draw):
    d = draw(st.integers(1, 3))
    n_init = draw(st.integers(0, 1))
    n_local = draw(st.integers(0, 2))
    Hkv = draw(st.integers(1, 2))
    cfg = dict(
        d=d, l=d * draw(st.integers(1, 3)), l_sel=d * draw(st.integers(1, 3)),
        n_init=n_init, n_local=n_local,
        n_sel=max(1, n_init + n_local + draw(st.integers(0, 2))),
        window=draw(st.integers(1, 20)), n_kv_heads=Hkv, n_heads=Hkv * draw(st.integers(1, 3)),
        d_qk=draw(st.sampled_from([2, 4])), d_v=draw(st.integers(1, 3)), dim=4,
        phi=draw(st.sampled_from(["avg", "mlp"])), backend="reference",
        score_chunk=draw(st.sampled_from([1, 5, 1024])), seed=draw(st.integers(0, 3)))
    B = draw(st.integers(1, 2))
    T = draw(st.integers(1, 40))
    t = draw(st.integers(0, T - 1))
    # document ids: non-decreasing, boundaries anywhere (or none)
    docs = None
    if draw(st.booleans()):
        docs = [sorted(draw(st.lists(st.integers(0, 3), min_size=T, max_size=T))) for _ in range(B)]
    # new document ids after t (still non-decreasing): boundaries after t may move or appear
    new_docs = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    return cfg, B, T, t, docs, new_docs, seed


def perturb_docs(doc_ids, t, gen):
    B, T = doc_ids.shape
    out = doc_ids.clone()
    for b in range(B):
        cur = int(out[b, t])
        for s in range(t + 1, T):
            cur += int(torch.randint(0, 4, (1,), generator=gen)) // 3  # a new document at ~25%
            out[b, s] = cur
    return out


def run(layer, x, doc_ids):
    return layer(x, doc_ids)


@settings()  # the profile: "ci" 200 examples, "thorough" 3000
@example(case=(dict(d=2, l=4, l_sel=6, n_init=1, n_local=2, n_sel=4, window=5, n_kv_heads=2,
                    n_heads=4, d_qk=2, d_v=2, dim=4, phi="mlp", backend="reference",
                    score_chunk=5, seed=0), 2, 37, 17, [[0] * 9 + [1] * 20 + [2] * 8, [0] * 37],
                   True, 1)).via("hand-picked: T and t off every block boundary, documents")
@given(case=cases())
def test_causality(case):
    cfg_kw, B, T, t, docs, new_docs, seed = case
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, 4, generator=gen)
    x2 = x.clone()
    x2[:, t + 1:] = torch.randn(B, T - t - 1, 4, generator=gen) * 3
    doc_ids = None if docs is None else torch.tensor(docs)
    doc2 = doc_ids
    if doc_ids is not None and new_docs:
        doc2 = perturb_docs(doc_ids, t, gen)
    w = torch.randn(B, t + 1, 4, generator=gen)
    note(f"cfg={cfg_kw} B={B} T={T} t={t} docs={docs} doc2={None if doc2 is None else doc2.tolist()}")

    base = NSAAttention(NSAConfig(**cfg_kw))
    with torch.no_grad():  # O(1) weights and non-trivial gates and scores
        for p in base.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (p.shape[-1] ** -0.5 if p.dim() > 1 else 0.5))
    state = base.state_dict()
    for label, over in variants():
        layer = NSAAttention(NSAConfig(**{**cfg_kw, **over}))
        layer.load_state_dict(state)
        with torch.no_grad():
            y = run(layer, x, doc_ids)
            y2 = run(layer, x2, doc2)
        assert y.shape == (B, T, 4) and torch.isfinite(y).all(), label
        err = (y[:, : t + 1] - y2[:, : t + 1]).abs().max().item()
        assert err <= 1e-6, (label, err)
        # gradient of the outputs <= t with respect to the inputs > t: exactly zero
        xg = x.clone().requires_grad_(True)
        (run(layer, xg, doc_ids)[:, : t + 1] * w).sum().backward()
        g = xg.grad
        assert torch.isfinite(g).all(), label
        assert torch.count_nonzero(g[:, t + 1:]) == 0, (label, g[:, t + 1:].abs().max().item())
        if y[:, : t + 1].abs().max() > 0:  # (a branch that sees no key outputs exactly 0)
            assert torch.count_nonzero(g[:, : t + 1]) > 0, label  # the gradient does flow


def test_variants_cover_every_builder_and_preset():
    labels = [v[0] for v in variants()]
    for name in ("compressed_causal",):
        assert f"cmp:{name}" in labels
    for name in ("topn", "random_selection", "local_selection", "causal", "sliding_window"):
        assert f"sel:{name}" in labels
    for name in ("causal", "sliding_window"):
        assert f"win:{name}" in labels
    assert {f"preset:{p}" for p in PRESETS} <= set(labels)


def test_causality_detects_a_leak():
    """Control: the check above fails for a non-causal layer (the layer with its mask swapped
    for a mask that sees the future)."""
    from masks import MaskSpec
    from masks.registry import _register_builtin  # bypasses the registration check, on purpose

    def leaky(ctx):
        return MaskSpec(lambda b, h, q, kv: kv <= q + 1, name="leaky")

    if "test_leaky" not in list_mask_builders("token"):
        _register_builtin("test_leaky", "token", leaky)
    cfg = NSAConfig(dim=4, n_heads=2, n_kv_heads=1, d_qk=2, d_v=2, l=2, d=1, l_sel=2, n_sel=3,
                    window=4, backend="reference", cmp_mask="none", sel_mask="none",
                    win_mask="test_leaky")
    layer = NSAAttention(cfg)
    x = torch.randn(1, 6, 4)
    x2 = x.clone()
    x2[:, 3:] += 1
    assert (layer(x)[:, :3] - layer(x2)[:, :3]).abs().max() > 1e-4


# ---------------------------------------------------------------------- registration
def test_builtin_builders_pass_the_registration_check():
    from masks import check_causal
    from masks.registry import _REGISTRY

    for name, info in sorted(_REGISTRY.items()):
        if not name.startswith("test_"):
            check_causal(name, info.kind, info.fn)


def _leaky_token(ctx):
    from masks import MaskSpec

    return MaskSpec(lambda b, h, q, kv: kv <= q + 1, name="leaky")


def test_register_rejects_a_leaking_builder_naming_the_pair():
    from masks import MaskBuilderError, register_mask_builder

    with pytest.raises(MaskBuilderError, match=r"mask builder 'leaky_next' \(kind 'token'\) is not causal: "
                                               r"query 0 sees key 1 in the reference backend's dense mask"):
        register_mask_builder("leaky_next", "token", _leaky_token)
    assert "leaky_next" not in list_mask_builders()


def test_register_rejects_a_leak_only_flex_sees():
    """The dense mask is causal, flex's block lists mark a future block full (mask_mod unused)."""
    from masks import MaskBuilderError, MaskSpec, causal, register_mask_builder
    from masks.builders import selection_block_flags  # noqa: F401  (the same flags machinery)

    good = causal()

    def kv_blocks(B, Q_LEN, KV_LEN, block_size, q_pack, device, lo, hi):
        nq, nk = -(-Q_LEN * q_pack // block_size[0]), -(-KV_LEN // block_size[1])
        full = torch.ones(1, 1, nq, nk, dtype=torch.bool)  # every block "full": the future too
        return full, full

    def flex_leaky(ctx):
        return MaskSpec(good.mask_mod, kv_blocks=kv_blocks, name="flex_leaky", heads=ctx.cfg.n_kv_heads)

    with pytest.raises(MaskBuilderError, match=r"'flex_leaky'.*query 0 sees key 1 in flex's BlockMask"):
        register_mask_builder("flex_leaky", "selection", flex_leaky)


def test_register_rejects_a_future_compressed_block():
    from masks import MaskBuilderError, MaskSpec, register_mask_builder

    def cmp_all(ctx):
        return MaskSpec(lambda b, h, q, kv: kv >= 0, name="cmp_all")

    with pytest.raises(MaskBuilderError, match=r"'cmp_all'.*query 0 sees compressed key 0 \(tokens up to 3\)"):
        register_mask_builder("cmp_all", "compressed", cmp_all)


def test_reregistering_the_same_function_is_fine_another_needs_replace():
    from masks import MaskBuilderError, get_mask_builder, register_mask_builder
    from masks.registry import _REGISTRY, _causal, _sliding

    try:
        register_mask_builder("test_reg", "token", _causal)
        register_mask_builder("test_reg", "token", _causal)  # a notebook cell run again
        with pytest.raises(MaskBuilderError, match="already registered.*replace=True"):
            register_mask_builder("test_reg", "token", _sliding)
        register_mask_builder("test_reg", "token", _sliding, replace=True)
        assert get_mask_builder("test_reg") is _sliding
    finally:
        _REGISTRY.pop("test_reg", None)


def test_check_runs_builders_on_the_configs_own_fields():
    """The causality check's small layer is NSAConfig's base (`nsa_flex.rules.LayerShape`), not a
    copy of some of its fields: a builder may read any of them (here the head dim, which the old
    copy lacked), and NSAConfig's shape fields are the base's, in its order."""
    import dataclasses

    from masks.builders import sliding_window
    from masks.registry import _REGISTRY, check_config
    from nsa_flex import NSAConfig
    from nsa_flex.rules import LayerShape

    assert issubclass(NSAConfig, LayerShape) and type(check_config()) is LayerShape
    base = [f.name for f in dataclasses.fields(LayerShape)]
    assert [f.name for f in dataclasses.fields(NSAConfig)][:len(base)] == base

    def head_dim_window(ctx):  # a window of d_qk keys
        return ctx.with_docs(sliding_window(ctx.cfg.d_qk))

    try:
        register_mask_builder("test_head_dim_window", "token", head_dim_window)
    finally:
        _REGISTRY.pop("test_head_dim_window", None)
