"""Retrieval documents of passkey and multi-key needles: over real text (``pysource``), or over the
synthetic filler of :mod:`nsa_flex.data.passkey` (``[training] passkey_keys`` > 1).

Document g (seeded by the corpus seed, the split and g) is either a passkey document
(:meth:`PasskeyCorpus.build`) or, with probability ``multikey_share``, a multi-key document
(:func:`multikey_document`: ``n_keys`` needles naming different people, the question asks for one),
both of exactly ``length`` tokens. Their haystack is a stretch of real text of the same split (the
filler of document g starts at a text drawn by g and goes on through the next texts until it is
long enough) or, with ``synthetic`` set, a synthetic filler of that kind. ``questions`` = q > 1 asks
q times (``[training] passkey_questions``): q - 1 extra question + answer pairs after the needles.
A multi-key document's questions name different people while names remain: an answer's nearest
earlier copy of its key is then its own needle, at any distance, where in a single-key document
every answer after the first copies the previous answer, which lies near (with 8 questions at
2048 tokens, 97% of the answers within 512 tokens of an earlier copy: a sliding window learns
them all). The interface is PasskeyCorpus's (``length``, ``seed``, ``document(g)``), so
PackedTokenDataset mixes either.
"""

import random
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import DatasetError
from .passkey import MULTIKEY_NAMES, PasskeyCorpus, check_filler, cue_free, multikey_document, synthetic_filler


@dataclass(eq=False)
class RetrievalCorpus:
    """Passkey and multi-key documents of ``length`` tokens over real-text or synthetic filler.

    ``texts(i, max_chars)``: the text of unit i (at least its first ``max_chars`` characters),
    ``n_texts`` units; or ``texts`` None and ``synthetic`` a synthetic filler kind
    (:data:`nsa_flex.data.passkey.SYNTHETIC_FILLERS`)."""

    tokenizer: Any
    length: int
    texts: Callable[[int, int], str] | None
    n_texts: int
    seed: int = 0
    split: str = "train"
    multikey_share: float = 0.5
    n_keys: int = 4
    questions: int = 1
    synthetic: str | None = None
    min_gap: int = 0  # single-key documents: PasskeyCorpus's min_gap and min_gap_share
    min_gap_share: float = 1.0
    passkey: PasskeyCorpus = field(init=False, repr=False)

    def __post_init__(self):
        if self.synthetic is not None:
            check_filler(self.synthetic)
        elif self.texts is None or self.n_texts < 1:
            raise DatasetError("retrieval documents need a filler: texts (and n_texts >= 1) or a synthetic kind")
        self.passkey = PasskeyCorpus(self.tokenizer, self.length, seed=self.seed, split=self.split,
                                     questions=self.questions, min_gap=self.min_gap,
                                     min_gap_share=self.min_gap_share)
        if self.multikey_share > 0:  # the longest names must fit: fail now, not at the first multi-key document
            n, longest = self.n_keys, sorted(MULTIKEY_NAMES, key=len)[-self.n_keys:]
            extra = [(n - 1, 0.0)] * (self.questions - 1)
            multikey_document(self.tokenizer, self.length, longest, [99999] * n, [0.0] * n,
                              [0] * self.length, extra)

    def filler(self, rng: random.Random, n: int) -> list[int]:
        """At least ``n`` tokens of filler without the cue token: real text from a unit drawn by
        ``rng`` on, or the synthetic filler of a seed drawn by ``rng``."""
        if self.synthetic is not None:
            seed = f"retrieval:{self.split}:{self.seed}:{rng.getrandbits(64)}"
            return cue_free(synthetic_filler(self.tokenizer, n, seed, self.synthetic), self.passkey.cue)
        i, toks = rng.randrange(self.n_texts), []
        for _ in range(self.n_texts):
            need = n - len(toks)
            toks += cue_free(self.tokenizer.encode(self.texts(i, 4 * need + 256)[: 4 * need + 256]), self.passkey.cue)
            if len(toks) >= n:
                return toks
            i = (i + 1) % self.n_texts
        while len(toks) < n:  # the whole split is shorter than one document: repeat it
            toks += toks
        return toks

    def kind(self, g: int) -> str:
        return "multikey" if random.Random(f"retrieval-kind:{self.split}:{self.seed}:{g}").random() < \
            self.multikey_share else "passkey"

    def document(self, g: int) -> tuple[list[int], int, int]:
        """(tokens, answer_start, key) of document g; tokens[answer_start:-1] is the answer."""
        rng = random.Random(f"retrieval:{self.split}:{self.seed}:{g}")
        filler = self.filler(rng, self.length)
        if self.kind(g) == "passkey":
            key = rng.randint(10000, 99999)
            depth, extra = self.passkey.draw_layout(rng, key)
            toks, ans = self.passkey.build(key, depth, filler, extra_questions=extra)
            return toks, ans, key
        names = rng.sample(MULTIKEY_NAMES, self.n_keys)
        keys = rng.sample(range(10000, 100000), self.n_keys)
        depths = [rng.random() for _ in range(self.n_keys)]
        extra = [(i, rng.random()) for i in extra_names(rng, self.n_keys, self.questions - 1)]
        toks, ans = multikey_document(self.tokenizer, self.length, names, keys, depths, filler, extra)
        return toks, ans, keys[0]


def extra_names(rng: random.Random, n_keys: int, n: int) -> list[int]:
    """The names (indices) of a multi-key document's ``n`` extra questions: names 1 .. n_keys - 1
    in a random order, each once before any twice (name 0 is the final question's), then again."""
    out: list[int] = []
    while len(out) < n:
        cycle = list(range(1, n_keys)) or [0]
        rng.shuffle(cycle)
        out += cycle
    return out[:n]


def synthetic_retrieval(tokenizer, length: int, seed: int = 0, split: str = "train", questions: int = 1,
                        filler: str = "sentences", keys: int = 1, min_gap: int = 0, min_gap_share: float = 1.0):
    """The generated retrieval documents of ``[training] passkey_keys`` = ``keys``: single-key passkey
    documents (:class:`PasskeyCorpus`) for 1; for more, half of them multi-key documents with
    ``keys`` needles (a RetrievalCorpus over the synthetic ``filler``)."""
    if keys == 1:
        return PasskeyCorpus(tokenizer, length, seed=seed, split=split, questions=questions, filler=filler,
                             min_gap=min_gap, min_gap_share=min_gap_share)
    return RetrievalCorpus(tokenizer, length, None, 0, seed=seed, split=split, multikey_share=0.5,
                           n_keys=keys, questions=questions, synthetic=filler, min_gap=min_gap,
                           min_gap_share=min_gap_share)
