"""``read_batch_in_place``: what the fast path's workers read with. Memory-mapped ragged fields
come back as ``Spans`` over the map (no copy); everything else exactly as ``read_batch``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from _format_files import Corpus, write_fastload

import fastload
from fastload._types import Ragged, Spans

ROWS = [5, 0, 56, 5, 13, 2]


def _materialize(column: Spans) -> Ragged:
    pieces = [column.source[s : s + n] for s, n in zip(column.starts.tolist(), column.lengths.tolist(), strict=True)]
    return Ragged(np.concatenate(pieces), column.lengths)


def _same(a: object, b: object) -> None:
    if isinstance(a, Spans):
        a = _materialize(a)
    if isinstance(a, Ragged):
        assert isinstance(b, Ragged)
        assert a.values.dtype == b.values.dtype and np.array_equal(a.values, b.values)
        assert np.array_equal(a.lengths, b.lengths)
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b)
    else:
        assert a == b


def test_mapped_ragged_fields_are_spans_over_the_map_and_read_the_same(corpus: Corpus, tmp_path: Path) -> None:
    ds = fastload.HDF5Dataset(write_fastload(tmp_path / "a.h5", corpus))
    in_place, copied = ds.read_batch_in_place(ROWS), ds.read_batch(ROWS)
    assert isinstance(in_place["tokens"], Spans) and isinstance(in_place["frames"], Spans)
    assert not in_place["tokens"].source.flags.writeable  # the map itself, not a copy
    assert in_place.keys() == copied.keys()
    for name in copied:
        _same(in_place[name], copied[name])


@pytest.mark.parametrize("chunked", [False, True])
def test_chunked_files_and_batches_across_shards_are_read_as_by_read_batch(
    corpus: Corpus, tmp_path: Path, chunked: bool
) -> None:
    half = len(corpus) // 2
    paths = [
        write_fastload(tmp_path / "s0.h5", corpus.slice(0, half), chunk_rows=8 if chunked else None),
        write_fastload(tmp_path / "s1.h5", corpus.slice(half, len(corpus))),
    ]
    ds = fastload.HDF5Dataset(paths)
    across = [1, half + 3, 2]
    within = [half + 1, half + 4] if chunked else [1, 2]
    got = ds.read_batch_in_place(across)
    assert isinstance(got["tokens"], Ragged)  # samples from two maps cannot be one Spans
    for name, column in ds.read_batch(across).items():
        _same(got[name], column)
    inside = ds.read_batch_in_place(within)
    assert isinstance(inside["tokens"], Spans)
    for name, column in ds.read_batch(within).items():
        _same(inside[name], column)
    if chunked:  # the chunked shard has no map to leave samples in
        assert isinstance(ds.read_batch_in_place([1, 2])["tokens"], Ragged)


def test_non_native_byte_order_is_read_as_by_read_batch(tmp_path: Path) -> None:
    import h5py

    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 9, 20)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    with h5py.File(tmp_path / "be.h5", "w") as f:
        f.attrs["fastload_format"] = 1
        f.attrs["num_samples"] = 20
        f.create_dataset("tokens/values", data=rng.integers(0, 1000, int(offsets[-1])).astype(">i4"))
        f.create_dataset("tokens/offsets", data=offsets)
    ds = fastload.HDF5Dataset(tmp_path / "be.h5")
    got = ds.read_batch_in_place([3, 1, 19])
    assert isinstance(got["tokens"], Ragged)  # swapped to native order: not left in the map
    assert got["tokens"].values.dtype == np.dtype("int32")
    _same(got["tokens"], ds.read_batch([3, 1, 19])["tokens"])
