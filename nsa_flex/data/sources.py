"""The document source of a dataset name and path (``[training] dataset`` / ``dataset_path``).

  * ``passkey`` (no files): the generated retrieval corpus (nsa_flex/data/passkey.py).
  * ``fineweb_edu``: HuggingFaceFW/fineweb-edu, streaming, config ``dataset_config`` (default
    sample-10BT). With ``dataset_path`` set, that local file / folder / glob (or hub id) is read
    instead -- the offline way, e.g. ``--training.dataset_path ../shared/data/fineweb_sample_2800.parquet``.
  * ``local``: ``dataset_path`` is required: a ``.parquet`` / ``.jsonl`` / ``.json`` / ``.txt`` file, a
    folder of such files, or a glob; column ``text_column`` (default ``text``); ``.txt`` files yield one
    document per paragraph. Bad records: see nsa_flex/data/records.py.
  * ``pysource``: the Python source of installed packages, split by package (nsa_flex/data/pysource.py);
    ``dataset_path``, when set, names the folders of packages to read instead of site-packages.
"""

import logging

from datasets import IterableDataset, load_dataset

from .errors import DatasetError
from .files import LOCAL_FORMATS, looks_local, resolve_local_files
from .hub_probe import hub_unreachable
from .passkey import PasskeySource
from .pysource import pysource_source
from .retrieval import synthetic_retrieval
from .records import SCAN_BYTES, SCAN_MIN_BYTES, check_local_file, read_records
from .text_source import HFTextSource

logger = logging.getLogger(__name__)

DATASET_CHOICES = ("passkey", "fineweb_edu", "local", "pysource")
FINEWEB_EDU_REPO = "HuggingFaceFW/fineweb-edu"


def local_source(name: str, path: str, tokenizer, text_column: str = "text", skip_bad: bool = False):
    """The source of the local files ``path`` names, checked up front (nsa_flex/data/records.py)."""
    fmt, files = resolve_local_files(path, DATASET_CHOICES)
    limit = max(SCAN_BYTES // len(files), SCAN_MIN_BYTES)
    empty = {f: why for f in files if (why := check_local_file(fmt, f, text_column, skip_bad, limit))}
    if len(empty) == len(files):
        raise DatasetError("no training text in dataset_path " + repr(path) + ": " + "; ".join(
            f"data file {f!r}: {why}" for f, why in empty.items()))
    if empty:
        logger.warning(f"Dataset {name}: skipping {len(empty)} empty file(s): " + "; ".join(
            f"{f!r} ({why})" for f, why in empty.items()))
        files = [f for f in files if f not in empty]
    ds = IterableDataset.from_generator(read_records, gen_kwargs={
        "files": files, "fmt": fmt, "text_column": text_column, "skip_bad": skip_bad})
    logger.info(f"Dataset {name}: {len(files)} local {fmt} file(s) from {path}")
    return HFTextSource(ds, tokenizer, text_column, name=f"{name}:{path}", files=files, skip_bad=skip_bad)


def hub_source(repo: str, dataset_config: str, tokenizer, text_column: str = "text", skip_bad: bool = False):
    """A hub dataset, streamed; fails at once with the offline hint when the hub is unreachable."""
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
    logger.info(f"Streaming {repo} ({dataset_config})")
    return HFTextSource(ds, tokenizer, text_column, name=f"{repo}/{dataset_config}", skip_bad=skip_bad)


def build_source(
    name: str,
    path: str | None,
    tokenizer,
    seq_len: int,
    *,
    dataset_config: str = "sample-10BT",
    text_column: str = "text",
    seed: int = 0,
    split: str = "train",
    passkey_questions: int = 1,
    skip_bad: bool = False,
    passkey_filler: str = "sentences",
    passkey_keys: int = 1,
    passkey_min_gap: int = 0,
    passkey_min_gap_share: float = 1.0,
):
    """The document source of dataset ``name`` (see the module docstring); validates name and path."""
    name = name.lower()
    if name not in DATASET_CHOICES:
        raise DatasetError(f"unknown dataset {name!r}; choices: {list(DATASET_CHOICES)}")
    if name == "passkey":
        if path:
            raise DatasetError("dataset 'passkey' is generated: leave dataset_path unset")
        return PasskeySource(synthetic_retrieval(tokenizer, seq_len + 1, seed=seed, split=split,
                                                 questions=passkey_questions, filler=passkey_filler,
                                                 keys=passkey_keys, min_gap=passkey_min_gap,
                                                 min_gap_share=passkey_min_gap_share))
    if name == "pysource":
        return pysource_source(tokenizer, split, seed, path, skip_bad)
    if name == "local" and not path:
        raise DatasetError(
            f"dataset 'local' needs dataset_path (a {sorted(LOCAL_FORMATS)} file, folder or glob); "
            f"datasets: {list(DATASET_CHOICES)}"
        )
    if path and (name == "local" or looks_local(path)):
        return local_source(name, path, tokenizer, text_column, skip_bad)
    return hub_source(path or FINEWEB_EDU_REPO, dataset_config, tokenizer, text_column, skip_bad)
