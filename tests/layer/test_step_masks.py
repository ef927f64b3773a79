"""The masks the layers of a step share (`nsa_flex.layer.StepMasks`): a layer given them computes
bit for bit what it computes with its own; the BlockMask built ahead is the one flex reads; a
compiled layer takes fresh ones every step without recompiling, or builds its own inside the
graph; the selection is never shared."""

import pytest
import torch
import torch._dynamo

from masks import register_mask_builder, sliding_window
from nsa_flex import NSAAttention, NSAConfig
from nsa_flex.layer import shares_mask

from .test_layer import BASE, docs_for, make_layer

pytestmark = pytest.mark.usefixtures("single_thread")

B, T = 2, 96
DOCS = docs_for(B, T, [(0, 40, 41), (0, 70)])


# the selection-training configurations whose layers read the step's dense causal mask too
SCORERS = {"indexer": dict(sel_scores="indexer", sel_distill=1.0, indexer_heads=2),
           "distill": dict(sel_distill=1.0)}


@pytest.mark.parametrize("doc_ids", [None, DOCS], ids=["no_docs", "docs"])
@pytest.mark.parametrize("masks", ["nsa", "full_causal", "random_selection", "no_compressed",
                                   "nsa+indexer", "nsa+distill"])
def test_shared_masks_bit_identical_outputs_and_grads(masks, doc_ids):
    """Reference backend with autograd (training mode: the distillation's loss included): output
    and every gradient equal (torch.equal)."""
    masks, _, scorer = masks.partition("+")
    m = make_layer(masks=masks, dtype=torch.float64, **SCORERS.get(scorer, {}))
    x = torch.randn(B, T, BASE["dim"], dtype=torch.float64, requires_grad=True)
    own = m(x, doc_ids)
    g_own = torch.autograd.grad(own.square().sum(), [x, *m.parameters()], allow_unused=True)
    shared = m(x, masks=m.step_masks(B, T, x.device, doc_ids))
    g_shared = torch.autograd.grad(shared.square().sum(), [x, *m.parameters()], allow_unused=True)
    assert torch.equal(own, shared)
    for a, b in zip(g_own, g_shared):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))


@pytest.mark.parametrize("doc_ids", [None, DOCS], ids=["no_docs", "docs"])
def test_flex_prebuilt_block_masks_read_by_flex(doc_ids):
    """Flex backend (CPU forward): the compressed and window masks carry their BlockMask, flex
    reads that one (the same object), and the output equals the layer's own masks' bit for bit."""
    m = make_layer(backend="flex", cmp_kernel="flex").eval()
    x = torch.randn(B, T, BASE["dim"])
    masks = m.step_masks(B, T, x.device, doc_ids)
    assert sorted(masks.specs) == ["cmp", "win"]
    assert all(s.built is not None for s in masks.specs.values())
    seen = []
    real = masks.specs["win"].block_mask

    def spy(*a, **kw):
        bm = real(*a, **kw)
        seen.append(bm)
        return bm

    object.__setattr__(masks.specs["win"], "block_mask", spy)
    with torch.no_grad():
        shared = m(x, masks=masks)
        own = m(x, doc_ids)
    assert seen and all(bm is masks.specs["win"].built for bm in seen)
    assert torch.equal(own, shared)


@pytest.mark.parametrize("doc_ids", [None, DOCS], ids=["no_docs", "docs"])
def test_dense_causal_mask_shared_with_the_indexer(doc_ids):
    """The indexer's dense causal mask comes with the step's masks, its BlockMask built ahead; the
    indexer's flex call reads that one, and the output equals the layer's own masks' bit for bit.
    Configurations without an indexer or a distillation build none."""
    assert "dense" not in make_layer().step_masks(B, T, "cpu", doc_ids).specs
    m = make_layer(backend="flex", cmp_kernel="flex", **SCORERS["indexer"]).eval()
    x = torch.randn(B, T, BASE["dim"])
    masks = m.step_masks(B, T, x.device, doc_ids)
    dense = masks.specs["dense"]
    assert dense.built is not None and masks.kv_lens["dense"] == T
    seen = []
    real = dense.block_mask

    def spy(*a, **kw):
        seen.append(real(*a, **kw))
        return seen[-1]

    object.__setattr__(dense, "block_mask", spy)
    with torch.no_grad():
        shared = m(x, masks=masks)
        own = m(x, doc_ids)
    assert seen and all(bm is dense.built for bm in seen)
    assert torch.equal(own, shared)


def test_compiled_layer_fresh_masks_every_step_no_recompile():
    """A compiled layer (fullgraph, flex backend, forward) given a new StepMasks each step, as the
    torchtitan model passes them to its compiled blocks: one graph, outputs equal the compiled
    layer's own masks' bit for bit."""
    torch._dynamo.reset()
    m = make_layer(backend="flex", cmp_kernel="flex").eval()
    shared = torch.compile(m, backend="aot_eager", fullgraph=True)
    own = torch.compile(make_layer(backend="flex", cmp_kernel="flex").eval(), backend="aot_eager",
                        fullgraph=True)
    with torch.no_grad():
        for step in range(3):
            x = torch.randn(B, T, BASE["dim"])
            with torch._dynamo.config.patch(error_on_recompile=step > 0):
                a = shared(x, masks=m.step_masks(B, T, x.device, DOCS))
                b = own(x, DOCS)
            assert torch.equal(a, b)


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
@pytest.mark.parametrize("doc_ids", [None, DOCS], ids=["no_docs", "docs"])
@pytest.mark.parametrize("masks", ["nsa", "full_causal"])
def test_compiled_layer_builds_its_own_masks(masks, doc_ids, compiler):
    """A layer compiled standalone (fullgraph, flex backend, forward) builds its StepMasks in
    the graph, BlockMasks included (as a benchmark of one layer runs it): it traces on every
    supported torch (2.11's dynamo could not bind a dataclass default of a user class there)
    and equals the eager layer."""
    torch._dynamo.reset()
    m = make_layer(backend="flex", masks=masks).eval()
    x = torch.randn(B, T, BASE["dim"])
    with torch.no_grad():
        got = torch.compile(m, backend=compiler, fullgraph=True, dynamic=False)(x, doc_ids)
        want = m(x, doc_ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_shares_mask_rule():
    """Shared: the compressed and window masks of builders that read neither the scores nor the
    step's draw. Not shared: the selection branch, whatever its builder, and a token builder on
    the window branch that declares the draw."""
    assert shares_mask("cmp", "compressed_causal") and shares_mask("win", "sliding_window")
    assert shares_mask("win", "causal")
    assert not any(shares_mask("sel", n) for n in ("topn", "causal", "local_selection"))

    def drawn_window(ctx):
        return sliding_window(ctx.cfg.window)

    register_mask_builder("test_step_masks_drawn", "token", drawn_window, replace=True, step=True)
    assert not shares_mask("win", "test_step_masks_drawn")
    m = NSAAttention(NSAConfig(**{**BASE, "win_mask": "test_step_masks_drawn"}))
    assert "win" not in m.step_masks(B, T, "cpu").specs


def test_masks_for_another_length_refused():
    m = make_layer()
    x = torch.randn(B, T, BASE["dim"])
    with pytest.raises(ValueError, match="masks for T="):
        m(x, masks=m.step_masks(B, T // 2, x.device))
    with pytest.raises(ValueError, match="doc_ids passed beside masks"):
        m(x, DOCS, masks=m.step_masks(B, T, x.device, DOCS))


def test_fsdp_input_cast_keeps_outputs():
    """fully_shard's mixed precision casts a block's floating-point arguments, dataclasses
    included (torch.distributed.utils._apply_to_tensors): the StepMasks it rebuilds (cos / sin in
    bf16, BlockMasks as they were) give the same output, bit for bit."""
    from torch.distributed.utils import _apply_to_tensors

    m = make_layer(backend="flex", cmp_kernel="flex", dtype=torch.bfloat16).eval()
    x = torch.randn(B, T, BASE["dim"], dtype=torch.bfloat16)
    masks = m.step_masks(B, T, x.device, DOCS)
    cast = _apply_to_tensors(lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t, masks)
    assert cast.cos.dtype == torch.bfloat16 and cast.specs["win"].built is masks.specs["win"].built
    with torch.no_grad():
        assert torch.equal(m(x, masks=cast), m(x, DOCS))
