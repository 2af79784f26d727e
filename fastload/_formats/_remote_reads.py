"""What a reader does differently when its shards live on object storage: each process opens
the shards from the local shard cache (:class:`~fastload._formats._remote_source.RemoteSource`
downloads one on first use, unless the prefetcher got there first), keeps a shard open, and
pinned in the cache, while it reads it, and checks a shard once when it enters the cache (see
NOTE [open while pinned]). A mixin of :class:`~fastload._formats._base.ShardedDataset`; local
datasets (``_remote is None``) never reach these paths.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from fastload._formats._remote_source import RemoteSource, check_lengths_as_indexed
from fastload._formats._shard_prefetch import ShardPrefetcher
from fastload._types import Column, StorageCounts

#: Remote shards one process keeps open (and pinned) at most: the least recently read is
#: closed first. Each holds three descriptors (the map, its size watch, the pin).
MAX_OPEN_REMOTE_SHARDS = 64
#: In a bounded cache, the shards one process keeps open take at most this share of the limit
#: (the rest is for the shards fetched ahead of the reads: see NOTE [open while pinned]).
PINNED_SHARE = 0.5


class RemoteShards:
    """The remote half of a sharded reader (see the module text)."""

    #: Where the shards of a remote dataset come from (``None``: local files).
    _remote: RemoteSource | None
    _process: Any  # the reader's per-process state (``_process.ProcessState``)
    _length_field: str | None
    _fields: dict[str, Any]
    _shard_starts: npt.NDArray[np.int64]

    if TYPE_CHECKING:

        def _shard(self, shard: int) -> Any: ...

        def _open_shard(self, shard: int, cache: Any) -> Any: ...

        def _process_state(self) -> Any: ...

    @property
    def remote(self) -> bool:
        """Whether the shards come from object storage (``s3://``, ``gs://``, ``https://``)."""
        return self._remote is not None

    def storage_counts(self) -> StorageCounts | None:
        """For a remote dataset, what this process's reads of its shards cost so far (time
        blocked on downloads, bytes downloaded, cache hits and misses); ``None`` for local
        files. The engine reports it per batch (``fastload._protocols``)."""
        return None if self._remote is None else self._remote.storage_counts()

    def shard_cache_plan(self) -> tuple[str, int | None, int] | None:
        """For a remote dataset, ``(folder, cache_limit, dataset_bytes)``: where its shards are
        cached, the cache's byte bound (``None``: none) and the bytes of all its shards; ``None``
        for local files (``fastload doctor`` checks the folder's owner and free space)."""
        remote = self._remote
        if remote is None:
            return None
        return str(remote.cache_root), remote.cache_limit, sum(s.bytes for s in remote.index.shards)

    def cache_window_warning(self, shuffle_shards: int) -> str | None:
        """Why a shard window of ``shuffle_shards`` shards will starve the prefetcher in this
        dataset's bounded cache (the window being read fills it, so nothing can come ahead:
        ``benchmarks/README.md``, bench_remote), or ``None`` when it leaves room."""
        remote = self._remote
        if remote is None or remote.cache_limit is None:
            return None
        sizes = sorted((s.bytes for s in remote.index.shards), reverse=True)
        need = 2 * sum(sizes[:shuffle_shards])
        if need <= remote.cache_limit:
            return None
        return (
            f"shuffle_shards={shuffle_shards} with cache_limit={remote.cache_limit:,} bytes: a "
            f"window of its largest shards and the next one take {need:,} bytes, more than the "
            "cache holds, so shards cannot be downloaded ahead of the reads; lower "
            "shuffle_shards or raise cache_limit"
        )

    def prefetch(
        self,
        batches: Iterator[npt.NDArray[np.int64]],
        consumed: Callable[[], int],
        *,
        concurrency: int = 4,
    ) -> ShardPrefetcher | None:
        """For a remote dataset, start bringing the shards of ``batches`` (the epoch's next
        batches, in order) to the local disk ahead of the consumer, whose progress
        ``consumed()`` gives (see ``_shard_prefetch.py``); ``None`` for local files. The loader calls
        this with its sampler's plan; call ``close()`` on the result when the epoch ends.
        ``concurrency`` downloads run at once."""
        if self._remote is None:
            return None
        return ShardPrefetcher(self, batches, consumed, concurrency=concurrency)

    def _check_indexed_lengths(self, shard: int, reader: Any) -> None:
        """A remote shard just opened: its lengths must be those its index planned with."""
        field = self._length_field
        if self._remote is None or field is None:
            return
        first = int(self._shard_starts[shard])
        check_lengths_as_indexed(self._remote.urls[shard], first, reader.lengths(field), self)

    def _opening_options(self) -> object:
        """What else than the fields decides how a shard is checked when opened (a subclass's
        options): part of what a check recorded in the cache is valid for."""
        return None

    def _checks(self) -> str:
        """What a shard opened by this dataset is checked for, as recorded in the cache: a
        shard checked once for the same fields and options is not checked again."""
        what = repr((type(self).__name__, sorted(self._fields.items()), self._length_field, self._opening_options()))
        return hashlib.sha256(what.encode()).hexdigest()[:32]

    def _checked_in_cache(self, shard: int) -> bool:
        """Whether shard ``shard``, pinned, was checked when it entered the cache for what
        this dataset reads (see NOTE [open while pinned])."""
        assert self._remote is not None
        return self._remote.checked(shard, self._checks())

    def _open_pinned(self, shard: int, process: Any) -> Any:
        """Open remote shard ``shard`` (under the process lock): in the cache (fetched if it is
        not), pinned there for as long as the reader stays open, checked unless the cache
        records that it was. See NOTE [open while pinned]."""
        remote = self._remote
        assert remote is not None
        sizes = [entry.bytes for entry in remote.index.shards]
        room = None if remote.cache_limit is None else int(remote.cache_limit * PINNED_SHARE)
        while process.pins and (
            len(process.pins) >= MAX_OPEN_REMOTE_SHARDS
            or (room is not None and sum(sizes[s] for s in process.pins) + sizes[shard] > room)
        ):
            process.close_shard(next(iter(process.pins)))
        for attempt in range(3):
            remote.local_path(shard)  # this read's lookup: a hit, or a miss that fetches it
            pin = remote.cache().pin(remote.key(shard))
            try:
                pin.__enter__()
                break
            except FileNotFoundError:  # evicted in between: fetch it again
                if attempt == 2:
                    raise
        try:
            checked = self._checked_in_cache(shard)
            reader = self._open_shard(shard, process.cache)
            try:
                if not checked:
                    self._check_indexed_lengths(shard, reader)
                    remote.mark_checked(shard, self._checks())
            except BaseException:
                reader.close()  # never stored: nothing else would close it
                raise
        except BaseException:
            pin.__exit__(None, None, None)
            raise
        process.pins[shard] = pin
        return reader

    def _remote_local_path(self, shard: int) -> str:
        """A remote shard on the local disk, pinned (called by a subclass's ``_open_shard``,
        under the process lock)."""
        assert self._remote is not None
        return str(self._remote.cache().root / self._remote.key(shard))

    def _read_remote(self, shard: int, read: Callable[[Any], Column]) -> Column:
        """``read`` of a remote shard through the reader this process keeps open, and pinned,
        for it; a read of a shard already open costs no system call and counts as a cache
        hit."""
        remote = self._remote
        assert remote is not None
        process = self._process_state()
        if process.readers[shard] is not None:
            remote.count_hit()
        reader = self._shard(shard)  # opens and pins it when it is not open
        with process.lock:
            if shard in process.pins:
                process.pins.move_to_end(shard)
        return read(reader)


# NOTE [open while pinned]
# A remote shard this process reads is opened once and pinned in the shard cache (a shared lock
# on its lock file, ``ShardCache.pin``) for as long as its reader stays open: eviction passes
# a pinned shard by, so the open reader's file is the cache's and stays on disk, and a read
# needs no look-up in the cache's folder. As the plan moves on to other shards, the least
# recently read are closed, and unpinned, when opening another would pass MAX_OPEN_REMOTE_SHARDS
# or, in a bounded cache, PINNED_SHARE of its limit: the plan's window stays open (a cache
# that holds two windows, as the loader asks, then leaves one window's room for the shards the
# prefetcher brings ahead, and for eviction to make it) and the shards it left make room. A shard's checks (its lengths against the index, an Arrow shard's nulls and
# record batches) run once when it enters the cache: the cache's record of the verified file
# notes what it was checked for, and a file replaced since has no record (``_storage._safe``).


__all__ = ["MAX_OPEN_REMOTE_SHARDS", "PINNED_SHARE", "RemoteShards"]
