"""The loader's shard traffic takes what a dataset's prefetcher reports through the declared
protocol (``fastload._protocols.ShardPrefetch``), never by attribute names: a prefetcher of a
user's dataset whose same-named attribute is something else is counted as downloading nothing."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from fastload._loader._shard_traffic import ShardTraffic
from fastload._metrics import StallMeter
from fastload._types import StorageCounts


class OwnPrefetcher:
    """A user's prefetcher: it closes, and its ``stats`` are its own business."""

    stats = SimpleNamespace(downloaded_bytes=None)

    def close(self) -> None:
        pass


class Downloader(OwnPrefetcher):
    def downloaded_bytes(self) -> int:
        return 1234


class RemoteData:
    remote = True

    def __init__(self, prefetcher: Any) -> None:
        self._prefetcher = prefetcher

    def storage_counts(self) -> StorageCounts:
        return StorageCounts()

    def prefetch(self, batches: Any, consumed: Any, **options: Any) -> Any:
        return self._prefetcher


def test_a_prefetcher_with_its_own_stats_counts_no_download() -> None:
    meter = StallMeter()
    traffic = ShardTraffic(RemoteData(OwnPrefetcher()), meter, concurrency=None)
    traffic.start(iter([]), lambda: 0)
    traffic.feed()
    traffic.stop()


def test_a_prefetcher_that_declares_its_downloads_is_counted() -> None:
    meter = StallMeter()
    traffic = ShardTraffic(RemoteData(Downloader()), meter, concurrency=None)
    traffic.start(iter([]), lambda: 0)
    traffic.feed()
    traffic.stop()
    assert meter.snapshot().downloaded_bytes == 1234
