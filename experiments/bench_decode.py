"""Per-token decode latency of ONE attention layer: NSA (per-branch caches) vs full attention with a
KV cache (SDPA), same process, same data type, caches pre-filled with random normal data.

    # GPU (H100), the issue's grid: S in {4k, 16k, 64k, 128k}, batch 1 and 16, bf16, CUDA graphs
    python experiments/bench_decode.py --out outputs/bench_decode
    # CI-size CPU check (small contexts, fp32, wall-clock timing)
    python experiments/bench_decode.py --quick --out /tmp/bench_decode

What is timed (one decode step of the attention core, after the q/k/v projections, which are the
same matmuls for both up to NSA's extra k/v pairs and are excluded; --with-proj adds them):
  nsa   write the new token into the selection cache, the window ring and the raw compression
        ring; emit a compressed block when one completes (every d tokens, branch-free); compressed
        attention over the stream; top-n scoring (Eq. 8-10, forced blocks, ties to lower index);
        gather of the n selected blocks + attention; window attention; sigmoid-gated sum.
        Exactly `nsa_flex.inference.decode.decode_attention`, the code the tests check.
  full  write the new token into a [B, Hkv, S, D] KV cache, then SDPA of the token's query over
        the S cached keys. Two layouts are timed and the faster one is the baseline:
        "gqa" q [B, H, 1, Dk] with enable_gqa=True; "fold" q folded to [B, Hkv, G, Dk] (the G
        heads of a group as G query rows over the group's keys, no mask needed).
Context S = keys the step attends to, the new token included (the caches hold S - 1 tokens).
Timing: CUDA: triton.testing.do_bench median (L2 flushed before every call, CUDA events), each
step captured in a CUDA graph (--no-cudagraph to time eager launches); no host sync inside the
step (all per-row state is on the device). CPU: median wall clock.
Output: <out>/bench_decode.csv, <out>/bench_decode.png, and a table on stdout.
"""

import argparse
import csv
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nsa_flex.config import NSAConfig  # noqa: E402
from nsa_flex.compression import PHI  # noqa: E402
from nsa_flex.inference.cache import NSACache  # noqa: E402
from nsa_flex.inference.decode import _write, attend_cached, decode_attention  # noqa: E402

PAPER = dict(dim=2560, n_heads=64, n_kv_heads=4, d_qk=192, d_v=128, l=32, d=16, l_sel=64, n_sel=16,
             window=512)


def expected_reads(cfg: NSAConfig, S: int) -> dict[str, int]:
    """Distinct key tokens one decode step reads at context S (n_local >= 1, no documents)."""
    nb = -(-S // cfg.l_sel)
    sel = S if nb <= cfg.n_sel else (cfg.n_sel - 1) * cfg.l_sel + (S - (nb - 1) * cfg.l_sel)
    return {"cmp": cfg.num_cmp(S), "sel": sel, "win": min(cfg.window, S)}


class Timer:
    def __init__(self, device, cudagraph: bool, reps: int):
        self.cuda = device.type == "cuda"
        self.cudagraph = cudagraph and self.cuda
        self.reps = reps

    def __call__(self, fn) -> float:
        """Median seconds per call of fn (warmed up; on CUDA optionally graph-captured)."""
        for _ in range(3):
            fn()
        if not self.cuda:
            ts = []
            for _ in range(self.reps):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts)
        torch.cuda.synchronize()
        call = fn
        if self.cudagraph:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    fn()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            call = g.replay
        try:
            from triton.testing import do_bench

            ms = do_bench(call, warmup=25, rep=max(50, self.reps), return_mode="median")
        except ImportError:  # CUDA events, L2 flushed by a 256 MB write before every call
            flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(self.reps)]
            for a, b in ev:
                flush.zero_()
                a.record()
                call()
                b.record()
            torch.cuda.synchronize()
            ms = statistics.median(a.elapsed_time(b) for a, b in ev)
        return ms / 1e3


def bench_one(cfg: NSAConfig, S: int, B: int, device, dtype, timer: Timer, compile_: bool,
              with_proj: bool, seed: int, profile: bool = False) -> dict:
    H, Hkv, dk, dv, G = cfg.n_heads, cfg.n_kv_heads, cfg.d_qk, cfg.d_v, cfg.group_size
    gen = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=gen, device=device, dtype=dtype)  # noqa: E731
    modes = {"cmp": "compressed_causal", "sel": "topn", "win": "sliding_window"}

    # ---------------------------------------------------------------- NSA
    cache = NSACache.empty(cfg, B, S, device, dtype)
    cache.random_fill_(S - 1, generator=gen)
    phi_k = PHI[cfg.phi](cfg.l, cfg.d, dk).to(device, dtype)
    phi_v = PHI[cfg.phi](cfg.l, cfg.d, dv).to(device, dtype)
    if cfg.phi == "mlp":
        for m in (phi_k, phi_v):
            m.init_weights(0.02)
    q = rnd(B, H, 1, dk)
    kv = {b: (rnd(B, Hkv, 1, dk), rnd(B, Hkv, 1, dv)) for b in ("cmp", "sel", "win")}
    g = torch.sigmoid(rnd(B, H, 1, 3))
    x = rnd(B, 1, cfg.dim)
    if with_proj:
        wq = rnd(H * dk, cfg.dim) * cfg.dim ** -0.5
        wkv = rnd(3 * Hkv * (dk + dv), cfg.dim) * cfg.dim ** -0.5
        wg = rnd(3 * H, cfg.dim) * cfg.dim ** -0.5
        wo = rnd(cfg.dim, H * dv) * (H * dv) ** -0.5
        wkv_full = rnd(Hkv * (dk + dv), cfg.dim) * cfg.dim ** -0.5

    # --compile: the pure read part (attend_cached) compiled; cache writes stay eager (in-place
    # updates of graph inputs would be functionalized into whole-cache copies)
    attend_fn = torch.compile(attend_cached, dynamic=False) if compile_ else None

    def nsa_step():
        if with_proj:
            q_ = F.linear(x, wq).view(B, 1, H, dk).transpose(1, 2)
            kvp = F.linear(x, wkv).view(B, 3, Hkv, dk + dv)
            kv_ = {b: (kvp[:, i, :, :dk].unsqueeze(2), kvp[:, i, :, dk:].unsqueeze(2))
                   for i, b in enumerate(("cmp", "sel", "win"))}
            g_ = torch.sigmoid(F.linear(x, wg)).view(B, 1, H, 3).permute(0, 2, 1, 3)
            o = decode_attention(cfg, modes, q_, kv_, g_, cache, phi_k, phi_v, attend_fn)
            return F.linear(o.transpose(1, 2).reshape(B, 1, H * dv), wo)
        return decode_attention(cfg, modes, q, kv, g, cache, phi_k, phi_v, attend_fn)

    # ---------------------------------------------------------------- full attention
    k_full, v_full = rnd(B, Hkv, S, dk), rnd(B, Hkv, S, dv)
    pos = torch.full((B,), S - 1, dtype=torch.long, device=device)
    k_new, v_new = kv["sel"]

    def full_step(layout):
        def step():
            if with_proj:
                q_ = F.linear(x, wq).view(B, 1, H, dk).transpose(1, 2)
                kvp = F.linear(x, wkv_full).view(B, 1, Hkv, dk + dv).transpose(1, 2)
                kn, vn = kvp[..., :dk], kvp[..., dk:]
            else:
                q_, kn, vn = q, k_new, v_new
            _write(k_full, pos, kn)
            _write(v_full, pos, vn)
            if layout == "fold":
                o = F.scaled_dot_product_attention(q_.view(B, Hkv, G, dk), k_full, v_full)
            else:
                o = F.scaled_dot_product_attention(q_, k_full, v_full, enable_gqa=True)
            o = o.reshape(B, 1, H * dv)
            return F.linear(o, wo) if with_proj else o

        return step

    fns = {"nsa": nsa_step, "full_gqa": full_step("gqa"), "full_fold": full_step("fold")}

    # sanity: finite outputs, and the counters of the NSA step are the exact expected reads
    with torch.no_grad():
        o_nsa = fns["nsa"]()
        o_a, o_b = fns["full_gqa"](), fns["full_fold"]()
    assert torch.isfinite(o_nsa).all(), "NSA decode produced non-finite values"
    assert torch.allclose(o_a.float(), o_b.float(), atol=2e-2, rtol=2e-2), "SDPA layouts disagree"
    reads = {k: v.float().mean().item() for k, v in cache.reads.items()}
    exp = expected_reads(cfg, S)
    assert reads == {k: float(v) for k, v in exp.items()}, (reads, exp)

    if profile and device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile as prof

        with torch.no_grad(), prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as pr:
            for _ in range(10):
                fns["nsa"]()
            torch.cuda.synchronize()
        print(pr.key_averages().table(sort_by="self_cuda_time_total", row_limit=25))

    row = {"S": S, "batch": B, "dtype": str(dtype).replace("torch.", ""), "device": device.type}
    with torch.no_grad():
        for name, fn in fns.items():
            row[f"{name}_ms"] = timer(fn) * 1e3
    row["full_ms"] = min(row["full_gqa_ms"], row["full_fold_ms"])
    row["speedup"] = row["full_ms"] / row["nsa_ms"]
    nsa_tokens = sum(exp.values())
    row.update({"nsa_reads_cmp": exp["cmp"], "nsa_reads_sel": exp["sel"], "nsa_reads_win": exp["win"],
                "nsa_reads": nsa_tokens, "full_reads": S, "decode_reads_cfg": cfg.decode_reads(S),
                "read_ratio": S / nsa_tokens})
    esz = torch.finfo(dtype).bits // 8
    kv_bytes = B * Hkv * (dk + dv) * esz
    row["nsa_GBps"] = nsa_tokens * kv_bytes / (row["nsa_ms"] * 1e-3) / 1e9
    row["full_GBps"] = S * kv_bytes / (row["full_ms"] * 1e-3) / 1e9
    del cache, k_full, v_full, fns
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def check_equivalence(device, T: int = 700, seed: int = 0) -> float:
    """Prefill + token-by-token decode == one full forward, on `device` in fp32 (the same check
    as tests/test_inference.py, here with the device's decode path: SDPA branches, K @ q^T).
    Returns the max abs difference of the layer outputs."""
    from nsa_flex import NSAAttention
    from nsa_flex.inference import decode_step, new_cache, prefill

    torch.manual_seed(seed)
    cfg = NSAConfig(dim=64, n_heads=8, n_kv_heads=2, d_qk=32, d_v=16, l=16, d=8, l_sel=32,
                    n_sel=4, window=64, backend="reference")
    layer = NSAAttention(cfg).to(device)
    with torch.no_grad():
        layer.gate.weight.normal_(0, 0.5)
        x = torch.randn(2, T, cfg.dim, device=device)
        full = layer(x)
        p0, p1 = T // 3, (2 * T) // 3
        P = torch.tensor([p0, p1], device=device)
        cache = new_cache(layer, 2, T + p1 - p0)
        out = prefill(layer, x[:, :p1], cache, P)
        err = max((out[b, : P[b]] - full[b, : P[b]]).abs().max().item() for b in range(2))
        rows = torch.arange(2, device=device)
        for k in range(T - p0):
            t = (P + k).clamp_max(T - 1)
            o = decode_step(layer, x[rows, t].unsqueeze(1), cache)
            live = P + k < T
            err = max(err, (o[live, 0] - full[rows[live], t[live]]).abs().max().item())
    return err


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for B in sorted({r["batch"] for r in rows}):
        rs = sorted((r for r in rows if r["batch"] == B), key=lambda r: r["S"])
        S = [r["S"] for r in rs]
        ax.plot(S, [r["nsa_ms"] for r in rs], "o-", label=f"NSA, batch {B}")
        ax.plot(S, [r["full_ms"] for r in rs], "s--", label=f"full attention (SDPA), batch {B}")
        ax2.plot(S, [r["speedup"] for r in rs], "o-", label=f"measured, batch {B}")
    rs = sorted({r["S"]: r for r in rows}.values(), key=lambda r: r["S"])
    ax2.plot([r["S"] for r in rs], [r["read_ratio"] for r in rs], "k:", label="token-read ratio")
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.set_xlabel("context S (tokens)")
        a.grid(True, which="both", alpha=0.3)
        a.legend(fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("decode step latency, one layer (ms)")
    ax2.set_ylabel("full / NSA")
    ax2.axhline(8, color="r", lw=0.8, alpha=0.5)
    r0 = rows[0]
    fig.suptitle(f"NSA vs full-attention decode, one layer ({r0['device']}, {r0['dtype']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output folder (CSV + PNG)")
    p.add_argument("--contexts", default=None, help="default 4096,16384,65536,131072")
    p.add_argument("--batches", default=None, help="default 1,16")
    p.add_argument("--quick", action="store_true",
                   help="CI-size CPU run: contexts 512,2048, batches 1,2, fp32, few reps")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"))
    p.add_argument("--phi", default="avg", choices=("avg", "mlp"))
    p.add_argument("--compile", action="store_true",
                   help="torch.compile NSA's read part (attend_cached); SDPA stays as it is")
    p.add_argument("--no-cudagraph", action="store_true", help="time eager launches on CUDA")
    p.add_argument("--with-proj", action="store_true",
                   help="include the q/k/v/gate/output projections of the layer in both steps")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--profile", action="store_true", help="print a CUDA kernel profile of the NSA step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-check", action="store_true",
                   help="skip the prefill+decode == forward check on the device (fp32, ~5 s)")
    a = p.parse_args(argv)

    if a.quick:
        a.contexts, a.batches = a.contexts or "512,2048", a.batches or "1,2"
        a.device = a.device or "cpu"
    a.contexts, a.batches = a.contexts or "4096,16384,65536,131072", a.batches or "1,16"
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, a.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    reps = a.reps or (5 if a.quick else (100 if device.type == "cuda" else 10))
    cfg = NSAConfig(**PAPER, phi=a.phi, backend="reference")
    timer = Timer(device, not a.no_cudagraph, reps)
    if not a.no_check and not a.quick:
        err = check_equivalence(device)
        print(f"check: prefill + decode vs full forward on {device} (fp32): max |diff| = {err:.2e}")
        assert err < 1e-3, f"decode path disagrees with the forward on {device}: {err}"
    os.makedirs(a.out, exist_ok=True)
    rows = []
    for B in [int(b) for b in a.batches.split(",")]:
        for S in [int(s) for s in a.contexts.split(",")]:
            r = bench_one(cfg, S, B, device, dtype, timer, a.compile, a.with_proj,
                          a.seed + 1000 * B + S, a.profile)
            r.update(compile=a.compile, cudagraph=timer.cudagraph, with_proj=a.with_proj)
            rows.append(r)
            print(f"S={S:>7} B={B:>3}  nsa {r['nsa_ms']:8.4f} ms  full {r['full_ms']:8.4f} ms "
                  f"(gqa {r['full_gqa_ms']:.4f}, fold {r['full_fold_ms']:.4f})  "
                  f"speedup {r['speedup']:6.2f}x  reads {r['nsa_reads']}/{S} "
                  f"({r['read_ratio']:.2f}x fewer)", flush=True)
    path = os.path.join(a.out, "bench_decode.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {path}")
    plot(rows, os.path.join(a.out, "bench_decode.png"))
    return rows


if __name__ == "__main__":
    main()
