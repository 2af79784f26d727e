"""The fast path, worker side: build one batch straight into the slot its task names.

The builder reads the task's samples in one call, asks the collate for the output layout, and
pads into the slot; or, where the collate offers one (``fastload._protocols.OneCallBuilder``),
builds the whole batch in one native call. It also reads and writes the two per-batch messages
in their binary form (``_slots.py``).
"""

from __future__ import annotations

import math
import pickle
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from fastload._capabilities import Capabilities, resolve
from fastload._engine._arena import SlotRef, WorkerSlots
from fastload._engine._messages import OK, Reply, TaskMessage
from fastload._engine._sizing import plan_layout
from fastload._engine._slots import REPLY, TASK, UNKNOWN, SlotBatch, SlotTask
from fastload._engine._transport import is_pickle
from fastload._protocols import Built, OneCallBuilder, TooLarge
from fastload._types import Counts, Spans

#: The reply header's StorageCounts for a local dataset (``_slots.REPLY``).
_NO_STORAGE = (math.nan, 0, 0, 0)


def batch_reader(dataset: Any, capabilities: Capabilities) -> Any:
    """How the builder reads a batch: in place where the dataset can and the collate takes
    what that gives (``reads_in_place`` and ``takes_spans``: a memory-mapped ragged field is
    then gathered straight from the map), else ``read_batch``."""
    if capabilities.dataset.reads_in_place and capabilities.collate.takes_spans:
        return dataset.read_batch_in_place
    return dataset.read_batch


class SlotBuilder:
    """Builds one batch into its slot (a worker's ``fetcher``)."""

    def __init__(
        self,
        dataset: Any,
        collate: Any,
        main_pid: int,
        capabilities: Capabilities | None = None,
    ) -> None:
        self.dataset = dataset
        self.collate = collate
        self.capabilities = resolve(dataset, collate) if capabilities is None else capabilities
        self.last_read_s = 0.0  # seconds the last build spent reading (for stats)
        self._slots = WorkerSlots(main_pid)
        self._read: Any = None  # looked up on the first build, in the process that builds
        self._one_call: OneCallBuilder | None = None
        self._one_call_tried = False  # decided once, at the first build (or one_call())
        self._check_mapped: Callable[[], None] | None = None

    def task_message(self, data: bytes) -> Any:
        """A message from the main process: a :class:`TaskMessage` of a :class:`SlotTask`, or
        a pickled message."""
        if is_pickle(data):
            return pickle.loads(data)
        _, epoch, seq, *slot, live_from = TASK.unpack_from(data)
        raw = data[TASK.size :]
        self._slots.retire_below(live_from)
        return TaskMessage(epoch, seq, SlotTask(np.frombuffer(raw, dtype=np.int64), SlotRef(*slot), raw))

    @staticmethod
    def result_bytes(reply: Reply) -> bytes:
        """The worker's reply as bytes."""
        epoch, seq, kind, payload, busy_s, read_s, storage = reply[:7]
        if kind != OK or not isinstance(payload, SlotBatch):
            return pickle.dumps(reply, pickle.HIGHEST_PROTOCOL)
        return _batch_reply(epoch, seq, payload, busy_s, read_s, storage)

    def direct_reply(self, data: bytes) -> bytes | None:
        """The reply to the binary task ``data`` where it is the common case, built without a
        message object: a one-call build into a regular slot that fits. ``None`` for anything
        else (a pickled message, a temporary or retired slot, a batch the one-call build cannot
        take or that does not fit, any error): the worker then handles ``data`` the general
        way, which builds it or says what is wrong (NOTE [direct replies] in ``_worker.py``)."""
        if data[:1] != b"T" or not self.one_call():
            return None
        _, epoch, seq, segment, fd, size, offset, capacity, temporary, live_from = TASK.unpack_from(data)
        slots = self._slots
        if temporary or segment < live_from:
            return None
        if live_from > slots.live_from:
            slots.retire_below(live_from)
        started = time.perf_counter()
        try:
            if self._check_mapped is not None:
                self._check_mapped()
            memory = slots.mapped(segment)
            if memory is None:
                memory = slots.segment(SlotRef(segment, fd, size, offset, capacity))
            assert self._one_call is not None
            built = self._one_call.build_into(data[TASK.size :], memory, offset, capacity)
        except Exception:
            return None
        if not isinstance(built, Built):
            return None
        busy_s = time.perf_counter() - started
        self.last_read_s = self._one_call.last_s
        batch = SlotBatch(built.arrays, None, built.nbytes, built.counts)
        return _batch_reply(epoch, seq, batch, busy_s, self.last_read_s, None)

    def one_call(self) -> bool:
        """Whether this builder's batches are one-call builds (judged once, at first asked,
        from the dataset and the collate alone)."""
        if not self._one_call_tried:
            self._one_call_tried = True
            offer = self.capabilities.collate.one_call_builder
            self._one_call = self.collate.one_call_builder(self.dataset) if offer else None
            # A one-call build reads the dataset's memory map without calling the dataset.
            if self.capabilities.dataset.check_mapped:
                self._check_mapped = self.dataset.check_mapped
        return self._one_call is not None

    def build(self, task: SlotTask) -> SlotBatch | TooLarge:
        slot = task.slot
        try:
            if self.one_call():
                assert self._one_call is not None
                if self._check_mapped is not None:
                    self._check_mapped()  # a truncated file: an error, not SIGBUS
                built = self._one_call.build_into(task.raw, self._slots.segment(slot), slot.offset, slot.capacity)
                if isinstance(built, Built):
                    self.last_read_s = self._one_call.last_s  # all of it reads from the map
                    return SlotBatch(built.arrays, None, built.nbytes, built.counts)
                if built is not None:
                    return built
            return self._build_general(task)
        finally:
            self._slots.done_with(slot)

    def _build_general(self, task: SlotTask) -> SlotBatch | TooLarge:
        started = time.perf_counter()
        if self._read is None:
            self._read = batch_reader(self.dataset, self.capabilities)
        columnar = self._read(task.indices)
        self.last_read_s = time.perf_counter() - started
        # A collate that plans a batch once for both halves is asked once; any other twice.
        prepared = self.collate.prepare(columnar) if self.capabilities.collate.prepare else None
        layout = prepared.layout if prepared is not None else self.collate.layout(columnar)
        arrays, nbytes = plan_layout(layout)
        if nbytes > task.slot.capacity:
            return TooLarge(nbytes)
        segment = self._slots.segment(task.slot)
        base = task.slot.offset
        out = {
            name: np.ndarray(shape, dtype, buffer=segment, offset=base + off)
            for name, off, shape, dtype in arrays
        }
        if prepared is not None:
            prepared.fill(out)  # it made the layout these arrays follow: no need to check them
        else:
            self.collate.collate_into(columnar, out)
        del out, segment
        if any(isinstance(column, Spans) for column in columnar.values()):
            # Samples left in the map are read by the gather into the slot: that is the read
            # (page faults on a cold file land there), so it counts as read time.
            self.last_read_s = time.perf_counter() - started
        objects = {k: v for k, v in columnar.items() if isinstance(v, list)} or None
        counts: Counts | None = prepared.counts if prepared is not None else None
        described = tuple([(n, off, shape, dt.str) for n, off, shape, dt in arrays])
        return SlotBatch(described, objects, nbytes, counts)


def _batch_reply(
    epoch: int, seq: int, batch: SlotBatch, busy_s: float, read_s: float | None, storage: Any
) -> bytes:
    """A built batch's reply in its binary form (``_slots.REPLY``, read by ``decode_reply``)."""
    rows, real, padded = batch.counts or (UNKNOWN, None, None)
    head = REPLY.pack(
        b"R", epoch, seq, batch.nbytes, rows,
        UNKNOWN if real is None else real, UNKNOWN if padded is None else padded,
        busy_s, math.nan if read_s is None else read_s,
        *(_NO_STORAGE if storage is None else storage),
    )  # fmt: skip
    return head + pickle.dumps((batch.arrays, batch.objects), pickle.HIGHEST_PROTOCOL)


__all__ = ["SlotBuilder", "batch_reader"]
