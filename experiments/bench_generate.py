"""Whole-model generation speed (issue 16, item 3): prefill seconds and decode tokens/s of the
nsa_flex model, NSA against the same model with full attention (`masks = "full_causal"`: SDPA
prefill on GPU, KV-cache decode), random weights, random prompt tokens (never zeros).

    python experiments/bench_generate.py --flavor 125M --context 32768 --batches 1,8 --out OUT
    python experiments/bench_generate.py --flavor 125M --context 32768 --batches 1,8 \
        --decode-modes eager,graph --out OUT                          # eager and CUDA-graph decode
    python experiments/bench_generate.py --quick --out /tmp/gen        # CPU smoke (tests)

Per (attention, batch): a fresh cache, prefill of `batch` prompts of `context` tokens (the first
call compiles the flex calls and is not timed; the second is), then per decode mode `--warmup`
decode steps and `--steps` timed decode steps (greedy), each step one token per row, each mode
going on from the cache the one before left. Decode modes (--decode-modes; --graphs is
--decode-modes graph): eager (`model_decode_step`, Python per step) and graph (one CUDA graph
replay per step, `GraphedDecodeStep`: its capture is not timed; GPU only, skipped on the CPU with
a note; before timing, the max |graph - eager| logits of one step from the same cache state is
printed). Times are wall clock around synchronized device work (CUDA events would not cover the
host side of a step, which is part of what a user waits for). Writes generate.csv (context,batch,
attention,prefill_s,decode_tokens_per_s,device,decode_mode) and prints a table.
"""

import argparse
import os
import time

import torch

from nsa_flex.bench import sync, write_csv
from nsa_flex.inference.model import (GraphedDecodeStep, model_decode_step, model_prefill,
                                      new_model_cache, restore_state, snapshot_state)
from nsa_flex.titan.args import nsa_flex_args
from nsa_flex.titan.model import NSATransformer

FIELDS = ["context", "batch", "attention", "prefill_s", "decode_tokens_per_s", "device",
          "decode_mode"]
PRESET = {"nsa": "nsa", "full": "full_causal"}
DECODE_MODES = ("eager", "graph")


def build(flavor: str, attention: str, context: int, vocab: int, dev, dtype, backend: str):
    args = nsa_flex_args[flavor]
    args.masks, args.backend, args.vocab_size = PRESET[attention], backend, vocab
    args.max_seq_len = context
    torch.manual_seed(0)
    model = NSATransformer(args)
    with torch.no_grad():
        model.init_weights()
    return model.to(dev, dtype).eval()


def parse_modes(text: str) -> list[str] | str:
    """--decode-modes "eager,graph" -> ["eager", "graph"] (in order, once each), or the error."""
    modes = list(dict.fromkeys(x for x in text.split(",") if x))
    bad = [x for x in modes if x not in DECODE_MODES]
    if bad or not modes:
        return f"--decode-modes: unknown {bad}; a comma list of {list(DECODE_MODES)}"
    return modes


@torch.no_grad()
def graph_check(model, step, tok, cache) -> float:
    """Max |graphed - eager| logits of one step from the same cache state; the cache is left as
    it was (a step at the saved position is rewritten by the next one there)."""
    state = snapshot_state(cache)
    eager = model_decode_step(model, tok, cache).float()
    restore_state(cache, state)
    diff = (step(tok).float() - eager).abs().max().item()
    restore_state(cache, state)
    return diff


@torch.no_grad()
def run_one(model, batch, context, steps, warmup, vocab, dev, profile=False, modes=("eager",)):
    """(prefill seconds, {decode mode: decode tokens/s}) for one batch size: one prefill, then
    each mode's decode goes on from the cache the one before left."""
    prompt = torch.randint(1, vocab, (batch, context), device=dev)
    per_mode = warmup + steps + (4 if profile else 0) + 2  # + the graph capture and check
    for timed in (False, True):  # the first prefill compiles
        cache = new_model_cache(model, batch, context + len(modes) * per_mode)
        sync(dev)
        t0 = time.perf_counter()
        logits = model_prefill(model, prompt, cache)
        sync(dev)
        prefill_s = time.perf_counter() - t0
    tok = logits[:, -1].argmax(-1)
    tps = {}
    for mode in modes:
        if mode == "graph":  # the capture is not timed
            step = GraphedDecodeStep(model, cache, batch, model_decode_step)
            print(f"  graph vs eager logits, one step: max abs diff "
                  f"{graph_check(model, step, tok, cache):.3g}", flush=True)
        else:
            def step(t):
                return model_decode_step(model, t, cache)
        for _ in range(warmup):
            tok = step(tok).argmax(-1)
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(steps):
            tok = step(tok).argmax(-1)
        sync(dev)
        tps[mode] = batch * steps / (time.perf_counter() - t0)
        if profile and dev.type == "cuda":  # where a decode step's time goes (stdout)
            from torch.profiler import ProfilerActivity, profile as prof

            with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                for _ in range(4):
                    tok = step(tok).argmax(-1)
                sync(dev)
            print(f"profile, {mode} decode:", flush=True)
            print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=15), flush=True)
            print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=10), flush=True)
        del step
    return prefill_s, tps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--flavor", default="125M")
    ap.add_argument("--context", type=int, default=32768, help="prompt tokens per row")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--attention", default="nsa,full", help="comma list of: nsa, full")
    ap.add_argument("--steps", type=int, default=64, help="timed decode steps")
    ap.add_argument("--warmup", type=int, default=4, help="untimed decode steps first")
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--profile", action="store_true",
                    help="after timing, profile 4 decode steps (torch.profiler tables on stdout)")
    ap.add_argument("--decode-modes", default=None,
                    help="comma list of: eager, graph (CUDA-graph decode); default eager")
    ap.add_argument("--graphs", action="store_true", help="the same as --decode-modes graph")
    ap.add_argument("--quick", action="store_true",
                    help="CPU smoke: debugmodel, context 96, batches 1,2, 4 steps")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.quick:
        a.flavor, a.context, a.batches, a.steps, a.warmup, a.vocab = "debugmodel", 96, "1,2", 4, 1, 64
    attns = [x for x in a.attention.split(",") if x]
    bad = [x for x in attns if x not in PRESET]
    if bad:
        ap.error(f"--attention: unknown {bad}; allowed: {sorted(PRESET)}")
    if a.graphs and a.decode_modes is not None:
        ap.error("--graphs is --decode-modes graph: give one of them")
    modes = parse_modes("graph" if a.graphs else a.decode_modes or "eager")
    if isinstance(modes, str):
        ap.error(modes)
    dev = torch.device("cuda" if torch.cuda.is_available() and not a.quick else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    backend = "flex" if dev.type == "cuda" else "reference"
    device = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    if dev.type != "cuda" and "graph" in modes:
        print("note: decode mode graph needs CUDA; skipped on the CPU", flush=True)
        modes = [m for m in modes if m != "graph"]
        if not modes:
            return []
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "generate.csv")
    rows = []
    for attn in attns:
        model = build(a.flavor, attn, a.context, a.vocab, dev, dtype, backend)
        for batch in [int(b) for b in a.batches.split(",")]:
            t = time.perf_counter()
            pre, tps = run_one(model, batch, a.context, a.steps, a.warmup, a.vocab, dev,
                               a.profile, modes)
            for mode, v in tps.items():
                rows.append(dict(context=a.context, batch=batch, attention=attn,
                                 prefill_s=round(pre, 4), decode_tokens_per_s=round(v, 1),
                                 device=device, decode_mode=mode))
                print(f"{attn:4s} batch {batch:2d} context {a.context}: prefill {pre:8.3f} s, "
                      f"decode {v:9.1f} tok/s ({mode})", flush=True)
            print(f"  ({time.perf_counter() - t:.0f} s)", flush=True)
            write_csv(rows, path, fields=FIELDS)  # after every row: a cut-off run keeps its rows
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    print("wrote", path)
    return rows


if __name__ == "__main__":
    main()
