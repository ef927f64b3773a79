"""torchtitan's data loaders for nsa_flex: ``[training]`` / ``[validation]`` -> ParallelAwareDataloader.

Chosen by ``[training] dataset`` / ``dataset_path`` (and ``[validation]`` likewise); the sources,
their errors and the packing live in the library (nsa_flex/data/): ``passkey`` (generated, the
default), ``fineweb_edu`` (HF streaming or a local copy), ``local`` (parquet / jsonl / json / txt
files), ``pysource`` (the Python source of installed packages). ``[training] passkey_mix`` (0..1)
replaces that fraction of the packed sequences of a text dataset by passkey documents (pysource:
passkey and multi-key documents in source-code filler, 0.15 when unset); ``skip_bad_records`` skips unreadable records (logged, counted) instead
of stopping at the first. Each data-parallel rank reads its own shard of the documents.
"""

import os
from dataclasses import asdict

from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.tools.logging import logger

from nsa_flex.data.errors import DatasetError
from nsa_flex.data.packing import PackedTokenDataset
from nsa_flex.data.passkey import check_filler, check_keys, check_min_gap, check_min_gap_share, check_questions
from nsa_flex.data.retrieval import synthetic_retrieval
from nsa_flex.data.pysource import pysource_retrieval
from nsa_flex.data.sources import DATASET_CHOICES, build_source

PYSOURCE_MIX = 0.15

__all__ = ["DATASET_CHOICES", "build_dataloader", "build_validation_dataloader", "passkey_mix_of"]


def passkey_mix_of(training) -> float:
    """``[training] passkey_mix``; unset (None): PYSOURCE_MIX for pysource, 0 for the other datasets."""
    mix = getattr(training, "passkey_mix", None)
    if mix is None:
        return PYSOURCE_MIX if training.dataset.lower() == "pysource" else 0.0
    return mix


def _worker_in_its_own_process_group(worker_id: int) -> None:
    """A loader worker's start: a process group of its own, so a stop signal sent to the
    training's group (``timeout``, Ctrl-C in a terminal) reaches the trainer alone, which halts
    after the step with a checkpoint; a worker it ended would break that step's data fetch. The
    worker still ends with the training process (torch's workers watch their parent) and at the
    loader's shutdown (a SIGTERM to the worker itself)."""
    os.setpgid(0, 0)


def _build(section, job_config, dp_world_size, dp_rank, tokenizer, infinite, split):
    training = job_config.training
    mix = passkey_mix_of(training) if split == "train" else 0.0
    questions = check_questions(getattr(training, "passkey_questions", 1)) if split == "train" else 1
    # validation documents ask once, anywhere: the retrieval metrics' near / far split reads them
    min_gap = check_min_gap(getattr(training, "passkey_min_gap", 0)) if split == "train" else 0
    gap_share = check_min_gap_share(getattr(training, "passkey_min_gap_share", 1.0))
    name = section.dataset.lower()
    if isinstance(mix, bool) or not isinstance(mix, (int, float)) or not 0.0 <= mix <= 1.0:
        raise DatasetError(f"training.passkey_mix={mix!r}: must be a number in [0, 1]")
    if mix > 0 and name == "passkey":
        raise DatasetError(
            f"training.passkey_mix={mix} mixes passkey documents into a text dataset (fineweb_edu, local); "
            "dataset 'passkey' is all passkey already: set passkey_mix = 0 or pick a text dataset")
    seed = getattr(training, "dataset_seed", 0)
    filler = check_filler(getattr(training, "passkey_filler", "sentences"))
    keys = check_keys(getattr(training, "passkey_keys", 1))
    source = build_source(
        section.dataset,
        section.dataset_path,
        tokenizer,
        section.seq_len,
        dataset_config=getattr(training, "dataset_config", "sample-10BT"),
        text_column=getattr(training, "dataset_text_column", "text"),
        seed=seed,
        split=split,
        passkey_questions=questions,
        skip_bad=bool(getattr(training, "skip_bad_records", False)),
        passkey_filler=filler,
        passkey_keys=keys,
        passkey_min_gap=min_gap,
        passkey_min_gap_share=gap_share,
    )
    if keys > 1 and name != "pysource" and (name == "passkey" or mix > 0):  # the generated documents
        logger.info(f"Generated retrieval documents ({split}): half of them hold {keys} keys naming different "
                    "people, each question another's (training.passkey_keys)")
    passkey = None
    if mix > 0 and name == "pysource":
        passkey = pysource_retrieval(tokenizer, section.seq_len + 1, split, seed, section.dataset_path,
                                     questions=questions, min_gap=min_gap, min_gap_share=gap_share)
        logger.info(f"Dataset pysource: {100 * mix:g}% of the sequences are retrieval documents (passkey "
                    f"and {passkey.n_keys}-key needles, half each, in source-code filler)")
    elif mix > 0:
        passkey = synthetic_retrieval(tokenizer, section.seq_len + 1, seed=seed, split=split,
                                      questions=questions, filler=filler, keys=keys, min_gap=min_gap,
                                      min_gap_share=gap_share)
        logger.info(f"Dataset {section.dataset}: {100 * mix:g}% of the sequences are passkey documents")
    ds = PackedTokenDataset(source, section.seq_len, dp_rank, dp_world_size, infinite=infinite,
                            restart_each_iter=split == "validation", passkey=passkey, passkey_mix=mix)
    kwargs = {**asdict(section.dataloader), "batch_size": section.local_batch_size,
              "worker_init_fn": _worker_in_its_own_process_group}
    return ParallelAwareDataloader(ds, dp_rank=dp_rank, dp_world_size=dp_world_size, **kwargs)


def build_dataloader(dp_world_size: int, dp_rank: int, tokenizer, job_config, infinite: bool = True):
    """TrainSpec.build_dataloader_fn for ``[training]``."""
    return _build(job_config.training, job_config, dp_world_size, dp_rank, tokenizer, infinite, "train")


def build_validation_dataloader(dp_world_size: int, dp_rank: int, tokenizer, job_config, infinite: bool = False):
    """Validation loader for ``[validation]`` (passkey validation documents use their own seed stream)."""
    v = job_config.validation
    if v.dataset.lower() == "passkey" and v.steps == -1:
        raise DatasetError("validation on the endless 'passkey' corpus needs validation.steps > 0")
    return _build(job_config.validation, job_config, dp_world_size, dp_rank, tokenizer, infinite, "validation")
