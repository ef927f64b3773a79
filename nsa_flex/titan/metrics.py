"""Metrics: torchtitan's MetricsProcessor plus a per-step JSONL file (``[metrics] jsonl_file``).

Each logged step appends one JSON line on rank 0: ``{"step", "time", "loss_metrics/global_avg_loss",
"grad_norm", "throughput(tps)", "memory/max_reserved(GiB)", "lr", ...}`` with full-precision floats
(the console line rounds the loss to 5 decimals). Validation lines carry ``validation_metrics/*``.
A resume from a checkpoint appends ``{"step": N, "event": "resume", "checkpoint_step": N,
"checkpoint": ...}`` first (:func:`note_resume`): later records of steps > N replace the earlier
run's records of the same steps. The file is opened at the first record (after the checkpoint
load, :func:`open_records`): a run that did not resume never appends to an earlier run's records
(they are moved to ``metrics.1.jsonl``, the first free number, with a warning); a last line cut
short (a kill or a full disk mid-write) is dropped, with a warning, before anything is appended.
Each record is one write; a write that fails (a full disk) is undone, so no partial line stays,
and the run stops with one :class:`nsa_flex.errors.DiskSpaceError`.

NSA telemetry (``[nsa] telemetry_every = N > 0``; see :mod:`nsa_flex.telemetry` for the design and
the quantities): when the trainer hands the model to the processor (``model_parts``), recording is
switched on in every ``NSAAttention`` (before the first, compiled, call). Every N steps (and at
step 1) the per-layer stats are read (one DP all-reduce), logged as ``nsa/...`` scalars through the
same loggers as the step metrics (TensorBoard when enabled, the JSONL file; merged into the step's
record when it is also a ``log_freq`` step, a record of their own otherwise), printed as one line
per layer, the selected-block distances also as a TensorBoard histogram; a gate whose mean stays
above ``gate_collapse_threshold`` over ``gate_collapse_steps`` steps logs a warning. The read rides
on ``should_log(step)``, which torchtitan's trainer calls once per step on every rank.

Operating long runs (``[ops]``, :mod:`nsa_flex.titan.ops`): the trainer
(:class:`nsa_flex.titan.trainer.NSATrainer`) hands its ``OpsMonitor`` to the training processor
(``ops``); the processor tells it about each completed step (and its data-loader wait) from
``should_log`` and adds its data-wait figures to each logged record and to the console step line.
"""

import json
import logging
import math
import os
import re
import time
import weakref

import torch

from torchtitan.components.metrics import BaseLogger, MetricsProcessor, TensorBoardLogger
from torchtitan.tools.logging import logger as log

from nsa_flex import telemetry as tm
from nsa_flex.errors import DiskSpaceError, space_error
from nsa_flex.layer import NSAAttention

from .ops import OpsMonitor
from .retrieval import summary as retrieval_summary


def _plain(v):
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)
    return v


def _duration(s: float) -> str:
    s = int(round(s))
    h, m = divmod(s // 60, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s % 60:02d}s" if m else f"{s}s"


def progress(step: int, total: int, first: tuple[int, float] | None, now: float) -> tuple[str, str]:
    """The step field ("12/50") and the ETA ("eta 1m05s"; "" until a second step is logged) of a
    step line; ``first`` is (step, time) of this process's first logged step: the rate is measured
    from there, so model build, compile and a checkpoint load do not count."""
    eta = ""
    if first is not None and step > first[0] and total > step:
        eta = "eta " + _duration((now - first[1]) / (step - first[0]) * (total - step))
    elif total <= step:
        eta = "eta 0s"
    return f"{step}/{total}", eta


class _StepProgress(logging.Filter):
    """Rewrites torchtitan's "step: 12" of the first step line to "step: 12/50  eta 1m05s"."""

    _STEP = re.compile(r"step:\s*\d+")

    def __init__(self, field: str, eta: str):
        super().__init__()
        self.field, self.eta, self.done = field, eta, False

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.done and isinstance(record.msg, str) and self._STEP.search(record.msg):
            new = f"step: {self.field}" + (f"  {self.eta}" if self.eta else "")
            record.msg = self._STEP.sub(new, record.msg, count=1)
            self.done = True
        return True


_OPEN = weakref.WeakSet()  # the open JSONL loggers of this process (rank 0), for note_resume


def note_resume(step: int, checkpoint: str) -> None:
    """Append a resume record to every open metrics JSONL file: ``{"step": N, "event": "resume",
    "checkpoint_step": N, "checkpoint": path}``. The steps logged after it replace earlier records
    of the same steps (a reader keeps the last value of each step)."""
    for lg in list(_OPEN):
        lg.resumed = True
        lg.log_event({"event": "resume", "checkpoint_step": step, "checkpoint": checkpoint}, step)


def _cut_partial_line(path: str) -> int:
    """Drop a last line without its newline from ``path`` (a write cut short); bytes dropped."""
    with open(path, "rb+") as f:
        end = f.seek(0, os.SEEK_END)
        pos = end
        while pos > 0:
            n = min(65536, pos)
            f.seek(pos - n)
            chunk = f.read(n)
            if pos == end and chunk.endswith(b"\n"):
                return 0
            i = chunk.rfind(b"\n")
            if i >= 0:
                f.truncate(pos - n + i + 1)
                return end - (pos - n + i + 1)
            pos -= n
        f.truncate(0)
        return end


def _free_name(path: str) -> str:
    root, ext = os.path.splitext(path)
    k = 1
    while os.path.exists(f"{root}.{k}{ext}"):
        k += 1
    return f"{root}.{k}{ext}"


def open_records(path: str, resumed: bool):
    """``path`` opened to append records (unbuffered binary). A resumed run appends (a partial
    last line dropped first); a run from step 0 moves an earlier run's records aside."""
    if os.path.isfile(path) and os.path.getsize(path) > 0:
        if resumed:
            cut = _cut_partial_line(path)
            if cut:
                log.warning(f"Metrics file {path}: dropped its last line ({cut} bytes without a newline: a write "
                            "cut short by a kill or a full disk)")
        else:
            old = _free_name(path)
            os.rename(path, old)
            log.warning(f"Metrics file {path} held the records of an earlier run that this run does not resume: "
                        f"moved to {old}; this run's records start a new {os.path.basename(path)}")
    return open(path, "ab", buffering=0)


class JsonlLogger(BaseLogger):
    def __init__(self, path: str):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self.resumed = False  # set by note_resume before the first record
        self._f = None  # opened at the first record (open_records)
        self._closed = False
        _OPEN.add(self)

    def _write(self, rec: dict) -> None:
        if self._closed:
            return
        if self._f is None:
            self._f = open_records(self.path, self.resumed)
        data = memoryview((json.dumps(rec) + "\n").encode())
        start = self._f.seek(0, os.SEEK_END)
        try:
            done = 0
            while done < len(data):
                done += self._f.write(data[done:])
        except OSError as e:
            self._f.truncate(start)  # no partial record stays behind
            if space_error(e) is None:
                raise
            raise DiskSpaceError(f"metrics file {self.path}: the disk is full while writing the record of step "
                                 f"{rec.get('step')} ({e.strerror}); the records so far are intact: free space "
                                 "and rerun to resume from the last checkpoint") from None

    def log_event(self, fields: dict, step: int) -> None:
        self._write({"step": step, "time": time.time(), **fields})

    def log(self, metrics: dict, step: int) -> None:
        self._write({"step": step, "time": time.time(), **{k: _plain(v) for k, v in metrics.items()
                                                           if not (k == "mfu(%)" and v != v)}})  # NaN: no peak FLOPS

    def close(self) -> None:
        self._closed = True
        if self._f is not None and not self._f.closed:
            self._f.close()


class NSAMetricsProcessor(MetricsProcessor):
    def __init__(self, job_config, parallel_dims, tag: str | None = None):
        nsa = getattr(job_config, "nsa", None)
        self.telemetry_every = getattr(nsa, "telemetry_every", 0)
        threshold = getattr(nsa, "gate_collapse_threshold", 0.95)
        steps = getattr(nsa, "gate_collapse_steps", 10)
        tm.validate_settings(self.telemetry_every, threshold, steps)
        self.collapse = tm.GateCollapseMonitor(float(threshold), steps)
        self._nsa_layers: list = []
        self._pending: dict | None = None
        self.ops: OpsMonitor | None = None
        self._dl_seen = 0  # data_loading_times entries already counted by ops
        self._first_logged: tuple[int, float] | None = None  # (step, time): the ETA's rate
        self.total_steps = job_config.training.steps  # as configured (a halt lowers training.steps)
        self.validation_extra: dict = {}  # the validator's retrieval metrics, for the next validation record
        super().__init__(job_config, parallel_dims, tag)
        self._base_logger = self.logger
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

    def log_validation(self, loss, step, extra_metrics=None):
        extra, self.validation_extra = {**self.validation_extra, **(extra_metrics or {})}, {}
        super().log_validation(loss, step, extra or None)
        if extra:
            log.info(f"validate step: {step:2}  retrieval: {retrieval_summary(extra)}")

    # ------------------------------------------------------------------ NSA telemetry
    @property
    def model_parts(self):
        return self._model_parts

    @model_parts.setter
    def model_parts(self, parts) -> None:
        self._model_parts = parts
        if not parts or self.telemetry_every <= 0:
            return

        self._nsa_layers = [m for part in parts for m in part.modules() if isinstance(m, NSAAttention)]
        for m in self._nsa_layers:
            m.telemetry = True
        log.info(f"NSA telemetry on for {len(self._nsa_layers)} layers: every {self.telemetry_every} steps, "
                 f"gate collapse at mean > {self.collapse.threshold} for {self.collapse.steps} steps")

    def telemetry_due(self, step: int) -> bool:
        return bool(self._nsa_layers) and (step == 1 or step % self.telemetry_every == 0)

    def collect_telemetry(self, step: int) -> dict:
        """Read, DP-average, print and check the layers' stats; returns the ``nsa/...`` metrics."""
        stats = torch.stack([m.telemetry_stats.detach().float() for m in self._nsa_layers])
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(stats)  # only data parallelism: the world is the DP group
            stats = stats / dist.get_world_size()
        stats = stats.cpu()
        enabled = [tuple(m.branch_names[b] != "none" for b in tm.BRANCHES) for m in self._nsa_layers]
        metrics = tm.telemetry_metrics(stats, enabled)
        rank0 = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
        if rank0:
            log.info(f"NSA telemetry step {step}:")
            for i, row in enumerate(stats):
                log.info("  " + tm.format_layer_line(i, row, enabled[i]))
        means = {(i, b): float(row[tm.GATE_MEAN][j]) for i, row in enumerate(stats)
                 for j, b in enumerate(tm.BRANCHES) if enabled[i][j]}
        for msg in self.collapse.update(step, means):  # the same DP-averaged values on every rank
            if rank0:
                log.warning(msg)
        metrics["nsa/gate_collapsed"] = self.collapse.collapsed
        self._tb_histograms(stats, enabled, step)
        return metrics

    def _tb_histograms(self, stats, enabled, step: int) -> None:
        for lg in getattr(self._base_logger, "_loggers", [self._base_logger]):
            if not isinstance(lg, TensorBoardLogger):
                continue
            for i, row in enumerate(stats):
                h = tm.histogram_raw(row) if enabled[i][1] else None
                if h is not None:
                    tag = f"nsa/layer{i}/sel_dist_hist"
                    lg.writer.add_histogram_raw(tag if lg.tag is None else f"{lg.tag}/{tag}", global_step=step, **h)

    def should_log(self, step: int) -> bool:
        if self.ops is not None:  # once per step, every rank, before the checkpoint save
            waits = self.data_loading_times[self._dl_seen:]
            self._dl_seen = len(self.data_loading_times)
            self.ops.step_done(step, sum(waits))
        due = super().should_log(step)
        if self.telemetry_due(step):
            metrics = self.collect_telemetry(step)
            if due:
                self._pending = metrics  # merged into this step's record by log()
            else:
                self.logger.log(metrics, step)
        return due

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        if self._pending:
            extra_metrics = {**(extra_metrics or {}), **self._pending}
            self._pending = None
        now = time.perf_counter()
        shown = _StepProgress(*progress(step, self.total_steps, self._first_logged, now))
        if self._first_logged is None:
            self._first_logged = (step, now)
        log.addFilter(shown)
        try:
            self._log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)
        finally:
            log.removeFilter(shown)

    def _log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics):
        if self.ops is None:
            super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra_metrics)
            return
        data = self.ops.window_metrics(self.ntokens_since_last_log, time.perf_counter() - self.time_last_log,
                                       self.parallel_dims.non_data_parallel_size)
        extra_metrics = {**(extra_metrics or {}), **data}
        line = self.ops.step_line_filter(data)  # the data wait, appended to torchtitan's step line
        log.addFilter(line)
        try:
            super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra_metrics)
        finally:
            log.removeFilter(line)
            self._dl_seen = 0  # super().log cleared data_loading_times

    def close(self) -> None:
        super().close()
        _remove_if_empty(os.path.join(self.job_config.job.dump_folder,
                                      self.job_config.comm.save_traces_folder))


def _remove_if_empty(folder: str) -> None:
    """torchtitan creates the flight recorder's dump folder (``[comm] save_traces_folder``) at start;
    a run that dumped nothing leaves no empty folder behind."""
    try:
        os.rmdir(folder)  # only an empty folder; a missing one, or one with dumps, stays as it is
    except OSError:
        pass


def build_metrics_processor(job_config, parallel_dims, model_args=None, tag: str | None = None):
    """TrainSpec.build_metrics_processor_fn."""
    return NSAMetricsProcessor(job_config, parallel_dims, tag)
