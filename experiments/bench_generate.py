"""Whole-model generation speed (issue 16, item 3): prefill seconds and decode tokens/s of the
nsa_flex model, NSA against the same model with full attention (`masks = "full_causal"`: SDPA
prefill on GPU, KV-cache decode), random weights, random prompt tokens (never zeros).

    python experiments/bench_generate.py --flavor 125M --context 32768 --batches 1,8 --out OUT
    python experiments/bench_generate.py --quick --out /tmp/gen        # CPU smoke (tests)

Per (attention, batch): a fresh cache, prefill of `batch` prompts of `context` tokens (the first
call compiles the flex calls and is not timed; the second is), then `--warmup` decode steps and
`--steps` timed decode steps (greedy), each step one token per row. Times are wall clock around
synchronized device work (CUDA events would not cover the host side of a step, which is part of
what a user waits for). Writes generate.csv (context,batch,attention,prefill_s,
decode_tokens_per_s,device) and prints a table.
"""

import argparse
import csv
import os
import time

import torch

from nsa_flex.inference.model import model_decode_step, model_prefill, new_model_cache
from nsa_flex.titan.args import nsa_flex_args
from nsa_flex.titan.model import NSATransformer

FIELDS = ["context", "batch", "attention", "prefill_s", "decode_tokens_per_s", "device"]
PRESET = {"nsa": "nsa", "full": "full_causal"}


def build(flavor: str, attention: str, context: int, vocab: int, dev, dtype, backend: str):
    args = nsa_flex_args[flavor]
    args.masks, args.backend, args.vocab_size = PRESET[attention], backend, vocab
    args.max_seq_len = context
    torch.manual_seed(0)
    model = NSATransformer(args)
    with torch.no_grad():
        model.init_weights()
    return model.to(dev, dtype).eval()


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def run_one(model, batch, context, steps, warmup, vocab, dev):
    """(prefill seconds, decode tokens/s) for one batch size."""
    prompt = torch.randint(1, vocab, (batch, context), device=dev)
    for timed in (False, True):  # the first prefill compiles
        cache = new_model_cache(model, batch, context + warmup + steps + 1)
        sync(dev)
        t0 = time.perf_counter()
        logits = model_prefill(model, prompt, cache)
        sync(dev)
        prefill_s = time.perf_counter() - t0
    tok = logits[:, -1].argmax(-1)
    for _ in range(warmup):
        tok = model_decode_step(model, tok, cache).argmax(-1)
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = model_decode_step(model, tok, cache).argmax(-1)
    sync(dev)
    return prefill_s, batch * steps / (time.perf_counter() - t0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--flavor", default="125M")
    ap.add_argument("--context", type=int, default=32768, help="prompt tokens per row")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--attention", default="nsa,full", help="comma list of: nsa, full")
    ap.add_argument("--steps", type=int, default=64, help="timed decode steps")
    ap.add_argument("--warmup", type=int, default=4, help="untimed decode steps first")
    ap.add_argument("--vocab", type=int, default=50304)
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
    dev = torch.device("cuda" if torch.cuda.is_available() and not a.quick else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    backend = "flex" if dev.type == "cuda" else "reference"
    device = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "generate.csv")
    rows = []
    for attn in attns:
        model = build(a.flavor, attn, a.context, a.vocab, dev, dtype, backend)
        for batch in [int(b) for b in a.batches.split(",")]:
            t = time.perf_counter()
            pre, tps = run_one(model, batch, a.context, a.steps, a.warmup, a.vocab, dev)
            rows.append(dict(context=a.context, batch=batch, attention=attn,
                             prefill_s=round(pre, 4), decode_tokens_per_s=round(tps, 1),
                             device=device))
            print(f"{attn:4s} batch {batch:2d} context {a.context}: prefill {pre:8.3f} s, decode "
                  f"{tps:9.1f} tok/s ({time.perf_counter() - t:.0f} s)", flush=True)
            with open(path, "w", newline="") as f:  # after every row: a cut-off run keeps its rows
                w = csv.DictWriter(f, fieldnames=FIELDS)
                w.writeheader()
                w.writerows(rows)
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    print("wrote", path)
    return rows


if __name__ == "__main__":
    main()
