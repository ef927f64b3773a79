"""Retrieval documents with real-text filler, to mix into a text corpus (``[training] passkey_mix``).

Document g (seeded by the corpus seed, the split and g) is either a passkey document
(:meth:`PasskeyCorpus.build`) or, with probability ``multikey_share``, a multi-key document
(:func:`multikey_document`: ``n_keys`` needles naming different people, the question asks for one),
both of exactly ``length`` tokens, their haystack a stretch of real text of the same split: the
filler of document g starts at a text drawn by g and goes on through the next texts until it is
long enough. ``questions`` = q > 1 asks q times (``[training] passkey_questions``): q - 1 extra
question + answer pairs after the needles (a multi-key document asks for random ones of its names). The interface is PasskeyCorpus's (``length``, ``seed``, ``document(g)``), so
PackedTokenDataset mixes either.
"""

import random
from dataclasses import dataclass, field
from typing import Any, Callable

from .passkey import MULTIKEY_NAMES, PasskeyCorpus, cue_free, multikey_document


@dataclass(eq=False)
class RetrievalCorpus:
    """Passkey and multi-key documents of ``length`` tokens over real-text filler.

    ``texts(i, max_chars)``: the text of unit i (at least its first ``max_chars`` characters),
    ``n_texts`` units."""

    tokenizer: Any
    length: int
    texts: Callable[[int, int], str]
    n_texts: int
    seed: int = 0
    split: str = "train"
    multikey_share: float = 0.5
    n_keys: int = 4
    questions: int = 1
    passkey: PasskeyCorpus = field(init=False, repr=False)

    def __post_init__(self):
        self.passkey = PasskeyCorpus(self.tokenizer, self.length, seed=self.seed, split=self.split,
                                     questions=self.questions)
        if self.multikey_share > 0:  # the longest names must fit: fail now, not at the first multi-key document
            n, longest = self.n_keys, sorted(MULTIKEY_NAMES, key=len)[-self.n_keys:]
            extra = [(n - 1, 0.0)] * (self.questions - 1)
            multikey_document(self.tokenizer, self.length, longest, [99999] * n, [0.0] * n,
                              [0] * self.length, extra)

    def filler(self, rng: random.Random, n: int) -> list[int]:
        """At least ``n`` tokens of real text without the cue token, from a unit drawn by ``rng`` on."""
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
            depth = rng.random()
            extra = [rng.random() for _ in range(self.questions - 1)]
            toks, ans = self.passkey.build(key, depth, filler, extra_questions=extra)
            return toks, ans, key
        names = rng.sample(MULTIKEY_NAMES, self.n_keys)
        keys = rng.sample(range(10000, 100000), self.n_keys)
        depths = [rng.random() for _ in range(self.n_keys)]
        extra = [(rng.randrange(self.n_keys), rng.random()) for _ in range(self.questions - 1)]
        toks, ans = multikey_document(self.tokenizer, self.length, names, keys, depths, filler, extra)
        return toks, ans, keys[0]
