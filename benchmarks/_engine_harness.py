"""The loaders that ``bench_engine.py`` compares, all building the same batches.

Every loader turns the same batch plan (lists of 64 sample indices) over the same HDF5 file
into the same output: token ids padded to the batch maximum as an int64 ``[B, L]`` tensor plus
the lengths. Baselines are what users write today; ``fastload`` is ``fastload.DataLoader`` over
``fastload.HDF5Dataset`` with ``PadCollate``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import psutil
import torch
import torch.utils.data

import fastload
from fastload._types import Spans  # the in-place column fastload's readers give the fast path

BATCH = 64


def write_corpus(path: Path, samples: int, seed: int = 0) -> np.ndarray:
    """Lognormal lengths (median 200, sigma 0.75, clipped 8..2048), uint16 token ids, stored in
    the fastload layout and, for the typical baseline, as an h5py vlen dataset too."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(200), 0.75, samples), 8, 2048).astype(np.int64)
    offsets = np.zeros(samples + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = rng.integers(0, 32_000, int(offsets[-1]), dtype=np.uint16)
    with h5py.File(path, "w") as f:
        f.attrs["fastload_format"] = 1
        f.attrs["num_samples"] = samples
        f.create_dataset("tokens/values", data=values)
        f.create_dataset("tokens/offsets", data=offsets)
        f.create_dataset("lengths", data=lengths)
        vlen = f.create_dataset("vlen", (samples,), dtype=h5py.vlen_dtype(np.uint16))
        for start in range(0, samples, 10_000):
            stop = min(samples, start + 10_000)
            vlen[start:stop] = np.split(values[offsets[start] : offsets[stop]], offsets[start + 1 : stop] - offsets[start])
    return lengths


def batch_plan(samples: int, batches: int, seed: int = 1) -> list[list[int]]:
    order = np.random.default_rng(seed).permutation(samples)[: batches * BATCH]
    return [order[i : i + BATCH].tolist() for i in range(0, len(order), BATCH)]


def pad(rows: list[np.ndarray]) -> dict[str, torch.Tensor]:
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    out = np.zeros((len(rows), int(lengths.max())), dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return {"tokens": torch.from_numpy(out), "lengths": torch.from_numpy(lengths)}


class TypicalVlen(torch.utils.data.Dataset):
    """One h5py vlen read per ``__getitem__``: what most users have."""

    def __init__(self, path: Path) -> None:
        self.path, self._f = str(path), None

    def __len__(self) -> int:
        with h5py.File(self.path, "r") as f:
            return len(f["vlen"])

    def __getitem__(self, i: int) -> np.ndarray:
        if self._f is None:
            self._f = h5py.File(self.path, "r")
        return self._f["vlen"][i]


class FlatPerSample(TypicalVlen):
    """One slice of the flat values per ``__getitem__``."""

    def __getitem__(self, i: int) -> np.ndarray:
        if self._f is None:
            self._f = h5py.File(self.path, "r")
        lo, hi = self._f["tokens/offsets"][i : i + 2]
        return self._f["tokens/values"][lo:hi]


class MmapGather(torch.utils.data.Dataset):
    """A well-engineered ``__getitems__``: the whole batch gathered from a memory map."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self._values: np.ndarray | None = None
        with h5py.File(self.path, "r") as f:
            self.offsets = f["tokens/offsets"][:]
            self._offset = f["tokens/values"].id.get_offset()
            self._count = len(f["tokens/values"])

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitems__(self, idx: list[int]) -> dict[str, torch.Tensor]:
        if self._values is None:
            self._values = np.memmap(self.path, np.uint16, "r", self._offset, (self._count,))
        return pad([self._values[self.offsets[i] : self.offsets[i + 1]] for i in idx])


def _first(batch: Any) -> Any:
    return batch


def typical(path: Path, plan: list[list[int]], workers: int) -> Iterable[Any]:
    return torch.utils.data.DataLoader(TypicalVlen(path), batch_sampler=plan, num_workers=workers, collate_fn=pad)


def flat(path: Path, plan: list[list[int]], workers: int) -> Iterable[Any]:
    return torch.utils.data.DataLoader(FlatPerSample(path), batch_sampler=plan, num_workers=workers, collate_fn=pad)


def mmap_getitems(path: Path, plan: list[list[int]], workers: int) -> Iterable[Any]:
    return torch.utils.data.DataLoader(MmapGather(path), batch_sampler=plan, num_workers=workers, collate_fn=_first)


def fast(path: Path, plan: list[list[int]], workers: int, host_tuning: bool | None = None) -> Iterable[Any]:
    return fastload.DataLoader(
        fastload.HDF5Dataset(path, fields=["tokens"]),
        batch_sampler=plan,
        num_workers=workers,
        collate_fn=collate_fn(),
        host_tuning=host_tuning,
    )


def _in_ram(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with h5py.File(path, "r") as f:
        return f["tokens/values"][:], f["tokens/offsets"][:]


def in_ram_limit(path: Path, plan: list[list[int]]) -> Iterator[dict[str, torch.Tensor]]:
    """No loader at all: one process gathering from arrays already in RAM with the fastest kernel
    we have (fastload's own native kernel, which pads and casts in one pass from the samples
    where they lie), writing token ids, mask and lengths. The ceiling for one core.

    The arrays are read from the file here, before the caller's clock starts: the limit is the
    gather, not the file read."""
    values, offsets = _in_ram(path)
    lengths = np.diff(offsets)
    collate = collate_fn()

    def batches() -> Iterator[dict[str, torch.Tensor]]:
        for idx in plan:
            rows = np.asarray(idx)
            yield collate({"tokens": Spans(values, offsets[rows], lengths[rows])})

    return batches()


def in_ram_per_sample(path: Path, plan: list[list[int]]) -> Iterator[dict[str, torch.Tensor]]:
    """No loader, arrays in RAM (read before the clock starts), but the samples handed to
    ``PadCollate`` one dict each, as a ``collate_fn`` gets them from torch's DataLoader."""
    values, offsets = _in_ram(path)
    collate = collate_fn()

    def batches() -> Iterator[dict[str, torch.Tensor]]:
        for idx in plan:
            yield collate([{"tokens": values[offsets[i] : offsets[i + 1]]} for i in idx])

    return batches()


def collate_fn() -> fastload.PadCollate:
    """What every fastload configuration pads with: int64 ids (for an embedding), a bool mask."""
    return fastload.PadCollate(dtype=torch.int64, mask_dtype=torch.bool)


LOADERS: dict[str, Callable[[Path, list[list[int]], int], Iterable[Any]]] = {
    "typical": typical,
    "flat": flat,
    "mmap_getitems": mmap_getitems,
    "fastload": fast,
}


def checksum(batch: dict[str, torch.Tensor]) -> int:
    """Touches every byte of the batch, as a host-to-device copy would (numpy: one thread)."""
    return int(batch["tokens"].numpy().sum()) + int(batch["lengths"].numpy().sum())


def run(batches: Iterable[Any], step_s: float = 0.0) -> dict[str, float]:
    """Consume every batch, sleeping ``step_s`` per batch as a GPU step would (no CPU used).
    Returns samples/s (over the whole run, start-up included), steady samples/s (after the first
    batch), the stall fraction (time in ``next()`` / total), p99 wait, time to the first batch
    and a checksum of everything received."""
    waits: list[float] = []
    total = samples = 0
    start = time.perf_counter()
    it = iter(batches)
    first = 0.0
    first_size: int | None = None
    while True:
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        waits.append(time.perf_counter() - t0)
        if not first:
            first = time.perf_counter() - start
            first_size = len(batch["lengths"])
        samples += len(batch["lengths"])
        total += checksum(batch)
        del batch
        if step_s:
            time.sleep(step_s)
    elapsed = time.perf_counter() - start
    del it
    steady = waits[1:] or waits  # the first wait is start-up, reported separately
    first_samples = 0 if first_size is None else first_size
    return {
        "samples_per_s": samples / elapsed,
        "steady_samples_per_s": (samples - first_samples) / max(1e-9, elapsed - first),
        "stall": sum(steady) / max(1e-9, elapsed - waits[0]) if waits else 0.0,
        "p99_wait_ms": float(np.percentile(steady, 99) * 1e3) if steady else 0.0,
        "first_batch_s": first,
        "checksum": total,
    }


def stall_as_users_loop(batches: Iterable[Any], step_s: float) -> dict[str, float]:
    """The loop as users write it: ``for batch in loader: step(batch)``, the previous batch held
    through ``next()`` and let go as ``batch`` is rebound. The caller's clock runs around the
    rebinding assignment, so it counts ``next()`` and the release of the batch before; the step
    is a sleep. Returns the stall (that time over the time from the first batch to the last),
    the epoch's end (the ``next()`` that raised ``StopIteration``, once per epoch, apart, as
    the start-up is) and the checksum of every batch."""
    it = iter(batches)
    batch = next(it)  # start-up, reported apart
    total = checksum(batch)
    waited = 0.0
    first = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        try:
            batch = next(it)  # the previous batch dies here, inside the clock
        except StopIteration:
            end = time.perf_counter()
            break
        waited += time.perf_counter() - t0
        total += checksum(batch)
        time.sleep(step_s)
    del batch, it
    return {"stall": waited / max(1e-9, t0 - first), "end_s": end - t0, "checksum": total}


class PeakPss:
    """Samples the proportional set size of this process and its children every 20 ms."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        me = psutil.Process()
        while not self._stop.is_set():
            total = 0
            for p in [me, *me.children(recursive=True)]:
                with contextlib.suppress(psutil.Error, OSError):  # a child that just exited
                    total += p.memory_full_info().pss
            self.peak = max(self.peak, total)
            self._stop.wait(0.02)

    def __enter__(self) -> PeakPss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
