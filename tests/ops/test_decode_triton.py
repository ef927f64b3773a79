"""The Triton decode step (nsa_flex.ops.decode_triton) against the torch decode path, on the
CPU under the Triton interpreter (on a GPU: `python tests/ops/test_decode_triton.py --gpu`, the
same cases with compiled kernels).

TRITON_INTERPRET=1 must be set before triton decorates the kernels, so the comparisons run in a
fresh subprocess (this file with --worker) that imports everything anew; the tests below read its
JSON report. fp32, tolerance 1e-5: outputs (gated and per branch), the compressed lse, the
selected blocks, the exact read counters, the caches after the write (incl. the emitted
compressed block), and a prefill + decode trajectory through `decode_step(backend="triton")`
against the layer's full forward."""

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOL = 1e-5

# (name, config, cache lengths before the step (S - 1 per row), options)
#   G in {1, 2, 4, 16}; head dims 24 / 48 (not powers of two); S below l, below n l', around w,
#   many blocks; batches with different lengths; -1 slots; document starts; every decode mode.
BLOCKS = dict(l=8, d=4, l_sel=16, n_sel=4, window=24)
CASES = [
    ("g16_dk48", dict(n_heads=16, n_kv_heads=1, d_qk=48, d_v=24, **BLOCKS), [300, 37], {}),
    ("g1_rows_docs", dict(n_heads=2, n_kv_heads=2, d_qk=24, d_v=48, **BLOCKS), [0, 5, 230],
     dict(starts=[0, 3, 101])),
    ("g2_around_window", dict(n_heads=4, n_kv_heads=2, d_qk=24, d_v=24, **BLOCKS), [22, 23, 24],
     dict(block_n=16, programs=24)),
    ("g4_splits_emit", dict(n_heads=8, n_kv_heads=2, d_qk=48, d_v=24, **BLOCKS), [63, 150],
     dict(block_n=16, programs=48)),
    ("g2_mlp_phi", dict(n_heads=4, n_kv_heads=2, d_qk=24, d_v=24, phi="mlp", **BLOCKS), [71, 100],
     {}),
    ("no_forced_blocks", dict(n_heads=4, n_kv_heads=1, d_qk=24, d_v=24, n_init=0, n_local=0,
                              l=8, d=4, l_sel=8, n_sel=3, window=16), [90, 17], {}),
    ("cmp_empty_cache", dict(n_heads=4, n_kv_heads=2, d_qk=24, d_v=24, l=32, d=16, l_sel=16,
                             n_sel=3, window=8), [9, 14], dict(cap=16)),
    ("doc_hides_cmp", dict(n_heads=4, n_kv_heads=2, d_qk=24, d_v=24, **BLOCKS), [120, 120],
     dict(starts=[118, 40])),
    ("local_selection", dict(n_heads=4, n_kv_heads=1, d_qk=24, d_v=24, masks="local_selection",
                             **BLOCKS), [130, 9], {}),
    ("full_causal", dict(n_heads=4, n_kv_heads=1, d_qk=24, d_v=24, masks="full_causal", **BLOCKS),
     [130, 9], dict(starts=[50, 0])),
    ("no_compressed", dict(n_heads=4, n_kv_heads=1, d_qk=24, d_v=24, masks="no_compressed",
                           **BLOCKS), [130, 9], {}),
    ("sliding_only", dict(n_heads=4, n_kv_heads=1, d_qk=24, d_v=24, masks="sliding_only",
                          **BLOCKS), [130, 9], {}),
    # several selection splits, selection block boundaries, many blocks to rank
    ("g16_chunks_boundaries", dict(n_heads=16, n_kv_heads=1, d_qk=48, d_v=24, **BLOCKS),
     [255, 256, 239, 15], dict(programs=64)),
    ("g8_docs_chunks", dict(n_heads=16, n_kv_heads=2, d_qk=24, d_v=24, **BLOCKS),
     [300, 191, 64], dict(starts=[128, 37, 64], programs=48)),
    ("g8_local_selection_chunks", dict(n_heads=16, n_kv_heads=2, d_qk=24, d_v=24,
                                       masks="local_selection", **BLOCKS),
     [300, 47], dict(programs=32)),
    ("many_candidates", dict(n_heads=2, n_kv_heads=1, d_qk=24, d_v=24, l=8, d=4, l_sel=16,
                             n_sel=16, window=24), [16000, 3000], {}),
    ("g16_paper_blocks", dict(n_heads=32, n_kv_heads=2, d_qk=192, d_v=128, l=32, d=16, l_sel=64,
                              n_sel=16, window=512), [3000, 1023], dict(starts=[0, 512],
                                                                       programs=64)),
]


# ---------------------------------------------------------------------- worker (subprocess)
def _one_case(cfg_kw: dict, lens: list[int], opt: dict, seed: int, device: str = "cpu") -> dict:
    """One step of a case by the Triton kernels against the torch step; data drawn on the CPU
    (the same on any device), then moved to `device`."""
    import math
    from types import SimpleNamespace

    from nsa_flex import NSAConfig
    from nsa_flex.compression import PHI
    from nsa_flex.inference.cache import NSACache
    from nsa_flex.inference.decode import branch_modes, cache_branches
    from nsa_flex.inference.decode_fused import write_token_triton
    from nsa_flex.inference.decode_reference import _attend, _qk, attend_cached, write_token
    from nsa_flex.ops.decode_triton import nsa_decode_attention
    from nsa_flex.rules import num_cmp

    torch.manual_seed(seed)
    cfg = NSAConfig(dim=16, backend="reference", **cfg_kw)
    modes = branch_modes(SimpleNamespace(branch_names=cfg.branch_masks(), cfg=cfg))
    B, H, Hkv, dk, dv = len(lens), cfg.n_heads, cfg.n_kv_heads, cfg.d_qk, cfg.d_v
    cap = opt.get("cap", max(lens) + 1)
    src = NSACache.empty(cfg, B, cap, branches=cache_branches(modes))
    src.random_fill_(torch.tensor(lens))
    if "starts" in opt:
        src.doc_start.copy_(torch.tensor(opt["starts"]))
    # ref: torch step; tri: Triton reads after the Triton write
    ref, tri = (NSACache.empty(cfg, B, cap, device, branches=cache_branches(modes))
                for _ in range(2))
    for c in (ref, tri):
        for k, t in src.tensors().items():
            getattr(c, k).copy_(t)
        c.lengths.copy_(src.lengths)
        c.doc_start.copy_(src.doc_start)
    phi_k, phi_v = PHI[cfg.phi](cfg.l, cfg.d, dk), PHI[cfg.phi](cfg.l, cfg.d, dv)
    if cfg.phi == "mlp":
        for m in (phi_k, phi_v):
            m.init_weights(0.3)
    phi_k, phi_v = phi_k.to(device), phi_v.to(device)
    q = torch.randn(B, H, 1, dk).to(device)
    kv = {b: (torch.randn(B, Hkv, 1, dk).to(device), torch.randn(B, Hkv, 1, dv).to(device))
          for b in cache_branches(modes)}
    g = torch.rand(B, H, 1, 3).to(device)
    out = {}
    with torch.no_grad():
        write_token(cfg, modes, kv, ref, phi_k, phi_v)
        write_token_triton(cfg, modes, kv, tri, phi_k, phi_v)
        out["cache_err"] = max((getattr(tri, k) - t).abs().max().item()
                               for k, t in ref.tensors().items() if t.numel())
        caches = {k: v for k, v in ref.tensors().items() if k not in ("k_raw", "v_raw")}
        args = (caches, ref.lengths, ref.doc_start)
        o_ref, reads_ref, idx_ref = attend_cached(cfg, modes, q, g, *args)
        br_ref = {}
        for i, b in enumerate(("cmp", "sel", "win")):
            if modes[b] != "none":
                one = torch.zeros(3, device=device)
                one[i] = 1.0
                br_ref[b] = attend_cached(cfg, modes, q, one.expand(B, H, 1, 3), *args)[0][:, :, 0]
        sel = modes["sel"]
        tc = {k: v for k, v in tri.tensors().items() if k not in ("k_raw", "v_raw")}
        r = nsa_decode_attention(
            q, tri.lengths, tri.doc_start, l=cfg.l, d=cfg.d, l_sel=cfg.l_sel,
            n_sel=cfg.n_sel, n_init=cfg.n_init, n_local=cfg.n_local, k_cmp=tc.get("k_cmp"),
            v_cmp=tc.get("v_cmp"), k_sel=tc.get("k_sel") if sel != "none" else None,
            v_sel=tc.get("v_sel") if sel != "none" else None,
            k_win=tc.get("k_win"), v_win=tc.get("v_win"), sel_mode=sel,
            use=tuple(b for b in ("cmp", "sel", "win") if modes[b] != "none"), g=g,
            return_branches=True, num_programs=opt.get("programs", 4),
            block_n=opt.get("block_n", 32))
        out["o_err"] = (r.o - o_ref[:, :, 0]).abs().max().item()
        out["branch_err"] = {b: (r.branches[b] - br_ref[b]).abs().max().item() for b in br_ref}
        out["branches"] = sorted(r.branches)
        out["idx_equal"] = (idx_ref is None and r.idx is None) or (
            idx_ref is not None and r.idx is not None
            and torch.equal(idx_ref.sort(-1).values, r.idx.sort(-1).values))
        out["minus_one_slots"] = int((r.idx < 0).sum()) if r.idx is not None else 0
        out["reads_equal"] = sorted(reads_ref) == sorted(r.reads) and all(
            torch.equal(reads_ref[k].long(), r.reads[k].long().expand_as(reads_ref[k]))
            for k in reads_ref)
        out["reads"] = {k: v.tolist() for k, v in r.reads.items()}
        out["splits"] = list(r.splits)
        if "k_cmp" in caches:  # the compressed lse of the torch path's own compressed attention
            kc, vc = caches["k_cmp"], caches["v_cmp"]
            Nc, S = kc.shape[2], ref.lengths + 1
            if Nc > 0:
                i = torch.arange(Nc, device=device).view(1, Nc)
                vis = ((i < num_cmp(S, cfg.l, cfg.d).view(B, 1))
                       & (i * cfg.d >= ref.doc_start.view(B, 1)))
                qg = q.reshape(B, Hkv, H // Hkv, dk)
                _, lse = _attend(_qk(qg, kc) / math.sqrt(dk), vis.view(B, 1, 1, Nc), vc)
                lse = lse.reshape(B, H)
            else:
                lse = torch.full((B, H), float("-inf"), device=device)
            fin = torch.isfinite(lse)
            out["lse_inf_equal"] = torch.equal(fin, torch.isfinite(r.lse_cmp))
            out["lse_err"] = (r.lse_cmp[fin] - lse[fin]).abs().max().item() if fin.any() else 0.0
            out["lse_finite_rows"] = int(fin.sum())
    return out


def _trajectory() -> dict:
    """Prefill right-padded prompts, decode through decode_step(backend="triton"), compare with
    the layer's full forward: crosses compressed emissions, window wrap and new selection blocks."""
    from nsa_flex import NSAAttention, NSAConfig
    from nsa_flex.inference import decode_step, new_cache, prefill

    torch.manual_seed(0)
    cfg = NSAConfig(dim=16, n_heads=2, n_kv_heads=1, d_qk=24, d_v=24, l=8, d=4, l_sel=8, n_sel=3,
                    window=12, backend="reference")
    layer = NSAAttention(cfg).eval()
    B, T, steps = 2, 40, 6
    P = torch.tensor([30, 12])
    with torch.no_grad():
        layer.gate.weight.normal_(0, 0.5)
        x = torch.randn(B, T, cfg.dim)
        full = layer(x)
        cache = new_cache(layer, B, T, decode_backend="triton")
        prefill(layer, x[:, :30], cache, P)
        rows, err = torch.arange(B), 0.0
        for k in range(steps):
            t = P + k
            o = decode_step(layer, x[rows, t].unsqueeze(1), cache)
            err = max(err, (o[:, 0] - full[rows, t]).abs().max().item())
    return {"err": err, "steps": steps, "lengths": cache.lengths.tolist()}


def _worker(shard: int, shards: int) -> dict:
    """Shard `shard` of `shards`: every shards-th case; the trajectory in the last shard."""
    from nsa_flex.ops.decode_triton import interpreter_active

    assert interpreter_active(), "the worker must run under TRITON_INTERPRET=1"
    torch.set_num_threads(1)
    res = {name: _one_case(cfg, lens, opt, seed)
           for seed, (name, cfg, lens, opt) in enumerate(CASES) if seed % shards == shard}
    if shard == shards - 1:
        res["trajectory"] = _trajectory()
    return res


# ---------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def report():
    """Both worker shards run at once (the interpreter is single-threaded Python)."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    shards = 2
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", str(i),
                               str(shards)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(shards)]
    res = {}
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, f"worker failed:\n{out[-3000:]}\n{err[-6000:]}"
        res.update(json.loads(out.strip().splitlines()[-1]))
    return res


@pytest.mark.slow
@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_triton_step_matches_torch(report, name):
    """`nsa_decode_write` + `nsa_decode_attention` (five launches) against the torch step."""
    r = report[name]
    assert not _case_failures(r, TOL), (_case_failures(r, TOL), r)


@pytest.mark.slow
def test_cases_cover_what_they_claim(report):
    """The configurations exercise what the case names promise (guards against a silent change
    of the setup making a case vacuous)."""
    assert report["g4_splits_emit"]["splits"][0] > 1 and report["g4_splits_emit"]["splits"][2] > 1
    assert report["g2_around_window"]["splits"][1] > 1
    assert report["g2_around_window"]["minus_one_slots"] > 0  # S <= 25 < n l' = 64
    assert report["cmp_empty_cache"]["lse_finite_rows"] == 0
    assert report["doc_hides_cmp"]["reads"]["cmp"][0] == 0
    assert report["doc_hides_cmp"]["lse_finite_rows"] == 4  # row 1 only
    assert report["g1_rows_docs"]["reads"]["cmp"][:2] == [0, 0]  # S = 1 and S = 6 < l
    assert report["full_causal"]["branches"] == ["sel"]
    assert report["sliding_only"]["branches"] == ["win"]
    assert report["no_compressed"]["branches"] == ["cmp", "sel", "win"]  # cmp feeds the scorer
    r = report["g16_chunks_boundaries"]
    assert r["splits"][2] > 1 and r["reads"]["sel"][0] != r["reads"]["sel"][1]
    assert report["g8_docs_chunks"]["splits"][2] > 1
    assert report["g8_local_selection_chunks"]["splits"][2] > 1


@pytest.mark.slow
def test_decode_step_trajectory_triton(report):
    r = report["trajectory"]
    assert r["err"] <= TOL, r
    assert r["lengths"] == [30 + r["steps"], 12 + r["steps"]]


def test_decode_backend_validation():
    from nsa_flex import NSAConfig
    from nsa_flex.inference import NSACache, resolve_decode_backend

    cfg = NSAConfig(dim=8, n_heads=2, n_kv_heads=1, d_qk=4, d_v=4, backend="reference")
    with pytest.raises(ValueError, match="allowed values"):
        NSACache.empty(cfg, 1, 8, decode_backend="cuda")
    with pytest.raises(ValueError, match="allowed values"):
        resolve_decode_backend("fast", "cpu")
    assert resolve_decode_backend("auto", "cpu") == "torch"
    assert resolve_decode_backend("torch", "cuda") == "torch"
    try:
        from nsa_flex.ops.decode_triton import interpreter_active
    except ImportError:
        with pytest.raises(RuntimeError, match="not importable"):
            resolve_decode_backend("triton", "cpu")
        return
    if not interpreter_active():
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            resolve_decode_backend("triton", "cpu")


KERNELS = ("_write_kernel", "_attn_kernel", "_score_kernel", "_combine_kernel")


@pytest.mark.parametrize("case", ["paper_bf16", "small_fp32"])
def test_kernels_compile_for_h100(monkeypatch, case):
    """Every kernel of a step compiles (Triton front end, TTGIR, PTX, ptxas) for sm_90 with the
    installed triton, no GPU needed: catches what the interpreter does not check (types across
    branches, constexpr-only globals, dot shapes). Launch arguments are those the wrappers pass."""
    from tests.ops.triton_harness import Launches, compile_for_h100, cuda_compiler

    cuda_compiler()
    import nsa_flex.ops.decode_triton as M
    from nsa_flex import NSAConfig
    from nsa_flex.inference.cache import NSACache

    if M.interpreter_active():
        pytest.skip("TRITON_INTERPRET is set in this process")
    calls = Launches()
    for name in KERNELS:
        monkeypatch.setattr(M, name, calls.wrap(getattr(M, name)))
    if case == "paper_bf16":
        cfg, dt, sel = NSAConfig(backend="reference"), torch.bfloat16, "topn"
    else:
        cfg = NSAConfig(dim=16, n_heads=4, n_kv_heads=2, d_qk=24, d_v=48, backend="reference",
                        **BLOCKS)
        dt, sel = torch.float32, "topn"
    B, H, Hkv, dk, dv = 2, cfg.n_heads, cfg.n_kv_heads, cfg.d_qk, cfg.d_v
    c = NSACache.empty(cfg, B, 4096, dtype=dt)
    q = torch.zeros(B, H, 1, dk, dtype=dt)
    new = {b: (torch.zeros(B, Hkv, 1, dk, dtype=dt), torch.zeros(B, Hkv, 1, dv, dtype=dt))
           for b in ("cmp", "sel", "win")}
    M.nsa_decode_write(c.lengths, new, l=cfg.l, d=cfg.d, emit_avg=True, **c.tensors())
    for b in (1, B):  # batch 1 and 2
        M.nsa_decode_attention(
            q[:b], c.lengths[:b], c.doc_start[:b], l=cfg.l, d=cfg.d, l_sel=cfg.l_sel,
            n_sel=cfg.n_sel, k_cmp=c.k_cmp[:b], v_cmp=c.v_cmp[:b], k_sel=c.k_sel[:b],
            v_sel=c.v_sel[:b], k_win=c.k_win[:b], v_win=c.v_win[:b], sel_mode=sel,
            g=q[:b, :, :, :3], num_programs=528)
    assert sorted({k.__name__ for k, _, _ in calls}) == sorted(KERNELS)
    if case == "small_fp32":  # the padded d_k / d_v / G paths of the attention kernels only
        calls = [c for c in calls
                 if c[0].__name__ == "_attn_kernel"]
    for kernel, args, kw in calls:
        compile_for_h100(kernel, args, kw)


def test_auto_backend_falls_back_to_torch(monkeypatch):
    """"auto" on a device where the Triton step fails: one warning, the cache switches to the
    torch path for good, and the step's output is the torch path's; "triton" raises instead."""
    import nsa_flex.inference.decode as dec
    from nsa_flex.inference import prefill
    from nsa_flex import NSAAttention, NSAConfig

    cfg = NSAConfig(dim=16, n_heads=4, n_kv_heads=2, d_qk=8, d_v=8, l=4, d=2, l_sel=4, n_sel=3,
                    window=6, backend="reference")
    torch.manual_seed(0)
    layer = NSAAttention(cfg).eval()
    x = torch.randn(2, 12, cfg.dim)
    caches = {be: dec.new_cache(layer, 2, 16, decode_backend=be) for be in ("torch", "auto",
                                                                             "triton")}
    for c in caches.values():
        prefill(layer, x[:, :10], c)

    def broken(*args, **kwargs):
        raise RuntimeError("no Triton device here")

    monkeypatch.setattr(dec, "resolve_decode_backend",
                        lambda name, device: "torch" if name == "torch" else "triton")
    monkeypatch.setattr(dec, "step_triton", broken)
    monkeypatch.setattr(dec, "_FALLBACK_WARNED", set())
    ref = [dec.decode_step(layer, x[:, t : t + 1], caches["torch"]) for t in (10, 11)]
    with pytest.warns(RuntimeWarning, match="Triton decode failed"):
        got = dec.decode_step(layer, x[:, 10:11], caches["auto"])
    assert caches["auto"].decode_backend == "torch"
    assert caches["auto"].fallback_reason == "RuntimeError: no Triton device here"
    got = [got, dec.decode_step(layer, x[:, 11:12], caches["auto"])]
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert torch.equal(caches["auto"].lengths, caches["torch"].lengths)
    with pytest.raises(RuntimeError, match="no Triton device"):
        dec.decode_step(layer, x[:, 10:11], caches["triton"])


def _case_failures(r: dict, tol: float) -> list[str]:
    """What is wrong with one path's report of a case (empty: it matches the torch step)."""
    bad = []
    if r.get("cache_err", 0.0) > 1e-6:
        bad.append(f"cache_err {r['cache_err']:.2e}")
    if r["o_err"] > tol or not r["branch_err"] or max(r["branch_err"].values()) > tol:
        bad.append(f"o_err {r['o_err']:.2e} branch_err {r['branch_err']}")
    if not r["idx_equal"]:
        bad.append("selected blocks differ")
    if not r["reads_equal"]:
        bad.append(f"read counters differ {r['reads']}")
    if "lse_err" in r and not (r["lse_inf_equal"] and r["lse_err"] <= tol):
        bad.append(f"lse_err {r['lse_err']:.2e} (inf pattern equal: {r['lse_inf_equal']})")
    return bad


def gpu_main(tol: float = 1e-4, device: str = "cuda") -> int:
    """The cases on CUDA, compiled kernels, against the torch step (fp32; the tolerance covers
    the reduction orders of cuBLAS / SDPA). One line per case."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    failed = 0
    for seed, (name, cfg, lens, opt) in enumerate(CASES):
        try:
            r = _one_case(cfg, lens, opt, seed, device=device)
            if device == "cuda":
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - report and go on with the next case
            print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
            failed += 1
            continue
        bad = _case_failures(r, tol)
        failed += bool(bad)
        print(f"{'FAIL' if bad else 'PASS'} {name}: o_err {r['o_err']:.2e} "
              f"splits {r['splits']} {'; '.join(bad)}", flush=True)
    print(f"gpu cases: {'all passed' if not failed else f'{failed} failed'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__" and "--worker" in sys.argv:
    i = sys.argv.index("--worker")
    print(json.dumps(_worker(int(sys.argv[i + 1]), int(sys.argv[i + 2]))))
elif __name__ == "__main__" and "--gpu" in sys.argv:
    sys.exit(gpu_main())
