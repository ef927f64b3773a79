"""``NSATrainer``: torchtitan's ``Trainer`` with the run control of nsa_flex as methods.

Started by ``nsa-train`` and by ``torchrun ... -m nsa_flex.titan.train`` (:mod:`nsa_flex.titan.train`).
The training loop is torchtitan's (``Trainer.train``); this subclass overrides six public methods:

  * ``__init__``: checks the versions (:func:`check_versions`), applies the CPU device shim
    (:mod:`nsa_flex.titan.cpu`, no CUDA only) and the console filter (:mod:`nsa_flex.titan.console`)
    before torchtitan reads the device, then gives the checkpoint manager nsa_flex's checks
    (:class:`nsa_flex.titan.checkpoint.NSACheckpointManager`);
  * ``init_distributed``: right after the process group exists, :meth:`start_run_control`: rank 0
    locks the dump and checkpoint folders (:mod:`nsa_flex.titan.runlock`), SIGTERM / SIGINT
    handlers, a gloo group for the ranks' agreement, the ``[ops]`` monitor (stall watchdog, SIGUSR1
    dumps, data wait);
  * ``train``: torchtitan's loop, without its closing 2-second wait for other ranks in a run of one
    process;
  * ``train_step``: before torchtitan's step, the selection's dense warm-up
    (``[nsa] sel_dense_steps``: :func:`nsa_flex.titan.model.set_dense_selection`); after it
    (optimizer step done, checkpoint not yet saved), :meth:`end_of_step` decides whether to halt or
    to stop on a non-finite step;
  * ``should_continue_training``: False once halted (``training.steps`` is never changed);
  * ``post_dataloading_process``: with context parallelism on the NSA model, this rank's
    contiguous shard of the inputs and labels (:mod:`nsa_flex.context_parallel`) in place of
    torchtitan's (zig-zag shards, position ids, ring attention), which the llama3 baseline
    (:mod:`nsa_flex.titan.llama3_baseline`) keeps.

Halt. ``<dump_folder>/<[ops] halt_file>`` (checked by every rank after every step), SIGTERM or a
first SIGINT (Ctrl-C): the ranks agree (one MAX all-reduce of two flags on the gloo group when
world size > 1), the checkpoint of this step is forced to a full "last step" checkpoint (also with
``last_save_model_only``: it must resume), and the loop ends: exit code 4
(:data:`nsa_flex.titan.ops.EXIT_HALTED`, read by the entry point from ``halted_at``; a halt at the
last step is a finished run, 0). Rerunning the same command resumes from it. Rank 0 removes the
halt file; a halt file found at the start (left from before this run) is removed with a warning.
Every later SIGTERM is the same request (``timeout`` and job schedulers signal the process and then
its whole process group, and one that will not wait sends SIGKILL); a second Ctrl-C ends the process
at once (SIGINT's default action), without a checkpoint. The halt's console line lists the signals
received, with their times.

Non-finite guard (``[ops] halt_on_nonfinite``, on by default). After every optimizer step each rank
checks that its gradients are finite (one fused norm and one host sync per step; a non-finite loss
or grad norm makes them NaN/inf: torchtitan clips with the non-finite norm), the ranks agree, and
every rank writes an ops dump (``stalls/step-N-rank-R.txt``) and raises
:class:`nsa_flex.titan.ops.NonFiniteError` naming the step and the checkpoint to resume from (exit
code 3 from the entry point). The step's weights are never saved; the checkpoint of the step
before (N - 1), finite but the state whose next loss was not (an exploding update is already in
it), is moved to ``<checkpoint folder>/nonfinite/step-(N-1)`` by rank 0, so the newest checkpoint
left, the one a rerun resumes from, is the last one whose next step's loss was finite. How one bad
input spreads is described in :mod:`nsa_flex.titan.ops`.
"""

import logging
import os
import re
import shutil
import signal
import threading
import time

import torch
import torchtitan.train as titan_train
from torchtitan.tools.logging import logger as log
from torchtitan.train import Trainer

from nsa_flex.errors import UserError

from . import checkpoint, console, cpu
from .model import set_dense_selection
from .ops import NONFINITE_DIR, CompileClock, NonFiniteError, OpsMonitor
from .parallelize import owns_context_parallel, shard_batch
from .runlock import check_writable, lock_run

TORCHTITAN_VERSION = "0.2.2"  # the Trainer methods overridden here and every patch target this version
TORCH_RANGE = ((2, 11), (2, 15))  # [low, high) as (major, minor), as in pyproject.toml


def _ignore_signal(signum, frame) -> None:
    """SIGCHLD once the run is stopping: a child's exit is no error then."""


class VersionError(UserError, RuntimeError):
    """torchtitan or torch outside the versions nsa_flex's trainer is written for."""


def check_versions(titan_version: str | None = None, torch_version: str | None = None) -> None:
    """torchtitan == :data:`TORCHTITAN_VERSION` and torch in :data:`TORCH_RANGE`; else one
    :class:`VersionError` naming the installed versions."""
    import torchtitan

    titan_version = torchtitan.__version__ if titan_version is None else titan_version
    torch_version = torch.__version__ if torch_version is None else torch_version
    errs = []
    if titan_version != TORCHTITAN_VERSION:
        errs.append(f"torchtitan {titan_version} is installed, nsa_flex.titan needs torchtitan=={TORCHTITAN_VERSION}")
    m = re.match(r"(\d+)\.(\d+)", torch_version)
    lo, hi = TORCH_RANGE
    if not m or not lo <= (int(m.group(1)), int(m.group(2))) < hi:
        errs.append(f"torch {torch_version} is installed, nsa_flex.titan needs torch>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}")
    if errs:
        raise VersionError("; ".join(errs) + " (the trainer subclass and its patches are written for those versions)")


def _dist_info() -> tuple[int, int]:
    d = torch.distributed
    if d.is_available() and d.is_initialized():
        return d.get_rank(), d.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class _EndOfRun(logging.Filter):
    """torchtitan's "Training completed" after a halt (HALT file, SIGTERM, Ctrl-C) says where it
    stopped; after no step at all (the resumed checkpoint is already at training.steps) it says
    how to train further."""

    def __init__(self, trainer):
        super().__init__()
        self.trainer = trainer

    def filter(self, record: logging.LogRecord) -> bool:
        t = self.trainer
        if record.msg == "Training completed" and t.halted_at is not None:
            record.msg = (f"Training halted after step {t.halted_at} of "
                          f"{t.job_config.training.steps} ({t.halt_reason})")
            record.args = None
        elif record.msg == "Training completed" and t.steps_run == 0:
            steps = t.job_config.training.steps
            record.msg = (f"Nothing to train: the run is at step {t.step} of --training.steps {steps}; "
                          f"raise --training.steps (e.g. --training.steps {steps * 2}) to train further")
            record.args = None
        return True


class _TimeWithoutSleep:
    """``time`` for torchtitan.train while one process trains (``NSATrainer.train``): ``sleep`` does
    not wait, everything else is the time module's."""

    @staticmethod
    def sleep(seconds: float) -> None:
        pass

    def __getattr__(self, name):
        return getattr(time, name)


class NSATrainer(Trainer):
    def __init__(self, job_config):
        check_versions()
        cpu.maybe_apply()  # before Trainer.__init__ reads torchtitan's device_type / device_module
        console.setup()
        self.init_run_control(job_config)
        try:
            super().__init__(job_config)
        except BaseException:  # torchtitan's main closes only a built trainer
            self.stop_run_control()
            raise
        checkpoint.adopt(self.checkpointer)
        self.metrics_processor.ops = self.ops

    # ------------------------------------------------------------------ setup / teardown
    def init_run_control(self, job_config) -> None:
        """The run-control state (no side effects)."""
        self.job_config = job_config
        self.ops: OpsMonitor | None = None
        self.halt_requested: str | None = None  # the signal's name, set by SIGTERM / SIGINT
        self.halt_reason: str | None = None
        self.halted_at: int | None = None
        self._dense_selection = False  # the selection's dense warm-up was on in the last step
        self.compile_clock = CompileClock()  # console lines for the work that compiled
        self.steps_run = 0  # steps trained by this process (0: the run was already at training.steps)
        self.rank, self.world = _dist_info()
        self._signals: list[tuple[str, float]] = []  # (name, time.monotonic()) of each stop signal
        self._old_handlers: dict = {}
        self._group = None
        self._locks: list = []  # the run locks (rank 0)
        self._end = None  # the "Training completed" rewrite after a halt
        ops_cfg = job_config.ops
        self.halt_path = (os.path.join(job_config.job.dump_folder, ops_cfg.halt_file)
                          if ops_cfg.halt_file else None)

    def init_distributed(self):
        parallel_dims = super().init_distributed()
        self.start_run_control()
        return parallel_dims

    def start_run_control(self) -> None:
        """Run lock (rank 0), signal handlers (main thread), agreement group, ``[ops]`` monitor."""
        jc = self.job_config
        self.rank, self.world = _dist_info()
        self.ops = OpsMonitor(jc)  # validates [ops] first
        if self.rank == 0:  # nsa-train has taken the lock already: a no-op then

            check_writable(jc)
            self._locks = lock_run(jc)
        if jc.ops.halt_on_sigterm and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old_handlers[sig] = signal.signal(sig, self.on_signal)
        d = torch.distributed
        if self.world > 1 and d.is_available() and d.is_initialized():
            # CPU-side agreement on halting: no GPU sync, every rank calls this in the same order
            self._group = d.new_group(backend="gloo")
        if self.rank == 0 and self.halt_path and os.path.exists(self.halt_path):
            log.warning(f"ops: halt file {self.halt_path} was left from before this run (it would stop the run "
                        "after its first step): removed; create it again to halt this run")
            self.consume_halt_file()
        self.ops.attach(self)
        self.ops.start()
        self._end = _EndOfRun(self)
        log.addFilter(self._end)
        halt = " or ".join(x for x in ((f"file {self.halt_path}" if self.halt_path else ""),
                                         ("SIGTERM/Ctrl-C" if jc.ops.halt_on_sigterm else "")) if x) or "off"
        log.info(f"ops: rank {self.rank}: halt: {halt}; non-finite guard "
                 f"{'on' if jc.ops.halt_on_nonfinite else 'off'}")

    def close(self) -> None:
        super().close()
        self.stop_run_control()

    def stop_run_control(self) -> None:
        if self._end is not None:
            log.removeFilter(self._end)
            self._end = None
        if self.ops is not None:
            self.ops.close()
        if threading.current_thread() is threading.main_thread():
            for sig, old in self._old_handlers.items():
                signal.signal(sig, old)
        self._old_handlers.clear()
        for lock in self._locks:
            lock.release()
        self._locks = []
        if self._group is not None:
            try:
                torch.distributed.destroy_process_group(self._group)
            except Exception:
                pass
            self._group = None
        if self.halted_at is not None:
            ck = self.job_config.checkpoint
            path = os.path.join(self.job_config.job.dump_folder, ck.folder, f"step-{self.halted_at}")
            if not ck.enable:
                where = "no checkpoint ([checkpoint] enable = false): a rerun starts from the beginning"
            elif os.path.isfile(os.path.join(path, ".metadata")):  # DCP writes .metadata last
                where = f"checkpoint: {path}; rerun the same command to resume"
            else:
                where = (f"its checkpoint {path} was not written (see the error above); rerunning the same "
                         "command resumes from the newest complete checkpoint")
            log.warning(f"ops: halted after step {self.halted_at} ({self.halt_reason}); {where}")

    # ------------------------------------------------------------------ the loop
    def train(self):
        """torchtitan's loop. Its rank 0 then sleeps 2 s "for other ranks to complete"; a run of one
        process has none, so there the wait is skipped (torchtitan.train's ``time.sleep``, called
        nowhere else in that module, is a no-op while the loop runs)."""
        if self.world > 1:
            return super().train()
        real = titan_train.time
        titan_train.time = _TimeWithoutSleep()
        try:
            return super().train()
        finally:
            titan_train.time = real

    def train_step(self, data_iterator):
        self.steps_run += 1
        dense = any([set_dense_selection(m, self.step) for m in self.model_parts])
        if dense != self._dense_selection:  # at the first step and where the warm-up ends
            self._dense_selection = dense
            log.info(f"nsa: step {self.step}: " + ("dense selection warm-up ([nsa] sel_dense_steps): "
                     "every layer selects every earlier block" if dense else
                     "top-n selection (the model recompiles once where the warm-up ends)"))
        # what compiled since the last step: the validation and checkpoint after it, then this step
        self.log_compile(f"the work after step {self.step - 1} (validation, checkpoint)")
        super().train_step(data_iterator)
        self.log_compile(f"step {self.step}")
        self.end_of_step(self.step)

    def log_compile(self, what: str) -> None:
        line = self.compile_clock.lap(what)
        if line:
            log.info(line)

    def post_dataloading_process(self, input_dict, labels):
        """torchtitan's, but with context parallelism on the NSA model nsa_flex's own sharding
        (`owns_context_parallel`): the model's layers all-gather the keys and values they read
        (`nsa_flex.context_parallel`), so this rank needs only its contiguous shard of the inputs
        and labels. The loss of a shard is its tokens' sum over the whole batch's token count
        (counted before sharding), so the ranks' gradients sum to the one-rank gradient. Any other
        model (the llama3 baseline) takes torchtitan's sharding for its ring attention."""
        if not (self.parallel_dims.cp_enabled and owns_context_parallel(self.model_parts[0])):
            return super().post_dataloading_process(input_dict, labels)
        return shard_batch(self.model_parts[0], input_dict, labels)

    def should_continue_training(self) -> bool:
        return self.halted_at is None and super().should_continue_training()

    # ------------------------------------------------------------------ halt / non-finite
    def on_signal(self, signum, frame) -> None:
        """SIGTERM / SIGINT: halt after this step; SIGTERM again: the same request; SIGINT again
        (Ctrl-C twice): the signal's default action, now."""
        name = signal.Signals(signum).name
        self._signals.append((name, time.monotonic()))
        if self.halt_requested is not None:
            if signum == signal.SIGINT:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            return
        self.halt_requested = name
        # the loader's workers have a process group of their own (nsa_flex.titan.data), but a
        # signal to the whole group also ends inductor's compile workers: torch's SIGCHLD handler
        # would then raise in the middle of the halt's save. A Python no-op, not SIG_DFL: a SIGCHLD
        # already pending when this runs would find no Python handler and raise OSError ("Signal 17
        # ignored due to race condition")
        if threading.current_thread() is threading.main_thread():
            self._old_handlers.setdefault(signal.SIGCHLD, signal.signal(signal.SIGCHLD, _ignore_signal))
        if signum == signal.SIGINT:
            log.warning("ops: Ctrl-C: stopping after this step with a checkpoint (Ctrl-C again: stop at once)")

    def grads_finite(self) -> bool:
        """Every gradient of this rank's model parts is finite (one fused norm, one host sync)."""
        grads = [p.grad for m in (getattr(self, "model_parts", None) or []) for p in m.parameters()
                 if p.grad is not None]
        grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        if not grads:
            return True
        return bool(torch.stack([n.float() for n in torch._foreach_norm(grads)]).sum().isfinite())

    def halt_wanted(self) -> str | None:
        """Why this rank wants to halt (a signal or the halt file), or None."""
        if self.halt_requested:
            return self.halt_requested
        if self.halt_path and os.path.exists(self.halt_path):
            return f"halt file {self.halt_path}"
        return None

    def agree(self, reason: str | None, bad: bool) -> tuple[str | None, bool]:
        """Every rank's (halt reason, non-finite) after one MAX all-reduce (one rank: unchanged)."""
        if self._group is None:
            return reason, bad
        t = torch.tensor([reason is not None, bad], dtype=torch.int32)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self._group)
        if t[0].item() and reason is None:
            reason = "requested on another rank"
        return reason, bool(t[1].item())

    def end_of_step(self, step: int) -> None:
        """After the optimizer step of ``step``, before its checkpoint: stop on a non-finite step
        (:class:`NonFiniteError`), or halt after this step with a full checkpoint."""
        bad = self.job_config.ops.halt_on_nonfinite and not self.grads_finite()
        reason, bad = self.agree(self.halt_wanted(), bad)
        if bad:
            self.stop_nonfinite(step)
        if reason is None:
            return
        self.consume_halt_file()
        if step >= self.job_config.training.steps:  # the last step: the run ends normally anyway
            return
        self.halt_reason, self.halted_at = reason, step
        ckpt = getattr(self, "checkpointer", None)
        if isinstance(ckpt, checkpoint.NSACheckpointManager):
            ckpt.halt_step = step  # saved now as a full "last step" checkpoint, which resumes
        got = ", ".join(f"{n} at +{t - self._signals[0][1]:.2f} s" for n, t in self._signals)
        log.warning(f"ops: halt ({reason}) on rank {self.rank}: stopping after step {step}, saving a checkpoint"
                    + (f" (signals: {got})" if got else ""))

    def stop_nonfinite(self, step: int) -> None:
        path, _ = self.ops.write_dump(f"non-finite loss or gradient norm at step {step}",
                                      self.ops.stacks_now(), step)
        kept, aside = self.set_aside_poisoned(step)
        last = (f"resume point: {kept} (the last checkpoint whose next step's loss was finite)" if kept
                else "no checkpoint to resume from was saved")
        if aside:
            last = f"the checkpoint of step {step - 1} led to it and is set aside as {aside}; " + last
        msg = (f"step {step}: the loss or the gradient norm is not finite (NaN/inf); stopped before saving "
               f"anything of this step; {last}; ops dump {path}. Rerun with a lower --optimizer.lr, "
               f"--training.max_norm or another seed ([ops] halt_on_nonfinite = false trains on)")
        log.error(f"ops: {msg}")
        self.halted_at = None
        raise NonFiniteError(msg)

    def set_aside_poisoned(self, step: int) -> tuple[str | None, str | None]:
        """After a non-finite ``step``: move the checkpoint of ``step - 1`` (it produced the non-finite
        loss) to ``<checkpoint folder>/nonfinite/`` (rank 0 moves, every rank answers the same);
        (the newest checkpoint left or None, where the set-aside one went or None)."""
        ck = self.job_config.checkpoint
        folder = os.path.join(self.job_config.job.dump_folder, ck.folder)
        steps = sorted(int(n[5:]) for n in (os.listdir(folder) if ck.enable and os.path.isdir(folder) else [])
                       if re.fullmatch(r"step-\d+", n) and os.path.isfile(os.path.join(folder, n, ".metadata")))
        aside = None
        if steps and steps[-1] == step - 1:
            aside = os.path.join(folder, NONFINITE_DIR, f"step-{step - 1}")
            if self.rank == 0:
                os.makedirs(os.path.dirname(aside), exist_ok=True)
                if os.path.exists(aside):
                    shutil.rmtree(aside)
                os.rename(os.path.join(folder, f"step-{step - 1}"), aside)
            steps.pop()
        return (os.path.join(folder, f"step-{steps[-1]}") if steps else None), aside

    def consume_halt_file(self) -> None:
        """Rank 0 removes the halt file (all ranks have read it: the agreement came first), so
        rerunning the same command does not halt again."""
        if self.rank == 0 and self.halt_path and os.path.exists(self.halt_path):
            try:
                os.remove(self.halt_path)
            except OSError:
                pass
