"""Graph breaks, host syncs and CUDA graphs of the NSA layer as torchtitan runs it.

    python experiments/host_syncs.py --out OUT                 # CPU: graph breaks (dynamo explain)
    python experiments/host_syncs.py --out OUT --T 8192        # CUDA: + syncs, + CUDA graphs timing

CPU (any machine): `torch._dynamo.explain` of the layer at the 125M shape, given the step's
shared masks (`nsa_flex.layer.StepMasks`, as the model's blocks get them) and building its own,
on the flex backend (forward: the CPU has no flex backward) and on the reference backend
(forward + backward); graphs, breaks and their reasons. CUDA: the layer compiled as torchtitan
compiles a block (inductor, fullgraph, combo kernels), warmed up, then one step (the shared
masks' eager build, forward, backward) under `torch.cuda.set_sync_debug_mode("warn")`: every
synchronizing call with where it came from; then the same layer compiled with inductor's CUDA
graphs (`[compile] cudagraphs`): inductor's reasons for skipping them, if any, and fwd+bwd ms of
both (medians of CUDA-event timings). Writes OUT/host_syncs.csv (check, setting, value, detail)
and prints it.
"""

import argparse
import os
import sys
import time
import traceback
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_attention
from bench_attention import config_args  # noqa: E402

from nsa_flex.bench import write_csv  # noqa: E402
from nsa_flex.config import NSAConfig  # noqa: E402
from nsa_flex.layer import NSAAttention  # noqa: E402

ROWS: list[dict] = []


def row(check, setting, value, detail=""):
    ROWS.append(dict(check=check, setting=setting, value=value, detail=detail))
    print(f"[{time.strftime('%H:%M:%S')}] {check:22s} {setting:28s} {value}  {detail}", flush=True)


def make(backend: str, dev: str, dtype) -> NSAAttention:
    torch.manual_seed(0)
    layer = NSAAttention(NSAConfig(**config_args("titan_125M"), backend=backend, rope_theta=5e5))
    layer.init_weights(0.02)
    return layer.to(dev, dtype)


def explain(T: int) -> None:
    """Graphs and breaks of the layer's forward, on flex and on reference with grad enabled (the
    backward is one graph AOT autograd derives from the forward's)."""
    for backend, grad in (("flex", False), ("reference", True)):
        layer = make(backend, "cpu", torch.float32)
        x = torch.randn(1, T, layer.cfg.dim, requires_grad=grad)
        for masks in ("shared", "own"):
            kw = {"masks": layer.step_masks(1, T, x.device)} if masks == "shared" else {}

            with torch.set_grad_enabled(grad):
                torch._dynamo.reset()
                ex = torch._dynamo.explain(layer)(x, **kw)
            reasons = "; ".join(str(b.reason)[:200] for b in ex.break_reasons)
            row("graph_breaks", f"{backend} T={T} masks={masks}", ex.graph_break_count,
                f"graphs={ex.graph_count} ops={ex.op_count} {reasons}")


def cuda_checks(T: int, calls: int) -> None:
    dev, dtype = "cuda", torch.bfloat16
    layer = make("flex", dev, dtype)
    x = torch.randn(1, T, layer.cfg.dim, device=dev, dtype=dtype, requires_grad=True)
    g = torch.randn_like(x)

    def fwd_bwd(f):
        masks = layer.step_masks(1, T, x.device)
        f(x, masks=masks).backward(g)

    f = torch.compile(layer, fullgraph=True, options={"combo_kernels": True})
    for _ in range(3):
        fwd_bwd(f)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fwd_bwd(f)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    row("host_syncs", f"compiled layer T={T}", len(syncs))
    for w in syncs:
        row("host_sync", f"T={T}", 1, f"{w.filename}:{w.lineno} {str(w.message)[:160]}")

    times = {}
    for name, options in (("inductor", {"combo_kernels": True}),
                          ("inductor+cudagraphs", {"combo_kernels": True, "triton.cudagraphs": True})):
        from torch._dynamo.utils import counters

        counters.clear()
        torch._dynamo.reset()
        f = torch.compile(layer, fullgraph=True, options=options)
        try:
            ms = []
            for i in range(calls + 3):
                torch.compiler.cudagraph_mark_step_begin()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fwd_bwd(f)
                b.record()
                torch.cuda.synchronize()
                if i >= 3:
                    ms.append(a.elapsed_time(b))
            times[name] = sorted(ms)[len(ms) // 2]
            row("fwd_bwd_ms", f"{name} T={T}", f"{times[name]:.3f}")
        except Exception as e:  # keep going: the other setting's row still tells
            row("fwd_bwd_ms", f"{name} T={T}", "error", f"{type(e).__name__}: {str(e)[:300]}")
            traceback.print_exc()
        skips = dict(counters["inductor"]).get("cudagraph_skips", 0)
        row("cudagraph_skips", f"{name} T={T}", skips,
            "; ".join(f"{k}={v}" for k, v in counters["inductor"].items() if "cudagraph" in k))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--T", type=int, default=2048, help="sequence length")
    ap.add_argument("--calls", type=int, default=20, help="timed calls per CUDA setting")
    ap.add_argument("--no-explain", action="store_true", help="skip the CPU explain (CUDA checks only)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    try:
        if not args.no_explain:
            explain(min(args.T, 2048))
        if torch.cuda.is_available():
            cuda_checks(args.T, args.calls)
    finally:
        write_csv(ROWS, os.path.join(args.out, "host_syncs.csv"))


if __name__ == "__main__":
    main()
