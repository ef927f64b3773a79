"""Launch-option sweep of the selected-attention op (`nsa_flex.ops.selected_triton`) on the GPU: the
op alone (eager, on prebuilt lists, as selected_gpu.py's op_only rows) at one shape, on random and
trained selections.

    python experiments/tune_selected.py --out OUT                        # 125M shape at 32k
    python experiments/tune_selected.py --out OUT --shape paper:64:4:192:128:16384

Grids: the forward kernel's q block rows x num_warps x num_stages (`selected_lists(rows=...)`,
`SelectedTuning.fwd_launch`), timed forward only (no grad); the dK/dV kernel's gathered rows x
num_warps x num_stages (`SelectedTuning.dkv_rows`, `dkv_launch`) and the dQ kernel's q block rows x
num_warps x num_stages (`dq_launch`, where dQ is not atomic; rows > 0 are the forward's too, so the
dQ pass runs on those blocks alone, not hybrid); each config is a tuning record passed to the op,
timed fwd+bwd (`ms`, triton's do_bench median) and by their own kernel (`kernel_ms`, torch.profiler). Before timing, every config's outputs (fwd: out, lse) or gradients (dkv: dq, dk,
dv) are compared with the default config's: `err` = max abs diff (a heavy block's dK/dV and an
atomic dQ are fp32 sums in arrival order: small diffs there are expected, a wrong config shows as
a large one). A config that fails (compile: shared memory, registers) gets its error in the row and
the sweep goes on. Inputs are random normal (q, k, v, dO); selections: `random` (uniform scores)
and `trained` (--trace NPZ:LAYER, its first T positions; skipped with the reason where it does not
fit the shape). Writes OUT/tune_selected.csv after every row and prints the best config per kernel
and selection (by kernel_ms where measured, else ms). --quick: a tiny shape and grid, for a smoke
test on the CPU under TRITON_INTERPRET=1.
"""

import argparse
import dataclasses
import functools
import math
import os
import time

import torch

from nsa_flex.bench import kernel_ms, median_ms, write_csv
from nsa_flex.config import NSAConfig
from nsa_flex.ops import (DEFAULT_TUNING, selected_attention, selected_lists,
                          triton_interpreted)
from selected_gpu import DEV, log, selection, spec_of, trace_selection

HERE = os.path.dirname(os.path.abspath(__file__))
TRACE = os.path.join(HERE, "results", "quality", "selection_traces", "nsa_L32768.npz") + ":6"
# (q block rows, num_warps, num_stages); rows 0: the layer's default for the shape
FWD = [(r, w, s) for r in (0, 32, 64) for w in (2, 4, 8) for s in (2, 3)]
DKV = [(r, w, s) for r in (32, 64, 128) for w in (4, 8) for s in (1, 2, 3)]  # (DKV_ROWS, ...)
DQ = [(r, w, s) for r in (16, 32, 64) for w in (2, 4, 8) for s in (1, 2)]  # where dQ is not atomic
# --quick: the first config of each grid is the default in fp32 (the interpreter's dtype)
QUICK = dict(shape="tiny:4:2:48:32:96", l_sel=16, n_sel=4, fwd=[(0, 8, 2), (32, 2, 1)],
             dkv=[(128, 8, 2), (16, 4, 1)])
KERNELS = {"fwd": "_sel_fwd_kernel", "dkv": "_sel_dkv_kernel", "dq": "_sel_dq_kernel"}
FIELDS = ["shape", "T", "selection", "kernel", "config", "ms", "kernel_ms", "err", "error", "device"]


def parse_shape(text: str) -> tuple[str, int, int, int, int, int]:
    """name:Hq:Hkv:Dk:Dv:T -> (name, Hq, Hkv, Dk, Dv, T)."""
    parts = text.split(":")
    if len(parts) != 6 or not all(p.isdigit() and int(p) > 0 for p in parts[1:]) \
            or int(parts[1]) % int(parts[2]):
        raise SystemExit(f"--shape: {text!r} must be name:Hq:Hkv:Dk:Dv:T (positive ints, Hq a "
                         "multiple of Hkv), e.g. 125M:16:2:64:64:32768")
    return (parts[0], *map(int, parts[1:]))


def parse_grid(text: str, n: int, what: str) -> list[tuple[int, ...]]:
    """"32:4:2,8:1" -> [(32, 4, 2), (0, 8, 1)] (n ints an entry; for fwd / dq the rows may be left
    out: 0, the default rows)."""
    out = []
    for item in [x for x in text.split(",") if x]:
        parts = item.split(":")
        if what in ("fwd", "dq") and len(parts) == n - 1:
            parts = ["0", *parts]
        ok = len(parts) == n and all(p.isdigit() and int(p) > 0 for p in parts[1:]) and \
            parts[0].isdigit() and (int(parts[0]) > 0 or what in ("fwd", "dq"))
        if not ok:
            raise SystemExit(f"--{what}: {item!r} must be {n} positive ints joined by ':'"
                             + (" (rows 0 or left out: the default)" if what != "dkv" else ""))
        out.append(tuple(map(int, parts)))
    return out


def config_name(kernel: str, cfg: tuple) -> str:
    """fwd (32, 4, 2) -> r32:w4:s2, (0, 4, 2) -> w4:s2 (default rows); dkv (64, 4, 2) -> r64:w4:s2."""
    rows, w, s = cfg
    return (f"r{rows}:" if rows else "") + f"w{w}:s{s}"


def tuning_for(kernel: str, cfg: tuple):
    """The op's tuning with `kernel`'s launch options set to cfg (and, for dkv, its gathered
    rows); the q block rows of fwd / dq are the lists' business (`lists_for`)."""
    rows, w, s = cfg
    extra = {"dkv_rows": rows} if kernel == "dkv" else {}
    return dataclasses.replace(DEFAULT_TUNING, **{f"{kernel}_launch": (w, s)}, **extra)


def max_diff(a: list, b: list) -> float:
    """Max abs difference over tensor pairs (equal infinities: 0)."""
    return max(torch.where(x == y, 0.0, (x.float() - y.float()).abs()).max().item()
               for x, y in zip(a, b))


def sweep(a, shape: str, sel_names: list[str], grids: dict, rows: list, path: str, t_end: float,
          defaults: dict) -> bool:
    """Every config of `grids` on each selection at one shape: rows appended (CSV rewritten after
    each), the default configs' names into defaults[(shape, T, kernel)]; False when the time limit
    stopped it."""
    name, H, Hkv, dk, dv, T = parse_shape(shape)
    G, B = H // Hkv, 1
    cfg = NSAConfig(dim=64, n_heads=H, n_kv_heads=Hkv, d_qk=dk, d_v=dv, l_sel=a.l_sel,
                    n_sel=a.n_sel, backend="flex")
    dt = torch.bfloat16 if DEV == "cuda" else torch.float32  # the interpreter computes in fp32
    device = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreted)"
    t0 = DEFAULT_TUNING
    opts = {kern: t0.launch_opts(kern, dt, r) for kern, r in
            (("fwd", t0.fwd_rows(G)), ("dq", t0.rows), ("dkv", 16))}
    ws = {kern: (o["num_warps"], o["num_stages"]) for kern, o in opts.items()}
    defaults.update({(name, T, "fwd"): config_name("fwd", (0, *ws["fwd"])),
                     (name, T, "dq"): config_name("dq", (0, *ws["dq"])),
                     (name, T, "dkv"): config_name("dkv", (t0.dkv_rows, *ws["dkv"]))})
    torch.manual_seed(0)
    q, k, v = [torch.randn(B, h, T, d, device=DEV, dtype=dt, requires_grad=True)
               for h, d in ((H, dk), (Hkv, dk), (Hkv, dv))]
    do = torch.randn(B, H, T, dv, device=DEV, dtype=dt)
    for sname in sel_names:
        base = dict(shape=name, T=T, device=device)
        if sname == "random":
            idx, label = selection(cfg, B, T, None, 1), "random"
        else:
            idx, label = trace_selection(a.trace, T, Hkv, a.n_sel)
            if idx is None:
                log(f"{name} T={T}: no trained selection ({label})")
                rows.append(dict(base, selection="trained", error=f"no trained selection: {label}"))
                write_csv(rows, path, fields=FIELDS)
                continue
        base["selection"] = label
        spec, cache = spec_of(cfg, B, T, idx), {}

        def lists_for(kern, c):  # the op's lists with this config's q block rows (0: default);
            # a dQ config's rows are the forward's too: one dQ pass on them, not the hybrid one
            key = (c[0], 0) if kern == "fwd" else (c[0], c[0]) if kern == "dq" else (0, 0)
            if key not in cache:
                cache[key] = selected_lists(spec, B, T, T, G, q.shape[-1], DEV, rows=key[0] or None,
                                            rows_dq=key[1] or None)
            return cache[key]

        def fwd(lists, tuning=DEFAULT_TUNING):
            with torch.no_grad():
                return list(selected_attention(q, k, v, **dict(lists, tuning=tuning)))

        def fwd_bwd(lists, tuning=DEFAULT_TUNING):
            o, _ = selected_attention(q, k, v, **dict(lists, tuning=tuning))
            return list(torch.autograd.grad(o, (q, k, v), do))

        fns = {"fwd": fwd, "dkv": fwd_bwd, "dq": fwd_bwd}
        default = lists_for("fwd", (0,))
        ref = {kern: fn(default) for kern, fn in fns.items()}  # what every config is compared with
        for kern, grid in grids.items():
            for c in grid:
                if time.time() > t_end:
                    log(f"--max-minutes reached: stopping before {kern} {config_name(kern, c)}")
                    return False
                row = dict(base, kernel=kern, config=config_name(kern, c), ms=math.nan,
                           kernel_ms=math.nan, err=math.nan, error="")
                try:
                    fn = functools.partial(fns[kern], lists_for(kern, c), tuning_for(kern, c))
                    row["err"] = max_diff(fn(), ref[kern])  # compiles: errors here
                    row["ms"] = median_ms(fn, DEV, reps=1, warmup=25, rep_ms=a.rep_ms)
                    if DEV == "cuda":
                        row["kernel_ms"] = sum(ms for kname, _, ms in kernel_ms(fn)
                                               if KERNELS[kern] in kname)
                except Exception as e:  # keep the sweep going; the row says why
                    row["error"] = f"{type(e).__name__}: " + " ".join(str(e).split())[-300:]
                rows.append(row)
                write_csv(rows, path, fields=FIELDS)
                log(row)
    return True


def best(rows: list, defaults: dict) -> list[str]:
    """One line per (shape, selection, kernel): the fastest config (kernel_ms where measured,
    else ms) and the default config's times beside it."""
    out, groups = [], {}
    for r in rows:
        if r.get("kernel") and not r["error"] and math.isfinite(r["ms"]):
            groups.setdefault((r["shape"], r["T"], r["selection"], r["kernel"]), []).append(r)
    for (shape, T, sel, kern), rs in groups.items():
        key = (lambda r: r["kernel_ms"]) if all(math.isfinite(r["kernel_ms"]) for r in rs) else \
            (lambda r: r["ms"])
        b = min(rs, key=key)
        line = (f"best {shape} T={T} {sel} {kern}: {b['config']} ms={b['ms']:.3f} "
                f"kernel_ms={b['kernel_ms']:.3f} err={b['err']:.3g}")
        d = [r for r in rs if r["config"] == defaults.get((shape, T, kern))]
        if d:
            line += f" (default {d[0]['config']}: ms={d[0]['ms']:.3f} kernel_ms={d[0]['kernel_ms']:.3f})"
        out.append(line)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="", help="comma list of name:Hq:Hkv:Dk:Dv:T (default "
                    "125M:16:2:64:64:32768; --quick: " + QUICK["shape"] + ")")
    ap.add_argument("--selection", default="random,trained", help="comma list: random, trained")
    ap.add_argument("--trace", default=TRACE, metavar="NPZ[:LAYER]",
                    help="the trained selection (python -m nsa_flex.eval --task selection)")
    ap.add_argument("--l-sel", type=int, default=0, help="selection block l' (default 64; --quick 16)")
    ap.add_argument("--n-sel", type=int, default=0, help="selected blocks n (default 16; --quick 4)")
    ap.add_argument("--fwd", default="", help="comma list of [ROWS:]WARPS:STAGES for the forward "
                    "kernel (ROWS: its q blocks' rows, 0 or left out: the default; default grid: "
                    "{0,32,64} x {2,4,8} x {2,3})")
    ap.add_argument("--dkv", default="", help="comma list of ROWS:WARPS:STAGES for the dK/dV "
                    "kernel (default: {32,64,128} x {4,8} x {1,2,3})")
    ap.add_argument("--dq", default="", help="comma list of [ROWS:]WARPS:STAGES for the dQ kernel "
                    "(default: {16,32,64} x {2,4,8} x {1,2}; 'none': skip; it runs only where dQ is "
                    "not accumulated by atomics in the dK/dV pass, e.g. the paper shape)")
    ap.add_argument("--rep-ms", type=int, default=200, help="do_bench's repetition time per config")
    ap.add_argument("--max-minutes", type=float, default=0,
                    help="stop the sweep after this long (0: no limit), keeping what it has")
    ap.add_argument("--quick", action="store_true",
                    help="tiny shape and grid: a CPU smoke test under TRITON_INTERPRET=1")
    a = ap.parse_args(argv)
    if DEV != "cuda" and not triton_interpreted():
        ap.error("needs a CUDA GPU (or TRITON_INTERPRET=1 on the CPU, for --quick)")
    a.l_sel = a.l_sel or (QUICK["l_sel"] if a.quick else 64)
    a.n_sel = a.n_sel or (QUICK["n_sel"] if a.quick else 16)
    shapes = [s for s in (a.shape or (QUICK["shape"] if a.quick else "125M:16:2:64:64:32768"))
              .split(",") if s]
    for s in shapes:
        parse_shape(s)
    sels = [s for s in a.selection.split(",") if s]
    if not sels or set(sels) - {"random", "trained"}:
        ap.error(f"--selection: a comma list of random, trained; got {a.selection!r}")
    grids = {"fwd": parse_grid(a.fwd, 3, "fwd") or (QUICK["fwd"] if a.quick else FWD),
             "dkv": parse_grid(a.dkv, 3, "dkv") or (QUICK["dkv"] if a.quick else DKV)}
    if a.dq != "none" and (a.dq or not a.quick):  # --quick: only a --dq given explicitly
        grids["dq"] = parse_grid(a.dq, 3, "dq") or DQ
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "tune_selected.csv")
    t_end = time.time() + (a.max_minutes * 60 if a.max_minutes > 0 else math.inf)
    rows, defaults = [], {}
    for s in shapes:
        if not sweep(a, s, sels, grids, rows, path, t_end, defaults):
            break
    write_csv(rows, path, fields=FIELDS)
    for line in best(rows, defaults):
        print(line, flush=True)
    print(f"wrote {path} ({len(rows)} rows)", flush=True)


if __name__ == "__main__":
    main()
