"""Host (CPU) cost of a compiled layer's fwd+bwd on the GPU: wall time per call against its kernel
time, the host's time to issue the forward and the backward, and the CPU-side ops that take it
(torch.profiler, CPU and CUDA activity).

    python experiments/host_overhead.py --out OUT [--configs titan_125M] [--T 8192] \
        [--items full_layer,nsa_layer] [--selection-trace NPZ:LAYER] [--inductor NAME=VALUE]

A layer whose wall time per call is well above its kernel time is bound by the host (Python,
launches, allocator); the CSVs say by what. Writes OUT/host_overhead.csv (per item: wall_ms,
kernel_ms, kernels per call, host_fwd_ms / host_bwd_ms: the time to return from the forward call
and from backward() while the GPU is still busy) and OUT/host_ops.csv (per item: the TOP ops by
self CPU time per call), and OUT/trace_ITEM.json.gz (one profiled call, chrome://tracing or
Perfetto). Same layers, inputs and compile as bench_attention.py's items.
"""

import argparse
import gzip
import os
import shutil
import statistics
import time

import torch

import bench_attention as ba
from nsa_flex.bench import write_csv

TOP = 40


def profile_item(make, trace_path: str, reps: int = 30):
    """dict(wall_ms, kernel_ms, kernels, host_fwd_ms, host_bwd_ms), [(op, calls per call, self
    CPU ms per call)]."""
    fwd = make()
    g = None

    def step(times=None):
        nonlocal g
        t0 = time.perf_counter()
        y = fwd()
        y = y[0] if isinstance(y, tuple) else y
        if g is None:
            g = torch.randn_like(y)
        t1 = time.perf_counter()
        y.backward(g)
        t2 = time.perf_counter()
        if times is not None:
            times.append((t1 - t0, t2 - t1))

    for _ in range(5):  # compile and warm up
        step()
    torch.cuda.synchronize()
    host = []
    t0 = time.perf_counter()
    for _ in range(reps):
        step(host)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3 / reps
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    n = 5
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    kernel = sum(e.self_device_time_total for e in gpu) / 1e3 / n
    ops = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CPU),
                 key=lambda e: -e.self_cpu_time_total)[:TOP]
    with torch.profiler.profile(activities=acts) as one:
        step()
        torch.cuda.synchronize()
    raw = trace_path[:-3]
    one.export_chrome_trace(raw)
    with open(raw, "rb") as f, gzip.open(trace_path, "wb") as z:
        shutil.copyfileobj(f, z)
    os.remove(raw)
    row = dict(wall_ms=wall, kernel_ms=kernel, kernels=sum(e.count for e in gpu) / n,
               host_fwd_ms=statistics.median(h[0] for h in host) * 1e3,
               host_bwd_ms=statistics.median(h[1] for h in host) * 1e3)
    return row, [(e.key, e.count / n, e.self_cpu_time_total / 1e3 / n) for e in ops]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", default="titan_125M")
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--items", default="full_layer,nsa_layer")
    ap.add_argument("--selection-trace", default="", metavar="NPZ:LAYER",
                    help="the NSA layer attends these trained picks (as bench_attention.py)")
    ap.add_argument("--inductor", action="append", default=[], metavar="NAME=VALUE",
                    help="set torch._inductor.config.NAME to the Python literal VALUE (e.g. "
                         "cpp_wrapper=True: inductor's wrapper in C++ instead of Python)")
    a = ap.parse_args(argv)
    inductor = ba.inductor_config(a.inductor, ap)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the host cost of launching the GPU kernels)")
    if a.selection_trace:  # as bench_attention.py: the trace's first T positions
        from nsa_flex.apps.eval.selection_stats import fit_trace, load_trace_arg

        c = ba.NSAConfig(**ba.config_args(a.configs))
        ba.TRACE = fit_trace(*load_trace_arg(a.selection_trace), c.n_kv_heads, a.T, c.n_sel)
    from nsa_flex.kernel_options import install_flex_patches

    install_flex_patches()
    os.makedirs(a.out, exist_ok=True)
    items = {n: mk for n, _, mk in ba.build_items(a.configs, a.T, "cuda", torch.bfloat16)}
    rows, op_rows = [], []
    for name in [x for x in a.items.split(",") if x]:
        if name not in items:
            ap.error(f"--items: {name!r} is not one of {sorted(items)}")
        print(f"[{time.strftime('%H:%M:%S')}] {name}: compile, warm-up, timing", flush=True)
        with torch._inductor.config.patch(inductor):
            row, ops = profile_item(items[name], os.path.join(a.out, f"trace_{name}.json.gz"))
        rows.append(dict(config=a.configs, T=a.T, item=name, inductor=" ".join(a.inductor),
                         **{k: round(v, 3) for k, v in row.items()},
                         device=torch.cuda.get_device_name()))
        print(rows[-1], flush=True)
        op_rows += [dict(config=a.configs, T=a.T, item=name, op=op, calls=c, self_cpu_ms=round(ms, 4))
                    for op, c, ms in ops]
        write_csv(rows, os.path.join(a.out, "host_overhead.csv"))
        write_csv(op_rows, os.path.join(a.out, "host_ops.csv"))
        for r in op_rows[-TOP:]:
            print(r["op"][:90], r["calls"], r["self_cpu_ms"], flush=True)


if __name__ == "__main__":
    main()
