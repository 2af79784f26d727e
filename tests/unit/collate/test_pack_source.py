"""PackedSource: a packed batch read through a real HDF5 reader (in place or not) or a plain
dataset gives the same packed tensors; its distinct samples are read once; its capabilities
are the dataset's; each error names what is wrong."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch

from fastload import HDF5Dataset
from fastload._collate import PackCollate
from fastload._collate._pack_source import PackedColumns, PackedSource
from fastload._types import Field, PackedBatch, Ragged, Spans
from fastload.errors import DataFormatError

SEQ_LEN = 16
LENGTHS = [5, 20, 3, 9, 1, 12]


def tokens(i: int, n: int) -> np.ndarray:
    return (np.arange(n) + 100 * (i + 1)).astype(np.uint16)


def write_corpus(path: Path) -> Path:
    """``ids`` and ``loss_mask`` (ragged, same lengths), ``score`` (fixed [2]) and ``name``."""
    offsets = np.concatenate(([0], np.cumsum(LENGTHS))).astype(np.int64)
    ids = np.concatenate([tokens(i, n) for i, n in enumerate(LENGTHS)])
    with h5py.File(path, "w") as f:
        f.attrs["fastload_format"] = 1
        f.attrs["num_samples"] = len(LENGTHS)
        f.create_dataset("ids/values", data=ids)
        f.create_dataset("ids/offsets", data=offsets)
        f.create_dataset("loss_mask/values", data=(ids % 3 != 0).astype(np.uint8))
        f.create_dataset("loss_mask/offsets", data=offsets)
        f.create_dataset("score", data=np.arange(2 * len(LENGTHS), dtype=np.float32).reshape(-1, 2))
        f.create_dataset("name", data=[f"s{i}" for i in range(len(LENGTHS))], dtype=h5py.string_dtype())
        f.create_dataset("lengths", data=np.asarray(LENGTHS, np.int64))
    return path


@pytest.fixture
def corpus(tmp_path: Path) -> HDF5Dataset:
    return HDF5Dataset(write_corpus(tmp_path / "corpus.h5"), length_field="ids")


class Samples:
    """A plain map-style dataset: a list of sample dicts and their lengths, nothing more."""

    def __init__(self, samples: list[dict[str, Any]], lengths: list[int]) -> None:
        self.samples = samples
        self.lengths = np.asarray(lengths, np.int64)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.samples[i]


class Described(Samples):
    """A plain dataset that says its fields, so that the 1-D ``score`` is read as fixed."""

    fields = {
        "ids": Field("ids", "ragged", np.dtype(np.uint16)),
        "loss_mask": Field("loss_mask", "ragged", np.dtype(np.uint8)),
        "score": Field("score", "fixed", np.dtype(np.float32), (2,)),
        "name": Field("name", "object", np.dtype(object)),
    }


def plain_twin(kind: type[Samples] = Described) -> Samples:
    samples = [
        {
            "ids": tokens(i, n),
            "loss_mask": (tokens(i, n) % 3 != 0).astype(np.uint8),
            "name": f"s{i}",  # the HDF5 file's field order
            "score": np.array([2 * i, 2 * i + 1], np.float32),
        }
        for i, n in enumerate(LENGTHS)
    ]
    return kind(samples, LENGTHS)


def plan(rows: list[list[tuple[int, int, int]]], seq_len: int = SEQ_LEN) -> PackedBatch:
    pieces = [piece for row in rows for piece in row]
    column = np.array(pieces, dtype=np.int64).reshape(-1, 3).T
    offsets = np.concatenate(([0], np.cumsum([len(row) for row in rows]))).astype(np.int64)
    return PackedBatch(column[0].copy(), column[1].copy(), column[2].copy(), offsets, seq_len)


#: Sample 1 (20 tokens) split over rows 0 and 2; sample 3 in two pieces of one row; a last
#: row of padding only.
SPLIT = plan([[(0, 0, 5), (1, 0, 11)], [(3, 0, 4), (2, 0, 3), (3, 4, 9)], [(1, 11, 20)], []])


def as_numpy(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    a, b = as_numpy(a), as_numpy(b)
    assert list(a) == list(b)
    for name in a:
        if isinstance(a[name], np.ndarray):
            assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name]), name
        else:
            assert a[name] == b[name], name


def test_every_read_packs_the_same_tensors(corpus: HDF5Dataset) -> None:
    source = PackedSource(corpus, seq_len=SEQ_LEN, rows=4)
    collate = PackCollate(SEQ_LEN, rows=4)
    assert source.reads_in_place
    in_place = source.read_batch_in_place(SPLIT)
    assert isinstance(in_place["ids"], Spans)  # left in the map: gathered from it, not copied
    reference = collate(source.read_batch(SPLIT))
    assert_same(collate(in_place), reference)
    plain = PackedSource(plain_twin(), seq_len=SEQ_LEN, rows=4)
    assert_same(collate(plain.__getitems__(SPLIT)), reference)
    assert_same(collate(source.__getitems__(SPLIT)), reference)
    # What it holds: sample 1's two pieces in rows 0 and 2, and its fixed and object values.
    ids = reference["ids"].numpy()
    assert ids[0, 5:16].tolist() == tokens(1, 20)[:11].tolist()
    assert ids[2, :9].tolist() == tokens(1, 20)[11:].tolist()
    assert ids[1, :12].tolist() == [*tokens(3, 9)[:4], *tokens(2, 3), *tokens(3, 9)[4:]]
    assert reference["score"][2, 0].tolist() == [2.0, 3.0]
    assert reference["name"] == ["s0", "s1", "s3", "s2", "s3", "s1"]
    mask = reference["loss_mask"].numpy()
    assert mask[2, :9].tolist() == (tokens(1, 20)[11:] % 3 != 0).tolist()


@pytest.mark.parametrize("form", ["object", "encoded", "bytes"])
def test_a_packed_batch_reads_alike_in_every_form(corpus: HDF5Dataset, form: str) -> None:
    given: Any = {"object": SPLIT, "encoded": np.asarray(SPLIT), "bytes": SPLIT.encode().tobytes()}[form]
    source = PackedSource(corpus, seq_len=SEQ_LEN, rows=4)
    columns = source.read_batch(given)
    assert isinstance(columns, PackedColumns)
    assert np.array_equal(np.asarray(columns.plan), np.asarray(SPLIT))
    assert_same(PackCollate(SEQ_LEN)(columns), PackCollate(SEQ_LEN)(source.read_batch(SPLIT)))


def test_a_batch_of_padding_only_reads_through_every_path(corpus: HDF5Dataset) -> None:
    empty = plan([[], []])
    collate = PackCollate(SEQ_LEN)
    for dataset in (corpus, plain_twin()):
        out = collate(PackedSource(dataset, seq_len=SEQ_LEN, rows=2).read_batch(empty))
        assert out["ids"].shape == (2, SEQ_LEN) and not out["ids"].any()
        assert out["cu_seqlens"].tolist() == [0, SEQ_LEN, 2 * SEQ_LEN]
        assert out["name"] == [] and out["score"].shape == (2, SEQ_LEN, 2)


class Counting(Samples):
    """A plain dataset with ``read_batch``, recording the indices of each read."""

    fields = {
        "ids": Field("ids", "ragged", np.dtype(np.uint16)),
        "fixed": Field("fixed", "fixed", np.dtype(np.int64)),
    }

    def __init__(self, lengths: list[int], *, lie: dict[int, int] | None = None) -> None:
        data_lengths = [(lie or {}).get(i, n) for i, n in enumerate(lengths)]
        super().__init__([{"ids": tokens(i, n), "fixed": i} for i, n in enumerate(data_lengths)], lengths)
        self.reads: list[list[int]] = []

    def read_batch(self, indices: Any) -> dict[str, Any]:
        self.reads.append(np.asarray(indices).tolist())
        rows = [self.samples[i] for i in self.reads[-1]]
        lengths = np.array([len(r["ids"]) for r in rows], np.int64)
        values = np.concatenate([r["ids"] for r in rows] or [np.zeros(0, np.uint16)])
        return {"ids": Ragged(values, lengths), "fixed": np.array([r["fixed"] for r in rows], np.int64)}


def test_each_distinct_sample_is_read_once() -> None:
    dataset = Counting(LENGTHS)
    columns = PackedSource(dataset, seq_len=SEQ_LEN, rows=4).read_batch(SPLIT)
    assert dataset.reads == [[0, 1, 2, 3]]
    assert columns["fixed"].tolist() == [0, 1, 3, 2, 3, 1]  # one entry per piece
    assert columns["ids"].lengths.tolist() == [5, 11, 4, 3, 5, 9]


def test_capabilities_are_the_datasets_own(corpus: HDF5Dataset) -> None:
    packed = PackedSource(corpus, seq_len=SEQ_LEN, rows=4)
    assert packed.process_independent_reads and packed.reads_in_place
    assert packed.fields == corpus.fields and np.array_equal(packed.lengths, corpus.lengths)
    assert corpus.mapped_ragged is not None and not hasattr(packed, "mapped_ragged")
    assert (packed.pack_rows, packed.seq_len, len(packed)) == (4, SEQ_LEN, len(LENGTHS))
    assert packed[1]["ids"].tolist() == tokens(1, 20).tolist()
    plain = PackedSource(plain_twin(Samples), seq_len=SEQ_LEN, rows=4)
    assert not plain.process_independent_reads and not plain.reads_in_place
    for absent in ("fields", "read_batch_in_place", "mapped_ragged"):
        assert not hasattr(plain, absent), absent


def test_packed_columns_and_the_source_pickle(corpus: HDF5Dataset) -> None:
    source = PackedSource(corpus, seq_len=SEQ_LEN, rows=4)
    columns = source.read_batch(SPLIT)
    again = pickle.loads(pickle.dumps(columns))
    assert isinstance(again, PackedColumns) and np.array_equal(np.asarray(again.plan), np.asarray(SPLIT))
    assert_same(PackCollate(SEQ_LEN)(again), PackCollate(SEQ_LEN)(columns))
    copied = pickle.loads(pickle.dumps(source))
    assert_same(PackCollate(SEQ_LEN)(copied.read_batch(SPLIT)), PackCollate(SEQ_LEN)(columns))


# -- errors -------------------------------------------------------------------------------------


def test_data_of_another_length_than_the_datasets_lengths_is_named(corpus: HDF5Dataset) -> None:
    dataset = Counting(LENGTHS, lie={3: 7})
    with pytest.raises(DataFormatError, match=r"Counting: field 'ids' of sample 3 has 7 elements, but .* say 9"):
        PackedSource(dataset, seq_len=SEQ_LEN, rows=4).read_batch(SPLIT)

    class Lying(HDF5Dataset):
        process_independent_reads = True

        @property
        def lengths(self) -> Any:
            return np.asarray([5, 20, 3, 8, 1, 12], np.int64)

    lying = Lying(corpus.files[0])
    with pytest.raises(DataFormatError, match=r"corpus.h5.*field 'ids' of sample 3 has 9 elements, but .* say 8"):
        PackedSource(lying, seq_len=SEQ_LEN, rows=4).read_batch(plan([[(3, 0, 8)]]))


def test_a_datasets_own_files_attribute_is_not_taken_for_its_name() -> None:
    dataset = Counting(LENGTHS, lie={3: 7})
    dataset.files = {"train": ["a", "b"]}  # type: ignore[attr-defined]  # the user's, not a path
    with pytest.raises(DataFormatError, match=r"^Counting: field 'ids' of sample 3 has 7 elements") as caught:
        PackedSource(dataset, seq_len=SEQ_LEN, rows=4).read_batch(SPLIT)
    assert "train" not in str(caught.value)


def test_a_piece_beyond_its_sample_is_named(corpus: HDF5Dataset) -> None:
    with pytest.raises(ValueError, match=r"piece 1 .* tokens 2:4 of sample 2, which has 3"):
        PackedSource(corpus, seq_len=SEQ_LEN, rows=1).read_batch(plan([[(0, 0, 5), (2, 2, 4)]]))


@pytest.mark.parametrize(
    ("rows", "seq_len", "message"),
    [
        ([[(0, 0, 5)]], 8, r"seq_len=16 but was handed a packed batch of seq_len=8"),
        ([[(1, 0, 20)]], 16, r"piece 0 \(tokens 0:20 of sample 1\) is longer than seq_len=16"),
        ([[(0, 4, 2)]], 16, r"piece 0 \(tokens 4:2 of sample 0\) is empty"),
        ([[(1, 0, 12), (0, 0, 5)]], 16, r"row 0 .* holds 17 tokens, more than seq_len=16"),
    ],
)
def test_a_plan_that_does_not_fit_is_refused(corpus: HDF5Dataset, rows: Any, seq_len: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PackedSource(corpus, seq_len=SEQ_LEN, rows=1).read_batch(plan(rows, seq_len))


def test_what_is_not_a_packed_batch_is_refused(corpus: HDF5Dataset) -> None:
    with pytest.raises(ValueError, match="expected a packed batch"):
        PackedSource(corpus, seq_len=SEQ_LEN, rows=1).read_batch(np.array([0, 1, 2]))


def test_bad_options_and_datasets_fail_at_construction(corpus: HDF5Dataset) -> None:
    with pytest.raises(ValueError, match=r"seq_len=...\) must be an integer >= 1; got 0"):
        PackedSource(corpus, seq_len=0, rows=1)
    with pytest.raises(ValueError, match=r"rows=...\) must be an integer >= 1; got None"):
        PackedSource(corpus, seq_len=4, rows=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="needs a dataset with `lengths`"):
        PackedSource([{"ids": [1]}], seq_len=4, rows=1)
