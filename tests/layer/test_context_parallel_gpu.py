"""Context parallelism on two GPUs (issue 42): the 125M layer shape at 32k tokens, bf16, flex
backend, with documents that cross the shard boundary: two ranks (torchrun, NCCL), each one
contiguous half of the sequence, give the one-GPU output, input gradient and (summed over the
ranks) parameter gradients within bf16 tolerance. The one-GPU reference runs on each rank itself,
with the executors a shard runs (flex, the torch scorer). Run: python -m pytest -m gpu
tests/layer/test_context_parallel_gpu.py on a machine with two GPUs."""

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("cp_gpu_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (context parallelism)")
@pytest.mark.parametrize("preset", ["nsa", "full_causal"])
def test_two_gpus_equal_one_at_32k(preset):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={_free_port()}", str(WORKER), "--preset", preset, "--seq", "32768"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    assert "cp_gpu_worker: ok" in p.stdout, p.stdout[-3000:]
