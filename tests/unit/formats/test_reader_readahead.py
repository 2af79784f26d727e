"""``ShardedDataset.willneed``: the byte ranges of the samples asked for are advised, page
aligned and merged, and a cold file's pages become resident (checked with ``mincore``); nothing
is advised where the ranges are unknown; hinting in the main process opens no HDF5 file."""

from __future__ import annotations

import mmap
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

import fastload
from fastload._apps._bench._pagecache import evict, resident_pages
from fastload._formats._readahead import coalesce_ranges

PAGE = mmap.PAGESIZE
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore is Linux's")


def _pages(starts: list[int], lengths: list[int]) -> set[int]:
    """The pages covering the byte ranges, counted one by one (independent of the code under
    test, which works on whole ranges)."""
    return {p for s, n in zip(starts, lengths, strict=True) if n for p in range(s // PAGE, (s + n - 1) // PAGE + 1)}


def _resident_soon(path: Path, pages: set[int], timeout_s: float = 5.0) -> np.ndarray:
    """The file's resident pages once every one of ``pages`` is in (the advice reads
    asynchronously), or at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        resident = resident_pages(str(path))
        assert resident is not None
        if all(resident[sorted(pages)]) or time.monotonic() > deadline:
            return resident
        time.sleep(0.01)


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3,000 samples of 1..3,999 uint16 tokens (about 12 MB) in the fastload layout, and an
    int64 label per sample."""
    path = tmp_path_factory.mktemp("readahead") / "tokens.h5"
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 4000, 3000)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    with h5py.File(path, "w") as f:
        f.attrs["fastload_format"] = 1
        f.create_dataset("tokens/values", data=rng.integers(0, 30_000, int(offsets[-1])).astype(np.uint16))
        f.create_dataset("tokens/offsets", data=offsets)
        f.create_dataset("label", data=rng.integers(0, 5, 3000).astype(np.int64))
    return path


def _h5_payload_pages(path: Path, rows: np.ndarray) -> set[int]:
    with h5py.File(path, "r") as f:
        values, offsets, label = f["tokens/values"], f["tokens/offsets"][...], f["label"]
        base, label_base = values.id.get_offset(), label.id.get_offset()
    starts = [base + 2 * int(offsets[r]) for r in rows] + [label_base + 8 * int(r) for r in rows]
    lengths = [2 * int(offsets[r + 1] - offsets[r]) for r in rows] + [8] * len(rows)
    return _pages(starts, lengths)


@linux_only
def test_willneed_makes_the_samples_pages_of_a_cold_hdf5_file_resident(token_file: Path) -> None:
    dataset = fastload.HDF5Dataset(token_file)
    rows = np.random.default_rng(1).choice(len(dataset), 40, replace=False)
    expected = _h5_payload_pages(token_file, rows)
    evict([str(token_file)])
    before = resident_pages(str(token_file))
    assert before is not None and not before[sorted(expected)].any()  # cold to begin with
    advised = dataset.willneed(rows)
    assert advised == len(expected) * PAGE
    resident = _resident_soon(token_file, expected)
    assert resident[sorted(expected)].all()
    # Only the samples came in, not the file: the offsets, read to find them, lie at its end,
    # and the kernel reads around them (up to the device's read-ahead, 8 MB here), so only the
    # first half of the file, all values, shows this.
    half = resident.size // 2
    assert set(np.flatnonzero(resident[:half]).tolist()) == {p for p in expected if p < half}


def test_willneed_merges_duplicates_and_neighbours_and_counts_pages(token_file: Path) -> None:
    dataset = fastload.HDF5Dataset(token_file)
    rows = np.array([5, 6, 7, 5, -1, 6])
    expected = _h5_payload_pages(token_file, rows % len(dataset))
    assert dataset.willneed(rows) == len(expected) * PAGE
    assert dataset.willneed([]) == 0
    with pytest.raises(IndexError):
        dataset.willneed([len(dataset)])


def test_willneed_in_the_main_process_opens_no_hdf5_file_and_changes_no_read(token_file: Path) -> None:
    dataset = fastload.HDF5Dataset(token_file)
    open_files = h5py.h5f.get_obj_count(h5py.h5f.OBJ_ALL, h5py.h5f.OBJ_FILE)
    assert dataset.willneed(np.arange(100)) > 0
    assert h5py.h5f.get_obj_count(h5py.h5f.OBJ_ALL, h5py.h5f.OBJ_FILE) == open_files
    rows = np.array([3, 2999, 17])
    got, expected = dataset.read_batch(rows), fastload.HDF5Dataset(token_file).read_batch(rows)
    assert np.array_equal(got["tokens"].values, expected["tokens"].values)
    assert np.array_equal(got["label"], expected["label"])


def test_willneed_advises_each_shard_of_a_sharded_dataset(tmp_path: Path, token_file: Path) -> None:
    second = tmp_path / "second.h5"
    second.write_bytes(token_file.read_bytes())
    dataset = fastload.HDF5Dataset([token_file, second])
    one = fastload.HDF5Dataset(token_file)
    rows = np.array([10, 3000 + 10, 11])
    assert dataset.willneed(rows) == one.willneed([10, 11]) + one.willneed([10])


def test_a_chunked_compressed_hdf5_file_is_not_advised(tmp_path: Path) -> None:
    """Chunked and compressed data has no fixed place per sample: willneed skips it (0)."""
    path = tmp_path / "chunked.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=np.arange(10_000, dtype=np.float32).reshape(1000, 10), chunks=(100, 10), compression="gzip")
    dataset = fastload.HDF5Dataset(path)
    assert dataset.willneed(np.arange(50)) == 0
    assert np.array_equal(dataset.read_batch([3])["x"][0], np.arange(30, 40, dtype=np.float32))


@pytest.fixture(scope="module")
def arrow_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2,000 samples of int32 token lists and an int64 label, in three record batches of an
    uncompressed Arrow IPC file (about 8 MB)."""
    path = tmp_path_factory.mktemp("readahead") / "tokens.arrow"
    rng = np.random.default_rng(2)
    lengths = rng.integers(1, 2000, 2000)
    tokens = [rng.integers(0, 30_000, n).astype(np.int32) for n in lengths]
    table = pa.table({"tokens": pa.array(tokens, pa.list_(pa.int32())), "label": pa.array(rng.integers(0, 5, 2000))})
    with ipc.new_file(str(path), table.schema) as writer:
        for batch in table.to_batches(max_chunksize=700):
            writer.write_batch(batch)
    return path


def _arrow_payload_pages(path: Path, rows: np.ndarray) -> set[int]:
    """From pyarrow's own buffers of each record batch: where each row's values lie."""
    source = pa.memory_map(str(path))
    reader = ipc.open_file(source)
    whole = source.read_buffer()
    starts, lengths, first = [], [], 0
    for b in range(reader.num_record_batches):
        batch = reader.get_batch(b)
        tokens, label = batch.column("tokens"), batch.column("label")
        offsets = np.frombuffer(tokens.buffers()[1], np.int32)[tokens.offset :]
        values_at = tokens.buffers()[3].address - whole.address
        label_at = label.buffers()[1].address - whole.address
        for r in rows[(rows >= first) & (rows < first + batch.num_rows)] - first:
            starts += [values_at + 4 * int(offsets[r]), label_at + 8 * (label.offset + int(r))]
            lengths += [4 * int(offsets[r + 1] - offsets[r]), 8]
        first += batch.num_rows
    return _pages(starts, lengths)


@linux_only
def test_willneed_makes_the_samples_pages_of_a_cold_arrow_file_resident(arrow_file: Path) -> None:
    dataset = fastload.ArrowDataset(arrow_file)
    rows = np.random.default_rng(3).choice(len(dataset), 30, replace=False)
    expected = _arrow_payload_pages(arrow_file, rows)
    evict([str(arrow_file)])
    before = resident_pages(str(arrow_file))
    assert before is not None and not before[sorted(expected)].any()
    assert dataset.willneed(rows) == len(expected) * PAGE
    # (Which other pages come in depends on the device's read-around of the list offsets,
    # which lie between the values of each record batch.)
    assert _resident_soon(arrow_file, expected)[sorted(expected)].all()


def test_arrow_fields_that_arrow_reads_itself_are_not_advised(tmp_path: Path) -> None:
    path = tmp_path / "names.arrow"
    table = pa.table({"name": pa.array([f"sample {i}" for i in range(100)])})
    with ipc.new_file(str(path), table.schema) as writer:
        writer.write_table(table)
    assert fastload.ArrowDataset(path).willneed(np.arange(100)) == 0


def test_coalescing_widens_to_pages_merges_touching_ranges_and_keeps_the_earliest() -> None:
    starts = np.array([10 * PAGE + 5, 0, PAGE - 1, 3 * PAGE, 10 * PAGE], np.int64)
    lengths = np.array([10, 1, 2, 0, 1], np.int64)  # the empty one is dropped
    got_starts, got_lengths, rank = coalesce_ranges(starts, lengths, np.arange(5, dtype=np.int64))
    # [0, 1) and [PAGE - 1, PAGE + 1) touch after widening: pages 0-1; the two at page 10 merge.
    assert got_starts.tolist() == [0, 10 * PAGE]
    assert got_lengths.tolist() == [2 * PAGE, PAGE]
    assert rank.tolist() == [1, 0]
    capped = coalesce_ranges(
        np.arange(5, dtype=np.int64) * 4 * PAGE, np.ones(5, np.int64), np.array([4, 0, 3, 1, 2]), max_ranges=2
    )
    assert capped[0].tolist() == [4 * PAGE, 12 * PAGE]  # priorities 0 and 1, in file order
