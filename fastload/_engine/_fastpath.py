"""The fast path: workers write whole padded batches into shared-memory slots.

Taken when the dataset offers ``read_batch`` and ``lengths`` (the ``BatchReader`` protocol) and
the collation is a ``PadCollate``. A task's index is a :class:`SlotTask` (sample indices plus the
slot reserved for the batch). The worker reads the samples in one call, asks the collate for the
output layout, and pads straight into the slot; it sends back only a :class:`SlotBatch`
descriptor (names, offsets, shapes, dtypes). The main process wraps the slot in tensors without
copying; the slot returns to the arena when the last of those tensors is garbage-collected.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fastload._engine._arena import SlotArena, SlotRef, WorkerSlots, align


@dataclass(frozen=True)
class SlotTask:
    indices: np.ndarray  # int64 sample indices of the batch
    slot: SlotRef

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self) -> Any:
        return iter(self.indices.tolist())


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
        offset = align(offset + int(np.prod(shape, dtype=np.int64)) * dt.itemsize)
    return arrays, offset


class SlotBuilder:
    """Runs in a worker: builds one batch into its slot (the worker's ``fetcher``)."""

    def __init__(self, dataset: Any, collate: Any, main_pid: int) -> None:
        self.dataset = dataset
        self.collate = collate
        self.last_read_s = 0.0  # seconds the last build spent in read_batch (for stats)
        self._slots = WorkerSlots(main_pid)

    def build(self, task: SlotTask) -> SlotBatch | Oversize:
        started = time.perf_counter()
        columnar = self.dataset.read_batch(task.indices)
        self.last_read_s = time.perf_counter() - started
        arrays, nbytes = plan_layout(self.collate.layout(columnar))
        if nbytes > task.slot.capacity:
            return Oversize(nbytes)
        buf = self._slots.view(task.slot)
        try:
            out = {
                name: np.frombuffer(buf, dtype=np.dtype(dt), count=int(np.prod(shape)), offset=off).reshape(shape)
                for name, (off, shape, dt) in arrays.items()
            }
            self.collate.collate_into(columnar, out)
            del out
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
        base = torch.from_numpy(self.arena.export(index.slot, payload.nbytes))
        batch: dict[str, Any] = {}
        for name, (off, shape, dt) in payload.arrays.items():
            dtype = np.dtype(dt)
            n = int(np.prod(shape, dtype=np.int64))
            flat = base[off : off + n * dtype.itemsize]
            batch[name] = flat.view(_TORCH_DTYPES[dtype]).view(shape)
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


_TORCH_DTYPES = {
    np.dtype(np.bool_): torch.bool,
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.int8): torch.int8,
    np.dtype(np.int16): torch.int16,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.uint16): torch.uint16,
    np.dtype(np.uint32): torch.uint32,
    np.dtype(np.uint64): torch.uint64,
    np.dtype(np.float16): torch.float16,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
    np.dtype(np.complex64): torch.complex64,
    np.dtype(np.complex128): torch.complex128,
}


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
