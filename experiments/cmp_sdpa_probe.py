"""Can the compressed branch run on SDPA's kernels? (experiments/NOTES.md 55)

Query t sees compressed key i iff i*d + l - 1 <= t, so the positions t = l-1 + m*d + r (r < d) all
see keys 0..m: with the d positions of a group moved into the head axis (H*d "heads", GQA onto
the Hkv key heads) the mask is plain causal over M = num_cmp rows and keys. This probe checks
which private SDPA ops (they return the lse the scorer needs) accept that GQA shape, compares
them with an fp32 math reference, and times fwd+bwd against FlexAttention's template on the same
mask (compiled, same process, medians), with what each keeps for its backward (`saved_MiB`) and
its fwd+bwd peak. `op`: the library's op (`nsa_flex.ops.compressed_sdpa`, cmp_kernel cudnn_lean:
q read through a strided view, opaque to torch.compile).

    python experiments/cmp_sdpa_probe.py --out OUT
"""

import argparse
import csv
import math
import os
import traceback

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from triton.testing import do_bench

from nsa_flex.ops.compressed_sdpa import compressed_sdpa


def pack(q, l, d):
    """[B, H, T, D] -> ([B, H*d, M, D], M): row (h*d + r, m) = position l-1 + m*d + r."""
    B, H, T, D = q.shape
    o = l - 1
    M = -(-(T - o) // d)
    qs = F.pad(q[:, :, o:], (0, 0, 0, M * d - (T - o)))
    return qs.view(B, H, M, d, D).transpose(2, 3).reshape(B, H * d, M, D), M


def unpack(x, T, l, d, fill=0.0):
    """[B, H*d, M, E] -> [B, H, T, E] (positions before l-1: fill)."""
    B, HD, M, E = x.shape
    H = HD // d
    y = x.view(B, H, d, M, E).transpose(2, 3).reshape(B, H, M * d, E)[:, :, : T - (l - 1)]
    return F.pad(y, (0, 0, l - 1, 0), value=fill)


def ref(q, k, v, l, d, scale):
    """fp32 math: out [B, H, T, Dv], lse [B, H, T]."""
    B, H, T, _ = q.shape
    G = H // k.shape[1]
    kk = k.float().repeat_interleave(G, 1)
    vv = v.float().repeat_interleave(G, 1)
    s = q.float() @ kk.transpose(-1, -2) * scale
    t = torch.arange(T, device=q.device)[:, None]
    i = torch.arange(k.shape[2], device=q.device)[None, :]
    s = s.masked_fill(~(i * d + l - 1 <= t), float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return p @ vv, lse


def via(op, q, k, v, l, d, scale):
    T = q.shape[2]
    qp, M = pack(q, l, d)
    kk, vv = k[:, :, :M], v[:, :, :M]
    if op == "cudnn":
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(
            qp, kk, vv, None, True, 0.0, True, False, scale=scale)
        o, lse = out[0], out[1].squeeze(-1)
    elif op == "flash":
        out = torch.ops.aten._scaled_dot_product_flash_attention(qp, kk, vv, 0.0, True, False,
                                                                 scale=scale)
        o, lse = out[0], out[1]
    elif op == "efficient":
        out = torch.ops.aten._scaled_dot_product_efficient_attention(qp, kk, vv, None, True, 0.0,
                                                                     True, scale=scale)
        o, lse = out[0], out[1][..., :M]
    elif op == "op":  # the library's op (nsa_flex.ops.compressed_sdpa)
        return compressed_sdpa(q, k, v, l, d, scale)
    else:  # public SDPA (no lse)
        o = F.scaled_dot_product_attention(qp, kk, vv, is_causal=True, enable_gqa=True,
                                           scale=scale)
        lse = torch.zeros(o.shape[:3], device=o.device)
    return unpack(o, T, l, d), unpack(lse[..., None], T, l, d, float("-inf"))[..., 0]


def saved_mib(fn, inputs) -> float:
    """MiB of the distinct storages fn's forward saves for its backward, its inputs excluded."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    for x in inputs:
        seen.pop(x.untyped_storage().data_ptr(), None)
    return sum(seen.values()) / 2**20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="125M:16:2:64:64:32768,paper:64:4:192:128:16384,"
                    "paper:64:4:192:128:65536")
    ap.add_argument("--ops", default="flex,cudnn,flash,efficient,public,op",
                    help="variants to check and time (`_compiled`: also under torch.compile)")
    a = ap.parse_args()
    ops = a.ops.split(",")
    os.makedirs(a.out, exist_ok=True)
    torch.manual_seed(0)
    dev, dt, l, d = "cuda", torch.bfloat16, 32, 16
    rows = []
    # correctness at a small T, every op, both head shapes
    for name, H, Hkv, Dk, Dv in (("125M", 16, 2, 64, 64), ("paper", 64, 4, 192, 128)):
        T = 1000
        Mk = (T - l) // d + 1
        q = torch.randn(1, H, T, Dk, device=dev, dtype=dt)
        k = torch.randn(1, Hkv, Mk, Dk, device=dev, dtype=dt)
        v = torch.randn(1, Hkv, Mk, Dv, device=dev, dtype=dt)
        scale = 1 / math.sqrt(Dk)
        ro, rl = ref(q, k, v, l, d, scale)
        for op in ("cudnn", "flash", "efficient", "public", "op"):
            if op not in ops:
                continue
            try:
                qq, kk_, vv_ = (x.clone().requires_grad_() for x in (q, k, v))
                o, lse = via(op, qq, kk_, vv_, l, d, scale)
                o.float().square().sum().backward()
                qr, kr, vr = (x.clone().float().requires_grad_() for x in (q, k, v))
                o2, _ = ref(qr, kr, vr, l, d, scale)
                o2.square().sum().backward()
                fin = torch.isfinite(rl)
                err = dict(out=(o.float() - ro).abs().max().item(),
                           lse=(lse[fin] - rl[fin]).abs().max().item(),
                           lse_inf_ok=bool((lse[~fin] == float("-inf")).all()),
                           dq=(qq.grad.float() - qr.grad).abs().max().item(),
                           dk=(kk_.grad.float() - kr.grad).abs().max().item(),
                           dv=(vv_.grad.float() - vr.grad).abs().max().item())
                rows.append(dict(kind="check", shape=name, op=op, T=T, ms="", error="",
                                 **{k_: f"{x:.4g}" if isinstance(x, float) else x
                                    for k_, x in err.items()}))
            except Exception as e:  # noqa: BLE001 - the probe records what fails
                rows.append(dict(kind="check", shape=name, op=op, T=T, ms="",
                                 error=f"{type(e).__name__}: {str(e)[:200]}"))
            print(rows[-1], flush=True)
    # timing: fwd+bwd, packed SDPA ops vs flex on the same mask
    for spec in a.shapes.split(","):
        name, H, Hkv, Dk, Dv, T = spec.split(":")
        H, Hkv, Dk, Dv, T = map(int, (H, Hkv, Dk, Dv, T))
        Mk = (T - l) // d + 1
        q = torch.randn(1, H, T, Dk, device=dev, dtype=dt, requires_grad=True)
        k = torch.randn(1, Hkv, Mk, Dk, device=dev, dtype=dt, requires_grad=True)
        v = torch.randn(1, Hkv, Mk, Dv, device=dev, dtype=dt, requires_grad=True)
        go = torch.randn(1, H, T, Dv, device=dev, dtype=dt)
        scale = 1 / math.sqrt(Dk)

        def mm(b, h, qi, ki):
            return ki * d + l - 1 <= qi

        bm = create_block_mask(mm, 1, 1, T, Mk, device=dev, BLOCK_SIZE=128)
        flex = torch.compile(flex_attention)

        def run_flex():
            o, lse = flex(q, k, v, block_mask=bm, scale=scale, enable_gqa=True, return_lse=True)
            return o

        cands = {"flex": run_flex}
        for op in ("cudnn", "flash", "public", "op"):
            cands[op] = (lambda op=op: via(op, q, k, v, l, d, scale)[0])
        for op in ("cudnn", "op"):
            cands[op + "_compiled"] = torch.compile(lambda op=op: via(op, q, k, v, l, d, scale)[0])
        for op, fn in cands.items():
            if op not in ops and op.removesuffix("_compiled") not in ops:
                continue
            for mode in ("fwd", "fwd_bwd"):
                try:
                    if mode == "fwd":
                        with torch.no_grad():
                            fn()
                            ms = do_bench(fn, warmup=20, rep=100, return_mode="median")
                    else:
                        def step():
                            q.grad = k.grad = v.grad = None
                            fn().backward(go)
                        step()
                        ms = do_bench(step, warmup=20, rep=100, return_mode="median")
                    extra = {}
                    if mode == "fwd_bwd":  # what the call keeps for its backward, and its peak
                        extra["saved_MiB"] = f"{saved_mib(fn, (q, k, v)):.1f}"
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                        base = torch.cuda.memory_allocated()
                        step()
                        torch.cuda.synchronize()
                        extra["peak_MiB"] = f"{(torch.cuda.max_memory_allocated() - base) / 2**20:.1f}"
                    rows.append(dict(kind="time", shape=name, op=op, T=T, mode=mode,
                                     ms=f"{ms:.3f}", error="", **extra))
                except Exception as e:  # noqa: BLE001
                    rows.append(dict(kind="time", shape=name, op=op, T=T, mode=mode, ms="",
                                     error=f"{type(e).__name__}: {str(e)[:200]}"))
                    traceback.print_exc()
                print(rows[-1], flush=True)
        del q, k, v, go
        torch.cuda.empty_cache()
    keys = []
    for r in rows:
        keys += [k_ for k_ in r if k_ not in keys]
    with open(os.path.join(a.out, "cmp_sdpa_probe.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
