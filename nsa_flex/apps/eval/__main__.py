"""``python -m nsa_flex.eval [--task T] ...``: T = needle (default: passkey / multi-key retrieval,
nsa_flex.apps.eval.needle), position-loss (loss by token position, nsa_flex.apps.eval.position_loss) or
selection (selection statistics and traces, nsa_flex.apps.eval.selection_stats). The needle task's
arguments are checked before torch is imported (a missing --out fails at once)."""

import sys

from .prompts import EvalError

TASKS = {"needle": ("nsa_flex.apps.eval.needle", "needle_eval"),
         "position-loss": ("nsa_flex.apps.eval.position_loss", "position_loss"),
         "selection": ("nsa_flex.apps.eval.selection_stats", "selection")}


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
    import importlib

    task, rest = split_task(argv)
    if task == "needle":
        from .args import parse_args

        parse_args(rest)  # argument errors before the task's module (and torch) is imported
    return importlib.import_module(TASKS[task][0]).main(rest)


if __name__ == "__main__":
    name = "needle_eval"
    try:
        name = TASKS.get(split_task(sys.argv[1:])[0], TASKS["needle"])[1]
        run(sys.argv[1:])
    except EvalError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        sys.exit(2)
