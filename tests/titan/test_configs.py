"""The shipped TOML configs: settings every long-context config must carry."""

import tomllib
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


def test_rope_bound():
    assert 3.0e5 < min_rope_base(16384) < 3.2e5 and 9.4e5 < min_rope_base(32768) < 9.6e5
