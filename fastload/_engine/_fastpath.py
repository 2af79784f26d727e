"""The fast path: workers write whole padded batches into shared-memory slots.

Taken when the dataset offers ``read_batch`` and ``lengths`` (the ``BatchReader`` protocol) and
the collation is a ``PadCollate``. A task's index is a :class:`SlotTask` (sample indices plus the
slot reserved for the batch). The worker reads the samples in one call, asks the collate for the
output layout, and pads straight into the slot; it sends back only a :class:`SlotBatch`
descriptor (names, offsets, shapes, dtypes). The main process wraps the slot in tensors without
copying; the slot returns to the arena when the last of those tensors is garbage-collected.

The two messages sent once per batch have a binary form of their own (the rest, rare, are
pickles): a task is ``b"T"``, the header and the indices' raw bytes; a built batch is ``b"R"``,
a header and the pickled array descriptor. Both are a few struct calls where a pickle of the
same objects costs several microseconds at each end.

While the consumer would wait, the main process may build a task no worker has started itself
(:meth:`SlotCodec.take_over`); a ticket in each task and a claim word in each slot make sure
exactly one of them does (``_claims.py``).
"""

from __future__ import annotations

import functools
import math
import pickle
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from fastload._collate import PadCollate, _kernels
from fastload._engine import _claims as claims
from fastload._engine._arena import ALIGN, SlotArena, SlotRef, WorkerSlots, align
from fastload._engine._engine import RESEND
from fastload._engine._transport import is_pickle
from fastload._engine._worker import OK
from fastload._types import Spans

# b"T", epoch, seq, the SlotRef's six fields, the ticket (see _claims.py), then the int64 indices.
_TASK = struct.Struct("<cqqqqqqq?q")
# b"R", epoch, seq, nbytes, rows, real tokens, padded tokens (-1: unknown), busy_s, read_s
# (NaN: unknown), then the pickled (arrays, objects).
_REPLY = struct.Struct("<cqqqqqqdd")
_UNKNOWN = -1
_PICKLE = b"\x80"  # what a pickle starts with (see is_pickle)


class SlotTask:
    """A fast-path task: the batch's sample indices and the slot reserved for it. Iterates and
    measures as its indices (it stands for them in error messages).

    ``indices`` is what the sampler gave (a list of ints, most often) in the main process, and
    an int64 array in the worker; ``raw`` is them as int64 bytes, made once (and checked) when
    the task is made. ``ticket`` is the claim ticket of its latest sending (0: none, the worker
    builds it unconditionally; see ``_claims.py``); ``claimable`` is ``False`` once the main
    process found it cannot build the task itself."""

    __slots__ = ("claimable", "indices", "raw", "slot", "ticket")

    def __init__(self, indices: Any, slot: SlotRef, raw: bytes | None = None, ticket: int = 0) -> None:
        self.indices = indices
        self.slot = slot
        self.raw = _index_bytes(indices) if raw is None else raw
        self.ticket = ticket
        self.claimable = True

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self) -> Any:
        indices = self.indices
        return iter(indices.tolist() if isinstance(indices, np.ndarray) else indices)

    def __reduce__(self) -> Any:
        return _slot_task, (self.raw, tuple(self.slot), self.ticket)


def _slot_task(raw: bytes, slot: tuple[Any, ...], ticket: int = 0) -> SlotTask:
    return SlotTask(np.frombuffer(raw, dtype=np.int64), SlotRef(*slot), raw, ticket)


@functools.lru_cache(maxsize=256)
def _int64s(count: int) -> struct.Struct:
    return struct.Struct(f"<{count}q")


def _index_bytes(indices: Any) -> bytes:
    """Sample indices as raw int64 bytes. A list of ints is packed directly (a third of the
    cost of converting it to an array first, once per batch)."""
    if type(indices) is list:
        try:
            return _int64s(len(indices)).pack(*indices)
        except struct.error:  # floats, out-of-range values: numpy says what is wrong
            return _array_index_bytes(indices)
    return _array_index_bytes(indices)


def _array_index_bytes(indices: Any) -> bytes:
    array = np.asarray(indices)
    if array.dtype.kind not in "iu" and array.size:
        raise TypeError(f"sample indices must be integers; got {array.dtype} from {indices!r:.80}")
    return np.ascontiguousarray(array, dtype=np.int64).tobytes()


class SlotBatch(NamedTuple):
    """Where each output array lies in the slot, as ``(name, offset, shape, dtype str)``;
    ``objects`` carries object fields (strings) by value; ``nbytes`` is the slot bytes used;
    ``counts`` are the batch's rows, real and padded tokens (for statistics; ``None`` when the
    collate does not say). A plain tuple of tuples: it is pickled once per batch."""

    arrays: tuple[tuple[str, int, tuple[int, ...], str], ...]
    objects: dict[str, Any] | None
    nbytes: int
    counts: tuple[int, int | None, int | None] | None


@dataclass(frozen=True)
class Oversize:
    """The batch needs ``nbytes``, more than its slot holds: build it again in a bigger slot."""

    nbytes: int


def plan_layout(layout: dict[str, tuple[tuple[int, ...], np.dtype]]) -> tuple[list[tuple[str, int, tuple[int, ...], np.dtype]], int]:
    """Each output array as ``(name, byte offset, shape, dtype)``, each offset aligned, and the
    total size."""
    arrays = []
    offset = 0
    for name, (shape, dtype) in layout.items():
        dt = dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)
        arrays.append((name, offset, shape, dt))
        offset = align(offset + math.prod(shape) * dt.itemsize)
    return arrays, offset


def in_place_reader(dataset: Any) -> Any:
    """The dataset's ``_read_batch_in_place`` (fastload's readers: samples left in their memory
    map for the padding to gather from), or ``None`` where it would bypass a ``read_batch`` of
    the dataset's own: a subclass, or an instance, that overrides ``read_batch`` alone must
    have it called."""
    if "read_batch" in getattr(dataset, "__dict__", {}):
        return None
    mro = type(dataset).__mro__
    in_place = next((i for i, cls in enumerate(mro) if "_read_batch_in_place" in vars(cls)), None)
    read = next((i for i, cls in enumerate(mro) if "read_batch" in vars(cls)), len(mro))
    return None if in_place is None or in_place > read else dataset._read_batch_in_place


class SlotBuilder:
    """Runs in a worker: builds one batch into its slot (the worker's ``fetcher``), and reads
    and writes the two per-batch messages in their binary form. In the main process, given the
    arena as ``slots``, it builds the batches the main process takes over."""

    def __init__(self, dataset: Any, collate: Any, main_pid: int, slots: Any = None) -> None:
        self.dataset = dataset
        self.collate = collate
        self.last_read_s = 0.0  # seconds the last build spent reading (for stats)
        self._slots: WorkerSlots | SlotArena = WorkerSlots(main_pid) if slots is None else slots
        self._read: Any = None  # looked up on the first build, in the worker
        self._express: _Express | None = None  # one-call builds, where they apply
        self._express_tried = False  # decided once, at the first build (or one_call())

    def _reader(self) -> Any:
        # fastload's readers can leave mapped samples in place for the padding to gather from.
        if self._read is None:
            self._read = in_place_reader(self.dataset) or self.dataset.read_batch
        return self._read

    @staticmethod
    def task_message(data: bytes) -> Any:
        """A message from the main process: ``(epoch, seq, SlotTask)``, or a pickled one."""
        if is_pickle(data):
            return pickle.loads(data)
        _, epoch, seq, *slot, ticket = _TASK.unpack_from(data)
        raw = data[_TASK.size :]
        return epoch, seq, SlotTask(np.frombuffer(raw, dtype=np.int64), SlotRef(*slot), raw, ticket)

    def claim(self, task: SlotTask) -> bool:
        """Take ``task`` before building it (``_claims.py``): ``False`` when the main process
        has built it already, and this worker must drop it without a reply."""
        if not task.ticket:
            return True
        slot = task.slot
        segment = self._slots.segment(slot)
        return claims.claim(segment, slot.claim_at, task.ticket, claims.WORKER)

    @staticmethod
    def result_bytes(reply: tuple[Any, ...]) -> bytes:
        """The worker's reply ``(epoch, seq, kind, payload, busy_s, read_s)`` as bytes."""
        epoch, seq, kind, payload, busy_s, read_s = reply
        if kind != OK or not isinstance(payload, SlotBatch):
            return pickle.dumps(reply, pickle.HIGHEST_PROTOCOL)
        rows, real, padded = payload.counts or (_UNKNOWN, None, None)
        head = _REPLY.pack(
            b"R", epoch, seq, payload.nbytes, rows,
            _UNKNOWN if real is None else real, _UNKNOWN if padded is None else padded,
            busy_s, math.nan if read_s is None else read_s,
        )  # fmt: skip
        return head + pickle.dumps((payload.arrays, payload.objects), pickle.HIGHEST_PROTOCOL)

    def one_call(self) -> bool:
        """Whether this builder's batches are one-call builds (judged once, at first asked)."""
        if not self._express_tried:
            self._express_tried = True
            self._express = express_builder(self.dataset, self.collate)
        return self._express is not None

    def build(self, task: SlotTask) -> SlotBatch | Oversize:
        if not self._express_tried:  # the first build: may it, and all after it, be one call?
            self.one_call()
        if self._express is not None:
            try:
                built = self._express.build(task, self._slots.segment(task.slot))
            finally:
                if task.slot.temporary:  # mapped for this batch alone
                    self._slots.forget(task.slot.segment)
            if built is not None:
                self.last_read_s = self._express.last_s  # all of it reads from the map
                return built
        started = time.perf_counter()
        columnar = (self._read or self._reader())(task.indices)
        self.last_read_s = time.perf_counter() - started
        # PadCollate plans a batch once for both halves; any other collate with layout and
        # collate_into is asked twice.
        prepare = getattr(self.collate, "_prepare", None)
        prepared = prepare(columnar) if prepare is not None else None
        layout = prepared.layout if prepared is not None else self.collate.layout(columnar)
        arrays, nbytes = plan_layout(layout)
        if nbytes > task.slot.capacity:
            return Oversize(nbytes)
        segment = self._slots.segment(task.slot)
        base = task.slot.offset
        try:
            out = {
                name: np.ndarray(shape, dtype, buffer=segment, offset=base + off)
                for name, off, shape, dtype in arrays
            }
            if prepared is not None:
                # It made the layout these arrays follow: no need to check them against it.
                getattr(prepared, "fill", prepared.write)(out)
            else:
                self.collate.collate_into(columnar, out)
            del out
            if any(isinstance(column, Spans) for column in columnar.values()):
                # Samples left in the map are read by the gather into the slot: that is the
                # read (page faults on a cold file land there), so it counts as read time.
                self.last_read_s = time.perf_counter() - started
        finally:
            del segment
            if task.slot.temporary:
                self._slots.forget(task.slot.segment)
        objects = {k: v for k, v in columnar.items() if isinstance(v, list)} or None
        counts = getattr(prepared, "counts", None)
        described = tuple([(n, off, shape, dt.str) for n, off, shape, dt in arrays])
        return SlotBatch(described, objects, nbytes, counts)


class _Express:
    """One-call builds for the commonest batch: a single ragged field left in place in a
    memory map (a fastload HDF5 file), padded by ``PadCollate``. The native ``gather_pad``
    checks the indices, reads each sample's span from the offsets, lays the slot out as
    ``PadCollate`` would and pads into it, where the general path makes some 60 Python-level
    calls. Measured in the workers of a 2-worker loader here, batches of 64: 84 against 160 µs
    of CPU per build, 147 against 250 µs per batch in all. A batch it cannot take (an index out
    of range, say) goes the general way, which says what is wrong."""

    def __init__(self, name: str, values: np.ndarray, offsets: np.ndarray, single: Any) -> None:
        native = _kernels._native
        assert native is not None
        codes = _kernels.NATIVE_TYPES
        rule = single.rule
        self._gather = native.gather_pad
        self._values, self._offsets = values, offsets
        self._args = (
            codes[values.dtype],
            math.prod(values.shape[1:]),
            codes[rule.dtype],
            codes[single.mask_dtype],
            0 if rule.dtype.kind == "f" else int(rule.pad_value),
            float(rule.pad_value),
            single.left,
            single.max_length or 0,
            single.multiple,
            ALIGN,
        )
        self._names = (name, rule.mask_name, rule.lengths_name)
        self._dtypes = (rule.dtype.str, single.mask_dtype.str, np.dtype(np.int64).str)
        self._elem = tuple(values.shape[1:])
        self.last_s = 0.0

    def build(self, task: SlotTask, segment: np.ndarray) -> SlotBatch | Oversize | None:
        started = time.perf_counter()
        slot = task.slot
        vt, items, ot, mt, pad_int, pad_float, left, max_length, multiple, al = self._args
        status, rows, width, real, nbytes, mask_at, lengths_at = self._gather(
            self._values, vt, items, self._offsets, task.raw, segment, slot.offset,
            slot.capacity, ot, mt, pad_int, pad_float, left, max_length, multiple, al,
        )  # fmt: skip
        if status == 2:
            return None
        if status == 1:
            return Oversize(nbytes)
        self.last_s = time.perf_counter() - started
        name, mask, lengths = self._names
        ids_t, mask_t, lengths_t = self._dtypes
        arrays = (
            (name, 0, (rows, width, *self._elem), ids_t),
            (mask, mask_at, (rows, width), mask_t),
            (lengths, lengths_at, (rows,), lengths_t),
        )
        return SlotBatch(arrays, None, nbytes, (rows, real, rows * width))


def express_builder(dataset: Any, collate: Any) -> _Express | None:
    """The one-call builder for ``dataset``'s batches padded by ``collate``, or ``None`` where
    one-call builds do not apply: judged from the dataset alone (its in-place reads would give
    ``Spans`` over the very arrays ``_mapped_ragged`` returns). Maps the file in this
    process."""
    if _kernels._native is None or getattr(type(collate), "_prepare", None) is not PadCollate._prepare:
        return None
    if in_place_reader(dataset) is None:  # it reads the map as _read_batch_in_place does
        return None
    mapped = getattr(dataset, "_mapped_ragged", None)
    found = mapped() if mapped is not None else None
    if found is None:
        return None
    name, values, offsets = found
    if not (values.flags.c_contiguous and offsets.flags.c_contiguous):
        return None
    none = np.zeros(0, np.int64)
    single = collate._single_field(name, Spans(values, none, none))
    codes = _kernels.NATIVE_TYPES
    if single is None or single.rule.mask_name is None:
        return None
    if any(d not in codes for d in (values.dtype, single.rule.dtype, single.mask_dtype)):
        return None
    return _Express(name, values, offsets, single)


class SlotCodec:
    """Runs in the main process: reserves slots for tasks and turns descriptors into tensors
    that view the slot (the engine's codec).

    With ``main_builder`` (what makes, given the arena, a :class:`SlotBuilder` for this
    loader's batches in the main process, or ``None`` where the main process may not build
    them) it can also take over a task no worker has started (:meth:`take_over`): each task
    sent into a regular slot then carries a new claim ticket (``_claims.py``). The builder is
    made when first needed, while ``next()`` would wait (it opens the file in this process:
    0.3-0.6 ms here), not when the iterator starts."""

    def __init__(
        self, arena: SlotArena, main_builder: Callable[[SlotArena], SlotBuilder | None] | None = None
    ) -> None:
        self.arena = arena
        self.oversize_batches = 0  # batches that needed a temporary slot
        self._make_builder = main_builder if claims.available() else None
        self._builder: SlotBuilder | None = None
        #: Whether :meth:`take_over` may take a task (``False`` for good once the builder
        #: turns out not to apply).
        self.takes_over = self._make_builder is not None
        self._tickets = 0  # the last ticket given

    def task(self, indices: Any) -> SlotTask:
        raw = _index_bytes(indices)  # a bad index fails here, as the sampler's error
        return SlotTask(indices, self.arena.reserve(), raw)

    def task_message(self, epoch: int, seq: int, index: SlotTask) -> bytes:
        slot = index.slot
        if self.takes_over and index.claimable and not slot.temporary:
            # Every sending gets a new ticket: a copy of an older sending that a worker has not
            # read yet finds its claim failing (``_claims.py``).
            self._tickets += 1
            index.ticket = self._tickets
            claims.post(self.arena.memory(slot), slot.claim_at, index.ticket)
        else:
            index.ticket = 0
        return _TASK.pack(b"T", epoch, seq, *slot, index.ticket) + index.raw

    def take_over(self, index: SlotTask) -> Any:
        """Build the task here if no worker has started it: ``None`` when not taken (its worker
        has it, or it takes no part in claims), else what a worker would have sent (a
        :class:`SlotBatch`, or :class:`Oversize`), or ``RESEND`` where building it raised (an
        index out of range, say: a worker builds it again and says what is wrong, in its own
        words and its turn). Once taken, its worker drops it unread."""
        slot = index.slot
        if not index.ticket or not self.takes_over:
            return None
        builder = self._builder
        if builder is None:
            assert self._make_builder is not None
            builder = self._builder = self._make_builder(self.arena)
            if builder is None:
                self.takes_over = False  # tasks sent so far are claimed by their workers
                return None
        if not claims.claim(self.arena.memory(slot), slot.claim_at, index.ticket, claims.MAIN):
            return None
        try:
            return builder.build(index)
        except Exception:  # a worker builds it again and says what is wrong, as without us
            index.claimable = False  # sent again with ticket 0: a worker builds it, whatever
            return RESEND

    def result_message(self, data: bytes) -> Any:
        if data[:1] == _PICKLE:  # is_pickle(), without the call: this runs once per batch
            return pickle.loads(data)
        _, epoch, seq, nbytes, rows, real, padded, busy_s, read_s = _REPLY.unpack_from(data)
        arrays, objects = pickle.loads(memoryview(data)[_REPLY.size :])
        counts = None
        if rows != _UNKNOWN:
            counts = (rows, None if real == _UNKNOWN else real, None if padded == _UNKNOWN else padded)
        # SlotBatch's own constructor is a Python function; tuple.__new__ makes the same object.
        batch = tuple.__new__(SlotBatch, (arrays, objects, nbytes, counts))
        return epoch, seq, OK, batch, busy_s, None if math.isnan(read_s) else read_s

    def deliver(self, index: SlotTask, payload: SlotBatch) -> tuple[dict[str, Any], Any]:
        """The batch (tensors viewing the slot) and the rows, real and padded tokens the worker
        counted (``None`` when the collate does not say)."""
        # One array per output, straight on the exported slot array (their base), each wrapped
        # once: several times cheaper than slicing and re-viewing, in numpy or torch. A loop,
        # not a comprehension: that would be one more function call per batch.
        base = self.arena.export(index.slot, payload.nbytes)
        batch: dict[str, Any] = {}
        for name, off, shape, dt in payload.arrays:
            batch[name] = torch.from_numpy(np.ndarray(shape, _np_dtype(dt), buffer=base, offset=off))
        if payload.objects:
            batch.update(payload.objects)
        return batch, payload.counts

    def retry(self, index: SlotTask, payload: Any) -> SlotTask | None:
        if not isinstance(payload, Oversize):
            return None
        self.arena.release(index.slot)
        self.oversize_batches += 1
        return SlotTask(index.indices, self.arena.temporary(payload.nbytes), index.raw)

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
