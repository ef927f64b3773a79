"""``nsa-train``: the training entry point :mod:`nsa_flex.titan.train` for one process, with defaults.

    nsa-train --job.config_file titan_configs/debug_nsa.toml [--section.key value ...]

Equivalent to ``torchrun --nproc_per_node=1 -m nsa_flex.titan.train ...`` plus environment setup:
  * a single process without torchrun gets WORLD_SIZE=1, RANK=0, LOCAL_RANK=0, MASTER_ADDR=127.0.0.1 and
    a free MASTER_PORT (under torchrun these are already set and left alone);
  * MKL_DYNAMIC defaults to FALSE: MKL otherwise picks its thread count per call, and a CPU run's
    numbers then differ from process to process (an exact resume could not be checked on the CPU);
  * TIKTOKEN_CACHE_DIR defaults to ``shared/data/tiktoken_cache`` in ``..`` or ``.`` (of the project root or
    the working directory) when that folder exists and the variable is unset;
  * without ``--job.config_file``, the embedded default ``titan_configs/debug_nsa.toml`` is used if
    present, else torchtitan's defaults merged with nsa_flex's JobConfig (byte tokenizer, passkey data,
    debugmodel).
Configuration itself comes only from the TOML file and command-line overrides.

User errors (an invalid config value, unknown flavor or field, a TOML syntax error, a bad data file
or checkpoint: :class:`nsa_flex.errors.UserError` and config-parsing errors) are printed as one
short message on stderr, exit code 2; a traceback only for real bugs.

Exit codes (docs/operations.md lists every fault): 0 done; 2 a user error (a full disk, a locked
folder, no usable checkpoint included); 3 the loss or the gradient norm was not finite (the
non-finite guard, :mod:`nsa_flex.titan.trainer`: nothing saved from that step on, the checkpoint
that led to it set aside); 4 halted by the halt file, SIGTERM or a first Ctrl-C, with a checkpoint
to resume from; ``[ops] stall_exit_code`` after a stall dump.

One run per dump folder and per checkpoint folder: rank 0 locks them (:mod:`nsa_flex.titan.runlock`)
before torchtitan starts (the dump folder already before torch is imported when the flags or the
TOML name it); a second run on either stops at once with one message naming the holder.

A TOML with a ``[curriculum] short`` phase runs it, then the long phase from its final weights, each
as its own ``nsa-train ... --curriculum.phase short|long`` (:mod:`nsa_flex.titan.curriculum`).

``nsa-train --preflight ...`` (same config and overrides) checks the launch instead of training and
exits 0 only when every check passes (:mod:`nsa_flex.titan.preflight`).
"""

import os
import socket
import sys

from nsa_flex.errors import UserError, user_error

from .curriculum import drive, wants_driver
from .flags import check_config_file, check_flags, check_flavor, dump_folder
from .runlock import RunLockError, lock_dump_folder
from .usage import usage

CONFIG_MODULE = "nsa_flex.titan.job_config"
PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_env() -> None:
    if "LOCAL_RANK" not in os.environ:  # not under torchrun: one local process
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.setdefault("MKL_DYNAMIC", "FALSE")  # read when MKL loads: set before torch is imported
    if "TIKTOKEN_CACHE_DIR" not in os.environ:
        from .tokenizer import default_tiktoken_cache  # here and below: modules that import torch,
        # loaded once the command needs them (--help and argument errors answer without torch)

        cache = default_tiktoken_cache()
        if cache:
            os.environ["TIKTOKEN_CACHE_DIR"] = cache


def _has_flag(args: list[str], *names: str) -> bool:
    return any(a.split("=", 1)[0] in names for a in args)


def build_args(argv: list[str]) -> list[str]:
    args = list(argv)
    if not _has_flag(args, "--job.config_file", "--job.config-file"):
        default = os.path.join(PROJECT_ROOT, "titan_configs", "debug_nsa.toml")
        if os.path.isfile(default):
            args = ["--job.config_file", default] + args
        elif not _has_flag(args, "--job.custom_config_module", "--job.custom-config-module"):
            args = ["--job.custom_config_module", CONFIG_MODULE] + args
    return args


def main(argv: list[str] | None = None) -> None:
    given = sys.argv[1:] if argv is None else list(argv)
    if "-h" in given or "--help" in given:  # answered before torch is imported
        print(usage(), end="")
        sys.exit(0)
    if "--help-all" in given:
        given = [a for a in given if a != "--help-all"] + ["--help"]
    else:
        try:  # argument and config-file errors, also before torch
            check_flags(given)
            check_config_file(given)
            if "--preflight" not in given:  # the preflight lists it among the config's problems
                check_flavor(given)
        except ValueError as e:
            sys.exit(user_error(str(e)))
    full = "--preflight-full" in given
    args = build_args([a for a in given if a != "--preflight-full"])
    if full and "--preflight" not in args:
        sys.exit(user_error("--preflight-full is an option of --preflight (nsa-train --preflight --preflight-full ...)"))
    if wants_driver(args):  # [curriculum]: the short phase, then the long one, each its own process
        from .train import bool_flags

        sys.exit(drive(bool_flags(args)))
    folder = dump_folder(args)  # only an existing folder can be busy: a new one is made by the run
    if folder and os.path.isdir(folder) and "--preflight" not in args and os.environ.get("RANK", "0") == "0":
        try:  # a busy dump folder is refused before torch is imported (the trainer takes it again)
            lock_dump_folder(folder)
        except RunLockError as e:
            sys.exit(user_error(str(e)))
        except OSError:  # not writable: the run's own check says so, with the folder's name
            pass
    setup_env()
    if "--preflight" in args:
        from .preflight import main as preflight
        from .train import phase_flags

        try:
            args = phase_flags([a for a in args if a != "--preflight"])
        except UserError as e:
            sys.exit(user_error(str(e)))
        sys.exit(preflight(args, full=full))
    from .train import run

    sys.exit(run(args))


if __name__ == "__main__":
    main()
