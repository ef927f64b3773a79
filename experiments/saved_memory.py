"""What one attention layer keeps for its backward: NSA against the same layer with full causal
attention (SDPA), compiled as in training (issue 24 item 3: where NSA's extra training memory goes).

    python experiments/saved_memory.py --out OUT                      # 125M shape at 32k, CUDA
    python experiments/saved_memory.py --out OUT --configs titan_125M,paper --T 32768,16384
    python experiments/saved_memory.py --out OUT --recompute none,win,cmp_win   # NSAConfig.recompute
    python experiments/saved_memory.py --out OUT --recompute cmp_win --at-peak  # what is live at the peak

For each layer: every tensor the autograd graph saves (a saved-tensors hook; one row per storage,
its shape, dtype and MiB), the memory the forward leaves allocated (activations held for the
backward, the output included) and the peak of forward + backward above the inputs and weights.
Writes OUT/saved_tensors.csv (config, T, layer, shape, dtype, MiB) and OUT/saved_memory.csv (one
row per layer: saved MiB, held MiB, peak MiB) and prints both. --at-peak (CUDA) also records the
allocator's history over the measured forward + backward and writes OUT/at_peak.csv: the blocks
allocated in that step and still live at its peak, by where they were allocated (the innermost
frames outside torch's own modules: for a compiled layer, the line of inductor's generated code,
its source text beside). On a machine without CUDA it runs the reference backend eagerly at --T
(tiny shapes only: a smoke test of the script).
"""

import linecache

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_attention
from bench_attention import config_args  # noqa: E402

from nsa_flex.bench import write_csv  # noqa: E402
from nsa_flex.config import NSAConfig  # noqa: E402
from nsa_flex.layer import NSAAttention  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
MiB = 2 ** 20


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def _origin(frames: list) -> str:
    """Where a block was allocated: the innermost two frames outside torch's modules (inductor's
    generated code counts as ours), with the first one's source line."""
    mine = [f for f in frames if "/torch/" not in f["filename"] or "torchinductor" in f["filename"]]
    mine = [f for f in mine if not f["filename"].startswith("<") and "saved_memory" not in f["filename"]]
    if not mine:
        return "?"
    where = "; ".join(f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in mine[:2])
    src = linecache.getline(mine[0]["filename"], mine[0]["line"]).strip()
    return f"{where} | {src[:160]}"


def live_at_peak(snapshot: dict) -> tuple[float, list[tuple[float, str]]]:
    """Replays the allocator's trace: (peak MiB above the start, [(MiB, origin)] of the blocks live
    at that moment, largest first, summed by origin)."""
    events = [e for trace in snapshot["device_traces"] for e in trace]
    live, total, best, at = {}, 0, 0, {}
    for e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], e.get("frames", []))
            total += e["size"]
            if total > best:
                best, at = total, dict(live)
        elif e["action"] in ("free_requested", "free_completed") and e["addr"] in live:
            total -= live.pop(e["addr"])[0]
    by = {}
    for size, frames in at.values():
        o = _origin(frames)
        by[o] = by.get(o, 0) + size
    return best / MiB, sorted(((b / MiB, o) for o, b in by.items()), reverse=True)


def measure(cname: str, T: int, masks: str | None, recompute: str = "none", at_peak=None):
    """(saved-tensor rows, summary row) of one layer (masks None: NSA with NSAConfig.recompute
    `recompute`, else that preset); at_peak: a list that gets live_at_peak's rows (CUDA)."""
    extra = {"recompute": recompute} if masks is None else {"masks": masks}
    cfg = NSAConfig(**config_args(cname), backend="flex" if DEV == "cuda" else "reference",
                    **extra)
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    layer = NSAAttention(cfg).to(DEV, dtype)
    layer.init_weights(0.02)
    f = torch.compile(layer, fullgraph=True, dynamic=False) if DEV == "cuda" else layer
    x = torch.randn(1, T, cfg.dim, device=DEV, dtype=dtype, requires_grad=True)
    g = torch.randn(1, T, cfg.dim, device=DEV, dtype=dtype)
    f(x).backward(g)  # compile, warm up
    x.grad = None
    layer.zero_grad(set_to_none=False)  # weight grads stay allocated: not counted as activations
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        seen.setdefault(st.data_ptr(), (tuple(t.shape), str(t.dtype).replace("torch.", ""),
                                        st.nbytes() / MiB))
        return t

    sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
    sync()
    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()
    m0 = torch.cuda.memory_allocated() if DEV == "cuda" else 0
    record = at_peak is not None and DEV == "cuda"
    if record:
        torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = f(x)
    sync()
    held = (torch.cuda.memory_allocated() - m0) / MiB if DEV == "cuda" else float("nan")
    out.backward(g)
    sync()
    peak = (torch.cuda.max_memory_allocated() - m0) / MiB if DEV == "cuda" else float("nan")
    name = masks if masks is not None else "nsa" if recompute == "none" else f"nsa_recompute_{recompute}"
    if record:
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        top, blocks = live_at_peak(snap)
        at_peak += [dict(config=cname, T=T, layer=name, MiB=round(mb, 2), origin=o)
                    for mb, o in blocks if mb >= 0.5]
        at_peak.append(dict(config=cname, T=T, layer=name, MiB=round(top, 1),
                            origin="(peak of the step, replayed)"))
    rows = [dict(config=cname, T=T, layer=name, shape="x".join(map(str, s)), dtype=dt,
                 MiB=round(mb, 2)) for s, dt, mb in sorted(seen.values(), key=lambda r: -r[2])]
    summary = dict(config=cname, T=T, layer=name, saved_tensors=len(rows),
                   saved_MiB=round(sum(r["MiB"] for r in rows), 1), held_MiB=round(held, 1),
                   peak_MiB=round(peak, 1))
    return rows, summary


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", default="titan_125M", help="comma list (bench_attention.py's)")
    ap.add_argument("--T", default="32768", help="comma list of sequence lengths")
    ap.add_argument("--recompute", default="none",
                    help="comma list of NSAConfig.recompute values: one NSA row each")
    ap.add_argument("--at-peak", action="store_true",
                    help="also write what is live at each layer's peak (CUDA): OUT/at_peak.csv")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.at_peak and DEV != "cuda":
        log("--at-peak needs CUDA (the allocator's history): not recorded here")
    tensors, summary, at_peak = [], [], ([] if a.at_peak else None)
    for cname in a.configs.split(","):
        for T in (int(t) for t in a.T.split(",")):
            runs = [(None, rc) for rc in a.recompute.split(",")] + [("full_causal", "none")]
            for masks, rc in runs:
                rows, s = measure(cname, T, masks, rc, at_peak)
                tensors += rows
                summary.append(s)
                log(s)
                for r in rows:
                    print(f"    {r['MiB']:9.2f} MiB  {r['dtype']:9s} {r['shape']}")
                write_csv(tensors, os.path.join(a.out, "saved_tensors.csv"))
                write_csv(summary, os.path.join(a.out, "saved_memory.csv"))
                if at_peak:
                    write_csv(at_peak, os.path.join(a.out, "at_peak.csv"))
                    for r in at_peak[-12:]:
                        print(f"    at peak {r['MiB']:9.2f} MiB  {r['origin']}")
                torch._dynamo.reset()


if __name__ == "__main__":
    main()
