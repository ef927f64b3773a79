"""Passkey retrieval and multi-key needle-in-a-haystack evaluation of an nsa_flex checkpoint.

    # a torchtitan checkpoint (DCP step folder, or the checkpoint folder: its latest step-N)
    python experiments/needle_eval.py --config titan_configs/ablation_nsa.toml \\
        --checkpoint outputs/ablation_nsa/checkpoint --lengths 2048,4096,8192 --out outputs/needle_nsa
    # CPU smoke test: the tiny debug model, random weights (or --checkpoint DIR of a debug run)
    python experiments/needle_eval.py --quick --out /tmp/needle_quick
    # the ablation table: every <DIR>/<run>/needle.csv + metrics.jsonl -> <DIR>/ablation.csv + .png
    python experiments/needle_eval.py --collect OUT

Prompts (generated offline, deterministic in --seed):
  * passkey: exactly the training passkey document of nsa_flex/titan/data.py
    (``PasskeyCorpus.build``: [BOS] intro, filler, the needle "The pass key is: 12345. Remember it.
    The pass key is: 12345." at the given depth, "What is the pass key? The pass key is:"), cut before
    the answer. A prompt of length L is the training document of seq_len L: with the synthetic
    filler, a model trained on the passkey corpus at seq_len L is evaluated in distribution at L.
  * multikey: --n-keys needles "The pass key of <name> is <key>. ..." with distinct names and keys,
    the asked one at the given depth, the others at random depths; the question asks for that name.
  Filler (--filler): ``synthetic`` = the training corpus's sentences; ``fineweb`` = real text from
  the FineWeb sample (--fineweb, one haystack per trial, the same for every depth); ``auto`` =
  fineweb when the file exists and the config trains on text, synthetic for a model trained on the
  passkey corpus alone (it has never seen real text) or without the file. Depth d% puts the needle after d% of the filler.

Model: flavor, [nsa] section and tokenizer from the TOML config (plus --override flags), weights from
the checkpoint (nsa_flex.generate's loaders). Greedy answer: prefill + token-by-token decode with the
NSA per-branch caches (nsa_flex.inference) when every layer's mask builders have a decode rule
(nsa, full_causal, sliding_only, local_selection, no_compressed); otherwise (random_selection, custom
builders) a full forward per new token. Attention backend per length (--backend auto): the dense
``reference`` path when its [heads, T, T] scores fit in --mem-fraction (0.5) of the free memory (no
compile), else
``flex``. Score: the digits at the start of the answer == the key.

Outputs under --out: needle.csv (kind, length, depth, trial, correct, answer, expected; one row
written and flushed as soon as it is scored), summary.csv (kind, length, n, correct, accuracy),
needle_heatmap.png (depth x length accuracy per kind, annotated; needs matplotlib), meta.json; a
summary line per length is printed. Bad arguments raise errors that name the flag and the value.
"""

import argparse
import csv
import glob
import json
import os
import random
import re
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

KINDS = ("passkey", "multikey")
FIELDS = ("kind", "length", "depth", "trial", "correct", "answer", "expected")
DEFAULT_FINEWEB = os.path.join(os.path.dirname(ROOT), "shared", "data", "fineweb_sample_2800.parquet")
DEFAULT_CONFIG = os.path.join(ROOT, "titan_configs", "debug_nsa.toml")
NAMES = ("Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry", "Irene", "Jack",
         "Karen", "Louis", "Maria", "Nora", "Oscar", "Peter")
MULTI_NEEDLE = " The pass key of {name} is: {key}. Remember it. The pass key of {name} is: {key}. "
MULTI_QUESTION = "\nWhat is the pass key of {name}? The pass key of {name} is:"  # + " {key}."


class EvalError(ValueError):
    """A bad argument or input, named in the message."""


# ---------------------------------------------------------------------- arguments
def int_list(text: str, flag: str, lo: int | None = None, hi: int | None = None) -> list[int]:
    out = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        try:
            v = int(part)
        except ValueError:
            raise EvalError(f"{flag}: {part!r} is not an integer (got {text!r})") from None
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise EvalError(f"{flag}: {v} is outside {lo}..{'' if hi is None else hi} (got {text!r})")
        out.append(v)
    if not out:
        raise EvalError(f"{flag}: empty list (got {text!r})")
    return sorted(set(out), key=out.index)


def kinds_list(text: str) -> list[str]:
    ks = [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in ks if k not in KINDS]
    if bad or not ks:
        raise EvalError(f"--kinds: {bad or text!r} not in {list(KINDS)}")
    return ks


# ---------------------------------------------------------------------- filler
class Filler:
    """Filler tokens, one haystack per trial (the same for every depth and length of a trial):
    ``synthetic`` (the training corpus's kind: a random passage repeated, unseen in training) or
    ``fineweb`` (real text)."""

    def __init__(self, kind: str, tok, path: str | None = None):
        self.kind, self.tok, self.path = kind, tok, path
        self._texts: list[str] | None = None
        self._cache: dict[int, list[int]] = {}

    @staticmethod
    def resolve(choice: str, path: str, text_trained: bool = True) -> str:
        """``auto``: fineweb when the file exists and the model was trained on text
        (``text_trained``); a model trained on the passkey corpus alone has never seen real text,
        so its in-distribution haystack is the synthetic filler."""
        if choice not in ("auto", "synthetic", "fineweb"):
            raise EvalError(f"--filler: {choice!r} not in ['auto', 'synthetic', 'fineweb']")
        if choice == "auto":
            return "fineweb" if text_trained and path and os.path.isfile(path) else "synthetic"
        if choice == "fineweb" and not (path and os.path.isfile(path)):
            raise EvalError(f"--filler fineweb: --fineweb {path!r} does not exist")
        return choice

    def tokens(self, n: int, trial: int) -> list[int]:
        if self.kind == "synthetic":  # the training documents' kind of filler, one passage per trial
            from nsa_flex.titan.data import synthetic_filler

            got = self._cache.get(trial, [])
            if len(got) < n:
                got = self._cache[trial] = synthetic_filler(self.tok, n, f"eval:{trial}")
            return got
        got = self._cache.get(trial, [])
        if len(got) < n:
            if self._texts is None:
                import pyarrow.parquet as pq

                try:
                    self._texts = [t for t in pq.read_table(self.path, columns=["text"]).column("text")
                                   .to_pylist() if t]
                except Exception as e:
                    raise EvalError(f"--fineweb {self.path!r}: cannot read a 'text' column: {e}") from e
                if not self._texts:
                    raise EvalError(f"--fineweb {self.path!r}: no text")
            i = (trial * 37) % len(self._texts)
            start = i
            got = []
            while len(got) < n:
                got += self.tok.encode(self._texts[i] + "\n\n")
                i = (i + 1) % len(self._texts)
                if i == start and len(got) < n:
                    got += got  # a small file: repeat it
            self._cache[trial] = got
        return got


# ---------------------------------------------------------------------- prompts
def make_prompt(tok, kind: str, length: int, depth: int, trial: int, filler: Filler,
                n_keys: int = 4, seed: int = 0) -> dict:
    """One prompt of ``length`` (= the training document of seq_len ``length``, cut before the
    answer): {"tokens", "expected", "answer_tokens"}."""
    from nsa_flex.titan.data import (PASSKEY_ANSWER, PASSKEY_INTRO, DatasetError,
                                     PasskeyCorpus)

    rng = random.Random(f"needle:{seed}:{kind}:{length}:{depth}:{trial}")
    if kind == "passkey":
        key = rng.randint(10000, 99999)
        try:
            corpus = PasskeyCorpus(tok, length + 1)
        except DatasetError as e:
            raise EvalError(f"--lengths: {length} is too short for a passkey prompt ({e})") from None
        toks, ans = corpus.build(key, depth / 100.0, filler=filler.tokens(length + 1, trial))
        return {"tokens": toks[:ans], "expected": str(key), "answer_tokens": len(toks) - 1 - ans}
    if kind != "multikey":
        raise EvalError(f"--kinds: {kind!r} not in {list(KINDS)}")
    if not 2 <= n_keys <= len(NAMES):
        raise EvalError(f"--n-keys: {n_keys} is outside 2..{len(NAMES)}")
    names = rng.sample(NAMES, n_keys)
    keys = rng.sample(range(10000, 100000), n_keys)
    depths = [depth / 100.0] + [rng.random() for _ in range(n_keys - 1)]
    needles = [tok.encode(MULTI_NEEDLE.format(name=n, key=k)) for n, k in zip(names, keys)]
    question = tok.encode(MULTI_QUESTION.format(name=names[0]))
    answer = tok.encode(PASSKEY_ANSWER.format(key=keys[0]))
    bos = [tok.bos_id] if getattr(tok, "bos_id", None) is not None else []
    eos = [tok.eos_id]
    head = bos + tok.encode(PASSKEY_INTRO)
    fixed = len(question) + len(answer) + len(eos) + sum(map(len, needles))
    n_fill = length + 1 - len(head) - fixed
    if n_fill < 8:
        head = list(bos)
        n_fill = length + 1 - len(head) - fixed
    if n_fill < 8:
        raise EvalError(f"--lengths: {length} is too short for a {n_keys}-key prompt "
                        f"(needs >= {len(head) + fixed + 7} tokens with this tokenizer)")
    fill = filler.tokens(n_fill, trial)[:n_fill]
    at = lambda d: min(int(d * (n_fill + 1)), n_fill)  # insertion point, as PasskeyCorpus.build
    order = sorted(range(n_keys), key=lambda i: (at(depths[i]), i))
    body, prev = [], 0
    for i in order:
        cut = at(depths[i])
        body += fill[prev:cut] + needles[i]
        prev = cut
    body += fill[prev:]
    toks = head + body + question
    assert len(toks) + len(answer) + len(eos) == length + 1
    return {"tokens": toks, "expected": str(keys[0]), "answer_tokens": len(answer)}


def score(text: str, expected: str) -> tuple[bool, str]:
    m = re.match(r"\s*(\d+)", text)
    got = m.group(1) if m else ""
    return got == expected, got


def digit_score(text: str, expected: str) -> float:
    """Partial credit: the fraction of the key's digits the answer has at the right place (a model
    that half-retrieves shows here before it gets exact matches; chance is ~0.1 per digit)."""
    _, got = score(text, expected)
    return sum(a == b for a, b in zip(got, expected)) / len(expected)


# ---------------------------------------------------------------------- model
def load(args):
    """(model, tokenizer, description) from --config / --checkpoint (or random weights)."""
    from nsa_flex.generate import build_model, load_checkpoint, load_job_config

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
        try:
            where = load_checkpoint(model, args.checkpoint)
        except (FileNotFoundError, KeyError) as e:
            raise EvalError(f"--checkpoint {args.checkpoint!r}: {e}") from e
    model.eval()
    a = model.model_args
    return model, tok, f"{a.masks} ({job_config.model.flavor}, {job_config.model.tokenizer}), {where}"


def attention_layers(model):
    return [blk.attention for blk in model.layers.values()]


def decode_mode(model, requested: str) -> str:
    from nsa_flex.inference.decode import branch_modes

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
    from nsa_flex.inference.model import generate

    return generate(model, prompts, max_new, greedy=True, eos_id=eos_id, device=device,
                    decode_backend=DECODE_BACKEND)["tokens"]


# ---------------------------------------------------------------------- outputs
def summarize(rows: list[dict]) -> list[dict]:
    """Per-prompt rows -> one row per (kind, length): n, correct, accuracy, digits (right, mean)."""
    agg: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for r in rows:
        agg.setdefault((r["kind"], int(r["length"])), []).append(
            (int(r["correct"]), digit_score(r["answer"], str(r["expected"]))))
    return [{"kind": k, "length": L, "n": len(v), "correct": sum(c for c, _ in v),
             "accuracy": sum(c for c, _ in v) / len(v), "digits": round(sum(d for _, d in v) / len(v), 4)}
            for (k, L), v in sorted(agg.items())]


def write_summary(rows: list[dict], out: str) -> list[dict]:
    summ = summarize(rows)
    with open(os.path.join(out, "summary.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["kind", "length", "n", "correct", "accuracy", "digits"])
        w.writeheader()
        w.writerows(summ)
    return summ


def plot_heatmap(rows: list[dict], path: str, title: str = "") -> bool:
    """Depth x length accuracy heatmap, one panel per kind, cells annotated. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"# matplotlib missing: no {path}", file=sys.stderr)
        return False
    kinds = [k for k in KINDS if any(r["kind"] == k for r in rows)]
    lengths = sorted({int(r["length"]) for r in rows})
    depths = sorted({int(r["depth"]) for r in rows})
    fig, axes = plt.subplots(1, len(kinds), figsize=(2.2 + (1.6 + 0.9 * len(lengths)) * len(kinds),
                                                     1.4 + 0.4 * len(depths)), squeeze=False)
    for n, (ax, kind) in enumerate(zip(axes[0], kinds)):
        acc = [[float("nan")] * len(lengths) for _ in depths]
        for i, d in enumerate(depths):
            for j, L in enumerate(lengths):
                cell = [int(r["correct"]) for r in rows
                        if r["kind"] == kind and int(r["depth"]) == d and int(r["length"]) == L]
                if cell:
                    acc[i][j] = sum(cell) / len(cell)
        im = ax.imshow(acc, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        for i in range(len(depths)):
            for j in range(len(lengths)):
                if acc[i][j] == acc[i][j]:
                    ax.text(j, i, f"{100 * acc[i][j]:.0f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(lengths)), [f"{L // 1024}k" if L % 1024 == 0 else str(L) for L in lengths])
        ax.set_yticks(range(len(depths)), [f"{d}%" for d in depths])
        ax.set_xlabel("context length (tokens)")
        if n == 0:
            ax.set_ylabel("needle depth")
        ax.set_title(f"{kind} {title}".strip(), fontsize=9)
    fig.colorbar(im, ax=axes[0].tolist(), label="accuracy", shrink=0.8)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return True


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
    text_trained = str(getattr(args, "train_dataset", "")).lower() != "passkey"
    filler = Filler(Filler.resolve(args.filler, args.fineweb, text_trained), tok, args.fineweb)
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
    rows: list[dict] = []
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        f.flush()
        for L in lengths:
            backend = pick_backend(model, L + 8, args.backend, args.device)
            set_backend(model, backend)
            bs = args.batch_size
            if backend == "reference":
                bs = max(1, min(bs, memory_budget(args.device) // dense_bytes(model, L + 8)))
            meta["backend"][L] = backend
            tL = time.perf_counter()
            for kind in kinds:
                items = jobs[(kind, L)]
                queue = [items[s: s + bs] for s in range(0, len(items), bs)]
                while queue:
                    chunk = queue.pop(0)
                    tb = time.perf_counter()
                    max_new = max(it["answer_tokens"] for it in chunk) + 2
                    try:
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
                    for it, g in zip(chunk, gens):
                        g = [t for t in g if t != tok.eos_id]
                        text = tok.decode(g)
                        ok, _ = score(text, it["expected"])
                        row = {"kind": kind, "length": L, "depth": it["depth"], "trial": it["trial"],
                               "correct": int(ok), "answer": text, "expected": it["expected"]}
                        w.writerow(row)
                        f.flush()
                        rows.append(row)
                    done = [r for r in rows if r["kind"] == kind and r["length"] == L]
                    print(f"  [{kind} L={L} {backend}] {len(done)}/{len(items)} rows, "
                          f"acc {sum(r['correct'] for r in done) / len(done):.3f}, "
                          f"batch {len(chunk)} in {time.perf_counter() - tb:.1f}s", flush=True)
            meta["seconds"][L] = round(time.perf_counter() - tL, 2)
    summ = write_summary(rows, args.out)
    for s in summ:
        print(f"{s['kind']:8s} length {s['length']:6d}: {s['correct']}/{s['n']} = {s['accuracy']:.3f}"
              f" (digits right {s['digits']:.2f})")
    png = os.path.join(args.out, "needle_heatmap.png")
    plotted = plot_heatmap(rows, png, args.tag or "")
    meta["total_s"] = round(time.perf_counter() - t0, 2)
    with open(os.path.join(args.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(f"# wrote {path}, summary.csv{', needle_heatmap.png' if plotted else ''}, meta.json "
          f"({meta['total_s']:.1f}s)", flush=True)
    return {"rows": rows, "summary": summ, "meta": meta, "heatmap": png if plotted else None}


# ---------------------------------------------------------------------- ablation table
def _metrics(path: str) -> dict:
    """step -> merged record of a metrics.jsonl (or, when only that exists, its committed .gz)."""
    recs = {}
    if not os.path.isfile(path) and os.path.isfile(path + ".gz"):
        import gzip

        path, opener = path + ".gz", gzip.open
    else:
        opener = open
    if os.path.isfile(path):
        for line in opener(path, "rt"):
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            recs.setdefault(r["step"], {}).update(r)
    return recs


def collect(out: str) -> list[dict]:
    """<out>/<run>/{needle/summary.csv, metrics.jsonl, train_seconds} -> <out>/ablation.csv (one
    row per run, kind and length: accuracy; and per run: last logged loss, mean of the last 5 logged
    losses, mean tokens/s after the first two logged steps, training seconds, last telemetry gate
    means per branch) and <out>/ablation.png (loss curves, accuracy vs length)."""
    table = []
    runs = sorted(d for d in os.listdir(out) if os.path.isdir(os.path.join(out, d)))
    for run in runs:
        rd = os.path.join(out, run)
        recs = _metrics(os.path.join(rd, "metrics.jsonl"))
        losses = [(s, r["loss_metrics/global_avg_loss"]) for s, r in sorted(recs.items())
                  if "loss_metrics/global_avg_loss" in r]
        tps = [r["throughput(tps)"] for s, r in sorted(recs.items()) if "throughput(tps)" in r and s > 1]
        gates = {b: [r[f"nsa/gate_mean/{b}"] for _, r in sorted(recs.items()) if f"nsa/gate_mean/{b}" in r]
                 for b in ("cmp", "sel", "win")}
        base = {"run": run, "steps": losses[-1][0] if losses else "",
                "final_loss": round(losses[-1][1], 5) if losses else "",
                "loss_last5": round(sum(v for _, v in losses[-5:]) / len(losses[-5:]), 5) if losses else "",
                **{f"gate_{b}": round(g[-1], 4) if g else "" for b, g in gates.items()},
                "tps": round(sum(tps[1:]) / len(tps[1:])) if len(tps) > 1 else "",
                "train_s": open(os.path.join(rd, "train_seconds")).read().strip()
                if os.path.isfile(os.path.join(rd, "train_seconds")) else ""}
        summ = os.path.join(rd, "needle", "summary.csv")
        got = list(csv.DictReader(open(summ))) if os.path.isfile(summ) else []
        if not got:  # partial eval (killed): recount from the rows written so far
            rows_path = os.path.join(rd, "needle", "needle.csv")
            if os.path.isfile(rows_path):
                rows = [r for r in csv.DictReader(open(rows_path)) if r.get("correct") in ("0", "1")]
                if rows:
                    got = write_summary(rows, os.path.join(rd, "needle"))
        if not got:
            table.append({**base, "kind": "", "length": "", "n": 0, "correct": "", "accuracy": "", "digits": ""})
        for s in got:
            table.append({**base, "kind": s["kind"], "length": int(s["length"]), "n": int(s["n"]),
                          "correct": int(s["correct"]), "accuracy": round(float(s["accuracy"]), 4),
                          "digits": round(float(s["digits"]), 4) if s.get("digits") not in (None, "") else ""})
    fields = ["run", "kind", "length", "n", "correct", "accuracy", "digits", "steps", "final_loss", "loss_last5", "tps",
              "train_s", "gate_cmp", "gate_sel", "gate_win"]
    with open(os.path.join(out, "ablation.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(table)
    _plot_ablation(out, runs, table)
    for r in table:
        print(",".join(str(r[k]) for k in fields))
    return table


def _plot_ablation(out: str, runs: list[str], table: list[dict]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    kinds = [k for k in KINDS if any(r["kind"] == k for r in table)]
    fig, axes = plt.subplots(1, len(kinds) + 1, figsize=(4.2 * (len(kinds) + 1), 3.6), squeeze=False)
    axes = axes[0]
    for run in runs:
        recs = _metrics(os.path.join(out, run, "metrics.jsonl"))
        pts = [(s, r["loss_metrics/global_avg_loss"]) for s, r in sorted(recs.items())
               if "loss_metrics/global_avg_loss" in r]
        if pts:
            axes[0].plot(*zip(*pts), label=run)
        for ax, kind in zip(axes[1:], kinds):
            pts = sorted((r["length"], r["accuracy"]) for r in table if r["run"] == run and r["kind"] == kind)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=run)
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("training loss")
    axes[0].legend(fontsize=7)
    for ax, kind in zip(axes[1:], kinds):
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(f"{kind} accuracy")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "ablation.png"), dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------- CLI
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="torchtitan TOML of the run (default with --quick: debug_nsa.toml)")
    p.add_argument("--checkpoint", help="DCP step-N folder, or a folder of step-N folders (latest)")
    p.add_argument("--quick", action="store_true",
                   help="CPU smoke run: debug model (random weights unless --checkpoint), lengths 256,512, "
                        "depths 0,50,100, 1 trial, 2 keys")
    p.add_argument("--random-init", action="store_true", help="evaluate random weights (no checkpoint)")
    p.add_argument("--lengths", help="context lengths, comma separated (default 1024,...,65536)")
    p.add_argument("--depths", help="needle depths in %% (default 0,10,...,100)")
    p.add_argument("--trials", type=int, help="prompts per (kind, length, depth) (default 2)")
    p.add_argument("--kinds", default="passkey,multikey", help="passkey,multikey")
    p.add_argument("--n-keys", type=int, help="needles in a multikey prompt (default 4; --quick: 2)")
    p.add_argument("--filler", default="auto", help="auto | synthetic | fineweb")
    p.add_argument("--fineweb", default=DEFAULT_FINEWEB, help="FineWeb parquet for --filler fineweb/auto")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16")
    p.add_argument("--backend", default="auto", help="auto | reference | flex (prefill attention)")
    p.add_argument("--decode", default="auto", choices=("auto", "cache", "full"),
                   help="cache: prefill + NSA caches; full: a full forward per token; auto: cache when supported")
    p.add_argument("--decode-backend", default="auto", choices=("auto", "torch", "triton"),
                   help="decode step of the NSA caches (nsa_flex.inference): auto = the fused Triton kernel "
                        "on CUDA, torch = the reference path")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per generation call (upper bound)")
    p.add_argument("--mem-fraction", type=float, default=0.5,
                   help="share of the free GPU memory the dense reference attention may use")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default="", help="label for the heatmap titles")
    p.add_argument("--out", help="output folder")
    p.add_argument("--override", action="append", default=[],
                   help="extra torchtitan config flag, e.g. --override=--nsa.window=64")
    p.add_argument("--collect", metavar="DIR", help="only build DIR/ablation.csv + .png from DIR/<run>/")
    a = p.parse_args(argv)
    if a.collect:
        return a
    if not a.out:
        raise EvalError("--out is required")
    if a.quick:
        a.config = a.config or DEFAULT_CONFIG
        a.device = a.device or "cpu"
        a.lengths = a.lengths or "256,512"
        a.n_keys = 2 if a.n_keys is None else a.n_keys
        a.depths = a.depths or "0,50,100"
        a.trials = 1 if a.trials is None else a.trials
        a.random_init = a.random_init or a.checkpoint is None
    if not a.config:
        raise EvalError("--config is required (or --quick)")
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    a.lengths = a.lengths or "1024,2048,4096,8192,16384,32768,65536"
    a.depths = a.depths or ",".join(str(d) for d in range(0, 101, 10))
    a.trials = 2 if a.trials is None else a.trials
    a.n_keys = 4 if a.n_keys is None else a.n_keys
    return a


def main(argv=None):
    global MEM_FRACTION, DECODE_BACKEND
    a = parse_args(argv)
    if a.collect:
        return collect(a.collect)
    if not 0 < a.mem_fraction <= 1:
        raise EvalError(f"--mem-fraction: {a.mem_fraction} must be in (0, 1]")
    MEM_FRACTION = a.mem_fraction
    DECODE_BACKEND = a.decode_backend
    return evaluate(a)


if __name__ == "__main__":
    try:
        main()
    except EvalError as e:
        print(f"needle_eval: error: {e}", file=sys.stderr)
        sys.exit(2)
