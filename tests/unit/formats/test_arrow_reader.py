"""ArrowDataset reads IPC files and streams, Hugging Face files and Parquet exactly as pyarrow
does."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pytest
from _format_files import (
    Corpus,
    arrow_sample,
    assert_same,
    assert_writable_arrays,
    batch_sample,
    corpus_table,
    fixed,
    hf_table,
    make_corpus,
    ragged,
    random_indices,
    write_arrow_file,
    write_arrow_stream,
    write_hf_cache_file,
    write_hf_save_to_disk,
    write_parquet,
)

from fastload import ArrowDataset
from fastload._protocols import BatchReader
from fastload._types import Field, Ragged
from fastload.errors import DataFormatError

# Each layout writes the corpus and returns (what to open, the table pyarrow reads back).
Layout = Callable[[Path, Corpus], tuple[Path, pa.Table]]


def _feather(path: Path, corpus: Corpus) -> tuple[Path, pa.Table]:
    feather.write_feather(corpus_table(corpus), path, chunksize=9)  # LZ4-compressed by default
    return path, corpus_table(corpus)


LAYOUTS: dict[str, Layout] = {
    "ipc-file": lambda p, c: (write_arrow_file(p, corpus_table(c), 5), corpus_table(c)),
    "ipc-file-one-batch": lambda p, c: (
        write_arrow_file(p, corpus_table(c), 1000),
        corpus_table(c),
    ),
    "ipc-file-zstd": lambda p, c: (
        write_arrow_file(p, corpus_table(c), 6, "zstd"),
        corpus_table(c),
    ),
    "feather-lz4": _feather,
    "ipc-stream": lambda p, c: (write_arrow_stream(p, corpus_table(c), 4), corpus_table(c)),
    "ipc-stream-large-lists": lambda p, c: (
        write_arrow_stream(p, corpus_table(c, large=True), 8),
        corpus_table(c, large=True),
    ),
    "hf-cache-file": lambda p, c: (write_hf_cache_file(p, c), hf_table(c)),
    "hf-save-to-disk": lambda p, c: (write_hf_save_to_disk(p, c, 3), hf_table(c)),
    "parquet": lambda p, c: (write_parquet(p, corpus_table(c), 8), corpus_table(c)),
}


def _reference(table: pa.Table, field: str, index: int) -> object:
    value = arrow_sample(table, field, index)
    if isinstance(value, list):
        return np.array(value)
    return value


@pytest.mark.parametrize("layout", LAYOUTS)
def test_read_batch_equals_plain_pyarrow_for_every_layout(
    layout: str, corpus: Corpus, tmp_path: Path
) -> None:
    path, table = LAYOUTS[layout](tmp_path / "data.arrow", corpus)
    ds = ArrowDataset(path)
    assert len(ds) == table.num_rows
    indices = random_indices(len(corpus), 40, seed=3)
    batch = ds.read_batch(indices)
    assert list(batch) == list(ds.fields) == table.column_names
    assert_writable_arrays(batch)
    assert_writable_arrays(ds.read_batch([0]))  # sample 0 is empty
    for name in ds.fields:
        for position, index in enumerate(indices.tolist()):
            expected = _reference(table, name, index % len(corpus))
            assert_same(batch_sample(batch, name, position), expected, f"{layout} {name}[{index}]")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_lengths_come_from_the_first_list_column(
    layout: str, corpus: Corpus, tmp_path: Path
) -> None:
    path, table = LAYOUTS[layout](tmp_path / "data.arrow", corpus)
    ds = ArrowDataset(path)
    first_list = table.column_names[0]
    assert ds.length_field == first_list
    assert ds.lengths.dtype == np.int64
    assert ds.lengths.tolist() == [len(x) for x in table.column(first_list).to_pylist()]


def test_fields_map_arrow_types_to_kinds(corpus: Corpus, tmp_path: Path) -> None:
    path, _ = LAYOUTS["hf-cache-file"](tmp_path / "data.arrow", corpus)
    assert ArrowDataset(path).fields == {
        "input_ids": Field("input_ids", "ragged", np.dtype(np.int32), ()),
        "frames": Field("frames", "ragged", np.dtype(np.float32), (3,)),  # Array2D, storage type
        "label": Field("label", "fixed", np.dtype(np.int64), ()),
        "text": Field("text", "object", np.dtype(object), ()),
    }


def test_struct_bool_binary_and_nested_fixed_size_lists(tmp_path: Path) -> None:
    n = 23
    table = pa.table(
        {
            "meta": pa.StructArray.from_arrays(
                [pa.array(range(n), pa.int16()), pa.array([[i] * (i % 3) for i in range(n)])],
                names=["id", "ids"],
            ),
            "flag": pa.array([i % 3 == 0 for i in range(n)]),
            "blob": pa.array([bytes([i]) * (i % 4) for i in range(n)], pa.binary()),
            "image": pa.array(
                [[[i, i + 1], [i + 2, i + 3], [i + 4, i + 5]] for i in range(n)],
                pa.list_(pa.list_(pa.uint8(), 2), 3),
            ),
        }
    )
    for path in (
        write_arrow_file(tmp_path / "a.arrow", table, 4),
        write_parquet(tmp_path / "a.parquet", table, 5),
    ):
        ds = ArrowDataset(path)
        assert list(ds.fields) == ["meta/id", "meta/ids", "flag", "blob", "image"]
        assert ds.fields["image"] == Field("image", "fixed", np.dtype(np.uint8), (3, 2))
        indices = random_indices(n, 20, seed=4)
        batch = ds.read_batch(indices)
        for name in ds.fields:
            for position, index in enumerate(indices.tolist()):
                assert_same(
                    batch_sample(batch, name, position),
                    _reference(table, name, index % n),
                    f"{path.name} {name}[{index}]",
                )


def test_getitem_and_getitems_return_dicts_matching_pyarrow(corpus: Corpus, tmp_path: Path) -> None:
    path, table = LAYOUTS["ipc-file"](tmp_path / "a.arrow", corpus)
    ds = ArrowDataset(path)
    assert isinstance(ds, BatchReader)
    sample = ds[-3]
    assert isinstance(sample["label"], np.int64) and isinstance(sample["text"], str)
    for name, value in sample.items():
        assert_same(value, _reference(table, name, len(corpus) - 3), name)
    for item, index in zip(ds.__getitems__([9, 9, 0]), [9, 9, 0], strict=True):
        for name, value in item.items():
            assert_same(value, _reference(table, name, index), f"{name}[{index}]")


def test_uncompressed_ipc_numeric_fields_are_read_from_the_memory_map(
    corpus: Corpus, tmp_path: Path
) -> None:
    # White-box: this is the fast path the loader relies on; strings always go through Arrow.
    for layout in ("ipc-file", "ipc-stream", "hf-cache-file"):
        path, _ = LAYOUTS[layout](tmp_path / f"{layout}.arrow", corpus)
        ds = ArrowDataset(path)
        mapped = set(ds._shard(0)._mapped)  # type: ignore[attr-defined]
        numeric = {n for n, f in ds.fields.items() if f.kind != "object"}
        assert mapped == numeric, layout
    compressed, _ = LAYOUTS["ipc-file-zstd"](tmp_path / "c.arrow", corpus)
    assert ArrowDataset(compressed)._shard(0)._mapped == {}  # type: ignore[attr-defined]


def _with_nulls(tmp_path: Path) -> Path:
    table = pa.table(
        {
            "ids": pa.array([[1, 2], None, [3, None], [], [4]], pa.list_(pa.int32())),
            "x": pa.array([1.5, None, 2.5, 3.5, None], pa.float32()),
            "s": pa.array(["a", None, "c", "d", "e"]),
            "v": pa.array([[1, 2], [3, 4], None, [5, None], [7, 8]], pa.list_(pa.int8(), 2)),
        }
    )
    return write_arrow_file(tmp_path / "nulls.arrow", table, 2)


def test_nulls_raise_at_construction_naming_the_sample(tmp_path: Path) -> None:
    path = _with_nulls(tmp_path)
    with pytest.raises(DataFormatError, match=r"nulls\.arrow: field 'ids': sample 1 is null"):
        ArrowDataset(path)
    with pytest.raises(DataFormatError, match=r"field 's': sample 1 is null.*null_fill"):
        ArrowDataset(path, fields=["s"])


def test_null_fill_reads_nulls_as_documented(tmp_path: Path) -> None:
    ds = ArrowDataset(_with_nulls(tmp_path), null_fill=-1)
    batch = ds.read_batch([0, 1, 2, 3, 4])
    ids = batch["ids"]
    assert isinstance(ids, Ragged)
    assert ids.lengths.tolist() == [2, 0, 2, 0, 1]  # a null list is an empty sample
    assert ids.values.tolist() == [1, 2, 3, -1, 4]  # a null element is the fill value
    assert fixed(batch["x"]).tolist() == [1.5, -1, 2.5, 3.5, -1]
    assert batch["s"] == ["a", "", "c", "d", "e"]
    assert fixed(batch["v"]).tolist() == [[1, 2], [3, 4], [-1, -1], [5, -1], [7, 8]]
    assert ds.lengths.tolist() == [2, 0, 2, 0, 1]


def test_null_fill_must_fit_the_dtype_of_a_field_with_nulls(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=r"null_fill=0\.5 cannot be stored in field 'ids' of dtype int32"
    ):
        ArrowDataset(_with_nulls(tmp_path), null_fill=0.5)
    with pytest.raises(TypeError, match="null_fill must be a number"):
        ArrowDataset(_with_nulls(tmp_path), null_fill="")  # type: ignore[arg-type]


def test_parquet_nulls_inside_lists_raise_at_construction_naming_file_and_copy(
    tmp_path: Path,
) -> None:
    table = pa.table({"ids": pa.array([[1], [], [2, None], [3]], pa.list_(pa.int64()))})
    path = write_parquet(tmp_path / "n.parquet", table, 2)
    with pytest.raises(
        DataFormatError,
        match=r"n\.parquet \(read from its decoded copy .*\.arrow\): field 'ids': sample 2 is null",
    ):
        ArrowDataset(path)


def test_parquet_nulls_inside_lists_raise_when_read_without_a_copy(tmp_path: Path) -> None:
    # Row-group statistics count an empty list as a null of its leaf, so they cannot tell.
    table = pa.table({"ids": pa.array([[1], [], [2, None], [3]], pa.list_(pa.int64()))})
    ds = ArrowDataset(write_parquet(tmp_path / "n.parquet", table, 2), cache_dir=False)
    assert ragged(ds.read_batch([0, 1, 3])["ids"]).values.tolist() == [1, 3]
    with pytest.raises(
        DataFormatError, match=r"n\.parquet: field 'ids': sample 2 is null or holds a null"
    ):
        ds.read_batch([3, 2])


def test_parquet_null_numbers_raise_at_construction(tmp_path: Path) -> None:
    table = pa.table({"x": pa.array([1, 2, None, 4], pa.int64())})
    with pytest.raises(DataFormatError, match="field 'x': sample 2 is null"):
        ArrowDataset(write_parquet(tmp_path / "n.parquet", table, 3))


def test_empty_dataset_is_valid(tmp_path: Path) -> None:
    empty = make_corpus(0)
    for path in (
        write_arrow_file(tmp_path / "a.arrow", corpus_table(empty), 5),
        write_arrow_stream(tmp_path / "b.arrow", corpus_table(empty), 5),
        write_parquet(tmp_path / "c.parquet", corpus_table(empty), 5),
    ):
        ds = ArrowDataset(path)
        assert len(ds) == 0
        assert ds.lengths.shape == (0,)
        batch = ds.read_batch(np.array([], np.int64))
        assert ragged(batch["frames"]).values.shape == (0, 3)
        assert fixed(batch["emb"]).shape == (0, 4)
        assert batch["text"] == []
        with pytest.raises(IndexError):
            ds[0]


def test_parquet_row_group_cache_gives_identical_reads_at_any_capacity(
    corpus: Corpus, tmp_path: Path
) -> None:
    path = write_parquet(tmp_path / "a.parquet", corpus_table(corpus), 6)
    indices = random_indices(len(corpus), 30, seed=5)
    expected = ArrowDataset(
        write_arrow_file(tmp_path / "a.arrow", corpus_table(corpus), 7)
    ).read_batch(indices)
    for cache_bytes in (0, 1 << 20):
        ds = ArrowDataset(path, cache_bytes=cache_bytes)
        for _ in range(2):
            batch = ds.read_batch(indices)
            np.testing.assert_array_equal(
                ragged(batch["tokens"]).values, ragged(expected["tokens"]).values
            )
            np.testing.assert_array_equal(batch["emb"], expected["emb"])
            assert batch["text"] == expected["text"]
