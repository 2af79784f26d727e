"""A bounded node cache that holds two shard windows downloads each shard at most once per epoch:
eviction never drops a shard this epoch fetched and still reads (counted per shard against the
S3 server: a plan that reads a shard again after others, and loaders over several epochs with
workers reading ahead of the consumer)."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from _procs import wait_until
from _token_files import indexed_token_shards

import fastload
from fastload._shards import ShardPrefetcher

SHARDS = 8


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return indexed_token_shards(tmp_path_factory.mktemp("corpus"), SHARDS, 40, 120, label=True)


def _downloads(server: Any) -> Counter[str]:
    """GETs of each shard from its byte 0 (a shard is smaller than one download part)."""
    return Counter(
        r.path.rsplit("/", 1)[-1]
        for r in server.requests()
        if r.method == "GET" and r.path.endswith(".h5") and (r.range or "bytes=0-").startswith("bytes=0-")
    )


def test_a_shard_read_again_later_in_the_epoch_is_kept_not_fetched_twice(
    s3_server: Any, bucket: str, corpus: Path, tmp_path: Path
) -> None:
    largest = max(p.stat().st_size for p in corpus.glob("*.h5"))
    remote = fastload.HDF5Dataset(
        s3_server.upload(corpus, bucket), storage_options=s3_server.options, cache_dir=tmp_path, cache_limit=2 * largest
    )
    starts = remote._shard_starts
    plan = [0, 1, 2, 3, 0]  # shard 0 first, then three others, then shard 0 again
    batches = [np.array([starts[shard] + i]) for i, shard in enumerate(plan)]
    consumed = [0]
    s3_server.proxy.reset()
    source = remote._shards.source  # type: ignore[attr-defined]
    prefetcher = ShardPrefetcher(source, starts, iter(batches), lambda: consumed[0], concurrency=1)
    steps: list[bool] = []
    step = prefetcher._step
    prefetcher._step = lambda: steps.append(step()) or steps[-1]  # type: ignore[method-assign]

    def settled() -> bool:
        """The prefetcher has done all it will at this position: two idle steps, none in flight."""
        return not prefetcher._flight and len(steps) >= 2 and not steps[-1] and not steps[-2]

    try:
        for position, shard in enumerate(plan):
            consumed[0] = position
            steps.clear()
            assert wait_until(settled, 30)
            source.local_path(shard)  # the read: fetched now if the prefetcher did not
    finally:
        prefetcher.close()
    assert prefetcher.error is None
    assert _downloads(s3_server) == {f"part-0000{s}.h5": 1 for s in range(4)}


@pytest.mark.parametrize("shuffle_shards", [1, 2])
def test_each_shard_is_downloaded_at_most_once_per_epoch_with_two_windows_cached(
    s3_server: Any, bucket: str, corpus: Path, tmp_path: Path, shuffle_shards: int
) -> None:
    largest = max(p.stat().st_size for p in corpus.glob("*.h5"))
    remote = fastload.HDF5Dataset(
        s3_server.upload(corpus, bucket),
        storage_options=s3_server.options,
        cache_dir=tmp_path,
        cache_limit=2 * shuffle_shards * largest,  # two windows of the largest shards
    )
    loader = fastload.DataLoader(remote, max_tokens=256, shuffle_shards=shuffle_shards, seed=3, num_workers=2)
    for epoch in range(3):
        s3_server.proxy.reset()
        batches = sum(1 for _ in loader)
        counts = _downloads(s3_server)
        assert batches > 0 and max(counts.values(), default=0) <= 1, (epoch, counts)
