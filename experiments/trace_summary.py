"""Where a profiled training step's GPU time goes, from a chrome trace (torch.profiler / torchtitan's
[profiling], e.g. OUT/profile_traces/iteration_20/rank0_trace.json).

Prints: the span from the first to the last GPU kernel, the summed kernel time, how much of the
span the GPU was busy (kernels merged over overlaps) and the longest idle gaps (host-bound stretches
show up here), then the top kernels by total time with their counts and a coarse grouping (flex
forward / backward templates, Triton kernels of ours, cuBLAS GEMMs, NCCL, other).

    python experiments/trace_summary.py TRACE.json[.gz] [--top 30] [--out summary.txt]
"""

import argparse
import gzip
import json
import re
import sys
from collections import defaultdict


def load_events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    evs = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in evs if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy",
                                                                       "gpu_memset")]


GROUPS = [("flex backward", re.compile(r"flex_attention_backward")),
          ("flex forward", re.compile(r"flex_attention")),
          ("nsa triton", re.compile(r"^_(group_slc_scores|topn|score|slc|attn|sel)")),
          ("gemm", re.compile(r"nvjet|gemm|cutlass|sm90_xmma|ampere_", re.I)),
          ("nccl", re.compile(r"nccl", re.I)),
          ("sdpa / flash", re.compile(r"flash|fmha|attention", re.I)),
          ("inductor fused", re.compile(r"^triton_")),
          ]


def group_of(name: str) -> str:
    return next((g for g, rx in GROUPS if rx.search(name)), "other")


def summarize(evs: list[dict], top: int = 30) -> str:
    if not evs:
        return "no GPU kernels in the trace\n"
    evs = sorted(evs, key=lambda e: e["ts"])
    t0, t1 = evs[0]["ts"], max(e["ts"] + e["dur"] for e in evs)
    busy, gaps, cur_s, cur_e = 0.0, [], evs[0]["ts"], evs[0]["ts"] + evs[0]["dur"]
    for e in evs[1:]:
        s, d = e["ts"], e["ts"] + e["dur"]
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append((s - cur_e, cur_e))
            cur_s, cur_e = s, d
        else:
            cur_e = max(cur_e, d)
    busy += cur_e - cur_s
    tot = defaultdict(lambda: [0, 0.0])
    groups = defaultdict(float)
    for e in evs:
        tot[e["name"]][0] += 1
        tot[e["name"]][1] += e["dur"]
        groups[group_of(e["name"])] += e["dur"]
    ksum = sum(v[1] for v in tot.values())
    lines = [f"span {(t1 - t0) / 1e3:.1f} ms, kernels {ksum / 1e3:.1f} ms, GPU busy "
             f"{busy / 1e3:.1f} ms ({100 * busy / (t1 - t0):.0f}% of the span), "
             f"{len(evs)} kernels",
             "longest idle gaps (ms at ms from the start): " + ", ".join(
                 f"{g / 1e3:.2f}@{(at - t0) / 1e3:.0f}" for g, at in sorted(gaps, reverse=True)[:8]),
             "by group (ms): " + ", ".join(f"{g} {v / 1e3:.1f}" for g, v in
                                           sorted(groups.items(), key=lambda kv: -kv[1])),
             f"top {top} kernels (total ms, count, name):"]
    for name, (n, d) in sorted(tot.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"  {d / 1e3:9.2f}  {n:5d}  {name[:140]}")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    text = f"== {args.trace}\n" + summarize(load_events(args.trace), args.top)
    sys.stdout.write(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
