"""Writers of real HDF5, Arrow and Parquet files for the reader tests, and plain h5py/pyarrow
reference reads to compare the readers against.

Every writer stores the same small corpus (:class:`Corpus`): ragged token ids (some empty),
ragged frames of 3 features, an int64 label equal to the sample's index (so that a sample's
identity survives a trip through a DataLoader), a float32 embedding and a unicode text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from fastload._types import Column, ColumnarBatch, Ragged


@dataclass
class Corpus:
    tokens: list[np.ndarray]  # int32 [L]
    frames: list[np.ndarray]  # float32 [L, 3]
    label: np.ndarray  # int64 [N], label[i] == i + label_base
    emb: np.ndarray  # float32 [N, 4]
    text: list[str]

    def __len__(self) -> int:
        return len(self.tokens)

    def slice(self, start: int, stop: int) -> Corpus:
        return Corpus(
            self.tokens[start:stop],
            self.frames[start:stop],
            self.label[start:stop],
            self.emb[start:stop],
            self.text[start:stop],
        )


def make_corpus(num_samples: int, seed: int = 0, label_base: int = 0) -> Corpus:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 24, num_samples)
    lengths[::7] = 0  # empty samples are legal and easy to get wrong
    tokens = [rng.integers(0, 50_000, n).astype(np.int32) for n in lengths]
    frames = [rng.standard_normal((int(n) // 2, 3)).astype(np.float32) for n in lengths]
    label = np.arange(label_base, label_base + num_samples, dtype=np.int64)
    emb = rng.standard_normal((num_samples, 4)).astype(np.float32)
    text = [f"sample {label_base + i} — “{'é' * (i % 4)}”" for i in range(num_samples)]
    return Corpus(tokens, frames, label, emb, text)


# ---- HDF5 ----------------------------------------------------------------------------------


def _offsets(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum([len(a) for a in arrays])]).astype(np.int64)


def _values(arrays: list[np.ndarray], dtype: Any, tail: tuple[int, ...] = ()) -> np.ndarray:
    if not arrays:
        return np.empty((0, *tail), dtype)
    return np.concatenate(arrays).astype(dtype)


def _create(
    group: h5py.Group, name: str, data: np.ndarray, chunk_rows: int | None, compression: str | None
) -> None:
    """A dataset, chunked ``chunk_rows`` rows at a time when asked (HDF5 cannot chunk an empty
    dataset, so empty ones stay contiguous)."""
    if chunk_rows is None or len(data) == 0:
        group.create_dataset(name, data=data)
    else:
        chunks = (min(chunk_rows, len(data)), *data.shape[1:])
        group.create_dataset(name, data=data, chunks=chunks, compression=compression)


def write_fastload(
    path: Path,
    corpus: Corpus,
    *,
    lengths: bool = True,
    chunk_rows: int | None = None,
    compression: str | None = None,
) -> Path:
    """The fastload layout, contiguous unless ``chunk_rows`` is given."""
    with h5py.File(path, "w") as f:
        f.attrs["fastload_format"] = 1
        f.attrs["num_samples"] = len(corpus)
        for name, arrays, dtype, tail in (
            ("tokens", corpus.tokens, np.int32, ()),
            ("frames", corpus.frames, np.float32, (3,)),
        ):
            group = f.create_group(name)
            _create(group, "values", _values(arrays, dtype, tail), chunk_rows, compression)
            _create(group, "offsets", _offsets(arrays), chunk_rows, compression)
        _create(f, "label", corpus.label, chunk_rows, compression)
        _create(f, "emb", corpus.emb, chunk_rows, compression)
        f.create_dataset("text", data=corpus.text, dtype=h5py.string_dtype())
        if lengths:
            f.create_dataset("lengths", data=np.diff(_offsets(corpus.tokens)))
    return path


def write_vlen(path: Path, corpus: Corpus, **storage: Any) -> Path:
    """What most users have: h5py variable-length datasets, one row per sample."""
    with h5py.File(path, "w") as f:
        tokens = f.create_dataset(
            "tokens", (len(corpus),), dtype=h5py.vlen_dtype(np.int32), **storage
        )
        for i, t in enumerate(corpus.tokens):
            tokens[i] = t
        f.create_dataset("label", data=corpus.label)
        f.create_dataset("text", data=corpus.text, dtype=h5py.string_dtype())
    return path


def write_plain(path: Path, corpus: Corpus) -> Path:
    """Plain ``[N, ...]`` arrays in nested groups, a fixed-length ASCII string, a scalar."""
    with h5py.File(path, "w") as f:
        f.create_dataset("meta/info/label", data=corpus.label)
        f.create_dataset("emb", data=corpus.emb)
        f.create_dataset(
            "image", data=(corpus.emb[:, :, None] * 10).astype(np.uint8).repeat(2, axis=2)
        )
        f.create_dataset("flag", data=corpus.label % 3 == 0)
        f.create_dataset("big_endian", data=corpus.label.astype(">i4"))
        f.create_dataset(
            "code", data=np.array([f"c{i}".encode() for i in range(len(corpus))], "S6")
        )
        f.create_dataset("version", data=3)  # a scalar: metadata, not a field
    return path


def open_reference(path: Path) -> h5py.File:
    """``path`` opened the plain h5py way, for :func:`h5_sample` (without file locking, like the
    reader: HDF5 refuses to open one file twice in a process with different locking flags)."""
    return h5py.File(path, "r", locking=False)


def h5_sample(file: h5py.File, field: str, index: int) -> Any:
    """Sample ``index`` of ``field`` read the plain h5py way, as a user would."""
    obj = file[field]
    if isinstance(obj, h5py.Group):
        offsets = obj["offsets"]
        return obj["values"][offsets[index] : offsets[index + 1]]
    info = h5py.check_string_dtype(obj.dtype)
    if info is not None:
        value = obj[index]
        return value.decode() if info.encoding == "utf-8" else bytes(value)
    return obj[index]


# ---- Arrow ---------------------------------------------------------------------------------


def corpus_table(corpus: Corpus, *, large: bool = False) -> pa.Table:
    list_of = pa.large_list if large else pa.list_
    return pa.table(
        {
            "tokens": pa.array([t.tolist() for t in corpus.tokens], list_of(pa.int32())),
            "frames": pa.array(
                [f.tolist() for f in corpus.frames], list_of(pa.list_(pa.float32(), 3))
            ),
            "label": pa.array(corpus.label, pa.int64()),
            "emb": pa.array(corpus.emb.tolist(), pa.list_(pa.float32(), 4)),
            "text": pa.array(corpus.text, pa.string()),
        }
    )


def write_arrow_file(
    path: Path, table: pa.Table, batch_rows: int, compression: str | None = None
) -> Path:
    options = pa.ipc.IpcWriteOptions(compression=compression)
    with pa.ipc.new_file(path, table.schema, options=options) as writer:
        writer.write_table(table, max_chunksize=batch_rows)
    return path


def write_arrow_stream(path: Path, table: pa.Table, batch_rows: int) -> Path:
    with pa.ipc.new_stream(path, table.schema) as writer:
        writer.write_table(table, max_chunksize=batch_rows)
    return path


def write_parquet(path: Path, table: pa.Table, row_group_rows: int) -> Path:
    pq.write_table(table, path, row_group_size=row_group_rows)
    return path


class Array2DLike(pa.ExtensionType):
    """The on-disk shape of ``datasets``' ``Array2D(shape=(None, 3))``: an extension type named
    like theirs over ``list<fixed_size_list<float, 3>>``. Never registered, so a reader sees
    only what a process without ``datasets`` would: the storage type plus field metadata."""

    def __init__(self) -> None:
        super().__init__(
            pa.list_(pa.list_(pa.float32(), 3)), "datasets.features.features.Array2DExtensionType"
        )

    def __arrow_ext_serialize__(self) -> bytes:
        return json.dumps({"shape": [None, 3], "dtype": "float32"}).encode()

    @classmethod
    def __arrow_ext_deserialize__(cls, storage_type: pa.DataType, serialized: bytes) -> Array2DLike:
        return cls()


def hf_table(corpus: Corpus) -> pa.Table:
    """The corpus as ``datasets`` stores it: Sequence(Value) as list, ClassLabel as int64,
    Array2D as an extension type, and the features in the schema's ``huggingface`` metadata."""
    frames_storage = pa.array(
        [f.tolist() for f in corpus.frames], pa.list_(pa.list_(pa.float32(), 3))
    )
    features = {
        "input_ids": {"feature": {"dtype": "int32", "_type": "Value"}, "_type": "Sequence"},
        "frames": {"shape": [None, 3], "dtype": "float32", "_type": "Array2D"},
        "label": {"names": [str(i) for i in range(len(corpus) + 1)], "_type": "ClassLabel"},
        "text": {"dtype": "string", "_type": "Value"},
    }
    table = pa.table(
        {
            "input_ids": pa.array([t.tolist() for t in corpus.tokens], pa.list_(pa.int32())),
            "frames": pa.ExtensionArray.from_storage(Array2DLike(), frames_storage),
            "label": pa.array(corpus.label, pa.int64()),
            "text": pa.array(corpus.text, pa.string()),
        }
    )
    metadata = {b"huggingface": json.dumps({"info": {"features": features}}).encode()}
    return table.replace_schema_metadata(metadata)


def write_hf_cache_file(path: Path, corpus: Corpus, writer_batch_size: int = 10) -> Path:
    """A ``datasets`` cache file: an Arrow IPC *stream* written batch by batch."""
    return write_arrow_stream(path, hf_table(corpus), writer_batch_size)


def write_hf_save_to_disk(folder: Path, corpus: Corpus, num_shards: int) -> Path:
    """A ``Dataset.save_to_disk`` folder: ``data-0000k-of-0000n.arrow`` streams, plus
    ``dataset_info.json`` and ``state.json`` listing the data files."""
    folder.mkdir()
    table = hf_table(corpus)
    bounds = np.linspace(0, len(corpus), num_shards + 1).astype(int)
    names = []
    for k in range(num_shards):
        name = f"data-{k:05d}-of-{num_shards:05d}.arrow"
        write_arrow_stream(folder / name, table.slice(bounds[k], bounds[k + 1] - bounds[k]), 10)
        names.append(name)
    info = json.loads(table.schema.metadata[b"huggingface"])["info"]
    (folder / "dataset_info.json").write_text(
        json.dumps({**info, "citation": "", "description": ""})
    )
    state: dict[str, Any] = {
        "_data_files": [{"filename": n} for n in names],
        "_fingerprint": "0123456789abcdef",
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": "train",
    }
    (folder / "state.json").write_text(json.dumps(state, indent=2))
    return folder


def arrow_sample(table: pa.Table, field: str, index: int) -> Any:
    """Sample ``index`` of ``field`` read the plain pyarrow way (``"a/b"`` is a struct child)."""
    parts = field.split("/")
    value = table.column(parts[0])[index].as_py()
    for part in parts[1:]:
        value = value[part]
    return value


# ---- comparing -----------------------------------------------------------------------------


def batch_sample(batch: ColumnarBatch, field: str, position: int) -> Any:
    """Sample ``position`` of ``field`` in a columnar batch, cut out independently of the reader."""
    column = batch[field]
    if isinstance(column, Ragged):
        ends = np.cumsum(column.lengths)
        return column.values[ends[position] - column.lengths[position] : ends[position]]
    return column[position]


def ragged(column: Column) -> Ragged:
    """``column``, which must be a ragged field's."""
    assert isinstance(column, Ragged), type(column)
    return column


def fixed(column: Column) -> np.ndarray:
    """``column``, which must be a fixed field's."""
    assert isinstance(column, np.ndarray), type(column)
    return column


def assert_writable_arrays(batch: ColumnarBatch) -> None:
    """Every array of a batch belongs to the caller: writable (torch warns on read-only
    arrays, and a view of a file's read-only map must never escape)."""
    for name, column in batch.items():
        arrays = [column.values, column.lengths] if isinstance(column, Ragged) else [column]
        for array in arrays:
            if isinstance(array, np.ndarray):
                assert array.flags.writeable, name


def assert_same(got: Any, expected: Any, context: str) -> None:
    if isinstance(got, (str, bytes)) or isinstance(expected, (str, bytes)):
        assert type(got) is type(expected) and got == expected, (
            f"{context}: {got!r} != {expected!r}"
        )
        return
    expected_array = np.asarray(expected)
    got_array = np.asarray(got)
    assert got_array.shape == expected_array.shape or expected_array.size == 0 == got_array.size, (
        f"{context}: shape {got_array.shape} != {expected_array.shape}"
    )
    np.testing.assert_array_equal(
        got_array.reshape(expected_array.shape), expected_array, err_msg=context
    )


def random_indices(num_samples: int, count: int, seed: int) -> np.ndarray:
    """Unsorted indices with duplicates and negative entries."""
    rng = np.random.default_rng(seed)
    indices = rng.integers(-num_samples, num_samples, count)
    return np.concatenate([indices, indices[:5], [0, num_samples - 1, -1]])
