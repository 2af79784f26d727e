"""What a reader does differently when its shards live on object storage: each process opens
the shards from the local shard cache (:class:`~fastload._formats._remote_source.RemoteSource`
downloads one on first use, unless the prefetcher got there first), keeps at most
:data:`MAX_OPEN_REMOTE_SHARDS` open, and pins a shard in the cache while a read of it runs, so
that eviction passes it by. A mixin of :class:`~fastload._formats._base.ShardedDataset`; local
datasets (``_remote is None``) never reach these paths.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from fastload._formats._prefetch import ShardPrefetcher
from fastload._formats._remote_source import RemoteSource, check_lengths_as_indexed
from fastload._types import Column, StorageCounts

#: Remote shards one process keeps open at most: the least recently read is closed first.
MAX_OPEN_REMOTE_SHARDS = 8


class RemoteShards:
    """The remote half of a sharded reader (see the module text)."""

    #: Where the shards of a remote dataset come from (``None``: local files).
    _remote: RemoteSource | None
    _process: Any  # the reader's per-process state (``_process.ProcessState``)
    _length_field: str | None
    _shard_starts: npt.NDArray[np.int64]

    if TYPE_CHECKING:

        def _shard(self, shard: int) -> Any: ...

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
        ``consumed()`` gives (see ``_prefetch.py``); ``None`` for local files. The loader calls
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
        try:
            check_lengths_as_indexed(self._remote.urls[shard], first, reader.lengths(field), self)
        except BaseException:
            reader.close()  # never stored: nothing else would close it
            raise

    def _make_room_to_open(self, process: Any) -> None:
        """Close the least recently read remote shards past :data:`MAX_OPEN_REMOTE_SHARDS`."""
        while len(process.local) >= MAX_OPEN_REMOTE_SHARDS:
            process.close_shard(next(iter(process.local)))

    def _remote_local_path(self, shard: int) -> str:
        """A remote shard on the local disk (called by a subclass's ``_open_shard``, under the
        process lock)."""
        assert self._remote is not None and self._process is not None
        path = str(self._remote.local_path(shard, counted=False))  # the pin counted it
        self._process.local[shard] = path
        return path

    def _read_remote(self, shard: int, read: Callable[[Any], Column]) -> Column:
        """``read`` of a remote shard, pinned in the cache while it runs, so that eviction
        passes it by. A shard evicted since this process opened it is opened again (fetched
        again); and the other shards this process has open that were evicted are closed, so
        that their disk space is freed (an unlinked file's blocks stay while it is mapped)."""
        assert self._remote is not None
        for attempt in range(3):
            try:
                with self._remote.pin(shard):
                    column = read(self._shard(shard))
                break
            except FileNotFoundError:
                if attempt == 2:
                    raise
                self._close_remote(shard)  # evicted: open (and fetch) it again
        process = self._process
        assert process is not None
        for other, path in list(process.local.items()):
            if other != shard and not os.path.exists(path):
                self._close_remote(other)
        return column

    def _close_remote(self, shard: int) -> None:
        process = self._process
        if process is not None:
            with process.lock:
                process.close_shard(shard)


__all__ = ["MAX_OPEN_REMOTE_SHARDS", "RemoteShards"]
