"""PadCollate as a collate_fn on lists of sample dicts, down to a real HDF5 file read through
torch's DataLoader with a LengthGroupedBatchSampler."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch
import torch.utils.data

from fastload import HDF5Dataset, LengthGroupedBatchSampler, PadCollate
from fastload.errors import DataFormatError


def test_lists_arrays_and_tensors_of_ints_are_ragged_and_scalars_fixed() -> None:
    samples = [
        {"ids": [1, 2, 3], "label": 0, "score": np.float32(0.5), "text": "a"},
        {"ids": np.array([4], dtype=np.int64), "label": 1, "score": np.float32(1.5), "text": "b"},
        {"ids": torch.tensor([5, 6]), "label": 2, "score": np.float32(2.5), "text": "c"},
    ]
    out = PadCollate(pad_value=-1)(samples)
    assert out["ids"].tolist() == [[1, 2, 3], [4, -1, -1], [5, 6, -1]]
    assert out["lengths"].tolist() == [3, 1, 2]
    assert out["label"].tolist() == [0, 1, 2]
    assert out["score"].dtype == torch.float32
    assert out["text"] == ["a", "b", "c"]


def test_an_empty_python_list_does_not_turn_token_ids_into_floats() -> None:
    out = PadCollate()([{"ids": []}, {"ids": [7, 8]}])
    assert out["ids"].dtype == torch.int64
    assert out["ids"].tolist() == [[0, 0], [7, 8]]


def test_ragged_names_fields_whose_elements_have_a_shape_and_fixed_vectors() -> None:
    samples = [
        {"frames": np.ones((n, 3), np.float32), "emb": np.full(4, n, np.float32)} for n in (2, 5)
    ]
    out = PadCollate(ragged=["frames"])(samples)
    assert out["frames"].shape == (2, 5, 3)
    assert out["emb"].shape == (2, 4)  # stacked, not padded
    assert out["lengths"].tolist() == [2, 5]
    assert "emb_lengths" not in out


def test_by_default_a_multi_dimensional_ragged_field_asks_for_ragged() -> None:
    samples = [{"frames": np.ones((n, 3), np.float32)} for n in (2, 5)]
    with pytest.raises(
        DataFormatError, match=r"'frames' is fixed-shape.*\(2, 3\).*\(5, 3\).*ragged="
    ):
        PadCollate()(samples)


@pytest.mark.parametrize(
    ("samples", "error", "words"),
    [
        ([], ValueError, ["empty"]),
        ([{"a": [1]}, {"b": [1]}], DataFormatError, ["sample 1", "['b']", "['a']"]),
        ([{"a": [1]}, [1]], TypeError, ["sample 1", "list"]),
    ],
)
def test_malformed_sample_lists_are_rejected(
    samples: list[Any], error: type[Exception], words: list[str]
) -> None:
    with pytest.raises(error) as caught:
        PadCollate()(samples)
    for word in words:
        assert word in str(caught.value)


def test_rows_of_a_ragged_field_with_different_element_shapes_are_rejected() -> None:
    samples = [{"x": np.ones((2, 3))}, {"x": np.ones((2, 4))}]
    with pytest.raises(DataFormatError, match="'x': the elements of its rows differ in shape"):
        PadCollate(ragged=["x"])(samples)


def write_corpus(path: Path, count: int) -> list[np.ndarray]:
    """A fastload-layout HDF5 file: ragged int32 tokens, an int64 label per sample."""
    rng = np.random.default_rng(0)
    tokens = [rng.integers(1, 1000, n).astype(np.int32) for n in rng.integers(0, 40, count)]
    offsets = np.concatenate([[0], np.cumsum([len(t) for t in tokens])]).astype(np.int64)
    with h5py.File(path, "w") as f:
        f.attrs["fastload_format"] = 1
        f.attrs["num_samples"] = count
        f.create_dataset("tokens/values", data=np.concatenate(tokens))
        f.create_dataset("tokens/offsets", data=offsets)
        f.create_dataset("label", data=np.arange(count, dtype=np.int64))
        f.create_dataset("lengths", data=np.diff(offsets))
    return tokens


def test_a_torch_dataloader_over_hdf5_pads_length_grouped_batches(tmp_path: Path) -> None:
    tokens = write_corpus(tmp_path / "corpus.h5", 300)
    dataset = HDF5Dataset(tmp_path / "corpus.h5")
    sampler = LengthGroupedBatchSampler(dataset.lengths, max_tokens=256, seed=1)
    collate = PadCollate(dtype=torch.int64, ragged=dataset.fields)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate)
    seen = []
    for batch, indices in zip(loader, sampler, strict=True):
        assert batch["label"].tolist() == indices
        assert batch["tokens"].numel() <= 256
        for row, index in enumerate(indices):
            n = len(tokens[index])
            assert batch["tokens"][row, :n].tolist() == tokens[index].tolist()
            assert batch["attention_mask"][row].sum().item() == n
        # The columnar path gives the same tensors as the list-of-dicts path.
        columnar = collate(dataset.read_batch(indices))
        assert all(torch.equal(columnar[k], batch[k]) for k in batch)
        seen += indices
    assert sorted(seen) == list(range(300))


def test_pad_collate_survives_pickling_for_worker_processes() -> None:
    collate = PadCollate(pad_value={"ids": -1}, dtype=torch.int64, ragged=["ids"], max_length=2)
    samples = [{"ids": [1, 2, 3]}, {"ids": [4]}]
    expected = collate(samples)  # also fills the per-field check cache that travels along
    clone = pickle.loads(pickle.dumps(collate))
    got = clone(samples)
    assert all(torch.equal(got[name], expected[name]) for name in expected)
    assert got["ids"].tolist() == [[1, 2], [4, -1]]
