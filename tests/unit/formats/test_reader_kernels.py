"""The pure pieces under the readers: the ragged gather, column reordering, the block cache,
index normalisation, the file map and path resolution."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastload._formats._block_cache import BlockCache
from fastload._formats._columns import (
    concat_columns,
    permute_column,
    ragged_gather,
    split_column,
)
from fastload._formats._mmap import FileMap
from fastload._formats._paths import files_in_directory, resolve_paths
from fastload._formats._validate import normalize_indices
from fastload._types import Ragged
from fastload.errors import DataFormatError


@settings(max_examples=80, deadline=None)
@given(
    total=st.integers(0, 3000),
    spans=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 400)), max_size=40),
    width=st.sampled_from([(), (3,)]),
    strided=st.booleans(),
)
def test_ragged_gather_equals_concatenated_slices(
    total: int, spans: list[tuple[int, int]], width: tuple[int, ...], strided: bool
) -> None:
    step = 2 if strided else 1
    base = np.arange(step * total * int(np.prod(width)), dtype=np.int32)
    values = base.reshape(step * total, *width)[::step]
    # Clip each span into range; every gather strategy (flat index, byte slices of a contiguous
    # array, array slices of a strided one) gets exercised as spans run from empty to hundreds
    # of rows.
    starts = np.array([min(s, total) for s, _ in spans], np.int64)
    lengths = np.array(
        [min(n, total - s) for s, (_, n) in zip(starts, spans, strict=True)], np.int64
    )
    got = ragged_gather(values, starts, lengths)
    pieces = [values[s : s + n] for s, n in zip(starts, lengths, strict=True)]
    expected = np.concatenate(pieces) if pieces else values[:0]
    assert got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)


def test_permute_concat_and_split_keep_samples_intact() -> None:
    ragged = Ragged(np.arange(10), np.array([3, 0, 5, 2], np.int64))
    order = np.array([2, 2, 0, 3, 1])
    permuted = permute_column(ragged, order)
    assert isinstance(permuted, Ragged)
    assert [s.tolist() for s in split_column(permuted)] == [
        [3, 4, 5, 6, 7],
        [3, 4, 5, 6, 7],
        [0, 1, 2],
        [8, 9],
        [],
    ]
    joined = concat_columns([ragged, Ragged(np.array([7]), np.array([1], np.int64))])
    assert isinstance(joined, Ragged) and joined.lengths.tolist() == [3, 0, 5, 2, 1]
    rows = permute_column(np.array([[1, 2], [3, 4]]), np.array([1, 0]))
    assert isinstance(rows, np.ndarray) and rows.tolist() == [[3, 4], [1, 2]]
    assert permute_column(["a", "b"], np.array([1, 1, 0])) == ["b", "b", "a"]


def test_block_cache_evicts_least_recently_used_but_keeps_the_newest() -> None:
    cache: BlockCache[str] = BlockCache(capacity_bytes=10)
    cache.put("a", "A", 4)
    cache.put("b", "B", 4)
    assert cache.get("a") == "A"  # now "b" is the least recently used
    cache.put("c", "C", 4)
    assert cache.get("b") is None and cache.get("a") == "A" and cache.get("c") == "C"
    cache.put("huge", "H", 100)
    assert cache.get("huge") == "H" and cache.get("a") is None
    assert cache.held_bytes == 100


def test_normalize_indices_counts_negatives_from_the_end_and_rejects_the_rest() -> None:
    assert normalize_indices([3, -1, 0, -5], 5).tolist() == [3, 4, 0, 0]
    assert normalize_indices(np.array([], np.int32), 0).dtype == np.int64
    with pytest.raises(
        IndexError,
        match=r"index 5 \(position 1 of the request\) is out of range for a dataset of 5",
    ):
        normalize_indices([0, 5], 5)
    with pytest.raises(IndexError, match="index 18446744073709551615"):
        normalize_indices(np.array([2**64 - 1], np.uint64), 5)
    with pytest.raises(TypeError, match="integers"):
        normalize_indices(np.array([True, False]), 5)
    with pytest.raises(TypeError, match="1-D"):
        normalize_indices(np.zeros((2, 2), np.int64), 5)
    with pytest.raises(TypeError, match="scalar"):
        normalize_indices(3, 5)


def test_file_map_refuses_ranges_past_the_end_of_a_truncated_file(tmp_path: Path) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(np.arange(10, dtype=np.int64).tobytes())
    file_map = FileMap(path)
    view = file_map.view(16, np.dtype(np.int64), (8,), what="dataset '/x'")
    assert view.tolist() == list(range(2, 10))
    assert not view.flags.writeable
    with pytest.raises(
        DataFormatError,
        match=r"short\.bin: dataset '/x': its data spans bytes \[16, 88\) but the file has 80 bytes",
    ):
        file_map.view(16, np.dtype(np.int64), (9,), what="dataset '/x'")
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with pytest.raises(DataFormatError, match="empty"):
        FileMap(empty).view(0, np.dtype(np.int8), (1,), what="dataset '/x'")


def test_resolve_paths_expands_globs_and_directories_in_sorted_order(tmp_path: Path) -> None:
    for name in ("b/2.h5", "b/1.h5", "a/3.h5", "a/skip.txt"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"")

    def expand(d: Path) -> list[Path]:
        return files_in_directory(d, (".h5",))

    names = [
        p.relative_to(tmp_path).as_posix()
        for p in resolve_paths(str(tmp_path / "*"), expand_directory=expand)
    ]
    assert names == ["a/3.h5", "b/1.h5", "b/2.h5"]
    recursive = resolve_paths(str(tmp_path / "**" / "*.h5"), expand_directory=expand)
    assert [p.name for p in recursive] == ["3.h5", "1.h5", "2.h5"]
    listed = resolve_paths([tmp_path / "b" / "2.h5", tmp_path / "a"], expand_directory=expand)
    assert [p.name for p in listed] == ["2.h5", "3.h5"]
    with pytest.raises(TypeError, match="path must be a str, a Path, or a list"):
        resolve_paths(3, expand_directory=expand)  # type: ignore[arg-type]
