"""GPU correctness of the issue-14 fast paths against the fp32 reference backend (paper heads).

Each case builds its masks inside one `torch.compile(fullgraph=True)` function, as the layer
does, on fresh random bf16 inputs, and compares output and the gradients of a random linear
loss with `attend_reference` in fp32 on the same inputs (rel = |a - b| / |b|):
  selected   the selection split into forced blocks + scored blocks, merged by lse
  packed     the same selection as one packed call (the old path)
  compressed compressed keys with one K/V copy per query head (no GQA in flex's backward)
  causal     the full_causal preset's plain causal mask, run by SDPA
  topn       the Triton top-n against nsa_flex.rules.pick_blocks on the same scores (must be equal)

    python experiments/check_flex_gpu.py --T 4096 --out OUT    # prints one PASS/FAIL line each
"""

import argparse
import csv
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from masks import MaskContext, get_mask_builder  # noqa: E402
from nsa_flex import NSAConfig  # noqa: E402
from nsa_flex.attention import attend_flex, attend_reference  # noqa: E402
from nsa_flex.kernel_options import install_flex_patches  # noqa: E402
from nsa_flex.ops import topn_blocks  # noqa: E402
from nsa_flex.rules import forced_and_valid, pick_blocks  # noqa: E402
from nsa_flex.selection import select_topn  # noqa: E402

PAPER = dict(n_heads=64, n_kv_heads=4, d_qk=192, d_v=128, dim=2560)
TOL = 2e-2  # bf16 operands against fp32


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def compare(name, T, fast, q, k, v, spec_fn, rows):
    """fast(q, k, v) -> (out, lse) compiled; reference on fp32 copies with the same spec."""
    dev = q.device
    w = torch.randn(q.shape[0], q.shape[1], q.shape[2], v.shape[-1], device=dev)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out, _ = fast(*leaves)
    g_fast = torch.autograd.grad((out.float() * w).sum(), leaves)
    ref_leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    ref, _ = attend_reference(*ref_leaves, spec_fn())
    g_ref = torch.autograd.grad((ref * w).sum(), ref_leaves)
    errs = dict(out=rel(out, ref), dq=rel(g_fast[0], g_ref[0]), dk=rel(g_fast[1], g_ref[1]),
                dv=rel(g_fast[2], g_ref[2]))
    ok = all(e < TOL and e == e for e in errs.values())
    rows.append(dict(case=name, T=T, ok=ok, **{f"rel_{k_}": f"{e:.2e}" for k_, e in errs.items()}))
    print(f"{'PASS' if ok else 'FAIL'} {name:10s} T={T} " +
          " ".join(f"{k_}={e:.2e}" for k_, e in errs.items()), flush=True)
    del ref_leaves, g_ref
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--out", default="")
    ap.add_argument("--cases", default="selected,packed,compressed,causal,topn")
    args = ap.parse_args()
    T, dev, bf = args.T, torch.device("cuda"), torch.bfloat16
    install_flex_patches()  # the cases compile flex on their own, before any layer
    cfg = NSAConfig(**PAPER, backend="flex")
    B, H, Hkv, dk, dv = 1, cfg.n_heads, cfg.n_kv_heads, cfg.d_qk, cfg.d_v
    torch.manual_seed(0)
    R = lambda *s: torch.randn(*s, device=dev, dtype=bf)
    q, k, v = R(B, H, T, dk), R(B, Hkv, T, dk), R(B, Hkv, T, dv)
    nc = cfg.num_cmp(T)
    kc, vc = R(B, Hkv, nc, dk), R(B, Hkv, nc, dv)
    rows = []
    ctx = MaskContext(cfg, B, T, dev)
    cspec = lambda: get_mask_builder("compressed_causal")(ctx)

    # selection from the real scorer (Triton scores + Triton top-n) on these inputs
    with torch.no_grad():
        lse = attend_flex(q, kc, vc, cspec())[1]
        idx = select_topn(q, kc, lse, cfg)
    sctx = MaskContext(cfg, B, T, dev, topn=lambda: idx)
    sspec = lambda: get_mask_builder("topn")(sctx)

    def compiled(spec_fn):
        return torch.compile(lambda q_, k_, v_: attend_flex(q_, k_, v_, spec_fn()),
                             fullgraph=True, dynamic=False)

    cases = set(args.cases.split(","))
    packed = lambda: replace(sspec(), parts=None)
    causal = lambda: get_mask_builder("causal")(ctx)
    for name, spec_fn, kv in [("selected", sspec, (k, v)), ("packed", packed, (k, v)),
                              ("compressed", cspec, (kc, vc)), ("causal", causal, (k, v))]:
        if name in cases:
            compare(name, T, compiled(spec_fn), q, *kv, spec_fn, rows)
    if "topn" not in cases:
        return finish(rows, args.out)

    # top-n: Triton kernel == pick_blocks on the same scores (ties included)
    ns = -(-T // cfg.l_sel)
    p = torch.randint(0, 5, (B, Hkv, T, ns), device=dev).float()
    starts = torch.zeros(1, T, dtype=torch.long, device=dev)
    valid, forced = forced_and_valid(cfg, T, starts, dev)
    want = pick_blocks(p, valid.unsqueeze(1), forced.unsqueeze(1), cfg.n_sel)
    got = topn_blocks(p, None, 0, cfg.l_sel, cfg.n_sel, cfg.n_init, cfg.n_local)
    ok = torch.equal(got, want)
    rows.append(dict(case="topn", T=T, ok=ok))
    print(f"{'PASS' if ok else 'FAIL'} topn       T={T} equal={ok}", flush=True)
    finish(rows, args.out)


def finish(rows, out):
    if out:
        os.makedirs(out, exist_ok=True)
        keys = sorted({k_ for r in rows for k_ in r}, key=lambda x: (x not in ("case", "T", "ok"), x))
        with open(os.path.join(out, "check_flex_gpu.csv"), "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=keys)
            wr.writeheader()
            wr.writerows(rows)
    sys.exit(0 if all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    main()
