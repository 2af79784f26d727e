"""Reads from a warm shard cache cost what reads of local shards cost: a shard is opened once
while the process keeps it pinned (not once per read), checked once when it enters the cache
(not once per process or per open), and a read makes no system call on the cache's folder.
Counted per epoch in the training process (``num_workers=0``) against the moto server, by
wrapping the calls that construct readers, check shards and stat paths: counts, not timings."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import fastload
from fastload._formats import _arrow_dataset as _arrow
from fastload._formats import _arrow_shard
from fastload._formats._indexing import build_index, write_index

SHARDS = 6
ROWS = 120


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six Arrow IPC shards of variable-length token lists (each in two record batches) and
    their index."""
    folder = tmp_path_factory.mktemp("arrow")
    rng = np.random.default_rng(0)
    for shard in range(SHARDS):
        lengths = rng.integers(1, 40, ROWS)
        tokens = [rng.integers(0, 1000, n).tolist() for n in lengths]
        table = pa.table({"tokens": pa.array(tokens, pa.list_(pa.int32())), "label": np.arange(ROWS) + shard})
        with pa.OSFile(str(folder / f"s{shard}.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as out:
            out.write_table(table, max_chunksize=ROWS // 2)
    write_index(folder, build_index(folder))
    return folder


class Calls:
    """Counts of wrapped calls, by name."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counts: Counter[str] = Counter()
        self._patch = monkeypatch

    def wrap(self, owner: Any, name: str, label: str | None = None) -> None:
        original: Callable[..., Any] = getattr(owner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.counts[label or name] += 1
            return original(*args, **kwargs)

        self._patch.setattr(owner, name, counted)

    def take(self) -> Counter[str]:
        counts, self.counts = self.counts, Counter()
        return counts


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[Calls]:
    counter = Calls(monkeypatch)
    counter.wrap(pa.ipc, "open_file", "ipc readers")
    counter.wrap(_arrow, "check_nulls", "null checks")
    counter.wrap(_arrow_shard, "check_batch", "batch checks")
    for name in ("stat", "lstat"):
        counter.wrap(os, name, "stats")
    yield counter


def epoch(loader: fastload.DataLoader) -> int:
    return sum(1 for _ in loader)


def test_a_warm_cache_opens_and_checks_each_shard_once_and_reads_without_stat(
    s3_server: Any, bucket: str, corpus: Path, tmp_path: Path, calls: Calls
) -> None:
    url = s3_server.upload(corpus, bucket, "arrow")
    dataset = fastload.ArrowDataset(url, storage_options=s3_server.options, cache_dir=tmp_path)
    loader = fastload.DataLoader(dataset, batch_size=8, length_grouped=True, seed=1)
    calls.take()
    first = epoch(loader)
    cold = calls.take()
    second = epoch(loader)
    warm = calls.take()
    assert first == second == SHARDS * ROWS // 8
    # Every batch of a length-grouped plan reads several shards: a shard opened per read would
    # construct a reader per batch and shard.
    assert cold["ipc readers"] <= 2 * SHARDS, cold
    assert cold["null checks"] == SHARDS, cold
    assert warm["ipc readers"] == 0 and warm["null checks"] == 0 and warm["batch checks"] == 0, warm
    # What the prefetcher looks up once per shard and epoch, never per read.
    assert warm["stats"] <= 8 * SHARDS < second, warm


def test_a_shard_checked_when_it_entered_the_cache_is_not_checked_again(
    s3_server: Any, bucket: str, corpus: Path, tmp_path: Path, calls: Calls
) -> None:
    url = s3_server.upload(corpus, bucket, "arrow")
    fastload.ArrowDataset(url, storage_options=s3_server.options, cache_dir=tmp_path).read_batch(
        np.arange(SHARDS) * ROWS
    )
    assert calls.take()["null checks"] == SHARDS
    again = fastload.ArrowDataset(url, storage_options=s3_server.options, cache_dir=tmp_path)
    got = again.read_batch(np.arange(SHARDS) * ROWS + 1)
    assert got["label"].tolist() == [1 + s for s in range(SHARDS)]
    counts = calls.take()
    assert counts["null checks"] == 0 and counts["batch checks"] == 0, counts
    # Other options check again: the shards were checked for what the first dataset reads.
    other = fastload.ArrowDataset(url, storage_options=s3_server.options, cache_dir=tmp_path, null_fill=0)
    other.read_batch([0])
    assert calls.take()["null checks"] == 1


def test_a_shard_changed_in_the_cache_is_checked_again(
    s3_server: Any, bucket: str, corpus: Path, tmp_path: Path, calls: Calls
) -> None:
    url = s3_server.upload(corpus, bucket, "arrow")
    dataset = fastload.ArrowDataset(url, storage_options=s3_server.options, cache_dir=tmp_path)
    expected = dataset.read_batch([0, ROWS])["label"].tolist()
    dataset.close()  # unpinned: the cache may now drop or replace the files
    for path in (tmp_path / "shards").iterdir():
        if not path.name.startswith("."):
            path.write_bytes(path.read_bytes())  # same bytes, rewritten: not the file verified
    calls.take()
    again = fastload.ArrowDataset(url, storage_options=s3_server.options, cache_dir=tmp_path)
    assert again.read_batch([0, ROWS])["label"].tolist() == expected
    # The cache verifies each file again (its checksum) and the reader checks it again.
    assert calls.take()["null checks"] == 2


def test_eviction_passes_by_the_shard_a_process_has_open_and_takes_it_once_closed(
    s3_server: Any, bucket: str, corpus: Path, tmp_path: Path
) -> None:
    url = s3_server.upload(corpus, bucket, "arrow")
    dataset = fastload.ArrowDataset(url, storage_options=s3_server.options, cache_dir=tmp_path, cache_limit=1)
    # Shard 1 stays open, and pinned; shard 0 was closed to open it (the limit holds one).
    dataset.read_batch([0, ROWS])
    source = dataset._shards.source  # type: ignore[attr-defined]
    cache, key = source.cache(), source.key
    assert cache.make_room(0, {}) == [key(0)]
    assert cache.make_room(0, {}) == []
    dataset.close()
    assert cache.make_room(0, {}) == [key(1)]
    assert dataset.read_batch([1, ROWS + 1])["label"].tolist() == [1, 2]  # fetched again
