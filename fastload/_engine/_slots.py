"""The fast path, main process side: tasks into shared-memory slots, batches out of them.

A task's index is a :class:`SlotTask` (sample indices plus the slot reserved for the batch). The
worker (``_builder.py``) reads the samples in one call and pads straight into the slot; it sends
back only a :class:`SlotBatch` descriptor (names, offsets, shapes, dtypes). :class:`SlotCodec`
wraps the slot in tensors without copying; the slot returns to the arena when the last of those
tensors is garbage-collected.

The two messages sent once per batch have a binary form of their own (the rest, rare, are
pickles): a task is ``b"T"``, the header and the indices' raw bytes; a built batch is ``b"R"``,
a header and the pickled array descriptor. Both are a few struct calls where a pickle of the
same objects costs several microseconds at each end.
"""

from __future__ import annotations

import functools
import math
import pickle
import struct
from typing import Any, NamedTuple

import numpy as np
import torch

from fastload._engine._arena import SlotArena, SlotRef
from fastload._engine._messages import OK, Reply
from fastload._engine._sizing import BatchBytes, SlotSizing
from fastload._protocols import TooLarge
from fastload._types import Counts, StorageCounts

# b"T", epoch, seq, the SlotRef's six fields, the arena's live_from, then the int64 indices.
TASK = struct.Struct("<cqqqqqqq?q")
# b"R", epoch, seq, nbytes, rows, real tokens, padded tokens (-1: unknown), busy_s, read_s
# (NaN: unknown), the StorageCounts (waited_s NaN: none), then the pickled (arrays, objects).
REPLY = struct.Struct("<cqqqqqqdddqqq")
_SEQ = struct.Struct("<q")
_SEQ_AT = struct.calcsize("<cq")  # where a task's seq lies in it
UNKNOWN = -1
_PICKLE = b"\x80"  # what a pickle starts with (see _transport.is_pickle)


def task_seq(data: bytes) -> int:
    """The sequence number of the binary task ``data``."""
    seq: int = _SEQ.unpack_from(data, _SEQ_AT)[0]
    return seq


class SlotTask:
    """A fast-path task: the batch's sample indices and the slot reserved for it. Iterates and
    measures as its indices (it stands for them in error messages).

    ``indices`` is what the sampler gave (a list of ints, most often) in the main process, and
    an int64 array in the worker; ``raw`` is them as int64 bytes, made once (and checked) when
    the task is made."""

    __slots__ = ("indices", "raw", "slot")

    def __init__(self, indices: Any, slot: SlotRef, raw: bytes | None = None) -> None:
        self.indices = indices
        self.slot = slot
        self.raw = index_bytes(indices) if raw is None else raw

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self) -> Any:
        indices = self.indices
        return iter(indices.tolist() if isinstance(indices, np.ndarray) else indices)

    def __reduce__(self) -> Any:
        return _slot_task, (self.raw, tuple(self.slot))


def _slot_task(raw: bytes, slot: tuple[Any, ...]) -> SlotTask:
    return SlotTask(np.frombuffer(raw, dtype=np.int64), SlotRef(*slot), raw)


@functools.lru_cache(maxsize=256)
def _int64s(count: int) -> struct.Struct:
    return struct.Struct(f"<{count}q")


def index_bytes(indices: Any) -> bytes:
    """Sample indices as raw int64 bytes. A list of ints is packed directly (a third of the
    cost of converting it to an array first, once per batch)."""
    if type(indices) is list:
        try:
            return _int64s(len(indices)).pack(*indices)
        except struct.error:  # floats, out-of-range values: numpy says what is wrong
            pass
    array = np.asarray(indices)
    if array.dtype.kind not in "iu" and array.size:
        raise TypeError(f"sample indices must be integers; got {array.dtype} from {indices!r:.80}")
    return np.ascontiguousarray(array, dtype=np.int64).tobytes()


class SlotBatch(NamedTuple):
    """Where each output array lies in the slot, as ``(name, offset, shape, dtype str)``;
    ``objects`` carries object fields (strings) by value; ``nbytes`` is the slot bytes used;
    ``counts`` says what the batch holds (``None`` when the collate does not say). A plain
    tuple of tuples: it is pickled once per batch."""

    arrays: tuple[tuple[str, int, tuple[int, ...], str], ...]
    objects: dict[str, Any] | None
    nbytes: int
    counts: Counts | None


def decode_reply(data: bytes) -> Reply:
    """A worker's reply from its bytes (the inverse of ``SlotBuilder.result_bytes``)."""
    if data[:1] == _PICKLE:  # is_pickle(), without the call: this runs once per batch
        reply: Reply = pickle.loads(data)
        return reply
    _, epoch, seq, nbytes, rows, real, padded, busy_s, read_s, *storage = REPLY.unpack_from(data)
    arrays, objects = pickle.loads(memoryview(data)[REPLY.size :])
    counts = None
    if rows != UNKNOWN:
        counts = Counts(rows, None if real == UNKNOWN else real, None if padded == UNKNOWN else padded)
    batch = SlotBatch(arrays, objects, nbytes, counts)
    read = None if math.isnan(read_s) else read_s
    return Reply(epoch, seq, OK, batch, busy_s, read, None if math.isnan(storage[0]) else StorageCounts(*storage))


class SlotCodec:
    """Runs in the main process: reserves slots for tasks and turns descriptors into tensors
    that view the slot (the engine's codec).

    ``batch_bytes``, where the slots are sized from the batches that come (``_sizing.py``),
    says how many bytes a batch needs; then the regular slots are remade when the batches
    outgrow them, and a batch that does not fit is sent with a temporary slot of its exact size."""

    def __init__(self, arena: SlotArena, batch_bytes: BatchBytes | None = None) -> None:
        self.arena = arena
        self.oversize_batches = 0  # batches that needed a temporary slot
        self._batch_bytes = batch_bytes
        self._sizing = SlotSizing() if batch_bytes is not None else None

    def task(self, indices: Any) -> SlotTask:
        raw = index_bytes(indices)  # a bad index fails here, as the sampler's error
        slot = self.arena.reserve() if self._sizing is None else self._slot_for(raw)
        return SlotTask(indices, slot, raw)

    def _slot_for(self, raw: bytes) -> SlotRef:
        """A slot for a batch whose size the sampler's lengths tell (``batch_bytes``)."""
        sizing, batch_bytes = self._sizing, self._batch_bytes
        assert sizing is not None and batch_bytes is not None
        need = batch_bytes(raw)
        if need is None:  # indices the lengths cannot answer for: a worker says what is wrong
            need = sizing.capacity or 1
        resize = sizing.observe(need)
        if resize is not None:
            self.arena.resize(resize)
        if need > self.arena.capacity:
            self.oversize_batches += 1
            return self.arena.temporary(need, _which(raw))
        return self.arena.reserve()

    def task_message(self, epoch: int, seq: int, index: SlotTask) -> bytes:
        return TASK.pack(b"T", epoch, seq, *index.slot, self.arena.live_from) + index.raw

    #: A worker's reply from its bytes: the function itself, one call per batch, not a wrapper.
    result_message = staticmethod(decode_reply)

    def deliver(self, index: SlotTask, payload: SlotBatch) -> tuple[dict[str, Any], Counts | None]:
        """The batch (tensors viewing the slot) and what the worker counted in it."""
        # One array per output, straight on the exported slot array (their base), each wrapped
        # once: several times cheaper than slicing and re-viewing, in numpy or torch.
        base = self.arena.export(index.slot, payload.nbytes)
        batch: dict[str, Any] = {}
        for name, off, shape, dt in payload.arrays:
            batch[name] = torch.from_numpy(np.ndarray(shape, _np_dtype(dt), buffer=base, offset=off))
        if payload.objects:
            batch.update(payload.objects)
        return batch, payload.counts

    def retry(self, index: SlotTask, payload: Any) -> SlotTask | None:
        if not isinstance(payload, TooLarge):
            return None
        self.arena.release(index.slot)
        self.oversize_batches += 1
        return SlotTask(index.indices, self.arena.temporary(payload.nbytes, _which(index.raw)), index.raw)

    def drop(self, index: SlotTask) -> None:
        self.arena.release(index.slot)


def _which(raw: bytes) -> str:
    """The batch of these int64 sample indices, in words (the first few of them)."""
    indices = np.frombuffer(raw, dtype=np.int64)
    shown = ", ".join(str(i) for i in indices[:6].tolist()) + (", ..." if indices.size > 6 else "")
    return f"the batch of {indices.size} samples [{shown}]"


@functools.lru_cache(maxsize=64)
def _np_dtype(text: str) -> np.dtype:
    return np.dtype(text)


__all__ = ["REPLY", "TASK", "UNKNOWN", "SlotBatch", "SlotCodec", "SlotTask", "decode_reply", "index_bytes", "task_seq"]
