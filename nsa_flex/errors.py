"""The user's errors and their one style: every entry point (``nsa-train``, ``python -m
nsa_flex.generate`` / ``eval`` / ``plot``) prints one as a single line ``prog: error: message`` on
stderr and exits with code 2; a traceback is left for bugs. A leaf: imports nothing of the project."""

import errno
import sys

EXIT_USER_ERROR = 2


class UserError(Exception):
    """Base of the errors a user fixes in a config, a flag or a file (not a bug)."""


def user_error(msg: str, code: int = EXIT_USER_ERROR, prog: str = "nsa-train") -> int:
    """Print a user error as one line ``prog: error: msg`` (no traceback); returns the exit code."""
    print(f"{prog}: error: {msg}", file=sys.stderr, flush=True)
    return code


class DiskSpaceError(UserError, OSError):
    """A disk is (or would be) full: a checkpoint's folder, the metrics file."""


def space_error(e: BaseException | None, depth: int = 0) -> BaseException | None:
    """The full-disk error that ``e`` is or wraps (ENOSPC, torch's "unexpected pos" of a short
    write; within DCP's ``CheckpointException``, a ``BaseException`` holding each rank's error, or
    a cause), else None."""
    if e is None or depth > 8:
        return None
    if (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)) or (
            isinstance(e, RuntimeError) and "unexpected pos" in str(e)):
        return e
    failures = getattr(e, "failures", None)
    for f in (failures.values() if isinstance(failures, dict) else ()):
        found = space_error(f[0] if isinstance(f, tuple) else f, depth + 1)
        if found is not None:
            return found
    return space_error(e.__cause__ or e.__context__, depth + 1)
