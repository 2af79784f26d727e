"""How fast do the readers gather a random batch? ``read_batch`` against per-sample reads; and
how fast is a shuffled epoch over Parquet, read through its decoded copy, against Arrow IPC?

``test_read_batch_against_per_sample_reads`` isolates: reading one batch of 64 random samples (variable-length int32 token ids,
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

``test_shuffled_epoch_parquet_against_ipc`` isolates the Parquet path: one epoch of
``fastload.LengthGroupedBatchSampler`` batches of 64 (shuffled, length-grouped), padded by
``PadCollate``, through ``fastload.DataLoader`` with ``num_workers=0``, over the same token data
(the engine benchmark's distribution: lognormal lengths, median 200, uint16 ids) stored as one
Parquet file of 20 row groups and as one Arrow IPC file. It reports samples/s of an epoch over
IPC, over Parquet after the first pass (read through the decoded copy in the local cache), and
over Parquet without a copy (``cache_dir=False``, a few batches only: it is that slow), plus
the first pass itself: constructing the dataset with an empty cache, which decodes the file.
Medians over rounds in which the cases take turns; the files are in the page cache. An epoch is
timed in CPU time, like the batch reads above (with ``num_workers=0`` it runs on this one
thread); the first pass in wall-clock time too, since pyarrow decodes with several threads.

Reproduce: ``.venv/bin/python -m pytest benchmarks/bench_readers.py -s -p no:cacheprovider
--size full`` (``--size smoke``, the default, runs in seconds so the benchmark never rots).
"""

from __future__ import annotations

import gc
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import fastload
from fastload import ArrowDataset, HDF5Dataset

BATCH = 64
# samples in the file, index sets for fast readers, index sets for per-sample baselines
SIZES = {"smoke": (5_000, 40, 20), "full": (200_000, 400, 60)}
ROUNDS = 4
# samples, rounds (epochs of each case, first passes), batches read without the decoded copy
PARQUET_SIZES = {"smoke": (4_000, 2, 2), "full": (200_000, 9, 10)}
ROW_GROUPS = 20


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
    gc.freeze()  # the collections between blocks scan what the reads made, not the whole heap
    try:
        for round_ in range(rounds):
            for name, (read, count) in cases.items():
                for indices in index_sets[round_:count:rounds]:
                    start = time.process_time()
                    read(indices)
                    times[name].append(time.process_time() - start)
                gc.collect()
    finally:
        gc.unfreeze()
        gc.enable()
    return {name: float(np.median(t)) for name, t in times.items()}


def _flatten(samples: list[Any]) -> np.ndarray:
    return np.concatenate([np.asarray(s, np.int32) for s in samples])


def _values(column: Any) -> np.ndarray:
    """The concatenated values of a ragged column of a batch."""
    return np.asarray(column.values)


def _markdown(title: str, header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    cells = [header, *rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
        for row in cells
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join([f"\n{title}", *lines])


def _table(title: str, rows: list[tuple[str, float, str]]) -> str:
    header = ("read of 64 random samples", "median CPU time per batch", "vs fastload reader, same file")
    return _markdown(title, header, [(name, f"{seconds * 1e6:,.0f} us", ratio) for name, seconds, ratio in rows])


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


@pytest.fixture(scope="module")
def token_files(tmp_path_factory: pytest.TempPathFactory, bench_size: str) -> dict[str, Path]:
    samples = PARQUET_SIZES[bench_size][0]
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(200), 0.75, samples), 8, 2048).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    values = rng.integers(0, 32_000, int(offsets[-1]), dtype=np.uint16)
    table = pa.table({"tokens": pa.ListArray.from_arrays(offsets, values)})
    root = tmp_path_factory.mktemp("parquet")
    pq.write_table(table, root / "tokens.parquet", row_group_size=-(-samples // ROW_GROUPS))
    with pa.ipc.new_file(root / "tokens.arrow", table.schema) as writer:
        writer.write_table(table, max_chunksize=1000)
    return {"parquet": root / "tokens.parquet", "arrow": root / "tokens.arrow", "root": root}


def _epoch(ds: ArrowDataset, batches: list[list[int]]) -> tuple[float, list[torch.Tensor]]:
    """CPU seconds to load ``batches``, and the first two batches' padded tokens."""
    loader = fastload.DataLoader(
        ds, batch_sampler=batches, num_workers=0, collate_fn=fastload.PadCollate()
    )
    kept: list[torch.Tensor] = []
    start = time.process_time()
    for batch in loader:
        if len(kept) < 2:
            kept.append(batch["tokens"].clone())
    return time.process_time() - start, kept


def _rate_table(title: str, rows: list[tuple[str, str, str]]) -> str:
    return _markdown(title, ("case", "samples/s or seconds", "vs one epoch over Arrow IPC"), rows)


def test_shuffled_epoch_parquet_against_ipc(
    token_files: dict[str, Path],
    bench_size: str,
    benchmark: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    samples, rounds, uncached_batches = PARQUET_SIZES[bench_size]
    ipc = ArrowDataset(token_files["arrow"])
    plan = [list(b) for b in fastload.LengthGroupedBatchSampler(ipc.lengths, batch_size=BATCH)]
    first_pass: list[tuple[float, float]] = []  # (wall, CPU) seconds
    reuse: list[float] = []
    epochs: dict[str, list[float]] = {"ipc": [], "copy": []}
    parquet: ArrowDataset | None = None
    for round_ in range(rounds):
        if parquet is not None:
            parquet.close()
            shutil.rmtree(token_files["root"] / f"cache-{round_ - 1}")  # ~100 MB at full size
        cache = token_files["root"] / f"cache-{round_}"
        start, start_cpu = time.perf_counter(), time.process_time()
        parquet = ArrowDataset(token_files["parquet"], cache_dir=cache)  # decodes: empty cache
        first_pass.append((time.perf_counter() - start, time.process_time() - start_cpu))
        start = time.perf_counter()
        parquet = ArrowDataset(token_files["parquet"], cache_dir=cache)  # finds the copy
        reuse.append(time.perf_counter() - start)
        cases = {"ipc": ipc, "copy": parquet}
        order = ["ipc", "copy"] if round_ % 2 == 0 else ["copy", "ipc"]  # neither always first
        firsts: dict[str, list[torch.Tensor]] = {}
        for name in order:
            seconds, firsts[name] = _epoch(cases[name], plan)
            epochs[name].append(seconds)
        for a, b in zip(firsts["copy"], firsts["ipc"], strict=True):
            assert torch.equal(a, b)
    assert parquet is not None
    uncached = ArrowDataset(token_files["parquet"], cache_dir=False)
    seconds, got = _epoch(uncached, plan[:uncached_batches])
    assert all(torch.equal(a, b) for a, b in zip(got, firsts["ipc"], strict=True))
    uncached_rate = sum(len(b) for b in plan[:uncached_batches]) / seconds

    ipc_s, copy_s = float(np.median(epochs["ipc"])), float(np.median(epochs["copy"]))
    decode_s, decode_cpu_s = np.median(np.array(first_pass), axis=0).tolist()
    reuse_s = float(np.median(reuse))
    ratio = ipc_s / copy_s  # samples/s of Parquet-after-first-pass over samples/s of IPC
    size_mb = token_files["parquet"].stat().st_size / 1e6
    rows = [
        ("Arrow IPC file, epoch", f"{samples / ipc_s:,.0f} samples/s", "1.00x"),
        (
            "Parquet via its decoded copy, epoch",
            f"{samples / copy_s:,.0f} samples/s",
            f"{ratio:.2f}x",
        ),
        (
            f"Parquet, cache_dir=False, {uncached_batches} batches",
            f"{uncached_rate:,.0f} samples/s",
            f"{uncached_rate * ipc_s / samples:.4f}x",
        ),
        (
            "first pass: construction decoding the file",
            f"{decode_s:.2f} s wall, {decode_cpu_s:.2f} s CPU",
            f"{decode_cpu_s / ipc_s:.1f} epochs (CPU)",
        ),
        (
            "later construction, copy found",
            f"{reuse_s * 1e3:.1f} ms",
            f"{reuse_s / ipc_s:.3f} epochs",
        ),
    ]
    title = (
        f"parquet, {bench_size}: {samples:,} samples, Parquet {size_mb:.0f} MB in {ROW_GROUPS}"
        f" row groups, {len(plan):,} batches of {BATCH}, {rounds} rounds"
    )
    with capsys.disabled():
        print(_rate_table(title, rows))
    benchmark.extra_info.update(
        {
            "ipc samples/s": round(samples / ipc_s),
            "parquet copy samples/s": round(samples / copy_s),
            "parquet copy / ipc": round(ratio, 3),
            "parquet without copy samples/s": round(uncached_rate, 1),
            "first pass, wall (s)": round(decode_s, 3),
            "first pass, CPU (s)": round(decode_cpu_s, 3),
            "first pass CPU / ipc epoch": round(decode_cpu_s / ipc_s, 2),
        }
    )
    if bench_size == "full":
        assert ratio >= 1 / 1.5, f"Parquet after the first pass runs at {ratio:.2f}x IPC"
    benchmark.pedantic(parquet.read_batch, args=(plan[0],), rounds=20, iterations=1)
