"""The user's errors and their one style: every entry point (``nsa-train``, ``python -m
nsa_flex.generate`` / ``eval`` / ``plot``) prints one as a single line ``prog: error: message`` on
stderr and exits with code 2; a traceback is left for bugs. A leaf: imports nothing of the project."""

import errno
import sys
from collections.abc import Callable

EXIT_USER_ERROR = 2


class UserError(Exception):
    """Base of the errors a user fixes in a config, a flag or a file (not a bug)."""


def user_error(msg: str, code: int = EXIT_USER_ERROR, prog: str = "nsa-train") -> int:
    """Print a user error as one line ``prog: error: msg`` (no traceback); returns the exit code."""
    print(f"{prog}: error: {msg}", file=sys.stderr, flush=True)
    return code


class DiskSpaceError(UserError, OSError):
    """A disk is (or would be) full: a checkpoint's folder, the metrics file."""


def find_error(e: BaseException | None, match: Callable[[BaseException], bool],
               depth: int = 0) -> BaseException | None:
    """The first error in ``e``, the errors it wraps (DCP's ``CheckpointException``, a
    ``BaseException`` holding each rank's error) and their causes that ``match`` accepts, else None."""
    if e is None or depth > 8:
        return None
    if match(e):
        return e
    failures = getattr(e, "failures", None)
    for f in (failures.values() if isinstance(failures, dict) else ()):
        found = find_error(f[0] if isinstance(f, tuple) else f, match, depth + 1)
        if found is not None:
            return found
    return find_error(e.__cause__ or e.__context__, match, depth + 1)


def space_error(e: BaseException | None) -> BaseException | None:
    """The full-disk error that ``e`` is or wraps (ENOSPC, torch's "unexpected pos" of a short
    write), else None."""
    return find_error(e, lambda x: (isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT))
                      or (isinstance(x, RuntimeError) and "unexpected pos" in str(x)))
