"""HDF5Dataset reads every supported layout exactly as plain h5py does."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from _format_files import (
    Corpus,
    assert_same,
    assert_writable_arrays,
    batch_sample,
    fixed,
    h5_sample,
    open_reference,
    ragged,
    random_indices,
    write_fastload,
    write_plain,
    write_vlen,
)

from fastload import HDF5Dataset
from fastload._formats._hdf5_shard import H5Shard, MappedShard
from fastload._protocols import BatchReader
from fastload._types import Field, Ragged
from fastload.errors import DataFormatError

Writer = Callable[[Path, Corpus], Path]

LAYOUTS: dict[str, Writer] = {
    "fastload": lambda p, c: write_fastload(p, c),
    "fastload-without-lengths-index": lambda p, c: write_fastload(p, c, lengths=False),
    "fastload-chunked": lambda p, c: write_fastload(p, c, chunk_rows=5),
    "fastload-chunked-gzip": lambda p, c: write_fastload(p, c, chunk_rows=4, compression="gzip"),
    "vlen": lambda p, c: write_vlen(p, c),
    "vlen-chunked-gzip-shuffle": lambda p, c: write_vlen(
        p, c, chunks=(6,), compression="gzip", shuffle=True
    ),
    "vlen-resizable": lambda p, c: write_vlen(p, c, maxshape=(None,)),
    "vlen-lzf": lambda p, c: write_vlen(p, c, chunks=(8,), compression="lzf"),
    "plain-arrays": lambda p, c: write_plain(p, c),
}


def _reference_lengths(path: Path, field: str) -> list[int]:
    with h5py.File(path, "r", locking=False) as f:
        obj = f[field]
        if isinstance(obj, h5py.Group):
            return np.diff(obj["offsets"][...]).tolist()
        return [len(x) for x in obj[...]]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_read_batch_equals_plain_h5py_for_every_layout(
    layout: str, corpus: Corpus, tmp_path: Path
) -> None:
    path = LAYOUTS[layout](tmp_path / "data.h5", corpus)
    ds = HDF5Dataset(path)
    indices = random_indices(len(corpus), 40, seed=1)
    batch = ds.read_batch(indices)
    assert list(batch) == list(ds.fields)
    assert_writable_arrays(batch)
    assert_writable_arrays(ds.read_batch([0]))  # sample 0 is empty
    with open_reference(path) as reference:
        for name in ds.fields:
            for position, index in enumerate(indices.tolist()):
                expected = h5_sample(reference, name, index % len(corpus))
                assert_same(
                    batch_sample(batch, name, position), expected, f"{layout} {name}[{index}]"
                )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_lengths_equal_the_length_fields_sample_sizes(
    layout: str, corpus: Corpus, tmp_path: Path
) -> None:
    path = LAYOUTS[layout](tmp_path / "data.h5", corpus)
    ds = HDF5Dataset(path)
    if not any(f.kind == "ragged" for f in ds.fields.values()):
        assert ds.length_field is None
        assert ds.lengths.tolist() == [1] * len(corpus)  # nothing varies: one unit per sample
        return
    assert ds.length_field is not None and ds.fields[ds.length_field].kind == "ragged"
    assert ds.lengths.dtype == np.int64
    assert ds.lengths.tolist() == _reference_lengths(path, ds.length_field)
    assert not ds.lengths.flags.writeable


def test_fields_describe_kind_dtype_and_shape(corpus: Corpus, tmp_path: Path) -> None:
    fastload = HDF5Dataset(write_fastload(tmp_path / "a.h5", corpus))
    assert fastload.fields == {
        "emb": Field("emb", "fixed", np.dtype(np.float32), (4,)),
        "frames": Field("frames", "ragged", np.dtype(np.float32), (3,)),
        "label": Field("label", "fixed", np.dtype(np.int64), ()),
        "text": Field("text", "object", np.dtype(object), ()),
        "tokens": Field("tokens", "ragged", np.dtype(np.int32), ()),
    }
    plain = HDF5Dataset(write_plain(tmp_path / "b.h5", corpus))
    assert list(plain.fields) == ["big_endian", "code", "emb", "flag", "image", "meta/info/label"]
    assert plain.fields["big_endian"].dtype == np.dtype("=i4")  # served in native byte order
    assert plain.fields["image"].shape == (4, 2)
    assert plain.fields["flag"].dtype == np.dtype(bool)
    assert plain.fields["code"].kind == "object"


def test_getitem_and_getitems_return_dicts_matching_h5py(corpus: Corpus, tmp_path: Path) -> None:
    path = write_fastload(tmp_path / "a.h5", corpus)
    ds = HDF5Dataset(path)
    assert len(ds) == len(corpus)
    reference = open_reference(path)
    for index in (0, 3, len(corpus) - 1, -1, -len(corpus)):
        sample = ds[index]
        assert list(sample) == list(ds.fields)
        for name, value in sample.items():
            expected = h5_sample(reference, name, index % len(corpus))
            assert_same(value, expected, f"{name}[{index}]")
    assert isinstance(ds[2]["label"], np.int64)
    assert isinstance(ds[2]["text"], str)
    items = ds.__getitems__([5, 1, 5, -2])
    for item, index in zip(items, [5, 1, 5, -2], strict=True):
        for name, value in item.items():
            expected = h5_sample(reference, name, index % len(corpus))
            assert_same(value, expected, f"{name}[{index}]")
    reference.close()


def test_columnar_batch_types_follow_field_kinds(corpus: Corpus, tmp_path: Path) -> None:
    ds = HDF5Dataset(write_fastload(tmp_path / "a.h5", corpus))
    assert isinstance(ds, BatchReader)
    batch = ds.read_batch(np.array([4, 2, 9]))
    assert isinstance(batch["tokens"], Ragged)
    assert batch["tokens"].lengths.dtype == np.int64
    assert batch["tokens"].values.dtype == np.int32
    assert ragged(batch["frames"]).values.shape[1:] == (3,)
    assert isinstance(batch["emb"], np.ndarray) and batch["emb"].shape == (3, 4)
    assert batch["text"] == [corpus.text[4], corpus.text[2], corpus.text[9]]


def test_fields_and_length_field_select_by_name_and_nested_path(
    corpus: Corpus, tmp_path: Path
) -> None:
    path = write_fastload(tmp_path / "a.h5", corpus)
    ds = HDF5Dataset(path, fields=["label", "frames", "tokens"], length_field="frames")
    assert list(ds.fields) == ["label", "frames", "tokens"]
    assert ds.lengths.tolist() == [len(f) for f in corpus.frames]
    nested = HDF5Dataset(write_plain(tmp_path / "b.h5", corpus), fields=["/meta/info/label"])
    assert list(nested.fields) == ["meta/info/label"]
    assert nested[7]["meta/info/label"] == corpus.label[7]


def test_default_length_field_is_the_one_the_lengths_index_describes(
    corpus: Corpus, tmp_path: Path
) -> None:
    # "frames" comes first in the file, but /lengths (written for "tokens") marks the primary.
    ds = HDF5Dataset(write_fastload(tmp_path / "a.h5", corpus))
    assert list(ds.fields)[:2] == ["emb", "frames"]
    assert ds.length_field == "tokens"
    unindexed = HDF5Dataset(write_fastload(tmp_path / "b.h5", corpus, lengths=False))
    assert unindexed.length_field == "frames"


def test_lengths_index_may_name_the_field_it_describes(corpus: Corpus, tmp_path: Path) -> None:
    path = write_fastload(tmp_path / "a.h5", corpus, lengths=False)
    with h5py.File(path, "a") as f:
        f["lengths"] = [len(x) for x in corpus.frames]
        f["lengths"].attrs["field"] = "frames"
    ds = HDF5Dataset(path, fields=["tokens", "label"])
    assert ds.length_field == "tokens"
    assert ds.lengths.tolist() == [len(t) for t in corpus.tokens]
    assert HDF5Dataset(path).length_field == "frames"


def test_empty_dataset_is_valid(tmp_path: Path) -> None:
    from _format_files import make_corpus

    empty = make_corpus(0)
    for path in (write_fastload(tmp_path / "a.h5", empty), write_vlen(tmp_path / "b.h5", empty)):
        ds = HDF5Dataset(path)
        assert len(ds) == 0
        assert ds.lengths.shape == (0,)
        batch = ds.read_batch([])
        tokens = ragged(batch["tokens"]).values
        assert tokens.shape == (0,) and tokens.dtype == np.int32
        assert fixed(batch["label"]).shape == (0,)
        assert batch["text"] == []
        with pytest.raises(IndexError):
            ds[0]


def test_index_errors_name_the_index_and_the_size(corpus: Corpus, tmp_path: Path) -> None:
    ds = HDF5Dataset(write_fastload(tmp_path / "a.h5", corpus))
    with pytest.raises(IndexError, match=f"index {len(corpus)} .* 57 samples"):
        ds[len(corpus)]
    with pytest.raises(IndexError, match="index -58"):
        ds.read_batch([0, -58])
    with pytest.raises(TypeError, match="integers"):
        ds.read_batch([0.5])
    with pytest.raises(TypeError, match="integer"):
        ds["label"]  # type: ignore[index]


def test_chunk_cache_serves_repeated_reads_identically_at_any_capacity(
    corpus: Corpus, tmp_path: Path
) -> None:
    path = write_fastload(tmp_path / "a.h5", corpus, chunk_rows=3, compression="gzip")
    indices = random_indices(len(corpus), 30, seed=2)
    reference = HDF5Dataset(write_fastload(tmp_path / "b.h5", corpus)).read_batch(indices)
    for cache_bytes in (0, 1 << 20):
        ds = HDF5Dataset(path, cache_bytes=cache_bytes)
        for _ in range(2):
            batch = ds.read_batch(indices)
            np.testing.assert_array_equal(
                ragged(batch["tokens"]).values, ragged(reference["tokens"]).values
            )
            np.testing.assert_array_equal(batch["emb"], reference["emb"])


def test_lengths_and_construction_never_read_the_payload(corpus: Corpus, tmp_path: Path) -> None:
    # Corrupt every compressed chunk of tokens/values: any read of the payload would fail.
    path = write_fastload(tmp_path / "a.h5", corpus, chunk_rows=4, compression="gzip")
    with h5py.File(path, "r", locking=False) as f:
        dset = f["tokens/values"]
        spans = [dset.id.get_chunk_info(i) for i in range(dset.id.get_num_chunks())]
    with open(path, "r+b") as handle:
        for span in spans:
            handle.seek(span.byte_offset)
            handle.write(b"\xff" * span.size)
    ds = HDF5Dataset(path)
    assert ds.lengths.tolist() == [len(t) for t in corpus.tokens]
    nonempty = next(i for i, t in enumerate(corpus.tokens) if len(t))
    with pytest.raises(
        DataFormatError, match=rf"a\.h5: field 'tokens': reading samples \[{nonempty}\]"
    ):
        ds.read_batch([nonempty])


def test_vlen_lengths_come_from_descriptors_not_the_heap(corpus: Corpus, tmp_path: Path) -> None:
    path = write_vlen(tmp_path / "a.h5", corpus)
    data = bytearray(path.read_bytes())
    # Destroy the global heap collections' signatures: HDF5 can then read no sequence at all.
    position = data.find(b"GCOL")
    assert position >= 0
    while position >= 0:
        data[position : position + 4] = b"XXXX"
        position = data.find(b"GCOL", position + 4)
    path.write_bytes(bytes(data))
    ds = HDF5Dataset(path, fields=["tokens"])
    assert ds.lengths.tolist() == [len(t) for t in corpus.tokens]
    with pytest.raises(DataFormatError, match=r"a\.h5: field 'tokens': reading samples \[1\]"):
        ds.read_batch([1])


def _vlen_file(
    path: Path, sequences: list[np.ndarray], file_options: dict[str, Any], storage: dict[str, Any]
) -> Path:
    with h5py.File(path, "w", **file_options) as f:
        vlen = h5py.vlen_dtype(sequences[0].dtype)
        dset = f.create_dataset("seq", (len(sequences),), dtype=vlen, **storage)
        for i, s in enumerate(sequences):
            if i % 11 != 10 or "chunks" not in storage:  # leave some chunks never written
                dset[i] = s
        words = f.create_dataset("word", (len(sequences),), dtype=h5py.string_dtype(), **storage)
        words[:] = ["" if i % 5 == 0 else f"wörd {i} " * (i % 4) for i in range(len(sequences))]
    return path


@pytest.mark.parametrize(
    ("dtype", "file_options", "storage", "uses_heap"),
    [
        (np.dtype("<i8"), {}, {}, True),
        (np.dtype("<f4"), {"userblock_size": 512}, {}, True),  # heap addresses skip the block
        (np.dtype("<i2"), {}, {"chunks": (4,), "compression": "gzip", "shuffle": True}, True),
        (np.dtype("<i4"), {}, {"chunks": (5,), "maxshape": (None,)}, True),
        (np.dtype("<i4"), {}, {"chunks": (5,), "compression": "lzf"}, False),
        (np.dtype(">i4"), {}, {}, False),  # non-native elements: read through HDF5
    ],
    ids=["int64", "userblock", "chunked-gzip-shuffle", "resizable", "lzf", "big-endian"],
)
def test_vlen_sequences_and_strings_equal_h5py_with_or_without_the_heap_reader(
    dtype: np.dtype,
    file_options: dict[str, Any],
    storage: dict[str, Any],
    uses_heap: bool,
    tmp_path: Path,
) -> None:
    rng = np.random.default_rng(7)
    # Lengths from empty to past a 4 KiB heap collection, which gets a collection of its own.
    lengths = [0, 1, 3000, *rng.integers(0, 40, 40).tolist()]
    sequences = [rng.integers(-1000, 1000, n).astype(dtype) for n in lengths]
    path = _vlen_file(tmp_path / "v.h5", sequences, file_options, storage)
    ds = HDF5Dataset(path)
    indices = random_indices(len(sequences), 50, seed=8)
    with open_reference(path) as reference:
        for _ in range(2):  # the second pass is served by the caches
            batch = ds.read_batch(indices)
            for position, index in enumerate(indices.tolist()):
                for name in ("seq", "word"):
                    expected = h5_sample(reference, name, index % len(sequences))
                    assert_same(batch_sample(batch, name, position), expected, f"{name}[{index}]")
    assert ds.lengths.tolist() == _reference_lengths(path, "seq")
    assert (ds._shard(0)._columns["seq"]._heap is not None) == uses_heap  # type: ignore[attr-defined]


def test_memory_mapped_datasets_are_found_past_a_userblock(corpus: Corpus, tmp_path: Path) -> None:
    path = tmp_path / "u.h5"
    with h5py.File(path, "w", userblock_size=1024) as f:
        f["tokens/values"] = np.concatenate(corpus.tokens)
        f["tokens/offsets"] = np.concatenate([[0], np.cumsum([len(t) for t in corpus.tokens])])
        f["emb"] = corpus.emb
    ds = HDF5Dataset(path)
    indices = random_indices(len(corpus), 30, seed=9)
    batch = ds.read_batch(indices)
    with open_reference(path) as reference:
        for position, index in enumerate(indices.tolist()):
            for name in ("tokens", "emb"):
                expected = h5_sample(reference, name, index % len(corpus))
                assert_same(batch_sample(batch, name, position), expected, f"{name}[{index}]")
    assert isinstance(ds._shard(0), MappedShard)  # all mapped: read without opening HDF5 at all


def test_a_file_changed_since_construction_is_opened_in_hdf5_again(corpus: Corpus, tmp_path: Path) -> None:
    path = tmp_path / "c.h5"
    with h5py.File(path, "w") as f:
        f["tokens/values"] = np.concatenate(corpus.tokens)
        f["tokens/offsets"] = np.concatenate([[0], np.cumsum([len(t) for t in corpus.tokens])])
    ds = HDF5Dataset(path)
    before = ds.read_batch([0, 3])
    ds.close()
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # "changed"
    assert isinstance(ds._shard(0), H5Shard)
    after = ds.read_batch([0, 3])
    assert np.array_equal(before["tokens"].values, after["tokens"].values)


def test_a_chunked_field_keeps_the_file_open_in_hdf5(corpus: Corpus, tmp_path: Path) -> None:
    path = tmp_path / "k.h5"
    with h5py.File(path, "w") as f:
        f["tokens/values"] = np.concatenate(corpus.tokens)
        f["tokens/offsets"] = np.concatenate([[0], np.cumsum([len(t) for t in corpus.tokens])])
        f.create_dataset("emb", data=corpus.emb, chunks=(4, *corpus.emb.shape[1:]), compression="gzip")
    ds = HDF5Dataset(path)
    assert isinstance(ds._shard(0), H5Shard)
    assert HDF5Dataset(path, fields=["tokens"])._placements[0] is not None  # that field alone maps
