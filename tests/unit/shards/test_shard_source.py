"""The seam between a reader and where its shards live (``fastload._shards``): a reader opens a
shard only through its source, once per process, and tells the source of every later read;
local shards hand over the file reads go to and cost no storage traffic; a shard that does not
hold what its index says is refused, naming it. The remote source behind the same seam is
tested against a real S3-compatible server in ``tests/remote`` (``test_warm_cache_reads.py``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fastload import ArrowDataset
from fastload._shards import LocalShards, ShardFile
from fastload._shards._source import OpenShards
from fastload._types import Field
from fastload.errors import DataFormatError

ROWS = 40


def _table(first: int) -> pa.Table:
    ids = [list(range(first + i, first + i + 1 + i % 5)) for i in range(ROWS)]
    return pa.table({"ids": pa.array(ids, pa.list_(pa.int64())), "label": np.arange(first, first + ROWS)})


def _corpus(tmp_path: Path) -> list[Path]:
    parquet, arrow = tmp_path / "a.parquet", tmp_path / "b.arrow"
    pq.write_table(_table(0), parquet)
    with pa.OSFile(str(arrow), "wb") as sink, pa.ipc.new_file(sink, _table(ROWS).schema) as writer:
        writer.write_table(_table(ROWS))
    return [parquet, arrow]


class _Recording(LocalShards):
    """Local shards that note what the reader asks of them."""

    def __init__(self, paths: list[str], names: list[str]) -> None:
        super().__init__(paths, names)
        self.opened: list[ShardFile] = []
        self.read_again_of: list[int] = []

    def open(self, shard: int, process: OpenShards, open_file: Callable[[ShardFile], Any]) -> Any:
        reader = super().open(shard, process, lambda file: self.opened.append(file) or open_file(file))
        return reader

    def read_again(self, shard: int, process: OpenShards) -> None:
        self.read_again_of.append(shard)


def test_a_reader_opens_each_shard_through_its_source_once_and_tells_it_of_every_later_read(
    tmp_path: Path,
) -> None:
    dataset = ArrowDataset(_corpus(tmp_path), cache_dir=tmp_path / "cache")
    local = dataset._shards
    assert isinstance(local, LocalShards)
    recording = _Recording([local.path(s) for s in range(2)], [local.name(s) for s in range(2)])
    dataset._shards = recording

    first = dataset.read_batch([0, ROWS + 1, 2])  # both shards
    again = dataset.read_batch([ROWS + 3, 1])

    assert [f.path for f in recording.opened] == dataset.read_files  # the decoded copy, then the file
    assert all(f.described and f.checked for f in recording.opened)  # described at construction
    # Each field's read of an open shard, in shard order: the second field of each shard in the
    # first batch, then both fields of both shards.
    assert recording.read_again_of == [0, 1, 0, 0, 1, 1]
    assert first["label"].tolist() == [0, ROWS + 1, 2] and again["label"].tolist() == [ROWS + 3, 1]
    assert again["ids"].values.tolist() == [ROWS + 3, ROWS + 4, ROWS + 5, ROWS + 6, 1, 2]
    dataset.close()
    dataset.read_batch([5])
    assert len(recording.opened) == 3  # closed, so opened again


def test_local_shards_are_read_where_they_are_and_cost_no_storage(tmp_path: Path) -> None:
    parquet, arrow = _corpus(tmp_path)
    dataset = ArrowDataset([parquet, arrow], cache_dir=tmp_path / "cache")
    copy = Path(dataset.read_files[0])
    assert copy.parent == tmp_path / "cache" / "parquet" and dataset.read_files[1] == str(arrow)
    assert dataset._shards.name(0).startswith(str(parquet)) and dataset._shards.name(1) == str(arrow)
    dataset.read_batch(np.arange(2 * ROWS))
    assert not dataset.remote
    assert dataset.storage_counts() is None and dataset.shard_cache_plan() is None
    assert dataset.prefetch(iter([np.arange(4)]), lambda: 0) is None
    assert dataset.cache_window_warning(8) is None
    assert dataset.lengths.tolist() == [1 + i % 5 for i in range(ROWS)] * 2  # from the files


def test_a_shard_that_does_not_hold_what_its_index_says_is_refused_naming_it() -> None:
    ids = Field("ids", "ragged", np.dtype(np.int64))
    label = Field("label", "fixed", np.dtype(np.int64))
    file = ShardFile("/cache/k", "s3://b/corpus/s-00003.arrow", described=False, checked=False, indexed_samples=40)
    file.check_holds({"ids": ids, "label": label}, 40, {"ids": ids, "label": label})  # as indexed
    with pytest.raises(DataFormatError, match=r"s3://b/corpus/s-00003.arrow: holds 39 samples .* index says 40"):
        file.check_holds({"ids": ids, "label": label}, 39, {"ids": ids, "label": label})
    with pytest.raises(DataFormatError, match=r"s-00003.arrow: holds 40 samples of fields \{'ids'.*write the index again"):
        file.check_holds({"ids": ids}, 40, {"ids": ids, "label": label})
