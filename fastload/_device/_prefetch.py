"""Copying batches to the GPU ahead of the step that needs them.

:class:`DevicePrefetcher` keeps one batch in flight: while the consumer trains on batch N (on the
current stream), batch N+1 is copied host-to-device on a side stream with ``non_blocking=True``.
The host tensors of a batch (views of a shared-memory slot on the fast path) are kept alive until
an event recorded after their copy has completed, so their slot cannot be reused while the DMA
engine still reads it. The device tensors are marked with ``record_stream`` for the consumer's
stream, so the caching allocator does not reuse their memory too early. Without CUDA (or for a
CPU device) it yields the batches unchanged.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch


def to_device(data: Any, device: torch.device, stream: Any = None) -> Any:
    """``data`` with every tensor moved to ``device`` (``non_blocking``), keeping containers."""
    if isinstance(data, torch.Tensor):
        out = data.to(device, non_blocking=True)
        if stream is not None and out.is_cuda:
            out.record_stream(stream)
        return out
    if isinstance(data, Mapping):
        return type(data)({k: to_device(v, device, stream) for k, v in data.items()})  # type: ignore[call-arg]
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(to_device(v, device, stream) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(to_device(v, device, stream) for v in data)
    return data


def cuda_available() -> bool:
    return torch.cuda.is_available()


def cuda_device(device: str | torch.device | None) -> torch.device | None:
    """The CUDA device to prefetch to, or ``None`` when batches stay where they are."""
    if device is None:
        return None
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"device={str(device)!r} was requested but CUDA is not available on this machine; "
            "pass device=None (or 'cpu') to keep batches on the host"
        )
    return dev


_EXHAUSTED = object()


class OneAhead:
    """An iterator that keeps one item staged ahead of its consumer: ``next()`` stages item N+1
    (``stage(item)``, e.g. starting its device copy) before handing out item N through
    ``hand_out(staged)``. ``on_end()`` runs once, when the consumer asks past the last item.

    Errors keep their place: when taking or staging item N+1 raises, item N is still returned,
    the error is raised by the following ``next()``, and the iterator goes on after it with the
    items that follow (as a DataLoader does after a batch whose building failed)."""

    def __init__(
        self,
        items: Iterator[Any],
        stage: Callable[[Any], Any],
        hand_out: Callable[[Any], Any],
        on_end: Callable[[], None] | None = None,
    ) -> None:
        self._items = items
        self._stage = stage
        self._hand_out = hand_out
        self._on_end = on_end
        self._ahead: Any = None  # None: nothing staged; _EXHAUSTED; or (ok, staged item | error)

    def __iter__(self) -> OneAhead:
        return self

    def _take(self) -> Any:
        try:
            return True, self._stage(next(self._items))
        except StopIteration:
            return _EXHAUSTED
        except Exception as exc:  # raised in its turn by __next__
            return False, exc

    def __next__(self) -> Any:
        current = self._take() if self._ahead is None else self._ahead
        if current is _EXHAUSTED:
            self._ahead = _EXHAUSTED
            on_end, self._on_end = self._on_end, None
            if on_end is not None:
                on_end()
            raise StopIteration
        ok, value = current
        if not ok:
            self._ahead = None  # the next call takes the item after the failed one
            raise value
        self._ahead = self._take()
        return self._hand_out(value)


class DevicePrefetcher:
    """Wraps an iterable of batches (tensors in any nesting of dicts, lists and tuples) and
    yields them on ``device``, each copied one step ahead on a side stream.

    ``gpu_idle_s`` accumulates, from CUDA events, how long the GPU waited for data: for each
    batch after the first, the time from the consumer stream finishing everything queued before
    ``next()`` to the batch's copy finishing (zero when the copy was done first). Events are read
    only once complete, so measuring never synchronizes."""

    def __init__(self, batches: Iterable[Any], device: str | torch.device | None) -> None:
        self._batches = batches
        self._device = cuda_device(device)
        self.gpu_idle_s = 0.0
        self._pending: deque[tuple[Any, Any]] = deque()  # (step done, batch ready) events

    def __len__(self) -> int:
        return len(self._batches)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        if self._device is None:
            return iter(self._batches)
        return self._prefetch(iter(self._batches), self._device)

    def _account(self) -> None:
        while self._pending and self._pending[0][0].query() and self._pending[0][1].query():
            step_done, ready = self._pending.popleft()
            self.gpu_idle_s += max(0.0, step_done.elapsed_time(ready)) / 1e3

    def _prefetch(self, it: Iterator[Any], device: torch.device) -> OneAhead:
        side = torch.cuda.Stream(device)
        consumer = torch.cuda.current_stream(device)
        hosts: deque[tuple[torch.cuda.Event, Any]] = deque()  # host batches whose copy may run
        first = True

        def start(host: Any) -> tuple[Any, torch.cuda.Event]:
            with torch.cuda.stream(side):
                dev = to_device(host, device, consumer)
                done = torch.cuda.Event(enable_timing=True)
                done.record(side)
            hosts.append((done, host))
            return dev, done

        def hand_out(staged: tuple[Any, torch.cuda.Event]) -> Any:
            nonlocal first
            batch, done = staged
            if not first:  # the consumer asked for this batch: its previous step is queued
                step_done = torch.cuda.Event(enable_timing=True)
                step_done.record(consumer)
                self._pending.append((step_done, done))
                self._account()
            first = False
            consumer.wait_event(done)
            while hosts and hosts[0][0].query():
                hosts.popleft()  # copy finished: the host batch (and its slot) may be freed
            return batch

        def end() -> None:
            side.synchronize()
            consumer.synchronize()
            self._account()
            hosts.clear()

        return OneAhead(it, start, hand_out, end)
