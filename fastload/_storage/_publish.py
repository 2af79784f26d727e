"""Atomic, once-per-machine publication of a file into the local cache.

Protocol, for a final path ``D/NAME``:

1. A reader that finds ``D/NAME`` uses it, taking no lock: a file appears under that name only
   complete (step 3), so whatever is there is whole.
2. Otherwise it takes the exclusive lock ``D/.NAME.lock`` (``_lock``), waiting while another
   process holds it, and looks again: the process that held the lock may have just published.
3. Still missing: it deletes the temporary files any earlier writer of ``NAME`` left (none can be
   writing, since it holds the lock), writes ``D/.NAME.<pid>-<random>.tmp``, fsyncs it, renames
   it to ``D/NAME`` (``os.replace``: atomic within a directory), fsyncs ``D`` so that the rename
   survives a power loss, and releases the lock.

So, however many processes ask at once, the file is produced once, and a process killed at any
instant leaves at most a temporary file (never ``D/NAME``), removed by the next publication in
``D``: of the same name under its lock, of other names when their lock is free.
"""

from __future__ import annotations

import errno
import os
import secrets
from collections.abc import Callable
from pathlib import Path

from fastload._storage._lock import HeldLock, lock, try_lock
from fastload._storage._root import CACHE_REMEDY
from fastload.errors import CacheError, FastloadError

_TEMP_SUFFIX = ".tmp"


def lock_path(final: Path) -> Path:
    """The lock file guarding ``final``'s publication."""
    return final.with_name(f".{final.name}.lock")


def publish(final: Path, produce: Callable[[Path], None], *, timeout_s: float) -> bool:
    """Make ``final`` exist, produced at most once however many processes ask at once (see the
    module docstring); True if this call produced it, False if it was there or another process
    produced it meanwhile.

    ``produce(temporary)`` must write the whole file at ``temporary`` and close it, or raise (the
    temporary is then deleted and the exception propagates). An ``OSError`` from creating the
    directory, the lock or the file, from ``produce`` (that is not a fastload error already),
    fsync or rename becomes a :class:`CacheError` naming the directory and the remedy; waiting
    more than ``timeout_s`` for another process's publication does too.
    """
    if final.exists():
        return False
    directory = final.parent
    try:
        directory.mkdir(parents=True, exist_ok=True)
        held = lock(lock_path(final), timeout_s=timeout_s)
    except OSError as exc:
        raise _cache_error(final, exc) from exc
    with held:
        if final.exists():
            return False
        _remove_temporaries(directory, final.name)
        remove_leftovers(directory)  # of other names: their own locks say whether that is safe
        temporary = directory / f".{final.name}.{os.getpid()}-{secrets.token_hex(4)}{_TEMP_SUFFIX}"
        try:
            produce(temporary)
            fsync_path(temporary)
            os.replace(temporary, final)
            fsync_path(directory)
        except BaseException as exc:
            temporary.unlink(missing_ok=True)
            if isinstance(exc, OSError) and not isinstance(exc, FastloadError):
                raise _cache_error(final, exc) from exc
            raise
    return True


def remove(final: Path) -> bool:
    """Delete ``final``, its lock file and any leftover temporary, unless a process is
    publishing it now (then nothing is touched and False is returned). A process that has
    ``final`` open or mapped keeps reading it; only new opens fail."""
    try:
        held = try_lock(lock_path(final))
    except OSError:
        return False
    if held is None:
        return False
    with held:
        final.unlink(missing_ok=True)
        _remove_temporaries(final.parent, final.name)
        held.unlink()
    return True


def remove_leftovers(directory: Path) -> list[Path]:
    """Delete the temporary files in ``directory`` that no process is writing: those whose
    final name's lock is free. Returns what was deleted."""
    removed: list[Path] = []
    for name in sorted({n for n in (_final_name(p) for p in _temporaries(directory)) if n}):
        try:
            held: HeldLock | None = try_lock(lock_path(directory / name))
        except OSError:
            continue
        if held is not None:
            with held:
                removed.extend(_remove_temporaries(directory, name))
    return removed


def _temporaries(directory: Path) -> list[Path]:
    try:
        names = [p for p in directory.iterdir() if p.name.startswith(".")]
    except OSError:
        return []
    return [p for p in names if p.name.endswith(_TEMP_SUFFIX)]


def _final_name(temporary: Path) -> str | None:
    """``NAME`` of ``.NAME.<pid>-<random>.tmp``, or ``None`` for another file."""
    name, dot, tag = temporary.name[1 : -len(_TEMP_SUFFIX)].rpartition(".")
    return name if dot and name and "-" in tag else None


def _remove_temporaries(directory: Path, name: str) -> list[Path]:
    """Delete ``name``'s temporaries; only under ``name``'s lock."""
    removed = []
    for path in _temporaries(directory):
        if _final_name(path) == name:
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def fsync_path(path: Path) -> None:
    """Flush a file's or a folder's data and metadata to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _cache_error(final: Path, exc: OSError) -> CacheError:
    if isinstance(exc, TimeoutError):
        return CacheError(
            f"{final}: another process is still writing it after a long wait: {exc}",
            final.parent,
            errno.ETIMEDOUT,
        )
    return CacheError(
        f"cannot write {final.name} into the cache directory {final.parent}:"
        f" {os.strerror(exc.errno) if exc.errno else exc}; {CACHE_REMEDY}",
        final.parent,
        exc.errno,
    )
