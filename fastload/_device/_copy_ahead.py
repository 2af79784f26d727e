"""Copying batches to the GPU ahead of the step that needs them.

:class:`DevicePrefetcher` keeps one batch in flight: while the consumer trains on batch N (on the
current stream), batch N+1 is copied host-to-device on a side stream with ``non_blocking=True``.
The host tensors of a batch (views of a shared-memory slot on the fast path) are kept alive until
an event recorded after their copy has completed, so their slot cannot be reused while the DMA
engine still reads it. The device tensors are marked with ``record_stream`` for the consumer's
stream, so the caching allocator does not reuse their memory too early. Without CUDA (or for a
CPU device) it yields the batches unchanged. A ``finish`` step (a packed batch's labels, built
from its ids) runs on the copied batch on the side stream, after its copy.

Everything of the device goes through one :class:`~fastload._device._ops.DeviceOps` object, so
:class:`PrefetchIterator` is plain Python: its tests run on the CPU with a fake one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, NamedTuple

import torch

from fastload._device._cuda import CudaOps, cuda_device
from fastload._device._ops import DeviceOps, EventT, StreamT


class _Staged(NamedTuple):
    """A batch whose copy has been started: its device tensors and the event after its copy."""

    batch: Any
    copied: Any


class _Failed(NamedTuple):
    """A batch that raised when it was taken or when its copy was started."""

    error: Exception


class _Exhausted:
    """The host batches raised ``StopIteration``."""


_EXHAUSTED = _Exhausted()


class PrefetchIterator(Generic[StreamT, EventT]):
    """One epoch of ``host_batches`` on the device, each batch's copy started one step ahead.

    Order: ``next()`` starts the copy of batch N+1 on a side stream before it hands out batch N,
    and hands batch N out after making the consumer's stream (the current stream when the
    iterator was made) wait for the event recorded after batch N's copy. The caller never waits
    for a copy.

    Errors keep their place: an ``Exception`` raised while batch N+1 is taken from
    ``host_batches`` or while its copy is started is raised by the ``next()`` that would have
    returned batch N+1, after batch N was returned, and the ``next()`` after that goes on with
    the following batch: the epoch goes on, as on the host path. Other exceptions
    (``KeyboardInterrupt``) propagate at once, and a batch already staged stays staged.

    Lifetimes: a host batch is referenced until the event recorded after its copy (also a copy
    that failed partway) has completed, and dropped by the first ``next()`` that finds it so.
    The end of the epoch (``StopIteration``) and :meth:`close` wait for both streams and drop
    every host batch.

    ``gpu_idle_s`` accumulates how long the GPU waited for data: for each batch handed out
    after the first, the time from the consumer's stream finishing the work queued before
    ``next()`` to the batch's copy finishing (zero when the copy finished first). Events are
    read only once complete, so measuring never waits."""

    def __init__(
        self,
        host_batches: Iterator[Any],
        ops: DeviceOps[StreamT, EventT],
        finish: Callable[[Any], Any] | None = None,
    ) -> None:
        self._host = host_batches
        self._ops = ops
        self._finish = finish
        self._side = ops.new_stream()
        self._consumer = ops.current_stream()
        self._ahead: _Staged | _Failed | _Exhausted | None = None  # None: nothing staged
        self._in_flight: deque[tuple[EventT, Any]] = deque()  # (copied, host batch) in copy order
        self._timings: deque[tuple[EventT, EventT]] = deque()  # (step done, copied), unread
        self._handed_out = False
        self._closed = False
        self.gpu_idle_s = 0.0

    def __iter__(self) -> PrefetchIterator[StreamT, EventT]:
        return self

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        current: _Staged | _Failed | _Exhausted | None = self._ahead
        if current is None:
            current = self._take()
        if isinstance(current, _Exhausted):
            self.close()
            raise StopIteration
        if isinstance(current, _Failed):
            self._ahead = None  # the next call takes the batch after the failed one
            error, current = current.error, None
            try:
                raise error
            finally:  # no cycle error -> traceback -> this frame: its host batch is freed at once
                del error
        self._ahead = current  # kept staged if taking the next batch raises a BaseException
        self._ahead = self._take()
        return self._hand_out(current)

    def close(self) -> None:
        """End the epoch: wait for both streams, count the last idle times and drop every host
        batch and the staged one. Idempotent; ``next()`` then raises ``StopIteration``."""
        if self._closed:
            return
        self._closed = True
        self._ahead = None
        self._ops.synchronize(self._side)
        self._ops.synchronize(self._consumer)
        self._account()
        self._in_flight.clear()

    def _take(self) -> _Staged | _Failed | _Exhausted:
        try:
            return self._start_copy(next(self._host))
        except StopIteration:
            return _EXHAUSTED
        except Exception as exc:  # raised in its turn by __next__
            return _Failed(exc)

    def _start_copy(self, host: Any) -> _Staged:
        ops = self._ops
        try:
            batch = ops.to_device(host, self._side, self._consumer)
            if self._finish is not None:
                batch = ops.run_on(self._finish, batch, self._side, self._consumer)
        finally:  # a copy that failed partway may have queued reads of the host batch
            copied = ops.timed_event()
            ops.record(copied, self._side)
            self._in_flight.append((copied, host))
        return _Staged(batch, copied)

    def _hand_out(self, staged: _Staged) -> Any:
        ops = self._ops
        if self._handed_out:  # the consumer asked for this batch: its previous step is queued
            step_done = ops.timed_event()
            ops.record(step_done, self._consumer)
            self._timings.append((step_done, staged.copied))
            self._account()
        self._handed_out = True
        ops.wait(self._consumer, staged.copied)
        while self._in_flight and ops.query(self._in_flight[0][0]):
            self._in_flight.popleft()  # copy finished: the host batch (and its slot) may be freed
        return staged.batch

    def _account(self) -> None:
        ops = self._ops
        while self._timings and ops.query(self._timings[0][0]) and ops.query(self._timings[0][1]):
            step_done, copied = self._timings.popleft()
            self.gpu_idle_s += max(0.0, ops.elapsed_s(step_done, copied))


class DevicePrefetcher:
    """Wraps an iterable of batches (tensors in any nesting of dicts, lists and tuples; what is
    not a tensor travels unchanged) and yields them on ``device``, each copied one step ahead on
    a side stream by a :class:`PrefetchIterator` per ``iter()``. For ``device=None`` or a CPU
    device it yields the batches unchanged (the caller finishes them). ``finish`` runs on each
    copied batch on the side stream, after its copy. ``ops`` replaces the device's streams and events
    (a test's fake); by default they are ``torch.cuda``'s for ``device``.

    ``gpu_idle_s`` is the sum over its iterators (see :class:`PrefetchIterator`)."""

    def __init__(
        self,
        batches: Iterable[Any],
        device: str | torch.device | None,
        *,
        ops: DeviceOps[Any, Any] | None = None,
        finish: Callable[[Any], Any] | None = None,
    ) -> None:
        self._batches = batches
        self._finish = finish
        if ops is None:
            dev = cuda_device(device)
            ops = None if dev is None else CudaOps(dev)
        self._ops = ops
        self._idle_before_s = 0.0  # of the iterators before the current one
        self._current: PrefetchIterator[Any, Any] | None = None

    def __len__(self) -> int:
        return len(self._batches)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        if self._ops is None:
            return iter(self._batches)
        if self._current is not None:
            self._idle_before_s += self._current.gpu_idle_s
        self._current = PrefetchIterator(iter(self._batches), self._ops, self._finish)
        return self._current

    @property
    def gpu_idle_s(self) -> float:
        current = 0.0 if self._current is None else self._current.gpu_idle_s
        return self._idle_before_s + current
