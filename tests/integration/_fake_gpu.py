"""A device for the engine's page-locked slots whose one stream the test runs by hand.

:class:`FakeGPU` is a ``SlotDevice`` (``fastload._engine._arena``): it records which host memory
is page-locked, and keeps one stream of queued work: the copies the test queues from a batch
(:meth:`FakeGPU.copy`, as ``x.to("cuda", non_blocking=True)`` would) and the fences the engine
records. Nothing on the stream runs until the test calls :meth:`FakeGPU.catch_up` or the engine
waits for a fence; a copy reads the host memory only then, as a DMA engine does, and counts as
corrupt when the bytes it finds are not the ones the batch held when the copy was queued.
"""

from __future__ import annotations

import ctypes
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch


class FakeGPU:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.locked: dict[int, int] = {}  # page-locked ranges: address -> bytes
        self.ever_locked: list[tuple[int, int]] = []
        # The stream: ("copy", address, bytes it must read) and ("fence", number), in order.
        self._stream: deque[tuple[Any, ...]] = deque()
        self._fences = 0  # fences recorded
        self._passed = 0  # fences the stream has run past
        self.copies = 0  # copies run
        self.corrupt = 0  # copies that read bytes other than those queued
        self.waits = 0  # fences the engine waited for

    # -- the SlotDevice ---------------------------------------------------------------------
    def page_lock(self, address: int, nbytes: int) -> Callable[[], None]:
        with self._lock:
            self.locked[address] = nbytes
            self.ever_locked.append((address, nbytes))

        def unlock() -> None:
            with self._lock:
                del self.locked[address]

        return unlock

    def fence(self) -> int:
        with self._lock:
            number = self._fences
            self._fences += 1
            self._stream.append(("fence", number))
            return number

    def passed(self, fence: int) -> bool:
        return fence < self._passed

    def wait(self, fence: int, timeout_s: float) -> bool:
        with self._lock:
            self.waits += 1
            self._run(until=fence)
        return True

    # -- the test's side --------------------------------------------------------------------
    def copy(self, batch: dict[str, Any]) -> None:
        """Queue a copy of each tensor of ``batch``; each reads its memory when it runs."""
        with self._lock:
            for value in batch.values():
                if isinstance(value, torch.Tensor):
                    queued = value.contiguous().numpy().tobytes()
                    self._stream.append(("copy", value.data_ptr(), queued))

    def catch_up(self) -> None:
        """Run everything queued."""
        with self._lock:
            self._run(until=None)

    def pending(self) -> list[tuple[int, int]]:
        """The host ranges that queued copies have yet to read."""
        with self._lock:
            return [(item[1], len(item[2])) for item in self._stream if item[0] == "copy"]

    def is_locked(self, tensor: torch.Tensor) -> bool:
        start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
        with self._lock:
            return any(a <= start and end <= a + n for a, n in self.locked.items())

    def _run(self, until: int | None) -> None:
        while self._stream:
            item = self._stream.popleft()
            if item[0] == "copy":
                _, address, queued = item
                self.copies += 1
                self.corrupt += ctypes.string_at(address, len(queued)) != queued
            else:
                self._passed = item[1] + 1
                if item[1] == until:
                    return


def overlaps(batch: dict[str, Any], ranges: list[tuple[int, int]]) -> bool:
    """Whether a tensor of ``batch`` lies in one of the ``(address, bytes)`` ``ranges``."""
    for value in batch.values():
        if isinstance(value, torch.Tensor):
            start = value.data_ptr()
            end = start + value.numel() * value.element_size()
            if any(start < a + n and a < end for a, n in ranges):
                return True
    return False
