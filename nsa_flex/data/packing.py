"""Packing a document source into training samples of ``seq_len + 1`` tokens, as torchtitan does.

Documents are concatenated (each ends with EOS) and cut into samples of ``seq_len + 1`` tokens (input =
first seq_len, labels = last seq_len). Data-parallel sharding is the source's (``source.shard(rank,
world)``): each rank reads and tokenizes its own documents and packs them, so the ranks' sequences
are disjoint.

The dataset is ``Stateful``: the token buffer, the sequence counter and the source position (HF
``IterableDataset.state_dict`` or the passkey document index) go into torchtitan's checkpoint, so a
resumed run continues the stream where it stopped, without repeats.
"""

import logging
import random
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset, get_worker_info

from .errors import DatasetError
from .passkey import PasskeyCorpus

logger = logging.getLogger(__name__)


class PackedTokenDataset(IterableDataset, Stateful):
    """Packs a document source into samples of ``seq_len + 1`` tokens.

    ``restart_each_iter`` (validation): every new iteration starts from the top of the stream, so
    each validation pass sees the same sequences.

    ``passkey`` / ``passkey_mix``: the k-th sequence of this shard is replaced by passkey document
    g of ``passkey`` (a PasskeyCorpus of ``seq_len + 1`` tokens), g = k * S + s for shard s of S
    (ranks x DataLoader workers), when a hash of (corpus seed, g) falls below ``passkey_mix``; the
    text stream goes on, unchanged, in the other sequences. The choice depends on (k, s) alone, so
    shards hold disjoint passkey documents and a resumed run (which restores k) continues the same mix."""

    def __init__(self, source, seq_len: int, dp_rank: int = 0, dp_world_size: int = 1, infinite: bool = True,
                 restart_each_iter: bool = False, passkey: PasskeyCorpus | None = None,
                 passkey_mix: float = 0.0):
        if passkey is not None and passkey.length != seq_len + 1:
            raise DatasetError(f"passkey corpus of {passkey.length} tokens for seq_len={seq_len}")
        self.passkey = passkey if passkey_mix > 0 else None
        self.passkey_mix = float(passkey_mix)
        self.restart_each_iter = restart_each_iter
        self.source = source
        if dp_world_size > 1:
            source.shard(dp_rank, dp_world_size)
        self.seq_len = seq_len
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.infinite = infinite
        self._token_buffer: list[int] = []
        self._seq_idx = 0  # packed sequences this shard has produced
        self._resumed = False  # a loaded state: the next pass starts mid-stream
        self._relooped = False  # the re-loop warning was given

    def is_passkey(self, g: int) -> bool:
        """Whether global sequence index g is a passkey document (passkey_mix)."""
        if self.passkey is None:
            return False
        return random.Random(f"passkey_mix:{self.passkey.seed}:{g}").random() < self.passkey_mix

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
            while self.is_passkey(g := self._seq_idx * stride + mine):
                self._seq_idx += 1
                yield sample(self.passkey.document(g)[0])

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
                    self._seq_idx += 1
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
