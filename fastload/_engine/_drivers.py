"""The pump's two drivers (see ``_pump.py``): the consumer's own thread, driving inline in
``next()``, and the engine thread's loop. Both work the same state machine, the
:class:`~fastload._engine._pump.Pump`, under its lock."""

from __future__ import annotations

import contextlib
import select
import time
from typing import TYPE_CHECKING

from fastload._engine._deadline import MAX_BLOCK_S, Deadline
from fastload._engine._messages import DONE, Delivery

if TYPE_CHECKING:
    from fastload._engine._pump import Pump

_IDLE_POLL_MS = int(MAX_BLOCK_S * 1000)  # longest block; every wake re-checks worker liveness
_DONE = Delivery(DONE, None, None)


def drive_inline(pump: Pump) -> Delivery:
    """Drive the engine on this thread until the next item is ready: send what the grants
    allow, then one poll (at once when results are waiting) and take what it found."""
    deadline = Deadline(pump._timeout_s)
    ready_items = pump._ready
    while True:
        if ready_items:
            return ready_items.popleft()
        with pump.lock:
            if pump._stop:
                raise RuntimeError("the DataLoader's engine was closed")
            if not pump._halted and (pump._granted > pump._used or pump._spent):
                pump._guarded(pump._dispatch)  # grant() dispatched the rest already
            halted = pump._halted
            if not halted:
                generation, fds = pump._engine.watch()
        if ready_items:
            return ready_items.popleft()
        if halted:  # the epoch's DONE or ERROR was taken already
            return _DONE
        wait_ms = max(1, int(deadline.block_s() * 1000))
        poller = _inline_poller(pump, generation, fds)
        ready = []
        if pump._helps:
            # Nothing has arrived yet: rather than block, build a batch no worker has
            # started (the next one, or one after it while a worker builds the next).
            with contextlib.suppress(InterruptedError):
                ready = poller.poll(0)
            if not ready and pump._help():
                continue
        if not ready:
            blocked_at = time.perf_counter()
            try:
                ready = poller.poll(wait_ms)
            except InterruptedError:
                ready = []
            pump.waited_s += time.perf_counter() - blocked_at
        if ready:
            with pump.lock:
                if not pump._halted:
                    pump._guarded(pump._collect, ready, generation)


def _inline_poller(pump: Pump, generation: int, fds: list[int]) -> select.poll:
    cached = pump._inline_poll
    if cached is None or cached[0] != generation or cached[1] != fds:
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        cached = pump._inline_poll = (generation, fds, poller)
    return cached[2]


def run_thread(pump: Pump) -> None:
    """The engine thread (``fastload-pump``): parked while the consumer drives, else
    :func:`_drive`."""
    while True:
        with pump._park:
            while not pump._threaded and not pump._stop:
                pump._park.wait()
        if pump._stop or not _drive(pump):
            return


def _drive(pump: Pump) -> bool:
    """The thread's loop while it drives; ``False`` once stopped, ``True`` when parked."""
    poller: select.poll | None = None
    watched: list[int] = []
    generation = -1
    ready: list[tuple[int, int]] | None = None  # what the last poll found; None: poll again
    while True:
        with pump.lock:
            if pump._stop:
                return False
            if not pump._threaded:
                return True  # the consumer drives now; what was polled is its to read
            if not pump._halted:
                pump._guarded(pump._step, ready, generation)
            if pump._halted:
                fds: list[int] = []
            else:
                generation, fds = pump._engine.watch()
            more = pump._granted > pump._used and not pump._spent and not pump._halted
        ready = None
        if fds != watched or poller is None:
            poller, watched = select.poll(), fds
            for fd in (*fds, pump._waker.fd):
                poller.register(fd, select.POLLIN)
        if more:
            continue  # a grant arrived while working: use it before blocking
        pump._sleeping = True
        events: list[tuple[int, int]] = []
        if pump._granted <= pump._used or pump._spent or pump._halted:
            with contextlib.suppress(InterruptedError):
                events = poller.poll(_IDLE_POLL_MS)
        pump._sleeping = False
        ready = [event for event in events if event[0] != pump._waker.fd]
        if len(ready) < len(events):
            pump._waker.drain()
        if not events:
            ready = None  # timed out, or a grant slipped in: poll the workers afresh
