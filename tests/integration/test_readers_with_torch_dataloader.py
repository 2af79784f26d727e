"""fastload's readers under torch's own DataLoader, with worker processes started by fork, spawn
and forkserver: every sample arrives exactly once and equals what was written.

Each reader is used in the parent before the loader starts, so that forked workers inherit open
handles and memory maps and must notice the new pid and open their own.
"""

from __future__ import annotations

import json
import multiprocessing
import pickle
from collections import Counter
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import ConcatDataset, DataLoader

from fastload import ArrowDataset, HDF5Dataset

SAMPLES_PER_FILE = 30
START_METHODS = [
    m for m in ("fork", "spawn", "forkserver") if m in multiprocessing.get_all_start_methods()
]


def _tokens(label: int) -> np.ndarray:
    """Sample ``label``'s token ids: derived from the label, so any mix-up shows."""
    return (np.arange(label % 9) + label * 100).astype(np.int32)


def _labels(base: int) -> list[int]:
    return list(range(base, base + SAMPLES_PER_FILE))


def _write_h5(path: Path, base: int, layout: str) -> Path:
    labels = _labels(base)
    tokens = [_tokens(label) for label in labels]
    with h5py.File(path, "w") as f:
        f["label"] = np.array(labels, np.int64)
        if layout == "vlen":
            dset = f.create_dataset("tokens", (len(labels),), dtype=h5py.vlen_dtype(np.int32))
            for i, t in enumerate(tokens):
                dset[i] = t
            return path
        storage = {"chunks": (8,), "compression": "gzip"} if layout == "chunked" else {}
        f.create_dataset("tokens/values", data=np.concatenate(tokens), **storage)
        f["tokens/offsets"] = np.concatenate([[0], np.cumsum([len(t) for t in tokens])])
    return path


def _table(base: int) -> pa.Table:
    labels = _labels(base)
    return pa.table(
        {
            "tokens": pa.array([_tokens(label).tolist() for label in labels], pa.list_(pa.int32())),
            "label": pa.array(labels, pa.int64()),
        }
    )


def _write_hf_folder(folder: Path, base: int) -> Path:
    folder.mkdir()
    table = _table(base)
    names = []
    for k, (start, stop) in enumerate([(0, 13), (13, SAMPLES_PER_FILE)]):
        name = f"data-{k:05d}-of-00002.arrow"
        with pa.ipc.new_stream(folder / name, table.schema) as writer:
            writer.write_table(table.slice(start, stop - start), max_chunksize=4)
        names.append(name)
    (folder / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": n} for n in names]})
    )
    (folder / "dataset_info.json").write_text(json.dumps({"features": {}}))
    return folder


@pytest.fixture(scope="module")
def readers(tmp_path_factory: pytest.TempPathFactory) -> list[HDF5Dataset | ArrowDataset]:
    root = tmp_path_factory.mktemp("readers")
    arrow_file = root / "e.arrow"
    with pa.ipc.new_file(arrow_file, _table(4000).schema) as writer:
        writer.write_table(_table(4000), max_chunksize=7)
    pq.write_table(_table(6000), root / "g.parquet", row_group_size=8)
    made: list[HDF5Dataset | ArrowDataset] = [
        HDF5Dataset(_write_h5(root / "a.h5", 1000, "contiguous")),
        HDF5Dataset(_write_h5(root / "b.h5", 2000, "chunked")),
        HDF5Dataset(_write_h5(root / "c.h5", 3000, "vlen")),
        ArrowDataset(arrow_file),
        ArrowDataset(_write_hf_folder(root / "f", 5000)),
        ArrowDataset(root / "g.parquet"),
    ]
    for ds in made:
        ds.read_batch([0, 5])  # open handles and maps in the parent before any fork
    return made


def _check_exactly_once(samples: list[dict[str, Any]], expected_labels: list[int]) -> None:
    counts = Counter(int(s["label"]) for s in samples)
    assert sorted(counts) == sorted(expected_labels)
    assert set(counts.values()) == {1}, [label for label, n in counts.items() if n > 1]
    for sample in samples:
        expected = _tokens(int(sample["label"]))
        np.testing.assert_array_equal(np.asarray(sample["tokens"]), expected)


@pytest.mark.parametrize(
    "start_method",
    # Spawned and forkserver workers import torch afresh (several seconds each on 2 cores),
    # so those cases run one loader over all readers at once.
    [m if m == "fork" else pytest.param(m, marks=pytest.mark.slow) for m in START_METHODS],
)
def test_every_sample_of_every_reader_arrives_once(
    readers: list[HDF5Dataset | ArrowDataset], start_method: str
) -> None:
    loader: DataLoader[dict[str, Any]] = DataLoader(
        ConcatDataset(readers),
        batch_size=None,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
        num_workers=2,
        multiprocessing_context=start_method,
        timeout=60,
    )
    samples = list(loader)
    assert isinstance(samples[0]["tokens"], torch.Tensor)
    _check_exactly_once(
        samples, [label for base in range(1000, 7000, 1000) for label in _labels(base)]
    )


def test_batches_read_through_getitems_arrive_once_for_every_reader(
    readers: list[HDF5Dataset | ArrowDataset],
) -> None:
    for ds in readers:
        base = int(ds[0]["label"])
        loader: DataLoader[dict[str, Any]] = DataLoader(
            ds,
            batch_size=7,
            shuffle=True,
            generator=torch.Generator().manual_seed(1),
            num_workers=2,
            multiprocessing_context="fork",
            collate_fn=list,  # keep the list of dicts __getitems__ returned
            timeout=60,
        )
        batches = list(loader)
        assert [len(b) for b in batches] == [7, 7, 7, 7, 2]
        _check_exactly_once([s for b in batches for s in b], _labels(base))


def test_a_pickled_reader_is_small_and_carries_no_handle(
    readers: list[HDF5Dataset | ArrowDataset],
) -> None:
    for ds in readers:
        data = pickle.dumps(ds)
        assert len(data) < 2500, (ds, len(data))
        assert b"h5py" not in data and b"pyarrow" not in data
