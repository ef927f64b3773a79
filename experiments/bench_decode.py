"""Per-token decode latency of ONE attention layer: NSA (per-branch caches; torch reference path and
Triton path) vs full attention with a KV cache (SDPA), same process, same data type, caches
pre-filled with random normal data (never zeros).

    # GPU (H100), the issue's grid: S in {4k, 16k, 64k, 128k}, batch 1 and 16, bf16,
    # eager launches and CUDA graphs for every implementation
    python experiments/bench_decode.py --out outputs/bench_decode
    # CI-size CPU check (small contexts, fp32, wall-clock timing, torch path + SDPA, eager)
    python experiments/bench_decode.py --quick --out /tmp/bench_decode

What is timed (one decode step of the attention core, after the q/k/v projections, which are the
same matmuls for both up to NSA's extra k/v pairs and are excluded; --with-proj adds them):
  nsa_torch   `decode_attention(backend="torch")`: write the new token into the selection cache,
              the window ring and the raw compression ring, emit a compressed block when one
              completes (branch-free), compressed attention, top-n scoring (Eq. 8-10, forced
              blocks, ties to the lower index), gather of the n selected blocks + attention,
              window attention, sigmoid-gated sum: ~50 small kernels (the reference the tests check)
  nsa_triton  `decode_attention(backend="triton")`: the same step in five Triton launches
              (`nsa_flex.ops.decode_triton`: write, compressed + window split-K, scorer + top-n,
              selected split-K, combine + gates); extra launch configs (--triton-configs) are
              timed in graph mode only, the row keeps the fastest
  full_gqa    write the new token into a [B, Hkv, S, D] KV cache, then SDPA of q [B, H, 1, Dk]
              over the S cached keys with enable_gqa=True
  full_fold   the same with q folded to [B, Hkv, G, Dk] (the G heads of a group as G query rows
              over the group's keys, no mask); the faster of the two is the baseline
Modes: "eager" (every launch from Python) and "graph" (the whole step captured in one
torch.cuda.CUDAGraph and replayed: launch overhead removed from both sides alike; CUDA only;
--no-cudagraph drops it). --compile adds nsa_torch_compiled (attend_cached under torch.compile).
Context S = keys the step attends to, the new token included (the caches hold S - 1 tokens).
Timing: CUDA: triton.testing.do_bench median (L2 flushed before every call, CUDA events), else
CUDA events; CPU: median wall clock. No host sync inside any step (all per-row state on device).
Checks per row: the read counters of the NSA paths equal the exact expected reads; the Triton
output against the torch path's (max abs error, share of (row, group) selections that agree:
bf16 scores may break near-ties differently). The device checks (prefill + decode == full
forward, Triton == torch at the paper's head dims, CUDA-graph replays) are GPU tests:
`python -m pytest -m gpu tests/inference/test_decode_gpu.py`.
Robust: an error in one measurement is recorded in the row's `errors` column and the run goes on.
--breakdown: per-kernel device time of one step of the Triton path and of the full-attention
baseline (torch.profiler, every kernel's launches summed per step, median over the profiled
steps; on the CPU the top-level torch ops instead), into <out>/decode_breakdown.csv (columns
S, batch, kernel, us, launches; kernel = "<implementation>/<kernel name>", plus the rows
"<implementation>/ALL_KERNELS" (their sum) and "<implementation>/GRAPH_STEP" (the timed step,
CUDA graphs when timed so: the difference to ALL_KERNELS is launch gaps and idle time)).
Output: <out>/bench_decode.csv (rewritten after every row), <out>/bench_decode.png, stdout table.
"""

import argparse
import math
import os
import statistics
import time
import traceback

import torch
import torch.nn.functional as F

from nsa_flex.bench import capture_graph, figure, median_ms, write_csv
from nsa_flex.config import NSAConfig
from nsa_flex.compression import PHI
from nsa_flex.inference.cache import NSACache
from nsa_flex.inference.decode import decode_attention, resolve_decode_backend
from nsa_flex.inference.decode_reference import _write, attend_cached

PAPER = dict(dim=2560, n_heads=64, n_kv_heads=4, d_qk=192, d_v=128, l=32, d=16, l_sel=64, n_sel=16,
             window=512)
MODES = {"cmp": "compressed_causal", "sel": "topn", "win": "sliding_window"}


def expected_reads(cfg: NSAConfig, S: int) -> dict[str, int]:
    """Distinct key tokens one decode step reads at context S (n_local >= 1, no documents)."""
    nb = -(-S // cfg.l_sel)
    sel = S if nb <= cfg.n_sel else (cfg.n_sel - 1) * cfg.l_sel + (S - (nb - 1) * cfg.l_sel)
    return {"cmp": cfg.num_cmp(S), "sel": sel, "win": min(cfg.window, S)}


def parse_triton_configs(text: str) -> list[dict]:
    """"32x4x2,32x8x2x8" -> [{block_n: 32, num_warps: 4, num_stages: 2}, {..., programs per SM:
    8}] (BLOCKNxWARPSxSTAGES[xPROGRAMS_PER_SM])."""
    out = []
    for item in text.split(","):
        parts = [int(x) for x in item.strip().split("x")]
        if len(parts) not in (3, 4):
            raise ValueError(f"--triton-configs item {item!r}: expected "
                             "BLOCKNxWARPSxSTAGES[xPROGRAMS_PER_SM]")
        o = dict(block_n=parts[0], num_warps=parts[1], num_stages=parts[2])
        if len(parts) == 4:
            o["programs_per_sm"] = parts[3]
        out.append(o)
    return out


def cfg_name(o: dict) -> str:
    return "x".join(str(o[k]) for k in ("block_n", "num_warps", "num_stages", "programs_per_sm")
                    if k in o)


def launch_opts(o: dict, device) -> dict:
    """decode_attention's triton_opts for a parsed config."""
    o = dict(o)
    per_sm = o.pop("programs_per_sm", None)
    if per_sm and device.type == "cuda":
        o["num_programs"] = per_sm * torch.cuda.get_device_properties(device).multi_processor_count
    return o


class Timer:
    def __init__(self, device, reps: int):
        self.cuda = device.type == "cuda"
        self.device = device
        self.reps = reps

    def __call__(self, fn, graph: bool) -> float:
        """Median seconds per call of fn (warmed up; on CUDA with graph=True captured in a CUDA
        graph and replayed)."""
        for _ in range(3):
            fn()
        if not self.cuda:
            return median_ms(fn, self.device, reps=self.reps) / 1e3
        torch.cuda.synchronize()
        call, g = fn, None
        if graph:
            g, _ = capture_graph(fn, warmup=2)
            call = g.replay
        ms = median_ms(call, self.device, reps=self.reps, warmup=25, rep_ms=max(50, self.reps))
        del g
        return ms / 1e3


def kernel_breakdown(fn, device, reps: int = 20) -> list[dict]:
    """[{kernel, us, launches}] of one call of fn: `reps` calls profiled (synchronised after
    each); per kernel name its launches' durations summed per call, median over the calls.
    CUDA: the CUDA kernels (device time); CPU: the top-level torch ops (self CPU time)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile as prof

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for _ in range(2):
        fn()
    if cuda:
        torch.cuda.synchronize()
    with torch.no_grad(), prof(activities=acts) as pr:
        for _ in range(reps):
            fn()
            if cuda:
                torch.cuda.synchronize()
    per = {}
    for e in pr.events():
        if cuda:
            if e.device_type != DeviceType.CUDA:
                continue
            us = e.time_range.elapsed_us()
        else:
            if e.device_type != DeviceType.CPU or e.cpu_parent is not None:
                continue
            us = e.self_cpu_time_total
        per.setdefault(e.name, []).append((e.time_range.start, us))
    out = []
    for name, ev in per.items():
        ev.sort()
        n = max(1, round(len(ev) / reps))
        sums = [sum(u for _, u in ev[i : i + n]) for i in range(0, len(ev), n)]
        out.append({"kernel": name, "us": statistics.median(sums), "launches": n})
    out.sort(key=lambda r: -r["us"])
    out.append({"kernel": "ALL_KERNELS", "us": sum(r["us"] for r in out),
                "launches": sum(r["launches"] for r in out)})
    return out


def triton_available(device) -> tuple[bool, str]:
    try:
        resolve_decode_backend("triton", device)
    except (RuntimeError, ValueError) as e:
        return False, str(e).split(";")[0]
    return True, ""


def bench_one(cfg: NSAConfig, S: int, B: int, device, dtype, timer: Timer, graph_modes,
              compile_: bool, with_proj: bool, seed: int, triton_cfgs: list[dict],
              profile: bool = False, log=print, breakdown: list | None = None) -> dict:
    """One (S, B) row; with `breakdown` (a list) its per-kernel rows are appended to it."""
    H, Hkv, dk, dv, G = cfg.n_heads, cfg.n_kv_heads, cfg.d_qk, cfg.d_v, cfg.group_size
    gen = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=gen, device=device, dtype=dtype)  # noqa: E731
    row = {"S": S, "batch": B, "dtype": str(dtype).replace("torch.", ""), "device": device.type}
    errors = []

    def fail(what, e):
        msg = f"{what}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        errors.append(msg)
        log(f"    ERROR {msg}", flush=True)
        if os.environ.get("BENCH_DEBUG"):
            traceback.print_exc()

    # ---------------------------------------------------------------- NSA
    cache = NSACache.empty(cfg, B, S, device, dtype)
    cache.random_fill_(S - 1, generator=gen)
    phi_k = PHI[cfg.phi](cfg.l, cfg.d, dk).to(device, dtype)
    phi_v = PHI[cfg.phi](cfg.l, cfg.d, dv).to(device, dtype)
    if cfg.phi == "mlp":
        for m in (phi_k, phi_v):
            m.init_weights(0.02)
    q = rnd(B, H, 1, dk)
    kv = {b: (rnd(B, Hkv, 1, dk), rnd(B, Hkv, 1, dv)) for b in ("cmp", "sel", "win")}
    g = torch.sigmoid(rnd(B, H, 1, 3))
    x = rnd(B, 1, cfg.dim)
    if with_proj:
        wq = rnd(H * dk, cfg.dim) * cfg.dim ** -0.5
        wkv = rnd(3 * Hkv * (dk + dv), cfg.dim) * cfg.dim ** -0.5
        wg = rnd(3 * H, cfg.dim) * cfg.dim ** -0.5
        wo = rnd(cfg.dim, H * dv) * (H * dv) ** -0.5
        wkv_full = rnd(Hkv * (dk + dv), cfg.dim) * cfg.dim ** -0.5

    def nsa_step(backend, attend_fn=None, opts=None):
        def step():
            if with_proj:
                q_ = F.linear(x, wq).view(B, 1, H, dk).transpose(1, 2)
                kvp = F.linear(x, wkv).view(B, 3, Hkv, dk + dv)
                kv_ = {b: (kvp[:, i, :, :dk].unsqueeze(2), kvp[:, i, :, dk:].unsqueeze(2))
                       for i, b in enumerate(("cmp", "sel", "win"))}
                g_ = torch.sigmoid(F.linear(x, wg)).view(B, 1, H, 3).permute(0, 2, 1, 3)
                o = decode_attention(cfg, MODES, q_, kv_, g_, cache, phi_k, phi_v, attend_fn,
                                     backend=backend, triton_opts=opts)
                return F.linear(o.transpose(1, 2).reshape(B, 1, H * dv), wo)
            return decode_attention(cfg, MODES, q, kv, g, cache, phi_k, phi_v, attend_fn,
                                    backend=backend, triton_opts=opts)

        return step

    # ---------------------------------------------------------------- full attention
    k_full, v_full = rnd(B, Hkv, S, dk), rnd(B, Hkv, S, dv)
    pos = torch.full((B,), S - 1, dtype=torch.long, device=device)
    k_new, v_new = kv["sel"]

    def full_step(layout):
        def step():
            if with_proj:
                q_ = F.linear(x, wq).view(B, 1, H, dk).transpose(1, 2)
                kvp = F.linear(x, wkv_full).view(B, 1, Hkv, dk + dv).transpose(1, 2)
                kn, vn = kvp[..., :dk], kvp[..., dk:]
            else:
                q_, kn, vn = q, k_new, v_new
            _write(k_full, pos, kn)
            _write(v_full, pos, vn)
            if layout == "fold":
                o = F.scaled_dot_product_attention(q_.reshape(B, Hkv, G, dk), k_full, v_full)
            else:
                o = F.scaled_dot_product_attention(q_, k_full, v_full, enable_gqa=True)
            o = o.reshape(B, 1, H * dv)
            return F.linear(o, wo) if with_proj else o

        return step

    fns = {"nsa_torch": nsa_step("torch")}
    ok_tr, why = triton_available(device)
    if ok_tr:
        fns["nsa_triton"] = nsa_step("triton", opts=launch_opts(triton_cfgs[0], device))
    else:
        row["skipped"] = f"nsa_triton: {why}"
    if compile_:
        fns["nsa_torch_compiled"] = nsa_step("torch", torch.compile(attend_cached, dynamic=False))
    fns["full_gqa"] = full_step("gqa")
    fns["full_fold"] = full_step("fold")

    # ---------------------------------------------------------------- checks
    exp = expected_reads(cfg, S)
    with torch.no_grad():
        try:
            o_t = fns["nsa_torch"]().float()
            sel_t = cache.last_selection.sort(-1).values
            reads = {k: v.float().mean().item() for k, v in cache.reads.items()}
            if reads != {k: float(v) for k, v in exp.items()}:
                raise AssertionError(f"torch read counters {reads} != expected {exp}")
            if not torch.isfinite(o_t).all():
                raise AssertionError("non-finite output")
        except Exception as e:  # noqa: BLE001
            fail("check nsa_torch", e)
            o_t = sel_t = None
        if "nsa_triton" in fns:
            try:
                o_r = fns["nsa_triton"]().float()
                reads = {k: v.float().mean().item() for k, v in cache.reads.items()}
                if reads != {k: float(v) for k, v in exp.items()}:
                    raise AssertionError(f"triton read counters {reads} != expected {exp}")
                if not torch.isfinite(o_r).all():
                    raise AssertionError("non-finite output")
                if o_t is not None:
                    row["triton_max_abs_err"] = (o_r - o_t).abs().max().item()
                    row["triton_ref_max_abs"] = o_t.abs().max().item()
                    same = cache.last_selection.sort(-1).values == sel_t
                    row["triton_sel_agree"] = same.all(-1).float().mean().item()
            except Exception as e:  # noqa: BLE001
                fail("check nsa_triton", e)
        try:
            o_a, o_b = fns["full_gqa"](), fns["full_fold"]()
            if not torch.allclose(o_a.float(), o_b.float(), atol=2e-2, rtol=2e-2):
                raise AssertionError("SDPA layouts disagree")
        except Exception as e:  # noqa: BLE001
            fail("check full", e)

    if profile and device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile as prof

        for name in [n for n in ("nsa_torch", "nsa_triton") if n in fns]:
            acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
            with torch.no_grad(), prof(activities=acts) as pr:
                for _ in range(10):
                    fns[name]()
                torch.cuda.synchronize()
            log(f"--- profile {name} S={S} B={B}")
            log(pr.key_averages().table(sort_by="self_cuda_time_total", row_limit=20))

    # ---------------------------------------------------------------- timings
    with torch.no_grad():
        for name, fn in fns.items():
            for mode in graph_modes:
                key = f"{name}_ms" if mode == "eager" else f"{name}_graph_ms"
                try:
                    row[key] = timer(fn, graph=mode == "graph") * 1e3
                    log(f"    {key:<28} {row[key]:9.4f} ms", flush=True)
                except Exception as e:  # noqa: BLE001
                    row[key] = float("nan")
                    fail(f"{name}/{mode}", e)
        if "nsa_triton" in fns and "graph" in graph_modes:
            row[f"nsa_triton_graph_ms[{cfg_name(triton_cfgs[0])}]"] = row.get("nsa_triton_graph_ms")
            for opts in triton_cfgs[1:]:
                key = f"nsa_triton_graph_ms[{cfg_name(opts)}]"
                try:
                    row[key] = timer(nsa_step("triton", opts=launch_opts(opts, device)),
                                     graph=True) * 1e3
                    log(f"    {key:<28} {row[key]:9.4f} ms", flush=True)
                except Exception as e:  # noqa: BLE001
                    row[key] = float("nan")
                    fail(f"nsa_triton[{cfg_name(opts)}]/graph", e)

    if breakdown is not None:
        sfx = "_graph_ms" if "graph" in graph_modes else "_ms"
        for name in [n for n in ("nsa_triton", "nsa_torch", "full_fold")
                     if n in fns and (device.type == "cuda" or n == "nsa_torch")]:
            try:
                with torch.no_grad():
                    rows_k = kernel_breakdown(fns[name], device)
                step = row.get(f"{name}{sfx}")
                if isinstance(step, float) and math.isfinite(step):
                    rows_k.append({"kernel": "GRAPH_STEP" if sfx == "_graph_ms" else "STEP",
                                   "us": step * 1e3, "launches": rows_k[-1]["launches"]})
                for r in rows_k:
                    breakdown.append({"S": S, "batch": B, "kernel": f"{name}/{r['kernel']}",
                                      "us": round(r["us"], 3), "launches": r["launches"]})
                log(f"    breakdown {name}: " + ", ".join(
                    f"{r['kernel']} {r['us']:.1f} us x{r['launches']}" for r in rows_k), flush=True)
            except Exception as e:  # noqa: BLE001
                fail(f"breakdown {name}", e)

    # ---------------------------------------------------------------- summary
    def best(keys):
        vals = [(row[k], k) for k in keys
                if isinstance(row.get(k), float) and math.isfinite(row[k])]
        return min(vals) if vals else (float("nan"), "")

    mode_sfx = "_graph_ms" if "graph" in graph_modes else "_ms"
    row["full_ms"], row["full_best"] = best([f"full_gqa{mode_sfx}", f"full_fold{mode_sfx}"])
    tr_keys = [k for k in row if k.startswith("nsa_triton_graph_ms[")] or [f"nsa_triton{mode_sfx}"]
    row["nsa_triton_best_ms"], row["nsa_triton_best"] = best(tr_keys)
    row["nsa_torch_best_ms"], _ = best([f"nsa_torch{mode_sfx}", f"nsa_torch_compiled{mode_sfx}"])
    row["nsa_ms"], which = best(["nsa_triton_best_ms", "nsa_torch_best_ms"])
    row["nsa_best"] = (f"triton {row['nsa_triton_best'].replace('nsa_triton', '')}"
                       if which == "nsa_triton_best_ms" else "torch" if which else "")
    row["speedup"] = row["full_ms"] / row["nsa_ms"]
    row["speedup_triton_vs_torch"] = row["nsa_torch_best_ms"] / row["nsa_triton_best_ms"]
    if "eager" in graph_modes:
        f_e, _ = best(["full_gqa_ms", "full_fold_ms"])
        n_e, _ = best(["nsa_triton_ms", "nsa_torch_ms"])
        row["speedup_eager"] = f_e / n_e
    nsa_tokens = sum(exp.values())
    row.update({"nsa_reads_cmp": exp["cmp"], "nsa_reads_sel": exp["sel"], "nsa_reads_win": exp["win"],
                "nsa_reads": nsa_tokens, "full_reads": S, "decode_reads_cfg": cfg.decode_reads(S),
                "read_ratio": S / nsa_tokens})
    esz = torch.finfo(dtype).bits // 8
    kv_bytes = B * Hkv * (dk + dv) * esz
    row["nsa_GBps"] = nsa_tokens * kv_bytes / (row["nsa_ms"] * 1e-3) / 1e9
    row["full_GBps"] = S * kv_bytes / (row["full_ms"] * 1e-3) / 1e9
    row["errors"] = " | ".join(errors)
    fns.clear()
    cache = k_full = v_full = None  # free the caches before the next row
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def plot(rows, path):
    with figure(path, 2) as fig:
        if fig is not None:
            _plot(rows, *fig)


def _plot(rows, fig, axes):
    ax, ax2 = axes
    sfx = "_graph_ms" if any("nsa_torch_graph_ms" in r for r in rows) else "_ms"
    for B in sorted({r["batch"] for r in rows}):
        rs = sorted((r for r in rows if r["batch"] == B), key=lambda r: r["S"])
        S = [r["S"] for r in rs]
        ax.plot(S, [r.get("nsa_triton_best_ms", float("nan")) for r in rs], "o-",
                label=f"NSA triton, B={B}")
        ax.plot(S, [r.get(f"nsa_torch{sfx}", float("nan")) for r in rs], "^:",
                label=f"NSA torch, B={B}")
        ax.plot(S, [r["full_ms"] for r in rs], "s--", label=f"full attn (SDPA), B={B}")
        ax2.plot(S, [r["speedup"] for r in rs], "o-", label=f"measured, B={B}")
    rs = sorted({r["S"]: r for r in rows}.values(), key=lambda r: r["S"])
    ax2.plot([r["S"] for r in rs], [r["read_ratio"] for r in rs], "k:", label="token-read ratio")
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.set_xlabel("context S (tokens)")
        a.grid(True, which="both", alpha=0.3)
        a.legend(fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("decode step latency, one layer (ms)")
    ax2.set_ylabel("full / NSA (best NSA path)")
    ax2.axhline(8, color="r", lw=0.8, alpha=0.5)
    r0 = rows[0]
    mode = "CUDA graphs" if sfx == "_graph_ms" else "eager"
    fig.suptitle(f"NSA vs full-attention decode, one layer ({r0['device']}, {r0['dtype']}, {mode})")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output folder (CSV + PNG)")
    p.add_argument("--contexts", default=None, help="default 4096,16384,65536,131072")
    p.add_argument("--batches", default=None, help="default 1,16")
    p.add_argument("--quick", action="store_true",
                   help="CI-size CPU run: contexts 512,2048, batches 1,2, fp32, few reps")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"))
    p.add_argument("--phi", default="avg", choices=("avg", "mlp"))
    p.add_argument("--compile", action="store_true",
                   help="also time torch.compile of the torch path's read part (attend_cached)")
    p.add_argument("--no-cudagraph", action="store_true", help="eager launches only")
    p.add_argument("--no-eager", action="store_true", help="CUDA graphs only (CUDA)")
    p.add_argument("--triton-configs", default="32x4x2,32x8x2,16x4x2,64x8x2,32x4x2x2,32x4x2x8",
                   help="launch configs BLOCKNxWARPSxSTAGES[xPROGRAMS_PER_SM] of the Triton "
                        "attention kernels; the first is the default path (eager + graph), the "
                        "others graph only (default programs per SM: "
                        "nsa_flex.ops.decode_triton.PROGRAMS_PER_SM)")
    p.add_argument("--with-proj", action="store_true",
                   help="include the q/k/v/gate/output projections of the layer in both steps")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--profile", action="store_true", help="print CUDA kernel profiles of NSA steps")
    p.add_argument("--breakdown", action="store_true",
                   help="per-kernel device times of one step (torch.profiler, median over steps) "
                        "of the Triton path and the baseline -> <out>/decode_breakdown.csv")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    if a.quick:
        a.contexts, a.batches = a.contexts or "512,2048", a.batches or "1,2"
        a.device = a.device or "cpu"
    a.contexts, a.batches = a.contexts or "4096,16384,65536,131072", a.batches or "1,16"
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, a.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    reps = a.reps or (5 if a.quick else (100 if device.type == "cuda" else 10))
    cfg = NSAConfig(**PAPER, phi=a.phi, backend="reference")
    triton_cfgs = parse_triton_configs(a.triton_configs)
    modes = []
    if not (a.no_eager and device.type == "cuda"):
        modes.append("eager")
    if device.type == "cuda" and not a.no_cudagraph:
        modes.append("graph")
    timer = Timer(device, reps)
    ok_tr, why = triton_available(device)
    print(f"device {device} dtype {dtype} modes {modes} triton path: "
          f"{'yes ' + str([cfg_name(c) for c in triton_cfgs]) if ok_tr else 'no (' + why + ')'}",
          flush=True)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "bench_decode.csv")
    rows, kernels = [], ([] if a.breakdown else None)
    t_start = time.time()
    grid = [(B, S) for B in (int(b) for b in a.batches.split(",")) for S in
            (int(s) for s in a.contexts.split(","))]
    for i, (B, S) in enumerate(grid):
        print(f"[{i + 1}/{len(grid)}] S={S} B={B} ({time.time() - t_start:.0f} s)", flush=True)
        try:
            r = bench_one(cfg, S, B, device, dtype, timer, modes, a.compile, a.with_proj,
                          a.seed + 1000 * B + S, triton_cfgs, a.profile, breakdown=kernels)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory building the caches
            traceback.print_exc()
            r = {"S": S, "batch": B, "dtype": str(dtype).replace("torch.", ""),
                 "device": device.type, "errors": f"row: {type(e).__name__}: {e}"[:300],
                 "nsa_ms": float("nan"), "full_ms": float("nan"), "speedup": float("nan"),
                 "read_ratio": float("nan"), "nsa_reads": float("nan")}
            if device.type == "cuda":
                torch.cuda.empty_cache()
        r.update(compile=a.compile, with_proj=a.with_proj, modes="+".join(modes))
        rows.append(r)
        tt = r.get("speedup_triton_vs_torch", float("nan"))
        print(f"  S={S:>7} B={B:>3}  nsa {r['nsa_ms']:8.4f} ms ({r.get('nsa_best', '')})  "
              f"full {r['full_ms']:8.4f} ms ({r.get('full_best', '')})  speedup "
              f"{r['speedup']:6.2f}x  triton/torch {tt:.2f}x  "
              f"  reads {r['nsa_reads']}/{S} ({r['read_ratio']:.2f}x fewer)"
              + (f"  ERRORS: {r['errors']}" if r.get("errors") else ""), flush=True)
        write_csv(rows, path)
        if kernels:
            write_csv(kernels, os.path.join(a.out, "decode_breakdown.csv"))
    print(f"wrote {path}")
    plot(rows, os.path.join(a.out, "bench_decode.png"))
    return rows


if __name__ == "__main__":
    main()
