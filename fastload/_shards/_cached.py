"""Shards on object storage, read through the node's shard cache: the remote
:class:`~fastload._shards._source.ShardSource`. A process opens a shard from the cache
(:class:`~fastload._shards._remote_source.RemoteSource` downloads it on first use, unless the
prefetcher got there first), keeps it open, and pinned in the cache, while it reads it, and has
it checked once when it enters the cache (see NOTE [open while pinned]).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from fastload._shards._prefetch import ShardPrefetcher
from fastload._shards._remote_source import RemoteSource
from fastload._shards._source import OpenShards, ShardFile, ShardReaderLike
from fastload._types import Field, StorageCounts
from fastload.errors import DataFormatError

#: Remote shards one process keeps open (and pinned) at most: the least recently read is
#: closed first. Each holds three descriptors (the map, its size watch, the pin).
MAX_OPEN_REMOTE_SHARDS = 64
#: In a bounded cache, the shards one process keeps open take at most this share of the limit
#: (the rest is for the shards fetched ahead of the reads: see NOTE [open while pinned]).
PINNED_SHARE = 0.5

_R = TypeVar("_R", bound=ShardReaderLike)


class CachedShards:
    """The shards of ``source``, read through its cache (see the module text) by a reader of
    type ``reader`` that reads ``fields`` with ``length_field`` and ``options``: what it checks
    a shard for when it opens one (a shard the cache records as checked for the same is not
    checked again)."""

    remote = True

    def __init__(
        self,
        source: RemoteSource,
        *,
        reader: str,
        fields: Mapping[str, Field],
        length_field: str | None,
        options: object,
    ) -> None:
        self.source = source
        index = source.index
        self._urls = source.urls
        self._sizes = [entry.bytes for entry in index.shards]
        self.starts = np.concatenate([[0], np.cumsum([e.samples for e in index.shards], dtype=np.int64)])
        self._length_field = length_field
        what = repr((reader, sorted(fields.items()), length_field, options))
        self._checks = hashlib.sha256(what.encode()).hexdigest()[:32]

    def open(self, shard: int, process: OpenShards, open_file: Callable[[ShardFile], _R]) -> _R:
        """Open shard ``shard`` (under the process lock): in the cache (fetched if it is not),
        pinned there for as long as the reader stays open, checked unless the cache records
        that it was. See NOTE [open while pinned]."""
        source = self.source
        room = None if source.cache_limit is None else int(source.cache_limit * PINNED_SHARE)
        sizes = self._sizes
        while process.holds and (
            len(process.holds) >= MAX_OPEN_REMOTE_SHARDS
            or (room is not None and sum(sizes[s] for s in process.holds) + sizes[shard] > room)
        ):
            process.close_shard(next(iter(process.holds)))
        for attempt in range(3):
            source.local_path(shard)  # this read's lookup: a hit, or a miss that fetches it
            pin = source.cache().pin(source.key(shard))
            try:
                pin.__enter__()
                break
            except FileNotFoundError:  # evicted in between: fetch it again
                if attempt == 2:
                    raise
        try:
            checked = source.checked(shard, self._checks)
            file = ShardFile(
                str(source.cache().root / source.key(shard)),
                self._urls[shard],
                described=False,
                checked=checked,
                indexed_samples=int(self.starts[shard + 1] - self.starts[shard]),
            )
            reader = open_file(file)
            try:
                if not checked:
                    self._check_lengths(shard, reader)
                    source.mark_checked(shard, self._checks)
            except BaseException:
                reader.close()  # never stored: nothing else would close it
                raise
        except BaseException:
            pin.__exit__(None, None, None)
            raise
        process.holds[shard] = pin
        return reader

    def read_again(self, shard: int, process: OpenShards) -> None:
        """A read of a shard this process has open, and pinned: a cache hit that costs no
        system call; the shard becomes the most recently read."""
        self.source.count_hit()
        with process.lock:
            if shard in process.holds:
                process.holds.move_to_end(shard)

    def name(self, shard: int) -> str:
        return self._urls[shard]

    def path(self, shard: int) -> None:
        return None

    def read_files(self) -> list[str]:
        return []

    def indexed_lengths(self) -> npt.NDArray[np.int64]:
        return self.source.index.lengths  # the index plans every batch; never from the shards

    def storage_counts(self) -> StorageCounts:
        return self.source.storage_counts()

    def prefetch(
        self, batches: Iterator[npt.NDArray[np.int64]], consumed: Callable[[], int], *, concurrency: int
    ) -> ShardPrefetcher:
        return ShardPrefetcher(self.source, self.starts, batches, consumed, concurrency=concurrency)

    def cache_plan(self) -> tuple[str, int | None, int]:
        source = self.source
        return str(source.cache_root), source.cache_limit, sum(self._sizes)

    def cache_window_warning(self, shuffle_shards: int) -> str | None:
        """Why a shard window of ``shuffle_shards`` shards will starve the prefetcher in this
        bounded cache (the window being read fills it, so nothing can come ahead:
        ``benchmarks/README.md``, bench_remote), or ``None`` when it leaves room."""
        limit = self.source.cache_limit
        if limit is None:
            return None
        need = 2 * sum(sorted(self._sizes, reverse=True)[:shuffle_shards])
        if need <= limit:
            return None
        return (
            f"shuffle_shards={shuffle_shards} with cache_limit={limit:,} bytes: a "
            f"window of its largest shards and the next one take {need:,} bytes, more than the "
            "cache holds, so shards cannot be downloaded ahead of the reads; lower "
            "shuffle_shards or raise cache_limit"
        )

    def _check_lengths(self, shard: int, reader: ShardReaderLike) -> None:
        """Raise unless the lengths shard ``shard`` holds (computed from its offsets) are those
        its index lists: the index's lengths plan every batch, so a disagreement would break
        the token budget without a word."""
        field = self._length_field
        if field is None:
            return
        first = int(self.starts[shard])
        stored = np.asarray(reader.lengths(field), dtype=np.int64)
        indexed = self.source.index.lengths[first : first + stored.size]
        wrong = np.flatnonzero(indexed != stored)
        if wrong.size:
            row = int(wrong[0])
            raise DataFormatError(
                f"{self._urls[shard]}: sample {first + row} (row {row} of the shard): the index "
                f"says {int(indexed[row])} elements of {field!r} but the shard holds "
                f"{int(stored[row])} ({wrong.size} of its {stored.size} lengths differ); write "
                "the index again (`fastload index`)"
            )


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


__all__ = ["MAX_OPEN_REMOTE_SHARDS", "PINNED_SHARE", "CachedShards"]
