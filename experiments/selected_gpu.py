"""The selected-attention op on the GPU: correctness against the fp64 reference, then the selected
branch's time per q-block layout and dQ mode, on random and trained selections, compiled.

    python experiments/selected_gpu.py --out OUT                       # checks + default timings
    python experiments/selected_gpu.py --out OUT --skip-check --shapes titan_125M:32768 \
        --layouts 16,16:0,32 --trace experiments/results/quality/selection_traces/nsa_L32768.npz:6

Writes OUT/selected_check.csv (relative errors of out, lse, dq, dk, dv per case and layout),
OUT/selected_time.csv (fwd and fwd+bwd medians, ms: `branch` = mask build + op compiled as in the
layer, `mask_build` alone, `op_only` on the prebuilt lists, SDPA causal of the same shape beside,
flex's template with --flex) and OUT/selected_kernels.csv (the op-only fwd+bwd kernel by kernel).
Layouts ROWS[:DQ]: the op's q-block rows (`SelectedTuning.rows`: the dQ pass's, and the forward's
where G < 16; at G >= 16 the forward takes `fwd_rows`, at least 64) and its dq_atomic (1: dQ in the
dK/dV pass, 0: the dQ pass; left out: by shape). Selections: `random` (uniform scores: the worst case
for sharing loads across positions) and, with --trace NPZ[:LAYER], a trained model's
(`python -m nsa_flex.eval --task selection`; its first T positions). On a machine without CUDA it
runs on the CPU under TRITON_INTERPRET=1 (tiny shapes only: a smoke test of the script).
"""

import argparse
import dataclasses
import math
import os
import time

import torch
import torch.nn.functional as F

from masks import MaskContext, get_mask_builder
from nsa_flex.attention import attend_flex, attend_reference, attend_selected
from nsa_flex.bench import kernel_ms, median_ms, write_csv as _write
from nsa_flex.config import NSAConfig
from nsa_flex.ops import DEFAULT_TUNING, SelectedTuning, selected_attention, selected_lists
from nsa_flex.rules import random_topn

SHAPES = {  # n_heads, n_kv_heads, d_qk, d_v
    "titan_125M": (16, 2, 64, 64),
    "paper": (64, 4, 192, 128),
    "g8_d128": (16, 2, 128, 128),
    "g1": (4, 4, 64, 64),
    "g2": (8, 4, 64, 64),
}
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def make_cfg(shape):
    H, Hkv, dk, dv = SHAPES[shape]
    return NSAConfig(dim=64, n_heads=H, n_kv_heads=Hkv, d_qk=dk, d_v=dv, backend="flex")


def selection(cfg, B, T, docs, seed):
    starts = torch.zeros(1, T, dtype=torch.long, device=DEV)
    if docs is not None:
        from masks.builders import doc_start

        starts = doc_start(docs)
    return random_topn(cfg, B, T, starts, seed, DEV)


def spec_of(cfg, B, T, idx, docs=None):
    ctx = MaskContext(cfg, B, T, torch.device(DEV), doc_ids=docs, topn=lambda: idx)
    return get_mask_builder("topn")(ctx)


def rel(a, b):
    a, b = a.double(), b.double()
    fin = torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), fin):
        return float("nan")
    return ((a[fin] - b[fin]).norm() / b[fin].norm().clamp_min(1e-30)).item()


def check(out_dir, only=None, layouts=(SelectedTuning(dq_atomic=False),), cases=None):
    """Op vs fp64 reference per case, layout and dK/dV split (the default one, and 4 heavy blocks
    in shares of 2 q blocks): relative errors of out, lse and every gradient."""
    cases = cases or [("titan_125M", 1000, False, torch.bfloat16), ("titan_125M", 1000, True, torch.float32),
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
        docs = torch.sort(torch.randint(0, 4, (B, T), device=DEV), -1).values if use_docs else None
        idx = selection(cfg, B, T, docs, T)
        spec = spec_of(cfg, B, T, idx, docs)
        H, Hkv, dk, dv = SHAPES[shape]
        x = [torch.randn(B, h, T, d, device=DEV, dtype=torch.float64)
             for h, d in ((H, dk), (Hkv, dk), (Hkv, dv))]
        ref_in = [t.clone().requires_grad_() for t in x]
        ro, rl = attend_reference(*ref_in, spec)
        do = torch.randn_like(ro)
        ro.backward(do)
        if DEV != "cuda":  # Triton's interpreter computes in fp32 only
            dtype = torch.float32
        op_in = [t.to(dtype).requires_grad_() for t in x]
        for layout in layouts:
            for heavy, split in ((DEFAULT_TUNING.heavy, DEFAULT_TUNING.split_tiles), (4, 2)):
                for t in op_in:
                    t.grad = None
                tuning = dataclasses.replace(layout, heavy=heavy, split_tiles=split)
                o, l = attend_selected(*op_in, spec, tuning=tuning)
                o.backward(do.to(dtype))
                r = dict(shape=shape, T=T, docs=use_docs, dtype=str(dtype).split(".")[-1],
                         layout=layout_name(layout), heavy=heavy, split_tiles=split,
                         out=rel(o, ro), lse=rel(l, rl), dq=rel(op_in[0].grad, ref_in[0].grad),
                         dk=rel(op_in[1].grad, ref_in[1].grad), dv=rel(op_in[2].grad, ref_in[2].grad))
                tol = 2e-2 if dtype != torch.float32 else 1e-4
                r["ok"] = all(r[k] <= tol for k in ("out", "lse", "dq", "dk", "dv"))
                rows.append(r)
                log(r)
    _write(rows, os.path.join(out_dir, "selected_check.csv"))
    return all(r["ok"] for r in rows)


def layout_name(t: SelectedTuning) -> str:
    """ROWS[:DQ] (no DQ: the op's choice by shape)."""
    return f"{t.rows}" + ("" if t.dq_atomic is None else f":{int(t.dq_atomic)}")


def parse_layouts(text: str) -> list[SelectedTuning]:
    """"16,32:1" -> [SelectedTuning(rows=16), SelectedTuning(rows=32, dq_atomic=True)] (DQ left
    out: the op chooses by shape): a clear error for a bad entry."""
    out = []
    for item in [x for x in text.split(",") if x]:
        parts = item.split(":")
        if len(parts) not in (1, 2) or not all(p.isdigit() for p in parts) or int(parts[0]) % 16 \
                or int(parts[0]) == 0 or any(p not in ("0", "1") for p in parts[1:]):
            raise SystemExit(f"--layouts: {item!r} must be ROWS[:DQ] with ROWS a positive multiple "
                             "of 16 and DQ 0 or 1 (e.g. 16 or 32:1)")
        out.append(SelectedTuning(rows=int(parts[0]),
                                  dq_atomic=parts[1] == "1" if len(parts) == 2 else None))
    return out


def trace_selection(spec: str, T: int, Hkv: int, n: int):
    """The first T positions of a trained selection NPZ[:LAYER[+LAYER]] ([1, Hkv, T, n] int64),
    or None with the reason when it does not fit the shape."""
    from nsa_flex.apps.eval.selection_stats import fit_trace, load_trace_arg

    try:
        idx, label = fit_trace(*load_trace_arg(spec), Hkv, T, n)
    except ValueError as e:
        return None, str(e)
    return idx.to(DEV), label


def _timed(fn, mode, tag, qkv, do, run):
    t0 = time.time()
    try:
        if mode == "fwd":
            with torch.no_grad():
                fn(*qkv[0])
        else:
            fn(*qkv[0]).backward(do)
        if DEV == "cuda":
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


def timing(out_dir, shapes, layouts, trace, flex=False):
    res, kernels = [], []
    path = os.path.join(out_dir, "selected_time.csv")
    for item in shapes:
        shape, T = item.split(":")
        T = int(T)
        cfg = make_cfg(shape)
        H, Hkv, dk, dv = SHAPES[shape]
        G, B = H // Hkv, 1
        sels = [("random", selection(cfg, B, T, None, 1))]
        if trace:
            idx, name = trace_selection(trace, T, Hkv, cfg.n_sel)
            if idx is None:
                log(f"{shape} T={T}: no trained selection ({name})")
            else:
                sels.append((name, idx))
        dt = torch.bfloat16 if DEV == "cuda" else torch.float32
        qkv = [[torch.randn(B, h, T, d, device=DEV, dtype=dt, requires_grad=True)
                for h, d in ((H, dk), (Hkv, dk), (Hkv, dv))] for _ in range(3)]
        do = torch.randn(B, H, T, dv, device=DEV, dtype=dt)
        it = [0]

        def nxt():  # a fresh input set per call (three rotate: no cache-warm repeats)
            it[0] = (it[0] + 1) % len(qkv)
            return qkv[it[0]]

        def run(fn, mode):
            if mode == "fwd":
                with torch.no_grad():
                    return median_ms(lambda: fn(*nxt()), DEV, warmup=50, rep_ms=300)

            def step():
                fn(*nxt()).backward(do)
            return median_ms(step, DEV, warmup=50, rep_ms=300)

        if DEV == "cuda":
            sd = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True), fullgraph=True)
            for mode in ("fwd", "fwd_bwd"):
                res.append(dict(shape=shape, T=T, executor="sdpa_causal", layout="", selection="",
                                mode=mode, ms=run(sd, mode)))
                log(res[-1])
        for sname, idx in sels:
            base = dict(shape=shape, T=T, selection=sname)
            if flex:
                torch._dynamo.reset()
                cf = torch.compile(lambda q, k, v: attend_flex(q, k, v, spec_of(cfg, B, T, idx))[0],
                                   fullgraph=True, dynamic=False)
                for mode in ("fwd", "fwd_bwd"):
                    res.append(_timed(cf, mode, dict(base, executor="flex", layout=""), qkv, do, run))
            for tuning in layouts:
                tag = dict(base, layout=layout_name(tuning))
                torch._dynamo.reset()
                if DEV == "cuda":  # the branch as the layer runs it: the mask build compiled in
                    cf = torch.compile(lambda q, k, v: attend_selected(
                        q, k, v, spec_of(cfg, B, T, idx), tuning=tuning)[0],
                        fullgraph=True, dynamic=False)
                    for mode in ("fwd", "fwd_bwd"):
                        res.append(_timed(cf, mode, dict(tag, executor="branch"), qkv, do, run))
                    _write(res, path)
                # the mask build alone (compiled) and the op on its prebuilt lists (eager)
                build = torch.compile(lambda i: {k: x for k, x in selected_lists(
                    spec_of(cfg, B, T, i), B, T, T, G, dk, DEV, tuning).items() if k != "tuning"},
                                      fullgraph=True, dynamic=False)
                lists = build(idx)
                res.append(dict(tag, executor="mask_build", mode="fwd",
                                ms=median_ms(lambda: build(idx), DEV, warmup=20, rep_ms=100)))
                log(res[-1])

                def op(q, k, v):
                    return selected_attention(q, k, v, tuning=tuning, **lists)[0]

                for mode in ("fwd", "fwd_bwd"):
                    res.append(_timed(op, mode, dict(tag, executor="op_only"), qkv, do, run))
                _write(res, path)
                if DEV == "cuda":  # where the op's fwd+bwd goes, kernel by kernel
                    for name, n, ms in kernel_ms(lambda: op(*nxt()).backward(do)):
                        kernels.append(dict(tag, kernel=name[:120], launches=n, ms=ms))
                    _write(kernels, os.path.join(out_dir, "selected_kernels.csv"))
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--check-shapes", default="", help="comma list: check only these shapes")
    ap.add_argument("--check-len", type=int, default=0,
                    help="sequence length of every check case (default: each case's own, 640-1024)")
    ap.add_argument("--shapes", default="titan_125M:32768,paper:16384,paper:65536")
    ap.add_argument("--layouts", default="16,32",
                    help="comma list of ROWS[:DQ] (the op's q-block rows and dq_atomic: "
                         "SelectedTuning) to time and to check")
    ap.add_argument("--trace", default="", metavar="NPZ[:LAYER[+LAYER]]",
                    help="a trained selection (selection_L<T>.npz of python -m nsa_flex.eval --task "
                         "selection): timed beside random selections")
    ap.add_argument("--flex", action="store_true", help="also time FlexAttention's template")
    a = ap.parse_args()
    layouts = parse_layouts(a.layouts)
    os.makedirs(a.out, exist_ok=True)
    ok = True
    if not a.skip_check:
        cases = None
        if a.check_len:
            cases = [("titan_125M", a.check_len, False, torch.bfloat16), ("g2", a.check_len, True, torch.float32)]
        ok = check(a.out, [x for x in a.check_shapes.split(",") if x], layouts, cases)
        log("CHECK", "PASS" if ok else "FAIL")
    if a.shapes:
        timing(a.out, a.shapes.split(","), layouts, a.trace, a.flex)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
