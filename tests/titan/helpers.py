"""Shared by the titan tests that launch a training process."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def launch_env() -> dict:
    """The environment of a fresh single-process run: no inherited rank variables, the project
    root first on PYTHONPATH (so `tests.titan.ops_test_data` imports)."""
    env = dict(os.environ)
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env
