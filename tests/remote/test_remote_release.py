"""A remote dataset's loop that lets go early (a ``break``, an error) leaves nothing running:
the shard prefetcher's thread must not keep the iterator, and with it the engine's thread and
the workers, alive. Real shards served over HTTP, real workers."""

from __future__ import annotations

import gc
import sys
import threading
from pathlib import Path
from typing import Any

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from _procs import wait_until
from _token_files import write_token_file
from test_index_lengths import _doctored_folder

import fastload
from fastload._formats._indexing import build_index, write_index
from fastload.errors import DataFormatError


def _fastload_threads() -> list[str]:
    # The reaper is one thread per process, started with the first workers, kept for good.
    return [
        t.name
        for t in threading.enumerate()
        if t.name.startswith("fastload-") and t.name != "fastload-reaper"
    ]


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_loop_that_breaks_leaves_no_thread_and_no_worker(
    http_server: Any, tmp_path: Path, num_workers: int
) -> None:
    folder = http_server.root / "shards"
    folder.mkdir()
    for shard in range(2):
        write_token_file(folder / f"part-{shard}.h5", 64, 50, seed=shard)
    write_index(folder, build_index(folder))
    gc.collect()
    threads_before, children_before = _fastload_threads(), _children()

    def one_batch() -> list[int]:
        dataset = fastload.HDF5Dataset(
            f"{http_server.endpoint}/shards/", cache_dir=tmp_path / "cache"
        )
        loader = fastload.DataLoader(dataset, batch_size=8, num_workers=num_workers)
        batches = iter(loader)
        for _ in batches:
            break
        return list(getattr(batches, "worker_pids", []))

    pids = one_batch()
    assert len(pids) == num_workers
    gc.collect()
    assert wait_until(lambda: _fastload_threads() == threads_before, timeout_s=10), (
        _fastload_threads()
    )
    assert wait_until(lambda: not (set(pids) & _children()), timeout_s=10), (
        pids,
        _children() - children_before,
    )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_loop_ended_by_an_error_leaves_no_thread_and_no_worker(
    http_server: Any, tmp_path: Path, num_workers: int
) -> None:
    # The first batch fails (the index disagrees with a shard) while the prefetcher still waits
    # for the loop to use what it fetched: before, its thread kept the iterator, the engine's
    # thread and the workers alive for the rest of the process.
    _doctored_folder(http_server.root, "hdf5")
    gc.collect()
    threads_before = _fastload_threads()
    pids: list[int] = []

    def failing_epoch() -> None:
        dataset = fastload.HDF5Dataset(
            f"{http_server.endpoint}/hdf5/", cache_dir=tmp_path / "cache"
        )
        batches = iter(
            fastload.DataLoader(dataset, max_tokens=256, shuffle=False, num_workers=num_workers)
        )
        pids.extend(getattr(batches, "worker_pids", []))
        with pytest.raises(DataFormatError, match="index says"):
            for _ in batches:
                pass

    failing_epoch()
    gc.collect()
    assert wait_until(lambda: _fastload_threads() == threads_before, timeout_s=10), (
        _fastload_threads()
    )
    assert wait_until(lambda: not (set(pids) & _children()), timeout_s=10), pids
