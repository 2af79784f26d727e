"""An index derived without checksums: it round-trips through the node's cache file, keys a
rewritten object apart from the old one, and the shards are described by a bounded number of
threads, in order, the first error raised."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from fastload._formats._discover_remote import (
    _ARROW_SUFFIXES,
    _HDF5_SUFFIXES,
    bounded_map,
    select_shards,
)
from fastload._formats._indexing import SHARD_SUFFIXES
from fastload._remote import DatasetIndex, ObjectInfo, ShardCache, ShardEntry
from fastload._types import Field
from fastload.errors import DataFileNotFoundError, DataFormatError

FIELDS = {"ids": Field("ids", "ragged", np.dtype(np.int32))}


def index(*shards: ShardEntry) -> DatasetIndex:
    lengths = np.arange(sum(s.samples for s in shards), dtype=np.int64)
    return DatasetIndex("arrow", FIELDS, "ids", shards, lengths)


def test_an_index_without_checksums_round_trips_with_the_object_versions() -> None:
    derived = index(ShardEntry("a.parquet", 3, 100, None, "1700000000000000000"), ShardEntry("b/c.arrow", 2, 50, None))
    back = DatasetIndex.from_json(derived.to_json(), "cache/x.derived.json")
    assert back.shards == derived.shards and np.array_equal(back.lengths, derived.lengths)


def test_an_index_with_checksums_is_written_as_before() -> None:
    sha = "ab" * 32
    written = index(ShardEntry("a.h5", 2, 10, sha)).to_json()
    assert set(json.loads(written)["shards"][0]) == {"path", "samples", "bytes", "sha256"}
    assert DatasetIndex.from_json(written, "i.json").shards[0].cache_version == sha
    with pytest.raises(DataFormatError, match=r"i\.json: shard 'a\.h5' has a bad count, size or sha256"):
        DatasetIndex.from_json(written.replace(sha.encode(), b"abc"), "i.json")


def test_a_rewritten_object_gets_another_cache_key() -> None:
    old, new = ShardEntry("a.parquet", 3, 100, None, "1"), ShardEntry("a.parquet", 3, 100, None, "2")
    resized = ShardEntry("a.parquet", 3, 101, None, "1")
    keys = {ShardCache.key("s3://b/c/", e.path, e.cache_version) for e in (old, new, resized)}
    assert len(keys) == 3


def test_shards_are_selected_as_a_local_folder_is() -> None:
    listing = [ObjectInfo(n, 1, "") for n in ("z.parquet", "a/b.arrow", "fastload-index.json", "notes.txt", "a.ipc")]
    assert select_shards("s3://b/c/", listing) == ("arrow", [listing[1], listing[4], listing[0]])  # by path parts
    with pytest.raises(DataFileNotFoundError, match=r"s3://b/c/: holds no fastload-index\.json and 1 objects, none of them"):
        select_shards("s3://b/c/", [listing[3]])


def test_the_shard_suffixes_are_the_readers_own() -> None:
    # Copied (the readers import the remote source, which imports the discovery): kept equal.
    assert _HDF5_SUFFIXES + _ARROW_SUFFIXES == SHARD_SUFFIXES


def test_bounded_map_keeps_order_and_the_thread_bound() -> None:
    running, most = 0, 0
    lock = threading.Lock()

    def slow(info: ObjectInfo) -> int:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.01)
        with lock:
            running -= 1
        return info.size

    items = [ObjectInfo(str(i), i, "") for i in range(20)]
    assert bounded_map(slow, items, 3) == list(range(20))
    assert 1 < most <= 3


def test_bounded_map_raises_the_first_error_and_starts_no_more() -> None:
    started: list[int] = []

    def failing(info: ObjectInfo) -> int:
        started.append(info.size)
        if info.size == 0:
            raise DataFormatError("s3://b/c/0: damaged")
        time.sleep(0.01)
        return info.size

    with pytest.raises(DataFormatError, match="damaged"):
        bounded_map(failing, [ObjectInfo(str(i), i, "") for i in range(50)], 2)
    assert len(started) < 10
