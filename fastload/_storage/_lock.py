"""Locks between processes on one machine: ``fcntl.flock`` on a lock file, exclusive or shared
(readers that many processes may hold at once, and that keep an exclusive holder out).

The kernel drops a process's locks when it dies, however it dies, so a lock never outlives its
holder and a waiter never needs to judge whether a holder is alive. A lock file may be deleted
while held (:meth:`HeldLock.unlink`): a waiter that then obtains the lock on the deleted file
sees that the path no longer leads to it and starts over on the new one, so two processes can
never both believe they hold the lock of one path.

A lock belongs to the process that took it, not to its children: a flock lives as long as any
descriptor of its open file does, and ``fork`` copies descriptors, so a child forked while its
parent held a lock (a loader's workers are forked while the main process downloads or evicts)
would hold it after the parent released it, for its whole life. Each child closes its copies
of the held locks' descriptors as it starts.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
import time
import weakref
from pathlib import Path

from fastload._storage._safe import CacheDir, link_error

_POLL_S = 0.05

#: The locks this process holds now, and the descriptors of lock files it has open (held or
#: waited on: one waited on at a fork may be locked by the parent afterwards): a forked child
#: closes its copies of them all (see the module text).
_held: weakref.WeakSet[HeldLock] = weakref.WeakSet()
_open_fds: set[int] = set()


def _drop_inherited() -> None:
    for held in list(_held):
        held._forget()
    _held.clear()
    for fd in _open_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    _open_fds.clear()


def _close(fd: int) -> None:
    _open_fds.discard(fd)
    os.close(fd)


os.register_at_fork(after_in_child=_drop_inherited)


class HeldLock:
    """A lock on :attr:`path` (exclusive unless taken ``shared``), held until :meth:`release`
    (or the ``with`` block's end)."""

    def __init__(self, path: Path, fd: int, directory: CacheDir | None) -> None:
        self.path = path
        self._fd: int | None = fd
        self._directory = directory
        _held.add(self)

    def _forget(self) -> None:
        """In a forked child: close the copy of the parent's descriptor (the parent's lock
        stays the parent's) and hold nothing."""
        self._fd = None  # its descriptor is among those _drop_inherited closes

    def unlink(self) -> None:
        """Delete the lock file while holding it (see the module docstring)."""
        if self._directory is not None:
            self._directory.unlink(self.path.name)
        else:
            self.path.unlink(missing_ok=True)

    def release(self) -> None:
        """Idempotent; closing the descriptor drops the lock."""
        if self._fd is not None:
            _held.discard(self)
            _close(self._fd)
            self._fd = None

    def __enter__(self) -> HeldLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def try_lock(path: Path, *, shared: bool = False, directory: CacheDir | None = None) -> HeldLock | None:
    """The lock of ``path`` if no other process holds it now (none holds it exclusively, for a
    ``shared`` one), else ``None``; creates the lock file (in ``directory``'s descriptor when
    given: ``path`` is then ``directory.path / name``). Raises ``OSError`` when the file cannot
    be created or opened, :class:`CacheError` when a link or another non-regular file is there
    (never followed)."""
    return _acquire(path, deadline=None, shared=shared, directory=directory)


def lock(path: Path, *, timeout_s: float, shared: bool = False, directory: CacheDir | None = None) -> HeldLock:
    """The lock of ``path``, waiting (polled) while another process holds it (exclusively, for a
    ``shared`` one); raises ``TimeoutError`` naming the lock file and its holder after
    ``timeout_s`` seconds, and what :func:`try_lock` raises."""
    held = _acquire(path, deadline=time.monotonic() + timeout_s, shared=shared, directory=directory)
    assert held is not None
    return held


def holder(path: Path, directory: CacheDir | None = None) -> str:
    """Who holds (or last held) the lock of ``path``, as its holder wrote it: ``pid N on HOST``."""
    try:
        fd = _open(path, os.O_RDONLY, directory)
    except OSError:
        return "unknown"
    try:
        return os.pread(fd, 256, 0).decode(errors="replace").strip() or "unknown"
    finally:
        os.close(fd)


def _open(path: Path, flags: int, directory: CacheDir | None) -> int:
    """The lock file, opened without following a link (:func:`link_error` for one)."""
    if directory is not None:
        return directory.open_file(path.name, flags, 0o600)
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise link_error(path) from exc
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise link_error(path)
    os.set_blocking(fd, True)
    return fd


def _acquire(path: Path, *, deadline: float | None, shared: bool, directory: CacheDir | None) -> HeldLock | None:
    while True:
        fd = _open(path, os.O_RDWR | os.O_CREAT, directory)
        _open_fds.add(fd)
        try:
            if not _wait_for(fd, path, deadline, fcntl.LOCK_SH if shared else fcntl.LOCK_EX, directory):
                _close(fd)
                return None
            if _still_at(fd, path, directory):
                if not shared:  # shared holders are many; the note names the exclusive one
                    # Only for messages: who to look for when a waiter gives up.
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
                return HeldLock(path, fd, directory)
        except BaseException:
            _close(fd)
            raise
        _close(fd)  # the file was deleted while we waited: lock the one now at ``path``


def _wait_for(fd: int, path: Path, deadline: float | None, mode: int, directory: CacheDir | None) -> bool:
    """Lock ``fd`` in ``mode``: False at once if it is held and ``deadline`` is ``None``; polled
    until ``deadline`` otherwise."""
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if deadline is None:
                return False
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{path} is locked by {holder(path, directory)}; if that process is stuck, stop it"
                    " (its lock goes with it)"
                ) from None
            time.sleep(_POLL_S)


def _still_at(fd: int, path: Path, directory: CacheDir | None) -> bool:
    try:
        at_path = os.lstat(path) if directory is None else directory.lstat(path.name)
    except FileNotFoundError:
        return False
    if at_path is None:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (at_path.st_dev, at_path.st_ino)
