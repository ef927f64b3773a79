"""GPU diagnosis of query folding (masks.core.fold_block_mask): which fwd+bwd fails, and does
torch's own BlockMask fail the same way at the folded shape? Each case runs in its own process
with CUDA_LAUNCH_BLOCKING=1 (an async CUDA error poisons the process), prints max |diff| of the
output and the q/k/v gradients against the unfolded call, or the error and the traceback's last
frames. Paper heads (64 q / 4 KV, d_k 192, d_v 128), bf16.

    python experiments/diag_fold.py [--T 4096] [--timeout 120]
"""

import argparse
import os
import subprocess
import sys
import traceback


CASES = ["cmp_fold1", "cmp_fold4", "torch_mask_batch4", "cmp_fold4_eager_mask", "sel_fold4"]


def run_case(name: str, T: int):
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from masks import compressed_causal, selection
    from masks.core import fold_block_mask
    from nsa_flex.attention import attend_flex

    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    Hq, Hkv, Dk, Dv, l, d = 64, 4, 192, 128, 32, 16
    S = (T - l) // d + 1
    q = torch.randn(1, Hq, T, Dk, device=dev, dtype=dt, requires_grad=True)
    if name.startswith("sel"):
        S = T
        ns = T // 64
        g = torch.randint(0, ns, (1, Hkv, T, 16), device=dev)
        t = torch.arange(T, device=dev).view(1, 1, T, 1)
        spec = selection(torch.where(g * 64 <= t, g, -1), 64)
    else:
        spec = compressed_causal(l, d)
    k = torch.randn(1, Hkv, S, Dk, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(1, Hkv, S, Dv, device=dev, dtype=dt, requires_grad=True)

    def fwd_bwd(fn):
        for x in (q, k, v):
            x.grad = None
        o = fn()
        o.float().square().sum().backward()
        torch.cuda.synchronize()
        return o.detach(), [x.grad.detach().clone() for x in (q, k, v)]

    comp = torch.compile(lambda C: attend_flex(q, k, v, spec, q_chunks=C)[0], dynamic=False)
    if name == "torch_mask_batch4":  # torch's own BlockMask at the folded shapes
        C = 4
        qf = q.detach().view(1, Hq, C, T // C, Dk).transpose(1, 2).reshape(C, Hq, T // C, Dk)
        qf = qf.contiguous().requires_grad_()
        kf = k.detach().expand(C, -1, -1, -1).contiguous().requires_grad_()
        vf = v.detach().expand(C, -1, -1, -1).contiguous().requires_grad_()
        rows = T // C
        bm = create_block_mask(lambda b, h, qi, ki: ki * d + l - 1 <= b * rows + qi, C, 1, rows, S,
                               device=dev)
        f = torch.compile(flex_attention, dynamic=False)
        o = f(qf, kf, vf, block_mask=bm, enable_gqa=True)
        o.float().square().sum().backward()
        torch.cuda.synchronize()
        print(f"{name}: ok, out {tuple(o.shape)}")
        return
    if name == "cmp_fold4_eager_mask":  # our folded BlockMask, built eagerly, compiled flex only
        C = 4
        bm = fold_block_mask(spec.block_mask(1, T, S, device=dev, block_size=128), C, 1)
        print("folded lists:", {n: tuple(getattr(bm, n).shape) for n in
                                ("kv_num_blocks", "kv_indices", "q_num_blocks", "q_indices")},
              "max q_idx", int(bm.q_indices.max()), "max kv_idx", int(bm.kv_indices.max()))
        qf = q.detach().view(1, Hq, C, T // C, Dk).transpose(1, 2).reshape(C, Hq, T // C, Dk)
        qf = qf.contiguous().requires_grad_()
        kf = k.detach().expand(C, -1, -1, -1).contiguous().requires_grad_()
        vf = v.detach().expand(C, -1, -1, -1).contiguous().requires_grad_()
        f = torch.compile(flex_attention, dynamic=False)
        o = f(qf, kf, vf, block_mask=bm, enable_gqa=True)
        o.float().square().sum().backward()
        torch.cuda.synchronize()
        print(f"{name}: ok")
        return
    C = int(name.split("fold")[1][0])
    o1, g1 = fwd_bwd(lambda: comp(1))
    if C == 1:
        print(f"{name}: ok")
        return
    oc, gc = fwd_bwd(lambda: comp(C))
    diffs = [float((a.float() - b.float()).abs().max()) for a, b in zip([o1] + g1, [oc] + gc)]
    print(f"{name}: ok, max|diff| out/dq/dk/dv = " + " ".join(f"{x:.3g}" for x in diffs))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--timeout", type=int, default=120)
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.case:
        try:
            run_case(a.case, a.T)
        except Exception as e:  # noqa: BLE001
            tb = traceback.format_exc().splitlines()
            print(f"{a.case}: FAIL {type(e).__name__}: {str(e)[:300]}")
            print("\n".join(tb[-40:]))
            sys.exit(1)
        return
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    for c in CASES:
        print(f"== {c} T={a.T}", flush=True)
        try:
            subprocess.run([sys.executable, __file__, "--case", c, "--T", str(a.T)], env=env,
                           timeout=a.timeout)
        except subprocess.TimeoutExpired:
            print(f"{c}: timeout {a.timeout}s", flush=True)


if __name__ == "__main__":
    main()
