"""Metrics: torchtitan's MetricsProcessor plus a per-step JSONL file (``[metrics] jsonl_file``).

Each logged step appends one JSON line on rank 0: ``{"step", "time", "loss_metrics/global_avg_loss",
"grad_norm", "throughput(tps)", "memory/max_reserved(GiB)", "lr", ...}`` with full-precision floats
(the console line rounds the loss to 5 decimals). Validation lines carry ``validation_metrics/*``.
"""

import json
import math
import os
import time

import torch

from torchtitan.components.metrics import BaseLogger, MetricsProcessor


def _plain(v):
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)
    return v


class JsonlLogger(BaseLogger):
    def __init__(self, path: str):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self._f = open(path, "a", buffering=1)

    def log(self, metrics: dict, step: int) -> None:
        rec = {"step": step, "time": time.time(), **{k: _plain(v) for k, v in metrics.items()}}
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


class NSAMetricsProcessor(MetricsProcessor):
    def __init__(self, job_config, parallel_dims, tag: str | None = None):
        super().__init__(job_config, parallel_dims, tag)
        self.jsonl: JsonlLogger | None = None
        name = getattr(job_config.metrics, "jsonl_file", "")
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if name and rank == 0:
            path = name if os.path.isabs(name) else os.path.join(job_config.job.dump_folder, name)
            if tag:
                root, ext = os.path.splitext(path)
                path = f"{root}_{tag}{ext}"
            self.jsonl = JsonlLogger(path)
            inner = self.logger

            class _Both(BaseLogger):
                def log(_self, metrics, step):
                    inner.log(metrics, step)
                    self.jsonl.log(metrics, step)

                def close(_self):
                    inner.close()
                    self.jsonl.close()

            self.logger = _Both()


def build_metrics_processor(job_config, parallel_dims, model_args=None, tag: str | None = None):
    """TrainSpec.build_metrics_processor_fn."""
    return NSAMetricsProcessor(job_config, parallel_dims, tag)
