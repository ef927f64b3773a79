"""The user's errors and their one style: every entry point (``nsa-train``, ``python -m
nsa_flex.generate`` / ``eval`` / ``plot``) prints one as a single line ``prog: error: message`` on
stderr and exits with code 2; a traceback is left for bugs. A leaf: imports nothing of the project."""

import sys

EXIT_USER_ERROR = 2


class UserError(Exception):
    """Base of the errors a user fixes in a config, a flag or a file (not a bug)."""


def user_error(msg: str, code: int = EXIT_USER_ERROR, prog: str = "nsa-train") -> int:
    """Print a user error as one line ``prog: error: msg`` (no traceback); returns the exit code."""
    print(f"{prog}: error: {msg}", file=sys.stderr, flush=True)
    return code
