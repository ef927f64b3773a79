"""torchrun entry point: torchtitan's ``torchtitan.train`` with :class:`~nsa_flex.titan.trainer.NSATrainer`.

    torchrun --nproc_per_node=N -m nsa_flex.titan.train --job.config_file titan_configs/X.toml [--section.key value ...]

Parses the same flags as ``torchtitan.train`` (torchtitan's ``ConfigManager``, with the ``[nsa]``,
``[ops]``, ... sections of ``[job] custom_config_module``) and runs torchtitan's ``main`` with the
trainer subclass. Before torchtitan starts: the config file exists and is valid TOML, the training
numbers are in range, the folders are writable and rank 0 locks the dump and checkpoint folders. User errors
(:class:`nsa_flex.errors.UserError`, config-parsing errors) are printed as one line, exit code 2;
a non-finite step exits with 3 (:data:`nsa_flex.titan.ops.EXIT_NONFINITE`), a halted run (halt
file, SIGTERM, Ctrl-C; a checkpoint to resume from) with 4 (:data:`nsa_flex.titan.ops.EXIT_HALTED`);
a data loader worker that died (the host's out-of-memory killer, most often), a step out of
memory or a failed torch.compile is one message naming the step and the checkpoint a rerun
resumes from, exit code 1
(:func:`crash_message`).
``--section.field true|false`` of a boolean field is accepted (:func:`bool_flags`). ``nsa-train``
(:mod:`nsa_flex.titan.cli`) is this entry point plus the single-process environment and a default
config.
"""

import contextlib
import dataclasses
import os
import re
import sys
import time

import torch
from torch._dynamo.exc import BackendCompilerFailed
from torch.distributed.checkpoint.api import CheckpointException
from torchtitan.config import ConfigManager, JobConfig
from torchtitan.train import main as titan_main

from nsa_flex.errors import EXIT_USER_ERROR, UserError, find_error, user_error

from . import console, curriculum
from .args import nsa_flex_args
from .checkpoint import newest_complete
from .flags import check_config_file
from .job_config import JobConfig as NSAJobConfig
from .ops import EXIT_HALTED, EXIT_NONFINITE, NonFiniteError
from .parallelize import cpu_data_parallel_problem
from .preflight import range_problems
from .runlock import check_writable, lock_run, release_all
from .trainer import NSATrainer

# how long a rank other than 0 waits on a startup error that rank 0 reports (the launcher stops it
# as soon as rank 0 exits)
RANK0_ERROR_WAIT_S = 60


def merged_job_config():
    """torchtitan's JobConfig merged with nsa_flex's (as ``[job] custom_config_module`` does)."""
    return ConfigManager._merge_configs(JobConfig, NSAJobConfig)


def config_error_message(e: Exception) -> str:
    """A config-parsing error as one line: torchtitan's unknown-field ValueError names the class
    (and suggests a script of torchtitan's repo); say the [section] and its valid fields instead."""
    m = re.match(r"Invalid field names in <class '[\w.]*\.(\w+)'> data: (\{.*?\})", str(e))
    if m:
        for f in dataclasses.fields(merged_job_config()):
            if getattr(f.type, "__name__", "").removeprefix("Merged") == m.group(1):
                names = sorted(x.name for x in dataclasses.fields(f.type) if not x.name.startswith("_"))
                return f"[{f.name}] unknown field(s) {m.group(2)}; valid fields: {', '.join(names)}"
        return f"unknown field(s) {m.group(2)} in [{m.group(1).lower()}]"
    return str(e)


def bool_fields() -> set[str]:
    """``"section.field"`` of every boolean field of the merged JobConfig."""
    out = set()
    for sec in dataclasses.fields(merged_job_config()):
        if dataclasses.is_dataclass(sec.type):
            out.update(f"{sec.name}.{f.name}" for f in dataclasses.fields(sec.type) if f.type in (bool, "bool"))
    return out


def bool_flags(args: list[str]) -> list[str]:
    """``--section.field true|false`` (or ``=true``) of a boolean field as torchtitan's parser takes
    it: ``--section.field`` / ``--section.no_field`` (it rejects the value otherwise)."""
    names, out, i = bool_fields(), [], 0
    while i < len(args):
        a = args[i]
        name, eq, value = a.partition("=")
        key = name[2:].replace("-", "_") if name.startswith("--") else ""
        if not eq and i + 1 < len(args):
            value = args[i + 1]
        if key in names and value.lower() in ("true", "false"):
            sec, field = key.split(".", 1)
            out.append(f"--{key}" if value.lower() == "true" else f"--{sec}.no_{field}")
            i += 1 if eq else 2
            continue
        out.append(a)
        i += 1
    return out


def unknown_flag(args: list[str]) -> str | None:
    """The first ``--section.field`` flag that names no section or field of the merged JobConfig
    (``-`` and ``_`` alike; ``--section.no-field`` negates a boolean field), said in one line with
    the valid names; None when every flag is known (tyro would print a boxed panel instead)."""
    sections = {f.name: f.type for f in dataclasses.fields(merged_job_config())}
    for a in args:
        m = re.fullmatch(r"--([A-Za-z_][\w-]*)\.([A-Za-z_][\w-]*)(?:\..*)?", a.split("=", 1)[0])
        if not m:
            continue
        section, field = m.group(1).replace("-", "_"), m.group(2).replace("-", "_")
        if section not in sections:
            return f"unknown option {a.split('=', 1)[0]!r}: no section [{section}]; sections: {', '.join(sorted(sections))}"
        names = sorted(f.name for f in dataclasses.fields(sections[section]) if not f.name.startswith("_"))
        if field not in names and not (field.startswith("no_") and field[3:] in names):
            return (f"unknown option {a.split('=', 1)[0]!r}: [{section}] has no field {field!r}; "
                    f"valid fields: {', '.join(names)}")
    return None


def phase_flags(args: list[str]) -> list[str]:
    """``args`` as torchtitan's parser takes them, with a ``--curriculum.phase``'s settings added
    (booleans as flags before the phase's config is read, and again for the phase's items)."""
    return bool_flags(curriculum.phase_args(bool_flags(args)))


def check_run(job_config) -> None:
    """Before torchtitan starts (every error a :class:`UserError`): the flavor exists, the numbers are in range
    (:func:`nsa_flex.titan.preflight.range_problems`), the folders are writable, and rank 0 holds
    the dump and checkpoint folders' locks."""
    if job_config.model.name == "nsa_flex":
        nsa_flex_args[job_config.model.flavor]  # an unknown flavor: FlavorError, before any log line
    errs = range_problems(job_config)
    if errs:
        raise UserError("; ".join(errs))
    check_writable(job_config)
    if int(os.environ.get("RANK", "0")) == 0:
        lock_run(job_config)


@contextlib.contextmanager
def titan_parses(args: list[str]):
    """Patch (torchtitan 0.2.2, scope: one call of its ``main``): ``torchtitan.train.main`` takes
    no arguments and calls ``ConfigManager().parse_args()``, whose default ``args`` is the
    ``sys.argv[1:]`` bound when ``torchtitan.config.manager`` was first imported (maybe before
    ``args`` were built); upstream has no way to pass arguments to ``main``
(fixed upstream by pytorch/torchtitan PR 3725, "Read config args from current sys.argv", after 0.2.2). For the duration of
    the call that default is ``args``; restored afterwards. Version-gated by
    :func:`nsa_flex.titan.trainer.check_versions`; tests/titan/test_trainer.py fails once upstream's
    ``main`` or ``parse_args`` no longer needs it."""
    saved = ConfigManager.parse_args.__defaults__
    ConfigManager.parse_args.__defaults__ = (args,)
    try:
        yield
    finally:
        ConfigManager.parse_args.__defaults__ = saved


def crash_message(e: BaseException, trainer: NSATrainer | None) -> str | None:
    """The message for a training run stopped by a fault a rerun can get past: a data loader worker
    process that died (``[training.dataloader] num_workers`` > 0), a step that ran out of memory
    (torch's ``OutOfMemoryError``), or torch.compile's backend that failed (e.g. inductor finding
    no kernel config within the GPU's shared memory): the step it stopped in, the likely cause,
    what to change and the newest complete checkpoint that rerunning resumes from; None for any
    other error. The step in flight is not saved (a dead worker takes the loader's position with
    it, also when it dies during that step's checkpoint save; an out-of-memory step is half done)."""
    what = str(e).strip()
    step = f" in step {trainer.step}" if trainer is not None and trainer.step > 0 else ""
    # a worker's death reaches the training process as torch's SIGCHLD handler raising wherever
    # that process is: inside a checkpoint save, DCP wraps it in a CheckpointException
    died = find_error(e, console.worker_died)
    if isinstance(e, torch.OutOfMemoryError):
        msg = (f"out of memory{step} ({what}); less memory a step: a smaller [training] local_batch_size "
               "or seq_len, [activation_checkpoint] mode = \"full\", [nsa] recompute = \"all\" "
               "(nsa-train --preflight estimates the step's memory)")
    elif died is not None:
        msg = (f"the data loader's worker process died{step} ({str(died).strip()}); a worker killed by "
               "SIGKILL is most often the host's out-of-memory killer: fewer [training.dataloader] "
               "num_workers or a smaller prefetch_factor use less host memory")
    elif isinstance(e, BackendCompilerFailed):  # inductor's InductorError too
        first = next((line.strip() for line in what.splitlines() if line.strip()), type(e).__name__)
        msg = (f"torch.compile failed{step} (inductor: {first}); --compile.no-enable ([compile] enable = "
               "false) trains without it, slower; TORCHDYNAMO_VERBOSE=1 shows where")
    else:
        return None
    if trainer is None:
        return msg + "; rerunning the same command resumes from the newest complete checkpoint, if any"
    if not trainer.job_config.checkpoint.enable:
        return msg + "; no checkpoint ([checkpoint] enable = false): a rerun starts from the beginning"
    ck = trainer.job_config.checkpoint
    newest = newest_complete(os.path.join(trainer.job_config.job.dump_folder, ck.folder))
    if newest is None:
        return msg + "; no checkpoint was saved yet: a rerun starts from the beginning"
    return msg + f"; the newest checkpoint: {newest}; rerun the same command to resume from it"


def run(args: list[str], prog: str = "nsa-train") -> int:
    """Parse ``args``, check the run and train with :class:`NSATrainer`; the exit code."""
    try:  # parse once up front: every error here is the user's (file, TOML, field, value)
        check_config_file(args)
        problem = unknown_flag(args)
        if problem:
            return user_error(problem, prog=prog)
        args = phase_flags(args)
        problem = unknown_flag(args)  # a [curriculum] short item's field
        if problem:
            return user_error(problem, prog=prog)
        job_config = ConfigManager().parse_args(args)
    except (ValueError, TypeError, OSError) as e:
        return user_error(config_error_message(e), prog=prog)
    except UserError as e:
        return user_error(str(e), prog=prog)
    problem = cpu_data_parallel_problem(job_config.parallelism, int(os.environ.get("WORLD_SIZE", "1")),
                                        torch.cuda.is_available())
    par = job_config.parallelism
    if problem and par.data_parallel_shard_degree == -1 and par.data_parallel_replicate_degree == 1:
        # the default FSDP (shard degree -1 = every rank) on CPU processes: DDP instead, said once
        world = os.environ.get("WORLD_SIZE", "1")
        args = args + ["--parallelism.data_parallel_replicate_degree", world,
                       "--parallelism.data_parallel_shard_degree", "1"]
        if console.rank_zero():
            print(f"{prog}: warning: {world} processes without CUDA: DDP instead of the default FSDP "
                  "(gloo lacks FSDP's PREMUL_SUM); set [parallelism] data_parallel_replicate_degree = "
                  f"{world}, data_parallel_shard_degree = 1 to say so", file=sys.stderr, flush=True)
    elif problem:  # FSDP asked for explicitly: every rank stops, rank 0 says why
        if console.rank_zero():
            return user_error(problem, prog=prog)
        # the other ranks wait for rank 0's exit, which makes the launcher stop them: a rank that
        # exited first would make the launcher kill rank 0 before its error line is out
        time.sleep(RANK0_ERROR_WAIT_S)
        return EXIT_USER_ERROR
    console.setup()  # before torchtitan's main logs its first line (its version line)
    built: list[NSATrainer] = []

    def trainer(config) -> NSATrainer:  # torchtitan's main builds it; its halt decides the exit code
        built.append(NSATrainer(config))
        return built[-1]

    try:
        check_run(job_config)
        with titan_parses(args):
            titan_main(trainer)
    except NonFiniteError as e:
        return user_error(str(e), EXIT_NONFINITE, prog=prog)
    except UserError as e:
        return user_error(str(e), prog=prog)
    except (RuntimeError, CheckpointException) as e:  # DCP's: a save that a dead worker broke
        msg = crash_message(e, built[-1] if built else None)
        if msg is None:
            raise
        return user_error(msg, 1, prog=prog)
    finally:
        release_all()
    return EXIT_HALTED if built and built[-1].halted_at is not None else 0


def main(argv: list[str] | None = None) -> None:
    sys.exit(run(sys.argv[1:] if argv is None else argv, prog="nsa_flex.titan.train"))


if __name__ == "__main__":
    main()
