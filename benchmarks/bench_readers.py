"""How fast do the readers gather a random batch? ``read_batch`` against per-sample reads.

What it isolates: reading one batch of 64 random samples (variable-length int32 token ids,
lognormal lengths, median ~200 tokens) from a file already in the page cache, in one process,
no loader. Compared on the same data and the same index sets:

* ``HDF5Dataset.read_batch`` on the fastload layout, against per-sample h5py slicing of the same
  file (``[values[o[i]:o[i + 1]] for i in idx]``, offsets already in memory) and against an h5py
  variable-length dataset read per sample (``[dset[i] for i in idx]``, what most users have);
* ``ArrowDataset.read_batch`` on an Arrow IPC file (1,000-row record batches, as ``datasets``
  writes), against per-row pyarrow access on the memory-mapped table
  (``column[i].values.to_numpy()`` and ``column[i].as_py()``).

Every figure is the median time per batch over many index sets, and every ratio compares two
medians measured in this one run; every fast read is checked against its baseline's result.

Reproduce: ``.venv/bin/python -m pytest benchmarks/bench_readers.py -s -p no:cacheprovider
--size full`` (``--size smoke``, the default, runs in seconds so the benchmark never rots).
"""

from __future__ import annotations

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
SIZES = {"smoke": (5_000, 40, 10), "full": (200_000, 400, 60)}


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


def _median_s(read: Callable[[np.ndarray], Any], index_sets: list[np.ndarray]) -> float:
    read(index_sets[0])  # warm up: open files, fault in the index data
    times = []
    for indices in index_sets:
        start = time.perf_counter()
        read(indices)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _flatten(samples: list[Any]) -> np.ndarray:
    return np.concatenate([np.asarray(s, np.int32) for s in samples])


def _table(title: str, rows: list[tuple[str, float, str]]) -> str:
    header = ("read of 64 random samples", "median per batch", "fastload is")
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
        ("fastload", fastload.read_batch(check)["tokens"].values),
        ("vlen reader", vlen_reader.read_batch(check)["tokens"].values),
        ("arrow reader", arrow_reader.read_batch(check)["tokens"].values),
        ("vlen per sample", _flatten(per_sample_vlen(check))),
        ("arrow per row", _flatten(per_row_as_py(check))),
    ]:
        np.testing.assert_array_equal(got, expected, err_msg=name)

    fast_h5 = _median_s(fastload.read_batch, index_sets)
    fast_arrow = _median_s(arrow_reader.read_batch, index_sets)
    medians = {
        "HDF5Dataset.read_batch, fastload layout": fast_h5,
        "h5py per sample, fastload layout": _median_s(per_sample_h5py, slow),
        "h5py per sample, vlen dataset": _median_s(per_sample_vlen, slow),
        "HDF5Dataset.read_batch, vlen dataset": _median_s(vlen_reader.read_batch, slow),
        "ArrowDataset.read_batch, IPC file": fast_arrow,
        "pyarrow per row, column[i].values.to_numpy()": _median_s(per_row_numpy, slow),
        "pyarrow per row, column[i].as_py()": _median_s(per_row_as_py, slow),
    }
    h5.close()
    vlen.file.close()
    ratios = {
        name: seconds / (fast_arrow if "arrow" in name.lower() else fast_h5)
        for name, seconds in medians.items()
    }
    rows = [(name, seconds, f"{ratios[name]:.1f}x") for name, seconds in medians.items()]
    with capsys.disabled():
        print(
            _table(
                f"readers, {bench_size}: {samples:,} samples, {len(slow)}-{len(index_sets)} index sets",
                rows,
            )
        )
    benchmark.extra_info.update({f"{name} (us)": round(s * 1e6, 1) for name, s in medians.items()})
    benchmark.extra_info.update({f"{name} / fast": round(r, 2) for name, r in ratios.items()})
    benchmark.pedantic(fastload.read_batch, args=(index_sets[0],), rounds=20, iterations=1)
