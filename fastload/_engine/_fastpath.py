"""The fast path: workers write whole padded batches into shared-memory slots.

Taken when the dataset offers ``read_batch`` and ``lengths`` (the ``BatchReader`` protocol) and
the collation is a ``PadCollate``. A task's index is a :class:`SlotTask` (sample indices plus the
slot reserved for the batch). The worker reads the samples in one call, asks the collate for the
output layout, and pads straight into the slot; it sends back only a :class:`SlotBatch`
descriptor (names, offsets, shapes, dtypes). The main process wraps the slot in tensors without
copying; the slot returns to the arena when the last of those tensors is garbage-collected.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fastload._engine._arena import SlotArena, SlotRef, WorkerSlots, align
from fastload._types import Spans


@dataclass(frozen=True)
class SlotTask:
    indices: np.ndarray  # int64 sample indices of the batch
    slot: SlotRef

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self) -> Any:
        return iter(self.indices.tolist())

    def __reduce__(self) -> Any:
        # Sent once per batch: raw bytes and a plain tuple pickle several times faster than an
        # ndarray and a dataclass.
        s = self.slot
        return _slot_task, (self.indices.tobytes(), s.segment, s.fd, s.size, s.offset, s.capacity, s.temporary)


def _slot_task(indices: bytes, *slot: Any) -> SlotTask:
    return SlotTask(np.frombuffer(indices, dtype=np.int64), SlotRef(*slot))


@dataclass(frozen=True)
class SlotBatch:
    """Where each output array lies in the slot: ``arrays[name] = (offset, shape, dtype str)``;
    ``objects`` carries object fields (strings) by value; ``nbytes`` is the slot bytes used."""

    arrays: dict[str, tuple[int, tuple[int, ...], str]]
    objects: dict[str, Any]
    nbytes: int


@dataclass(frozen=True)
class Oversize:
    """The batch needs ``nbytes``, more than its slot holds: build it again in a bigger slot."""

    nbytes: int


def plan_layout(layout: dict[str, tuple[tuple[int, ...], np.dtype]]) -> tuple[dict[str, tuple[int, tuple[int, ...], str]], int]:
    """Byte offsets for each output array, each aligned, and the total size."""
    arrays: dict[str, tuple[int, tuple[int, ...], str]] = {}
    offset = 0
    for name, (shape, dtype) in layout.items():
        dt = np.dtype(dtype)
        arrays[name] = (offset, tuple(int(d) for d in shape), dt.str)
        offset = align(offset + math.prod(shape) * dt.itemsize)
    return arrays, offset


class SlotBuilder:
    """Runs in a worker: builds one batch into its slot (the worker's ``fetcher``)."""

    def __init__(self, dataset: Any, collate: Any, main_pid: int) -> None:
        self.dataset = dataset
        self.collate = collate
        self.last_read_s = 0.0  # seconds the last build spent reading (for stats)
        self._slots = WorkerSlots(main_pid)

    def build(self, task: SlotTask) -> SlotBatch | Oversize:
        started = time.perf_counter()
        # fastload's readers can leave mapped samples in place for the padding to gather from.
        read = getattr(self.dataset, "_read_batch_in_place", None) or self.dataset.read_batch
        columnar = read(task.indices)
        self.last_read_s = time.perf_counter() - started
        # PadCollate plans a batch once for both halves; any other collate with layout and
        # collate_into is asked twice.
        prepare = getattr(self.collate, "_prepare", None)
        prepared = prepare(columnar) if prepare is not None else None
        layout = prepared.layout if prepared is not None else self.collate.layout(columnar)
        arrays, nbytes = plan_layout(layout)
        if nbytes > task.slot.capacity:
            return Oversize(nbytes)
        buf = self._slots.view(task.slot)
        try:
            out = {
                name: np.frombuffer(buf, dtype=_np_dtype(dt), count=math.prod(shape), offset=off).reshape(shape)
                for name, (off, shape, dt) in arrays.items()
            }
            if prepared is not None:
                prepared.write(out)
            else:
                self.collate.collate_into(columnar, out)
            del out
            if any(isinstance(column, Spans) for column in columnar.values()):
                # Samples left in the map are read by the gather into the slot: that is the
                # read (page faults on a cold file land there), so it counts as read time.
                self.last_read_s = time.perf_counter() - started
        finally:
            buf.release()
            if task.slot.temporary:
                self._slots.forget(task.slot.segment)
        objects = {k: v for k, v in columnar.items() if isinstance(v, list)}
        return SlotBatch(arrays, objects, nbytes)


class SlotCodec:
    """Runs in the main process: reserves slots for tasks and turns descriptors into tensors
    that view the slot (the engine's codec)."""

    def __init__(self, arena: SlotArena) -> None:
        self.arena = arena
        self.oversize_batches = 0  # batches that needed a temporary slot

    def task(self, indices: Any) -> SlotTask:
        return SlotTask(np.asarray(indices, dtype=np.int64), self.arena.reserve())

    def decode(self, index: SlotTask, payload: SlotBatch) -> dict[str, Any]:
        # numpy views of the exported array keep it (and so the slot) alive: their base is that
        # array, not the mmap under it. Building views in numpy and wrapping each once is several
        # times cheaper than slicing and re-viewing a torch tensor.
        base = self.arena.export(index.slot, payload.nbytes)
        batch: dict[str, Any] = {}
        for name, (off, shape, dt) in payload.arrays.items():
            dtype = _np_dtype(dt)
            view = base[off : off + math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)
            batch[name] = torch.from_numpy(view)
        batch.update(payload.objects)
        return batch

    def retry(self, index: SlotTask, payload: Any) -> SlotTask | None:
        if not isinstance(payload, Oversize):
            return None
        self.arena.release(index.slot)
        self.oversize_batches += 1
        return SlotTask(index.indices, self.arena.temporary(payload.nbytes))

    def drop(self, index: SlotTask) -> None:
        self.arena.release(index.slot)


@functools.lru_cache(maxsize=64)
def _np_dtype(text: str) -> np.dtype:
    return np.dtype(text)


def synthetic_batch(fields: dict[str, Any], rows: int, length: int) -> dict[str, Any]:
    """A columnar batch of ``rows`` samples of ``length`` elements per ragged field, built from
    zero-stride arrays (no memory), for sizing slots with the collate's own layout."""
    from fastload._types import Ragged

    out: dict[str, Any] = {}
    for name, f in fields.items():
        if f.kind == "ragged":
            values = np.broadcast_to(np.zeros((), f.dtype), (rows * length, *f.shape))
            out[name] = Ragged(values, np.full(rows, length, dtype=np.int64))
        elif f.kind == "fixed":
            out[name] = np.broadcast_to(np.zeros((), f.dtype), (rows, *f.shape))
        else:
            out[name] = [""] * rows
    return out


def slot_bytes_bound(
    collate: Any,
    fields: dict[str, Any],
    lengths: np.ndarray,
    *,
    rows: int | None,
    max_tokens: int | None,
) -> int:
    """The bytes of the largest batch the plan can produce, from the collate's layout: at most
    ``rows`` samples of the longest length, or, under a token budget, either many short samples
    or few long ones, whichever needs more (ragged fields other than the length field are
    assumed no longer than it; a batch that is still larger gets a temporary slot)."""
    n = max(1, len(lengths))
    longest = max(1, int(lengths.max())) if len(lengths) else 1
    shortest = max(1, int(lengths.min())) if len(lengths) else 1

    def size(r: int, length: int) -> int:
        return plan_layout(collate.layout(synthetic_batch(fields, max(1, r), max(1, length))))[1]

    if max_tokens is None:
        return size(min(rows or n, n), longest)
    cap = min(n, rows or n, max(1, max_tokens // shortest))
    return max(
        size(cap, max(shortest, max_tokens // cap)),
        size(max(1, min(cap, max_tokens // longest)), longest),
    )
