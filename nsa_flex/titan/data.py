"""Datasets for nsa_flex training: ``passkey`` (generated), ``fineweb_edu`` (HF streaming) and local files.

Chosen by ``[training] dataset`` / ``dataset_path`` (and ``[validation]`` likewise):

  * ``passkey`` (default, built in, no files): a deterministic long-context retrieval corpus. Document i
    (seeded by ``dataset_seed`` and i) is exactly ``seq_len + 1`` tokens: [BOS] intro, filler text with a
    needle "The pass key is: 12345. Remember it. The pass key is: 12345." at a random depth in a
    filler passage of random sentences that repeats (``synthetic_filler``, new in every document), then
    "What is the pass key? The pass key is: 12345." and EOS (the answer " 12345." with its
    leading space, tokenized as in the needle); so every training sample is one document,
    for any sequence length and tokenizer. :func:`passkey_document` returns one with its answer span.
    ``[training] passkey_questions`` = q > 1 asks the question q times in training documents: q - 1
    extra question + answer pairs replace filler at random points after the needle (more retrieval
    targets per document; the evaluation asks once, at the end).
  * ``fineweb_edu``: HuggingFaceFW/fineweb-edu, streaming, config ``[training] dataset_config``
    (default sample-10BT). With ``dataset_path`` set, that local file / folder / glob (or hub id) is
    read instead -- the offline way, e.g. ``--training.dataset_path ../shared/data/fineweb_sample_2800.parquet``.
  * ``passkey_mix`` (``[training]``, 0..1): with a text dataset, that fraction of the packed training
    sequences are passkey documents instead (chosen per sequence index, see PackedTokenDataset).
  * ``local``: ``dataset_path`` is required: a ``.parquet`` / ``.jsonl`` / ``.json`` / ``.txt`` file, a folder
    of such files, or a glob; read with ``datasets`` (streaming). Column ``[training] dataset_text_column``
    (default ``text``); ``.txt`` files yield one document per paragraph.

Documents are tokenized with EOS (and BOS where the tokenizer has one) and packed into samples of
``seq_len + 1`` tokens (input = first seq_len, labels = last seq_len), as torchtitan does.

Data-parallel sharding is per packed sequence: every rank reads and tokenizes the same stream and
keeps sequences ``k`` with ``k % dp_world_size == dp_rank``. So one global batch holds the same
sequences whatever the DP degree (a 2-GPU run sees the same data per step as a 1-GPU run with twice
the local batch).

The dataset is ``Stateful``: the token buffer, the sequence counter and the source position (HF
``IterableDataset.state_dict`` or the passkey document index) go into torchtitan's checkpoint, so a
resumed run continues the stream where it stopped, without repeats.
"""

import glob
import json
import math
import os
import random
from dataclasses import asdict
from typing import Any, Iterator

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset, get_worker_info

from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.tools.logging import logger

from nsa_flex.config import UserError

DATASET_CHOICES = ("passkey", "fineweb_edu", "local")
FINEWEB_EDU_REPO = "HuggingFaceFW/fineweb-edu"
LOCAL_FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".txt": "text"}


class DatasetError(UserError, ValueError):
    """Unknown dataset name, missing path, unreadable or corrupt data file (named in the message)."""


# ----------------------------------------------------------------------------- passkey corpus
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


def synthetic_filler(tokenizer: BaseTokenizer, n: int, seed: str) -> list[int]:
    """At least ``n`` filler tokens for ``seed``: a passage of 3..100 random sentences (log-uniform),
    repeated, tokenized at once. Deterministic in (seed, tokenizer)."""
    rng = random.Random(f"filler:{seed}")
    unit = "".join(_sentence(rng) for _ in range(int(math.exp(rng.uniform(math.log(3), math.log(100))))))
    reps, got = 1, tokenizer.encode(unit)
    while len(got) < n:
        reps *= 2
        got = tokenizer.encode(unit * reps)
    return got


# The key follows the cue ":" which nothing else in a synthetic document has: "is" alone occurs
# three times per filler sentence, so retrieving after "... is" needs a two-token match, and small
# models trained from scratch learn no copy at all; after ":" it is a one-token
# match (an induction head). The needle states the key twice, the second a short-range copy of the
# same pattern.
PASSKEY_NEEDLE = " The pass key is: {key}. Remember it. The pass key is: {key}. "
# The space before the key belongs to the answer, as in the needle (": {key}."): with a BPE
# tokenizer (gpt2) the answer's key tokens are then exactly the needle's (" 60", "494"), so the
# answer is a plain copy; ": " + "60494." gave different tokens ("60", "494" after a lone " ";
# a 1-in-4 different digit split too) and no copy to learn.
PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is:"
PASSKEY_ANSWER = " {key}."


MAX_QUESTIONS = 16


def check_questions(questions) -> int:
    """``[training] passkey_questions``: an int in [1, MAX_QUESTIONS], else DatasetError."""
    if isinstance(questions, bool) or not isinstance(questions, int) or not 1 <= questions <= MAX_QUESTIONS:
        raise DatasetError(f"training.passkey_questions={questions!r}: must be an integer in [1, {MAX_QUESTIONS}]")
    return questions


class PasskeyCorpus:
    """Deterministic passkey documents of exactly ``length`` tokens (``length = seq_len + 1``)."""

    def __init__(self, tokenizer: BaseTokenizer, length: int, seed: int = 0, split: str = "train",
                 questions: int = 1):
        check_questions(questions)
        self.tok = tokenizer
        self.length = length
        self.seed = seed
        self.split = split
        self.questions = questions
        self._intro = tokenizer.encode(PASSKEY_INTRO)
        self._question = tokenizer.encode(PASSKEY_QUESTION)
        self._bos = [tokenizer.bos_id] if getattr(tokenizer, "bos_id", None) is not None else []
        self._eos = [tokenizer.eos_id]
        # the longest needle/answer (5-digit keys) must fit, with at least some filler
        probe = self._parts(99999)
        fixed = (len(self._bos) + len(probe[0]) + questions * (len(probe[1]) + len(self._question))
                 + len(self._eos))
        if fixed + 8 > length:
            raise DatasetError(
                f"passkey: seq_len={length - 1} is too short for a passkey document with "
                f"passkey_questions={questions} (needs seq_len >= {fixed + 7} with this tokenizer)"
            )

    def _parts(self, key: int) -> tuple[list[int], list[int]]:
        return (self.tok.encode(PASSKEY_NEEDLE.format(key=key)), self.tok.encode(PASSKEY_ANSWER.format(key=key)))

    def document(self, index: int) -> tuple[list[int], int, int]:
        """(tokens, answer_start, key) of document ``index``; tokens[answer_start:-1] is the answer
        (" 12345.", the space included)."""
        rng = random.Random(f"passkey:{self.split}:{self.seed}:{index}")
        key = rng.randint(10000, 99999)
        depth = rng.random()
        extra = [rng.random() for _ in range(self.questions - 1)]
        filler = synthetic_filler(self.tok, self.length, f"{self.split}:{self.seed}:{index}")
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
        filler = synthetic_filler(self.tok, self.length, "build") if filler is None else filler
        needle, answer = self._parts(key)
        qa = self._question + answer
        head = self._bos + self._intro
        tail = qa + self._eos
        fixed = len(needle) + len(tail) + len(qa) * len(extra_questions)
        n_fill = self.length - len(head) - fixed
        if n_fill < 8:  # drop the intro when the sequence is short
            head = list(self._bos)
            n_fill = self.length - len(head) - fixed
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


def passkey_document(tokenizer: BaseTokenizer, seq_len: int, index: int, seed: int = 0, split: str = "train",
                     questions: int = 1):
    """Document ``index`` of the passkey corpus for ``seq_len``: (tokens [seq_len+1], answer_start, key)."""
    return PasskeyCorpus(tokenizer, seq_len + 1, seed, split, questions).document(index)


class PasskeySource:
    """Stateful stream of passkey documents (token lists); state = next document index."""

    def __init__(self, corpus: PasskeyCorpus):
        self.corpus = corpus
        self.doc_idx = 0

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            toks, _, _ = self.corpus.document(self.doc_idx)
            self.doc_idx += 1
            yield toks

    def next_epoch(self) -> None:  # infinite already
        pass

    def restart(self) -> None:
        self.doc_idx = 0

    def state_dict(self) -> dict[str, Any]:
        return {"doc_idx": self.doc_idx}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.doc_idx = int(sd["doc_idx"])

    def describe(self) -> str:
        return f"passkey(seed={self.corpus.seed}, split={self.corpus.split})"


# ----------------------------------------------------------------------------- local / HF text sources
def _looks_local(path: str) -> bool:
    return (
        os.path.isabs(path)
        or path.startswith((".", "~"))
        or any(ch in path for ch in "*?[")
        or os.path.splitext(path)[1].lower() in LOCAL_FORMATS
        or os.path.exists(path)
        or path.count("/") != 1  # a hub id is exactly "owner/name"
    )


def resolve_local_files(path: str) -> tuple[str, list[str]]:
    """The ``datasets`` builder name and the sorted files of a local file, folder or glob."""
    p = os.path.expanduser(path)
    if any(ch in p for ch in "*?["):
        files = sorted(f for f in glob.glob(p, recursive=True) if os.path.isfile(f))
        if not files:
            raise DatasetError(f"dataset_path {path!r}: the glob matches no file")
    elif os.path.isdir(p):
        files = sorted(
            os.path.join(root, f)
            for root, _, names in os.walk(p)
            for f in names
            if os.path.splitext(f)[1].lower() in LOCAL_FORMATS
        )
        if not files:
            raise DatasetError(
                f"dataset_path {path!r}: folder holds no {sorted(LOCAL_FORMATS)} file"
            )
    elif os.path.isfile(p):
        files = [p]
    else:
        raise DatasetError(
            f"dataset_path {path!r} does not exist. Give a local {sorted(LOCAL_FORMATS)} file, a folder "
            f"or a glob of them (datasets: {list(DATASET_CHOICES)})"
        )
    kinds = {LOCAL_FORMATS.get(os.path.splitext(f)[1].lower()) for f in files}
    if None in kinds:
        bad = [f for f in files if os.path.splitext(f)[1].lower() not in LOCAL_FORMATS]
        raise DatasetError(f"unsupported data file {bad[0]!r}: supported extensions {sorted(LOCAL_FORMATS)}")
    if len(kinds) > 1:
        raise DatasetError(f"dataset_path {path!r} mixes formats {sorted(kinds)}; use one format")
    return kinds.pop(), files


def check_local_file(builder: str, path: str, text_column: str) -> str | None:
    """Cheap up-front check of one data file: the footer of a parquet file, the first record of a
    jsonl file, the first bytes of a txt file. Raises DatasetError naming the file; returns why the
    file holds no documents (empty, 0 rows, blank lines only) or None."""
    try:
        if os.path.getsize(path) == 0:
            return "the file is empty (0 bytes)"
        if builder == "parquet":
            import pyarrow.parquet as pq

            meta = pq.read_metadata(path)
            if text_column not in meta.schema.names:
                raise DatasetError(
                    f"data file {path!r} has no column {text_column!r} (columns: {meta.schema.names}); "
                    "set [training] dataset_text_column"
                )
            if meta.num_rows == 0:
                return "the parquet file has 0 rows"
        elif builder == "json":
            with open(path, "rb") as f:
                for line in f:
                    if line.strip():
                        rec = json.loads(line)
                        if not isinstance(rec, dict) or text_column not in rec:
                            raise DatasetError(
                                f"data file {path!r}: first record has no field {text_column!r}; "
                                "set [training] dataset_text_column"
                            )
                        return None
            return "the file holds only blank lines (no records)"
        else:
            with open(path, "rb") as f:
                head = f.read(1 << 16)
            head.decode("utf-8", errors="strict")
            if not head.strip() and os.path.getsize(path) <= len(head):
                return "the file holds only blank lines (no text)"
    except DatasetError:
        raise
    except UnicodeDecodeError as e:
        # a multi-byte character cut at the 64 KiB boundary is fine
        if e.start < (1 << 16) - 4:
            raise DatasetError(f"corrupt or non-UTF-8 data file {path!r}: {e}") from e
    except Exception as e:
        raise DatasetError(f"corrupt or unreadable data file {path!r}: {type(e).__name__}: {e}") from e
    return None


def _find_shard_idx(state: Any) -> int | None:
    if isinstance(state, dict):
        if "shard_idx" in state:
            return state["shard_idx"]
        for v in state.values():
            r = _find_shard_idx(v)
            if r is not None:
                return r
    return None


class HFTextSource:
    """Stateful stream of tokenized documents from a ``datasets`` IterableDataset (streaming)."""

    def __init__(self, ds, tokenizer: BaseTokenizer, text_column: str, name: str, files: list[str] | None = None):
        self._data = ds
        self.tok = tokenizer
        self.text_column = text_column
        self.name = name
        self.files = files
        self.records = 0  # records read in the current pass (empty texts included)

    def __iter__(self) -> Iterator[list[int]]:
        it = iter(self._data)
        self.records = 0
        while True:
            try:
                sample = next(it)
            except StopIteration:
                return
            except Exception as e:
                raise DatasetError(f"error while reading {self._where()}: {type(e).__name__}: {e}") from e
            text = sample.get(self.text_column)
            if text is None:
                raise DatasetError(f"{self._where()}: record without column {self.text_column!r}")
            self.records += 1
            if text.strip():  # an empty text is no document (it would train on BOS/EOS alone)
                yield self.tok.encode(text, add_bos=True, add_eos=True)

    def empty_reason(self) -> str:
        """Why a whole pass gave no document (for the error)."""
        if not self.records:
            return "a full pass read no record"
        return f"a full pass read {self.records} record(s), every {self.text_column!r} text empty or blank"

    def _where(self) -> str:
        if not self.files:
            return f"dataset {self.name}"
        if len(self.files) == 1:
            return f"data file {self.files[0]!r}"
        try:
            idx = _find_shard_idx(self._data.state_dict())
            if idx is not None and 0 <= idx < len(self.files):
                return f"data file {self.files[idx]!r}"
        except Exception:
            pass
        return f"data files {self.files!r}"

    def next_epoch(self) -> None:
        # datasets re-applies a loaded state at the start of an iteration of the same epoch;
        # bump the epoch so the next pass starts from the beginning
        self._data.set_epoch(self._data.epoch + 1)

    def restart(self) -> None:
        pass  # a new iteration of a datasets IterableDataset (without a loaded state) starts at the top

    def state_dict(self) -> dict[str, Any]:
        return {"data": self._data.state_dict()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._data.load_state_dict(sd["data"])

    def describe(self) -> str:
        return self._where() if self.files else self.name


def hub_unreachable(timeout: float = 5.0) -> str | None:
    """Why the Hugging Face hub cannot be reached (offline mode set, or one HTTPS request to its
    endpoint failing within ``timeout`` s), or None when it answers (any HTTP status)."""
    import urllib.error
    import urllib.request

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    try:
        urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=timeout)
    except urllib.error.HTTPError:
        return None  # it answered
    except Exception as e:  # DNS, refused, timeout, proxy
        return f"{constants.ENDPOINT}: {type(e).__name__}: {getattr(e, 'reason', e)}"
    return None


def build_source(
    name: str,
    path: str | None,
    tokenizer: BaseTokenizer,
    seq_len: int,
    *,
    dataset_config: str = "sample-10BT",
    text_column: str = "text",
    seed: int = 0,
    split: str = "train",
    passkey_questions: int = 1,
):
    """The document source of dataset ``name`` (see module docstring); validates name and path."""
    name = name.lower()
    if name not in DATASET_CHOICES:
        raise DatasetError(f"unknown dataset {name!r}; choices: {list(DATASET_CHOICES)}")
    if name == "passkey":
        if path:
            raise DatasetError("dataset 'passkey' is generated: leave dataset_path unset")
        return PasskeySource(PasskeyCorpus(tokenizer, seq_len + 1, seed=seed, split=split,
                                           questions=passkey_questions))

    from datasets import load_dataset

    if name == "local" and not path:
        raise DatasetError(
            f"dataset 'local' needs dataset_path (a {sorted(LOCAL_FORMATS)} file, folder or glob); "
            f"datasets: {list(DATASET_CHOICES)}"
        )
    if path and (name == "local" or _looks_local(path)):
        builder, files = resolve_local_files(path)
        empty = {f: why for f in files if (why := check_local_file(builder, f, text_column))}
        if len(empty) == len(files):
            raise DatasetError("no training text in dataset_path " + repr(path) + ": " + "; ".join(
                f"data file {f!r}: {why}" for f, why in empty.items()))
        if empty:  # the datasets readers fail on empty files (StopIteration, ArrowInvalid): skip them
            logger.warning(f"Dataset {name}: skipping {len(empty)} empty file(s): " + "; ".join(
                f"{f!r} ({why})" for f, why in empty.items()))
            files = [f for f in files if f not in empty]
        kwargs = {"sample_by": "paragraph"} if builder == "text" else {}
        try:
            ds = load_dataset(builder, data_files=files, split="train", streaming=True, **kwargs)
        except Exception as e:
            raise DatasetError(f"cannot read data files {files!r}: {type(e).__name__}: {e}") from e
        logger.info(f"Dataset {name}: {len(files)} local {builder} file(s) from {path}")
        return HFTextSource(ds, tokenizer, text_column, name=f"{name}:{path}", files=files)

    repo = path or FINEWEB_EDU_REPO
    offline_hint = ("Offline, point dataset_path at a local parquet/jsonl file, "
                    "e.g. --training.dataset_path ../shared/data/fineweb_sample_2800.parquet")
    unreachable = hub_unreachable()
    if unreachable:  # datasets would retry for ~30 s before failing
        raise DatasetError(f"cannot open {repo!r} (config {dataset_config!r}): the Hugging Face hub is "
                           f"unreachable ({unreachable}). {offline_hint}")
    try:
        ds = load_dataset(repo, name=dataset_config, split="train", streaming=True)
    except Exception as e:
        raise DatasetError(
            f"cannot open {repo!r} (config {dataset_config!r}) from the Hugging Face hub: "
            f"{type(e).__name__}: {e}. {offline_hint}"
        ) from e
    logger.info(f"Dataset {name}: streaming {repo} ({dataset_config})")
    return HFTextSource(ds, tokenizer, text_column, name=f"{repo}/{dataset_config}")


# ----------------------------------------------------------------------------- packing
class PackedTokenDataset(IterableDataset, Stateful):
    """Packs a document source into samples of ``seq_len + 1`` tokens; shards per sequence.

    ``restart_each_iter`` (validation): every new iteration starts from the top of the stream, so
    each validation pass sees the same sequences.

    ``passkey`` / ``passkey_mix`` (``[training] passkey_mix``): packed sequence k is replaced by
    passkey document k of ``passkey`` (a PasskeyCorpus of ``seq_len + 1`` tokens) when a hash of
    (corpus seed, k) falls below ``passkey_mix``; the text stream goes on, unchanged, in the other
    sequences. The choice depends on k alone, so DP ranks agree and a resumed run (which restores
    k) continues the same mix."""

    def __init__(self, source, seq_len: int, dp_rank: int = 0, dp_world_size: int = 1, infinite: bool = True,
                 restart_each_iter: bool = False, passkey: "PasskeyCorpus | None" = None,
                 passkey_mix: float = 0.0):
        if passkey is not None and passkey.length != seq_len + 1:
            raise DatasetError(f"passkey corpus of {passkey.length} tokens for seq_len={seq_len}")
        self.passkey = passkey if passkey_mix > 0 else None
        self.passkey_mix = float(passkey_mix)
        self.restart_each_iter = restart_each_iter
        self.source = source
        self.seq_len = seq_len
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.infinite = infinite
        self._token_buffer: list[int] = []
        self._seq_idx = 0  # packed sequences produced so far (over all ranks)
        self._resumed = False  # a loaded state: the next pass starts mid-stream
        self._relooped = False  # the re-loop warning was given

    def is_passkey(self, k: int) -> bool:
        """Whether packed sequence k is a passkey document (passkey_mix)."""
        if self.passkey is None:
            return False
        return random.Random(f"passkey_mix:{self.passkey.seed}:{k}").random() < self.passkey_mix

    def __iter__(self):
        n = self.seq_len + 1
        if self.restart_each_iter:
            self._token_buffer, self._seq_idx, self._resumed = [], 0, False
            self.source.restart()
        info = get_worker_info()
        n_workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        stride = self.dp_world_size * n_workers
        mine = self.dp_rank * n_workers + worker

        def sample(x):
            t = torch.tensor(x, dtype=torch.long)
            return {"input": t[:-1]}, t[1:]

        def passkeys():  # the passkey sequences due before the next text sequence
            while self.is_passkey(self._seq_idx):
                k = self._seq_idx
                self._seq_idx += 1
                if k % stride == mine:
                    yield sample(self.passkey.document(k)[0])

        # a pass that starts mid-stream (a resumed state) may be empty; a whole one may not
        whole_pass = not self._resumed
        self._resumed = False
        while True:
            yield from passkeys()
            pass_tokens = 0
            for toks in self.source:
                pass_tokens += len(toks)
                self._token_buffer.extend(toks)
                while len(self._token_buffer) >= n:
                    x = self._token_buffer[:n]
                    self._token_buffer = self._token_buffer[n:]
                    k = self._seq_idx
                    self._seq_idx += 1
                    if k % stride == mine:
                        yield sample(x)
                    yield from passkeys()
            if whole_pass and pass_tokens == 0:  # would re-loop forever on nothing
                why = getattr(self.source, "empty_reason", lambda: "a full pass gave no token")()
                raise DatasetError(f"{self.source.describe()} holds no training text: {why}")
            if not self.infinite:
                logger.warning(f"Dataset {self.source.describe()} has run out of data")
                return
            if whole_pass and not self._relooped:  # once: a small source re-loops often
                logger.warning(
                    f"Dataset {self.source.describe()} is being re-looped: one pass gives {pass_tokens:,} "
                    f"tokens ({pass_tokens / n:.1f} sequences of seq_len + 1 = {n}); it repeats from now on")
                self._relooped = True
            whole_pass = True
            self.source.next_epoch()

    def state_dict(self) -> dict[str, Any]:
        return {"token_buffer": list(self._token_buffer), "seq_idx": self._seq_idx, "source": self.source.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._token_buffer = list(state_dict["token_buffer"])
        self._seq_idx = int(state_dict["seq_idx"])
        self.source.load_state_dict(state_dict["source"])
        self._resumed = True


def _build(section, job_config, dp_world_size, dp_rank, tokenizer, infinite, split):
    training = job_config.training
    mix = getattr(training, "passkey_mix", 0.0) if split == "train" else 0.0
    questions = check_questions(getattr(training, "passkey_questions", 1)) if split == "train" else 1
    if isinstance(mix, bool) or not isinstance(mix, (int, float)) or not 0.0 <= mix <= 1.0:
        raise DatasetError(f"training.passkey_mix={mix!r}: must be a number in [0, 1]")
    if mix > 0 and section.dataset.lower() == "passkey":
        raise DatasetError(
            f"training.passkey_mix={mix} mixes passkey documents into a text dataset (fineweb_edu, local); "
            "dataset 'passkey' is all passkey already: set passkey_mix = 0 or pick a text dataset")
    source = build_source(
        section.dataset,
        section.dataset_path,
        tokenizer,
        section.seq_len,
        dataset_config=getattr(training, "dataset_config", "sample-10BT"),
        text_column=getattr(training, "dataset_text_column", "text"),
        seed=getattr(training, "dataset_seed", 0),
        split=split,
        passkey_questions=questions,
    )
    passkey = None
    if mix > 0:
        passkey = PasskeyCorpus(tokenizer, section.seq_len + 1, seed=getattr(training, "dataset_seed", 0),
                                split=split, questions=questions)
        logger.info(f"Dataset {section.dataset}: {100 * mix:g}% of the sequences are passkey documents")
    ds = PackedTokenDataset(source, section.seq_len, dp_rank, dp_world_size, infinite=infinite,
                            restart_each_iter=split == "validation", passkey=passkey, passkey_mix=mix)
    kwargs = {**asdict(section.dataloader), "batch_size": section.local_batch_size}
    return ParallelAwareDataloader(ds, dp_rank=dp_rank, dp_world_size=dp_world_size, **kwargs)


def build_dataloader(dp_world_size: int, dp_rank: int, tokenizer: BaseTokenizer, job_config, infinite: bool = True):
    """TrainSpec.build_dataloader_fn for ``[training]``."""
    return _build(job_config.training, job_config, dp_world_size, dp_rank, tokenizer, infinite, "train")


def build_validation_dataloader(
    dp_world_size: int, dp_rank: int, tokenizer: BaseTokenizer, job_config, infinite: bool = False
):
    """Validation loader for ``[validation]`` (passkey validation documents use their own seed stream)."""
    v = job_config.validation
    if v.dataset.lower() == "passkey" and v.steps == -1:
        raise DatasetError("validation on the endless 'passkey' corpus needs validation.steps > 0")
    return _build(job_config.validation, job_config, dp_world_size, dp_rank, tokenizer, infinite, "validation")
