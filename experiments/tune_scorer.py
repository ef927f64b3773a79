"""Tile sweep of the fused selection scorer (`nsa_flex.ops.group_slc_scores`) and the time of the
top-n kernel, at one length of the paper config (64 q heads, 4 KV groups, d_k 192, l 32, d 16,
l' 64, n 16), bf16, on the GPU. Every config's scores are checked against the default config's
(the same function: only tiles and launch differ), then timed with triton's do_bench (median).

    python experiments/tune_scorer.py --T 65536 --out OUT          # H100: OUT/tune_scorer.csv

Why (experiments/NOTES.md 27): score + top-n took 24.7 ms of the NSA layer's 100 ms forward at
64k (target <= 15%). Each program loads its BLOCK_M queries' q for all G heads once per tile of
BLOCK_N compressed keys, so q is read ceil(Nc / BLOCK_N) times: wider key tiles read it less.
A config that fails to compile (registers, shared memory) gets its error in the CSV.
"""

import argparse
import math
import os
import time

import torch

from nsa_flex.bench import median_ms, write_csv
from nsa_flex.ops import group_slc_scores, topn_blocks

# (block_m, block_n, num_warps, num_stages); round 1 (session 9), the first the old default
CONFIGS = [(64, 128, 8, 2), (64, 256, 8, 2), (64, 256, 8, 1), (32, 256, 4, 2), (32, 256, 8, 2),
           (128, 128, 8, 2), (64, 512, 8, 1), (32, 512, 8, 1), (128, 256, 8, 1), (64, 128, 4, 3)]
FIELDS = ["T", "chunk", "block_m", "block_n", "num_warps", "num_stages", "score_ms", "topn_ms",
          "max_rel_diff", "error", "device"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--T", type=int, default=65536)
    ap.add_argument("--chunk", type=int, default=0,
                    help="queries per scorer call (default T/8, what select_topn uses at 64k)")
    ap.add_argument("--configs", default="",
                    help="comma list of BMxBNxWARPSxSTAGES, e.g. 128x128x8x2 (default: CONFIGS; "
                         "the first is the reference the others are checked against)")
    ap.add_argument("--topn-configs", default="",
                    help="comma list of ROWSxWARPS for the top-n kernel (rows per program, warps), "
                         "each checked equal to the default launch's picks and timed "
                         "(tune_topn.csv); e.g. 1x4,2x4,4x8,8x8")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    try:
        configs = [tuple(int(x) for x in c.split("x")) for c in a.configs.split(",") if c] \
            or CONFIGS
        assert all(len(c) == 4 and min(c) > 0 for c in configs)
    except (ValueError, AssertionError):
        ap.error(f"--configs: BMxBNxWARPSxSTAGES with positive ints, got {a.configs!r}")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    T, Hq, Hkv, D, l, d, ls, n = a.T, 64, 4, 192, 32, 16, 64, 16
    chunk = a.chunk or T // 8
    if chunk <= 0 or T % chunk:
        ap.error(f"--chunk must divide --T={T}, got {chunk}")
    Nc = (T - l) // d + 1
    torch.manual_seed(0)
    q = torch.randn(1, Hq, T, D, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(1, Hkv, Nc, D, device="cuda", dtype=torch.bfloat16)
    # a plausible lse: log of the visible blocks' exp-sum at this scale (values matter only to
    # the numbers compared, not to the time)
    lse = (torch.log(torch.arange(T, device="cuda").clamp_min(1).float() / d) + 2.0)
    lse = lse.view(1, 1, T).expand(1, Hq, T).contiguous()
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "tune_scorer.csv")
    dev = torch.cuda.get_device_name()
    rows, ref = [], None
    t0s = list(range(0, T, chunk))
    for bm, bn, w, s in configs:
        row = dict(T=T, chunk=chunk, block_m=bm, block_n=bn, num_warps=w, num_stages=s, device=dev)
        try:
            t = time.perf_counter()
            call = lambda: [group_slc_scores(q, kc, lse, None, t0, t0 + chunk, l, d, ls, bm, bn,
                                             w, s) for t0 in t0s]
            outs = call()
            torch.cuda.synchronize()
            if ref is None:
                ref = outs
            diff = max(((o - r).abs().max() / r.abs().max().clamp_min(1e-30)).item()
                       for o, r in zip(outs, ref))
            row["max_rel_diff"] = f"{diff:.2e}"
            row["score_ms"] = f"{median_ms(call, 'cuda', warmup=5, rep_ms=200):.3f}"
            if len(rows) == 0:  # the top-n kernel on the default config's scores
                tcall = lambda: [topn_blocks(p, None, t0, ls, n, 1, 2) for p, t0 in zip(ref, t0s)]
                row["topn_ms"] = f"{median_ms(tcall, 'cuda', warmup=5, rep_ms=200):.3f}"
            print(f"bm {bm:3d} bn {bn:3d} warps {w} stages {s}: score {row['score_ms']} ms "
                  f"(first call {time.perf_counter() - t:.1f} s), rel diff {row['max_rel_diff']}"
                  + (f", top-n {row['topn_ms']} ms" if "topn_ms" in row else ""), flush=True)
        except Exception as e:  # a config that does not compile: say so, go on
            row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:150]}" \
                if str(e).strip() else type(e).__name__
            print(f"bm {bm} bn {bn} warps {w} stages {s}: {row['error']}", flush=True)
        rows.append(row)
        write_csv(rows, path, fields=FIELDS)  # after every config
    print("wrote", path, "| q reads per call ~", math.ceil(Nc / 128), "x (default tiles)")
    if a.topn_configs and ref is not None:
        tune_topn(a.topn_configs, ref, t0s, ls, n, T, dev, a.out)


def tune_topn(spec, scores, t0s, ls, n, T, dev, out):
    """The top-n kernel's launch (rows per program x warps) on the scorer's outputs: picks must
    equal the default launch's; median ms over all chunks."""
    ref = [topn_blocks(p, None, t0, ls, n, 1, 2) for p, t0 in zip(scores, t0s)]
    rows = []
    for c in spec.split(","):
        r_, w = (int(x) for x in c.split("x"))
        row = dict(T=T, block_r=r_, num_warps=w, device=dev)
        try:
            call = lambda: [topn_blocks(p, None, t0, ls, n, 1, 2, r_, w)
                            for p, t0 in zip(scores, t0s)]
            row["equal"] = all(torch.equal(o, e) for o, e in zip(call(), ref))
            row["topn_ms"] = f"{median_ms(call, 'cuda', warmup=5, rep_ms=200):.3f}"
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e).strip()[:150]}"
        print(f"top-n rows {r_} warps {w}: {row}", flush=True)
        rows.append(row)
        write_csv(rows, os.path.join(out, "tune_topn.csv"),
                  fields=["T", "block_r", "num_warps", "topn_ms", "equal", "error", "device"])


if __name__ == "__main__":
    main()
