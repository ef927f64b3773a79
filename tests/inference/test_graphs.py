"""CUDA-graph decode (nsa_flex.inference.graphs): on the CPU, the state snapshot / restore the
capture relies on (a step, restore, the same step again: identical logits and counters; why every
warm-up run starts from the restored state), the clear refusals; on CUDA, graph == eager."""

import pytest
import torch

pytest.importorskip("torchtitan")

from nsa_flex.inference.graphs import check_tokens  # noqa: E402
from nsa_flex.inference.model import (GraphedDecodeStep, generate, model_decode_step,  # noqa: E402
                                      model_prefill, new_model_cache, restore_state,
                                      snapshot_state)
from nsa_flex.titan.args import nsa_flex_args  # noqa: E402
from nsa_flex.titan.model import NSATransformer  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")

EOS = 3


def make_model(doc_masking=False, device="cpu"):
    args = nsa_flex_args["debugmodel"]  # l=8, d=4, l_sel=16, window=32
    args.backend, args.vocab_size, args.doc_masking, args.eos_id = "reference", 64, doc_masking, EOS
    torch.manual_seed(0)
    model = NSATransformer(args)
    with torch.no_grad():
        model.init_weights()
        for blk in model.layers.values():  # gates away from their 0.5 init
            blk.attention.gate.weight.normal_(0, 0.3)
    return model.eval().to(device)


def prefilled(model, lens=(45, 38), extra=8, device="cpu"):
    """A model cache after a prefill of random prompts (rows past the window and the raw ring:
    the step overwrites ring slots)."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(4, 64, (len(lens), max(lens)), generator=g)
    tokens[0, 20] = EOS  # a document boundary inside row 0 (doc masking)
    cache = new_model_cache(model, len(lens), max(lens) + extra)
    model_prefill(model, tokens.to(device), cache, torch.tensor(lens, device=device))
    return cache


def counters(cache):
    return ([c.host_max_len for c in cache.layers], cache.steps, cache.lengths.tolist(),
            [c.doc_start.tolist() for c in cache.layers])


@pytest.mark.parametrize("doc_masking", [False, True])
def test_restore_state_repeats_the_step(doc_masking):
    model = make_model(doc_masking)
    cache = prefilled(model)
    tok = torch.tensor([EOS, 7])  # row 0 ends a document: the step moves its doc_start
    before = counters(cache)
    state = snapshot_state(cache)
    first = model_decode_step(model, tok, cache).clone()
    after = counters(cache)
    assert after != before  # the step advanced what the snapshot holds
    if doc_masking:
        assert after[3] != before[3]
    restore_state(cache, state)
    assert counters(cache) == before
    again = model_decode_step(model, tok, cache)
    assert torch.equal(first, again)
    assert counters(cache) == after
    # and the next step goes on as without the detour
    nxt = model_decode_step(model, torch.tensor([5, 6]), cache)
    ref_cache = prefilled(model)
    model_decode_step(model, tok, ref_cache)
    assert torch.equal(nxt, model_decode_step(model, torch.tensor([5, 6]), ref_cache))


def test_steps_past_the_saved_position_are_not_harmless():
    """Why the capture restores before every warm-up run: a step at lengths + 1 evicts a window
    ring token that the step at lengths reads."""
    model = make_model()
    cache = prefilled(model)
    tok = torch.tensor([9, 7])
    state = snapshot_state(cache)
    first = model_decode_step(model, tok, cache).clone()
    model_decode_step(model, tok, cache)
    restore_state(cache, state)
    assert not torch.equal(first, model_decode_step(model, tok, cache))


def test_graphed_step_refuses_a_cpu_model():
    model = make_model()
    cache = prefilled(model)
    before = counters(cache)
    with pytest.raises(ValueError, match="needs a CUDA model"):
        GraphedDecodeStep(model, cache, 2, model_decode_step)
    assert counters(cache) == before
    with pytest.raises(ValueError, match="needs a CUDA device"):
        generate(model, [[5, 6, 7]], 3, greedy=True, cuda_graphs=True)


def test_check_tokens():
    check_tokens(torch.zeros(2, dtype=torch.long), 2, "cpu")
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        check_tokens(torch.zeros(2, 1, dtype=torch.long), 2, "cpu")
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        check_tokens(torch.zeros(3, dtype=torch.long), 2, "cpu")
    with pytest.raises(ValueError, match="torch.long"):
        check_tokens(torch.zeros(2, dtype=torch.int32), 2, "cpu")
    with pytest.raises(ValueError, match="must be on cuda:0"):
        check_tokens(torch.zeros(2, dtype=torch.long), 2, torch.device("cuda", 0))
    with pytest.raises(ValueError, match="a tensor"):
        check_tokens([1, 2], 2, "cpu")


def test_generate_command_refuses_cuda_graphs_on_cpu(capsys):
    from nsa_flex.apps.generate import main

    with pytest.raises(SystemExit):
        main(["--config", "x.toml", "--checkpoint", "x", "--prompt", "hi", "--device", "cpu",
              "--cuda-graphs"])
    assert "--cuda-graphs needs a CUDA --device" in capsys.readouterr().err


@pytest.mark.gpu  # CUDA graphs need a GPU
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_graphed_step_equals_eager_on_cuda(backend):
    model = make_model(doc_masking=True, device="cuda")
    caches = []
    for _ in range(2):
        c = prefilled(model, extra=24, device="cuda")
        for layer in c.layers:
            layer.decode_backend = backend
        caches.append(c)
    eager_cache, graph_cache = caches
    step = GraphedDecodeStep(model, graph_cache, 2, model_decode_step)
    assert counters(graph_cache) == counters(eager_cache)  # the capture left no trace
    g = torch.Generator().manual_seed(2)
    for k in range(20):
        tok = torch.randint(0, 64, (2,), generator=g).cuda()  # EOS 3 appears: doc_start moves
        ref = model_decode_step(model, tok, eager_cache)
        got = step(tok)
        assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), (k, (got - ref).abs().max())
        assert counters(graph_cache) == counters(eager_cache)
        assert {k: v.tolist() for k, v in graph_cache.reads().items()} == \
            {k: v.tolist() for k, v in eager_cache.reads().items()}
    with pytest.raises(ValueError, match="shape"):
        step(torch.zeros(3, dtype=torch.long, device="cuda"))
    with pytest.raises(ValueError, match="must be on"):
        step(torch.zeros(2, dtype=torch.long))
    while graph_cache.layers[0].host_max_len < graph_cache.capacity:
        step(torch.zeros(2, dtype=torch.long, device="cuda"))
    with pytest.raises(RuntimeError, match="NSACache full"):
        step(torch.zeros(2, dtype=torch.long, device="cuda"))
