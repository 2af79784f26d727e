"""A cold local disk: the stall at a 10 ms step when the file's pages are not in the page cache,
with and without readahead hints (``ShardedDataset.willneed``).

What it isolates: ``fastload.DataLoader`` (2 workers, prefetch 2) over one HDF5 file in the
fastload layout (uint16 tokens, lengths 1..4,095), random batches of 32 samples (each sample a
random read of about 4 KB), a 10 ms sleep as the step. Three conditions, interleaved over rounds:

* ``warm``: the whole file read once before the run (every page resident);
* ``cold``: the file evicted before the run (``os.sync`` + ``posix_fadvise(DONTNEED)``, as
  ``fastload bench --cold`` does, again while ``mincore`` finds pages left; the most left is
  printed);
* ``cold+willneed``: evicted, then ``dataset.willneed(batch)`` for every batch of the run,
  in plan order, before iterating: the most any hinting can do, all at once;
* ``cold+readahead``: evicted, then ``DataLoader(readahead=True)``: each worker hints the
  batches queued behind the one it builds (``prefetch_factor`` ahead), as a user would run it.

Figures: the median stall (wait / (wait + step), the first batch excluded) of each condition and
its ratio to ``warm``'s; the time the hints took. How much a cold read costs depends on the
disk and on what sits under it (a VM's virtual disk may be cached by the host), so the ratios,
not the milliseconds, are what carries over.

Reproduce: ``.venv/bin/python -m pytest benchmarks/bench_cold.py -s -p no:cacheprovider --size
full`` (a 400 MB file; about two minutes). ``--size smoke``, the default, uses 32 MB and checks
only that the three conditions run. Linux only (``posix_fadvise``, ``mincore``).
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

import fastload
from fastload._apps._bench._cli import evict_files

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="posix_fadvise and mincore")

STEP_S = 0.010
BATCH = 32
SIZES = {"smoke": {"file_mb": 32, "batches": 40, "rounds": 1}, "full": {"file_mb": 400, "batches": 300, "rounds": 3}}


def write_corpus(path: Path, file_mb: int) -> Path:
    rng = np.random.default_rng(0)
    tokens = file_mb * (1 << 20) // 2
    lengths = rng.integers(1, 4096, tokens // 2048 + 1)
    lengths = lengths[: np.searchsorted(np.cumsum(lengths), tokens)]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    with h5py.File(path, "w") as f:
        f.attrs["fastload_format"] = 1
        values = f.create_dataset("tokens/values", (int(offsets[-1]),), np.uint16)
        step = 1 << 26
        for start in range(0, int(offsets[-1]), step):
            end = min(start + step, int(offsets[-1]))
            values[start:end] = rng.integers(1, 30_000, end - start, dtype=np.uint16)
        f.create_dataset("tokens/offsets", data=offsets)
    return path


def run(dataset: Any, batches: list[list[int]], readahead: bool = False) -> float:
    """The stall fraction of one pass over ``batches`` at a 10 ms step."""
    loader = fastload.DataLoader(
        dataset, batch_sampler=batches, num_workers=2, prefetch_factor=2,
        collate_fn=fastload.PadCollate(primary="tokens"), readahead=readahead,
    )
    wait_s = step_s = 0.0
    iterator = iter(loader)
    next(iterator)  # start-up, not stall
    for _ in range(len(batches) - 1):
        start = time.perf_counter()
        next(iterator)
        waited = time.perf_counter()
        time.sleep(STEP_S)
        wait_s += waited - start
        step_s += time.perf_counter() - waited
    assert next(iterator, None) is None  # the epoch ends: the workers go
    return wait_s / (wait_s + step_s)


def test_cold_disk_stall_with_and_without_readahead_hints(tmp_path: Path, bench_size: str) -> None:
    size = SIZES[bench_size]
    path = write_corpus(tmp_path / "cold.h5", size["file_mb"])
    dataset = fastload.HDF5Dataset(path)
    rng = np.random.default_rng(1)
    stalls: dict[str, list[float]] = {"warm": [], "cold": [], "cold+willneed": [], "cold+readahead": []}
    hint_s: list[float] = []
    left: list[int] = []
    for _ in range(size["rounds"]):
        batches = [rng.choice(len(dataset), BATCH, replace=False).tolist() for _ in range(size["batches"])]
        for condition in stalls:
            dataset.close()  # a mapped page cannot be evicted: no map of it may stay
            gc.collect()
            left_now = evict_files([str(path)])  # retries while the last run's workers exit
            if condition == "warm":
                path.read_bytes()
            else:
                left.append(left_now)
            if condition == "cold+willneed":
                start = time.perf_counter()
                advised = sum(dataset.willneed(batch) for batch in batches)
                hint_s.append(time.perf_counter() - start)
                assert advised > 0
            stalls[condition].append(run(dataset, batches, readahead=condition == "cold+readahead"))
    warm = float(np.median(stalls["warm"]))
    print(f"\ncold disk, {size['file_mb']} MB file, {size['batches']} batches of {BATCH} random samples,"
          f" 10 ms step, 2 workers, {size['rounds']} rounds (medians); resident after eviction:"
          f" {max(left) / 1e6:.2f} MB at most")
    for condition, values in stalls.items():
        median = float(np.median(values))
        ratio = median / warm if warm > 0 else float("inf")
        print(f"  {condition:<14} stall {median * 100:6.2f} %   x{ratio:.1f} of warm")
    print(f"  willneed of all {size['batches']} batches took {np.median(hint_s) * 1e3:.1f} ms (median)")
    assert all(0.0 <= s <= 1.0 for values in stalls.values() for s in values)
