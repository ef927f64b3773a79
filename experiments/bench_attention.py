"""Compile-mode benchmark of the NSA layer, its stages, and full-attention baselines.

    python experiments/bench_attention.py --out experiments/results/bench      # H100, full sweep
    python experiments/bench_attention.py --quick --out /tmp/bench             # CPU, tiny, CI
    # one long T, every item capped at 150 s per phase, the stages first:
    python experiments/bench_attention.py --configs paper --T 65536 --item-limit 150 --out OUT
    # memory check: only the whole layer's forward+backward
    python experiments/bench_attention.py --configs paper --T 131072 --only nsa_layer \\
        --modes fwd_bwd --out OUT
    # layer + baselines, no stages
    python experiments/bench_attention.py --configs paper --T 4096,16384 --stages-at "" --out OUT

Items, in the order they run for each (config, T): the per-stage breakdown (projections,
compression, score_topn, mask_build, attn_compressed, attn_selected, attn_window, gate_out; only
at the --stages-at T values), the baselines of the same shape (sdpa_causal, flex_causal and, when
fla-core is installed, fla_parallel_nsa_w0: its `parallel_nsa` = compression + top-k + selection,
run with window 0 since its window path needs flash_attn), then the whole layer (nsa_layer), the
slowest to compile, last. --only picks a subset, --modes fwd / fwd_bwd the modes (fwd+bwd only on
CUDA: CPU flex has no backward).

Each item runs in phases: setup (weights, inputs, masks), then per mode the first call (compile
included; CSV fwd_first_s / fwd_bwd_first_s) and the timing. Every phase prints a timestamped start
and end line to stdout (flushed), so a log cut off by `timeout` shows where the time went; the CSV
is rewritten before every phase (the running item reads "unfinished: <phase>") and after every row.
Times are medians of triton's do_bench (CUDA events) on fresh random inputs (never zeros),
rotating between several input sets (passed to the compiled functions as arguments), compile
excluded (the harness: nsa_flex.bench).

--item-limit S limits each phase to S seconds (nsa_flex.bench.time_limit, SIGALRM); on expiry
the row gets e.g. error="fwd(no_grad) timeout after 150s (first call)", the traceback at that
moment goes to errors.log, and the sweep goes on. A hang inside one C call (a CUDA sync on a
kernel that never ends) is not interrupted; inductor's compile workers are subprocesses, and
waiting on them is interruptible. Use an outer `timeout` as well.

--band-options / --packed-options / --pack-rows / --sel-rows override the library's tile tables
for this run only (nsa_flex.bench.kernel_overrides: restored when the sweep ends).

Writes bench.csv, errors.log (tracebacks) and bench.png (speedup against T, and the per-stage
breakdown at the largest T).
"""

import argparse
import csv
import json
import math
import os
import time
from dataclasses import replace

import torch
import torch.nn.functional as F

from masks import MaskContext, get_mask_builder
from nsa_flex import NSAAttention, NSAConfig
from nsa_flex.config import CMP_KERNEL_CHOICES
from nsa_flex.attention import attend_flex, mix_branches, plan_branch
from nsa_flex.bench import (Clock, Lazy, PhaseTimeout, Rot, TimingLock, error_line, figure,
                            first_call, kernel_ms, kernel_overrides, median_ms, phase, write_csv as _write)
from nsa_flex.kernel_options import packed_block_size
from nsa_flex.ops import DEFAULT_TUNING, SelectedTuning
from nsa_flex.selection import select_topn

CONFIGS = {
    "paper": dict(n_heads=64, n_kv_heads=4, d_qk=192, d_v=128, dim=2560),
    "d128": dict(n_heads=64, n_kv_heads=4, d_qk=128, d_v=128, dim=2560),
    # the attention of torchtitan's 125M flavor without importing torchtitan (the GPU machine has
    # none installed); tests/experiments/test_bench_attention.py checks it against the flavor
    "titan_125M": dict(n_heads=16, n_kv_heads=2, d_qk=64, d_v=64, dim=768),
    "tiny": dict(n_heads=4, n_kv_heads=2, d_qk=16, d_v=16, dim=64, l=8, d=4, l_sel=16, n_sel=4,
                 window=32),
}


def config_args(cname: str) -> dict:
    """NSAConfig fields of a bench config: a name above, or "titan_<flavor>" for the attention of a
    torchtitan flavor (nsa_flex.titan.args, e.g. titan_1B: 32 q / 2 KV heads, d 64, dim 2048)."""
    if cname.startswith("titan_") and cname not in CONFIGS:
        from dataclasses import asdict

        from nsa_flex.titan.args import nsa_flex_args

        c = asdict(nsa_flex_args[cname[len("titan_"):]].nsa_config())
        return {k: c[k] for k in ("n_heads", "n_kv_heads", "d_qk", "d_v", "dim", "l", "d",
                                  "l_sel", "n_sel", "window")}
    return CONFIGS[cname]


STAGES = ["projections", "compression", "score_topn", "mask_build", "attn_compressed",
          "attn_selected", "attn_selected_flex", "attn_window", "gate_out"]
BASELINES = ["sdpa_causal", "flex_causal", "fla_parallel_nsa_w0", "full_layer"]
ITEMS = STAGES + BASELINES + ["nsa_layer"]  # the order items run in
# layer.csv (issue 14): item names there for the bench's own
LAYER_ITEMS = {"nsa_layer": "nsa_layer", "full_layer": "full_layer", "sdpa_causal": "sdpa",
               "flex_causal": "flex_causal", "fla_parallel_nsa_w0": "fla_parallel_nsa"}
MODES = ("fwd", "fwd_bwd")
SEL_KERNEL = "auto"  # --sel-kernel: the layer's executor of the selection
CMP_KERNEL = "auto"  # --cmp-kernel: the layer's executor of the compressed branch
SEL_TUNING = DEFAULT_TUNING  # --sel-rows, --sel-dq-atomic: the selected op's tuning
TRACE_RAW = None  # --selection-trace: (int64 [1, Hkv, T', n] trained picks, label) as loaded
TRACE = None  # those picks fitted to the running (config, T), replacing the random ones
SHARED_MASKS = False  # --shared-masks: the layer items get a StepMasks built once, outside the timing

log = Clock()
CSV_PATH = None
ERR_LOG = None
PROFILE_PATH = ""  # --profile: OUT/kernels.txt
LOCK = TimingLock()  # --timing-lock: bench processes side by side never time at once
CSV_FIRST = ("config", "T", "stage", "fwd_ms", "fwd_bwd_ms", "peak_GiB", "fwd_first_s",
             "fwd_bwd_first_s", "setup_s", "item_s", "error")


def rnd(*shape, dev, dtype, grad=False):
    return torch.randn(*shape, device=dev, dtype=dtype).requires_grad_(grad)


def save(rows):
    if CSV_PATH:
        write_csv(rows, CSV_PATH)


def write_csv(rows, path):
    _write(rows, path, first=CSV_FIRST)


def profile_kernels(fn, title, calls=3, top=25):
    """Append the top GPU kernels of `calls` calls of fn (CUDA time per call) to PROFILE_PATH:
    where an item's time goes, kernel by kernel (e.g. a flex backward's share)."""
    rows = kernel_ms(fn, calls)
    with open(PROFILE_PATH, "a") as f:
        f.write(f"== {title}: {sum(ms for *_, ms in rows):.2f} ms of kernels per call\n")
        for name, n, ms in rows[:top]:
            f.write(f"  {ms:9.3f} ms  {n:4d}x  {name[:150]}\n")


def timed(name, make, with_bwd, dev, rows, meta, modes=MODES, limit=0):
    """One item: setup (make() -> fwd; fwd() returns an output), then for each mode its first
    call (compile included) and its timing, each phase under `limit` seconds. fwd: inference
    forward (no_grad); fwd_bwd: forward + backward of out.float().sum()."""
    where = f"{meta['config']} T={meta['T']} {name}"
    rec = dict(meta, stage=name)
    errs, timeouts = [], []
    rows.append(rec)
    t_item = time.perf_counter()
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()

    def attempt(label, fn):
        """fn() -> True; a failure -> False, its line in errs (a timeout: tagged with its phase)."""
        rec["error"] = " | ".join(errs + [f"unfinished: {label}"])  # what a killed run keeps
        save(rows)
        try:
            fn()
            return True
        except Exception as e:  # keep the sweep going; the CSV says what failed
            errs.append(error_line(label, e, limit, ERR_LOG or "",
                                   f"{meta['config']} T={meta['T']} {name}"))
            timeouts.append(isinstance(e, PhaseTimeout))
            return False

    def run_mode(key, label, fn, grad):
        with torch.enable_grad() if grad else torch.no_grad():
            for what, run in (("compile+first call", lambda: LOCK.shared(first_call, fn, dev)),
                              ("timing", lambda: median_ms(fn, dev, lock=LOCK))):
                try:
                    out, dt = phase(f"{where} {label} {what}", run, limit, log)
                except PhaseTimeout as e:
                    e.phase = what
                    raise
                if what == "compile+first call":
                    rec[f"{key}_first_s"] = out
                else:
                    rec[f"{key}_ms"] = out
            if PROFILE_PATH and dev == "cuda":
                with LOCK.hold(exclusive=True):  # kernel times, like timings, from a quiet GPU
                    profile_kernels(fn, f"{where} {label}")

    got = []
    if attempt("setup", lambda: got.append(phase(f"{where} setup", lambda: LOCK.shared(make),
                                                 limit, log))):
        fwd, rec["setup_s"] = got[0]

        def fb():
            fwd().float().sum().backward()

        if "fwd" in modes and not attempt("fwd(no_grad)",
                                          lambda: run_mode("fwd", "fwd(no_grad)", fwd, False)):
            if with_bwd and not timeouts[-1]:
                # the training forward (grad mode) is a separate graph: time it instead
                if attempt("fwd(grad)", lambda: run_mode("fwd", "fwd(grad)", fwd, True)):
                    rec["fwd_mode"] = "grad"
        if with_bwd and "fwd_bwd" in modes:
            attempt("fwd+bwd", lambda: run_mode("fwd_bwd", "fwd+bwd", fb, True))
        del fwd, fb
    got.clear()
    rec.pop("error")
    if errs:
        rec["error"] = " | ".join(errs)
    rec["item_s"] = time.perf_counter() - t_item
    if dev == "cuda":
        rec["peak_GiB"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.empty_cache()
    save(rows)  # after every row: a killed run keeps what it measured
    fmt = lambda k: f"{rec[k]:9.3f}" if k in rec else "        -"
    print(f"{meta['config']:6s} T={meta['T']:6d} {name:22s} fwd {fmt('fwd_ms')} ms  "
          f"fwd+bwd {fmt('fwd_bwd_ms')} ms  {rec.get('error', '')}", flush=True)
    return rec


# ---- the items

def layer_config(cname) -> NSAConfig:
    """The NSA layer's config for --configs entry `cname` with this run's executors."""
    return NSAConfig(**config_args(cname), backend="flex", sel_kernel=SEL_KERNEL,
                     cmp_kernel=CMP_KERNEL)


def build_items(cname, T, dev, dtype, compile_=True):
    """[(name, has_backward, make)] in ITEMS order; make() does the item's setup (shared parts
    through Lazy) and returns its fwd(). Nothing is allocated or compiled before make()."""
    cfg = layer_config(cname)
    train = dev == "cuda"  # CPU flex has no backward
    B, H, Hkv, dk, dv = 1, cfg.n_heads, cfg.n_kv_heads, cfg.d_qk, cfg.d_v
    comp = (lambda f: torch.compile(f, fullgraph=True, dynamic=False)) if compile_ else (lambda f: f)
    R = lambda *shape, grad=True: rnd(*shape, dev=dev, dtype=dtype, grad=grad and train)
    ddev = torch.device(dev)

    def make_layer():
        layer = NSAAttention(cfg, sel_tuning=SEL_TUNING).to(dev, dtype)
        layer.init_weights(0.02)
        return layer

    layer = Lazy(make_layer)
    xs = Lazy(lambda: Rot(lambda: R(B, T, cfg.dim)))
    x = Lazy(lambda: R(B, T, cfg.dim, grad=False))
    qs = Lazy(lambda: Rot(lambda: R(B, H, T, dk)))
    kvs = Lazy(lambda: Rot(lambda: (R(B, Hkv, T, dk), R(B, Hkv, T, dv))))
    kc = Lazy(lambda: torch.no_grad()(layer().phi_k)(R(B, Hkv, T, dk, grad=False)))  # [.., Nc, dk]
    ctx = Lazy(lambda: MaskContext(cfg, B, T, ddev))
    cspec = Lazy(lambda: get_mask_builder("compressed_causal")(ctx()))
    # the stages run each branch as the layer plans it with sel_kernel and cmp_kernel "auto"
    stage_cfg = replace(cfg, sel_kernel="auto", cmp_kernel="auto")

    def plan(builder, sel_kernel="auto"):
        return plan_branch(replace(stage_cfg, sel_kernel=sel_kernel), builder, SEL_TUNING)

    def make_score_inputs():
        q = R(B, H, T, dk, grad=False)
        vc = layer().phi_v(R(B, Hkv, T, dv, grad=False))
        with torch.no_grad():
            lse = plan("compressed_causal").attend(q, kc(), vc, cspec())[1] if dev == "cuda" \
                else None
        return q, kc(), lse

    score_in = Lazy(make_score_inputs)
    # the top-n indices the mask items use: eager (no compile), so they don't hang on score_topn
    sel_idx = Lazy(lambda: torch.no_grad()(select_topn)(*score_in(), cfg) if TRACE is None
                   else TRACE[0].to(ddev))
    sspec = Lazy(lambda: get_mask_builder("topn")(MaskContext(cfg, B, T, ddev, topn=sel_idx)))
    wspec = Lazy(lambda: get_mask_builder("sliding_window")(ctx()))

    def projections():
        lay, xr = layer(), xs()
        f = comp(lambda x_: lay.wq(x_) + 0)
        return lambda: f(xr())

    def compression():
        lay, kr = layer(), Rot(lambda: R(B, Hkv, T, dk))
        f = comp(lambda k_: lay.phi_k(k_))
        return lambda: f(kr())

    def score_topn():
        q, k, lse = score_in()
        f = comp(lambda q_, kc_, lse_: select_topn(q_, kc_, lse_, cfg))
        return lambda: f(q, k, lse)

    def mask_build():
        idx, cs, nc = sel_idx(), cspec(), kc().shape[2]

        def build(idx_):
            c = MaskContext(cfg, B, T, ddev, topn=lambda: idx_)
            ss = get_mask_builder("topn")(c)
            ws = get_mask_builder("sliding_window")(c)
            a = ss.block_mask(B, T, T, device=dev, block_size=packed_block_size(H // Hkv, ss),
                              q_pack=H // Hkv)
            b = ws.block_mask(B, T, T, device=dev, block_size=128)
            cc = cs.block_mask(B, T, nc, device=dev, block_size=128)
            return a.kv_indices.sum() + b.kv_indices.sum() + cc.kv_indices.sum()

        f = comp(build)
        return lambda: f(idx)

    def attention(spec, kv, builder, sel_kernel="auto"):
        def make():
            s, q, kvr, p = spec(), qs(), kv(), plan(builder, sel_kernel)
            f = comp(lambda q_, k_, v_: p.attend(q_, k_, v_, s)[0])
            return lambda: f(q(), *kvr())

        return make

    kvc = Lazy(lambda: Rot(lambda: (R(B, Hkv, kc().shape[2], dk), R(B, Hkv, kc().shape[2], dv))))

    def gate_out():
        lay, x_, outs = layer(), x(), Rot(lambda: [R(B, H, T, dv) for _ in range(3)])

        def f(o3):  # as the layer mixes them (Eq. 5)
            g = torch.sigmoid(lay.gate(x_)).view(B, T, H, 3)
            return lay.wo(mix_branches(g, o3, lay.cfg.backend))

        cf = comp(f)
        return lambda: cf(outs())

    qkv = Lazy(lambda: Rot(lambda: (R(B, H, T, dk), R(B, Hkv, T, dk), R(B, Hkv, T, dv))))

    def sdpa_causal():
        r = qkv()
        f = comp(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                enable_gqa=True))
        return lambda: f(*r())

    def flex_causal():
        # the causal builder's plan runs SDPA: this row keeps flex
        r, causal = qkv(), get_mask_builder("causal")(ctx())
        f = comp(lambda q, k, v: attend_flex(q, k, v, causal)[0])
        return lambda: f(*r())

    def fla_nsa():
        from fla.ops.nsa import parallel_nsa

        r = qkv()
        g = (torch.rand(B, T, H, device=dev, dtype=dtype),
             torch.rand(B, T, H, device=dev, dtype=dtype))

        def f():
            q, k, v = r()
            return parallel_nsa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                g_cmp=g[0], g_slc=g[1], block_counts=cfg.n_sel,
                                block_size=cfg.l_sel, window_size=0)

        return f

    def nsa_layer():
        lay, xr = layer(), xs()
        if TRACE is not None:  # the layer scores as usual (timed), then attends the trained picks
            trained = TRACE[0].to(ddev)
            lay.select_topn = lambda *a, **k: torch.where(select_topn(*a, **k) >= -1, trained, -1)
        return layer_call(comp(lay), lay, xr)

    def layer_call(f, lay, xr):
        """The timed call of a layer item: f(x), or with --shared-masks f(x, masks) on masks
        built once beforehand (what each layer of a model gets: the step's one build is spread
        over its layers and not timed here)."""
        if SHARED_MASKS:
            masks = lay.step_masks(B, T, ddev)
            return lambda: f(xr(), masks=masks)
        return lambda: f(xr())

    def full_layer():
        # the same layer class with the full_causal preset: q/k/v/o projections (+ the tiny gate)
        # around SDPA causal attention with GQA, what a user would otherwise run
        lay = NSAAttention(NSAConfig(**config_args(cname), backend="flex", masks="full_causal"),
                           sel_tuning=SEL_TUNING)
        lay = lay.to(dev, dtype)
        lay.init_weights(0.02)
        return layer_call(comp(lay), lay, xs())

    items = [("projections", train, projections), ("compression", train, compression),
             ("score_topn", False, score_topn), ("mask_build", False, mask_build),
             ("attn_compressed", train, attention(cspec, kvc, "compressed_causal")),
             ("attn_selected", train, attention(sspec, kvs, "topn")),
             # the selection on FlexAttention's template (forced bands + packed scored blocks)
             ("attn_selected_flex", train, attention(sspec, kvs, "topn", "flex")),
             ("attn_window", train, attention(wspec, kvs, "sliding_window")),
             ("gate_out", train, gate_out),
             ("sdpa_causal", train, sdpa_causal), ("flex_causal", train, flex_causal)]
    if _has_fla():
        items.append(("fla_parallel_nsa_w0", train, fla_nsa))
    items.append(("full_layer", train, full_layer))
    items.append(("nsa_layer", train, nsa_layer))
    assert [n for n, _, _ in items] == [n for n in ITEMS if n in {m for m, _, _ in items}]
    return items


def _has_fla():
    try:
        from fla.ops.nsa import parallel_nsa  # noqa: F401
    except ImportError:
        return False
    except Exception as e:  # installed but broken: say so, keep the sweep
        log(f"fla-core not usable ({type(e).__name__}: {e}): no fla_parallel_nsa_w0")
        return False
    return True


def run_config(cname, T, dev, dtype, rows, stages, baselines, compile_=True, only=None,
               modes=MODES, limit=0):
    """Stages (if `stages`), then baselines (if `baselines`), then the layer; `only`: a set of
    item names to keep."""
    global TRACE
    label = "random"
    if TRACE_RAW is not None:  # the trace's first T positions, its KV heads as the config's
        from nsa_flex.apps.eval.selection_stats import fit_trace

        c = NSAConfig(**config_args(cname))
        try:
            TRACE = fit_trace(*TRACE_RAW, c.n_kv_heads, T, c.n_sel)
        except ValueError as e:
            log(f"skip  {cname} T={T}: {e}")
            return
        label = TRACE[1]
    meta = dict(config=cname, T=T, device=torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                sel_kernel=SEL_KERNEL, cmp_kernel=CMP_KERNEL, selection=label)
    if SHARED_MASKS:
        meta["masks"] = "shared"
    log(f"config {cname} T={T} on {meta['device']}")
    for name, has_bwd, make in build_items(cname, T, dev, dtype, compile_):
        if (only is not None and name not in only) or (name in STAGES and not stages) or (
                name in BASELINES and not baselines):
            continue
        if not ("fwd" in modes or (has_bwd and "fwd_bwd" in modes)):
            log(f"skip  {cname} T={T} {name}: no requested mode applies")
            continue
        timed(name, make, has_bwd, dev, rows, meta, modes, limit)
    if dev == "cuda":
        torch.cuda.empty_cache()


def plot(rows, path):
    with figure(path, 2, size=(13, 4.8)) as fig:
        if fig is not None:
            _plot(rows, fig[1])


def _plot(rows, axes):
    ax = axes[0]
    for cname in sorted({r["config"] for r in rows}):
        for mode in ("fwd_ms", "fwd_bwd_ms"):
            for base, style in (("full_layer", "o-"), ("sdpa_causal", "o:")):
                pts = []
                for T in sorted({r["T"] for r in rows if r["config"] == cname}):
                    get = lambda s: next((r.get(mode) for r in rows if r["config"] == cname
                                          and r["T"] == T and r["stage"] == s), None)
                    n, b = get("nsa_layer"), get(base)
                    if n and b:
                        pts.append((T, b / n))
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style,
                            label=f"{cname} {mode.replace('_ms', '')} vs {base}")
    ax.axhline(1, color="gray", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("baseline time / NSA layer time")
    ax.set_title("NSA layer speed-up over the full-attention layer (SDPA) and SDPA alone",
                 fontsize=10)
    ax.legend(fontsize=7)
    ax = axes[1]
    stage_names = ["projections", "compression", "score_topn", "mask_build", "attn_compressed",
                   "attn_selected", "attn_window", "gate_out"]
    colors = {s: f"C{i}" for i, s in enumerate(stage_names)}  # one color per stage, both bars
    Tmax = max((r["T"] for r in rows if r["stage"] == "attn_selected"), default=None)
    if Tmax is not None:
        cname = next(r["config"] for r in rows if r["stage"] == "attn_selected" and r["T"] == Tmax)
        for j, mode in enumerate(("fwd_ms", "fwd_bwd_ms")):
            bottom = 0.0
            for s in stage_names:
                # no backward (score_topn, mask_build): its forward time in both bars
                v = next((r.get(mode) or (r.get("fwd_ms") if mode == "fwd_bwd_ms" else None)
                          for r in rows if r["config"] == cname and r["T"] == Tmax
                          and r["stage"] == s), None)
                if v:
                    ax.bar(j, v, bottom=bottom, color=colors[s], label=s if j == 0 else None)
                    bottom += v
        ax.set_xticks([0, 1], ["forward", "forward+backward"])
        ax.set_ylabel("ms")
        ax.set_title(f"per-stage time, {cname}, T={Tmax}")
        ax.legend(fontsize=8)


def merge(paths, out):
    """Merge result CSVs of several runs (each may hold a subset of items) into one, and plot."""
    rows = {}
    for p in paths:
        with open(p) as f:
            for r in csv.DictReader(f):
                r = {k: v for k, v in r.items() if v not in ("", None)}
                r["T"] = int(r["T"])
                for k in ("fwd_ms", "fwd_bwd_ms", "peak_GiB"):
                    if k in r:
                        r[k] = float(r[k])
                key = (r["config"], r["T"], r["stage"])
                old = rows.get(key, {})
                if "fwd_ms" in r or "fwd_bwd_ms" in r or not old:
                    if "error" not in r:
                        old = {k: v for k, v in old.items() if k != "error"}
                    rows[key] = {**old, **r}
    rows = sorted(rows.values(), key=lambda r: (r["config"], r["T"], r["stage"]))
    os.makedirs(out, exist_ok=True)
    write_csv(rows, os.path.join(out, "bench.csv"))
    write_layer_csv(rows, os.path.join(out, "layer.csv"))
    plot(rows, os.path.join(out, "bench.png"))
    return rows


def write_layer_csv(rows, path):
    """layer.csv (issue 14): T,item,fwd_ms,fwd_bwd_ms,peak_GiB,compile_s,device for the layer
    and baselines of the paper config; compile_s = first fwd+bwd call (else first fwd call)."""
    out = []
    for r in rows:
        if r["stage"] not in LAYER_ITEMS or r.get("config", "paper") != "paper":
            continue
        first = r.get("fwd_bwd_first_s") or r.get("fwd_first_s")
        out.append(dict(T=r["T"], item=LAYER_ITEMS[r["stage"]], fwd_ms=r.get("fwd_ms", ""),
                        fwd_bwd_ms=r.get("fwd_bwd_ms", ""), peak_GiB=r.get("peak_GiB", ""),
                        compile_s=first if first is not None else "",
                        device=r.get("device", "")))
    out.sort(key=lambda r: (int(r["T"]), list(LAYER_ITEMS.values()).index(r["item"])))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["T", "item", "fwd_ms", "fwd_bwd_ms", "peak_GiB",
                                          "compile_s", "device"])
        w.writeheader()
        w.writerows(out)
    return out


def _names(text, allowed, what, ap):
    names = [n for n in text.split(",") if n]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        ap.error(f"{what}: unknown {bad or 'empty list'}; choose from {','.join(allowed)}")
    return names


def inductor_config(items: list[str], ap) -> dict:
    """--inductor NAME=VALUE items -> {NAME: VALUE} for torch._inductor.config.patch (VALUE a Python
    literal); an unknown name or a value that is not a literal is an argument error."""
    import ast

    import torch._inductor.config as cfg

    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not hasattr(cfg, name):
            ap.error(f"--inductor {item!r}: expected NAME=VALUE with NAME a torch._inductor.config "
                     "option, e.g. epilogue_fusion=False")
        try:
            out[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            ap.error(f"--inductor {item!r}: VALUE must be a Python literal (True, 3, 'x')")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny CPU run (CI)")
    ap.add_argument("--configs", default="paper,d128")
    ap.add_argument("--T", default="4096,8192,16384,32768,65536,131072")
    ap.add_argument("--stages-at", default="65536", help="T values with the per-stage breakdown")
    ap.add_argument("--no-baselines", action="store_true")
    ap.add_argument("--only", default=",".join(ITEMS),
                    help="comma list of items to run (stages still only at --stages-at, baselines "
                         "not with --no-baselines); default all:\n" + ",".join(ITEMS))
    ap.add_argument("--modes", default=",".join(MODES), help="fwd,fwd_bwd (default both)")
    ap.add_argument("--item-limit", type=float, default=0,
                    help="seconds per phase of an item (setup, first call, timing); 0: none")
    ap.add_argument("--band-options", default="",
                    help="JSON kernel_options for the non-packed flex calls of the layer and the "
                         "stages (compressed, forced bands, window), e.g. "
                         "'{\"bwd_num_warps\": 8, \"bwd_BLOCK_M1\": 32}': overrides "
                         "nsa_flex.kernel_options.BAND_OPTIONS for the head dim of each --configs "
                         "entry during the run")
    ap.add_argument("--packed-options", default="",
                    help="JSON overrides of the packed selection call's kernel_options: overrides "
                         "nsa_flex.kernel_options.PACKED_OPTIONS for the head dim of each "
                         "--configs entry during the run")
    ap.add_argument("--sel-kernel", default="auto", choices=("auto", "flex", "triton"),
                    help="NSAConfig.sel_kernel of the layer items (attn_selected always runs auto, "
                         "attn_selected_flex flex)")
    ap.add_argument("--cmp-kernel", default="auto", choices=CMP_KERNEL_CHOICES,
                    help="NSAConfig.cmp_kernel of the layer items")
    ap.add_argument("--sel-rows", type=int, default=0,
                    help="rows of the selected-attention op's q block (positions x G): its "
                         "SelectedTuning.rows for the run")
    ap.add_argument("--sel-dq-atomic", default="", choices=("", "1", "0"),
                    help="the op's dq_atomic: 1 accumulates dQ in the dK/dV pass (fp32 atomics, no "
                         "dQ kernel), 0 runs the dQ kernel")
    ap.add_argument("--pack-rows", type=int, default=0,
                    help="rows of a packed selection q block at least (a multiple of 16): overrides "
                         "nsa_flex.kernel_options.PACK_ROWS during the run (positions per block = lcm(G, rows)/G)")
    ap.add_argument("--timing-lock", default="",
                    help="file locked while timing: bench processes run side by side (compiles "
                         "overlap, GPU timings never do)")
    ap.add_argument("--profile", action="store_true",
                    help="after each timing, profile 3 calls and append the top kernels (CUDA ms "
                         "per call) to OUT/kernels.txt")
    ap.add_argument("--selection-trace", default="", metavar="NPZ[:LAYER[+LAYER]]",
                    help="time on a trained selection: a selection_L<T>.npz of `python -m nsa_flex.eval "
                         "--task selection`, its first T positions; several layers stack their KV "
                         "heads (which must number the config's)")
    ap.add_argument("--inductor", action="append", default=[], metavar="NAME=VALUE",
                    help="set torch._inductor.config.NAME to the Python literal VALUE for the run "
                         "(repeatable), e.g. epilogue_fusion=False: what a fusion choice costs")
    ap.add_argument("--shared-masks", action="store_true",
                    help="the layer items (nsa_layer, full_layer) take the step's shared masks "
                         "(nsa_flex.layer.StepMasks) built once before timing, as each layer of a "
                         "model does; rows get masks=shared")
    ap.add_argument("--out", default="experiments/results/bench")
    ap.add_argument("--merge", default="",
                    help="comma list of bench.csv files from earlier runs: rows merged (a later "
                         "file's row for the same config/T/stage wins when it has a time), "
                         "written to OUT/bench.csv + bench.png; nothing is run")
    args = ap.parse_args(argv)
    if args.merge:
        return merge(args.merge.split(","), args.out)
    inductor = inductor_config(args.inductor, ap)
    only = set(_names(args.only, ITEMS, "--only", ap))
    modes = _names(args.modes, MODES, "--modes", ap)
    global CMP_KERNEL, LOCK, SEL_KERNEL, SEL_TUNING, TRACE_RAW, SHARED_MASKS
    SHARED_MASKS = args.shared_masks
    LOCK = TimingLock(args.timing_lock)
    SEL_KERNEL = args.sel_kernel
    CMP_KERNEL = args.cmp_kernel
    if args.selection_trace:
        from nsa_flex.apps.eval.selection_stats import load_trace_arg

        TRACE_RAW = load_trace_arg(args.selection_trace)
    # items compile flex calls on their own, before any layer exists (the layer installs it too)
    from nsa_flex.kernel_options import install_flex_patches

    install_flex_patches()
    if args.pack_rows and (args.pack_rows < 0 or args.pack_rows % 16):
        ap.error(f"--pack-rows must be a positive multiple of 16, got {args.pack_rows}")
    tables = {}
    for key, given in (("band", args.band_options), ("packed", args.packed_options)):
        if given:
            opts = json.loads(given)
            tables[key] = {config_args(c)["d_qk"]: opts for c in args.configs.split(",")}
    flag = {"": None, "1": True, "0": False}
    SEL_TUNING = SelectedTuning(rows=args.sel_rows or DEFAULT_TUNING.rows,
                                dq_atomic=flag[args.sel_dq_atomic])
    if SEL_TUNING != DEFAULT_TUNING:
        log(f"selected op: {SEL_TUNING}")
    with kernel_overrides(**tables, pack_rows=args.pack_rows, log=log), \
            torch._inductor.config.patch(inductor):
        return sweep(args, only, modes)


def sweep(args, only, modes):
    """The sweep main() parsed: every (config, T), then layer.csv, the plot and a summary."""
    os.makedirs(args.out, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    if args.quick:
        configs, Ts, stages_at = ["tiny"], [128, 256], {256}
    else:
        configs = args.configs.split(",")
        Ts = [int(t) for t in args.T.split(",")]
        stages_at = {int(t) for t in args.stages_at.split(",") if t}
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    torch._dynamo.config.cache_size_limit = 256
    global CSV_PATH, ERR_LOG, PROFILE_PATH
    rows = []
    PROFILE_PATH = os.path.join(args.out, "kernels.txt") if args.profile else ""
    path = CSV_PATH = os.path.join(args.out, "bench.csv")
    ERR_LOG = os.path.join(args.out, "errors.log")
    log(f"start: configs={configs} T={Ts} stages at {sorted(stages_at)} only={args.only} "
        f"modes={modes} item limit={args.item_limit:g}s")
    for cname in configs:
        for T in Ts:
            torch._dynamo.reset()
            # CPU: inductor's CPU flex template can't lower the packed selection inside a larger
            # graph, so --quick times eager code around the (separately compiled) flex calls
            run_config(cname, T, dev, dtype, rows, stages=T in stages_at,
                       baselines=not args.no_baselines, compile_=dev == "cuda", only=only,
                       modes=modes, limit=args.item_limit)
    log(f"wrote {path}")
    write_layer_csv(rows, os.path.join(args.out, "layer.csv"))
    plot(rows, os.path.join(args.out, "bench.png"))
    print("\nsummary (ms):")
    for r in rows:
        if r["stage"] in LAYER_ITEMS:
            print(f"  {r['config']:6s} T={r['T']:6d} {r['stage']:22s} fwd={r.get('fwd_ms', math.nan):8.2f}"
                  f" fwd+bwd={r.get('fwd_bwd_ms', math.nan):8.2f} peak={r.get('peak_GiB', math.nan):6.1f}GiB")
    return rows


if __name__ == "__main__":
    main()
