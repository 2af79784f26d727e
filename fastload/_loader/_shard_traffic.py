"""The loader's side of a remote dataset: each epoch, a prefetcher that brings the plan's shards
to the local cache ahead of the reads (``_shards/_prefetch.py``), and the count of what the
reads cost, fed into the loader's :class:`~fastload._metrics.StallMeter` (``loader.stats()``'s
download and cache fields, and the diagnosis that names the storage)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from fastload._capabilities import DatasetCapabilities, resolve_dataset
from fastload._metrics import StallMeter
from fastload._protocols import ShardPrefetch
from fastload._types import StorageCounts

#: Shard downloads the prefetcher runs at once unless ``download_concurrency=`` says otherwise.
DOWNLOAD_CONCURRENCY = 4


class ShardTraffic:
    """Prefetch and counting for ``dataset`` (any dataset: for one without remote shards, every
    call does nothing). Counters are cumulative where they come from (the dataset in this
    process, the engine's sum of the workers' replies, each prefetcher); :meth:`feed` hands the
    meter what changed since the last call."""

    def __init__(
        self,
        dataset: Any,
        meter: StallMeter,
        *,
        concurrency: int | None,
        capabilities: DatasetCapabilities | None = None,
    ) -> None:
        self._dataset = dataset
        self._meter = meter
        self._concurrency = DOWNLOAD_CONCURRENCY if concurrency is None else concurrency
        # What the dataset can do, as the loader resolved it (fastload._capabilities).
        self._capabilities = resolve_dataset(dataset) if capabilities is None else capabilities
        counts = dataset.storage_counts if self._capabilities.storage_counts else None
        self._main: Callable[[], StorageCounts | None] | None = counts
        seen = counts() if counts is not None else None
        self.remote = seen is not None
        self._main_seen = seen or StorageCounts()
        self._workers_seen = StorageCounts()
        self._busy_seen = 0.0
        self._prefetcher: Any = None
        self._prefetched_seen = 0

    def start(self, batches: Any, consumed: Callable[[], int]) -> None:
        """Prefetch the shards of ``batches`` (the epoch's plan from the next batch on), the
        consumer's progress being ``consumed()``; stops the previous epoch's prefetcher."""
        self.stop()
        if not self._capabilities.prefetch or batches is None:
            return
        self._prefetcher = self._dataset.prefetch(batches, consumed, concurrency=self._concurrency)

    def stop(self) -> None:
        """Stop the prefetcher (downloads in flight finish; see its ``close``) and count what
        it downloaded since the last :meth:`feed`."""
        prefetcher = self._prefetcher
        if prefetcher is not None:
            prefetcher.close()
            self._feed_prefetched()
            self._prefetcher, self._prefetched_seen = None, 0

    def feed(self, workers: StorageCounts | None = None, busy_s: float = 0.0) -> None:
        """Count into the meter's current epoch what changed since the last call: reads in this
        process, the workers' reads (``workers``: the engine's cumulative sum, ``busy_s`` the
        workers' cumulative busy seconds) and the prefetcher's downloads."""
        if not self.remote:
            return
        assert self._main is not None
        main = self._main() or StorageCounts()
        delta = main - self._main_seen
        busy = 0.0
        if workers is not None:
            delta = delta + (workers - self._workers_seen)
            busy = max(0.0, busy_s - self._busy_seen)
            self._workers_seen, self._busy_seen = workers, busy_s
        self._main_seen = main
        self._meter.add_storage(delta, prefetched_bytes=0, busy_s=busy)
        self._feed_prefetched()

    def _feed_prefetched(self) -> None:
        if self._prefetcher is None or not self.remote:
            return
        total = _prefetched(self._prefetcher)
        fed, self._prefetched_seen = total - self._prefetched_seen, total
        if fed:
            self._meter.add_storage(StorageCounts(), prefetched_bytes=fed, busy_s=0.0)


def _prefetched(prefetcher: Any) -> int:
    """The bytes ``prefetcher`` downloaded, where it declares them (``ShardPrefetch``)."""
    if not isinstance(prefetcher, ShardPrefetch):
        return 0
    count = prefetcher.downloaded_bytes()
    return int(count) if isinstance(count, (int, np.integer)) else 0


__all__ = ["DOWNLOAD_CONCURRENCY", "ShardTraffic"]
