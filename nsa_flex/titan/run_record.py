"""The config a checkpoint was made with, and what a resume may change.

Every checkpoint folder ``step-N`` gets ``run_config.json``: the ``[model]``, ``[nsa]``,
``[training]``, ``[optimizer]`` and ``[lr_scheduler]`` sections of the job config that saved it.
On resume :func:`compare` sorts the differences with the current config:

  * ``refused``: fields that change the model or the data stream (:data:`MODEL_DATA`): loading the
    weights or the loader state into them is wrong or fails deep inside DCP. Refused unless
    ``[checkpoint] allow_config_change``;
  * ``applied``: everything else (lr, schedule, steps, max_norm, ...): logged and applied as asked;
    :func:`rebuild_schedule` recomputes the learning rate of the resumed step from the new config,
    so a changed lr or a longer run continues the new schedule at the restored step (no jump back
    to a value of the old schedule).
"""

import dataclasses
import json
import os

FILE = "run_config.json"
SECTIONS = ("model", "nsa", "training", "optimizer", "lr_scheduler")
# fields that make another model or another data stream ("section.field"; "nsa.*": every [nsa]
# field but NOT_MODEL's)
MODEL_DATA = (
    "model.name", "model.flavor", "model.tokenizer", "nsa.*",
    "training.dataset", "training.dataset_path", "training.dataset_config", "training.dataset_text_column",
    "training.dataset_seed", "training.passkey_mix", "training.passkey_questions",
    "training.passkey_filler", "training.passkey_keys", "training.passkey_min_gap",
    "training.passkey_min_gap_share", "training.seq_len",
    "training.local_batch_size", "training.global_batch_size",
)
# [nsa] fields that choose how the same function is computed (executors, recomputation, chunking),
# what is logged, or training-only settings (the selection distillation and dense warm-up, like
# optimizer settings): a
# resume may change them (e.g. recompute after an out-of-memory)
NOT_MODEL = ("nsa.telemetry_every", "nsa.gate_collapse_threshold", "nsa.gate_collapse_steps",
             "nsa.backend", "nsa.scorer", "nsa.sel_kernel", "nsa.cmp_kernel", "nsa.recompute",
             "nsa.score_chunk", "nsa.sel_distill", "nsa.sel_dense_steps")


def _plain(v):
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    return str(v)


def record(job_config, bare: bool = False) -> dict:
    """{"section.field": value} of the recorded sections (JSON-safe values); ``bare``: each
    section's defaults (its dataclass built anew) instead of its values."""
    out = {}
    for sec in SECTIONS:
        obj = getattr(job_config, sec, None)
        if obj is None or not dataclasses.is_dataclass(obj):
            continue
        obj = type(obj)() if bare else obj
        for f in dataclasses.fields(obj):
            if not f.name.startswith("_"):
                out[f"{sec}.{f.name}"] = _plain(getattr(obj, f.name))
    return out


def write(folder: str, job_config) -> str:
    path = os.path.join(folder, FILE)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record(job_config), f, indent=1, sort_keys=True)
    os.replace(tmp, path)
    return path


def read(folder: str) -> dict | None:
    try:
        with open(os.path.join(folder, FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def is_model_data(key: str) -> bool:
    if key in NOT_MODEL:
        return False
    return key in MODEL_DATA or any(p.endswith(".*") and key.startswith(p[:-1]) for p in MODEL_DATA)


def defaults(job_config) -> dict:
    """:func:`record` of the recorded sections' defaults."""
    return record(job_config, bare=True)


def compare(old: dict, new: dict, default: dict | None = None) -> tuple[list[str], list[str]]:
    """(refused, applied): "key old -> new" for each field that differs, split by :func:`is_model_data`.
    A field only one side has (another version of the config) is compared as missing, except a field
    added since the old record whose new value is its ``default`` (:func:`defaults`): the version
    that saved it behaved as that default."""
    refused, applied = [], []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, "<absent>"), new.get(key, "<absent>")
        if key not in old and default is not None and key in default and b == default[key]:
            continue
        if a != b:
            (refused if is_model_data(key) else applied).append(f"{key} {a!r} -> {b!r}")
    return refused, applied


def rebuild_schedule(lr_schedulers, optimizer_cfg) -> list[tuple[float, float]]:
    """Point every (LambdaLR) scheduler at the configured lr and set each param group's lr to the
    new schedule's value at the restored step; the (old, new) lr of each changed group."""
    changed = []
    for sched in lr_schedulers:
        sched.base_lrs = [float(optimizer_cfg.lr) for _ in sched.base_lrs]
        groups = sched.optimizer.param_groups
        for g, base, lam in zip(groups, sched.base_lrs, sched.lr_lambdas):
            new = base * lam(sched.last_epoch)
            if new != g["lr"]:
                changed.append((g["lr"], new))
            g["initial_lr"], g["lr"] = base, new
            for key, val in (("weight_decay", getattr(optimizer_cfg, "weight_decay", None)),
                             ("eps", getattr(optimizer_cfg, "eps", None))):
                if val is not None and key in g:
                    g[key] = val
        sched._last_lr = [g["lr"] for g in groups]
    return changed
