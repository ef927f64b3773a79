"""Inference: prefill + token-by-token decode == one full forward; exact read counters;
selection at decode == select_topn (ties to the lower block). CPU, fp32, reference backend."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from masks import doc_start
from nsa_flex import NSAAttention, NSAConfig
from nsa_flex.inference import decode_step, new_cache, prefill
from nsa_flex.rope import apply_rope, rope_cos_sin
from nsa_flex.selection import select_topn

SETTINGS = dict(deadline=None, derandomize=True, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])


pytestmark = pytest.mark.usefixtures("single_thread")  # hundreds of tiny ops per token


def make_layer(cfg: NSAConfig, seed: int) -> NSAAttention:
    torch.manual_seed(seed)
    layer = NSAAttention(cfg)
    with torch.no_grad():
        layer.gate.weight.normal_(0, 0.5)
        layer.gate.bias.normal_(0, 0.5)
        if cfg.phi == "mlp":
            for m in (layer.phi_k, layer.phi_v):
                m.pos.normal_(0, 0.3)
    return layer.eval()


def random_doc_ids(B, T, gen):
    return torch.cumsum((torch.rand(B, T, generator=gen) < 0.02).long(), dim=1)


def check_layer(cfg: NSAConfig, B: int, T: int, prompt_lens: list[int], seed: int,
                docs: bool = False, tol: float = 1e-4):
    """Prefill right-padded prompts of per-row lengths, decode every row to T; compare with the
    layer's full forward over the whole sequences."""
    layer = make_layer(cfg, seed)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, cfg.dim, generator=gen)
    doc_ids = random_doc_ids(B, T, gen) if docs else None
    with torch.no_grad():
        full = layer(x, doc_ids)
    P = torch.tensor(prompt_lens)
    Pm = int(P.max())
    cache = new_cache(layer, B, T + Pm - int(P.min()))
    out = prefill(layer, x[:, :Pm], cache, P, None if doc_ids is None else doc_ids[:, :Pm])
    got = torch.zeros_like(full)
    rows = torch.arange(B)
    for b in range(B):
        got[b, : P[b]] = out[b, : P[b]]
    starts = doc_start(doc_ids) if docs else None
    for k in range(T - int(P.min())):
        t = (P + k).clamp_max(T - 1)  # rows already at T decode padding (ignored)
        ds = starts[rows, t] if docs else None
        o = decode_step(layer, x[rows, t].unsqueeze(1), cache, doc_start=ds)
        live = P + k < T
        got[rows[live], t[live]] = o[live, 0]
    err = (got - full).abs().max().item()
    assert err <= tol, f"max |prefill+decode - full| = {err:.3g} ({cfg}, P={prompt_lens}, T={T})"
    assert cache.host_max_len == Pm + T - int(P.min())


@st.composite
def tiny_configs(draw):
    d = draw(st.sampled_from([1, 2, 4]))
    n_init = draw(st.integers(0, 1))
    n_local = draw(st.integers(0, 2))
    n_kv = draw(st.integers(1, 2))
    return NSAConfig(
        dim=16, n_heads=n_kv * draw(st.integers(1, 3)), n_kv_heads=n_kv,
        d_qk=draw(st.sampled_from([4, 8])), d_v=draw(st.sampled_from([4, 6])),
        l=d * draw(st.integers(1, 3)), d=d, l_sel=d * draw(st.sampled_from([1, 2, 4])),
        n_sel=max(1, n_init + n_local) + draw(st.integers(0, 3)), n_init=n_init, n_local=n_local,
        window=draw(st.integers(1, 40)), phi=draw(st.sampled_from(["avg", "mlp"])),
        masks=draw(st.sampled_from(["nsa", "nsa", "nsa", "no_compressed", "local_selection",
                                    "full_causal", "sliding_only"])),
        backend="reference")


@st.composite
def cases(draw, t_min, t_max):
    cfg = draw(tiny_configs())
    T = draw(st.integers(t_min, t_max))
    B = draw(st.integers(1, 3))
    P = [draw(st.integers(1, T)) for _ in range(B)]
    return cfg, B, T, P, draw(st.integers(0, 2**16)), draw(st.booleans())


@settings(max_examples=30, **SETTINGS)
@given(cases(1, 160))
def test_layer_prefill_decode_equals_forward(case):
    cfg, B, T, P, seed, docs = case
    check_layer(cfg, B, T, P, seed, docs)


@settings(max_examples=2, **SETTINGS)
@given(cases(1500, 2048))
def test_layer_prefill_decode_equals_forward_long(case):
    cfg, B, T, P, seed, docs = case
    check_layer(cfg, B, T, P, seed, docs)


def test_layer_long_paper_blocks():
    """T = 2048 with the paper's block structure (l=32, d=16, l'=64, n=16, w=512), tiny heads:
    long enough for the top-n to choose (32 selection blocks > n), two prompt lengths."""
    cfg = NSAConfig(dim=16, n_heads=4, n_kv_heads=2, d_qk=8, d_v=8, backend="reference")
    check_layer(cfg, 2, 2048, [1100, 1900], seed=3)


# ---------------------------------------------------------------------- selection == select_topn
def full_selection(layer, x):
    """select_topn of the full forward (same q, same compressed keys)."""
    cfg = layer.cfg
    B, T, _ = x.shape
    cos, sin = rope_cos_sin(torch.arange(T), cfg.d_qk, cfg.rope_theta)
    q = apply_rope(layer.wq(x).view(B, T, cfg.n_heads, cfg.d_qk).transpose(1, 2), cos, sin)
    k = apply_rope(layer.wk["cmp"](x).view(B, T, cfg.n_kv_heads, cfg.d_qk).transpose(1, 2), cos, sin)
    return select_topn(q, layer.phi_k(k), None, cfg)


@pytest.mark.parametrize("ties", [False, True])
def test_decode_selection_equals_select_topn(ties):
    cfg = NSAConfig(dim=16, n_heads=4, n_kv_heads=2, d_qk=8, d_v=8, l=4, d=2, l_sel=4, n_sel=3,
                    n_local=1, window=6, backend="reference")
    layer = make_layer(cfg, 0)
    if ties:  # all compressed keys equal: every visible block ties, ties go to the lower index
        with torch.no_grad():
            layer.wk["cmp"].weight.zero_()
    x = torch.randn(2, 90, cfg.dim, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = full_selection(layer, x)  # [B, Hkv, T, n]
    cache = new_cache(layer, 2, 90)
    prefill(layer, x[:, :1], cache)
    for t in range(1, 90):
        decode_step(layer, x[:, t : t + 1], cache)
        got = cache.last_selection.sort(-1).values
        assert torch.equal(got, ref[:, :, t].sort(-1).values), t


# ---------------------------------------------------------------------- read counters
def exact_reads(cfg: NSAConfig, S: int) -> dict[str, int]:
    """Distinct key tokens a decode step at context S reads (n_local >= 1, no documents): every
    visible compressed block; the selected blocks' tokens up to the position (all S tokens while
    ceil(S/l') <= n, else n-1 whole blocks + the current partial one); min(w, S) window tokens."""
    nb = -(-S // cfg.l_sel)
    sel = S if nb <= cfg.n_sel else (cfg.n_sel - 1) * cfg.l_sel + S - (nb - 1) * cfg.l_sel
    return {"cmp": cfg.num_cmp(S), "sel": sel, "win": min(cfg.window, S)}


PAPER_BLOCKS = dict(l=32, d=16, l_sel=64, n_sel=16, window=512)


def _check_reads(cfg, cache, S):
    exp = exact_reads(cfg, S)
    r = cache.reads
    assert int(r["cmp"][0]) == exp["cmp"], (S, r, exp)
    assert (r["sel"] == exp["sel"]).all(), (S, r, exp)  # every GQA group
    assert int(r["win"][0]) == exp["win"], (S, r, exp)
    total = sum(exp.values())
    # NSAConfig.decode_reads counts whole selected blocks: exact whenever the current block is
    # complete (S % l' == 0) or all blocks fit (S <= n l'); over by the current block's unwritten
    # tail otherwise
    over = cfg.decode_reads(S) - total
    if S % cfg.l_sel == 0 or S <= cfg.n_sel * cfg.l_sel:
        assert over == 0, (S, cfg.decode_reads(S), total)
    else:
        assert 0 <= over < cfg.l_sel, (S, cfg.decode_reads(S), total)


def test_read_counters_along_a_decode():
    """Counters of a real prefill + decode trajectory, S = 1 .. 1200 (crosses n l' = 1024)."""
    cfg = NSAConfig(dim=8, n_heads=2, n_kv_heads=1, d_qk=4, d_v=4, backend="reference",
                    **PAPER_BLOCKS)
    layer = make_layer(cfg, 0)
    x = torch.randn(1, 1200, cfg.dim)
    cache = new_cache(layer, 1, 1200)
    prefill(layer, x[:, :1], cache)
    for t in range(1, 1200):
        decode_step(layer, x[:, t : t + 1], cache)
        _check_reads(cfg, cache, t + 1)


def test_read_counters_up_to_64k():
    """One real decode step at context S (cache random-filled to S - 1 tokens), S up to 64k."""
    cfg = NSAConfig(dim=8, n_heads=2, n_kv_heads=2, d_qk=4, d_v=4, backend="reference",
                    **PAPER_BLOCKS)
    layer = make_layer(cfg, 0)
    cache = new_cache(layer, 1, 65536)
    gen = torch.Generator().manual_seed(0)
    Ss = [1, 2, 31, 32, 33, 47, 48, 63, 64, 65, 511, 512, 513, 1023, 1024, 1025, 1087, 1088, 4096,
          4097, 16383, 16384, 32768 + 17, 65535, 65536]
    Ss += torch.randint(1, 65537, (10,), generator=gen).tolist()
    x = torch.randn(1, 1, cfg.dim)
    for S in Ss:
        cache.random_fill_(S - 1, generator=gen)
        decode_step(layer, x, cache, commit=False)
        _check_reads(cfg, cache, S)
    # the paper's 64k figure: 4095 compressed + 16 x 64 selected + 512 window tokens
    assert sum(exact_reads(cfg, 65536).values()) == 5631 == cfg.decode_reads(65536)
    assert math.isclose(65536 / 5631, 11.64, abs_tol=0.01)


def test_counters_batch_rows_differ():
    cfg = NSAConfig(dim=8, n_heads=2, n_kv_heads=1, d_qk=4, d_v=4, backend="reference",
                    **PAPER_BLOCKS)
    layer = make_layer(cfg, 0)
    cache = new_cache(layer, 3, 4096)
    lens = torch.tensor([10, 1500, 4000])
    cache.random_fill_(lens)
    decode_step(layer, torch.randn(3, 1, cfg.dim), cache)
    for b, S in enumerate((lens + 1).tolist()):
        exp = exact_reads(cfg, S)
        assert [int(cache.reads[k][b].max()) for k in ("cmp", "sel", "win")] == list(exp.values())
    assert cache.lengths.tolist() == (lens + 1).tolist()


def test_cache_full_raises():
    cfg = NSAConfig(dim=8, n_heads=2, n_kv_heads=1, d_qk=4, d_v=4, l=4, d=2, l_sel=4, n_sel=3,
                    window=4, backend="reference")
    layer = make_layer(cfg, 0)
    cache = new_cache(layer, 1, 8)
    prefill(layer, torch.randn(1, 8, 8), cache)
    with pytest.raises(RuntimeError, match="full"):
        decode_step(layer, torch.randn(1, 1, 8), cache)


def test_sdpa_branches_match_reference_math(monkeypatch):
    """The CUDA default (selection/window by SDPA) computes the same outputs, checked on CPU."""
    import functools

    import nsa_flex.inference.decode as dec

    monkeypatch.setattr(dec, "attend_cached", functools.partial(dec.attend_cached, sdpa=True))
    cfg = NSAConfig(dim=16, n_heads=4, n_kv_heads=2, d_qk=8, d_v=6, l=4, d=2, l_sel=8, n_sel=3,
                    window=10, backend="reference")
    check_layer(cfg, 2, 120, [30, 77], seed=5, docs=True)
