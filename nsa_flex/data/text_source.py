"""A stateful stream of tokenized documents from a ``datasets`` IterableDataset (streaming).

Local files arrive through :func:`nsa_flex.data.records.read_records` (bad records already located and
handled there); a hub dataset arrives as is, and a record whose text is null or not a string is a bad
record here (located by its index in the pass). Sharding over data-parallel ranks is
``datasets.distributed.split_dataset_by_node``, as torchtitan does: whole files per rank when their
number divides by the world size, else every W-th record; each rank tokenizes only its own records.
"""

import logging
from dataclasses import dataclass, field
from typing import Any, Iterator

from datasets.distributed import split_dataset_by_node

from .errors import DatasetError
from .records import LOG_FIRST, SKIP_HINT

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class HFTextSource:
    """Tokenized documents (BOS + text + EOS) of a ``datasets`` IterableDataset ``ds`` (this rank's
    shard of it after :meth:`shard`)."""

    ds: Any
    tokenizer: Any
    text_column: str
    name: str
    files: list[str] | None = None
    skip_bad: bool = False
    records: int = field(default=0, init=False)  # records read in the current pass (empty texts included)

    def shard(self, rank: int, world: int) -> None:
        if world > 1:
            self.ds = split_dataset_by_node(self.ds, rank=rank, world_size=world)

    def __iter__(self) -> Iterator[list[int]]:
        it = iter(self.ds)
        self.records, bad = 0, 0
        while True:
            try:
                sample = next(it)
            except StopIteration:
                return
            except DatasetError:
                raise
            except Exception as e:
                raise DatasetError(f"error while reading {self.describe()}: {type(e).__name__}: {e}") from e
            self.records += 1
            text = sample.get(self.text_column)
            if not isinstance(text, str):
                why = (f"record without column {self.text_column!r}" if self.text_column not in sample else
                       f"{self.text_column!r} is " + ("null" if text is None else f"{type(text).__name__}, not a string"))
                where = f"{self.describe()}, record {self.records - 1} of this pass"
                if not self.skip_bad:
                    raise DatasetError(f"{where}: bad record: {why}; {SKIP_HINT}")
                bad += 1
                if bad <= LOG_FIRST:
                    logger.warning(f"Skipping bad record {bad} of {where}: {why}")
                continue
            if text.strip():  # an empty text is no document (it would train on BOS/EOS alone)
                yield self.tokenizer.encode(text, add_bos=True, add_eos=True)

    def empty_reason(self) -> str:
        """Why a whole pass gave no document (for the error)."""
        if not self.records:
            return "a full pass read no record"
        return f"a full pass read {self.records} record(s), every {self.text_column!r} text empty or blank"

    def next_epoch(self) -> None:
        # datasets re-applies a loaded state at the start of an iteration of the same epoch;
        # bump the epoch so the next pass starts from the beginning
        self.ds.set_epoch(self.ds.epoch + 1)

    def restart(self) -> None:
        pass  # a new iteration of a datasets IterableDataset (without a loaded state) starts at the top

    def state_dict(self) -> dict[str, Any]:
        return {"data": self.ds.state_dict()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if "data" not in sd:
            raise DatasetError(f"the checkpoint's data state {sorted(sd)} is not that of {self.describe()}: "
                               "it was saved with another dataset")
        self.ds.load_state_dict(sd["data"])

    def describe(self) -> str:
        if not self.files:
            return f"dataset {self.name}"
        if len(self.files) == 1:
            return f"data file {self.files[0]!r}"
        return f"data files {self.files[0]!r} .. {self.files[-1]!r} ({len(self.files)})"
