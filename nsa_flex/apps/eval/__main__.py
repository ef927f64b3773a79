"""``python -m nsa_flex.eval [--task T] ...``: T = needle (default: passkey / multi-key retrieval,
nsa_flex.apps.eval.needle), position-loss (loss by token position, nsa_flex.apps.eval.position_loss) or
selection (selection statistics and traces, nsa_flex.apps.eval.selection_stats). The needle task's
arguments are checked before torch is imported (a missing --out fails at once). A user error is one
line ``python -m nsa_flex.eval: error: ...``, exit code 2."""

import importlib
import sys

from nsa_flex.errors import UserError, user_error

from .args import parse_args
from .cli import EvalError

PROG = "python -m nsa_flex.eval"
# the task's module, imported only when the task runs (it imports torch)
TASKS = {"needle": "nsa_flex.apps.eval.needle",
         "position-loss": "nsa_flex.apps.eval.position_loss",
         "selection": "nsa_flex.apps.eval.selection_stats"}


def split_task(argv: list[str]) -> tuple[str, list[str]]:
    """(task, the other arguments) of ``--task T`` / ``--task=T`` anywhere in argv."""
    task, rest, i = "needle", [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--task":
            if i + 1 >= len(argv):
                raise EvalError(f"--task needs a value: one of {list(TASKS)}")
            task, i = argv[i + 1], i + 2
            continue
        if a.startswith("--task="):
            task = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    if task not in TASKS:
        raise EvalError(f"--task: {task!r} not in {list(TASKS)}")
    return task, rest


def run(argv: list[str]):
    task, rest = split_task(argv)
    if task == "needle":
        parse_args(rest)  # argument errors before the task's module (and torch) is imported
    return importlib.import_module(TASKS[task]).main(rest)


def main(argv: list[str] | None = None) -> int:
    try:
        run(sys.argv[1:] if argv is None else argv)
    except UserError as e:
        return user_error(str(e), prog=PROG)
    return 0


if __name__ == "__main__":
    sys.exit(main())
