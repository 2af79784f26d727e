"""The cache's folders and files, opened so that nothing another user planted is ever read or
written through.

The cache is shared by a user's processes on a node, often below a folder others may write to
(``/tmp``, a shared scratch filesystem), so someone else may have made our folder first, or put
a link where we keep a file. Hence:

- the cache root is created 0700 and refused when it belongs to another user or when its
  group or others may write to it (then they could rename or plant anything in it);
- each folder below it is opened relative to its parent's descriptor with ``O_NOFOLLOW`` and
  checked the same way, and every file relative to its folder's descriptor with ``O_NOFOLLOW``
  (``O_EXCL`` for temporaries): a link, or anything but a regular file, where one of our files
  should be is a :class:`CacheError` naming it, never followed;
- a file the cache trusts (a verified shard, a decoded copy, an index) is tied to what we wrote:
  a *record* beside it (``.NAME.ok``, written atomically by us) holds its inode, size, mtime and
  ctime when we finished it, and any other file found under that name is not trusted.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import stat
import weakref
from pathlib import Path
from typing import Any

from fastload._storage._root import CACHE_ENV, CACHE_REMEDY
from fastload.errors import CacheError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
RECORD_SUFFIX = ".ok"
TEMP_SUFFIX = ".tmp"
_RECORD_MAX_BYTES = 1 << 16


def link_error(path: Path) -> CacheError:
    """The error for a link, or another non-regular file, where the cache keeps one of its own."""
    return CacheError(
        f"{path} is a symbolic link or not a regular file, where fastload keeps a file of its own"
        " cache; it is never followed: delete it, and keep the cache in a folder only you can"
        f" write (cache_dir= or {CACHE_ENV})",
        path,
        errno.ELOOP,
    )


def _unsafe_folder(path: Path, info: os.stat_result, what: str) -> CacheError | None:
    if not stat.S_ISDIR(info.st_mode):
        return CacheError(f"{what} {path} is not a folder; pass cache_dir= another folder or set {CACHE_ENV}", path, errno.ENOTDIR)
    if info.st_uid != os.geteuid():
        return CacheError(
            f"{what} {path} belongs to user id {info.st_uid}, not to this user ({os.geteuid()}):"
            f" its owner could plant any file in it; pass cache_dir= a folder of your own, or set"
            f" {CACHE_ENV} to one",
            path,
            errno.EPERM,
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return CacheError(
            f"{what} {path} may be written by others (mode {stat.S_IMODE(info.st_mode):04o}):"
            f" they could plant any file in it; run `chmod go-w {path}`, or pass cache_dir= a"
            f" folder only you can write, or set {CACHE_ENV} to one",
            path,
            errno.EPERM,
        )
    return None


class CacheDir:
    """An open folder of the cache: :attr:`path` for messages and for readers that open files
    by path, :attr:`fd` for every operation on its entries. Opening it creates it (0700) and
    refuses it (:class:`CacheError`) unless it and the folders from the cache root down to it
    are this user's and written by nobody else. The descriptor closes with the object."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd
        self._closer = weakref.finalize(self, os.close, fd)

    def close(self) -> None:
        """Idempotent; the object is unusable afterwards."""
        self._closer()

    @classmethod
    def open(cls, root: Path, *parts: str) -> CacheDir:
        """The folder ``root/parts...``, where ``root`` is the cache root (see the class)."""
        root = Path(root).absolute()
        target = root.joinpath(*parts)  # what the caller asked for, in messages
        try:
            try:  # opened first: the folder exists on every call but the first
                fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except FileNotFoundError:
                root.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                with contextlib.suppress(FileExistsError):
                    os.mkdir(root, 0o700)
                fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise _unusable(target, exc) from exc
        path = root
        try:
            if os.path.islink(root):  # a link we did not make leads where its maker chose
                link = os.lstat(root)
                if link.st_uid not in (os.geteuid(), 0):
                    raise CacheError(
                        f"the cache folder {root} is a link made by user id {link.st_uid}, not by"
                        f" this user; pass cache_dir= a folder of your own, or set {CACHE_ENV}",
                        root, errno.EPERM,
                    )  # fmt: skip
            problem = _unsafe_folder(root, os.fstat(fd), "the cache folder")
            if problem is not None:
                raise problem
            for part in parts:
                path = path / part
                try:
                    try:
                        inner = os.open(part, _DIR_FLAGS, dir_fd=fd)
                    except FileNotFoundError:
                        with contextlib.suppress(FileExistsError):
                            os.mkdir(part, 0o700, dir_fd=fd)
                        inner = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise link_error(path) from exc
                    raise
                os.close(fd)
                fd = inner
                problem = _unsafe_folder(path, os.fstat(fd), "the cache folder")
                if problem is not None:
                    raise problem
        except BaseException as exc:
            os.close(fd)
            if isinstance(exc, OSError) and not isinstance(exc, CacheError):
                raise _unusable(target, exc) from exc
            raise
        return cls(path, fd)

    # -- entries -----------------------------------------------------------------------------

    def open_file(self, name: str, flags: int, mode: int = 0o600) -> int:
        """A descriptor of the regular file ``name`` (``os.open`` flags); a link or a
        non-regular file there is a :class:`CacheError` (:func:`link_error`), other failures
        raise ``OSError`` as they are."""
        try:
            fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise link_error(self.path / name) from exc
            raise
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise link_error(self.path / name)
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def lstat(self, name: str) -> os.stat_result | None:
        """``name``'s own status (a link's, not its target's), or ``None`` when absent."""
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def read(self, name: str, limit: int | None = None) -> bytes | None:
        """The bytes of regular file ``name``, ``None`` when it is absent (or longer than
        ``limit``); a link there is a :class:`CacheError`."""
        try:
            fd = self.open_file(name, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            if limit is not None and size > limit:
                return None
            chunks = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def write_new(self, name: str, data: bytes) -> None:
        """Publish ``data`` as ``name`` atomically: a temporary made with ``O_EXCL``, fsynced,
        renamed over ``name``."""
        temporary = self.temporary_name(name)
        fd = self.open_file(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temporary, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            self.unlink(temporary)
            raise

    def create_temporary(self, name: str) -> str:
        """A new empty temporary file for ``name`` (``O_EXCL``: never one that was there);
        its name, for :meth:`replace`."""
        temporary = self.temporary_name(name)
        os.close(self.open_file(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
        return temporary

    @staticmethod
    def temporary_name(name: str) -> str:
        """``.NAME.<pid>-<random>.tmp``: hidden, unique, and telling which name it is for."""
        return f".{name}.{os.getpid()}-{secrets.token_hex(4)}{TEMP_SUFFIX}"

    def replace(self, source: str, target: str) -> None:
        os.replace(source, target, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def unlink(self, name: str) -> bool:
        """Delete ``name`` (a link itself, never its target); False when it was not there."""
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            return False
        return True

    def names(self) -> list[str]:
        return os.listdir(self.fd)

    def fsync(self) -> None:
        os.fsync(self.fd)

    # -- records: what the cache trusts ------------------------------------------------------

    @staticmethod
    def record_name(name: str) -> str:
        return f".{name}{RECORD_SUFFIX}"

    def record(self, name: str, **facts: Any) -> dict[str, Any]:
        """Tie ``name`` (a regular file we just finished) to what it is now, with ``facts``
        (JSON values) beside; the record written, as :meth:`trusted` returns it."""
        info = self.lstat(name)
        if info is None or not stat.S_ISREG(info.st_mode):
            raise link_error(self.path / name)
        record = {**facts, "identity": _identity(info)}
        self.write_new(self.record_name(name), json.dumps(record).encode())
        return record

    def trusted(self, name: str) -> dict[str, Any] | None:
        """The record of ``name`` if the file there is still the one it was written for (a
        regular file of the same inode, size, mtime and ctime), else ``None``: absent, replaced,
        touched, or a link."""
        info = self.lstat(name)
        if info is None or not stat.S_ISREG(info.st_mode):
            return None
        try:
            data = self.read(self.record_name(name), _RECORD_MAX_BYTES)
            record = json.loads(data) if data else None
        except (CacheError, ValueError):
            return None
        if not isinstance(record, dict) or record.get("identity") != _identity(info):
            return None
        return record

    def forget(self, name: str) -> None:
        """Delete ``name`` and its record (the record first: a file without one is untrusted)."""
        self.unlink(self.record_name(name))
        self.unlink(name)


def _identity(info: os.stat_result) -> list[int]:
    return [info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns]


def _unusable(path: Path, exc: OSError) -> CacheError:
    return CacheError(
        f"cannot use the cache folder {path}: {os.strerror(exc.errno) if exc.errno else exc}; {CACHE_REMEDY}",
        path,
        exc.errno,
    )
