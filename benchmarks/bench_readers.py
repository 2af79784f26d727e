"""How fast do the readers gather a random batch? ``read_batch`` against per-sample reads.

What it isolates: reading one batch of 64 random samples (variable-length int32 token ids,
lognormal lengths, median ~200 tokens) from a file already in the page cache, in one process,
no loader. Compared on the same data and the same index sets:

* ``HDF5Dataset.read_batch`` on the fastload layout, against per-sample h5py slicing of the same
  file (``[values[o[i]:o[i + 1]] for i in idx]``, offsets already in memory) and against an h5py
  variable-length dataset read per sample (``[dset[i] for i in idx]``, what most users have).
  Both readers are also timed reading each batch a second time: the first read of a page of a
  memory map costs a page fault, and the vlen reader parses each global-heap collection the
  first time a batch touches it (both are cached for the rest of the process's life);
* ``ArrowDataset.read_batch`` on an Arrow IPC file (1,000-row record batches, as ``datasets``
  writes), against per-row pyarrow access on the memory-mapped table
  (``column[i].values.to_numpy()`` and ``column[i].as_py()``).

Every figure is the median CPU time per batch over many index sets, each reader reading its
sets back to back in rounds and the readers taking turns between rounds; every ratio compares
two medians measured in this one run, and every fast read is checked against its baseline.

Reproduce: ``.venv/bin/python -m pytest benchmarks/bench_readers.py -s -p no:cacheprovider
--size full`` (``--size smoke``, the default, runs in seconds so the benchmark never rots).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pyarrow as pa
import pytest

from fastload import ArrowDataset, HDF5Dataset

BATCH = 64
# samples in the file, index sets for fast readers, index sets for per-sample baselines
SIZES = {"smoke": (5_000, 40, 20), "full": (200_000, 400, 60)}
ROUNDS = 4


def _tokens(samples: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(200), 0.6, samples), 1, 4096).astype(np.int64)
    flat = rng.integers(0, 50_000, int(lengths.sum()), dtype=np.int32)
    return np.split(flat, np.cumsum(lengths)[:-1])


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, bench_size: str) -> dict[str, Path]:
    samples = SIZES[bench_size][0]
    tokens = _tokens(samples)
    root = tmp_path_factory.mktemp("readers")
    offsets = np.concatenate([[0], np.cumsum([len(t) for t in tokens])]).astype(np.int64)
    with h5py.File(root / "fastload.h5", "w") as f:
        f.attrs["fastload_format"] = 1
        f.attrs["num_samples"] = samples
        f["tokens/values"] = np.concatenate(tokens)
        f["tokens/offsets"] = offsets
        f["lengths"] = np.diff(offsets)
    with h5py.File(root / "vlen.h5", "w") as f:
        dset = f.create_dataset("tokens", (samples,), dtype=h5py.vlen_dtype(np.int32))
        column = np.empty(samples, object)
        column[:] = tokens
        dset[...] = column
    table = pa.table({"tokens": pa.array(tokens, pa.list_(pa.int32()))})
    with pa.ipc.new_file(root / "data.arrow", table.schema) as writer:
        writer.write_table(table, max_chunksize=1000)
    return {
        "fastload": root / "fastload.h5",
        "vlen": root / "vlen.h5",
        "arrow": root / "data.arrow",
    }


Read = Callable[[np.ndarray], Any]


def _medians(
    cases: dict[str, tuple[Read, int]], index_sets: list[np.ndarray], rounds: int
) -> dict[str, float]:
    """Median CPU seconds per call of each case, ``cases[name] = (read, how many index sets)``.

    Each case reads its index sets back to back, as a loader's worker does, so caches hold what
    that reader keeps warm in real use; the cases take turns in ``rounds`` rounds, each reading
    every ``rounds``-th set, so that a drift in the machine's load reaches every case. CPU time,
    not wall time: other processes competing for the 2 cores would otherwise add their time
    slices to whichever read they interrupted (the files are in the page cache, so no read
    waits on the disk). The garbage collector runs between blocks, not inside them.
    """
    for read, _ in cases.values():
        read(index_sets[0])  # warm up: open files, map them, fault in the index data
    times: dict[str, list[float]] = {name: [] for name in cases}
    gc.disable()  # as timeit does: a collection would land on whichever read triggered it
    try:
        for round_ in range(rounds):
            for name, (read, count) in cases.items():
                for indices in index_sets[round_:count:rounds]:
                    start = time.process_time()
                    read(indices)
                    times[name].append(time.process_time() - start)
                gc.collect()
    finally:
        gc.enable()
    return {name: float(np.median(t)) for name, t in times.items()}


def _flatten(samples: list[Any]) -> np.ndarray:
    return np.concatenate([np.asarray(s, np.int32) for s in samples])


def _values(column: Any) -> np.ndarray:
    """The concatenated values of a ragged column of a batch."""
    return np.asarray(column.values)


def _table(title: str, rows: list[tuple[str, float, str]]) -> str:
    header = (
        "read of 64 random samples",
        "median CPU time per batch",
        "vs fastload reader, same file",
    )
    cells = [header, *[(name, f"{seconds * 1e6:,.0f} us", ratio) for name, seconds, ratio in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(3)]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
        for row in cells
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join([f"\n{title}", *lines])


def test_read_batch_against_per_sample_reads(
    files: dict[str, Path], bench_size: str, benchmark: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    samples, fast_sets, slow_sets = SIZES[bench_size]
    rng = np.random.default_rng(1)
    index_sets = [rng.integers(0, samples, BATCH) for _ in range(fast_sets)]
    slow = index_sets[:slow_sets]

    fastload = HDF5Dataset(files["fastload"], fields=["tokens"])
    vlen_reader = HDF5Dataset(files["vlen"])
    arrow_reader = ArrowDataset(files["arrow"])
    h5 = h5py.File(files["fastload"], "r", locking=False)
    values, offsets = h5["tokens/values"], h5["tokens/offsets"][...]
    vlen = h5py.File(files["vlen"], "r", locking=False)["tokens"]
    column = pa.ipc.open_file(pa.memory_map(str(files["arrow"]))).read_all().column("tokens")

    def per_sample_h5py(idx: np.ndarray) -> list[np.ndarray]:
        return [values[offsets[i] : offsets[i + 1]] for i in idx]

    def per_sample_vlen(idx: np.ndarray) -> list[np.ndarray]:
        return [vlen[i] for i in idx]

    def per_row_numpy(idx: np.ndarray) -> list[np.ndarray]:
        return [column[int(i)].values.to_numpy() for i in idx]

    def per_row_as_py(idx: np.ndarray) -> list[list[int]]:
        return [column[int(i)].as_py() for i in idx]

    check = index_sets[0]
    expected = _flatten(per_sample_h5py(check))
    for name, got in [
        ("fastload", _values(fastload.read_batch(check)["tokens"])),
        ("vlen reader", _values(vlen_reader.read_batch(check)["tokens"])),
        ("arrow reader", _values(arrow_reader.read_batch(check)["tokens"])),
        ("vlen per sample", _flatten(per_sample_vlen(check))),
        ("arrow per row", _flatten(per_row_as_py(check))),
    ]:
        np.testing.assert_array_equal(got, expected, err_msg=name)

    fast_h5 = "HDF5Dataset.read_batch, fastload layout"
    fast_vlen = "HDF5Dataset.read_batch, vlen dataset"
    fast_arrow = "ArrowDataset.read_batch, IPC file"
    many, few = len(index_sets), len(slow)

    def fastload_again(idx: np.ndarray) -> Any:
        # Runs right after the first-pass case read the same sets: their pages are mapped into
        # this process (a first touch costs a page fault, ~20 us in a VM, per 16 pages).
        return fastload.read_batch(idx)

    def vlen_again(idx: np.ndarray) -> Any:
        # Likewise, and the heap collections of these samples are parsed and cached.
        return vlen_reader.read_batch(idx)

    # name: (what is timed, on how many index sets, the fast read of the same file)
    cases: dict[str, tuple[Read, int, str]] = {
        fast_h5: (fastload.read_batch, many, fast_h5),
        f"{fast_h5}, batch read again": (fastload_again, many, fast_h5),
        "h5py per sample, fastload layout": (per_sample_h5py, few, fast_h5),
        fast_vlen: (vlen_reader.read_batch, many, fast_vlen),
        f"{fast_vlen}, batch read again": (vlen_again, many, fast_vlen),
        "h5py per sample, vlen dataset": (per_sample_vlen, few, fast_vlen),
        fast_arrow: (arrow_reader.read_batch, many, fast_arrow),
        "pyarrow per row, column[i].values.to_numpy()": (per_row_numpy, few, fast_arrow),
        "pyarrow per row, column[i].as_py()": (per_row_as_py, few, fast_arrow),
    }
    medians = _medians(
        {name: (read, count) for name, (read, count, _) in cases.items()}, index_sets, ROUNDS
    )
    h5.close()
    vlen.file.close()
    ratios = {name: medians[name] / medians[cases[name][2]] for name in cases}
    rows = [(name, medians[name], f"{ratios[name]:.1f}x") for name in cases]
    typical = medians["h5py per sample, vlen dataset"] / medians[fast_h5]
    title = f"readers, {bench_size}: {samples:,} samples, {len(slow)}-{len(index_sets)} index sets"
    with capsys.disabled():
        print(_table(title, rows))
        print(
            f"h5py per sample on a vlen dataset / read_batch on the fastload layout: {typical:.0f}x"
        )
    benchmark.extra_info.update({f"{name} (us)": round(s * 1e6, 1) for name, s in medians.items()})
    benchmark.extra_info.update(
        {f"{name} / same-file reader": round(r, 2) for name, r in ratios.items()}
    )
    benchmark.pedantic(fastload.read_batch, args=(index_sets[0],), rounds=20, iterations=1)
