"""Passkey retrieval and multi-key needle-in-a-haystack evaluation of an nsa_flex checkpoint.

    # a torchtitan checkpoint (DCP step folder, or the checkpoint folder: its latest step-N)
    python -m nsa_flex.eval --config titan_configs/ablation.toml \\
        --checkpoint outputs/ablation_nsa/checkpoint --lengths 2048,4096,8192 --out outputs/needle_nsa
    # CPU smoke test: the tiny debug model, random weights (or --checkpoint DIR of a debug run)
    python -m nsa_flex.eval --quick --out /tmp/needle_quick
    # the ablation table: every <DIR>/<run>/needle.csv + metrics.jsonl -> <DIR>/ablation.csv + .png
    python -m nsa_flex.eval --collect OUT

Prompts (generated offline, deterministic in --seed):
  * passkey: exactly the training passkey document of nsa_flex/data/passkey.py
    (``PasskeyCorpus.build``: [BOS] intro, filler, the needle "The pass key is: 12345. Remember it.
    The pass key is: 12345." at the given depth, "What is the pass key? The pass key is:"), cut before
    the answer. A prompt of length L is the training document of seq_len L: with the synthetic
    filler, a model trained on the passkey corpus at seq_len L is evaluated in distribution at L.
  * multikey: --n-keys needles "The pass key of <name> is <key>. ..." with distinct names and keys,
    the asked one at the given depth, the others at random depths; the question asks for that name.
  Filler (--filler): ``synthetic`` = the training corpus's sentences; ``fineweb`` = real text from
  the FineWeb sample (--fineweb, one haystack per trial, the same for every depth); ``auto`` =
  fineweb when the file exists and the config trains on text, synthetic for a model trained on the
  passkey corpus alone (it has never seen real text) or without the file; ``pysource`` = source code of
  the pysource corpus's validation packages (``auto`` for a model trained on pysource). Depth d% puts the needle after d% of the filler.

Model: flavor, [nsa] section and tokenizer from the TOML config (plus --override flags), weights from
the checkpoint (nsa_flex.apps.generate's loaders). Greedy answer: prefill + token-by-token decode with the
NSA per-branch caches (nsa_flex.inference) when every layer's mask builders have a decode rule
(nsa, full_causal, sliding_only, local_selection, no_compressed); otherwise (random_selection, custom
builders) a full forward per new token. Attention backend per length (--backend auto): the dense
``reference`` path when its [heads, T, T] scores fit in --mem-fraction (0.5) of the free memory (no
compile), else
``flex``. Score: the digits at the start of the answer == the key.

Long evaluations in segments: --time-limit S stops cleanly after S seconds (rows, summary and
heatmap of what was scored; meta.json "complete": false); the same command with --resume keeps the
scored rows of needle.csv (checked against this run's prompts) and evaluates only the missing ones.

Outputs under --out: needle.csv (kind, length, depth, trial, correct, answer, expected, and for a
model whose selection scores: sel_recall, the share of layers x KV groups whose picks at the
question hold a block of the needle's key, needle_forced, 1 where that block is forced; one row
written and flushed as soon as it is scored), summary.csv (kind, length, n, correct, accuracy,
digits, ci_lo / ci_hi: the 95% Wilson interval of the accuracy, sel_recall), needle_heatmap.png (depth x
length accuracy per kind, annotated; needs matplotlib), meta.json; a summary line per length is printed. Bad arguments raise errors that name the flag and the value.
"""

import csv
import json
import os
import time

import torch

from nsa_flex.apps.generate import build_model, load_checkpoint, load_job_config
from nsa_flex.inference.decode import branch_modes
from nsa_flex.inference.model import generate
from nsa_flex.selection import QuestionPicks

from .args import DEFAULT_CONFIG, DEFAULT_FINEWEB, ROOT, parse_args  # noqa: F401 (re-exported)
from .prompts import (KINDS, MULTI_NEEDLE, MULTI_QUESTION, NAMES, EvalError, Filler, digit_score,
                      int_list, kinds_list, make_prompt, score)
from .report import read_metrics, collect, plot_heatmap, summarize, write_summary

# sel_recall: the share of selecting layers x KV groups whose picks at the question hold a block of
# the needle's key; needle_forced: 1 where that block is forced (block 0, the local blocks);
# sel_recall_layers: that share per selecting layer, space-separated in model order
FIELDS = ("kind", "length", "depth", "trial", "correct", "answer", "expected", "sel_recall", "needle_forced",
          "sel_recall_layers")
__all__ = ["KINDS", "MULTI_NEEDLE", "MULTI_QUESTION", "NAMES", "EvalError", "Filler", "digit_score",
           "int_list", "kinds_list", "make_prompt", "score", "collect", "plot_heatmap", "summarize",
           "write_summary", "read_metrics", "evaluate", "main"]


# ---------------------------------------------------------------------- model
def load(args):
    """(model, tokenizer, description) from --config / --checkpoint (or random weights)."""
    if not os.path.isfile(args.config):
        raise EvalError(f"--config {args.config!r}: no such file")
    if args.checkpoint is None and not args.random_init:
        raise EvalError("--checkpoint is required (a DCP step-N folder or a folder of them); "
                        "--quick or --random-init evaluate random weights")
    if args.checkpoint is not None and not os.path.exists(args.checkpoint):
        raise EvalError(f"--checkpoint {args.checkpoint!r}: no such file or folder")
    job_config = load_job_config(args.config, args.override)
    args.train_dataset = job_config.training.dataset  # for --filler auto
    model, tok = build_model(job_config, args.device, getattr(torch, args.dtype))
    if args.checkpoint is None:
        torch.manual_seed(args.seed)
        with torch.no_grad():
            model.init_weights()
        where = "random weights"
    else:
        where = load_checkpoint(model, args.checkpoint)  # a bad one: a UserError naming --checkpoint
    model.eval()
    a = model.model_args
    return model, tok, f"{a.masks} ({job_config.model.flavor}, {job_config.model.tokenizer}), {where}"


def attention_layers(model):
    return [blk.attention for blk in model.layers.values()]


def decode_mode(model, requested: str) -> str:
    if requested == "full":
        return "full"
    try:
        for att in attention_layers(model):
            branch_modes(att)
        return "cache"
    except NotImplementedError as e:
        if requested == "cache":
            raise EvalError(f"--decode cache: {e}") from None
        return "full"


def dense_bytes(model, T: int) -> int:
    """Peak bytes of one row of the reference backend's dense attention (scores, masked scores,
    exponentials and probabilities: 4 x [heads, T, T] fp32)."""
    return 4 * model.model_args.n_heads * T * T * 4


MEM_FRACTION = 0.5  # of the free GPU memory for the reference backend's dense scores (--mem-fraction)


def memory_budget(device) -> int:
    if torch.device(device).type == "cuda":
        return int(MEM_FRACTION * torch.cuda.mem_get_info(torch.device(device))[0])
    return 4 << 30


def pick_backend(model, T: int, requested: str, device) -> str:
    if requested not in ("auto", "reference", "flex"):
        raise EvalError(f"--backend: {requested!r} not in ['auto', 'reference', 'flex']")
    if torch.device(device).type != "cuda":
        return "reference"  # training-time CPU rule: flex is compiled and GPU-only here
    if requested != "auto":
        return requested
    return "reference" if dense_bytes(model, T) <= memory_budget(device) else "flex"


def set_backend(model, backend: str) -> None:
    for att in attention_layers(model):
        att.cfg.backend = backend


@torch.no_grad()
def greedy_full(model, prompts: list[list[int]], max_new: int, eos_id, device) -> list[list[int]]:
    """Greedy decoding by a full forward per new token (right padding; masks are causal)."""
    seqs = [list(p) for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    for _ in range(max_new):
        lens = torch.tensor([len(s) for s in seqs], device=device)
        toks = torch.zeros(len(seqs), int(lens.max()), dtype=torch.long, device=device)
        for b, s in enumerate(seqs):
            toks[b, : len(s)] = torch.tensor(s, device=device)
        logits = model(toks)
        nxt = logits[torch.arange(len(seqs), device=device), lens - 1].argmax(-1).tolist()
        for b, t in enumerate(nxt):
            seqs[b].append(t)
            if not done[b]:
                out[b].append(t)
                done[b] = eos_id is not None and t == eos_id
        if all(done):
            break
    return out


DECODE_BACKEND = "auto"  # --decode-backend: the NSA cache decode step, auto | torch | triton


def generate_batch(model, prompts, max_new, mode, eos_id, device) -> list[list[int]]:
    if mode == "full":
        return greedy_full(model, prompts, max_new, eos_id, device)
    return generate(model, prompts, max_new, greedy=True, eos_id=eos_id, device=device,
                    decode_backend=DECODE_BACKEND)["tokens"]


# ---------------------------------------------------------------------- evaluation
def evaluate(args) -> dict:
    os.makedirs(args.out, exist_ok=True)
    lengths = sorted(int_list(args.lengths, "--lengths", lo=16))
    depths = int_list(args.depths, "--depths", lo=0, hi=100)
    kinds = kinds_list(args.kinds)
    if args.trials < 1:
        raise EvalError(f"--trials: {args.trials} must be >= 1")
    if args.batch_size < 1:
        raise EvalError(f"--batch-size: {args.batch_size} must be >= 1")
    if args.dtype not in ("float32", "bfloat16"):
        raise EvalError(f"--dtype: {args.dtype!r} not in ['float32', 'bfloat16']")
    t0 = time.perf_counter()
    model, tok, desc = load(args)
    trained_on = str(getattr(args, "train_dataset", "")).lower()
    filler = Filler(Filler.resolve(args.filler, args.fineweb, trained_on != "passkey", trained_on == "pysource"),
                    tok, args.fineweb)
    mode = decode_mode(model, args.decode)
    # all prompts first: argument errors (too short a length) before any generation
    jobs = {(k, L): [make_prompt(tok, k, L, d, t, filler, args.n_keys, args.seed) | {"depth": d, "trial": t}
                     for d in depths for t in range(args.trials)] for k in kinds for L in lengths}
    print(f"# needle eval: {desc}; decode {mode}; filler {filler.kind}; kinds {kinds}; lengths {lengths}; "
          f"{len(depths)} depths x {args.trials} trials; device {args.device} {args.dtype}; "
          f"load {time.perf_counter() - t0:.1f}s", flush=True)
    meta = {"config": args.config, "checkpoint": args.checkpoint, "model": desc, "decode": mode,
            "decode_backend": args.decode_backend,
            "filler": filler.kind, "kinds": kinds, "lengths": lengths, "depths": depths,
            "trials": args.trials, "n_keys": args.n_keys, "seed": args.seed, "backend": {}, "seconds": {}}
    path = os.path.join(args.out, "needle.csv")
    kept = resumed_rows(path, jobs) if args.resume else []
    done_keys = {(r["kind"], r["length"], r["depth"], r["trial"]) for r in kept}
    rows: list[dict] = []
    meta["resumed_rows"] = len(kept)
    meta["complete"] = True
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(kept)
        rows += kept
        f.flush()
        if kept:
            print(f"# --resume: {len(kept)} rows of {path} kept", flush=True)
        for L in lengths:
            if not meta["complete"]:
                break
            if all((k, L, it["depth"], it["trial"]) in done_keys for k in kinds for it in jobs[(k, L)]):
                continue
            backend = pick_backend(model, L + 8, args.backend, args.device)
            set_backend(model, backend)
            bs = args.batch_size
            if backend == "reference":
                bs = max(1, min(bs, memory_budget(args.device) // dense_bytes(model, L + 8)))
            meta["backend"][L] = backend
            tL = time.perf_counter()
            for kind in kinds:
                items = [it for it in jobs[(kind, L)] if (kind, L, it["depth"], it["trial"]) not in done_keys]
                queue = [items[s: s + bs] for s in range(0, len(items), bs)]
                while queue:
                    if args.time_limit and time.perf_counter() - t0 > args.time_limit:
                        meta["complete"] = False  # --resume goes on from here
                        print(f"# --time-limit {args.time_limit}s reached: stopping before {kind} L={L} "
                              f"({sum(map(len, queue))} prompts left there)", flush=True)
                        break
                    chunk = queue.pop(0)
                    tb = time.perf_counter()
                    max_new = max(it["answer_tokens"] for it in chunk) + 2
                    picks = QuestionPicks(model, [len(it["tokens"]) for it in chunk])
                    try:
                        with picks:
                            gens = generate_batch(model, [it["tokens"] for it in chunk], max_new, mode,
                                                  tok.eos_id, args.device)
                    except torch.OutOfMemoryError:
                        torch.cuda.empty_cache()
                        if len(chunk) == 1:
                            raise EvalError(f"--lengths {L}: out of memory for one prompt with backend "
                                            f"{backend!r}; try --backend flex or shorter lengths") from None
                        h = len(chunk) // 2  # halve the batch and retry
                        queue[:0] = [chunk[:h], chunk[h:]]
                        print(f"  [{kind} L={L}] out of memory with batch {len(chunk)}: retrying as {h}",
                              flush=True)
                        continue
                    for b, (it, g) in enumerate(zip(chunk, gens)):
                        g = [t for t in g if t != tok.eos_id]
                        text = tok.decode(g)
                        ok, _ = score(text, it["expected"])
                        row = {"kind": kind, "length": L, "depth": it["depth"], "trial": it["trial"],
                               "correct": int(ok), "answer": text, "expected": it["expected"]}
                        rec = picks.recall(b, it["needle"])
                        if rec is not None:
                            row["sel_recall"], row["needle_forced"] = round(rec[0], 4), rec[1]
                            row["sel_recall_layers"] = " ".join(f"{h:.2f}" for h in rec[2])
                        w.writerow(row)
                        f.flush()
                        rows.append(row)
                    done = [r for r in rows if r["kind"] == kind and r["length"] == L]
                    print(f"  [{kind} L={L} {backend}] {len(done)}/{len(jobs[(kind, L)])} rows, "
                          f"acc {sum(r['correct'] for r in done) / len(done):.3f}, "
                          f"batch {len(chunk)} in {time.perf_counter() - tb:.1f}s", flush=True)
                if not meta["complete"]:
                    break
            meta["seconds"][L] = round(time.perf_counter() - tL, 2)
    summ = write_summary(rows, args.out)
    for s in summ:
        rec = f", selection recall {s['sel_recall']:.2f}" if s["sel_recall"] != "" else ""
        print(f"{s['kind']:8s} length {s['length']:6d}: {s['correct']}/{s['n']} = {s['accuracy']:.3f}"
              f" (digits right {s['digits']:.2f}{rec})")
    png = os.path.join(args.out, "needle_heatmap.png")
    plotted = plot_heatmap(rows, png, args.tag or "")
    meta["total_s"] = round(time.perf_counter() - t0, 2)
    with open(os.path.join(args.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(f"# wrote {path}, summary.csv{', needle_heatmap.png' if plotted else ''}, meta.json "
          f"({meta['total_s']:.1f}s){'' if meta['complete'] else '; INCOMPLETE: rerun with --resume'}",
          flush=True)
    return {"rows": rows, "summary": summ, "meta": meta, "heatmap": png if plotted else None}


def resumed_rows(path: str, jobs: dict) -> list[dict]:
    """The scored rows of an earlier needle.csv (--resume) that belong to this evaluation's prompts;
    a row whose expected key differs from this run's prompt was made with other settings: error."""
    if not os.path.isfile(path):
        return []
    want = {(k, L, it["depth"], it["trial"]): it["expected"] for (k, L), items in jobs.items() for it in items}
    out = []
    for r in csv.DictReader(open(path, newline="")):
        if r.get("correct") not in ("0", "1"):
            continue  # a line cut by a kill
        key = (r["kind"], int(r["length"]), int(r["depth"]), int(r["trial"]))
        if key not in want:
            continue
        if str(r["expected"]) != str(want[key]):
            raise EvalError(f"--resume: {path} row {key} expects {r['expected']} but this evaluation's "
                            f"prompt expects {want[key]} (other --seed / --n-keys / --filler?); use a "
                            "new --out or the same settings")
        out.append({**r, "length": key[1], "depth": key[2], "trial": key[3], "correct": int(r["correct"])})
    return out


# ---------------------------------------------------------------------- CLI
def main(argv=None):
    global MEM_FRACTION, DECODE_BACKEND
    a = parse_args(argv)
    if a.collect:
        return collect(a.collect)
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not 0 < a.mem_fraction <= 1:
        raise EvalError(f"--mem-fraction: {a.mem_fraction} must be in (0, 1]")
    MEM_FRACTION = a.mem_fraction
    DECODE_BACKEND = a.decode_backend
    return evaluate(a)
