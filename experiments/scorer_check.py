"""GPU self-check of the fused Triton selection scorer (issue 4) against the torch scorer.

    python experiments/scorer_check.py --out experiments/results/scorer          # H100, ~5 min
    python experiments/scorer_check.py --out /tmp/sc --T 4096 --no-sweep --no-layer   # quick

Paper config (64 q heads, 4 KV groups, d_k 192, l=32, d=16, l'=64, n=16), bf16 q / compressed keys
(random), fp32 lse computed exactly from the same bf16 values. For every T (default 4096 and
65536), without and with documents:

  accuracy  p_slc of the Triton kernel and of the torch scorer on the same bf16 inputs
            ("torch_lowp": bf16 matmul, the production torch path) against the torch scorer on
            the inputs cast to fp32 (the reference): max abs / max relative error; the share of
            (position, group) rows whose top-n set is identical.
  timing    median ms (triton.testing.do_bench) of the scorer alone (all chunks) and of
            select_topn, torch vs triton, with the peak memory of one select_topn call; a small
            sweep of the kernel's tile shapes and of the chunk size (--no-sweep to skip).
  compile   select_topn with the Triton scorer inside torch.compile(fullgraph=True) == eager
            (smallest T), and the whole NSA layer compiled with scorer auto vs torch
            (--no-layer to skip): graph breaks, output difference, forward ms.

Every case catches and reports its own error and the CSV (long format: one measurement per row)
is rewritten after every row, so a crash or a timeout keeps what was measured.
"""

import argparse
import csv
import math
import os
import sys
import time
import traceback

import torch

import masks
from nsa_flex import NSAAttention, NSAConfig
from nsa_flex.ops import HAS_TRITON, group_slc_scores
from nsa_flex.selection import block_scores, select_topn

DEVICE = "cuda"
FIELDS = ["T", "docs", "dtype", "case", "impl", "metric", "value", "unit", "status", "note"]


class Log:
    def __init__(self, path):
        self.path, self.rows, self.t_start = path, [], time.time()

    def row(self, **kw):
        r = {k: kw.get(k, "") for k in FIELDS}
        if isinstance(r["value"], float):
            r["value"] = f"{r['value']:.6g}"
        r["status"] = r["status"] or "ok"
        self.rows.append(r)
        with open(self.path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            w.writeheader()
            w.writerows(self.rows)
        print(f"[{time.time() - self.t_start:7.1f}s] T={r['T']} docs={r['docs']} {r['case']} "
              f"{r['impl']} {r['metric']} = {r['value']} {r['unit']} {r['status']} {r['note']}",
              flush=True)


def run_case(log, meta, name, fn):
    """Run one case; an error becomes a CSV row (and a traceback on stderr), never a crash."""
    print(f"--- {name} T={meta['T']} docs={meta['docs']}", flush=True)
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - report and go on
        traceback.print_exc()
        log.row(**meta, case=name, status="error", note=f"{type(e).__name__}: {e}"[:300])
    finally:
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001 - a sticky CUDA error: later cases will say so too
            print(f"cuda synchronize after {name}: {e}", flush=True)


def bench(fn, rep=200):
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def peak_mib(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def exact_lse(q, k, cfg, starts, chunk=1024):
    """fp32 natural-log lse of the compressed attention (-inf where no block is visible)."""
    B, Hq, T, D = q.shape
    Hkv, Nc = k.shape[1], k.shape[2]
    G = Hq // Hkv
    out = torch.empty(B, Hq, T, device=q.device, dtype=torch.float32)
    kf = k.float()
    i = torch.arange(Nc, device=q.device)
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        t = torch.arange(t0, t1, device=q.device).view(-1, 1)
        s = torch.einsum("bhgtd,bhnd->bhgtn", q[:, :, t0:t1].float().view(B, Hkv, G, t1 - t0, D),
                         kf) * D ** -0.5
        vis = (i * cfg.d + cfg.l - 1 <= t).view(1, 1, 1, t1 - t0, Nc)
        if starts is not None:
            vis = vis & (i * cfg.d >= starts[:, t0:t1, None]).view(B, 1, 1, t1 - t0, Nc)
        out[:, :, t0:t1] = torch.logsumexp(s.masked_fill(~vis, float("-inf")), -1).view(
            B, Hq, t1 - t0)
    return out


def scores_all(q, k, lse, cfg, starts, chunk=None):
    chunk = chunk or cfg.score_chunk
    return [block_scores(q, k, lse, cfg, starts, t0, min(q.shape[2], t0 + chunk))
            for t0 in range(0, q.shape[2], chunk)]


def with_(cfg, **kw):
    return NSAConfig(**{**cfg.to_dict(), **kw})


def check_T(log, args, T, docs):
    dev = DEVICE
    meta = dict(T=T, docs=int(docs), dtype=args.dtype)
    cfg = NSAConfig(backend="flex")  # paper defaults
    c_torch, c_tri = with_(cfg, scorer="torch"), with_(cfg, scorer="triton")
    B, Hq, Hkv, D = args.B, cfg.n_heads, cfg.n_kv_heads, cfg.d_qk
    g = torch.Generator(device=dev).manual_seed(T + docs)
    dt = getattr(torch, args.dtype)
    q = torch.randn(B, Hq, T, D, device=dev, generator=g).to(dt)
    k = torch.randn(B, Hkv, cfg.num_cmp(T), D, device=dev, generator=g).to(dt)
    starts = None
    if docs:  # a few documents of random lengths
        cuts = torch.randperm(T - 1, device=dev, generator=g)[:4] + 1
        doc_ids = (torch.arange(T, device=dev).view(-1, 1) >= cuts.view(1, -1)).sum(-1)
        starts = masks.doc_start(doc_ids.view(1, T).expand(B, T).long())
    lse = exact_lse(q, k, cfg, starts)
    qf, kf = q.float(), k.float()
    print(f"=== T={T} docs={docs}: q {tuple(q.shape)} k_cmp {tuple(k.shape)}, rows without a "
          f"visible block: {int((~torch.isfinite(lse)).sum())}", flush=True)

    def accuracy():
        worst = {"triton": [0.0, 0.0], "torch_lowp": [0.0, 0.0]}
        chunk = cfg.score_chunk
        for t0 in range(0, T, chunk):
            t1 = min(T, t0 + chunk)
            ref = block_scores(qf, kf, lse, c_torch, starts, t0, t1)
            scale = ref.abs().amax().clamp_min(1e-30)
            for impl, (cc, qq, kk) in {"triton": (c_tri, q, k),
                                       "torch_lowp": (c_torch, q, k)}.items():
                p = block_scores(qq, kk, lse, cc, starts, t0, t1)
                err = (p - ref).abs().amax()
                worst[impl][0] = max(worst[impl][0], err.item())
                worst[impl][1] = max(worst[impl][1], (err / scale).item())
                assert torch.isfinite(p).all(), f"{impl}: non-finite scores at chunk {t0}"
        for impl, (a, r) in worst.items():
            log.row(**meta, case="p_slc vs torch fp32", impl=impl, metric="max_abs_err", value=a)
            log.row(**meta, case="p_slc vs torch fp32", impl=impl, metric="max_rel_err", value=r,
                    note="abs err / max |p_slc| of the chunk")
        ref = select_topn(qf, kf, lse, c_torch, starts)
        tri = select_topn(q, k, lse, c_tri, starts)
        tb = select_topn(q, k, lse, c_torch, starts)
        same = lambda a, b: 100.0 * (a.sort(-1).values == b.sort(-1).values).all(-1).float().mean().item()  # noqa: E731
        log.row(**meta, case="top-n identical rows", impl="triton vs torch fp32", metric="pct",
                value=same(tri, ref), unit="%")
        log.row(**meta, case="top-n identical rows", impl="torch_lowp vs torch fp32",
                metric="pct", value=same(tb, ref), unit="%")
        log.row(**meta, case="top-n identical rows", impl="triton vs torch_lowp", metric="pct",
                value=same(tri, tb), unit="%")

    def timing():
        for impl, cc in (("torch", c_torch), ("triton", c_tri)):
            ms = bench(lambda: scores_all(q, k, lse, cc, starts))
            log.row(**meta, case="scorer (all chunks)", impl=impl, metric="median", value=ms,
                    unit="ms", note=f"chunk {cc.score_chunk}")
            ms = bench(lambda: select_topn(q, k, lse, cc, starts))
            log.row(**meta, case="select_topn", impl=impl, metric="median", value=ms, unit="ms")
            mib = peak_mib(lambda: select_topn(q, k, lse, cc, starts))
            log.row(**meta, case="select_topn", impl=impl, metric="peak_extra_mem", value=mib,
                    unit="MiB")

    def sweep():
        Hs = -(-T // cfg.l_sel)
        flops = 2 * B * Hq * D * sum(min(cfg.num_cmp(T), max(0, (t - cfg.l + 1) // cfg.d + 1))
                                     for t in range(0, T, 64)) * 64  # q.k of visible blocks
        for bm, bn, nw, ns in [(64, 128, 8, 2), (64, 128, 4, 2), (64, 64, 4, 2), (64, 64, 4, 3),
                               (128, 64, 8, 2), (128, 128, 8, 2), (32, 128, 4, 2), (64, 256, 8, 2)]:
            tag = f"block_m={bm} block_n={bn} warps={nw} stages={ns}"
            try:
                for chunk in ([cfg.score_chunk] if (bm, bn, nw, ns) != (64, 128, 8, 2)
                              else [cfg.score_chunk, 4096, T]):
                    def f():
                        for t0 in range(0, T, chunk):
                            group_slc_scores(q, k, lse, starts, t0, min(T, t0 + chunk), cfg.l,
                                             cfg.d, cfg.l_sel, block_m=bm, block_n=bn,
                                             num_warps=nw, num_stages=ns)
                    ms = bench(f, rep=100)
                    log.row(**meta, case="kernel sweep", impl="triton", metric="median", value=ms,
                            unit="ms", note=f"{tag} chunk={chunk} ({flops / ms / 1e9:.0f} "
                                            f"TFLOP/s on visible q.k; Ns={Hs})")
            except Exception as e:  # noqa: BLE001 - a config that does not compile is a result
                log.row(**meta, case="kernel sweep", impl="triton", status="error",
                        note=f"{tag}: {type(e).__name__}: {e}"[:300])
                torch.cuda.empty_cache()

    def compiled():
        f = torch.compile(lambda q, k, lse, s: select_topn(q, k, lse, c_tri, s), fullgraph=True)
        got = f(q, k, lse, starts)
        want = select_topn(q, k, lse, c_tri, starts)
        log.row(**meta, case="compiled select_topn (fullgraph)", impl="triton",
                metric="identical_to_eager", value=float(torch.equal(got, want)))
        log.row(**meta, case="compiled select_topn (fullgraph)", impl="triton", metric="median",
                value=bench(lambda: f(q, k, lse, starts)), unit="ms")

    if args.accuracy:
        run_case(log, meta, "accuracy", accuracy)
    run_case(log, meta, "timing", timing)
    if args.sweep:
        run_case(log, meta, "kernel sweep", sweep)
    if T == min(args.T) and not docs:
        run_case(log, meta, "compiled select_topn", compiled)
        if args.layer:
            run_case(log, meta, "layer", lambda: layer_check(log, meta, T, args.B))


def layer_check(log, meta, T, B):
    """The whole layer, compiled fullgraph, scorer auto (Triton on CUDA) vs torch."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    cfg = NSAConfig(backend="flex")
    a = NSAAttention(cfg).to(DEVICE)
    a.init_weights(0.02)
    with torch.no_grad():  # non-uniform compressed scores
        a.wq.weight.normal_(0, 0.05)
        a.wk["cmp"].weight.normal_(0, 0.05)
    b = NSAAttention(with_(cfg, scorer="torch")).to(DEVICE)
    b.load_state_dict(a.state_dict())
    a, b = a.to(torch.bfloat16), b.to(torch.bfloat16)
    x = torch.randn(B, T, cfg.dim, device=DEVICE, dtype=torch.bfloat16)
    outs = {}
    for impl, layer in (("triton", a), ("torch", b)):
        counters.clear()
        f = torch.compile(layer, fullgraph=True)
        with torch.no_grad():
            outs[impl] = f(x).float()
            ms = bench(lambda: f(x), rep=100)
        breaks = sum(counters["graph_break"].values())
        log.row(**meta, case="layer fwd compiled", impl=impl, metric="median", value=ms,
                unit="ms", note=f"graph breaks {breaks}")
    d = (outs["triton"] - outs["torch"]).abs().amax().item()
    log.row(**meta, case="layer fwd compiled", impl="triton vs torch", metric="max_abs_diff",
            value=d, note=f"output max |y| {outs['torch'].abs().amax().item():.3g}; "
                          "differs only where bf16 near-ties pick other blocks")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="experiments/results/scorer")
    ap.add_argument("--T", type=int, nargs="+", default=[4096, 65536])
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                    help="q / compressed keys (lse is always fp32)")
    ap.add_argument("--docs", type=int, nargs="+", default=[0, 1], help="0: none, 1: documents")
    ap.add_argument("--no-sweep", dest="sweep", action="store_false")
    ap.add_argument("--no-accuracy", dest="accuracy", action="store_false",
                    help="skip the accuracy checks (timing and sweep only)")
    ap.add_argument("--no-layer", dest="layer", action="store_false")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "scorer_check.csv")
    log = Log(path)
    if not torch.cuda.is_available() or not HAS_TRITON:
        log.row(T=0, docs=0, case="setup", status="error",
                note=f"needs CUDA and triton (cuda={torch.cuda.is_available()}, "
                     f"triton={HAS_TRITON})")
        return 1
    import triton

    print(f"torch {torch.__version__}, triton {triton.__version__}, "
          f"{torch.cuda.get_device_name()}", flush=True)
    log.row(T=0, docs=0, case="setup", impl=torch.cuda.get_device_name(), metric="versions",
            note=f"torch {torch.__version__} triton {triton.__version__}")
    for T in sorted(args.T):
        for docs in args.docs:
            try:
                check_T(log, args, T, bool(docs))
            except Exception as e:  # noqa: BLE001 - e.g. out of memory while making the inputs
                traceback.print_exc()
                log.row(T=T, docs=docs, case="inputs", status="error",
                        note=f"{type(e).__name__}: {e}"[:300])
                torch.cuda.empty_cache()
    errors = sum(r["status"] != "ok" for r in log.rows)
    print(f"wrote {path} ({len(log.rows)} rows, {errors} errors)", flush=True)
    return 0 if errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
