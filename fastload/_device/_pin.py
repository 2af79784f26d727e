"""Page-locked host memory for asynchronous host-to-device copies: :func:`pin_tree` copies a
batch into pinned memory (the generic path's way); :class:`PinnedSlots` page-locks the fast
path's reusable slots once and fences the copies queued from them (NOTE [pending copies] in
``fastload/_engine/_arena.py``)."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch


def pin_tree(data: Any) -> Any:
    """``data`` with every CPU tensor replaced by a pinned copy, keeping the container types
    (dicts, lists, tuples, named tuples) and calling ``pin_memory()`` on objects that have one,
    as torch's DataLoader does. Call it only when CUDA is available."""
    if isinstance(data, torch.Tensor):
        return data.pin_memory()
    if isinstance(data, (str, bytes)):
        return data
    if isinstance(data, Mapping):
        pinned = {k: pin_tree(v) for k, v in data.items()}
        try:
            return type(data)(pinned)  # type: ignore[call-arg]
        except TypeError:
            return pinned
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(pin_tree(v) for v in data))
    if isinstance(data, tuple):
        return tuple(pin_tree(v) for v in data)
    if isinstance(data, Sequence):
        try:
            return type(data)([pin_tree(v) for v in data])  # type: ignore[call-arg]
        except TypeError:
            return [pin_tree(v) for v in data]
    if hasattr(data, "pin_memory"):
        return data.pin_memory()
    return data


class PinnedSlots:
    """The engine's ``SlotDevice`` for CUDA (``fastload._engine._arena``): page-locks batch
    slots, and fences the ``non_blocking`` copies a consumer queues from them.

    A fence is an event recorded on the releasing thread's current stream, and on the device's
    default stream where that is another one: the copies a training loop queues from a batch
    before dropping it (``x.to("cuda", non_blocking=True)`` on the current stream, or inside
    ``with torch.cuda.stream(s)`` when the batch is dropped there too) are before it. Recording
    an event is a driver call, no system call."""

    def page_lock(self, address: int, nbytes: int) -> Callable[[], None] | None:
        """Page-lock ``nbytes`` of host memory at ``address`` (a shared-memory segment) so that
        copies from it to the GPU run asynchronously. Returns the function that undoes it, or
        ``None`` when there is no CUDA device or the driver refused (the memory then stays
        pageable and copies are synchronous, which is still correct)."""
        if not torch.cuda.is_available():
            return None
        cudart = torch.cuda.cudart()
        if int(cudart.cudaHostRegister(address, nbytes, 0)) != 0:
            warnings.warn(
                f"cudaHostRegister refused to page-lock {nbytes / 2**20:.1f} MiB of batch slots "
                "(ulimit -l?); host-to-device copies will be synchronous",
                RuntimeWarning,
                stacklevel=2,
            )
            return None

        def unlock() -> None:
            cudart.cudaHostUnregister(address)

        return unlock

    def fence(self) -> tuple[torch.cuda.Event, ...]:
        current = torch.cuda.current_stream()
        default = torch.cuda.default_stream()
        marks = [torch.cuda.Event()]
        marks[0].record(current)
        if current != default:
            marks.append(torch.cuda.Event())
            marks[1].record(default)
        return tuple(marks)

    def passed(self, fence: tuple[torch.cuda.Event, ...]) -> bool:
        return all(event.query() for event in fence)

    def wait(self, fence: tuple[torch.cuda.Event, ...], timeout_s: float) -> bool:
        # Polled, not event.synchronize(): that cannot be bounded.
        deadline = time.monotonic() + timeout_s
        pause_s = 20e-6
        while not self.passed(fence):
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause_s)
            pause_s = min(2 * pause_s, 1e-3)
        return True


_PINNED_SLOTS = PinnedSlots()


def pinned_slots() -> PinnedSlots:
    """The process's :class:`PinnedSlots` (it holds no state: one serves every loader)."""
    return _PINNED_SLOTS


def pin_failure(nbytes: int = 1 << 20) -> str | None:
    """Why ``nbytes`` of host memory cannot be page-locked here (the error's text), or ``None``
    when they can (``fastload doctor``'s check before a loader pins its slots)."""
    try:
        torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    except RuntimeError as exc:
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return None
