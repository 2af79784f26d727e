"""Readers pickle as paths and options: small, without handles, reopened on first use."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
from _format_files import (
    Corpus,
    corpus_table,
    ragged,
    write_arrow_file,
    write_fastload,
    write_vlen,
)

from fastload import ArrowDataset, HDF5Dataset


def _readers(corpus: Corpus, tmp_path: Path) -> list[HDF5Dataset | ArrowDataset]:
    return [
        HDF5Dataset(write_fastload(tmp_path / "a.h5", corpus)),
        HDF5Dataset(write_vlen(tmp_path / "b.h5", corpus)),
        ArrowDataset(write_arrow_file(tmp_path / "c.arrow", corpus_table(corpus), 5)),
    ]


def test_pickles_are_small_and_hold_no_handle_even_after_reads(
    corpus: Corpus, tmp_path: Path
) -> None:
    indices = np.array([5, 1, 50, 5])
    for ds in _readers(corpus, tmp_path):
        before = pickle.dumps(ds)
        expected = ds.read_batch(indices)
        _ = ds.lengths
        after = pickle.dumps(ds)
        assert len(after) == len(before) < 2500, type(ds).__name__
        assert b"h5py" not in after and b"pyarrow" not in after
        clone = pickle.loads(after)
        batch = clone.read_batch(indices)
        np.testing.assert_array_equal(batch["label"], expected["label"])
        np.testing.assert_array_equal(
            ragged(batch["tokens"]).values, ragged(expected["tokens"]).values
        )
        np.testing.assert_array_equal(clone.lengths, ds.lengths)


def test_pickle_size_grows_only_by_file_names_with_many_shards(
    corpus: Corpus, tmp_path: Path
) -> None:
    paths = [
        write_fastload(tmp_path / f"part-{k:03d}.h5", corpus.slice(k, k + 1)) for k in range(30)
    ]
    one = len(pickle.dumps(HDF5Dataset(paths[:1])))
    many = len(pickle.dumps(HDF5Dataset(paths)))
    assert many - one < 29 * (len(str(paths[1])) + 40)


@pytest.mark.parametrize("index", [0, 1, 2])
def test_close_is_idempotent_and_the_next_read_reopens(
    corpus: Corpus, tmp_path: Path, index: int
) -> None:
    ds = _readers(corpus, tmp_path)[index]
    first = ds[3]
    ds.close()
    ds.close()
    again = ds[3]
    assert first.keys() == again.keys()
    assert again["label"] == first["label"]
    assert "HDF5Dataset" in repr(ds) or "ArrowDataset" in repr(ds)
