"""Atomic, once-per-machine publication of a file into the local cache.

Protocol, for a final path ``D/NAME``:

1. A reader that finds ``D/NAME`` with its record uses it, taking no lock: a file gets a record
   only once complete (step 3), so whatever is there is whole.
2. Otherwise it takes the exclusive lock ``D/.NAME.lock`` (``_lock``), waiting while another
   process holds it, and looks again: the process that held the lock may have just published.
3. Still missing: it deletes the temporary files any earlier writer of ``NAME`` left (none can be
   writing, since it holds the lock), writes ``D/.NAME.<pid>-<random>.tmp`` (created with
   ``O_EXCL``), fsyncs it, renames it to ``D/NAME`` (``os.replace``: atomic within a directory),
   writes its record ``D/.NAME.ok`` (``_storage._safe``: a file there that is not the one
   published is never taken for it), fsyncs ``D`` so that the rename survives a power loss, and
   releases the lock.

So, however many processes ask at once, the file is produced once, and a process killed at any
instant leaves at most a temporary file (never ``D/NAME``), removed by the next publication in
``D``: of the same name under its lock, of other names when their lock is free.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

from fastload._storage._lock import HeldLock, lock, try_lock
from fastload._storage._root import CACHE_REMEDY
from fastload._storage._safe import RECORD_SUFFIX, TEMP_SUFFIX, CacheDir
from fastload.errors import CacheError, FastloadError


def lock_path(final: Path) -> Path:
    """The lock file guarding ``final``'s publication."""
    return final.with_name(f".{final.name}.lock")


def publish(final: Path, produce: Callable[[Path], None], *, timeout_s: float, root: Path | None = None) -> bool:
    """Make ``final`` exist, produced at most once however many processes ask at once (see the
    module docstring); True if this call produced it, False if it was there or another process
    produced it meanwhile.

    ``root`` is the cache root ``final``'s folder lies in (default: that folder), checked and
    walked as ``_storage._safe`` says. A file at ``final`` counts only if its record says it is
    the one a publication finished; any other (replaced, touched, a link) is produced again.

    ``produce(temporary)`` must write the whole file at ``temporary`` and close it, or raise (the
    temporary is then deleted and the exception propagates). An ``OSError`` from creating the
    directory, the lock or the file, from ``produce`` (that is not a fastload error already),
    fsync or rename becomes a :class:`CacheError` naming the directory and the remedy; waiting
    more than ``timeout_s`` for another process's publication does too.
    """
    folder = _folder(final, root)
    try:
        if folder.trusted(final.name) is not None:
            return False
        try:
            held = lock(lock_path(final), timeout_s=timeout_s, directory=folder)
        except FastloadError:
            raise
        except OSError as exc:
            raise _cache_error(final, exc) from exc
        with held:
            if folder.trusted(final.name) is not None:
                return False
            _remove_temporaries(folder, final.name)
            _remove_leftovers(folder)  # of other names: their own locks say whether that is safe
            temporary = ""
            try:
                folder.forget(final.name)
                temporary = folder.create_temporary(final.name)
                produce(folder.path / temporary)
                fd = folder.open_file(temporary, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
                folder.replace(temporary, final.name)
                folder.record(final.name)
                folder.fsync()
            except BaseException as exc:
                if temporary:
                    folder.unlink(temporary)
                if isinstance(exc, OSError) and not isinstance(exc, FastloadError):
                    raise _cache_error(final, exc) from exc
                raise
        return True
    finally:
        folder.close()


def remove(final: Path, *, root: Path | None = None) -> bool:
    """Delete ``final``, its record, its lock file and any leftover temporary, unless a process
    is publishing it now (then nothing is touched and False is returned). A process that has
    ``final`` open or mapped keeps reading it; only new opens fail."""
    folder = _folder(final, root)
    try:
        try:
            held = try_lock(lock_path(final), directory=folder)
        except OSError:
            return False
        if held is None:
            return False
        with held:
            folder.forget(final.name)
            _remove_temporaries(folder, final.name)
            held.unlink()
        return True
    finally:
        folder.close()


def remove_leftovers(directory: Path) -> list[Path]:
    """Delete the temporary files in ``directory`` that no process is writing: those whose
    final name's lock is free. Returns what was deleted."""
    folder = CacheDir.open(directory)
    try:
        return _remove_leftovers(folder)
    finally:
        folder.close()


def _folder(final: Path, root: Path | None) -> CacheDir:
    if root is None:
        return CacheDir.open(final.parent)
    return CacheDir.open(root, *final.parent.relative_to(root).parts)


def _remove_leftovers(folder: CacheDir) -> list[Path]:
    removed: list[Path] = []
    for name in sorted({n for n in (_final_name(p) for p in _temporaries(folder)) if n}):
        try:
            held: HeldLock | None = try_lock(lock_path(folder.path / name), directory=folder)
        except OSError:
            continue
        if held is not None:
            with held:
                removed.extend(_remove_temporaries(folder, name))
    return removed


def _temporaries(folder: CacheDir) -> list[str]:
    try:
        names = folder.names()
    except OSError:
        return []
    return [n for n in names if n.startswith(".") and n.endswith(TEMP_SUFFIX)]


def _final_name(temporary: str) -> str | None:
    """``NAME`` of ``.NAME.<pid>-<random>.tmp`` (and of its record's temporary
    ``..NAME.ok.<pid>-<random>.tmp``), or ``None`` for another file."""
    name, dot, tag = temporary[1 : -len(TEMP_SUFFIX)].rpartition(".")
    if not (dot and name and "-" in tag):
        return None
    if name.startswith(".") and name.endswith(RECORD_SUFFIX):
        return name[1 : -len(RECORD_SUFFIX)] or None
    return name


def _remove_temporaries(folder: CacheDir, name: str) -> list[Path]:
    """Delete ``name``'s temporaries (and its record's); only under ``name``'s lock."""
    removed = []
    for temporary in _temporaries(folder):
        if _final_name(temporary) == name:
            folder.unlink(temporary)
            removed.append(folder.path / temporary)
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
