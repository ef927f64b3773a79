"""Short-then-long training from one TOML (``[curriculum]``): a short phase first, then the TOML's
own (long) run starting from the short phase's final weights.

    nsa-train --job.config_file titan_configs/quality_curriculum.toml [--section.field value ...]

``[curriculum] short`` lists the short phase's settings as ``section.field=value`` (or a boolean
flag, ``section.field`` / ``section.no-field``); they override the TOML and the command line for
that phase, which trains into ``<dump_folder>/<short_folder>``. The long phase is the TOML with the
command line, in ``<dump_folder>``, loading the short phase's final checkpoint (model weights only:
``checkpoint.initial_load_path``; the optimizer and the LR schedule start afresh). Both phases save
checkpoints (``checkpoint.enable`` is implied: the long phase needs it to load the short one's).

``nsa-train`` runs the two phases one after the other, each as ``nsa-train ... --curriculum.phase
short|long`` (a phase whose final checkpoint exists is not trained again, so the same command
resumes a halted curriculum where it stopped). Under torchrun, run the phases yourself:
``torchrun ... -m nsa_flex.titan.train ... --curriculum.phase short``, then ``... long``.
"""

import os
import re
import subprocess
import sys

from nsa_flex.errors import UserError

PHASES = ("short", "long")
_ITEM = re.compile(r"[A-Za-z_]\w*\.[A-Za-z_][\w.-]*(=.*)?", re.S)


def _flag(args: list[str], name: str) -> str | None:
    """The value of ``--name`` (``--name value`` or ``--name=value``) in ``args``, else None."""
    for i, a in enumerate(args):
        if a == name:
            return args[i + 1] if i + 1 < len(args) else ""
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def short_items(items) -> list[str]:
    """``[curriculum] short`` as command-line flags, each item checked."""
    flags = []
    for i, item in enumerate(items or []):
        if not isinstance(item, str) or not _ITEM.fullmatch(item):
            raise UserError(f"curriculum.short[{i}]={item!r}: must look like section.field=value (e.g. "
                            "training.seq_len=2048) or a boolean flag section.field / section.no-field")
        flags.append("--" + item)
    return flags


def _field(flag: str) -> str:
    """``--section.field[=value]`` or ``--section.no-field`` -> ``section.field`` (dashes as _)."""
    name = flag[2:].split("=", 1)[0].replace("-", "_")
    section, _, field = name.partition(".")
    return f"{section}.{field[3:] if field.startswith('no_') else field}"


def shadowed_flags(args: list[str], items: list[str]) -> list[str]:
    """The fields that the command line sets and the short phase's items set again (the items come
    last, so they win in the short phase): named in a warning, since a user who passes
    ``--training.steps 100`` with a curriculum would otherwise not know it ran 7000 there."""
    mine = {_field(i) for i in items}
    return sorted({_field(a) for a in args if a.startswith("--") and "." in a} & mine)


def wants_driver(args: list[str]) -> bool:
    """Whether ``nsa-train args`` runs a whole curriculum: the TOML lists a short phase and no
    ``--curriculum.phase`` (nor ``--preflight``) is given. Reads the TOML only (no torch)."""
    import tomllib

    path = _flag(args, "--job.config_file") or _flag(args, "--job.config-file")
    if not path or _flag(args, "--curriculum.phase") is not None or "--preflight" in args:
        return False
    with open(path, "rb") as f:
        return bool(tomllib.load(f).get("curriculum", {}).get("short"))


def _parse(args: list[str]):
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(args)


def _last_step(folder: str) -> int:
    steps = [int(m.group(1)) for n in (os.listdir(folder) if os.path.isdir(folder) else [])
             if (m := re.fullmatch(r"step-(\d+)", n))]
    return max(steps, default=0)


def _short_checkpoint(short_config) -> tuple[str, int]:
    """(checkpoint folder, final step) of the short phase."""
    ck = short_config.checkpoint
    return os.path.join(short_config.job.dump_folder, ck.folder), short_config.training.steps


def phase_args(args: list[str]) -> list[str]:
    """``args`` of one phase (``--curriculum.phase short|long``) with that phase's settings added;
    ``args`` unchanged without the flag. UserError for a bad phase, a bad item, a long phase before
    the short one has finished."""
    phase = _flag(args, "--curriculum.phase")
    if phase is None or phase == "":
        return args
    if phase not in PHASES:
        raise UserError(f"curriculum.phase={phase!r}: must be one of {', '.join(PHASES)}")
    jc = _parse(args)
    items = short_items(jc.curriculum.short)
    if not items:
        raise UserError(f"--curriculum.phase {phase}: the config lists no [curriculum] short phase")
    overridden = shadowed_flags(args, items) if phase == "short" else []
    if overridden:
        print(f"nsa-train: curriculum: the short phase's [curriculum] short sets {', '.join(overridden)}; "
              "the command line's values apply to the long phase only", file=sys.stderr, flush=True)
    # the short phase always saves its final checkpoint: the long phase starts from it
    short = args + ["--job.dump_folder", os.path.join(jc.job.dump_folder, jc.curriculum.short_folder),
                    "--checkpoint.enable"] + items
    if phase == "short":
        return short
    folder, steps = _short_checkpoint(_parse(short))
    final = os.path.join(folder, f"step-{steps}")
    if not os.path.isdir(final):
        raise UserError(f"curriculum: the short phase has not finished ({folder} has no step-{steps}): "
                        "run it first (--curriculum.phase short), or the whole curriculum without --curriculum.phase")
    args = args + ["--checkpoint.enable"]  # torchtitan loads initial_load_path only with checkpoints on
    if _flag(args, "--checkpoint.initial_load_path") is not None:
        return args
    return args + ["--checkpoint.initial_load_path", final]


def _run_forwarding_signals(cmd: list[str]) -> int:
    """Run ``cmd``; SIGTERM / SIGINT / SIGUSR1 sent to this process go to it (halt, dump)."""
    import signal

    child = subprocess.Popen(cmd)
    forward = lambda sig, _frame: child.send_signal(sig)  # noqa: E731
    saved = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    try:
        return child.wait()
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def drive(args: list[str], prog: str = "nsa-train") -> int:
    """Run the short phase (unless its final checkpoint exists), then the long one; each in its own
    process. The exit code: the first failing phase's, else the long phase's."""
    try:
        jc = _parse(args)
        items = short_items(jc.curriculum.short)
        folder, steps = _short_checkpoint(_parse(args + ["--job.dump_folder", os.path.join(
            jc.job.dump_folder, jc.curriculum.short_folder)] + items))
    except (ValueError, TypeError, UserError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        return 2
    for phase in PHASES:
        if phase == "short" and _last_step(folder) >= steps:
            print(f"{prog}: curriculum: short phase done ({folder}/step-{steps}); long phase next", flush=True)
            continue
        print(f"{prog}: curriculum: {phase} phase", flush=True)
        rc = _run_forwarding_signals([sys.executable, "-m", "nsa_flex.titan.cli", *args, "--curriculum.phase", phase])
        if rc != 0:
            return rc
        if phase == "short" and _last_step(folder) < steps:  # halted: resume with the same command
            print(f"{prog}: curriculum: the short phase stopped at step {_last_step(folder)} of {steps}; "
                  "the same command resumes it", flush=True)
            return 0
    return 0
