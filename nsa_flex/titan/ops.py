"""Operating long runs: stall watchdog, on-demand stack dumps, data-wait telemetry.

Configured by the ``[ops]`` section (:class:`nsa_flex.titan.job_config.Ops`). The trainer
(:class:`nsa_flex.titan.trainer.NSATrainer`) owns one ``OpsMonitor``: built and started (every rank,
main thread: signal handlers can only be installed there) right after the process group exists,
``attach(trainer)`` so the watchdog reads the step in progress, ``close()`` with the trainer. The
metrics processor (:mod:`nsa_flex.titan.metrics`) calls ``step_done(step, data_wait_s)`` from
``should_log(step)``, which torchtitan's ``train_step`` calls once per step on every rank. Halting
(halt file, SIGTERM, Ctrl-C) and the non-finite guard are the trainer's.

Stall watchdog. A daemon thread per rank checks every ``poll`` seconds that a step completed within
``stall_timeout_s`` (``stall_timeout_first_s`` until this process's first step: build, checkpoint
load, compile). If not, it writes ``<dump_folder>/stalls/step-N-rank-R.txt`` (N = the step that did
not complete): a header, every Python thread's stack (``faulthandler``, innermost call first), and
on CUDA ``torch.cuda.memory_summary()`` (CPU: the peak RSS); it logs one line naming the file and
the innermost frame of the training (main) thread that lies in this project; with
``stall_exit_code`` > 0 it then ends the process with that code (``os._exit``: the main thread is
stuck). Ranks need no communication: in a collective hang every rank stalls and dumps.

SIGUSR1. Python's C-level signal handler writes the signal number into a wakeup pipe
(``signal.set_wakeup_fd``) at once, whatever the main thread is doing; the watchdog thread reads it
and writes the dump itself, so a dump is written even while the main thread is blocked inside C
code (a CUDA sync, an NCCL wait, a blocked read), and the run goes on. Same file name and content.
(``faulthandler.register`` on SIGUSR1 wrote nothing on an H100 once torch.compile had run, though
the signal was caught and unblocked.)

Non-finite steps (the trainer's guard, ``[ops] halt_on_nonfinite``) raise :class:`NonFiniteError`;
``nsa-train`` exits with :data:`EXIT_NONFINITE` (3). How one bad input spreads (CPU, torch 2.13): a
NaN at one position of one batch row turns every position of that row to NaN, earlier positions and
other documents too, on the layer's reference path and with SDPA causal attention alike (flash and
math kernels): the masked probability 0 meets the NaN value in the probabilities-times-values
product (0 * NaN = NaN); other batch rows stay finite. GPU kernels that skip fully masked blocks may
keep earlier blocks finite (not checked). In training the backward then reaches every weight, so the
guard stops the run at that step.

Data wait. torchtitan times each ``next(data_iterator)``; per step the processor passes the sum
here. Logged (console step line, metrics.jsonl, TensorBoard) per log window as
``time_metrics/data_wait_per_step(s)``, ``time_metrics/data_wait(%)`` and
``throughput_excl_data(tps)`` (tokens / (window time - data wait)); a warning when the wait exceeds
``data_wait_warn_share`` of the step time for ``data_wait_warn_steps`` consecutive steps.
"""

import faulthandler
import logging
import os
import re
import resource
import select
import signal
import socket
import sys
import tempfile
import threading
import time
import weakref

import torch

from torchtitan.tools.logging import logger as log

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STALLS_DIR = "stalls"


# ----------------------------------------------------------------------------- config
def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def validate(ops) -> list[str]:
    """Every problem of an ``[ops]`` section, each naming the field and its allowed range."""
    errs = []
    if not _num(ops.stall_timeout_s) or ops.stall_timeout_s < 0:
        errs.append(f"ops.stall_timeout_s={ops.stall_timeout_s!r}: must be a number >= 0 (0 = watchdog off)")
    if not _num(ops.stall_timeout_first_s) or ops.stall_timeout_first_s < 0:
        errs.append(f"ops.stall_timeout_first_s={ops.stall_timeout_first_s!r}: must be a number >= 0")
    elif _num(ops.stall_timeout_s) and ops.stall_timeout_s > 0 and ops.stall_timeout_first_s < ops.stall_timeout_s:
        errs.append(f"ops.stall_timeout_first_s={ops.stall_timeout_first_s!r}: must be >= ops.stall_timeout_s "
                    f"({ops.stall_timeout_s!r}): the first step also builds and compiles")
    if not _int(ops.stall_exit_code) or not 0 <= ops.stall_exit_code <= 255:
        errs.append(f"ops.stall_exit_code={ops.stall_exit_code!r}: must be an integer in [0, 255] (0 = do not exit)")
    if not isinstance(ops.halt_file, str) or os.sep in ops.halt_file or ops.halt_file in (".", ".."):
        errs.append(f"ops.halt_file={ops.halt_file!r}: must be a file name inside job.dump_folder (\"\" = off)")
    if not _num(ops.data_wait_warn_share) or not 0 < ops.data_wait_warn_share <= 1:
        errs.append(f"ops.data_wait_warn_share={ops.data_wait_warn_share!r}: must be a number in (0, 1]")
    if not _int(ops.data_wait_warn_steps) or ops.data_wait_warn_steps < 1:
        errs.append(f"ops.data_wait_warn_steps={ops.data_wait_warn_steps!r}: must be an integer >= 1")
    if not _int(ops.long_run_steps) or ops.long_run_steps < 0:
        errs.append(f"ops.long_run_steps={ops.long_run_steps!r}: must be an integer >= 0 (0 = no check)")
    return errs


class OpsConfigError(ValueError):
    pass


EXIT_NONFINITE = 3  # nsa-train's exit code when the non-finite guard stops a run
EXIT_HALTED = 4  # nsa-train's exit code after a halt (halt file, SIGTERM, Ctrl-C): a checkpoint to resume
NONFINITE_DIR = "nonfinite"  # under the checkpoint folder: checkpoints set aside by the non-finite guard


class NonFiniteError(RuntimeError):
    """The loss or the gradient norm was not finite at a step; nothing of that step was saved."""


# ----------------------------------------------------------------------------- stack dumps
_THREAD_RE = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+)")
_FRAME_RE = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def thread_frames(text: str) -> dict[int, list[tuple[str, int, str]]]:
    """Parse a faulthandler all-threads dump: thread ident -> [(file, line, function)], innermost first."""
    out: dict[int, list] = {}
    cur = None
    for line in text.splitlines():
        m = _THREAD_RE.match(line)
        if m:
            cur = out.setdefault(int(m.group(1), 16), [])
            continue
        m = _FRAME_RE.match(line)
        if m and cur is not None:
            cur.append((m.group(1), int(m.group(2)), m.group(3)))
    return out


def _in_project(path: str, root: str) -> bool:
    if not os.path.isabs(path):  # "<string>", "<frozen runpy>": code without a file
        return False
    path = os.path.abspath(path)
    return path.startswith(root + os.sep) and "site-packages" not in path


def innermost_project_frame(text: str, ident: int | None = None, root: str = PROJECT_ROOT) -> str:
    """'rel/path.py:LINE in func' of the innermost frame of thread ``ident`` (default: the main
    thread) that lies in the project; its innermost frame of any file when none does."""
    frames = thread_frames(text).get(threading.main_thread().ident if ident is None else ident, [])
    for path, line, func in frames:
        if _in_project(path, root):
            return f"{os.path.relpath(os.path.abspath(path), root)}:{line} in {func}"
    if frames:
        path, line, func = frames[0]
        return f"{path}:{line} in {func} (no project frame)"
    return "(main thread not in the dump)"


def _memory_text(device_type: str, timeout: float = 10.0) -> str:
    """CUDA allocator summary (CPU: peak RSS), from a helper thread: the allocator's lock may be held
    by the stuck main thread, and the stacks are already on disk by then."""
    out = ["(memory summary timed out)"]

    def run():
        if device_type == "cuda" and torch.cuda.is_available():
            out[0] = torch.cuda.memory_summary(abbreviated=True)
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
            out[0] = f"CPU process peak RSS: {peak / 2**30:.2f} GiB"

    t = threading.Thread(target=run, daemon=True, name="nsa-ops-memory")
    t.start()
    t.join(timeout)
    return out[0]


def _flush_logs() -> None:
    for h in list(log.handlers) + list(logging.getLogger().handlers):
        try:
            h.flush()
        except Exception:
            pass


# ----------------------------------------------------------------------------- compile time
# the phases of `compile_seconds` a lap names beside its total (torch's dynamo_timed phase names)
COMPILE_PARTS = (("tracing", "dynamo tracing"), ("entire_backward_compile", "backward graphs"),
                 ("async_compile.wait", "waiting for kernel compiles"))


def compile_seconds() -> dict[str, float]:
    """Seconds torch.compile has spent in this process so far, cumulative: "total" (dynamo's frame
    compiles -- tracing, AOT autograd, inductor and its kernels' compiles -- and the backward graphs
    AOT autograd compiles at their first backward), "tracing" (the frames' time outside their
    backend), and torch's own phases by name; all 0 before the first compile."""
    from torch._dynamo.utils import calculate_time_spent

    t = {k: float(v) for k, v in calculate_time_spent().items()}
    frame = t.get("entire_frame_compile", 0.0)
    t["tracing"] = max(frame - t.get("backend_compile", 0.0), 0.0)
    t["total"] = frame + t.get("entire_backward_compile", 0.0)
    return t


class CompileClock:
    """One line per stretch of work that compiled for at least ``min_s`` seconds: what compiled
    (the step, or the validation and checkpoint after one), for how long and where the time went
    (`COMPILE_PARTS`) -- the first step's and the first validation's compiles, and any recompile
    later (where the dense warm-up ends, a new shape), each visible in the console."""

    def __init__(self, min_s: float = 1.0, clock=compile_seconds):
        self.min_s, self.clock = min_s, clock
        self.seen = clock()

    def lap(self, what: str) -> str | None:
        now = self.clock()
        spent = {k: v - self.seen.get(k, 0.0) for k, v in now.items()}
        self.seen = now
        if spent.get("total", 0.0) < self.min_s:
            return None
        parts = ", ".join(f"{name} {spent[k]:.0f} s" for k, name in COMPILE_PARTS if spent.get(k, 0.0) >= 0.5)
        return (f"compile: {what} compiled for {spent['total']:.0f} s ({parts + '; ' if parts else ''}"
                f"torch.compile in this process: {now['total']:.0f} s)")


# ----------------------------------------------------------------------------- data wait
class DataStallMonitor:
    """Warns once when the loader's share of step time exceeds ``share`` for ``steps`` consecutive
    steps; re-arms when a step falls below it."""

    def __init__(self, share: float, steps: int):
        self.share, self.steps = float(share), int(steps)
        self.run = 0  # consecutive steps above the share
        self.waits: list[float] = []
        self.warned = False

    def update(self, step: int, wait_s: float, step_s: float) -> str | None:
        frac = wait_s / step_s if step_s > 0 else 0.0
        if frac <= self.share:
            self.run, self.waits, self.warned = 0, [], False
            return None
        self.run += 1
        self.waits.append(wait_s)
        if self.run >= self.steps and not self.warned:
            self.warned = True
            mean = sum(self.waits[-self.steps:]) / self.steps
            return (f"ops: data loader stall: waiting for data took more than {100 * self.share:g}% of the step "
                    f"time for {self.run} steps (step {step}: {100 * frac:.0f}%, mean wait {mean:.3f} s/step); "
                    "the input pipeline limits throughput")
        return None


class _AppendToStepLine(logging.Filter):
    """Appends ``suffix`` to the first record with "step:" (torchtitan's console step line)."""

    def __init__(self, suffix: str):
        super().__init__()
        self.suffix, self.done = suffix, False

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.done and isinstance(record.msg, str) and "step:" in record.msg:
            record.msg = f"{record.msg}  {self.suffix}"
            self.done = True
        return True


# ----------------------------------------------------------------------------- the monitor
def _ignore_signal(signum, frame) -> None:
    """Python-level SIGUSR1 handler: nothing to do in the main thread; installing a Python handler
    is what makes the C handler write the signal into the wakeup pipe the watchdog reads."""


def _dist_info() -> tuple[int, int]:
    d = torch.distributed
    if d.is_available() and d.is_initialized():
        return d.get_rank(), d.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class OpsMonitor:
    def __init__(self, job_config, device_type: str | None = None):
        cfg = job_config.ops
        errs = validate(cfg)
        if errs:
            raise OpsConfigError("invalid [ops] settings: " + "; ".join(errs))
        self.cfg = cfg
        self.job_config = job_config
        self.dump_folder = job_config.job.dump_folder
        self.stall_dir = os.path.join(self.dump_folder, STALLS_DIR)
        self.device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        self.rank, self.world = _dist_info()
        self.data = DataStallMonitor(cfg.data_wait_warn_share, cfg.data_wait_warn_steps)
        self.poll = 0.5 if cfg.stall_timeout_s == 0 else max(0.05, min(1.0, cfg.stall_timeout_s / 20))
        # watchdog state (written by the main thread, read by the watchdog thread)
        self.t_start = self.t_beat = time.monotonic()
        self.last_step = 0  # last completed step (0 = none yet in this process)
        self.first_done = False
        self._dumped_step = None  # step whose stall is already dumped
        # data-wait window (since the last log)
        self.win_wait = 0.0
        self.win_steps = 0
        self._trainer = None
        self._thread = None
        self._stop = threading.Event()
        self._pipe = None
        self._old_wakeup = -1
        self._old_handlers: dict = {}
        self.started = False

    # ------------------------------------------------------------------ setup / teardown
    def start(self) -> None:
        """The SIGUSR1 dump pipe and the watchdog thread (main thread, every rank)."""
        in_main = threading.current_thread() is threading.main_thread()
        if self.cfg.dump_on_sigusr1 and in_main:
            r, w = os.pipe()
            os.set_blocking(w, False)  # set_wakeup_fd needs it; a full pipe drops the byte
            self._pipe = (r, w)
            self._old_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
            if self._old_wakeup != -1:
                log.warning(f"ops: signal wakeup fd {self._old_wakeup} replaced by the SIGUSR1 dump "
                            "pipe for this run (restored at the end)")
            self._old_handlers[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, _ignore_signal)
        if self.cfg.stall_timeout_s > 0 or self._pipe is not None:
            self._thread = threading.Thread(target=self._watch, daemon=True, name="nsa-ops-watchdog")
            self._thread.start()
        self.started = True
        wd = (f"stall watchdog {self.cfg.stall_timeout_first_s:g} s first step, then {self.cfg.stall_timeout_s:g} s"
              + (f", exit code {self.cfg.stall_exit_code}" if self.cfg.stall_exit_code else "")
              if self.cfg.stall_timeout_s > 0 else "stall watchdog off")
        log.info(f"ops: rank {self.rank} pid {os.getpid()}: {wd}; dumps in {self.stall_dir}"
                 f"{' (also on SIGUSR1)' if self._pipe else ''}")

    def attach(self, trainer) -> None:
        self._trainer = weakref.ref(trainer) if trainer is not None else None

    @property
    def trainer(self):
        return self._trainer() if self._trainer is not None else None

    def close(self) -> None:
        if not self.started:
            return
        self.started = False
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.poll + 1)
        if self._pipe is not None:
            if threading.current_thread() is threading.main_thread():
                signal.set_wakeup_fd(self._old_wakeup)
            for fd in self._pipe:
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._pipe = None
        if threading.current_thread() is threading.main_thread():
            for sig, old in self._old_handlers.items():
                signal.signal(sig, old)
        self._old_handlers.clear()

    # ------------------------------------------------------------------ per step (main thread)
    def step_done(self, step: int, data_wait_s: float) -> None:
        now = time.monotonic()
        step_s = now - self.t_beat
        first = not self.first_done
        self.t_beat, self.last_step, self.first_done = now, step, True
        self.win_wait += data_wait_s
        self.win_steps += 1
        if not first:  # the first step's time is build + compile
            msg = self.data.update(step, data_wait_s, step_s)
            if msg:
                log.warning(f"{msg} (rank {self.rank})")

    def window_metrics(self, ntokens: int, window_s: float, non_dp_size: int) -> dict:
        """Data-wait figures of the log window now ending (resets it)."""
        steps = max(1, self.win_steps)
        busy = max(window_s - self.win_wait, 1e-9)
        out = {
            "time_metrics/data_wait_per_step(s)": self.win_wait / steps,
            "time_metrics/data_wait(%)": 100 * self.win_wait / window_s if window_s > 0 else 0.0,
            "throughput_excl_data(tps)": ntokens / (busy * max(1, non_dp_size)),
        }
        self.win_wait, self.win_steps = 0.0, 0
        return out

    @staticmethod
    def console_suffix(m: dict) -> str:
        return (f"data: {1000 * m['time_metrics/data_wait_per_step(s)']:.0f}ms/step "
                f"({m['time_metrics/data_wait(%)']:.1f}%)  "
                f"tps excl. data: {round(m['throughput_excl_data(tps)']):,}")

    def step_line_filter(self, metrics: dict) -> logging.Filter:
        return _AppendToStepLine(self.console_suffix(metrics))

    # ------------------------------------------------------------------ watchdog thread
    def _step_in_progress(self) -> int:
        tr = self.trainer
        cur = getattr(tr, "step", 0) if tr is not None else 0
        return max(int(cur or 0), self.last_step + 1)

    def _dump_path(self, step: int) -> str:
        base = os.path.join(self.stall_dir, f"step-{step}-rank-{self.rank}")
        path, k = base + ".txt", 1
        while os.path.exists(path):
            k += 1
            path = f"{base}.{k}.txt"
        return path

    def write_dump(self, reason: str, stacks: str, step: int | None = None) -> tuple[str, str]:
        """Write one dump file (of ``step``, default the step in progress); returns (path,
        innermost project frame of the main thread)."""
        step = self._step_in_progress() if step is None else step
        where = innermost_project_frame(stacks)
        path = self._dump_path(step)
        os.makedirs(self.stall_dir, exist_ok=True)
        since = time.monotonic() - self.t_beat
        with open(path, "w") as f:
            f.write(f"nsa-flex ops dump: {reason}\n"
                    f"step: {step} (in progress; last completed: {self.last_step or 'none in this process'})\n"
                    f"rank: {self.rank} of {self.world}   pid: {os.getpid()}   host: {socket.gethostname()}\n"
                    f"time: {time.strftime('%Y-%m-%d %H:%M:%S')}   seconds since the last completed step "
                    f"(or start): {since:.1f}\n"
                    f"innermost project frame (main thread): {where}\n\n"
                    "--- Python thread stacks (faulthandler, innermost call first) ---\n")
            f.write(stacks.rstrip() + "\n\n")
            f.flush()  # the stacks are on disk even if the memory summary hangs
            f.write(f"--- memory ({self.device_type}) ---\n{_memory_text(self.device_type)}\n")
        return path, where

    def stacks_now(self) -> str:
        with tempfile.TemporaryFile("w+") as tf:
            faulthandler.dump_traceback(file=tf, all_threads=True)
            tf.seek(0)
            return tf.read()

    def _watch(self) -> None:
        # SIGUSR1 goes to another thread, which is not blocked reading the pipe
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        while not self._stop.is_set():
            try:
                if self._pipe is not None:
                    r, _, _ = select.select([self._pipe[0]], [], [], self.poll)
                    # one byte per caught signal (SIGTERM's too): dump for SIGUSR1 only
                    if r and signal.SIGUSR1 in os.read(self._pipe[0], 4096) and not self._stop.is_set():
                        path, where = self.write_dump("SIGUSR1 (on demand; the run goes on)", self.stacks_now())
                        log.info(f"ops: SIGUSR1 dump on rank {self.rank}: {path}; innermost project frame: {where}")
                        continue
                else:
                    self._stop.wait(self.poll)
                self._check_stall()
            except Exception as e:  # never let the watchdog kill or silence itself
                if self._stop.is_set():
                    return
                log.warning(f"ops: watchdog error on rank {self.rank}: {type(e).__name__}: {e}")
                self._stop.wait(self.poll)

    def _check_stall(self) -> None:
        limit = self.cfg.stall_timeout_s if self.first_done else self.cfg.stall_timeout_first_s
        if self.cfg.stall_timeout_s <= 0:
            return
        idle = time.monotonic() - self.t_beat
        step = self._step_in_progress()
        if idle <= limit or self._dumped_step == step:
            return
        self._dumped_step = step
        path, where = self.write_dump(
            f"stall: no training step completed in {idle:.1f} s (limit {limit:g} s"
            f"{', first step' if not self.first_done else ''})", self.stacks_now())
        log.error(f"ops: STALL on rank {self.rank}: no training step completed in {idle:.1f} s (limit {limit:g} s, "
                  f"step {step}); stacks in {path}; innermost project frame: {where}")
        if self.cfg.stall_exit_code:
            log.error(f"ops: exiting with code {self.cfg.stall_exit_code} (ops.stall_exit_code) so the run "
                      "can be restarted from its last checkpoint")
            _flush_logs()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(self.cfg.stall_exit_code)
