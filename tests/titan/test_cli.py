"""nsa-train wrapper (environment, default config) and a 2-process torchrun run on CPU (DDP/gloo):
per-sequence DP sharding gives the 2-rank run the same global batch as the 1-rank run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nsa_flex.titan import cli
from tests.titan.helpers import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_build_args_defaults_to_debug_config():
    args = cli.build_args(["--training.steps", "3"])
    assert args[:2] == ["--job.config_file", str(ROOT / "titan_configs" / "debug_nsa.toml")]
    assert cli.build_args(["--job.config_file=x.toml"]) == ["--job.config_file=x.toml"]


def test_setup_env_single_process(monkeypatch):
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "TIKTOKEN_CACHE_DIR", "MKL_DYNAMIC"):
        monkeypatch.delenv(k, raising=False)
    cli.setup_env()
    assert os.environ["MKL_DYNAMIC"] == "FALSE"  # a CPU run's numbers repeat from process to process
    assert (os.environ["WORLD_SIZE"], os.environ["RANK"], os.environ["LOCAL_RANK"]) == ("1", "0", "0")
    assert os.environ["MASTER_ADDR"] == "127.0.0.1" and int(os.environ["MASTER_PORT"]) > 0
    shared = ROOT.parent / "shared" / "data" / "tiktoken_cache"
    if shared.is_dir():
        assert Path(os.environ["TIKTOKEN_CACHE_DIR"]).resolve() == shared.resolve()
    # under torchrun the launcher's variables are kept
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "3")
    cli.setup_env()
    assert os.environ["RANK"] == "3"


def _losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss_metrics/global_avg_loss"] for r in map(json.loads, path.read_text().splitlines())}


@pytest.mark.slow
def test_two_rank_ddp_matches_one_rank(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    common = ["--job.config_file", str(ROOT / "titan_configs" / "debug_nsa.toml"), "--training.steps", "4"]
    one = subprocess.run(
        [sys.executable, "-m", "nsa_flex.titan.cli", *common, "--training.local_batch_size", "4",
         "--job.dump_folder", str(tmp_path / "one")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
         "-m", "nsa_flex.titan.train", *common, "--training.local_batch_size", "2",
         "--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
         "--job.dump_folder", str(tmp_path / "two")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, (two.stdout + two.stderr)[-3000:]
    out = two.stdout + two.stderr  # rank 0 alone logs; no NCCL / CUDA-mesh notes on the CPU
    assert sum(" - INFO - step: 1/4 " in l for l in out.splitlines()) == 1, out[-3000:]
    assert "Warning" not in out and "TORCH_NCCL" not in out, out[-3000:]
    a, b = _losses(tmp_path / "one" / "metrics.jsonl"), _losses(tmp_path / "two" / "metrics.jsonl")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    assert a[1] == pytest.approx(b[1], abs=1e-5)  # same weights, same global batch
    for s in a:
        assert a[s] == pytest.approx(b[s], abs=1e-2)
