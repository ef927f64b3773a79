"""Inference at the model level (nsa_flex.titan.model.NSATransformer): prefill + decode logits ==
full-forward logits; the generation command on a DCP checkpoint; the decode benchmark's CPU mode."""

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("torchtitan")

from nsa_flex.inference.model import (generate, model_decode_step, model_prefill,  # noqa: E402
                                      new_model_cache, sample)
from nsa_flex.titan.args import nsa_flex_args  # noqa: E402
from nsa_flex.titan.model import NSATransformer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "titan_configs", "debug_nsa.toml")


pytestmark = pytest.mark.usefixtures("single_thread")  # hundreds of tiny ops per token


def make_model(seed=0, doc_masking=False, phi="avg", masks="nsa", vocab=64, eos=3):
    args = nsa_flex_args["debugmodel"]
    args.backend, args.vocab_size, args.doc_masking, args.eos_id = "reference", vocab, doc_masking, eos
    args.phi, args.masks = phi, masks
    torch.manual_seed(seed)
    model = NSATransformer(args)
    with torch.no_grad():
        model.init_weights()
        for blk in model.layers.values():  # gates away from their 0.5 init
            blk.attention.gate.weight.normal_(0, 0.3)
    return model.eval()


@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.integers(0, 1000), st.booleans(), st.sampled_from(["avg", "mlp"]),
       st.integers(1, 2), st.integers(40, 300))
def test_model_prefill_decode_equals_forward(seed, docs, phi, B, T):
    model = make_model(seed, docs, phi)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 64, (B, T), generator=gen)  # eos_id 3 appears: documents split
    with torch.no_grad():
        full = model(tokens)
    P = torch.randint(1, T + 1, (B,), generator=gen)
    cache = new_model_cache(model, B, T + int(P.max() - P.min()))
    logits = model_prefill(model, tokens[:, : int(P.max())], cache, P)
    got = torch.zeros_like(full)
    rows = torch.arange(B)
    for b in range(B):
        got[b, : P[b]] = logits[b, : P[b]]
    for k in range(T - int(P.min())):
        t = (P + k).clamp_max(T - 1)
        out = model_decode_step(model, tokens[rows, t], cache)
        live = P + k < T
        got[rows[live], t[live]] = out[live]
    err = (got - full).abs().max().item()
    assert err <= 1e-4, err


def test_sample_top_p():
    logits = torch.tensor([[0.0, 10.0, 9.0, -5.0]])
    assert sample(logits, greedy=True).tolist() == [1]
    g = torch.Generator().manual_seed(0)
    draws = {sample(logits, 1.0, 0.5, generator=g).item() for _ in range(50)}
    assert draws == {1}  # top-p 0.5 keeps only the most likely token here
    draws = {sample(logits, 1.0, 0.99, generator=g).item() for _ in range(200)}
    assert draws == {1, 2}


def test_generate_greedy_matches_uncached():
    model = make_model(1)
    prompts = [[5, 6, 7], [9] * 20]
    r = generate(model, prompts, 12, greedy=True)
    for p, g in zip(prompts, r["tokens"]):
        ids = list(p)
        for _ in range(12):
            with torch.no_grad():
                ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
        assert g == ids[len(p):]


@pytest.mark.skipif(not os.path.isfile(CONFIG), reason="titan_configs/debug_nsa.toml missing")
def test_generate_command_on_dcp_checkpoint(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    from nsa_flex.apps.generate import build_model, load_job_config, main

    job_config = load_job_config(CONFIG)
    model, tok = build_model(job_config)
    with torch.no_grad():
        model.init_weights()
    # the layout torchtitan 0.2.2 writes: model keys flattened at the top level, other states beside
    sd = dict(model.state_dict())
    sd["train_state"] = {"step": torch.tensor(7)}
    dcp.save(sd, checkpoint_id=str(tmp_path / "checkpoint" / "step-7"))
    r = main(["--config", CONFIG, "--checkpoint", str(tmp_path / "checkpoint"), "--prompt", "hi",
              "--max-new-tokens", "8", "--greedy", "--device", "cpu"])
    out = capsys.readouterr()
    assert "tokens/s" in out.err and "hi" in out.out
    ids = tok.encode("hi", add_bos=True)
    model.eval()
    for _ in range(8):
        with torch.no_grad():
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    gen = ids[-8:]
    if tok.eos_id in gen:
        gen = gen[: gen.index(tok.eos_id) + 1]
    assert r["tokens"][0] == gen
    # nested {"model": ...} layout and sampling
    dcp.save({"model": dict(model.state_dict())}, checkpoint_id=str(tmp_path / "nested"))
    r = main(["--config", CONFIG, "--checkpoint", str(tmp_path / "nested"), "--prompt", "a",
              "--prompt", "longer prompt", "--max-new-tokens", "4", "--temperature", "0.8",
              "--top-p", "0.9", "--device", "cpu"])
    assert len(r["tokens"]) == 2


def test_bench_decode_quick(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "bench_decode", os.path.join(ROOT, "experiments", "bench_decode.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.main(["--quick", "--contexts", "1024", "--batches", "1,2", "--reps", "1",
                     "--out", str(tmp_path)])
    assert (tmp_path / "bench_decode.csv").is_file()
    assert [r["nsa_reads"] for r in rows] == [63 + 1024 + 512] * 2
