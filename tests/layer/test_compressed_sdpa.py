"""The compressed branch as causal SDPA over groups of d positions, both routes: traced
(`attend_compressed_sdpa`, cmp_kernel cudnn) and our op (`attend_compressed_lean`, cmp_kernel
cudnn_lean, which reads q through strided views and keeps no packed copies): on the CPU each
runs with fp32 math in place of cuDNN (the GPU test in test_flex_gpu.py
runs cuDNN), against the reference backend on the `compressed_causal` mask: output, lse and
the gradients of q, k, v, for any T (groups that do not fill the last one included), l, d with
d | l, and GQA; exactly causal (hypothesis: no output up to t moves, nor has a gradient, when
inputs after t change). Also which plans take the route: the compressed-causal builder's in a step
without documents, and NSAConfig.cmp_kernel's choices."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from masks.builders import compressed_causal
from nsa_flex import NSAConfig
from nsa_flex.attention import (attend_compressed_lean, attend_compressed_sdpa, attend_reference,
                                plan_branch)
from nsa_flex.rules import num_cmp

pytestmark = pytest.mark.usefixtures("single_thread")


ROUTES = {"traced": attend_compressed_sdpa, "lean": attend_compressed_lean}


def _compare(T, l, d, Hkv, G, seed, route):
    g = torch.Generator().manual_seed(seed)
    S = num_cmp(T, l, d)
    R = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    q, k, v = R(1, Hkv * G, T, 8), R(1, Hkv, S, 8), R(1, Hkv, S, 4)
    spec = compressed_causal(l, d)
    w = R(1, Hkv * G, T, 4)
    res = []
    for fn in (lambda *a: ROUTES[route](*a, l, d), lambda *a: attend_reference(*a, spec)):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out, lse = fn(*leaves)
        grads = torch.autograd.grad((out * w).sum(), leaves)
        res.append((out, lse, *grads))
    (out, lse, *gs), (ro, rl, *rgs) = res
    torch.testing.assert_close(out, ro)
    assert torch.equal(torch.isfinite(lse), torch.isfinite(rl))  # rows before l - 1: -inf
    seen = torch.isfinite(rl)
    torch.testing.assert_close(lse[seen], rl[seen])
    for a, b in zip(gs, rgs):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("route", ROUTES)
@settings(deadline=None)
@given(l_over_d=st.integers(1, 4), d=st.sampled_from([1, 2, 4, 16]), extra=st.integers(0, 70),
       Hkv=st.integers(1, 2), G=st.sampled_from([1, 2, 3]), seed=st.integers(0, 2**16))
def test_compressed_sdpa_equals_reference(route, l_over_d, d, extra, Hkv, G, seed):
    l = l_over_d * d
    _compare(l + extra, l, d, Hkv, G, seed, route)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("T", [32, 33, 46, 47, 48, 1000, 1024])
def test_compressed_sdpa_paper_blocks(T, route):
    """l = 32, d = 16 at the group boundaries (T - 31 a multiple of 16 or not)."""
    _compare(T, 32, 16, 2, 2, T, route)


CFG = dict(dim=16, n_heads=4, n_kv_heads=2, d_qk=8, d_v=8, l=8, d=4, l_sel=16, n_sel=3, window=12)


def test_only_the_plain_compressed_mask_takes_the_route():
    """The compressed-causal builder's plan runs cuDNN on the config's (l, d) in a step without
    documents and flex with them (the mask is not causal then); other builders' plans never."""
    cfg = NSAConfig(**CFG)
    plan = plan_branch(cfg, "compressed_causal")
    assert (plan.executor, plan.docs_executor, plan.cmp) == ("cudnn", "flex", (8, 4))
    assert plan_branch(cfg, "sliding_window").executor == "flex"


def test_cmp_kernel_routing_and_errors(monkeypatch):
    """flex never takes the route, auto falls back to flex where cuDNN cannot run (here: CPU
    tensors), cudnn says why it cannot; an unknown value names the field and the allowed ones."""
    import nsa_flex.attention as A

    monkeypatch.setattr(A, "attend_flex", lambda *a: "flex")
    spec = compressed_causal(8, 4)
    q, k, v = torch.randn(1, 4, 64, 8), torch.randn(1, 2, 15, 8), torch.randn(1, 2, 15, 8)
    plans = {kern: plan_branch(NSAConfig(**CFG, backend="flex", cmp_kernel=kern),
                               "compressed_causal") for kern in ("flex", "auto", "cudnn", "cudnn_lean")}
    assert [(p.executor, p.strict) for p in plans.values()] == \
        [("flex", False), ("cudnn", False), ("cudnn", True), ("cudnn_lean", True)]
    assert plans["flex"].attend(q, k, v, spec) == "flex"
    assert plans["auto"].attend(q, k, v, spec) == "flex"
    for kernel in ("cudnn", "cudnn_lean"):
        with pytest.raises(RuntimeError, match=f"cmp_kernel='{kernel}' cannot run here: .*CUDA"):
            plans[kernel].attend(q, k, v, spec)
        assert plans[kernel].attend(q, k, v, spec, docs=True) == "flex"  # documents: flex
    with pytest.raises(ValueError, match="cmp_kernel='cuda': allowed values"):
        NSAConfig(cmp_kernel="cuda")


@pytest.mark.parametrize("route", ROUTES)
@settings(deadline=None)
@given(l_over_d=st.integers(1, 3), d=st.sampled_from([1, 2, 4, 16]), extra=st.integers(0, 60),
       cut=st.floats(0, 1), G=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_compressed_sdpa_is_causal(route, l_over_d, d, extra, cut, G, seed):
    """Changing the queries after position t and the compressed keys / values that end after t
    leaves every output up to t unchanged (exactly), and the gradient of those outputs with
    respect to the changed inputs is exactly zero: the packing never lets a row read a block
    that has not ended."""
    l = l_over_d * d
    T = l + extra
    t = int(cut * (T - 1))
    S = num_cmp(T, l, d)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)
               for s in ((1, 2 * G, T, 8), (1, 2, S, 8), (1, 2, S, 4)))
    future_key = torch.arange(S) * d + l - 1 > t  # blocks that end after t
    out, _ = ROUTES[route](q, k, v, l, d)
    with torch.no_grad():
        q2, k2, v2 = q.clone(), k.clone(), v.clone()
        q2[:, :, t + 1:] += 5
        k2[:, :, future_key] -= 3
        v2[:, :, future_key] *= -7
    out2, _ = ROUTES[route](q2, k2, v2, l, d)
    assert torch.equal(out[:, :, : t + 1], out2[:, :, : t + 1])
    gq, gk, gv = torch.autograd.grad(out[:, :, : t + 1].sum(), (q, k, v))
    assert not gq[:, :, t + 1:].any() and not gk[:, :, future_key].any()
    assert not gv[:, :, future_key].any()


def test_compiled_op_keeps_no_packed_copies():
    """Compiled (fullgraph, CPU), the lean route (our op) equals its eager self in output and
    gradients, and what the graph keeps for the backward is at most q, k, v, the output and lse
    (and the loss's weights): the packed copies of q and of the output are never saved (the
    traced route keeps them: 128 MiB a layer at the 125M shape, 32k)."""
    l, d, T, Hkv, G = 8, 4, 203, 2, 3
    S = num_cmp(T, l, d)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*s, generator=g) for s in ((1, Hkv * G, T, 16), (1, Hkv, S, 16),
                                                       (1, Hkv, S, 8)))
    w = torch.randn(1, Hkv * G, T, 8, generator=g)

    def f(q, k, v):
        out, lse = attend_compressed_lean(q, k, v, l, d)
        return (out * w).sum(), out, lse

    def run(fn):
        saved = []

        def keep(x):
            saved.append(x.numel() * x.element_size())
            return x

        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda x: x):
            loss, out, lse = fn(*leaves)
        return out, lse, torch.autograd.grad(loss, leaves), sum(saved)

    torch._dynamo.reset()
    ref = run(f)
    got = run(torch.compile(f, fullgraph=True))
    torch.testing.assert_close(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1])
    for a, b in zip(got[2], ref[2]):
        torch.testing.assert_close(a, b)
    # w: what (out * w).sum() keeps for its own backward
    allowed = sum(x.numel() * x.element_size() for x in (q, k, v, ref[0], ref[1], w))
    assert got[3] <= allowed, f"compiled graph keeps {got[3]} bytes, q/k/v/out/lse/w are {allowed}"
    assert not ref[1].requires_grad  # the lse carries no gradient (cuDNN's backward has none)


def test_op_compiles_with_dynamic_shapes():
    """The lean route: one graph with a symbolic length serves lengths with and without a partial last group
    (the op's integer arithmetic stays inside it)."""
    l, d = 8, 4
    f = torch.compile(lambda q, k, v: attend_compressed_lean(q, k, v, l, d)[0], fullgraph=True,
                      dynamic=True)
    for T in (64, 75, 90):
        S = num_cmp(T, l, d)
        q, k, v = torch.randn(1, 4, T, 8), torch.randn(1, 2, S, 8), torch.randn(1, 2, S, 8)
        torch.testing.assert_close(f(q, k, v), attend_compressed_lean(q, k, v, l, d)[0])


def _saved_by_compiled_forward(fn, *args):
    """Element counts of what the compiled forward (inductor's min-cut partition) keeps for the
    backward (counts: on the CPU the math in cuDNN's place keeps its operands reshaped)."""
    import functools

    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    saved = []

    def fw(gm, _):
        for n in next(iter(gm.graph.find_nodes(op="output"))).args[0]:
            v = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
            if isinstance(v, torch.Tensor):
                saved.append(v.numel())
        return gm

    backend = aot_autograd(fw_compiler=fw, bw_compiler=lambda gm, _: gm, partition_fn=functools.partial(
        min_cut_rematerialization_partition, compiler="inductor"))
    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return out, saved


def test_packed_q_rebuilt_in_backward_not_kept(monkeypatch):
    """The traced route keeps cuDNN's packed output and lse but not the packed q (rebuilt from q in
    the backward, `repack_in_backward`): compiled, no kept tensor has the packed q's size; eager
    and compiled, output and gradients equal bit for bit those of the route keeping it."""
    import nsa_flex.attention as attention

    T, l, d, Hkv, G = 45, 8, 4, 2, 3
    S = num_cmp(T, l, d)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*s, generator=g) for s in ((1, Hkv * G, T, 8), (1, Hkv, S, 8), (1, Hkv, S, 4)))
    packed_q = Hkv * G * d * S * 8  # elements; the packed output has d_v 4: another count

    def run(q, k, v):
        out, lse = attend_compressed_sdpa(q, k, v, l, d)
        return out, lse, torch.autograd.grad(out.square().sum(), (q, k, v), create_graph=False)

    def fwd(q, k, v):
        return attend_compressed_sdpa(q, k, v, l, d)

    leaves = lambda: [t.clone().requires_grad_(True) for t in (q, k, v)]  # noqa: E731
    repacked = run(*leaves())
    _, saved = _saved_by_compiled_forward(fwd, *leaves())
    assert packed_q not in saved, saved
    monkeypatch.setattr(attention, "repack_in_backward", lambda fn, *a: fn(*a))
    kept = run(*leaves())
    _, saved_kept = _saved_by_compiled_forward(fwd, *leaves())
    assert packed_q in saved_kept  # the check sees the packed q where it is kept
    for a, b in zip(repacked[:2] + repacked[2], kept[:2] + kept[2]):
        assert torch.equal(a, b)
