"""The local shard cache: remote shards downloaded once per machine, served only whole and
verified, bounded by evicting what the epoch plan needs last.

Layout of the cache directory ``D`` (one file per name; everything that is not a shard starts
with a dot, so a shard is exactly a regular file whose name does not):

``D/KEY``           a complete, verified shard
``D/.KEY.ok``       its record: the inode, size, mtime and ctime of the file we verified
``D/.KEY.part``     its download in progress, or left by a killed process (resumed)
``D/.KEY.lock``     its lock file: exclusive while downloading or evicting, shared while pinned
``D/.evict.lock``   serializes eviction, so two processes making room do not both evict

``D`` is opened as ``_storage._safe`` says: this user's, written by nobody else, every entry
opened relative to it without following links (a link at a lock or a part is a CacheError).

NOTE [download protocol]
1. ``get`` returns ``D/KEY`` when its record says it is the file this cache verified, taking no
   lock: a shard gets a record only after a rename of a verified, fsynced file (step 4), so a
   file there without one, or another file put there since, is never served.
2. Otherwise it takes ``.KEY.lock`` exclusively, waiting while another process or thread holds it,
   and looks again: the holder may have just published it. A file without a record that has the
   right size and sha256 (from an earlier version of the cache) gets one; any other is deleted.
3. Still missing: it opens ``.KEY.part`` and calls ``fetch(fd, start)`` with ``start`` the part's
   size, so a part left by a killed process is resumed (no process can be writing it: we hold
   the lock).
4. It checks the size and the sha256, fsyncs, renames the part to ``KEY``, writes its record
   (atomically) and fsyncs ``D``. A wrong size or checksum deletes the part and downloads once
   more from byte 0, then fails.

So a shard is downloaded once per machine however many processes and threads ask (``flock``
locks belong to an open file, so threads of one process exclude each other too), and a process
killed at any instant leaves at most a part, never a ``KEY``. Eviction (``make_room``) and pins
(``pin``) take the same lock file, see their docstrings.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

from fastload._storage import CACHE_REMEDY, cache_root
from fastload._storage._lock import HeldLock, holder, lock, try_lock
from fastload._storage._safe import RECORD_SUFFIX, TEMP_SUFFIX, CacheDir
from fastload.errors import CacheError, FastloadError, StorageChecksumError

#: Errors of a fetch that mean the cache's disk, not the store, failed: they become CacheError.
_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG})
_KEY = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_STEM_CHARS = re.compile(r"[^A-Za-z0-9_-]+")
_SUFFIX = re.compile(r"\.[A-Za-z0-9]{1,16}")
_STEM_MAX = 48
_PART = ".part"
_LOCK = ".lock"
_EVICT_LOCK = ".evict.lock"
_READ_CHUNK = 1 << 20
_ATTEMPTS = 2  # the first download, and one from scratch after a wrong size or checksum
#: A part younger than this survives the clean-up on open: a restart after ``kill -9`` follows
#: the same plan and resumes it soon; older ones belong to plans that moved on.
KEEP_PARTS_S = 24 * 3600.0

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50,
}  # fmt: skip
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")

#: ``fetch(fd, start)`` writes the object's bytes from offset ``start`` to its end into ``fd``
#: (``os.pwrite`` at their own offsets), in order, so that the file's size is always the count of
#: bytes written: a killed download resumes from there. It may raise; an ``OSError`` with a
#: disk-full errno becomes :class:`CacheError`, anything else propagates and keeps the part.
Fetch = Callable[[int, int], None]


def parse_size(value: int | str, *, option: str = "cache_limit") -> int:
    """Bytes in ``value``: an int, or a number with a decimal (``kB MB GB TB PB``) or binary
    (``KiB MiB GiB TiB PiB``) unit, case-insensitive, spaces allowed: ``"200GB"`` is 200·10⁹,
    ``"1.5 GiB"`` 1.5·2³⁰. A bare ``G`` is refused as ambiguous. Fractions of a byte are dropped.
    ``ValueError`` naming ``option`` for anything else, negative sizes included."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and (match := _SIZE.fullmatch(value)):
        number, unit = match.groups()
        if unit.lower() in _UNITS:
            scale = _UNITS[unit.lower()]
            # whole numbers stay exact however large; a float has 53 bits
            return int(number) * scale if number.isdigit() else int(float(number) * scale)
    raise ValueError(
        f"{option} must be a number of bytes (an int >= 0) or a string like '200GB', '500MB' or"
        f" '1.5 GiB' (units kB MB GB TB PB, KiB MiB GiB TiB PiB); got {value!r}"
    )


def eviction_order(keys: list[str], next_use: Mapping[str, float]) -> list[str]:
    """``keys`` in the order to evict them: the one whose next use is furthest away first, a key
    absent from ``next_use`` (never used again) before all, equal ones by key. Evicting a prefix
    of this order therefore never drops a shard needed sooner than one kept."""
    return sorted(keys, key=lambda k: (-next_use.get(k, math.inf), k))


class ShardCache:
    """Complete, verified shards in ``root``, or in its subfolder ``folder`` (default
    ``cache_root() / "shards"``), shared by all processes and threads of the machine, bounded by
    ``limit`` bytes (an int, a string for :func:`parse_size`, or ``None`` for no bound) through
    :meth:`make_room`. ``root`` is checked as the cache root, ``folder`` opened below it without
    following a link (``_storage._safe``); a folder that is not this user's alone raises
    :class:`CacheError` when the cache is first used.

    A wait for another process's lock gives up after ``timeout_s`` with a :class:`CacheError`
    naming the holder. A part older than ``keep_parts_s`` whose writer is gone is deleted when the
    cache is first used; younger ones are resumed.
    """

    def __init__(
        self,
        root: Path | None = None,
        limit: int | str | None = None,
        *,
        folder: str | None = None,
        timeout_s: float = 3600.0,
        keep_parts_s: float = KEEP_PARTS_S,
    ) -> None:
        if root is None:
            root, folder = cache_root(), "shards"
        self._base = Path(root).absolute()
        self._parts = () if folder is None else (folder,)
        self.root = self._base.joinpath(*self._parts)
        self.limit = None if limit is None else parse_size(limit, option="cache_limit")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be a positive number of seconds; got {timeout_s!r}")
        if not keep_parts_s >= 0:
            raise ValueError(f"keep_parts_s must be a number of seconds >= 0; got {keep_parts_s!r}")
        self.timeout_s = float(timeout_s)
        self.keep_parts_s = float(keep_parts_s)
        self._opened = False
        self._opening = threading.Lock()
        self._local = threading.local()  # the folder open during this thread's call (_session)

    @staticmethod
    def key(url: str, name: str, version: str) -> str:
        """The cache key of shard ``name`` of the dataset at ``url`` in ``version`` (its checksum
        or ETag): the name's stem and suffix made filesystem-safe, for people and for readers that
        look at suffixes, and a 160-bit hash of all three, so that distinct triples never share a
        key (the three are hashed unambiguously, as a JSON list)."""
        base = PurePosixPath(name).name
        suffix = PurePosixPath(base).suffix
        suffix = suffix if _SUFFIX.fullmatch(suffix) else ""
        stem = _STEM_CHARS.sub("_", base[: len(base) - len(suffix)])[:_STEM_MAX] or "shard"
        digest = hashlib.sha256(json.dumps([url, name, version]).encode()).hexdigest()[:40]
        return f"{stem}.{digest}{suffix}"

    def evict(self, key: str) -> int | None:
        """Delete shard ``key`` unless it is pinned or being written: the bytes freed, or
        ``None`` when it stays (or is not there)."""
        self._final(key)  # checks the key
        with self._existing() as folder:
            return None if folder is None else self._evict(key)

    def shards(self) -> dict[str, int]:
        """The complete shards in the cache and their sizes (a scan of the directory)."""
        return self._shards()

    def contains(self, key: str) -> bool:
        """Whether a complete shard ``key``, the very file this cache verified, is there now."""
        self._final(key)
        with self._existing() as folder:
            return folder is not None and folder.trusted(key) is not None

    def usage(self) -> int:
        """Bytes of the complete shards in the cache (one ``scandir`` pass and a stat per file;
        parts of downloads in progress do not count)."""
        return sum(self._shards().values())

    def get(
        self, key: str, *, size: int, checksum: str | None, fetch: Fetch, source: str | None = None
    ) -> Path:
        """The path of a complete copy of shard ``key`` of ``size`` bytes whose sha256 is
        ``checksum`` (lowercase hex; ``None`` checks the size only), downloaded by ``fetch`` if
        absent, once per machine (see NOTE [download protocol]).

        Raises :class:`StorageError` naming ``source`` (the URL; the key when not given) and both
        values when the size or checksum is wrong twice; :class:`CacheError` naming the directory
        when the disk is full or the directory unusable (no part is kept then), or naming the
        file when a link is where the cache keeps one. Whatever ``fetch`` raises otherwise
        propagates and its part stays, to be resumed.
        """
        final = self._final(key)
        if size < 0:
            raise ValueError(f"size must be a number of bytes >= 0; got {size!r}")
        if checksum is not None and not _SHA256.fullmatch(checksum):
            raise ValueError(f"checksum must be a sha256 in lowercase hex or None; got {checksum!r}")
        with self._session() as folder:
            if _trusted(folder, key, size):
                return final
            held = self._download_lock(key, size)
            if held is None:
                return final  # another process downloaded it while we waited
            with held:
                if _trusted(folder, key, size) or self._adopt(key, size, checksum):
                    return final
                folder.forget(key)  # not the file we verified (replaced, touched, a link): fetch it
                self._download(key, size, checksum, fetch, source or key)
        return final

    def _adopt(self, key: str, size: int, checksum: str | None) -> bool:
        """Trust the regular file at ``key`` that has no record (kept by an earlier version of
        the cache) if its size and checksum are right: read whole once, instead of fetched."""
        folder = self._open()
        info = folder.lstat(key)
        if checksum is None or info is None or not stat.S_ISREG(info.st_mode) or info.st_size != size:
            return False
        try:
            fd = folder.open_file(key, os.O_RDONLY)
        except FastloadError:
            return False
        try:
            if _sha256(fd) != checksum:
                return False
        finally:
            os.close(fd)
        folder.record(key, size=size, sha256=checksum)
        return True

    def _download_lock(self, key: str, size: int) -> HeldLock | None:
        """The exclusive lock to download ``key``, or ``None`` once the shard is complete.

        Not a blocking wait on the lock: the process that downloads a shard usually pins it
        at once (a shared lock on the same file) and keeps it pinned while it reads, so a
        waiter would wait as long as that reader reads (and two readers each waiting for a
        shard the other has pinned, forever). The waiter polls for the lock or the file."""
        folder = self._open()
        deadline = time.monotonic() + self.timeout_s
        pause = 0.001
        while True:
            try:
                held = try_lock(self._lock_file(key), directory=folder)
            except FastloadError:
                raise
            except OSError as exc:  # a directory we cannot write: say so, do not wait
                raise self._disk_error(exc) from exc
            if held is not None:
                return held
            if _trusted(folder, key, size):
                return None
            if time.monotonic() > deadline:
                path = self._lock_file(key)
                raise CacheError(
                    f"{path}: waited {self.timeout_s:g} s for another process: {path} is locked "
                    f"by {holder(path, folder)}; if that process is stuck, stop it (its lock goes"
                    " with it)",
                    self.root, errno.ETIMEDOUT,
                )  # fmt: skip
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    @contextmanager
    def pin(self, key: str) -> Iterator[Path]:
        """Hold shard ``key`` in the cache while the ``with`` block runs (while a process has it
        open or mapped): a shared lock on its lock file, which :meth:`make_room` cannot take, so
        it never evicts a pinned shard. Many processes may pin one shard. Raises
        ``FileNotFoundError`` when the shard is not in the cache (evicted since :meth:`get`)."""
        final = self._final(key)
        missing = FileNotFoundError(
            errno.ENOENT, f"shard {key} is not in the cache (evicted?); get() it again", str(final)
        )
        with self._existing() as folder:
            if folder is None or folder.trusted(key) is None:  # no lock file for a shard not there
                raise missing
            held = self._lock(key, shared=True)
            if folder.trusted(key) is None:  # evicted while we took the lock
                held.release()
                raise missing
        try:
            yield final
        finally:
            held.release()

    def checked(self, key: str, checks: str) -> bool:
        """Whether shard ``key``, the very file this cache verified, has the checks named
        ``checks`` noted in its record (:meth:`mark_checked`)."""
        self._final(key)
        with self._existing() as folder:
            record = None if folder is None else folder.trusted(key)
        return record is not None and checks in record.get("checked", [])

    def mark_checked(self, key: str, checks: str) -> None:
        """Note in shard ``key``'s record that it passed the checks named ``checks``; only while
        the caller pins it (nobody may replace or evict it meanwhile). A record that is no
        longer the file's (the file was replaced) is left alone: its checks are lost with it."""
        self._final(key)
        with self._session() as folder:
            record = folder.trusted(key)
            if record is None:
                return
            done = [c for c in record.pop("checked", []) if isinstance(c, str)][-7:]
            record.pop("identity", None)
            try:
                folder.record(key, **record, checked=[*done, checks])
            except FastloadError:
                raise
            except OSError as exc:
                raise self._disk_error(exc) from exc

    def make_room(
        self, need: int, next_use: Mapping[str, float], *, later_than: float = -math.inf
    ) -> list[str]:
        """Evict complete shards until ``usage() + need <= limit`` or nothing more may go, in
        :func:`eviction_order` of ``next_use`` (key → when the plan next reads it, in any
        increasing unit; absent means never), and return the evicted keys in that order.
        Only shards whose next use is later than ``later_than`` may go: making room for a
        shard the plan reads at ``later_than`` never drops one it reads sooner, even when the
        cache has grown since the caller counted what it could free.

        A shard being pinned or downloaded is skipped and stays counted, so the limit may be
        exceeded by the shards in use at that moment; with ``limit=None`` nothing is evicted.
        Callers making room at once are serialized (the others wait), so none evicts what
        another's eviction already freed. Downloads in flight are not counted: ``need`` is the
        caller's own."""
        if need < 0:
            raise ValueError(f"need must be a number of bytes >= 0; got {need!r}")
        if self.limit is None:
            return []
        evicted: list[str] = []
        with self._session(), self._held(self.root / _EVICT_LOCK, shared=False):
            shards = self._shards()
            excess = sum(shards.values()) + need - self.limit
            for key in eviction_order(list(shards), next_use):
                if excess <= 0 or next_use.get(key, math.inf) <= later_than:
                    break
                freed = self._evict(key)
                if freed is not None:
                    evicted.append(key)
                    excess -= freed
        return evicted

    def clean_leftovers(self, *, older_than_s: float = 0.0) -> list[Path]:
        """Delete the parts no live process is writing (their lock is free) that were last
        written more than ``older_than_s`` ago, records and temporaries of shards no longer
        there, and lock files that guard nothing; return the parts deleted. A part being
        written, and any shard, is left alone."""
        with self._existing() as folder:
            return [] if folder is None else self._clean(folder, older_than_s)

    def _clean(self, folder: CacheDir, older_than_s: float) -> list[Path]:
        removed: list[Path] = []
        now = time.time()
        try:
            names = sorted(folder.names())
        except OSError as exc:
            raise self._disk_error(exc) from exc
        for name in names:
            if not (name.startswith(".") and name.endswith(_PART)):
                continue
            key = name[1 : -len(_PART)]
            held = self._try_lock(key)
            if held is None:
                continue
            with held:
                info = folder.lstat(name)
                if info is not None and now - info.st_mtime >= older_than_s:
                    folder.unlink(name)
                    removed.append(self.root / name)
        for name in names:
            owner = _owner_of(name)
            if owner is not None and _KEY.fullmatch(owner) and (record_lock := self._try_lock(owner)) is not None:
                with record_lock:  # a record's temporary is written under its shard's lock
                    if name.endswith(TEMP_SUFFIX) or folder.lstat(owner) is None:
                        folder.unlink(name)
        for name in names:
            if name.startswith(".") and name.endswith(_LOCK) and name != _EVICT_LOCK:
                key = name[1 : -len(_LOCK)]
                if _KEY.fullmatch(key) and folder.lstat(key) is None and folder.lstat(self._part(key).name) is None:
                    self._drop_lock_file(key)  # looks again under the lock
        return removed

    # -- internals --------------------------------------------------------------------------

    def _final(self, key: str) -> Path:
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise ValueError(
                "key must be 1 to 200 of the characters A-Z a-z 0-9 . _ - and not start with a"
                f" dot (ShardCache.key() makes one); got {key!r}"
            )
        return self.root / key

    def _part(self, key: str) -> Path:
        return self.root / f".{key}{_PART}"

    def _lock_file(self, key: str) -> Path:
        return self.root / f".{key}{_LOCK}"

    @contextmanager
    def _existing(self) -> Iterator[CacheDir | None]:
        """:meth:`_session`, or ``None`` when the directory does not exist (looking creates
        nothing)."""
        if getattr(self._local, "folder", None) is None and not self.root.exists():
            yield None
        else:
            with self._session() as folder:
                yield folder

    @contextmanager
    def _session(self) -> Iterator[CacheDir]:
        """The directory, created and checked (``_storage._safe``), open while this call of a
        public method runs (in this thread; nested calls share it) and closed after, so that no
        descriptor outlives the call; old leftovers are cleaned on the first, once per
        instance."""
        current: CacheDir | None = getattr(self._local, "folder", None)
        if current is not None:
            yield current
            return
        folder = CacheDir.open(self._base, *self._parts)
        self._local.folder = folder
        try:
            with self._opening:
                first, self._opened = not self._opened, True
            if first:
                self._clean(folder, self.keep_parts_s)
            yield folder
        finally:
            self._local.folder = None
            folder.close()

    def _open(self) -> CacheDir:
        """The directory of the running :meth:`_session`."""
        folder: CacheDir | None = getattr(self._local, "folder", None)
        assert folder is not None, "only within a _session"
        return folder

    def _shards(self) -> dict[str, int]:
        with self._existing() as folder:
            return {} if folder is None else _shards_in(folder)

    def _lock(self, key: str, *, shared: bool = False) -> HeldLock:
        return self._held(self._lock_file(key), shared=shared)

    def _held(self, path: Path, *, shared: bool) -> HeldLock:
        try:
            return lock(path, timeout_s=self.timeout_s, shared=shared, directory=self._open())
        except TimeoutError as exc:
            raise CacheError(
                f"{path}: waited {self.timeout_s:g} s for another process: {exc}",
                self.root, errno.ETIMEDOUT,
            ) from exc
        except FastloadError:
            raise
        except OSError as exc:
            raise self._disk_error(exc) from exc

    def _try_lock(self, key: str) -> HeldLock | None:
        try:
            return try_lock(self._lock_file(key), directory=self._open())
        except OSError:
            return None  # a directory we cannot write: nothing of it can be ours to delete

    def _evict(self, key: str) -> int | None:
        """Delete shard ``key`` unless it is pinned or being written; the bytes freed, or
        ``None`` when it stays (or another process evicted it first)."""
        held = self._try_lock(key)
        if held is None:
            return None
        folder = self._open()
        with held:
            info = folder.lstat(key)
            if info is None:
                return None
            folder.forget(key)
            held.unlink()  # see _storage._lock: a waiter on the old file moves to a new one
        return info.st_size

    def _drop_lock_file(self, key: str) -> None:
        held = self._try_lock(key)
        if held is None:
            return
        folder = self._open()
        with held:
            if folder.lstat(key) is None and folder.lstat(self._part(key).name) is None:
                held.unlink()

    def _download(self, key: str, size: int, checksum: str | None, fetch: Fetch, source: str) -> None:
        """Steps 3 and 4 of NOTE [download protocol]; only under ``key``'s exclusive lock."""
        folder = self._open()
        part = self._part(key).name
        for attempt in range(_ATTEMPTS):
            try:
                got_size, got_sum = self._fill(part, size, fetch)
                if got_size == size and (checksum is None or got_sum == checksum):
                    try:
                        folder.replace(part, key)
                        folder.record(key, size=size, sha256=got_sum)
                        folder.fsync()
                    except FastloadError:
                        raise
                    except OSError as exc:
                        raise self._disk_error(exc) from exc
                    return
            except CacheError:
                folder.unlink(part)  # a full disk should not stay full of our part (nor a link)
                raise
            folder.unlink(part)
            if attempt + 1 == _ATTEMPTS:
                raise StorageChecksumError(
                    f"{source}: the download of shard {key} is {got_size} bytes with sha256"
                    f" {got_sum}, the index says {size} bytes with sha256 {checksum or '(any)'};"
                    f" downloaded {_ATTEMPTS} times from scratch, wrong each time. The object"
                    " changed after it was indexed, or the store serves it damaged: index the"
                    " dataset again (fastload index) or check the store",
                    source,
                    errno.EIO,
                )

    def _fill(self, part: str, size: int, fetch: Fetch) -> tuple[int, str]:
        """Complete ``part`` through ``fetch`` from its current size, fsync it, and return its
        size and sha256 (read back: bytes written before a kill were never seen by this
        process). A failure of the cache's disk is a :class:`CacheError`; whatever else
        ``fetch`` raises propagates."""
        try:
            fd = self._open().open_file(part, os.O_RDWR | os.O_CREAT, 0o600)
        except FastloadError:
            raise
        except OSError as exc:
            raise self._disk_error(exc) from exc
        try:
            try:
                start = os.fstat(fd).st_size
                if start > size:  # longer than the object: nothing of it can be trusted
                    os.ftruncate(fd, 0)
                    start = 0
            except OSError as exc:
                raise self._disk_error(exc) from exc
            if start < size:
                try:
                    fetch(fd, start)
                except FastloadError:
                    raise
                except OSError as exc:
                    if exc.errno in _DISK_ERRNOS:
                        raise self._disk_error(exc) from exc
                    raise  # the store's (a reset connection): the part is kept, to resume
            try:
                os.fsync(fd)
                return os.fstat(fd).st_size, _sha256(fd)
            except OSError as exc:
                raise self._disk_error(exc) from exc
        finally:
            os.close(fd)

    def _disk_error(self, exc: OSError) -> CacheError:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        return CacheError(
            f"cannot write shards into the cache directory {self.root}: {reason}; {CACHE_REMEDY}"
            + (", or lower cache_limit" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else ""),
            self.root,
            exc.errno,
        )


def _shards_in(folder: CacheDir) -> dict[str, int]:
    shards: dict[str, int] = {}
    for name in folder.names():
        if name.startswith("."):
            continue
        info = folder.lstat(name)  # None: evicted while we looked
        if info is not None and stat.S_ISREG(info.st_mode):
            shards[name] = info.st_size
    return shards


def _trusted(folder: CacheDir, key: str, size: int) -> bool:
    """Whether ``key`` is the file this cache verified (see _storage._safe), of ``size`` bytes."""
    record = folder.trusted(key)
    return record is not None and record.get("size") == size


def _owner_of(name: str) -> str | None:
    """The key whose record (``.KEY.ok``) or record's temporary ``name`` is, else ``None``."""
    if name.startswith("..") and name.endswith(TEMP_SUFFIX):
        name = name[1:].rpartition(".")[0].rpartition(".")[0]
    if name.startswith(".") and name.endswith(RECORD_SUFFIX):
        return name[1 : -len(RECORD_SUFFIX)]
    return None


def _sha256(fd: int) -> str:
    digest = hashlib.sha256()
    offset = 0
    while chunk := os.pread(fd, _READ_CHUNK, offset):
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()
