"""The selected-attention op on the GPU: correctness against the fp64 reference, then the selected
branch's time (op vs FlexAttention's template, SDPA causal of the same shape beside), compiled.

    python experiments/selected_gpu.py --out OUT                       # checks + default timings
    python experiments/selected_gpu.py --out OUT --skip-check --shapes titan_125M:32768 --rows 32,64,128

Writes OUT/selected_check.csv (relative errors of out, lse, dq, dk, dv per case) and
OUT/selected_time.csv (fwd and fwd+bwd medians, ms, per shape / executor / rows / selection).
Selections: `random` (uniform scores: the worst case for sharing loads across positions) or a
trace file (`--trace PATH.npz`, int16 top-n indices [layers, Hkv, T, n] of a trained model).
"""

import argparse
import math
import os
import time

import torch
import torch.nn.functional as F

from masks import MaskContext, get_mask_builder
from nsa_flex.attention import attend_flex, attend_reference
from nsa_flex.bench import kernel_overrides, median_ms, write_csv as _write
from nsa_flex.config import NSAConfig
from nsa_flex.ops import selected_triton
from nsa_flex.rules import random_topn

SHAPES = {  # n_heads, n_kv_heads, d_qk, d_v
    "titan_125M": (16, 2, 64, 64),
    "paper": (64, 4, 192, 128),
    "g8_d128": (16, 2, 128, 128),
    "g1": (4, 4, 64, 64),
    "g2": (8, 4, 64, 64),
}


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def make_cfg(shape):
    H, Hkv, dk, dv = SHAPES[shape]
    return NSAConfig(dim=64, n_heads=H, n_kv_heads=Hkv, d_qk=dk, d_v=dv, backend="flex")


def selection(cfg, B, T, docs, seed):
    starts = torch.zeros(1, T, dtype=torch.long, device="cuda")
    if docs is not None:
        from masks.builders import doc_start

        starts = doc_start(docs)
    return random_topn(cfg, B, T, starts, seed, "cuda")


def spec_of(cfg, B, T, idx, docs=None):
    ctx = MaskContext(cfg, B, T, torch.device("cuda"), doc_ids=docs, topn=lambda: idx)
    return get_mask_builder("topn")(ctx)


def rel(a, b):
    a, b = a.double(), b.double()
    fin = torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), fin):
        return float("nan")
    return ((a[fin] - b[fin]).norm() / b[fin].norm().clamp_min(1e-30)).item()


def check(out_dir, only=None):
    cases = [("titan_125M", 1000, False, torch.bfloat16), ("titan_125M", 1000, True, torch.float32),
             ("paper", 777, True, torch.bfloat16), ("paper", 1024, False, torch.float32),
             ("g8_d128", 900, True, torch.float16), ("g1", 700, False, torch.bfloat16),
             ("g2", 640, True, torch.float32)]
    rows = []
    for shape, T, use_docs, dtype in cases:
        if only and shape not in only:
            continue
        cfg = make_cfg(shape)
        B = 2
        torch.manual_seed(T)
        docs = torch.sort(torch.randint(0, 4, (B, T), device="cuda"), -1).values if use_docs else None
        idx = selection(cfg, B, T, docs, T)
        spec = spec_of(cfg, B, T, idx, docs)
        H, Hkv, dk, dv = SHAPES[shape]
        x = [torch.randn(B, h, T, d, device="cuda", dtype=torch.float64)
             for h, d in ((H, dk), (Hkv, dk), (Hkv, dv))]
        ref_in = [t.clone().requires_grad_() for t in x]
        ro, rl = attend_reference(*ref_in, spec)
        do = torch.randn_like(ro)
        ro.backward(do)
        op_in = [t.to(dtype).requires_grad_() for t in x]
        for heavy, split in ((selected_triton.HEAVY, selected_triton.SPLIT_TILES), (4, 2)):
            for t in op_in:
                t.grad = None
            o, l = attend_flex(*op_in, spec, sel_kernel="triton") if heavy == selected_triton.HEAVY \
                else _op_with(op_in, spec, heavy, split)
            o.backward(do.to(dtype))
            r = dict(shape=shape, T=T, docs=use_docs, dtype=str(dtype).split(".")[-1],
                     heavy=heavy, split_tiles=split, out=rel(o, ro), lse=rel(l, rl),
                     dq=rel(op_in[0].grad, ref_in[0].grad), dk=rel(op_in[1].grad, ref_in[1].grad),
                     dv=rel(op_in[2].grad, ref_in[2].grad))
            tol = 2e-2 if dtype != torch.float32 else 1e-4
            r["ok"] = all(r[k] <= tol for k in ("out", "lse", "dq", "dk", "dv"))
            rows.append(r)
            log(r)
    _write(rows, os.path.join(out_dir, "selected_check.csv"))
    return all(r["ok"] for r in rows)


def _op_with(xs, spec, heavy, split):
    q, k, v = xs
    sel, l_sel = spec.selection
    G = q.shape[1] // k.shape[1]
    P = selected_triton.tile_positions(G)
    bm = spec.block_mask(q.shape[0], q.shape[2], k.shape[2], device="cuda",
                         block_size=(P * G, l_sel), q_pack=G)
    lo = hi = None
    if spec.row_band is not None:
        lo, hi = spec.row_band(torch.arange(q.shape[2], device="cuda"))
    return selected_triton.selected_attention(q, k, v, sel, l_sel, bm, lo, hi, heavy=heavy,
                                              split_tiles=split)


def load_trace(path, T, Hkv, n, layer):
    import numpy as np

    a = np.load(path)["sel"][layer]  # [Hkv, T', n]
    idx = torch.from_numpy(a.astype("int64"))[None, :Hkv, :T, :n].cuda()
    return idx


def _timed(fn, mode, tag, qkv, do, run):
    t0 = time.time()
    try:
        if mode == "fwd":
            with torch.no_grad():
                fn(*qkv[0])
        else:
            fn(*qkv[0]).backward(do)
        torch.cuda.synchronize()
        first = time.time() - t0
        ms, err = run(fn, mode), ""
    except Exception as e:  # keep the sweep going; the row says why
        import traceback

        traceback.print_exc()
        ms, first, err = float("nan"), time.time() - t0, (f"{type(e).__name__}: " + str(e)[-400:])
    r = dict(tag, mode=mode, ms=ms, first_s=round(first, 1), error=err)
    log(r)
    return r


def timing(out_dir, shapes, rows_list, trace):
    res = []
    for item in shapes:
        shape, T = item.split(":")
        T = int(T)
        cfg = make_cfg(shape)
        H, Hkv, dk, dv = SHAPES[shape]
        B = 1
        sels = [("random", selection(cfg, B, T, None, 1))]
        if trace:
            sels.append(("trained", load_trace(trace, T, Hkv, cfg.n_sel, 0)))
        qkv = [[torch.randn(B, h, T, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for h, d in ((H, dk), (Hkv, dk), (Hkv, dv))] for _ in range(3)]
        do = torch.randn(B, H, T, dv, device="cuda", dtype=torch.bfloat16)
        it = [0]

        def nxt():
            it[0] = (it[0] + 1) % len(qkv)
            return qkv[it[0]]

        def run(fn, mode):
            if mode == "fwd":
                with torch.no_grad():
                    return median_ms(lambda: fn(*nxt()), "cuda", warmup=50, rep_ms=300)

            def step():
                o = fn(*nxt())
                o.backward(do)
            return median_ms(step, "cuda", warmup=50, rep_ms=300)

        sd = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True), fullgraph=True)
        for mode in ("fwd", "fwd_bwd"):
            ms = run(sd, mode)
            res.append(dict(shape=shape, T=T, executor="sdpa_causal", rows="", selection="",
                            mode=mode, ms=ms))
            log(res[-1])
        for sname, idx in sels:
            for ex in ["flex"] + [f"triton{r}" for r in rows_list]:
                torch._dynamo.reset()
                rows_ = int(ex[6:]) if ex.startswith("triton") else 0
                # the op's q-block rows for this executor, restored after
                with kernel_overrides(sel_rows=rows_, log=log):
                    kern = "flex" if ex == "flex" else "triton"
                    tag = dict(shape=shape, T=T, executor=kern,
                               rows=ex[6:] if kern == "triton" else "", selection=sname)

                    def f(q, k, v, idx_, kern=kern):  # the mask build inside, as in the layer
                        return attend_flex(q, k, v, spec_of(cfg, B, T, idx_), sel_kernel=kern)[0]

                    cf = torch.compile(f, fullgraph=True, dynamic=False)
                    for mode in ("fwd", "fwd_bwd"):
                        res.append(_timed(lambda q, k, v: cf(q, k, v, idx), mode, tag, qkv, do, run))
                        _write(res, os.path.join(out_dir, "selected_time.csv"))
                    if kern == "triton":  # the op alone on a prebuilt BlockMask (eager), and the build
                        spec = spec_of(cfg, B, T, idx)
                        G = H // Hkv
                        P = selected_triton.tile_positions(G)
                        build = torch.compile(lambda i: spec_of(cfg, B, T, i).block_mask(
                            B, T, T, device="cuda", block_size=(P * G, cfg.l_sel), q_pack=G),
                            fullgraph=True, dynamic=False)
                        bm = build(idx)
                        ms = median_ms(lambda: build(idx), "cuda", warmup=20, rep_ms=100)
                        res.append(dict(tag, executor="mask_build", mode="fwd", ms=ms))
                        log(res[-1])
                        sel = spec.selection[0]
                        for mode in ("fwd", "fwd_bwd"):
                            res.append(_timed(lambda q, k, v: selected_triton.selected_attention(
                                q, k, v, sel, cfg.l_sel, bm)[0], mode, dict(tag, executor="op_only"),
                                qkv, do, run))
                        _write(res, os.path.join(out_dir, "selected_time.csv"))
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--check-shapes", default="", help="comma list: check only these shapes")
    ap.add_argument("--shapes", default="titan_125M:32768,paper:16384,paper:65536")
    ap.add_argument("--rows", default="16,32", help="comma list of the op's q-block rows to time")
    ap.add_argument("--trace", default="", help="selection trace .npz (key 'sel')")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    ok = True
    if not a.skip_check:
        ok = check(a.out, [x for x in a.check_shapes.split(",") if x])
        log("CHECK", "PASS" if ok else "FAIL")
    if a.shapes:
        timing(a.out, a.shapes.split(","), [int(r) for r in a.rows.split(",")], a.trace)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
