"""One run per dump folder, and folders a run can write, checked before training starts.

:class:`DumpLock`: rank 0 holds ``<dump_folder>/.nsa-run.lock`` for the whole run. The file holds
the holder's pid, host and start time (JSON). It is created atomically (``O_CREAT | O_EXCL``); a
lock whose holder is on this host and no longer alive is stale and taken over (with a warning); a
live holder, or one on another host (its liveness cannot be seen from here), refuses the run with
one :class:`RunLockError` naming the folder and the holder. Released (the file removed) when the
run ends, on an error too (``release`` and an ``atexit`` hook); a process killed with SIGKILL
leaves a stale lock, which the next run takes over. Acquiring again from the holding process is a
no-op, so ``nsa-train`` may take it before torchtitan starts and the trainer again.

:func:`check_writable`: the dump folder (created if missing) and, with ``[checkpoint] enable``,
the checkpoint folder accept a new file; else one :class:`FolderNotWritable` naming the folder.
"""

import atexit
import json
import os
import socket
import tempfile
import time

from nsa_flex.errors import UserError

LOCK_NAME = ".nsa-run.lock"


class RunLockError(UserError, RuntimeError):
    """The dump folder is in use by another run."""


class FolderNotWritable(UserError, OSError):
    """A folder the run writes into cannot be written."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def _describe(holder: dict) -> str:
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started {when}"


class DumpLock:
    def __init__(self, dump_folder: str):
        self.folder = os.path.abspath(dump_folder)
        self.path = os.path.join(self.folder, LOCK_NAME)
        self.held = False

    def _read(self) -> dict | None:
        try:
            with open(self.path) as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # unreadable or half-written: treated as a holder we cannot identify

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}, f)
        return True

    def acquire(self) -> "DumpLock":
        """Take the lock or raise :class:`RunLockError`; returns self."""
        if self.held:
            return self
        os.makedirs(self.folder, exist_ok=True)
        for _ in range(3):  # a stale lock removed by a concurrent starter: try again
            if self._create():
                self.held = True
                atexit.register(self.release)
                return self
            holder = self._read()
            if holder is None:
                continue
            if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
                self.held = True  # this process took it already (nsa-train before the trainer)
                return self
            stale = (holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int)
                     and not _alive(holder["pid"]))
            if not stale:
                who = _describe(holder) if holder else "an unreadable lock file"
                raise RunLockError(
                    f"dump folder {self.folder} is in use by another run ({who}; lock file {self.path}). "
                    "Use another --job.dump_folder, or stop that run; if it is gone (another host), "
                    "remove the lock file")
            from torchtitan.tools.logging import logger

            logger.warning(f"Dump folder lock {self.path} is stale ({_describe(holder)}: not running); "
                           "taking it over")
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass
        raise RunLockError(f"dump folder {self.folder}: could not take the lock {self.path}")

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        holder = self._read()
        if holder and holder.get("pid") == os.getpid():
            try:
                os.remove(self.path)
            except OSError:
                pass


_LOCKS: dict[str, DumpLock] = {}


def lock_dump_folder(dump_folder: str) -> DumpLock:
    """The process-wide lock of ``dump_folder``, acquired (idempotent within a process)."""
    key = os.path.abspath(dump_folder)
    lock = _LOCKS.setdefault(key, DumpLock(key))
    return lock.acquire()


def release_all() -> None:
    for lock in _LOCKS.values():
        lock.release()


def existing_folder(path: str) -> str:
    """``path`` if it exists (a file there stays: nothing can be made inside it), else the nearest
    folder above it that exists (where a missing one would be made)."""
    while path and not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path or "."


def _writable(folder: str, create: bool = True) -> str | None:
    """Why ``folder`` cannot take a new file (None if it can). create=False leaves a missing
    folder missing and tests the nearest existing folder above it, where it would be created."""
    try:
        if create:
            os.makedirs(folder, exist_ok=True)
        else:
            folder = existing_folder(folder)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".nsa-write-test-"):
            pass
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


def check_writable(job_config) -> None:
    """The dump folder and (checkpointing on) the checkpoint folder are writable; else one
    :class:`FolderNotWritable` naming each folder that is not."""
    dump = job_config.job.dump_folder
    folders = [("job.dump_folder", dump)]
    ck = job_config.checkpoint
    if ck.enable:
        folders.append(("checkpoint.folder", os.path.join(dump, ck.folder)))
    bad = []
    for name, folder in folders:
        # the checkpoint folder is never created here: torchtitan loads checkpoint.initial_load_path
        # only while that folder does not exist (an empty one would silently start from scratch)
        why = _writable(folder, create=name == "job.dump_folder")
        if why:
            bad.append(f"{name} {folder} is not writable ({why})")
            break  # the checkpoint folder lies inside the dump folder
    if bad:
        raise FolderNotWritable("; ".join(bad) + ": choose a writable folder or fix its permissions")
