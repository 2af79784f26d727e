"""Where a remote dataset's shards are, and how one reaches the local disk.

A reader given a URL (``s3://bucket/corpus/``, ``gs://...``, ``https://...``; a glob in the last
part selects shards) builds a :class:`RemoteSource`: the dataset's index, read once per node
(cached in the local cache, fresh for :data:`INDEX_FRESH_S`; a later loader on the node makes
no request), and the shard cache. The reader plans from the index alone; a shard is downloaded
when a process first reads from it (:meth:`RemoteSource.local_path`), unless a prefetcher got
there first, and is *pinned* while a process has it open, so that eviction passes it by.
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, TypeVar

from fastload._remote import INDEX_NAME, DatasetIndex, ShardEntry
from fastload._remote._cache import ShardCache, parse_size
from fastload._remote._store import Store, open_store
from fastload._storage import cache_root
from fastload._storage._lock import lock
from fastload._storage._safe import CacheDir
from fastload._types import Field, StorageCounts
from fastload.errors import (
    DataFileNotFoundError,
    DataFormatError,
    FieldNotFoundError,
    StorageNotFoundError,
)

#: A cached index fetched less than this long ago is used without asking the store (one request
#: per node per job); an older one is revalidated (see NOTE [cached index]).
INDEX_FRESH_S = 600.0

# NOTE [cached index]
# An index is cached in ``<cache root>/indexes/`` (``_storage._safe``: our folder, no link
# followed) with a record of the file we wrote, when we fetched it (our clock, never a file's
# time) and the store's version and size of the object. Within INDEX_FRESH_S of the fetch it is
# used as it is; after that, or when our clock says the fetch lies in the future, a HEAD (stat)
# of the object revalidates it: the same version and size keep it (fresh again), anything else
# fetches it again. A file there that is not the one we wrote is never used.
_GLOB_CHARS = frozenset("*?[")
_warned: set[str] = set()  # dataset folders planned without an index, said once per process
_warned_lock = threading.Lock()
_T = TypeVar("_T")


def split_url(url: str) -> tuple[str, str | None]:
    """``(folder URL ending in "/", pattern or None)``: ``s3://b/c/`` → all shards of ``c``;
    ``s3://b/c/*.h5`` → those matching; ``s3://b/c/x.h5`` → that one (a pattern without
    wildcards)."""
    if url.endswith("/"):
        return url, None
    folder, _, last = url.rpartition("/")
    scheme_end = url.find("://") + 3
    if len(folder) < scheme_end:  # s3://bucket: the bucket is the folder
        return url + "/", None
    return folder + "/", last


class RemoteSource:
    """A remote dataset's index, store and shard cache (see the module text). Pickles as its
    settings and index; each process opens its own store and cache."""

    def __init__(
        self,
        url: str,
        *,
        storage_options: Mapping[str, Any] | None,
        cache_dir: str | os.PathLike[str] | None,
        cache_limit: int | str | None,
        derive: Callable[[Store], DatasetIndex],
    ) -> None:
        self.folder, pattern = split_url(url)
        self.storage_options = dict(storage_options or {})
        self.cache_root = cache_root(cache_dir)
        self.cache_limit = None if cache_limit is None else parse_size(cache_limit)
        self._store: Store | None = None
        self._cache: ShardCache | None = None
        self._pid = os.getpid()
        self._environment = storage_environment()
        self._counts = StorageCounts()  # this process's reads (see storage_counts)
        self._counting = threading.Lock()
        index = self._load_index(derive)
        if pattern is not None:
            names = [s.path for s in index.shards if fnmatch.fnmatchcase(s.path, pattern)]
            if not names:
                raise DataFileNotFoundError(
                    f"{url}: no shard of the index {self.folder}{INDEX_NAME} matches "
                    f"{pattern!r} (it lists {len(index.shards)}, e.g. {index.shards[0].path})",
                    url,
                )
            index = index.matching(names)
        self.index = index

    # -- per process -------------------------------------------------------------------------

    def store(self) -> Store:
        self._own_process()
        if self._store is None:
            _adopt(self._environment)
            self._store = open_store(self.folder, self.storage_options)
        return self._store

    def cache(self) -> ShardCache:
        self._own_process()
        if self._cache is None:
            self._cache = ShardCache(self.cache_root, self.cache_limit, folder="shards")
        return self._cache

    def _own_process(self) -> None:
        if self._pid != os.getpid():  # forked: the parent's clients and counters are not ours
            self._pid, self._store, self._cache = os.getpid(), None, None
            self._counts, self._counting = StorageCounts(), threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_store"] = state["_cache"] = state["_counting"] = None
        state["_counts"] = StorageCounts()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._counting = threading.Lock()

    def storage_counts(self) -> StorageCounts:
        """What this process's reads of the shards cost so far (the prefetcher's downloads are
        its own: it counts them in :class:`~fastload._shards._prefetch.PrefetchStats`)."""
        self._own_process()
        return self._counts

    # -- shards --------------------------------------------------------------------------------

    @property
    def urls(self) -> list[str]:
        return [self.folder + s.path for s in self.index.shards]

    def key(self, shard: int) -> str:
        entry = self.index.shards[shard]
        return self.cache().key(self.folder, entry.path, entry.cache_version)

    def cached(self, shard: int) -> bool:
        return self.cache().contains(self.key(shard))

    def local_path(self, shard: int, *, counted: bool = True) -> Path:
        """Shard ``shard`` on the local disk, complete and verified: from the cache, else
        downloaded now (once per node: another process downloading it is waited for).
        ``counted``: add the call to :meth:`storage_counts` (a read's lookup, not a
        prefetcher's)."""
        entry = self.index.shards[shard]
        key, cache = self.key(shard), self.cache()
        hit = counted and cache.contains(key)
        started = time.perf_counter()
        fetched = [0]
        try:
            return cache.get(
                key,
                size=entry.bytes,
                checksum=entry.sha256,
                fetch=self._fetcher(entry, fetched),
                source=self.urls[shard],
            )
        finally:
            if hit and not fetched[0]:
                self._count(StorageCounts(hits=1))
            elif counted:
                self._count(StorageCounts(time.perf_counter() - started, fetched[0], 0, 1))

    def count_hit(self) -> None:
        """Count a read of a shard this process has open (pinned: a hit, looked up in no
        folder)."""
        self._count(StorageCounts(hits=1))

    def checked(self, shard: int, checks: str) -> bool:
        """Whether shard ``shard`` (pinned) was checked for ``checks`` since it entered the
        cache (see :meth:`mark_checked`)."""
        return self.cache().checked(self.key(shard), checks)

    def mark_checked(self, shard: int, checks: str) -> None:
        """Record in the cache that shard ``shard`` (pinned) passed the checks ``checks`` names
        (a reader's digest of what it checks for), so that no process checks it again while
        it stays the file the cache verified."""
        self.cache().mark_checked(self.key(shard), checks)

    def _count(self, counts: StorageCounts) -> None:
        self._own_process()
        with self._counting:
            self._counts = self._counts + counts

    def pin(self, shard: int) -> AbstractContextManager[Any]:
        """Shard ``shard`` in the cache (fetched if it is not), held there while the ``with``
        block opens or reads it; raises ``FileNotFoundError`` when it was evicted in between
        (try again)."""
        self.local_path(shard)
        return self.cache().pin(self.key(shard))

    def _fetcher(self, entry: ShardEntry, fetched: list[int]) -> Any:
        """The download of ``entry`` into a descriptor from byte ``start`` on; adds the bytes
        it asked for to ``fetched[0]``."""
        store = self.store()

        def fetch(fd: int, start: int) -> None:
            fetched[0] += entry.bytes - start
            store.download(entry.path, fd, size=entry.bytes, start=start)

        return fetch

    # -- the index -----------------------------------------------------------------------------

    def _load_index(self, derive: Callable[[Store], DatasetIndex]) -> DatasetIndex:
        """The index, from this node's cache when fresh, else from the store (one GET; the
        node's processes and loaders wait for one another instead of each asking). Without an
        index file, ``derive(store)``: one derived from a listing and the shards' footers
        (``fastload._formats._discover_remote``), cached alike. See NOTE [cached index]."""
        where = self.folder + INDEX_NAME
        digest = hashlib.sha256(where.encode()).hexdigest()[:32]
        name, derived = f"{digest}.json", f"{digest}.derived.json"
        folder = CacheDir.open(self.cache_root, "indexes")
        try:
            with lock(folder.path / f"{digest}.lock", timeout_s=600.0, directory=folder):
                data = self._cached_index(folder, name)
                if data is None:
                    cached = _fresh(folder, derived)
                    if cached is not None:
                        return _cached_derived_index(folder.path / derived, self.folder, cached)
                    try:
                        data = self.store().read(INDEX_NAME)
                    except StorageNotFoundError:
                        return _derived_index(self.store(), derive, lambda text: _keep(folder, derived, text), self.folder)
                    # After the GET: a HEAD of a missing object costs S3 a listing too. A version
                    # that does not match the bytes' size is not kept (revalidation then refetches).
                    info = self.store().info(INDEX_NAME)
                    version = info.version if info.size == len(data) else ""
                    _keep(folder, name, data, version=version, size=info.size)
            try:
                return DatasetIndex.from_json(data, where)
            except DataFormatError:
                folder.forget(name)  # not kept: the next loader asks the store again
                raise
        finally:
            folder.close()

    def _cached_index(self, folder: CacheDir, name: str) -> bytes | None:
        """This node's copy of the index file if it is fresh, or still the store's version (a
        HEAD or stat says so), else ``None``."""
        data = _fresh(folder, name)
        if data is not None:
            return data
        record = folder.trusted(name)
        if record is None or not record.get("version"):
            return None
        try:
            info = self.store().info(INDEX_NAME)
        except StorageNotFoundError:
            return None  # deleted since: the caller finds out, and derives one
        if [info.version, info.size] != [record["version"], record.get("size")]:
            return None
        data = folder.read(name)
        if data is None or len(data) != info.size:
            return None
        _keep(folder, name, data, version=info.version, size=info.size)
        return data


#: Environment variables the storage clients read (credentials, endpoints, regions, profiles).
_STORAGE_ENV = ("AWS_", "GOOGLE_", "GCS_", "GCE_", "CLOUDSDK_")


def storage_environment() -> dict[str, str]:
    """This process's variables that configure the storage clients (:data:`_STORAGE_ENV`)."""
    return {k: v for k, v in os.environ.items() if k.startswith(_STORAGE_ENV)}


def _adopt(environment: dict[str, str]) -> None:
    """Make this process's storage variables those the dataset was made with. A worker forked
    by a fork server has the server's environment, from whenever it started, not the main
    process's: without its credentials the AWS SDK asks the EC2 metadata service and waits."""
    for name in list(os.environ):
        if name.startswith(_STORAGE_ENV) and name not in environment:
            del os.environ[name]
    os.environ.update(environment)


def remote_fields(
    source: RemoteSource, kind: str, requested: list[str] | None, length_field: str | None
) -> tuple[dict[str, Field], str | None]:
    """The fields a reader of ``kind`` reads from ``source`` (its index's, or ``requested`` of
    them, in that order) and its length field, which must be the one the index has lengths of."""
    index, where = source.index, source.folder + INDEX_NAME
    if index.kind != kind:
        other = "ArrowDataset" if index.kind == "arrow" else "HDF5Dataset"
        raise DataFormatError(f"{where}: indexes {index.kind} shards; read them with {other}")
    if requested is None:
        fields = dict(index.fields)
    else:
        missing = [name for name in requested if name not in index.fields]
        if missing:
            raise FieldNotFoundError(
                f"{where}: no field {', '.join(map(repr, missing))}; the shards hold "
                f"{', '.join(index.fields)}"
            )
        fields = {name: index.fields[name] for name in requested}
    chosen = index.length_field if length_field is None else length_field
    if chosen != index.length_field or (chosen is not None and chosen not in fields):
        ragged = [n for n, f in fields.items() if f.kind == "ragged"]
        if chosen is None and not ragged:
            return fields, None  # no ragged field read: every sample has length 1
        raise DataFormatError(
            f"{where}: holds the lengths of {index.length_field!r}, so it must be the length "
            f"field and among the fields read (asked: length_field={chosen!r}, fields "
            f"{list(fields)}); index the shards for another length field to read by that one"
        )
    return fields, chosen


def local_only(reader: str, *, storage_options: Mapping[str, Any] | None, cache_limit: int | str | None) -> None:
    """Check the remote-only options given for a local dataset (local files are read where they
    are, never copied into the cache): ``storage_options`` is refused; ``cache_limit`` is
    checked, then ignored, and a log line says so once per process, so that code choosing
    local or remote data by its path works with either."""
    if storage_options is not None:
        raise ValueError(
            f"{reader}: storage_options apply to remote datasets (s3://, gs://, https://); "
            "local files are read in place"
        )
    if cache_limit is not None:
        parse_size(cache_limit)
        with _said_lock:
            if _said:
                return
            _said.append(reader)
        _log.warning(
            "fastload: %s: cache_limit=%r is ignored for local files, which are read in place"
            " (it bounds the cache of remote datasets); said once per process",
            reader, cache_limit,
        )  # fmt: skip


_said: list[str] = []
_said_lock = threading.Lock()
_log = logging.getLogger("fastload")


def _cached_derived_index(path: Path, folder: str, cached: bytes) -> DatasetIndex:
    """The derived index of the dataset at ``folder`` from ``cached``, this node's copy at
    ``path`` (deleted when damaged, so the next loader derives it again). Warns once per
    process and folder (:func:`_warn_derived`)."""
    try:
        index = DatasetIndex.from_json(cached, str(path))
    except DataFormatError:
        path.unlink(missing_ok=True)
        raise
    _warn_derived(folder, len(index.shards), None)
    return index


def _derived_index(
    store: Store, derive: Callable[[Store], DatasetIndex], keep: Callable[[bytes], None], folder: str
) -> DatasetIndex:
    """``derive(store)``, the index of the dataset at ``folder`` derived from its shards, handed
    to ``keep`` as JSON (it caches it for the node's other processes and loaders; the caller
    holds the node's lock of the index). Warns once per process and folder
    (:func:`_warn_derived`)."""
    index, seconds = _timed(lambda: derive(store))
    keep(index.to_json())
    _warn_derived(folder, len(index.shards), seconds)
    return index


def _warn_derived(folder: str, shards: int, seconds: float | None) -> None:
    """Say once per process and dataset folder that it was planned without an index."""
    with _warned_lock:
        if folder in _warned:
            return
        _warned.add(folder)
    how = (
        f"listed {shards} shards and read their footers and length columns in {seconds:.2f} s"
        if seconds is not None
        else f"planned from this node's cached copy of the index derived from {shards} shards' footers"
    )
    warnings.warn(
        f"{folder}{INDEX_NAME} not found: {how}; an index starts faster and lets the shard "
        f"cache verify checksums: write one with `fastload index {folder}`",
        UserWarning,
        stacklevel=6,  # the dataset's construction in the caller's code
    )


def _timed(function: Callable[[], _T]) -> tuple[_T, float]:
    """``function()`` and the seconds it took."""
    started = time.perf_counter()
    result = function()
    return result, time.perf_counter() - started


def _fresh(folder: CacheDir, name: str) -> bytes | None:
    """The bytes of cached ``name`` if it is the file we wrote and we fetched it less than
    :data:`INDEX_FRESH_S` ago (by our record: a fetch time ahead of the clock is not fresh)."""
    record = folder.trusted(name)
    if record is None:
        return None
    fetched = record.get("fetched_at")
    if not isinstance(fetched, (int, float)) or not 0 <= time.time() - fetched < INDEX_FRESH_S:
        return None
    return folder.read(name)


def _keep(folder: CacheDir, name: str, data: bytes, **facts: object) -> None:
    """Cache ``data`` as ``name`` with its record: fetched now, and ``facts``."""
    folder.write_new(name, data)
    folder.record(name, fetched_at=time.time(), **facts)


__all__ = [
    "INDEX_FRESH_S",
    "RemoteSource",
    "local_only",
    "remote_fields",
    "split_url",
]
