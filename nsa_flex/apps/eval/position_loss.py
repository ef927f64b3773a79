"""Validation loss as a function of token position: does the model use distant context?

    python -m nsa_flex.eval --task position-loss --config titan_configs/quality_125m_16k.toml \\
        --checkpoint outputs/quality_nsa/checkpoint --docs VAL.parquet --seq-len 16384 --out OUT
    # CPU smoke test: the debug model, random weights, FineWeb-Edu sample documents
    python -m nsa_flex.eval --task position-loss --quick --out /tmp/posloss

Input: --docs, a parquet / jsonl file with a text column (--text-column) or a .txt file. Each
document with at least --seq-len tokens is cut to --seq-len (BOS first), up to --max-docs of them;
with --join the documents are concatenated (EOS after each) and cut into --seq-len pieces (unrelated
documents: a check that distance does not hurt, not that it helps).

Loss: the next-token cross entropy (nats) of the token at position p (0-based) given the p tokens
before it, p = 1 .. seq_len-1, averaged over the tokens of each position bucket. Buckets:
log-spaced (default, --per-octave edges per doubling from 1: [1,2), [2,3), [3,4), [4,6), ... with
2 per octave) or fixed width (--bucket-width W: [1,W), [W,2W), ...); the last ends at seq_len.

Outputs under --out: position_loss.csv (bucket_lo, bucket_hi (exclusive), pos_mid (geometric
mean of the bucket's positions), n_tokens, n_docs, loss (mean over the bucket's tokens), loss_sem
(standard error over documents of their bucket means; empty with one document)),
position_loss.png (one curve; experiments/quality_report.py plots several runs in one figure),
position_loss_meta.json. Model loading and the attention backend: as the needle evaluation.
"""

import csv
import json
import math
import os
import time

import torch
import torch.nn.functional as F

from .cli import add_docs_args, add_run_args, resolve_common, task_parser
from .docs import read_texts, token_sequences
from .needle import load, pick_backend, set_backend
from .prompts import EvalError
from .report import plot_position_loss

FIELDS = ("bucket_lo", "bucket_hi", "pos_mid", "n_tokens", "n_docs", "loss", "loss_sem")
CE_CHUNK = 2048  # positions per cross-entropy chunk: [B, 2048, vocab] fp32 at a time


def bucket_edges(seq_len: int, per_octave: int = 2, width: int | None = None) -> list[int]:
    """Edges e_0 = 1 < e_1 < ... < e_k = seq_len of the position buckets [e_i, e_i+1)."""
    if seq_len < 2:
        raise EvalError(f"--seq-len: {seq_len} must be >= 2")
    if width is not None:
        if width < 1:
            raise EvalError(f"--bucket-width: {width} must be >= 1")
        inner = list(range(width, seq_len, width))
    else:
        if per_octave < 1:
            raise EvalError(f"--per-octave: {per_octave} must be >= 1")
        inner, k = [], 1
        while (e := math.ceil(2 ** (k / per_octave) - 1e-9)) < seq_len:
            inner.append(e)
            k += 1
    return sorted({1, *[e for e in inner if 1 < e < seq_len], seq_len})


@torch.no_grad()
def token_losses(model, tokens: torch.Tensor) -> torch.Tensor:
    """tokens [B, T] -> per-token cross entropy [B, T-1] (fp32, nats): entry p-1 is the loss of
    tokens[:, p] given tokens[:, :p]."""
    logits = model(tokens)
    T = tokens.shape[1]
    out = []
    for s in range(0, T - 1, CE_CHUNK):
        e = min(T - 1, s + CE_CHUNK)
        lg = logits[:, s:e].float()
        out.append(F.cross_entropy(lg.reshape(-1, lg.shape[-1]), tokens[:, s + 1:e + 1].reshape(-1),
                                   reduction="none").view(tokens.shape[0], e - s))
    return torch.cat(out, 1)


def bucket_rows(losses: torch.Tensor, edges: list[int]) -> list[dict]:
    """losses [N, T-1] (documents x positions 1..T-1) -> one row per bucket (FIELDS)."""
    losses = losses.double()
    N = losses.shape[0]
    rows = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        part = losses[:, lo - 1:hi - 1]  # positions lo..hi-1
        per_doc = part.mean(1)
        sem = float(per_doc.std(unbiased=True) / math.sqrt(N)) if N > 1 else ""
        rows.append({"bucket_lo": lo, "bucket_hi": hi,
                     "pos_mid": round(math.sqrt(lo * (hi - 1)), 2), "n_tokens": part.numel(),
                     "n_docs": N, "loss": round(float(part.mean()), 6),
                     "loss_sem": round(sem, 6) if sem != "" else ""})
    return rows


def read_rows(path: str) -> list[dict]:
    """A position_loss.csv back as numbers."""
    out = []
    for r in csv.DictReader(open(path)):
        out.append({k: (float(v) if v not in ("", None) else None) for k, v in r.items()})
    return out


def evaluate(args) -> dict:
    os.makedirs(args.out, exist_ok=True)
    for flag, v, lo in (("--max-docs", args.max_docs, 1), ("--batch-size", args.batch_size, 1)):
        if v < lo:
            raise EvalError(f"{flag}: {v} must be >= {lo}")
    if args.dtype not in ("float32", "bfloat16"):
        raise EvalError(f"--dtype: {args.dtype!r} not in ['float32', 'bfloat16']")
    edges = bucket_edges(args.seq_len, args.per_octave, args.bucket_width)
    texts = read_texts(args.docs, args.text_column, "--docs")
    t0 = time.perf_counter()
    model, tok, desc = load(args)
    seqs = token_sequences(texts, tok, args.seq_len, args.max_docs, args.join, "--docs")
    backend = pick_backend(model, args.seq_len, args.backend, args.device)
    set_backend(model, backend)
    print(f"# position loss: {desc}; {len(seqs)} sequences of {args.seq_len} tokens from {args.docs}"
          f"{' (joined)' if args.join else ''}; backend {backend}; {args.device} {args.dtype}", flush=True)
    losses = []
    for s in range(0, len(seqs), args.batch_size):
        toks = torch.tensor(seqs[s:s + args.batch_size], dtype=torch.long, device=args.device)
        losses.append(token_losses(model, toks).cpu())
    losses = torch.cat(losses)
    rows = bucket_rows(losses, edges)
    path = os.path.join(args.out, "position_loss.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    for r in rows:
        print(f"  positions [{r['bucket_lo']:6d}, {r['bucket_hi']:6d}): loss {r['loss']:.4f}")
    meta = {"config": args.config, "checkpoint": args.checkpoint, "model": desc, "docs": args.docs,
            "text_column": args.text_column, "join": args.join, "seq_len": args.seq_len,
            "n_sequences": len(seqs), "buckets": ("width %d" % args.bucket_width if args.bucket_width
                                                  else f"log, {args.per_octave} per octave"),
            "mean_loss": round(float(losses.double().mean()), 6), "backend": backend,
            "seconds": round(time.perf_counter() - t0, 2)}
    with open(os.path.join(args.out, "position_loss_meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    png = os.path.join(args.out, "position_loss.png")
    plotted = plot_position_loss({args.tag or "run": rows}, png)
    print(f"# wrote {path}{', position_loss.png' if plotted else ''} (mean loss {meta['mean_loss']:.4f}, "
          f"{meta['seconds']:.1f}s)", flush=True)
    return {"rows": rows, "losses": losses, "sequences": seqs, "meta": meta}


def parse_args(argv=None):
    p = task_parser(__doc__, "CPU smoke run: debug model (random weights unless --checkpoint), seq 256, 4 documents",
                    prog="python -m nsa_flex.eval --task position-loss")
    add_docs_args(p)
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default 16384; --quick 256)")
    p.add_argument("--max-docs", type=int, default=16, help="sequences evaluated (at most)")
    p.add_argument("--per-octave", type=int, default=2, help="log buckets: edges per doubling")
    p.add_argument("--bucket-width", type=int, help="fixed-width buckets of this many positions instead")
    p.add_argument("--batch-size", type=int, default=1)
    add_run_args(p, tag_help="the curve's label", override_example="--nsa.window=64")
    a = resolve_common(p.parse_args(argv))
    if a.quick:
        a.seq_len = a.seq_len or 256
        a.max_docs = min(a.max_docs, 4)
    a.seq_len = a.seq_len or 16384
    return a


def main(argv=None):
    return evaluate(parse_args(argv))
