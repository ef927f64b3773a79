"""The passkey corpus: deterministic long-context retrieval documents of an exact length.

Document i (seeded by the corpus seed, the split and i) is exactly ``length`` tokens: [BOS] intro,
filler text with a needle "The pass key is: 12345. Remember it. The pass key is: 12345." at a random
depth in a filler passage that repeats (``synthetic_filler``: random sentences, or random pseudo-words
with ``filler="words"`` or ``"far_words"``; new in every document), then "What is the pass key? The pass key is: 12345." and EOS (the answer " 12345." with its
leading space, tokenized as in the needle); so every training sample is one document, for any sequence
length and tokenizer. ``questions`` = q > 1 asks the question q times: q - 1 extra question + answer
pairs replace filler at random points after the needle (more retrieval targets per document; the
evaluation asks once, at the end). :meth:`PasskeyCorpus.build` takes any filler (real text too).

Tokenizers are duck-typed: ``encode(text)``, ``eos_id`` and optionally ``bos_id``.
"""

import math
import random
from typing import Any, Iterator

from torch.utils.data import get_worker_info

from .errors import DatasetError

PASSKEY_INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about the important information there.\n"
)
# Synthetic filler: a passage of random sentences, different in every document, repeated until the
# document is full. A fixed filler (the classic "The grass is green. The sky is blue. ...") is
# memorized in the weights and teaches nothing about the context; a
# per-document passage repeated at a period of ~20 to ~600
# tokens can only be predicted by copying from earlier in the context -- the induction circuit that
# retrieval of the key needs, trained on most tokens instead of the key's few, and
# at distances inside and beyond the sliding window.
_NOUNS = ("grass", "sky", "sun", "river", "house", "garden", "road", "cloud", "tree", "stone", "bird",
          "field", "lake", "hill", "door", "lamp", "boat", "bridge", "forest", "window", "city", "cat")
_ADJS = ("green", "blue", "yellow", "quiet", "old", "small", "bright", "dark", "warm", "cold", "wide",
         "tall", "calm", "red", "soft", "long", "wet", "round", "empty", "busy", "still", "white")
_VERBS = ("walked to", "looked at", "painted", "found", "passed", "watched", "left", "crossed", "saw")
_NAMES = ("Anna", "Ben", "Clara", "David", "Ella", "Frank", "Grace", "Hugo", "Iris", "Jack", "Lena")


def _sentence(rng: random.Random) -> str:
    if rng.random() < 0.5:
        return f"The {rng.choice(_NOUNS)} is {rng.choice(_ADJS)}. "
    return f"{rng.choice(_NAMES)} {rng.choice(_VERBS)} the {rng.choice(_ADJS)} {rng.choice(_NOUNS)}. "


# Pseudo-words of 1..3 random syllables (70 syllables: ~350k words): a passage of them is nearly
# incompressible except by copying (a BPE tokenizer splits them into arbitrary pieces), so every
# repeated token rewards the induction circuit; the sentences' small vocabulary is mostly
# predictable from the grammar and the word lists, which leaves little for copying to win.
_CONSONANTS, _VOWELS = "bdfgklmnprstvz", "aeiou"


def _pseudo_word(rng: random.Random) -> str:
    return "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(rng.randint(1, 3)))


def _words_passage(rng: random.Random, n: int | None = None) -> str:
    """n pseudo-words (default 10..300, log-uniform), a full stop after every 4..12."""
    n = int(math.exp(rng.uniform(math.log(10), math.log(300)))) if n is None else n
    out, left = [], rng.randint(4, 12)
    for _ in range(n):
        out.append(_pseudo_word(rng))
        left -= 1
        if left == 0:
            out[-1] += "."
            left = rng.randint(4, 12)
    return " ".join(out).rstrip(".") + ". "


# [training] passkey_filler: the kind of passage the generated documents repeat
SYNTHETIC_FILLERS = ("sentences", "words", "far_words")
# far_words: the shortest passage in tokens (the longest is half the document)
_FAR_MIN_TOKENS = 16


def check_filler(kind) -> str:
    """``[training] passkey_filler``: one of SYNTHETIC_FILLERS, else DatasetError."""
    if kind not in SYNTHETIC_FILLERS:
        raise DatasetError(f"training.passkey_filler={kind!r}: must be one of {', '.join(SYNTHETIC_FILLERS)}")
    return kind


def synthetic_filler(tokenizer, n: int, seed: str, kind: str = "sentences") -> list[int]:
    """At least ``n`` filler tokens for ``seed``: a passage repeated, tokenized at once.
    ``kind`` "sentences": 3..100 random sentences (log-uniform) of a small vocabulary; "words":
    10..300 random pseudo-words (log-uniform: with gpt2 a median of ~120 tokens, 93% under 512, so
    a 512-token sliding window sees almost every repeat); "far_words": pseudo-words whose passage
    is uniform in 16 .. n / 2 tokens, so repeats lie at every distance up to half the document
    (beyond the window too: the copy the selected and compressed branches must learn).
    Deterministic in (seed, kind, tokenizer)."""
    check_filler(kind)
    rng = random.Random(f"filler:{seed}" if kind == "sentences" else f"filler:{kind}:{seed}")
    if kind == "words":
        unit = _words_passage(rng)
    elif kind == "far_words":
        target = rng.randint(_FAR_MIN_TOKENS, max(_FAR_MIN_TOKENS, n // 2))
        per_word = len(tokenizer.encode(_words_passage(random.Random(0), 64))) / 64  # tokens a word
        unit = _words_passage(rng, max(2, round(target / per_word)))
    else:
        unit = "".join(_sentence(rng) for _ in range(int(math.exp(rng.uniform(math.log(3), math.log(100))))))
    reps, got = 1, tokenizer.encode(unit)
    while len(got) < n:
        reps *= 2
        got = tokenizer.encode(unit * reps)
    return got


# The key follows the cue ":" and nothing else in a document has that token: "is" alone occurs
# three times per filler sentence, so retrieving after "... is" needs a two-token match, and small
# models trained from scratch learn no copy at all; after ":" it is a one-token
# match (an induction head). Real filler (source code, prose) has the cue token too, so every
# document builder removes it from its filler (:func:`cue_free`). The needle states the key twice,
# the second a short-range copy of the same pattern.
PASSKEY_NEEDLE = " The pass key is: {key}. Remember it. The pass key is: {key}. "
# The space before the key belongs to the answer, as in the needle (": {key}."): with a BPE
# tokenizer (gpt2) the answer's key tokens are then exactly the needle's (" 60", "494"), so the
# answer is a plain copy; ": " + "60494." gave different tokens ("60", "494" after a lone " ";
# a 1-in-4 different digit split too) and no copy to learn.
PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is:"
PASSKEY_ANSWER = " {key}."


MAX_QUESTIONS = 16


def cue_id(tokenizer) -> int:
    """The token right before the key in the needle and at the end of the question (":" for the
    byte and the gpt2 tokenizers): the one-token match that retrieval copies after."""
    needle = tokenizer.encode(PASSKEY_NEEDLE.format(key=12345))
    key = tokenizer.encode(PASSKEY_ANSWER.format(key=12345))[:-1]  # " 12345" without the "."
    at = next((i for i in range(1, len(needle)) if needle[i:i + len(key)] == key), None)
    cue = None if at is None else needle[at - 1]
    if cue is None or tokenizer.encode(PASSKEY_QUESTION)[-1] != cue:
        raise DatasetError("passkey: this tokenizer splits the question's cue from the needle's differently")
    return cue


def cue_free(filler: list[int], cue: int) -> list[int]:
    """``filler`` without the cue token, so that the needles and questions hold the only cues."""
    return [t for t in filler if t != cue]


def check_keys(keys) -> int:
    """``[training] passkey_keys``: an int in [1, len(MULTIKEY_NAMES)], else DatasetError."""
    if isinstance(keys, bool) or not isinstance(keys, int) or not 1 <= keys <= len(MULTIKEY_NAMES):
        raise DatasetError(f"training.passkey_keys={keys!r}: must be an integer in [1, {len(MULTIKEY_NAMES)}]")
    return keys


def check_questions(questions) -> int:
    """``[training] passkey_questions``: an int in [1, MAX_QUESTIONS], else DatasetError."""
    if isinstance(questions, bool) or not isinstance(questions, int) or not 1 <= questions <= MAX_QUESTIONS:
        raise DatasetError(f"training.passkey_questions={questions!r}: must be an integer in [1, {MAX_QUESTIONS}]")
    return questions


def check_min_gap(gap) -> int:
    """``[training] passkey_min_gap``: an int >= 0, else DatasetError."""
    if isinstance(gap, bool) or not isinstance(gap, int) or gap < 0:
        raise DatasetError(f"training.passkey_min_gap={gap!r}: must be an integer >= 0 (0: answers anywhere)")
    return gap


def check_min_gap_share(share) -> float:
    """``[training] passkey_min_gap_share``: a number in [0, 1], else DatasetError."""
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
        raise DatasetError(f"training.passkey_min_gap_share={share!r}: must be a number in [0, 1] (the share of "
                           "single-key training documents laid out with passkey_min_gap)")
    return float(share)


class PasskeyCorpus:
    """Deterministic passkey documents of exactly ``length`` tokens (``length = seq_len + 1``).
    ``min_gap`` > 0: every answer lies at least that many filler tokens after the copy of its key
    before it (the needle, or the previous question's answer), in a ``min_gap_share`` of the
    documents (the others: answers anywhere): :meth:`draw_layout`."""

    def __init__(self, tokenizer, length: int, seed: int = 0, split: str = "train",
                 questions: int = 1, filler: str = "sentences", min_gap: int = 0, min_gap_share: float = 1.0):
        check_questions(questions)
        self.filler = check_filler(filler)
        self.min_gap = check_min_gap(min_gap)
        self.min_gap_share = check_min_gap_share(min_gap_share)
        self.tok = tokenizer
        self.length = length
        self.seed = seed
        self.split = split
        self.questions = questions
        self._intro = tokenizer.encode(PASSKEY_INTRO)
        self._question = tokenizer.encode(PASSKEY_QUESTION)
        self._bos = [tokenizer.bos_id] if getattr(tokenizer, "bos_id", None) is not None else []
        self._eos = [tokenizer.eos_id]
        self.cue = cue_id(tokenizer)
        # the longest needle/answer (5-digit keys) must fit, with at least some filler
        probe = self._parts(99999)
        fixed = (len(self._bos) + len(probe[0]) + questions * (len(probe[1]) + len(self._question))
                 + len(self._eos))
        if fixed + 8 > length:
            raise DatasetError(
                f"passkey: seq_len={length - 1} is too short for a passkey document with "
                f"passkey_questions={questions} (needs seq_len >= {fixed + 7} with this tokenizer)"
            )
        # the gaps must fit the filler of the longest key, with a few tokens to spare for keys that
        # tokenize longer
        room = self._head_fill(99999, questions - 1)[1] - 4
        if min_gap and room < questions * min_gap:
            need = length - 1 - room + questions * min_gap
            raise DatasetError(
                f"training.passkey_min_gap={min_gap} with passkey_questions={questions}: {questions} gaps of "
                f"{min_gap} tokens do not fit seq_len={length - 1} (needs seq_len >= {need}, or fewer "
                "questions, or a smaller gap)")

    def _parts(self, key: int) -> tuple[list[int], list[int]]:
        return (self.tok.encode(PASSKEY_NEEDLE.format(key=key)), self.tok.encode(PASSKEY_ANSWER.format(key=key)))

    def _head_fill(self, key: int, n_extra: int) -> tuple[list[int], int]:
        """(head, filler tokens) of a document with ``key`` and ``n_extra`` extra questions."""
        needle, answer = self._parts(key)
        qa = len(self._question) + len(answer)
        fixed = len(needle) + qa + len(self._eos) + qa * n_extra
        head = self._bos + self._intro
        if self.length - len(head) - fixed < 8:  # drop the intro when the sequence is short
            head = list(self._bos)
        return head, self.length - len(head) - fixed

    def draw_layout(self, rng: random.Random, key: int) -> tuple[float, list[float]]:
        """(depth, extra_questions) for :meth:`build`, drawn from ``rng``: uniform (the needle's
        depth, each extra question's fraction of the filler after the needle); with ``min_gap`` the
        needle and the questions in filler positions p_0 < p_1 < ... < p_q = the end (the last
        question) with every p_(i+1) - p_i >= min_gap, uniform among such layouts; that in a
        ``min_gap_share`` of the documents, drawn from ``rng`` (a share of 0 or 1 draws nothing for
        it: the documents of no gap or of every document gapped)."""
        share = self.min_gap_share
        gapped = self.min_gap and share > 0 and (share >= 1 or rng.random() < share)
        if not gapped:
            return rng.random(), [rng.random() for _ in range(self.questions - 1)]
        n_fill, q, gap = self._head_fill(key, self.questions - 1)[1], self.questions, self.min_gap
        slack = n_fill - q * gap
        if slack < 0:
            raise DatasetError(f"training.passkey_min_gap={gap}: key {key} leaves {n_fill} filler tokens, "
                               f"{q} gaps need {q * gap}")
        at = [int(u) + i * gap for i, u in enumerate(sorted(rng.uniform(0, slack) for _ in range(q)))]
        # build() maps depth d to the cut min(int(d * (n_fill + 1)), n_fill) and an extra question's
        # fraction f to min(int(f * (n_fill - cut + 1)), n_fill - cut) after it: the centres give at
        depth = (at[0] + 0.5) / (n_fill + 1)
        return depth, [(p - at[0] + 0.5) / (n_fill - at[0] + 1) for p in at[1:]]

    def document(self, index: int) -> tuple[list[int], int, int]:
        """(tokens, answer_start, key) of document ``index``; tokens[answer_start:-1] is the answer
        (" 12345.", the space included)."""
        rng = random.Random(f"passkey:{self.split}:{self.seed}:{index}")
        key = rng.randint(10000, 99999)
        depth, extra = self.draw_layout(rng, key)
        filler = synthetic_filler(self.tok, self.length, f"{self.split}:{self.seed}:{index}", self.filler)
        toks, answer_start = self.build(key, depth, filler, extra_questions=extra)
        return toks, answer_start, key

    def build(self, key: int, depth: float, filler: list[int] | None = None,
              extra_questions: list[float] = ()) -> tuple[list[int], int]:
        """(tokens, answer_start) of the document with pass key ``key`` whose needle sits at
        ``depth`` (0..1) of the filler; ``filler``: token ids, at least ``length`` of them (default:
        ``synthetic_filler`` of seed "build"; documents use their own seed, the needle-in-a-haystack
        evaluation passes one per trial, or real text).
        ``extra_questions`` (each in [0, 1)): one more question + answer per value, placed at that
        fraction of the filler that follows the needle (training documents, passkey_questions)."""
        filler = cue_free(synthetic_filler(self.tok, self.length, "build") if filler is None else filler, self.cue)
        needle, answer = self._parts(key)
        qa = self._question + answer
        tail = qa + self._eos
        head, n_fill = self._head_fill(key, len(extra_questions))
        if len(filler) < n_fill:
            raise DatasetError(f"passkey: filler of {len(filler)} tokens, the document needs {n_fill}")
        # n_fill + 1 insertion points, from right after the head (depth 0) to right before the
        # question (depth 1: the evaluation's 100%); a uniform depth in [0, 1) draws each alike
        # (int(depth * n_fill) never put the needle next to the question in training)
        cut = min(int(depth * (n_fill + 1)), n_fill)
        after = filler[cut:n_fill]
        for f in sorted(extra_questions, reverse=True):  # from the back: earlier cuts stay valid
            at = min(int(f * (n_fill - cut + 1)), n_fill - cut)
            after = after[:at] + qa + after[at:]
        toks = head + filler[:cut] + needle + after + tail
        assert len(toks) == self.length, (len(toks), self.length)
        return toks, self.length - len(answer) - len(self._eos)


# Multi-key documents: n_keys needles naming different people, the question asks for one of them
# (the needle evaluation's multikey prompts are these documents cut before the answer).
MULTIKEY_NAMES = ("Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry", "Irene", "Jack",
                  "Karen", "Louis", "Maria", "Nora", "Oscar", "Peter")
MULTI_NEEDLE = " The pass key of {name} is: {key}. Remember it. The pass key of {name} is: {key}. "
MULTI_QUESTION = "\nWhat is the pass key of {name}? The pass key of {name} is:"  # + PASSKEY_ANSWER


def multikey_document(tokenizer, length: int, names: list[str], keys: list[int], depths: list[float],
                      filler: list[int], extra_questions: list[tuple[int, float]] = ()) -> tuple[list[int], int]:
    """(tokens, answer_start) of a document of exactly ``length`` tokens: [BOS] intro, ``filler``
    with needle i (``names[i]``, ``keys[i]``) inserted at ``depths[i]`` (0..1) of it, the question
    for ``names[0]`` and its answer " {keys[0]}." and EOS; tokens[answer_start:-1] is the answer.
    ``extra_questions`` ((i, f) each): one more question + answer for ``names[i]`` at fraction f of
    the filler that follows the last needle (training documents, passkey_questions).
    The intro is dropped when the sequence is short; DatasetError when even that does not fit."""
    filler = cue_free(filler, cue_id(tokenizer))
    needles = [tokenizer.encode(MULTI_NEEDLE.format(name=n, key=k)) for n, k in zip(names, keys)]
    qas = [tokenizer.encode(MULTI_QUESTION.format(name=n)) + tokenizer.encode(PASSKEY_ANSWER.format(key=k))
           for n, k in zip(names, keys)]
    question = tokenizer.encode(MULTI_QUESTION.format(name=names[0]))
    answer = tokenizer.encode(PASSKEY_ANSWER.format(key=keys[0]))
    bos = [tokenizer.bos_id] if getattr(tokenizer, "bos_id", None) is not None else []
    head = bos + tokenizer.encode(PASSKEY_INTRO)
    fixed = (len(question) + len(answer) + 1 + sum(map(len, needles))
             + sum(len(qas[i]) for i, _ in extra_questions))
    n_fill = length - len(head) - fixed
    if n_fill < 8:
        head = list(bos)
        n_fill = length - len(head) - fixed
    if n_fill < 8:
        raise DatasetError(f"multi-key: seq_len={length - 1} is too short for a {len(names)}-key document "
                           f"with {1 + len(extra_questions)} question(s) (needs seq_len >= "
                           f"{len(head) + fixed + 7} with this tokenizer)")
    if len(filler) < n_fill:
        raise DatasetError(f"multi-key: filler of {len(filler)} tokens, the document needs {n_fill}")
    at = [min(int(d * (n_fill + 1)), n_fill) for d in depths]  # insertion points, as PasskeyCorpus.build
    body, prev = [], 0
    for i in sorted(range(len(names)), key=lambda i: (at[i], i)):
        body += filler[prev:at[i]] + needles[i]
        prev = at[i]
    after = filler[prev:n_fill]
    n_after = len(after)
    for i, f in sorted(extra_questions, key=lambda e: -e[1]):  # from the back: earlier cuts stay valid
        cut = min(int(f * (n_after + 1)), n_after)
        after = after[:cut] + qas[i] + after[cut:]
    toks = head + body + after + question + answer + [tokenizer.eos_id]
    assert len(toks) == length, (len(toks), length)
    return toks, length - len(answer) - 1


def passkey_document(tokenizer, seq_len: int, index: int, seed: int = 0, split: str = "train",
                     questions: int = 1):
    """Document ``index`` of the passkey corpus for ``seq_len``: (tokens [seq_len+1], answer_start, key)."""
    return PasskeyCorpus(tokenizer, seq_len + 1, seed, split, questions).document(index)


class PasskeySource:
    """Stateful stream of passkey documents (token lists) of one data-parallel shard.

    Rank r of W (and DataLoader worker w of n) reads documents ``j * W * n + r * n + w`` for
    j = 0, 1, ...: the ranks' documents are disjoint and their union is the 1-rank stream.
    State = j, the number of documents this shard has read."""

    def __init__(self, corpus: PasskeyCorpus):
        self.corpus = corpus
        self.doc_idx = 0
        self.rank, self.world = 0, 1

    def shard(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def __iter__(self) -> Iterator[list[int]]:
        info = get_worker_info()
        n_workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        stride, offset = self.world * n_workers, self.rank * n_workers + worker
        while True:
            toks, _, _ = self.corpus.document(self.doc_idx * stride + offset)
            self.doc_idx += 1
            yield toks

    def next_epoch(self) -> None:  # infinite already
        pass

    def restart(self) -> None:
        self.doc_idx = 0

    def state_dict(self) -> dict[str, Any]:
        return {"doc_idx": self.doc_idx}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if "doc_idx" not in sd:
            raise DatasetError(f"the checkpoint's data state {sorted(sd)} is not that of {self.describe()}: "
                               "it was saved with another dataset")
        self.doc_idx = int(sd["doc_idx"])

    def describe(self) -> str:
        return f"passkey(seed={self.corpus.seed}, split={self.corpus.split})"
