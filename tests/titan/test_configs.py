"""The shipped TOML configs: settings every long-context config and every GPU config must carry."""

import tomllib
from dataclasses import asdict
from pathlib import Path

import pytest

from nsa_flex.config import NSAConfig
from nsa_flex.rope import min_rope_base

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "titan_configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_long_context_configs_set_a_rope_base_for_their_length(path):
    """RoPE base >= 0.0424 L^1.628 (Men et al. 2024) for every training length from 8k on: below it
    retrieval across the context fails while the loss looks fine."""
    cfg = tomllib.loads(path.read_text())
    lengths = [cfg.get("training", {}).get("seq_len", 0)]
    lengths += [int(item.split("=", 1)[1]) for item in cfg.get("curriculum", {}).get("short", [])
                if item.startswith("training.seq_len=")]
    theta = cfg.get("nsa", {}).get("rope_theta", NSAConfig.rope_theta)
    for L in lengths:
        if L >= 8192:
            assert theta >= min_rope_base(L), f"{path.name}: rope_theta={theta} < {min_rope_base(L):.3g} for seq_len {L}"


# the CPU quick start loads in the training process: its byte-tokenized generated batches take
# ~1 ms of a CPU step (torchtitan's "data:", < 0.5%), so on a small CPU machine (2 cores) a worker
# would only compete with the model's step for a core and add a process start to a 50-step run
CPU_CONFIGS = ("debug_nsa.toml",)


@pytest.mark.parametrize("path", [p for p in CONFIGS if p.name not in CPU_CONFIGS],
                         ids=lambda p: p.name)
def test_gpu_configs_load_data_in_a_worker(path):
    """Every config meant for a GPU tokenizes in a worker process with batches prefetched
    (`[training.dataloader]`, torchtitan's loader settings as `nsa_flex.titan.data` passes them):
    in-process, loading is on the step (the log's "data:", 14-22 ms a step, issue 43)."""
    from torchtitan.config.job_config import DataLoader

    section = tomllib.loads(path.read_text()).get("training", {}).get("dataloader", {})
    loader = asdict(DataLoader(**section))  # a key torchtitan does not know: TypeError
    assert loader["num_workers"] >= 1 and (loader["prefetch_factor"] or 0) >= 2, (path.name, loader)


def test_rope_bound():
    assert 3.0e5 < min_rope_base(16384) < 3.2e5 and 9.4e5 < min_rope_base(32768) < 9.6e5
