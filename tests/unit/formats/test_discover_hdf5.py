"""An HDF5 shard described through aligned block reads: the same fields, length field and
lengths as the local reader finds, each block fetched once and neighbouring ones together."""

from __future__ import annotations

import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration"))
from _token_files import write_token_file

import fastload
from fastload._formats._discover_hdf5 import BLOCK_BYTES, BlockFile, describe_hdf5


class Reads:
    def __init__(self, path: Path) -> None:
        self.data = path.read_bytes()
        self.calls: list[tuple[int, int]] = []

    def __call__(self, offset: int, length: int) -> bytes:
        self.calls.append((offset, length))
        return self.data[offset : offset + length]


def test_described_as_the_local_reader_does_from_its_metadata_and_offsets(tmp_path: Path) -> None:
    path = write_token_file(tmp_path / "t.h5", 500, 4000, seed=2, label=True, names=True)
    reads = Reads(path)
    fields, length_field, lengths = describe_hdf5("s3://b/t.h5", reads, len(reads.data), "index it")
    local = fastload.HDF5Dataset([path])
    assert (fields, length_field) == (local.fields, local.length_field) and np.array_equal(lengths, local.lengths)
    fetched = sum(n for _, n in reads.calls)
    assert fetched < len(reads.data) / 4 and len({o for o, _ in reads.calls}) == len(reads.calls)


def test_blocks_are_fetched_once_and_neighbours_in_one_read(tmp_path: Path) -> None:
    path = tmp_path / "x.bin"
    path.write_bytes(bytes(range(256)) * (5 * BLOCK_BYTES // 256 + 7))
    reads = Reads(path)
    file = BlockFile(reads, len(reads.data))
    file.seek(BLOCK_BYTES - 10)
    assert file.read(3 * BLOCK_BYTES) == reads.data[BLOCK_BYTES - 10 : 4 * BLOCK_BYTES - 10]
    file.seek(2 * BLOCK_BYTES)
    assert file.read(100) == reads.data[2 * BLOCK_BYTES : 2 * BLOCK_BYTES + 100]
    file.seek(-5, 2)
    assert file.read(100) == reads.data[-5:]
    assert reads.calls == [(0, 4 * BLOCK_BYTES), (5 * BLOCK_BYTES, len(reads.data) - 5 * BLOCK_BYTES)]


def test_a_variable_length_field_needs_an_index(tmp_path: Path) -> None:
    with h5py.File(tmp_path / "v.h5", "w") as f:
        f.create_dataset("ids", data=[np.arange(3), np.arange(5)], dtype=h5py.vlen_dtype(np.int64))
    reads = Reads(tmp_path / "v.h5")
    with pytest.raises(FileNotFoundError, match=r"s3://b/v\.h5: ragged field 'ids' is a variable-length dataset.*; index it"):
        describe_hdf5("s3://b/v.h5", reads, len(reads.data), "index it")
