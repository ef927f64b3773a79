"""Retrieval at every validation step: teacher-forced answer loss and exact answers on held-out
retrieval documents (``[validation] retrieval_docs``), so a run shows whether and when it learns
retrieval without waiting for the end-of-run evaluation.

The documents are the validation split of the training data's own retrieval documents at the
validation ``seq_len``: passkey documents (synthetic filler; with ``passkey_keys`` > 1 multi-key
documents too) for ``dataset = "passkey"`` or a ``passkey_mix`` of a text dataset, passkey and
multi-key needles in held-out source code for
``pysource``. Each asks once, at its end. Per kind the metrics are
``retrieval/<kind>_answer_loss`` (mean NLL of the answer's tokens, " 12345." with its space and
period), ``retrieval/<kind>_exact`` (share of documents whose every answer token is the argmax)
and ``retrieval/<kind>_digits`` (share of answer tokens that are the argmax); with ``far_from`` (the
model's sliding window), also ``retrieval/<kind>_exact_far`` and ``_exact_near``: exact answers of
the documents whose needle lies more / not more than ``far_from`` tokens before the answer (a model
whose window learned the copy alone answers only the near ones).

With ``[validation] retrieval_recall_docs`` (`selection_recall`), NSA's selection recall too:
``retrieval/<kind>_sel_recall``, over the documents whose needle lies beyond the window and outside
block 0 (picked whatever the scores), the share of (selecting layer, KV group) whose picks at the
question (the position predicting the answer's first token) hold a block of the needle; and
``retrieval/<kind>_sel_recall_best`` / ``_best_layer``, the highest recall of one selecting layer
and its index among them (a copy made in one layer needs that layer's picks alone). Read beside
``_exact_far``: misses with a high recall are the copy's, with a low one the selection's.
"""

import torch
import torch.nn.functional as F

from nsa_flex.data.errors import DatasetError
from nsa_flex.data.retrieval import synthetic_retrieval
from nsa_flex.data.pysource import pysource_retrieval
from nsa_flex.selection import QuestionPicks

from .data import passkey_mix_of

MAX_DOCS = 1024
KINDS = ("passkey", "multikey")
RECALL_BATCH = 4  # rows per eager forward of `selection_recall` (eager flex holds [B, H, T, T] scores)


def check_docs(n, field: str = "retrieval_docs") -> int:
    """``[validation] retrieval_docs`` / ``retrieval_recall_docs``: an int in [0, MAX_DOCS], else
    DatasetError naming the field."""
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_DOCS:
        raise DatasetError(f"validation.{field}={n!r}: must be an integer in [0, {MAX_DOCS}] (0 = off)")
    return n


def probe_corpus(job_config, tokenizer):
    """The validation split's retrieval documents of the training data at the validation seq_len,
    or None when the training data holds none (nothing to measure)."""
    training, seq_len = job_config.training, job_config.validation.seq_len
    seed = getattr(training, "dataset_seed", 0)
    dataset = training.dataset.lower()
    if dataset == "pysource":
        return pysource_retrieval(tokenizer, seq_len + 1, "validation", seed, training.dataset_path)
    if dataset == "passkey" or passkey_mix_of(training) > 0:
        return synthetic_retrieval(tokenizer, seq_len + 1, seed=seed, split="validation",
                                   filler=getattr(training, "passkey_filler", "sentences"),
                                   keys=getattr(training, "passkey_keys", 1))
    return None


def probe_documents(corpus, n: int) -> list[tuple[str, list[int], int]]:
    """(kind, tokens, answer_start) of the corpus's first ``n`` documents."""
    kind = getattr(corpus, "kind", lambda g: "passkey")
    return [(kind(g), *corpus.document(g)[:2]) for g in range(n)]


def needle_distance(toks: list[int], ans: int) -> int | None:
    """Tokens from the needle's key to the answer: ``ans`` minus the first position before ``ans``
    where the answer's key tokens (``toks[ans:-2]``, the answer without its period and EOS) occur;
    None if they occur nowhere before it."""
    key = toks[ans:len(toks) - 2]
    n = len(key)
    return next((ans - i for i in range(ans - n + 1) if toks[i:i + n] == key), None) if n else None


@torch.no_grad()
def score(logits_of, docs: list[tuple[str, list[int], int]], batch_size: int, device,
          far_from: int | None = None) -> dict[str, float]:
    """The metrics of ``docs`` under ``logits_of`` ((tokens [B, T], start) -> the logits of
    positions start .. T - 1, [B, T - start, V]; start is the batch's first position that predicts
    an answer token, so only the documents' ends are asked for), in batches of ``batch_size`` (the
    last one padded with its first document, so every call has one shape)."""
    sums = {k: [0.0, 0, 0, 0] for k in KINDS}  # nll, answer tokens, right tokens, exact documents
    docs_of = {k: 0 for k in KINDS}
    by_reach = {(k, far): [0, 0] for k in KINDS for far in (True, False)}  # documents, exact
    for i in range(0, len(docs), batch_size):
        batch = docs[i:i + batch_size]
        rows = [d[1][:-1] for d in batch]
        rows += [rows[0]] * (batch_size - len(rows))
        start = min(ans for _, _, ans in batch) - 1
        logits = logits_of(torch.tensor(rows, dtype=torch.long, device=device), start).float()
        for b, (kind, toks, ans) in enumerate(batch):
            target = torch.tensor(toks[ans:-1], device=logits.device)  # the answer, EOS excluded
            pred = logits[b, ans - 1 - start:len(toks) - 2 - start]  # position t predicts token t + 1
            right = pred.argmax(-1) == target
            s = sums[kind]
            s[0] += F.cross_entropy(pred, target, reduction="sum").item()
            s[1] += target.numel()
            s[2] += int(right.sum())
            s[3] += int(right.all())
            docs_of[kind] += 1
            dist = needle_distance(toks, ans) if far_from is not None else None
            if dist is not None:
                r = by_reach[kind, dist > far_from]
                r[0] += 1
                r[1] += int(right.all())
    out = {}
    for kind, (nll, n, good, exact) in sums.items():
        if docs_of[kind]:
            out[f"retrieval/{kind}_answer_loss"] = nll / n
            out[f"retrieval/{kind}_exact"] = exact / docs_of[kind]
            out[f"retrieval/{kind}_digits"] = good / n
        for far, name in ((True, "far"), (False, "near")):
            n_docs, n_exact = by_reach[kind, far]
            if n_docs:
                out[f"retrieval/{kind}_exact_{name}"] = n_exact / n_docs
    return out


@torch.no_grad()
def selection_recall(model, forward, docs: list[tuple[str, list[int], int]], far_from: int, n: int,
                     device) -> dict[str, float]:
    """``retrieval/<kind>_sel_recall`` of the first ``n`` documents of ``docs`` whose needle lies
    more than ``far_from`` tokens before the answer and outside the forced blocks; ``forward``
    (tokens [B, T] -> anything) runs ``model``, here eagerly (``force_eager``: torch.compile'd
    blocks run their Python, where the probe is), ``RECALL_BATCH`` rows at a time (the last batch
    padded with its first row). Empty without a selecting layer or such a document."""
    if not QuestionPicks(model, []).layers:
        return {}  # full attention, sliding window only: nothing selects
    far = []
    for kind, toks, ans in docs:
        dist = needle_distance(toks, ans)
        if dist is not None and dist > far_from:
            start = ans - dist
            far.append((kind, toks, ans, list(range(start, start + len(toks) - 2 - ans))))
    sums = {k: [0.0, 0] for k in KINDS}
    per_layer: dict[str, torch.Tensor] = {}  # kind -> recall summed per selecting layer
    for i in range(0, min(len(far), n), RECALL_BATCH):
        batch = far[i:min(i + RECALL_BATCH, n)]
        rows = [d[1][:-1] for d in batch]
        rows += [rows[0]] * (RECALL_BATCH - len(rows))
        ends = [d[2] for d in batch] + [batch[0][2]] * (RECALL_BATCH - len(batch))
        # position ans - 1 predicts the answer's first token; eager: compiled blocks traced no probe
        with QuestionPicks(model, ends) as picks, torch.compiler.set_stance("force_eager"):
            forward(torch.tensor(rows, dtype=torch.long, device=device))
        for b, (kind, _, _, needle) in enumerate(batch):
            rec = picks.recall(b, needle)
            if rec is None:
                return {}
            if not rec[1]:  # a forced block (block 0) is picked whatever the scores
                sums[kind][0] += rec[0]
                sums[kind][1] += 1
                per_layer[kind] = per_layer.get(kind, 0) + torch.tensor(rec[2], dtype=torch.float64)
    out = {}
    for k, (s, c) in sums.items():
        if c:
            best = per_layer[k] / c
            out |= {f"retrieval/{k}_sel_recall": s / c, f"retrieval/{k}_sel_recall_best": float(best.max()),
                    f"retrieval/{k}_sel_recall_best_layer": int(best.argmax())}
    return out


def summary(metrics: dict[str, float]) -> str:
    """One console line: "passkey loss 0.123 exact 94% (near 100%, far 90%)[ sel recall 0.71 (best
    layer 3 0.98)] | multikey ..."."""
    parts = []
    for k in KINDS:
        if f"retrieval/{k}_answer_loss" not in metrics:
            continue
        reach = [f"{name} {100 * metrics[f'retrieval/{k}_exact_{name}']:.0f}%" for name in ("near", "far")
                 if f"retrieval/{k}_exact_{name}" in metrics]
        rec = metrics.get(f"retrieval/{k}_sel_recall")
        best = metrics.get(f"retrieval/{k}_sel_recall_best")
        best = (f" (best layer {metrics[f'retrieval/{k}_sel_recall_best_layer']} {best:.2f})"
                if best is not None else "")
        parts.append(f"{k} loss {metrics[f'retrieval/{k}_answer_loss']:.3f} exact "
                     f"{100 * metrics[f'retrieval/{k}_exact']:.0f}%" + (f" ({', '.join(reach)})" if reach else "")
                     + (f" sel recall {rec:.2f}{best}" if rec is not None else ""))
    return " | ".join(parts)
