"""Can the sliding-window branch run on FlashAttention-2's local kernels? (experiments/NOTES.md 57)

torch ships FA2 with local (sliding-window) attention behind the private
`aten._flash_attention_forward(..., window_size_left, window_size_right)`, with GQA and autograd
(`_flash_attention_backward`). FA2 needs d_v == d_k, so at the paper shape (192 / 128) v is
padded with zeros to 192 and the output sliced. This probe checks the output, lse and all three
gradients against fp32 math at a T that is not a multiple of any block, then times fwd and
fwd+bwd (medians, do_bench, same process) against the library's flex route of the same mask
(`attend_flex` with `sliding_window(w)`, compiled).

    python experiments/win_flash_probe.py --out OUT
"""

import argparse
import csv
import math
import os
import traceback

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from masks import sliding_window
from nsa_flex.attention import attend_flex

SHAPES = {  # name: (H, Hkv, d_k, d_v)
    "titan_125M": (16, 2, 64, 64),
    "paper": (64, 4, 192, 128),
}


def flash(q, k, v, w, scale):
    """q [B, H, T, Dk], k [B, Hkv, T, Dk], v [B, Hkv, T, Dv] -> out [B, H, T, Dv], lse [B, H, T]."""
    Dv = v.shape[-1]
    if Dv < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - Dv))
    T = q.shape[2]
    out = torch.ops.aten._flash_attention_forward(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, T, T, 0.0, True,
        False, scale=scale, window_size_left=w - 1, window_size_right=0)
    return out[0].transpose(1, 2)[..., :Dv], out[1]


def ref(q, k, v, w, scale):
    B, H, T, _ = q.shape
    G = H // k.shape[1]
    kk, vv = k.float().repeat_interleave(G, 1), v.float().repeat_interleave(G, 1)
    s = q.float() @ kk.transpose(-1, -2) * scale
    t = torch.arange(T, device=q.device)
    ok = (t[None, :] <= t[:, None]) & (t[:, None] - t[None, :] < w)
    s = s.masked_fill(~ok, float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1) @ vv, lse


def inputs(shape, T, seed=0):
    H, Hkv, Dk, Dv = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
    return mk(1, H, T, Dk), mk(1, Hkv, T, Dk), mk(1, Hkv, T, Dv)


def check(shape, T, w):
    q, k, v = inputs(shape, T)
    scale = 1 / math.sqrt(q.shape[-1])
    do = torch.randn_like(q[..., : v.shape[-1]])
    o, lse = flash(q, k, v, w, scale)
    g = torch.autograd.grad(o, (q, k, v), do)
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    ro, rl = ref(qf, kf, vf, w, scale)
    rg = torch.autograd.grad(ro, (qf, kf, vf), do.float())
    err = lambda a, b: float((a.float() - b).abs().max() / b.abs().max().clamp_min(1e-6))
    return {"out_err": err(o, ro), "lse_err": float((lse - rl).abs().max()),
            **{f"d{n}_err": err(a, b) for n, a, b in zip("qkv", g, rg)}}


def timed(fn, q, k, v):
    do = torch.randn_like(q[..., : v.shape[-1]])
    with torch.no_grad():
        fwd = do_bench(lambda: fn(q, k, v), warmup=25, rep=200, return_mode="median")

    def fb():
        o = fn(q, k, v)[0]
        torch.autograd.grad(o, (q, k, v), do)

    return fwd, do_bench(fb, warmup=25, rep=200, return_mode="median")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--runs", default="titan_125M:8192,titan_125M:32768,paper:8192,paper:16384")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    w, rows = args.window, []
    spec = sliding_window(w)
    flex = torch.compile(lambda q, k, v: attend_flex(q, k, v, spec))
    for shape in SHAPES:
        row = {"shape": shape, "T": 1000 + 3, "variant": "flash_check"}
        try:
            row.update(check(shape, row["T"], w))
        except Exception as e:  # noqa: BLE001 -- the row says why
            row["error"] = repr(e)[:300]
            traceback.print_exc()
        print(row, flush=True)
        rows.append(row)
    for run in args.runs.split(","):
        shape, T = run.split(":")
        q, k, v = inputs(shape, int(T), seed=1)
        scale = 1 / math.sqrt(q.shape[-1])
        for name, fn in (("flex", flex), ("flash", lambda q, k, v: flash(q, k, v, w, scale))):
            row = {"shape": shape, "T": int(T), "variant": name}
            try:
                row["fwd_ms"], row["fwd_bwd_ms"] = timed(fn, q, k, v)
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)[:300]
                traceback.print_exc()
            print(row, flush=True)
            rows.append(row)
        torch.cuda.empty_cache()
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(os.path.join(args.out, "win_flash_probe.csv"), "w", newline="") as f:
        wr = csv.DictWriter(f, keys)
        wr.writeheader()
        wr.writerows(rows)


if __name__ == "__main__":
    main()
