"""Compile-mode benchmark of the NSA layer, its stages, and full-attention baselines.

    python experiments/bench_attention.py --out experiments/results/bench      # H100, full sweep
    python experiments/bench_attention.py --quick --out /tmp/bench             # CPU, tiny, CI

Every timed function is compiled and warmed up first (compile excluded); times are medians of
triton's do_bench (CUDA events) on fresh random inputs (never zeros), rotating between several
input sets. Baselines run in the same process: SDPA full causal, flex full causal and, when
installed, fla-core's `parallel_nsa` (compression + top-k + selection; run with window 0 since
its window path needs flash_attn). Writes bench.csv and bench.png (speedup against T, and the
per-stage breakdown at the largest T).
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
from masks import MaskContext, get_mask_builder  # noqa: E402
from nsa_flex import NSAAttention, NSAConfig  # noqa: E402
from nsa_flex.attention import attend_flex  # noqa: E402
from nsa_flex.kernel_options import packed_block_size  # noqa: E402
from nsa_flex.selection import select_topn  # noqa: E402

CONFIGS = {
    "paper": dict(n_heads=64, n_kv_heads=4, d_qk=192, d_v=128, dim=2560),
    "d128": dict(n_heads=64, n_kv_heads=4, d_qk=128, d_v=128, dim=2560),
    "tiny": dict(n_heads=4, n_kv_heads=2, d_qk=16, d_v=16, dim=64, l=8, d=4, l_sel=16, n_sel=4,
                 window=32),
}


def bench(fn, dev, reps=3):
    """Median ms of fn over fresh calls (fn rotates its own inputs)."""
    fn()
    if dev == "cuda":
        from triton.testing import do_bench

        torch.cuda.synchronize()
        return do_bench(fn, warmup=10, rep=max(50, reps * 10), return_mode="median")
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


class Rot:
    """Cycle through k input sets so repeated calls don't just hit the cache."""

    def __init__(self, make, k=3):
        self.sets = [make() for _ in range(k)]
        self.i = 0

    def __call__(self):
        self.i += 1
        return self.sets[self.i % len(self.sets)]


def rnd(*shape, dev, dtype, grad=False):
    return torch.randn(*shape, device=dev, dtype=dtype).requires_grad_(grad)


def timed(name, fwd, with_bwd, dev, rows, meta):
    """fwd() returns an output; fwd+bwd runs backward of out.float().sum()."""
    def fb():
        out = fwd()
        out.float().sum().backward()

    rec = dict(meta, stage=name)
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:  # inference forward
        with torch.no_grad():
            rec["fwd_ms"] = bench(fwd, dev)
    except Exception as e:  # keep the sweep going; the CSV says what failed, ERR_LOG the traceback
        rec["error"] = _fail(name, meta, "fwd(no_grad)", e)
        if with_bwd:  # the training forward (grad mode) is a separate graph: time it instead
            try:
                rec["fwd_ms"] = bench(fwd, dev)
                rec["fwd_mode"] = "grad"
            except Exception as e2:
                rec["error"] += " | " + _fail(name, meta, "fwd(grad)", e2)
    if with_bwd:
        try:
            rec["fwd_bwd_ms"] = bench(fb, dev)
        except Exception as e:
            rec["error"] = (rec.get("error", "") + " | " + _fail(name, meta, "fwd+bwd", e)).strip(" |")
    if dev == "cuda":
        rec["peak_GiB"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.empty_cache()
    rows.append(rec)
    if CSV_PATH:
        write_csv(rows, CSV_PATH)  # after every row: a killed run keeps what it measured
    fmt = lambda k: f"{rec[k]:9.3f}" if k in rec else "        -"
    print(f"{meta['config']:6s} T={meta['T']:6d} {name:22s} fwd {fmt('fwd_ms')} ms  "
          f"fwd+bwd {fmt('fwd_bwd_ms')} ms  {rec.get('error', '')}", flush=True)
    return rec


CSV_PATH = None
ERR_LOG = None


def _fail(name, meta, mode, e):
    """One line for the CSV; the whole traceback to ERR_LOG."""
    import traceback

    msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    if ERR_LOG:
        with open(ERR_LOG, "a") as f:
            f.write(f"==== {meta['config']} T={meta['T']} {name} {mode}\n{traceback.format_exc()}\n")
    return f"{mode} {type(e).__name__}: {msg}"


def write_csv(rows, path):
    keys = sorted({k for r in rows for k in r}, key=lambda k: (k not in (
        "config", "T", "stage", "fwd_ms", "fwd_bwd_ms", "peak_GiB"), k))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def run_config(cname, T, dev, dtype, rows, stages, baselines, compile_=True):
    base = CONFIGS[cname]
    cfg = NSAConfig(**base, backend="flex")
    meta = dict(config=cname, T=T, device=torch.cuda.get_device_name() if dev == "cuda" else "cpu")
    train = dev == "cuda"  # CPU flex has no backward
    B, H, Hkv, dk, dv = 1, cfg.n_heads, cfg.n_kv_heads, cfg.d_qk, cfg.d_v
    comp = (lambda f: torch.compile(f, fullgraph=True, dynamic=False)) if compile_ else (lambda f: f)

    # ---- whole layer
    layer = NSAAttention(cfg).to(dev, dtype)
    layer.init_weights(0.02)
    clayer = comp(layer)
    xs = Rot(lambda: rnd(B, T, cfg.dim, dev=dev, dtype=dtype, grad=train))
    timed("nsa_layer", lambda: clayer(xs()), train, dev, rows, meta)

    # ---- baselines: attention cores of the same shape
    if baselines:
        qkv = Rot(lambda: (rnd(B, H, T, dk, dev=dev, dtype=dtype, grad=train),
                           rnd(B, Hkv, T, dk, dev=dev, dtype=dtype, grad=train),
                           rnd(B, Hkv, T, dv, dev=dev, dtype=dtype, grad=train)))
        sdpa = comp(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                    enable_gqa=True))
        timed("sdpa_causal", lambda: sdpa(*qkv()), train, dev, rows, meta)
        causal = get_mask_builder("causal")(MaskContext(cfg, B, T, torch.device(dev)))
        flex_c = comp(lambda q, k, v: attend_flex(q, k, v, causal)[0])
        timed("flex_causal", lambda: flex_c(*qkv()), train, dev, rows, meta)
        try:
            from fla.ops.nsa import parallel_nsa

            def fla_inputs():
                q, k, v = qkv()
                return (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                        torch.rand(B, T, H, device=dev, dtype=dtype),
                        torch.rand(B, T, H, device=dev, dtype=dtype))

            fl = Rot(fla_inputs)
            timed("fla_parallel_nsa_w0", lambda: parallel_nsa(*fl()[:3], g_cmp=fl.sets[0][3],
                                                               g_slc=fl.sets[0][4],
                                                               block_counts=cfg.n_sel,
                                                               block_size=cfg.l_sel,
                                                               window_size=0),
                  train, dev, rows, meta)
        except ImportError:
            pass

    # ---- stages
    if stages:
        x = rnd(B, T, cfg.dim, dev=dev, dtype=dtype)

        def proj():
            return layer.wq(x), [layer.wk[b](x) for b in ("cmp", "sel", "win")]

        timed("projections", comp(lambda: layer.wq(xs()) + 0), train, dev, rows, meta)
        kraw = Rot(lambda: rnd(B, Hkv, T, dk, dev=dev, dtype=dtype, grad=train))
        timed("compression", comp(lambda: layer.phi_k(kraw())), train, dev, rows, meta)

        q = rnd(B, H, T, dk, dev=dev, dtype=dtype)
        kc = layer.phi_k(rnd(B, Hkv, T, dk, dev=dev, dtype=dtype))
        vc = layer.phi_v(rnd(B, Hkv, T, dv, dev=dev, dtype=dtype))
        ctx = MaskContext(cfg, B, T, torch.device(dev))
        cspec = get_mask_builder("compressed_causal")(ctx)
        if dev == "cuda":
            o, lse = attend_flex(q, kc, vc, cspec)
        else:
            lse = None
        score = comp(lambda: select_topn(q, kc, lse, cfg))
        timed("score_topn", score, False, dev, rows, meta)
        sel_idx = score()

        def build_masks():
            c = MaskContext(cfg, B, T, torch.device(dev), topn=lambda: sel_idx)
            sspec = get_mask_builder("topn")(c)
            wspec = get_mask_builder("sliding_window")(c)
            G = H // Hkv
            bs = packed_block_size(G, sspec)
            a = sspec.block_mask(B, T, T, device=dev, block_size=bs, q_pack=G)
            b = wspec.block_mask(B, T, T, device=dev, block_size=128)
            cc = cspec.block_mask(B, T, kc.shape[2], device=dev, block_size=128)
            return a.kv_indices.sum() + b.kv_indices.sum() + cc.kv_indices.sum()

        timed("mask_build", comp(build_masks), False, dev, rows, meta)

        c = MaskContext(cfg, B, T, torch.device(dev), topn=lambda: sel_idx)
        sspec, wspec = get_mask_builder("topn")(c), get_mask_builder("sliding_window")(c)
        qs = Rot(lambda: rnd(B, H, T, dk, dev=dev, dtype=dtype, grad=train))
        kvs = Rot(lambda: (rnd(B, Hkv, T, dk, dev=dev, dtype=dtype, grad=train),
                           rnd(B, Hkv, T, dv, dev=dev, dtype=dtype, grad=train)))
        kvc = Rot(lambda: (rnd(B, Hkv, kc.shape[2], dk, dev=dev, dtype=dtype, grad=train),
                           rnd(B, Hkv, kc.shape[2], dv, dev=dev, dtype=dtype, grad=train)))
        for name, spec, kvr in (("attn_compressed", cspec, kvc), ("attn_selected", sspec, kvs),
                                ("attn_window", wspec, kvs)):
            f = comp(lambda q_, k_, v_, s=spec: attend_flex(q_, k_, v_, s)[0])
            timed(name, lambda f=f, kvr=kvr: f(qs(), *kvr()), train, dev, rows, meta)
        outs = Rot(lambda: [rnd(B, H, T, dv, dev=dev, dtype=dtype, grad=train) for _ in range(3)])

        def gate_out():
            o3 = outs()
            g = torch.sigmoid(layer.gate(x)).view(B, T, H, 3).permute(0, 2, 1, 3)
            o = sum(g[..., i:i + 1] * o3[i] for i in range(3))
            return layer.wo(o.transpose(1, 2).reshape(B, T, H * dv))

        timed("gate_out", comp(gate_out), train, dev, rows, meta)
    del layer, clayer
    if dev == "cuda":
        torch.cuda.empty_cache()


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    ax = axes[0]
    for cname in sorted({r["config"] for r in rows}):
        for mode in ("fwd_ms", "fwd_bwd_ms"):
            pts = []
            for T in sorted({r["T"] for r in rows if r["config"] == cname}):
                get = lambda s: next((r.get(mode) for r in rows if r["config"] == cname
                                      and r["T"] == T and r["stage"] == s), None)
                n, b = get("nsa_layer"), get("sdpa_causal")
                if n and b:
                    pts.append((T, b / n))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-",
                        label=f"{cname} {mode.replace('_ms', '')}")
    ax.axhline(5, color="gray", ls="--", lw=1, label="5x target")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("SDPA full causal time / NSA layer time")
    ax.set_title("NSA layer speedup over SDPA full causal (batch 1)")
    ax.legend(fontsize=8)
    ax = axes[1]
    stage_names = ["projections", "compression", "score_topn", "mask_build", "attn_compressed",
                   "attn_selected", "attn_window", "gate_out"]
    Tmax = max((r["T"] for r in rows if r["stage"] == "attn_selected"), default=None)
    if Tmax is not None:
        cname = next(r["config"] for r in rows if r["stage"] == "attn_selected" and r["T"] == Tmax)
        for j, mode in enumerate(("fwd_ms", "fwd_bwd_ms")):
            bottom = 0.0
            for s in stage_names:
                v = next((r.get(mode) or (r.get("fwd_ms") if mode == "fwd_bwd_ms" else None)
                          for r in rows if r["config"] == cname and r["T"] == Tmax
                          and r["stage"] == s), None)
                if v:
                    ax.bar(j, v, bottom=bottom, label=s if j == 0 else None)
                    bottom += v
        ax.set_xticks([0, 1], ["forward", "forward+backward"])
        ax.set_ylabel("ms")
        ax.set_title(f"per-stage time, {cname}, T={Tmax}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("wrote", path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny CPU run (CI)")
    ap.add_argument("--configs", default="paper,d128")
    ap.add_argument("--T", default="4096,8192,16384,32768,65536,131072")
    ap.add_argument("--stages-at", default="65536", help="T values with the per-stage breakdown")
    ap.add_argument("--no-baselines", action="store_true")
    ap.add_argument("--out", default="experiments/results/bench")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    if args.quick:
        configs, Ts, stages_at = ["tiny"], [128, 256], {256}
    else:
        configs = args.configs.split(",")
        Ts = [int(t) for t in args.T.split(",")]
        stages_at = {int(t) for t in args.stages_at.split(",") if t}
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    torch._dynamo.config.cache_size_limit = 256
    global CSV_PATH, ERR_LOG
    rows = []
    path = CSV_PATH = os.path.join(args.out, "bench.csv")
    ERR_LOG = os.path.join(args.out, "errors.log")
    for cname in configs:
        for T in Ts:
            torch._dynamo.reset()
            # CPU: inductor's CPU flex template can't lower the packed selection inside a larger
            # graph, so --quick times eager code around the (separately compiled) flex calls
            run_config(cname, T, dev, dtype, rows, stages=T in stages_at,
                       baselines=not args.no_baselines, compile_=dev == "cuda")
    print("wrote", path)
    plot(rows, os.path.join(args.out, "bench.png"))
    print("\nsummary (ms):")
    for r in rows:
        if r["stage"] in ("nsa_layer", "sdpa_causal", "flex_causal", "fla_parallel_nsa_w0"):
            print(f"  {r['config']:6s} T={r['T']:6d} {r['stage']:22s} fwd={r.get('fwd_ms', math.nan):8.2f}"
                  f" fwd+bwd={r.get('fwd_bwd_ms', math.nan):8.2f} peak={r.get('peak_GiB', math.nan):6.1f}GiB")


if __name__ == "__main__":
    main()
