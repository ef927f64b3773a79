"""Does the compiled NSA layer (fullgraph, paper config, bf16) compile and run at sequence length T?

For each T and each mode (no_grad forward, forward+backward): compile, run twice, report the
wall time of the second call, or the exception with the tail of its traceback. Used to find where
the whole-layer compile breaks at long T (issue 4); one row per (T, mode, score_chunk) in a CSV.

    python experiments/diag_layer.py --T 16384,32768,65536 --score-chunk 1024,8192 --out DIR
"""

import argparse
import csv
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nsa_flex import NSAAttention, NSAConfig  # noqa: E402

PAPER = dict(n_heads=64, n_kv_heads=4, d_qk=192, d_v=128, dim=2560)


def one(T, mode, chunk, scorer):
    torch._dynamo.reset()
    cfg = NSAConfig(**PAPER, backend="flex", score_chunk=chunk, scorer=scorer)
    layer = NSAAttention(cfg).cuda().to(torch.bfloat16)
    layer.init_weights(0.02)
    f = torch.compile(layer, fullgraph=True, dynamic=False)
    x = torch.randn(1, T, cfg.dim, device="cuda", dtype=torch.bfloat16, requires_grad=mode == "fwd_bwd")
    times = []
    for _ in range(2):
        torch.cuda.synchronize()
        t = time.perf_counter()
        if mode == "fwd_bwd":
            f(x).float().square().mean().backward()
        else:
            with torch.no_grad():
                f(x)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--T", default="16384,32768,65536")
    ap.add_argument("--modes", default="no_grad,fwd_bwd")
    ap.add_argument("--score-chunk", default="1024")
    ap.add_argument("--scorer", default="auto")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "diag_layer.csv")
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["T", "mode", "score_chunk", "scorer", "status", "first_call_s", "second_call_s",
                    "peak_gib", "error"])
        for T in map(int, a.T.split(",")):
            for chunk in map(int, a.score_chunk.split(",")):
                for mode in a.modes.split(","):
                    torch.cuda.reset_peak_memory_stats()
                    print(f"== T={T} mode={mode} score_chunk={chunk} scorer={a.scorer}", flush=True)
                    try:
                        t = one(T, mode, chunk, a.scorer)
                        row = [T, mode, chunk, a.scorer, "ok", f"{t[0]:.2f}", f"{t[1] * 1e3:.1f}ms"]
                        err = ""
                    except Exception as e:  # noqa: BLE001 -- a diagnosis: record and go on
                        tb = traceback.format_exc()
                        name = f"tb_{T}_{mode}_{chunk}_{a.scorer}.txt"
                        with open(os.path.join(a.out, name), "w") as f:  # frames first, IR dump last
                            f.write(tb[:150_000] + ("\n...\n" + tb[-20_000:] if len(tb) > 170_000 else tb[150_000:]))
                        row = [T, mode, chunk, a.scorer, "error", "", ""]
                        err = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                    peak = torch.cuda.max_memory_allocated() / 2**30
                    w.writerow(row + [f"{peak:.1f}", err])
                    fh.flush()
                    print("  ->", row, err[:200], flush=True)
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
