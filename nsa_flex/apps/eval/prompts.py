"""Needle prompts and their scoring: the training passkey document cut before the answer, multi-key
haystacks (synthetic or FineWeb filler), exact and per-digit scores. Used by `nsa_flex.apps.eval.needle`.
"""

import os
import random
import re

from nsa_flex.data.errors import DatasetError
from nsa_flex.data.passkey import (MULTI_NEEDLE, MULTI_QUESTION, MULTIKEY_NAMES, PASSKEY_ANSWER, PasskeyCorpus,  # noqa: F401
                                   cue_free, cue_id, multikey_document, synthetic_filler)

from .cli import EvalError
from .docs import PYSOURCE, read_texts

KINDS = ("passkey", "multikey")
NAMES = MULTIKEY_NAMES  # the prompts are the training documents (nsa_flex.data.passkey), cut before the answer


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
FILLERS = ("auto", "synthetic", "words", "far_words", "fineweb", "pysource")


class Filler:
    """Filler tokens, one haystack per trial (the same for every depth and length of a trial):
    ``synthetic`` (the training corpus's kind: a random passage of sentences repeated, unseen in
    training) or ``words`` / ``far_words`` (a random passage of pseudo-words repeated, as
    ``passkey_filler`` of that name) or
    ``fineweb`` (real text from the --fineweb file) or ``pysource`` (the validation split of the
    pysource corpus: source code of packages never trained on, for models trained on pysource)."""

    def __init__(self, kind: str, tok, path: str | None = None):
        self.kind, self.tok, self.path = kind, tok, path
        self._texts: list[str] | None = None
        self._cache: dict[int, list[int]] = {}

    @staticmethod
    def resolve(choice: str, path: str, text_trained: bool = True, code_trained: bool = False) -> str:
        """``auto``: pysource for a model trained on pysource (``code_trained``), else fineweb when
        the file exists and the model was trained on text (``text_trained``); a model trained on the
        passkey corpus alone has never seen real text, so its in-distribution haystack is the
        synthetic filler."""
        if choice not in FILLERS:
            raise EvalError(f"--filler: {choice!r} not in {list(FILLERS)}")
        if choice == "auto" and code_trained:
            return "pysource"
        if choice == "auto":
            return "fineweb" if text_trained and path and os.path.isfile(path) else "synthetic"
        if choice == "fineweb" and not (path and os.path.isfile(path)):
            raise EvalError(f"--filler fineweb: --fineweb {path!r} does not exist")
        return choice

    def tokens(self, n: int, trial: int) -> list[int]:
        if self.kind in ("synthetic", "words", "far_words"):  # the generated documents' filler
            got = self._cache.get(trial, [])  # one passage per trial
            if len(got) < n:
                got = self._cache[trial] = synthetic_filler(
                    self.tok, n, f"eval:{trial}", "sentences" if self.kind == "synthetic" else self.kind)
            return got
        got = self._cache.get(trial, [])
        if len(got) < n:
            if self._texts is None:
                self._texts = read_texts(PYSOURCE if self.kind == "pysource" else self.path, "text",
                                         "--filler pysource" if self.kind == "pysource" else "--fineweb")
            i = (trial * 37) % len(self._texts)
            start = i
            got, cue = [], cue_id(self.tok)
            while len(got) < n:  # without the cue token, as the documents' builders use it
                got += cue_free(self.tok.encode(self._texts[i] + "\n\n"), cue)
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
    rng = random.Random(f"needle:{seed}:{kind}:{length}:{depth}:{trial}")
    if kind == "passkey":
        key = rng.randint(10000, 99999)
        try:
            corpus = PasskeyCorpus(tok, length + 1)
        except DatasetError as e:
            raise EvalError(f"--lengths: {length} is too short for a passkey prompt ({e})") from None
        toks, ans = corpus.build(key, depth / 100.0, filler=filler.tokens(length + 1, trial))
        return {"tokens": toks[:ans], "expected": str(key), "answer_tokens": len(toks) - 1 - ans,
                "needle": key_positions(toks[:ans], tok, key)}
    if kind != "multikey":
        raise EvalError(f"--kinds: {kind!r} not in {list(KINDS)}")
    if not 2 <= n_keys <= len(NAMES):
        raise EvalError(f"--n-keys: {n_keys} is outside 2..{len(NAMES)}")
    names = rng.sample(NAMES, n_keys)
    keys = rng.sample(range(10000, 100000), n_keys)
    depths = [depth / 100.0] + [rng.random() for _ in range(n_keys - 1)]
    try:
        toks, ans = multikey_document(tok, length + 1, names, keys, depths, filler.tokens(length + 1, trial))
    except DatasetError as e:
        raise EvalError(f"--lengths: {length} is too short for a {n_keys}-key prompt ({e})") from None
    return {"tokens": toks[:ans], "expected": str(keys[0]), "answer_tokens": len(toks) - 1 - ans,
            "needle": key_positions(toks[:ans], tok, keys[0])}


def key_positions(tokens: list[int], tok, key: int) -> list[int]:
    """Positions in ``tokens`` of the key's tokens (as the answer spells it, " 12345"), every
    occurrence: where the needle states the key, the tokens a retrieval must read."""
    k = tok.encode(PASSKEY_ANSWER.format(key=key))[:-1]
    return [i + j for i in range(len(tokens) - len(k) + 1) if tokens[i:i + len(k)] == k
            for j in range(len(k))]


def score(text: str, expected: str) -> tuple[bool, str]:
    m = re.match(r"\s*(\d+)", text)
    got = m.group(1) if m else ""
    return got == expected, got


def digit_score(text: str, expected: str) -> float:
    """Partial credit: the fraction of the key's digits the answer has at the right place (a model
    that half-retrieves shows here before it gets exact matches; chance is ~0.1 per digit)."""
    _, got = score(text, expected)
    return sum(a == b for a, b in zip(got, expected)) / len(expected)
