"""One run per dump folder and per checkpoint folder, and folders a run can write, checked before
training starts.

:class:`DumpLock`: rank 0 holds ``<dump_folder>/.nsa-run.lock`` for the whole run: an exclusive
``flock`` on that file, held while the process lives (the kernel drops it when the process ends,
SIGKILL included). The file also holds the holder's pid, host and start time (JSON), for the
message only. A lock file whose ``flock`` can be taken has no live holder (a killed run, a pid
now used by another process, an empty file left by a full disk): it is taken over with a warning.
A held one refuses the run with one :class:`RunLockError` naming the folder and the holder. A
file naming another host is refused too (a network filesystem may not share locks between
hosts). Released (the file removed, then unlocked) when the run ends, on an error too
(``release`` and an ``atexit`` hook). Acquiring again from the holding process is a no-op, so
``nsa-train`` may take it before torchtitan starts and the trainer again. The holder's record is
written before the file gets its name (a temporary file, hard-linked), so a full disk never
leaves an empty lock file; it fails as one :class:`FolderNotWritable`.

:func:`lock_run`: the dump folder's lock and, with ``[checkpoint] enable``, the checkpoint
folder's (``<parent>/.<name>.nsa-run.lock`` beside it: the folder itself must not be created
before torchtitan looks for it), so two runs with different dump folders and one
``--checkpoint.folder`` are refused too.

:func:`check_writable`: the dump folder (created if missing) and, with ``[checkpoint] enable``,
the checkpoint folder accept a new file with one byte; else one :class:`FolderNotWritable`
naming the folder (a full disk too).
"""

import atexit
import errno
import fcntl
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


def _describe(holder: dict) -> str:
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started {when}"


class DumpLock:
    """The lock of one folder: ``path`` (default ``<folder>/.nsa-run.lock``); ``what`` names the
    folder in messages."""

    def __init__(self, folder: str, path: str | None = None, what: str = "dump folder"):
        self.folder = os.path.abspath(folder)
        self.path = path or os.path.join(self.folder, LOCK_NAME)
        self.what = what
        self.held = False
        self._fd: int | None = None

    def _read(self) -> dict | None:
        try:
            with open(self.path) as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # unreadable or empty: a holder we cannot identify

    def _record(self) -> str:
        """A temporary file beside the lock holding this process's record (never half-written)."""
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path), prefix=".nsa-lock-")
            with os.fdopen(fd, "w") as f:
                json.dump({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}, f)
        except OSError as e:
            if tmp:
                os.remove(tmp)
            raise self._unwritable(e) from None
        return tmp

    def _unwritable(self, e: OSError):
        full = e.errno in (errno.ENOSPC, errno.EDQUOT)
        return FolderNotWritable(f"{self.what} {self.folder}: cannot write the run lock {self.path} "
                                 f"({e.strerror or e}){': the disk is full' if full else ''}: free space "
                                 "or choose another folder")

    def _flock(self) -> int | None:
        """An fd of the lock file with the exclusive flock taken, or None if another process holds it."""
        try:
            fd = os.open(self.path, os.O_RDWR)
        except OSError:  # gone, or not ours to write (another user's run): not taken
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None
        try:  # still the file of that name (not removed by its releasing holder meanwhile)?
            same = os.path.samestat(os.fstat(fd), os.stat(self.path))
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            return None
        return fd

    def _take(self, tmp: str) -> bool:
        """Give the record ``tmp`` the lock's name if it has none; flock it. True when held."""
        try:
            os.link(tmp, self.path)
        except FileExistsError:
            return False
        fd = self._flock()
        if fd is None:  # another starter took over the new file already
            return False
        self._fd = fd
        return True

    def _refuse(self, holder: dict):
        who = _describe(holder) if holder else "an unreadable lock file"
        return RunLockError(
            f"{self.what} {self.folder} is in use by another run ({who}; lock file {self.path}). "
            f"Use another {'--job.dump_folder' if self.what == 'dump folder' else '--checkpoint.folder'}, "
            "or stop that run; if it is gone (another host), remove the lock file")

    def acquire(self) -> "DumpLock":
        """Take the lock or raise :class:`RunLockError`; returns self."""
        if self.held:
            return self
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
        except OSError as e:
            raise self._unwritable(e) from None
        tmp = self._record()
        try:
            for _ in range(5):  # a lock released or taken over by a concurrent starter: try again
                if self._take(tmp):
                    break
                holder = self._read()
                if holder is None:
                    continue
                if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
                    self.held = True  # another DumpLock of this process holds it
                    return self
                other_host = holder.get("host") not in (None, socket.gethostname())
                fd = None if other_host else self._flock()
                if fd is None:
                    if os.path.exists(self.path):
                        raise self._refuse(self._read() or holder)
                    continue
                from torchtitan.tools.logging import logger

                why = (f"{_describe(holder)}: that run has ended" if holder else "an empty or unreadable file "
                       "left by a run that could not write it")
                logger.warning(f"Run lock {self.path} is stale ({why}); taking it over")
                with open(tmp, "rb") as src:
                    rec = src.read()
                try:  # this process's record in place of the old one (under the flock)
                    os.pwrite(fd, rec, 0)
                    os.ftruncate(fd, len(rec))
                except OSError as e:
                    os.close(fd)
                    raise self._unwritable(e) from None
                self._fd = fd
                break
            else:
                raise RunLockError(f"{self.what} {self.folder}: could not take the lock {self.path}")
        finally:
            os.remove(tmp)
        self.held = True
        atexit.register(self.release)
        return self

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        if self._fd is None:
            return  # held by another DumpLock of this process
        try:
            os.remove(self.path)  # removed while still locked: a starter never takes a live file
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None


_LOCKS: dict[str, DumpLock] = {}


def lock_dump_folder(dump_folder: str) -> DumpLock:
    """The process-wide lock of ``dump_folder``, acquired (idempotent within a process)."""
    key = os.path.abspath(dump_folder)
    lock = _LOCKS.setdefault(key, DumpLock(key))
    return lock.acquire()


def checkpoint_lock_path(folder: str) -> str:
    """The lock file of the checkpoint folder ``folder``: beside it, ``.<name>.nsa-run.lock``."""
    folder = os.path.abspath(folder)
    return os.path.join(os.path.dirname(folder), f".{os.path.basename(folder)}{LOCK_NAME}")


def lock_run(job_config) -> list[DumpLock]:
    """Rank 0's locks of a run: the dump folder's and, checkpointing on, the checkpoint folder's
    (idempotent within a process)."""
    locks = [lock_dump_folder(job_config.job.dump_folder)]
    ck = job_config.checkpoint
    if ck.enable:
        folder = os.path.abspath(os.path.join(job_config.job.dump_folder, ck.folder))
        key = "checkpoint:" + folder
        lock = _LOCKS.setdefault(key, DumpLock(folder, checkpoint_lock_path(folder), "checkpoint folder"))
        try:
            locks.append(lock.acquire())
        except BaseException:
            locks[0].release()
            raise
    return locks


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
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".nsa-write-test-") as f:
            f.write(b"x")  # a byte too: a full disk still creates empty files
            f.flush()
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
