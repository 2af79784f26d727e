"""The engine on a thread of the main process: batches are received and decoded, and the next
tasks dispatched, while the consumer is busy elsewhere (a GPU step, a sleep), so ``next()`` only
takes a finished batch off a queue.

Without it, each ``next()`` pays for receiving a descriptor, wrapping the slot in tensors and
sending the next task. That is a few hundred microseconds right after the consumer slept (cold
caches; waking a worker), which is 5-10 % of a 10 ms step. On the thread the same work overlaps
the step: it needs the GIL only for short bursts and blocks in ``poll`` otherwise.

Protocol. The consumer ``grant()``s one task per batch it takes (torch's ``_try_put_index``),
so at most ``prefetch_factor * num_workers`` batches are dispatched and not yet taken, as in
torch. The thread takes sample indices from ``source`` only when it has a grant, so the sampler
runs ahead of the consumer by that much and no more. ``get()`` returns the next item in order:
``(OK, batch, counts)``, ``(FAILED, exception, None)`` for a batch whose building raised (the
epoch goes on), ``(ERROR, exception, None)`` when the epoch cannot go on (a crash loop; a
sampler that raised, once the batches it gave before are out), or ``(DONE, None, None)`` once the sampler is spent and every batch taken.

Locking: ``lock`` guards the engine and the sampler; the thread holds it while it works, never
while it blocks, and the consumer takes it for control (a new epoch, adding or retiring a worker,
statistics). The ready queue has its own condition, so taking a batch never waits for the
thread's work. Grants are two counters, each written by one thread only.

The thread holds no reference to the loader's iterator (only to the engine, the index source and
this object), so dropping the iterator still shuts everything down through ``__del__``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from fastload._engine._engine import DONE, Engine
from fastload._engine._worker import FAILED, OK
from fastload.errors import LoaderTimeoutError


def _libc_write() -> Callable[[int, bytes, int], int]:
    """libc's ``write`` called with the GIL held (``ctypes.PyDLL``), or a stand-in returning -1
    where there is no libc to load."""
    try:
        write = ctypes.PyDLL(None).write
    except (OSError, AttributeError):
        return lambda fd, data, n: -1
    write.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t)
    write.restype = ctypes.c_ssize_t
    return write


_write_holding_gil = _libc_write()

ERROR = -2  # the epoch cannot go on: raise and stop
_END = object()  # the index source is spent
_IDLE_POLL_MS = 1000  # longest block; every wake re-checks worker liveness


class IndexSource(Protocol):
    def __call__(self) -> Any:
        """The next task's index for the engine, or ``_END`` (see :func:`end_marker`)."""


def end_marker() -> object:
    """What an :class:`IndexSource` returns once the sampler is spent."""
    return _END


class Pump:
    """Runs ``engine`` on a daemon thread; see the module docstring."""

    def __init__(
        self, engine: Engine, source: IndexSource, counts: Callable[[Any], Any], timeout_s: float
    ) -> None:
        self.lock = threading.Lock()
        self._engine = engine
        self._source = source
        self._counts = counts
        self._timeout_s = timeout_s
        self._ready: deque[tuple[int, Any, Any]] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._granted = 0  # written by the consumer only
        self._used = 0  # written by the thread only
        self._spent = False  # the source returned _END (or raised) this epoch
        self._source_error: BaseException | None = None
        self._halted = False  # an ERROR or DONE was queued: nothing more this epoch
        self._stop = False
        self._sleeping = False
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
        self._thread = threading.Thread(target=self._run, name="fastload-pump", daemon=True)
        self._thread.start()

    # -- the consumer's side ------------------------------------------------------------------
    def grant(self, n: int = 1) -> None:
        """Allow ``n`` more tasks to be dispatched. A single grant does not wake the thread:
        the consumer is about to drop its previous batch, and :meth:`nudge` (called when a slot
        is freed) wakes it outside ``next()``; a second pending grant (a consumer that holds its
        batches) or a consumer about to wait does."""
        self._granted += n
        if self._sleeping and self._granted - self._used >= 2:
            self._wake()

    def nudge(self) -> None:
        """A slot was freed: wake the thread if it has a grant to use."""
        if self._sleeping and self._granted > self._used:
            self._wake()

    def get(self) -> tuple[int, Any, Any]:
        """The next item in order, waiting for it (up to the loader's ``timeout``, if any)."""
        with self._cond:
            if self._ready:
                return self._ready.popleft()
            if self._granted > self._used:
                self._wake()
            deadline = time.monotonic() + self._timeout_s if self._timeout_s > 0 else None
            while not self._ready:
                if not self._thread.is_alive():
                    raise RuntimeError("the DataLoader's engine thread stopped unexpectedly")
                wait_s = 1.0
                if deadline is not None:
                    wait_s = deadline - time.monotonic()
                    if wait_s <= 0:
                        raise LoaderTimeoutError(
                            f"DataLoader timed out after {self._timeout_s} seconds"
                        )
                self._cond.wait(min(wait_s, 1.0))
            return self._ready.popleft()

    def new_epoch(self, source: IndexSource) -> None:
        """Start over on the same workers with a new index source; batches of the old epoch not
        yet taken are dropped."""
        with self.lock:
            self._engine.new_epoch()
            with self._cond:
                self._ready.clear()
            self._source = source
            self._granted = self._used = 0
            self._spent = self._halted = False
            self._source_error = None

    def wake(self) -> None:
        """Make the thread look again (after a control change made under ``lock``)."""
        self._wake()

    def close(self, join_s: float = 5.0) -> None:
        """Stop the thread (not the engine). Idempotent; safe from any thread but the pump's."""
        with self.lock:
            self._stop = True
        self._wake()
        if threading.current_thread() is not self._thread:
            self._thread.join(join_s)
        with self._cond:
            self._ready.clear()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_r = self._wake_w = -1

    def _wake(self) -> None:
        # Without releasing the GIL: os.write would hand it to the thread it wakes, and the
        # consumer would wait for the thread's work before its next() returns. This way the
        # thread runs when the consumer next blocks (its step) or after the switch interval.
        if _write_holding_gil(self._wake_w, b"\0", 1) < 0:
            with contextlib.suppress(OSError):  # full: a wake is pending anyway; closed: stopping
                os.write(self._wake_w, b"\0")

    # -- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        poller: select.poll | None = None
        watched: list[int] = []
        generation = -1
        ready: list[tuple[int, int]] | None = None  # what the last poll found; None: poll again
        while True:
            with self.lock:
                if self._stop:
                    return
                if not self._halted:
                    try:
                        self._step(ready, generation)
                    except BaseException as exc:  # the consumer raises it; nothing more is sent
                        self._halted = True
                        self._push((ERROR, exc, None))
                if self._halted:
                    fds: list[int] = []
                else:
                    generation, fds = self._engine.watch()
                more = self._granted > self._used and not self._spent and not self._halted
            ready = None
            if fds != watched or poller is None:
                poller, watched = select.poll(), fds
                for fd in (*fds, self._wake_r):
                    poller.register(fd, select.POLLIN)
            if more:
                continue  # a grant arrived while working: use it before blocking
            self._sleeping = True
            events: list[tuple[int, int]] = []
            if self._granted <= self._used or self._spent or self._halted:
                with contextlib.suppress(InterruptedError):
                    events = poller.poll(_IDLE_POLL_MS)
            self._sleeping = False
            ready = [event for event in events if event[0] != self._wake_r]
            if len(ready) < len(events):
                with contextlib.suppress(OSError):
                    while os.read(self._wake_r, 4096):
                        pass
            if not events:
                ready = None  # timed out, or a grant slipped in: poll the workers afresh

    def _step(self, ready: list[tuple[int, int]] | None, generation: int) -> None:
        engine = self._engine
        while self._granted > self._used and not self._spent:
            try:
                index = self._source()
            except BaseException as exc:  # raised once the batches dispatched before it are out
                self._source_error, index = exc, _END
            self._used += 1
            if index is _END:
                self._spent = True
            else:
                engine.put(index)
        items = engine.collect(self._refill, ready, generation)
        if items:
            counts = self._counts
            self._push_all([(kind, value, counts(value) if kind == OK else None) for kind, value in items])
        if self._spent and engine.in_flight == 0 and engine.pending == 0:
            self._halted = True
            error, self._source_error = self._source_error, None
            self._push((DONE, None, None) if error is None else (ERROR, error, None))

    def _refill(self) -> None:
        # An iterable dataset's worker ran dry: torch dispatches another task in its place.
        self._used -= 1

    def _push(self, item: tuple[int, Any, Any]) -> None:
        self._push_all([item])

    def _push_all(self, items: list[tuple[int, Any, Any]]) -> None:
        with self._cond:
            self._ready.extend(items)
            self._cond.notify()


__all__ = ["DONE", "ERROR", "FAILED", "OK", "IndexSource", "Pump", "end_marker"]
