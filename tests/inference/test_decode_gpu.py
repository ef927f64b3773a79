"""The decode paths on a CUDA device (marked `gpu`: skipped without one): prefill + decode equals
the full forward for both backends, the Triton step equals the torch step at the paper's head dims,
and the Triton step replayed from a CUDA graph equals its eager run bit for bit."""

import pytest
import torch

from nsa_flex import NSAAttention, NSAConfig
from nsa_flex.compression import PHI
from nsa_flex.inference import decode_step, new_cache, prefill
from nsa_flex.inference.cache import NSACache
from nsa_flex.inference.decode import decode_attention

pytestmark = pytest.mark.gpu

PAPER = dict(dim=2560, n_heads=64, n_kv_heads=4, d_qk=192, d_v=128, l=32, d=16, l_sel=64, n_sel=16,
             window=512)
MODES = {"cmp": "compressed_causal", "sel": "topn", "win": "sliding_window"}
DEV = torch.device("cuda")


@pytest.fixture(autouse=True)
def _fp32_matmuls():
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = tf32


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_prefill_then_decode_equals_forward(backend, T=700):
    """Rows prefilled to different lengths, then decoded token by token to T (fp32)."""
    torch.manual_seed(0)
    cfg = NSAConfig(dim=64, n_heads=8, n_kv_heads=2, d_qk=32, d_v=16, l=16, d=8, l_sel=32,
                    n_sel=4, window=64, backend="reference")
    layer = NSAAttention(cfg).to(DEV)
    with torch.no_grad():
        layer.gate.weight.normal_(0, 0.5)
        x = torch.randn(2, T, cfg.dim, device=DEV)
        full = layer(x)
        p0, p1 = T // 3, (2 * T) // 3
        P = torch.tensor([p0, p1], device=DEV)
        cache = new_cache(layer, 2, T + p1 - p0, decode_backend=backend)
        out = prefill(layer, x[:, :p1], cache, P)
        err = max((out[b, : P[b]] - full[b, : P[b]]).abs().max().item() for b in range(2))
        rows = torch.arange(2, device=DEV)
        for k in range(T - p0):
            t = (P + k).clamp_max(T - 1)
            o = decode_step(layer, x[rows, t].unsqueeze(1), cache)
            live = P + k < T
            err = max(err, (o[live, 0] - full[rows[live], t[live]]).abs().max().item())
    assert err < 1e-3


def _paper_step_inputs(B, dtype, seed):
    cfg = NSAConfig(**PAPER, backend="reference")
    H, Hkv, dk, dv = cfg.n_heads, cfg.n_kv_heads, cfg.d_qk, cfg.d_v
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(B, H, 1, dk, generator=gen, device=DEV, dtype=dtype)
    kv = {b: (torch.randn(B, Hkv, 1, dk, generator=gen, device=DEV, dtype=dtype),
              torch.randn(B, Hkv, 1, dv, generator=gen, device=DEV, dtype=dtype)) for b in MODES}
    g = torch.rand(B, H, 1, 3, generator=gen, device=DEV, dtype=dtype)
    return cfg, q, kv, g, PHI["avg"](cfg.l, cfg.d, dk)


def test_triton_step_equals_torch_at_paper_dims(lens=(700, 3000, 5000), seed=0):
    """One step, G = 16, d_k 192, d_v 128, fp32, rows of different lengths: outputs, selections,
    read counters and the caches after the write."""
    cfg, q, kv, g, phi = _paper_step_inputs(len(lens), torch.float32, seed)
    caches, out = {}, {}
    with torch.no_grad():
        for be in ("torch", "triton"):
            c = NSACache.empty(cfg, len(lens), max(lens) + 1, DEV, torch.float32)
            c.random_fill_(torch.tensor(lens, device=DEV),
                           generator=torch.Generator(device=DEV).manual_seed(seed))
            out[be] = decode_attention(cfg, MODES, q, kv, g, c, phi, phi, backend=be)
            caches[be] = c
    a, b = caches["torch"], caches["triton"]
    assert all(torch.equal(a.reads[k], b.reads[k]) for k in a.reads)
    assert max((getattr(b, k) - t).abs().max().item() for k, t in a.tensors().items()) < 1e-5
    same = (a.last_selection.sort(-1).values == b.last_selection.sort(-1).values).all(-1)
    if same.all():  # a near-tie may pick another block (different reduction order)
        assert (out["torch"] - out["triton"]).abs().max().item() < 1e-3


def test_triton_step_graph_replays_equal_eager(S=20000, B=3, replays=100, seed=0):
    """The Triton step (bf16, rows at different lengths, one with a document start) captured in
    a CUDA graph: every replay gives the eager output bit for bit (fixed split shapes and merge
    order)."""
    cfg, q, kv, g, phi = _paper_step_inputs(B, torch.bfloat16, seed)
    c = NSACache.empty(cfg, B, S, DEV, torch.bfloat16)
    c.random_fill_(torch.tensor([S - 1 - 997 * i for i in range(B)], device=DEV),
                   generator=torch.Generator(device=DEV).manual_seed(seed))
    c.doc_start[-1] = 4096

    def step():
        return decode_attention(cfg, MODES, q, kv, g, c, phi, phi, backend="triton")

    with torch.no_grad():
        ref = step().clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        diffs = []
        for _ in range(replays):
            graph.replay()
            diffs.append((out.float() - ref.float()).abs().max().item())
        assert max(diffs) == 0
        assert torch.equal(step(), ref)
