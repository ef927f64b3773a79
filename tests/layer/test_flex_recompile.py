"""Eager callers of flex (model prefill) compile it per shape; past dynamo's recompile limit it
would run flex eagerly, materializing the score matrix (an OOM at 32k on the H100): we fail
with a clear error instead, after FLEX_RECOMPILE_LIMIT shapes (default 64, not dynamo's 8)."""

import pytest
import torch

import nsa_flex.attention as A
from masks import sliding_window


def _call(T):
    spec = sliding_window(8)
    q, k = torch.randn(1, 2, T, 16), torch.randn(1, 2, T, 16)
    return A.attend_flex(q, k, k, spec)[0]


def test_more_shapes_than_dynamo_default_compile(monkeypatch):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(A, "_compiled_flex", None)
    for T in range(16, 16 * 11, 16):  # 10 shapes > dynamo's default limit of 8
        _call(T)
    # every shape compiled (past dynamo's limit the last two would have run eagerly)
    assert counters["frames"]["ok"] == 10 and counters["stats"]["unique_graphs"] == 10


def test_limit_hit_is_a_clear_error(monkeypatch):
    torch._dynamo.reset()
    monkeypatch.setattr(A, "_compiled_flex", None)
    monkeypatch.setattr(A, "FLEX_RECOMPILE_LIMIT", 2)
    _call(32)
    _call(48)
    with pytest.raises(RuntimeError, match="FLEX_RECOMPILE_LIMIT"):
        _call(64)
    torch._dynamo.reset()
