"""Each branch's executor is chosen once, when the layer is built (`NSAAttention.plans`, from
`nsa_flex.attention.plan_branch` and the mask registry's `builder_info`), and the selected op's
tile choices follow from its tuning record: pinned here for every shipped flavor and preset, so a
refactor of the dispatch that changes what runs on the GPU fails on the CPU."""

import dataclasses

import pytest
import torch

from masks import MaskContext, builder_info, get_mask_builder, list_mask_builders, register_mask_builder
from masks.builders import selection
from nsa_flex import NSAAttention, NSAConfig
from nsa_flex.ops import DEFAULT_TUNING, HAS_TRITON
from nsa_flex.ops.selected_tuning import tile_positions
from nsa_flex.rules import random_topn

# flavor -> (G, d_qk) and the op's choices there: forward q block rows, positions per forward q
# block, dQ by atomics in the dK/dV pass, positions per dQ q block, hybrid dQ (wide blocks'
# positions per narrow one), (num_warps, num_stages) of fwd / dq / dq's wide pass in bf16
FLAVORS = {
    "debugmodel": ((2, 16), 16, 8, True, None, 0, ((2, 2), None, None)),
    "30M": ((16, 32), 64, 4, True, None, 0, ((4, 2), None, None)),
    "30M_kv4": ((4, 32), 16, 4, True, None, 0, ((2, 2), None, None)),
    "125M": ((8, 64), 16, 2, True, None, 0, ((2, 2), None, None)),
    "350M": ((8, 64), 16, 2, True, None, 0, ((2, 2), None, None)),
    "1B": ((16, 64), 64, 4, False, 1, 4, ((4, 2), (2, 2), (4, 1))),
    "paper": ((16, 192), 64, 4, False, 1, 4, ((4, 2), (2, 2), (4, 1))),  # NSAConfig's defaults
}


def flavor_config(name: str) -> NSAConfig:
    if name == "paper":
        return NSAConfig()
    from nsa_flex.titan.args import nsa_flex_args

    return nsa_flex_args[name].nsa_config()


def plans(cfg) -> dict:
    layer = NSAAttention(dataclasses.replace(cfg, dim=16))  # the plans do not depend on dim
    return {b: (p.executor, p.docs_executor, p.strict) for b, p in layer.plans.items()}


NSA_PLAN = {"cmp": ("cudnn", "flex", False), "sel": ("selected", "selected", False),
            "win": ("flex", "flex", False)}


@pytest.mark.parametrize("flavor", FLAVORS)
def test_shipped_flavors_plan_the_same_executors(flavor):
    """Every flavor (the nsa preset, sel_kernel and cmp_kernel auto): the compressed branch on
    cuDNN without documents and on flex with them, the selection on our op, the window on flex."""
    cfg = flavor_config(flavor)
    assert plans(cfg) == NSA_PLAN
    assert NSAAttention(dataclasses.replace(cfg, dim=16)).plans["cmp"].cmp == (cfg.l, cfg.d)


@pytest.mark.parametrize("flavor", FLAVORS)
def test_shipped_flavors_keep_the_ops_tiles(flavor):
    """The selected op's tile and launch choices at each flavor's group and head dim (what the
    module settings gave before they became `SelectedTuning`)."""
    (G, dk), rows, P, fused, P_dq, kw, (fwd, dq, dq_wide) = FLAVORS[flavor]
    cfg = flavor_config(flavor)
    assert (cfg.n_heads // cfg.n_kv_heads, cfg.d_qk) == (G, dk)
    t = DEFAULT_TUNING
    assert t.fwd_rows(G) == rows and tile_positions(G, rows) == P and t.fuse_dq(G, dk) == fused
    launch = lambda kern, r: tuple(t.launch_opts(kern, torch.bfloat16, r).values())  # noqa: E731
    assert launch("fwd", rows) == fwd and launch("dkv", 16) == (8, 2) and t.dkv_rows == 128
    assert (t.heavy, t.split_tiles) == (16, 256)
    if not fused:
        assert tile_positions(G, t.rows) == P_dq and t.dq_hybrid(G, rows, t.rows) == kw
        assert launch("dq", t.rows) == dq and launch("dq", rows) == dq_wide
    assert launch("fwd", 16) == (2, 2) and tuple(t.launch_opts("fwd", torch.float32, 16).values()) == (8, 2)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")
@pytest.mark.parametrize("flavor", FLAVORS)
def test_shipped_flavors_build_the_ops_lists(flavor):
    """`selected_lists` at each flavor's shape: the forward's lists for q blocks of P positions,
    the dQ pass's own lists only where it runs (dQ not fused) on q blocks of another size."""
    from nsa_flex.ops import selected_lists

    (G, dk), rows, P, fused, P_dq, kw, _ = FLAVORS[flavor]
    cfg = flavor_config(flavor)
    B, T, Hkv = 1, 4 * cfg.l_sel + 3, cfg.n_kv_heads
    idx = random_topn(cfg, B, T, torch.zeros(1, T, dtype=torch.long), 0, "cpu")
    spec = get_mask_builder("topn")(MaskContext(cfg, B, T, torch.device("cpu"), topn=lambda: idx))
    out = selected_lists(spec, B, T, T, G, dk, "cpu")
    assert out["rows"] == rows and out["tuning"] == DEFAULT_TUNING
    assert out["block_mask"][0].shape == (B, Hkv, -(-T // P))
    assert ("dq_block_mask" in out) == (not fused)
    if not fused:
        assert out["dq_block_mask"][0].shape == (B, Hkv, -(-T // P_dq))


PRESET_PLANS = {
    "nsa": NSA_PLAN,
    "full_causal": {"sel": ("sdpa", "flex", False)},
    "sliding_only": {"win": ("flex", "flex", False)},
    "random_selection": NSA_PLAN,
    "local_selection": NSA_PLAN,
    # the scorer's compressed keys and lse: the compressed-causal mask runs though the branch is off
    "no_compressed": NSA_PLAN,
}


@pytest.mark.parametrize("preset", PRESET_PLANS)
def test_presets_plan(preset):
    assert plans(NSAConfig(masks=preset)) == PRESET_PLANS[preset]


def test_kernel_knobs_and_backend_reach_the_plan():
    """sel_kernel / cmp_kernel flex plan flex; triton / cudnn / cudnn_lean plan their executor
    strictly (an error where it cannot run); the backend is kept for the call (auto: per device)."""
    cfg = NSAConfig(sel_kernel="flex", cmp_kernel="flex")
    assert plans(cfg) == {b: ("flex", "flex", False) for b in ("cmp", "sel", "win")}
    got = plans(NSAConfig(sel_kernel="triton", cmp_kernel="cudnn_lean"))
    assert got["sel"] == ("selected", "selected", True) and got["cmp"] == ("cudnn_lean", "flex", True)
    assert plans(NSAConfig(cmp_kernel="cudnn"))["cmp"] == ("cudnn", "flex", True)
    layer = NSAAttention(NSAConfig(backend="reference"))
    assert {p.backend for p in layer.plans.values()} == {"reference"}


def test_layer_runs_its_plan_not_a_route_per_call(monkeypatch):
    """The layer's forward calls each branch's plan with whether the step has documents; changing
    the plan changes what runs (here: every branch on the reference backend, checked by a spy)."""
    from nsa_flex.attention import BranchPlan

    cfg = NSAConfig(dim=32, n_heads=4, n_kv_heads=2, d_qk=16, d_v=16, l=8, d=4, l_sel=16,
                    n_sel=3, window=16, backend="reference")
    layer = NSAAttention(cfg)
    seen = []
    real = BranchPlan.attend

    def spy(plan, q, k, v, spec, docs=False, scale=None):
        seen.append((plan.executor, docs))
        return real(plan, q, k, v, spec, docs, scale)

    monkeypatch.setattr(BranchPlan, "attend", spy)
    x = torch.randn(1, 40, 32)
    layer(x)
    layer(x, torch.tensor([[0] * 20 + [1] * 20]))
    assert seen == [("cudnn", False), ("selected", False), ("flex", False),
                    ("cudnn", True), ("selected", True), ("flex", True)]


def test_registry_answers_what_builders_need():
    """The layer and the decode step ask the registry, not builder names: which builder scores
    (needs the compressed keys), draws per step, runs natively, decodes on which branch."""
    assert builder_info("topn").scores and not builder_info("local_selection").scores
    assert builder_info("random_selection").step and not builder_info("topn").step
    assert builder_info("causal").native == "causal"
    assert builder_info("compressed_causal").native == "compressed_causal"
    assert builder_info("sliding_window").native is None
    assert list_mask_builders(decode="sel") == ["causal", "local_selection", "none", "topn"]
    assert list_mask_builders(decode="cmp") == ["compressed_causal", "none"]
    assert list_mask_builders(decode="win") == ["none", "sliding_window"]
    with pytest.raises(KeyError, match="unknown mask builder 'nope'"):
        builder_info("nope")


def _scored_band(ctx):
    """A user's selection builder that reads the scorer's picks (keeps the first half of them)."""
    idx = ctx.topn()
    return selection(idx[..., : max(1, idx.shape[-1] // 2)], ctx.cfg.l_sel)


def test_custom_builder_says_what_it_needs():
    """A user's builder registered with scores=True gets the compressed branch's keys and lse
    even with that branch off (as topn does), one with step=True a draw per step; decode refuses
    both, naming the builders it supports."""
    from types import SimpleNamespace

    from nsa_flex.inference.decode import branch_modes, cache_branches

    register_mask_builder("test_scored_half", "selection", _scored_band, replace=True, scores=True)
    assert builder_info("test_scored_half").scores
    cfg = NSAConfig(dim=32, n_heads=4, n_kv_heads=2, d_qk=16, d_v=16, l=8, d=4, l_sel=16,
                    n_sel=3, window=16, masks="no_compressed", sel_mask="test_scored_half",
                    backend="reference")
    layer = NSAAttention(cfg)
    assert set(layer.plans) == {"cmp", "sel", "win"} and not layer.draws
    assert layer(torch.randn(1, 40, 32)).shape == (1, 40, 32)
    assert cache_branches({"cmp": "none", "sel": "test_scored_half", "win": "none"}) == ("cmp", "sel")
    with pytest.raises(NotImplementedError, match=r"decode supports sel mask builders \('causal', "
                                                  r"'local_selection', 'none', 'topn'\), not 'test_scored_half'"):
        branch_modes(SimpleNamespace(branch_names=cfg.branch_masks(), cfg=cfg))
    register_mask_builder("test_drawn", "selection", _scored_band, replace=True, step=True)
    assert NSAAttention(dataclasses.replace(cfg, sel_mask="test_drawn")).draws


def test_executors_hand_what_they_cannot_run_to_flex(monkeypatch):
    """Off CUDA every executor a plan can name but the strict ones hands the call to flex (SDPA and
    cuDNN need CUDA, our op CUDA or the interpreter); the reference backend never reaches them."""
    import nsa_flex.attention as A

    cfg = NSAConfig(dim=32, n_heads=4, n_kv_heads=2, d_qk=16, d_v=16, l=8, d=4, l_sel=16,
                    n_sel=3, window=16)
    B, T = 1, 48
    q, k, v = torch.randn(B, 4, T, 16), torch.randn(B, 2, T, 16), torch.randn(B, 2, T, 16)
    spec = get_mask_builder("causal")(MaskContext(cfg, B, T, torch.device("cpu")))
    ref = A.attend_reference(q, k, v, spec)
    monkeypatch.setattr(A, "attend_flex", lambda *a: "flex")
    for name in A.EXECUTORS:
        plan = A.BranchPlan("flex", name, name, cmp=(cfg.l, cfg.d))
        assert plan.attend(q, k, v, spec) == "flex", name
        out = dataclasses.replace(plan, backend="reference").attend(q, k, v, spec)
        assert all(torch.equal(a, b) for a, b in zip(out, ref))
