"""Held-out text documents for the evaluations: one reader for parquet / jsonl / txt files (a
column of strings; a .txt file is one document) and the sequences built from them."""

import json
import os

from nsa_flex.data.errors import DatasetError
from nsa_flex.data.pysource import pysource_texts

from .cli import EvalError

FORMATS = (".parquet", ".jsonl", ".json", ".txt")
PYSOURCE = "pysource"  # --docs / filler name: the validation split of the pysource corpus, not a file


def read_texts(path: str, column: str = "text", flag: str = "--docs") -> list[str]:
    """The non-empty strings of ``column`` in a parquet / jsonl file, in file order (a .txt file:
    its whole text); ``pysource``: the documents of the pysource corpus's validation split (packages
    never trained on). Errors name ``flag``, the path and what is wrong."""
    if path == PYSOURCE:
        try:
            return pysource_texts("validation")
        except DatasetError as e:
            raise EvalError(f"{flag} pysource: {e}") from None
    if not path or not os.path.isfile(path):
        raise EvalError(f"{flag} {path!r}: no such file")
    ext = os.path.splitext(path)[1].lower()
    if ext not in FORMATS:
        raise EvalError(f"{flag} {path!r}: unknown format {ext!r}; allowed {list(FORMATS)}")
    try:
        if ext == ".txt":
            texts = [open(path, encoding="utf-8").read()]
        elif ext == ".parquet":
            import pyarrow.parquet as pq

            texts = pq.read_table(path, columns=[column]).column(column).to_pylist()
        else:
            texts = []
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        rec = json.loads(line)
                        if column not in rec:
                            raise KeyError(f"line {n} has no {column!r} field")
                        texts.append(rec[column])
    except EvalError:
        raise
    except Exception as e:  # corrupt file, missing column: one line naming the file
        raise EvalError(f"{flag} {path!r}: cannot read a {column!r} column of strings: "
                        f"{type(e).__name__}: {e}") from None
    texts = [t for t in texts if isinstance(t, str) and t]
    if not texts:
        raise EvalError(f"{flag} {path!r}: no non-empty {column!r} strings")
    return texts


def token_sequences(texts: list[str], tok, seq_len: int, max_seqs: int, join: bool,
                    flag: str = "--docs") -> list[list[int]]:
    """Up to ``max_seqs`` sequences of exactly ``seq_len`` tokens. join=False: each document that
    has at least seq_len tokens (BOS first when the tokenizer has one), cut to seq_len, so every
    position of every sequence is a real distance into one document. join=True: the documents in
    file order, each followed by EOS, concatenated and cut into consecutive seq_len pieces."""
    bos = [tok.bos_id] if getattr(tok, "bos_id", None) is not None else []
    out: list[list[int]] = []
    if not join:
        longest = 0
        for t in texts:
            ids = bos + tok.encode(t)
            longest = max(longest, len(ids))
            if len(ids) >= seq_len:
                out.append(ids[:seq_len])
                if len(out) == max_seqs:
                    break
        if not out:
            raise EvalError(f"{flag}: no document has {seq_len} tokens (the longest has {longest}); "
                            "use a corpus of longer documents, a shorter --seq-len, or --join")
        return out
    buf: list[int] = []
    for t in texts:
        buf += bos + tok.encode(t) + [tok.eos_id]
        while len(buf) >= seq_len and len(out) < max_seqs:
            out.append(buf[:seq_len])
            buf = buf[seq_len:]
        if len(out) == max_seqs:
            break
    if not out:
        raise EvalError(f"{flag}: all documents together have {len(buf)} tokens, fewer than "
                        f"--seq-len {seq_len}")
    return out
