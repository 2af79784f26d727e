"""What the device prefetcher asks of a device: its streams and events, and moving a batch.

:class:`DeviceOps` is the one object through which the prefetcher reaches the device, so that its
order, its lifetimes and its measuring run without one: the loader passes
:class:`~fastload._device._cuda.CudaOps` (``torch.cuda``), a test a fake that runs on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

import torch

StreamT = TypeVar("StreamT")
EventT = TypeVar("EventT")


class DeviceOps(Protocol[StreamT, EventT]):
    """The device's streams and events. A stream runs the work queued on it in order; an event
    marks the work queued on a stream up to a point and completes once that work is done. Only
    :meth:`synchronize` makes the caller wait."""

    def new_stream(self) -> StreamT:
        """A new stream (the side stream that the copies run on)."""

    def current_stream(self) -> StreamT:
        """The stream that the caller's work is queued on (the consumer's)."""

    def timed_event(self) -> EventT:
        """A new event that takes its time when it completes, for :meth:`elapsed_s`."""

    def record(self, event: EventT, stream: StreamT) -> None:
        """Mark with ``event`` the work queued on ``stream`` so far."""

    def query(self, event: EventT) -> bool:
        """Whether ``event`` has completed."""

    def wait(self, stream: StreamT, event: EventT) -> None:
        """Make the work queued on ``stream`` from now on wait for ``event``."""

    def synchronize(self, stream: StreamT) -> None:
        """Return once ``stream`` has done all the work queued on it."""

    def elapsed_s(self, start: EventT, end: EventT) -> float:
        """Seconds from ``start`` to ``end``, both completed (negative when ``end`` came first)."""

    def to_device(self, data: Any, copy_on: StreamT, used_on: StreamT) -> Any:
        """``data`` with each tensor replaced by its device copy, queued on ``copy_on``. The
        copies are marked as used on ``used_on``, so that their memory is not handed out again
        before the work queued there has used them."""

    def run_on(self, fn: Callable[[Any], Any], data: Any, stream: StreamT, used_on: StreamT) -> Any:
        """``fn(data)`` with the work it queues on ``stream`` (after a copy queued there), its
        new tensors marked as used on ``used_on`` as :meth:`to_device`'s are."""


def map_tensors(data: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``data`` with ``fn(t)`` in place of each tensor ``t``, in dicts (and other mappings),
    named tuples, tuples and lists, keeping their types; anything else is returned as it is."""
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, Mapping):
        return type(data)({k: map_tensors(v, fn) for k, v in data.items()})  # type: ignore[call-arg]
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(map_tensors(v, fn) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(map_tensors(v, fn) for v in data)
    return data
