"""The fast path's driver: receives and decodes batches and dispatches the next tasks, either
on the consumer's own thread or on a thread of its own, whichever the consumer's pace calls for.

Two drivers of one state machine:

* **Inline** (the consumer steps fast, under ``FAST_STEP_S``): ``next()`` itself sends the next
  task and takes what the workers have finished. No second thread competes for the GIL, which
  on a small machine costs more than the work it would hide.
* **Threaded** (the consumer steps slowly, over ``SLOW_STEP_S``: a GPU step, a sleep): the
  thread ``fastload-pump`` does the same work while the consumer is away, so ``next()`` only
  takes a finished batch off a queue: after a long step everything ``next()`` touches is cold,
  so the less it does the better.

The first batch is taken inline (the workers are still being forked); the thread starts as it
is handed out and drives during the consumer's first step. From then on the pump follows the
consumer's step (the first one measured, then an exponential average), with hysteresis: a fast
consumer is back inline at its second ``next()``. A switch costs one wake-up; a parked thread
holds no descriptor and polls nothing. (The measurements behind these choices are in
``benchmarks/README.md``.)

Protocol. Each batch taken grants one task (torch's ``_try_put_index``), so at most
``prefetch_factor * num_workers`` batches are dispatched and not yet taken, as in torch. Tasks
take sample indices from ``source`` only against a grant, so the sampler runs ahead of the
consumer by that much and no more. :meth:`Pump.take` returns the next item in order:
``(OK, batch, counts)``, ``(FAILED, exception, None)`` for a batch whose building raised (the
epoch goes on), ``(ERROR, exception, None)`` when the epoch cannot go on (a crash loop; a
sampler that raised, once the batches it gave before are out), or ``(DONE, None, None)`` once
the sampler is spent and every batch taken.

Locking: ``lock`` guards the engine and the sampler; whichever driver works holds it while it
works, never while it blocks, and the consumer takes it for control (a new epoch, adding or
retiring a worker, statistics). The ready queue has its own condition, so taking a batch never
waits for the thread's work. Grants are two counters, ``_granted`` written by the consumer,
``_used`` by the driver holding ``lock``.

The thread holds no reference to the loader's iterator (only to the engine, the index source and
this object), so dropping the iterator still shuts everything down through ``__del__``.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from fastload._engine._deadline import MAX_BLOCK_S, Deadline
from fastload._engine._engine import Engine
from fastload._engine._messages import DONE, ERROR, FAILED, OK, Delivery
from fastload._threads import own_thread
from fastload._types import Counts

_END = object()  # the index source is spent
_DONE = Delivery(DONE, None, None)
_IDLE_POLL_MS = int(MAX_BLOCK_S * 1000)  # longest block; every wake re-checks worker liveness

#: The consumer's average step (seconds between taking a batch and asking for the next) above
#: which the thread takes over, and below which the consumer drives again.
SLOW_STEP_S = 1e-3
FAST_STEP_S = 0.3e-3
_STEP_WEIGHT = 0.25  # weight of the newest step in the average
_PERIOD_WEIGHT = 0.125  # weight of the newest period in the average


class Waker:
    """One non-blocking pipe the engine thread polls beside the workers' results:
    :meth:`wake` from any thread, :attr:`fd` to poll, :meth:`drain` once woken."""

    def __init__(self) -> None:
        self.fd, self._write_fd = os.pipe()
        for fd in (self.fd, self._write_fd):
            os.set_blocking(fd, False)

    def wake(self) -> None:
        with contextlib.suppress(OSError):  # full: a wake is pending anyway; closed: stopping
            os.write(self._write_fd, b"\0")

    def drain(self) -> None:
        """Read every pending wake (the poll said :attr:`fd` is readable)."""
        with contextlib.suppress(OSError):
            while os.read(self.fd, 4096):
                pass

    def close(self) -> None:
        """Idempotent; a wake after it does nothing."""
        for fd in (self.fd, self._write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fd = self._write_fd = -1


class IndexSource(Protocol):
    def __call__(self) -> Any:
        """The next task's index for the engine, or ``_END`` (see :func:`end_marker`)."""


def end_marker() -> object:
    """What an :class:`IndexSource` returns once the sampler is spent."""
    return _END


class Pump:
    """Runs ``engine`` inline or on a daemon thread; see the module docstring."""

    def __init__(
        self,
        engine: Engine,
        source: IndexSource,
        counts: Callable[[Any], Counts],
        timeout_s: float,
    ) -> None:
        self.lock = threading.Lock()
        self._engine = engine
        self._source = source
        self._counts = counts
        self._timeout_s = timeout_s
        # Appended by whichever driver holds ``lock`` (the thread under _cond too, to wake a
        # consumer waiting on it); popped by the consumer alone (without a lock where it is
        # not empty: deque operations are atomic).
        self._ready: deque[Delivery] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._granted = 0  # written by the consumer only
        self._skipped_grants = 0  # items still to be taken without granting (skip_grants)
        self._used = 0  # written under lock only
        self._spent = False  # the source returned _END (or raised) this epoch
        self._source_error: BaseException | None = None
        self._halted = False  # an ERROR or DONE was queued: nothing more this epoch
        self._ended = False  # the same, under _cond (for a consumer that waits on it)
        self._stop = False
        self._sleeping = False
        # The consumer's pace and which driver it calls for (see the module docstring).
        self._step_s = 0.0
        self._paced = False  # a step has been timed (the first sets the average outright)
        self._taken_at: float | None = None
        # The consumer's period: seconds from one take() to the next, less what it waited in
        # between (NOTE [tasks placed in time] in _engine.py), as an exponential average.
        self._period_s = 0.0
        self._entered_at: float | None = None
        self._waited_mark = 0.0  # waited_s as the last take() began
        self._taken = 0  # items taken this epoch (the tasks dispatched ahead are _used less it)
        self._threaded = False
        #: Seconds the consumer has spent blocked in get(), waiting for the workers.
        self.waited_s = 0.0
        self._park = threading.Condition(threading.Lock())
        self._waker = Waker()
        self._inline_poll: tuple[int, list[int], select.poll] | None = None  # see _inline_poller
        self._thread = own_thread(self._run_thread, "fastload-pump")
        self._started = False
        self._follow_pace()  # inline, unless the thresholds say otherwise (tests set them)

    # -- the consumer's side ------------------------------------------------------------------
    def grant(self, n: int = 1) -> None:
        """Allow ``n`` more tasks to be dispatched (inline: dispatch them). While threaded, a
        single grant does not wake the thread: a worker's next result does, or, where no task
        is in flight, the thread's own poll within half a step (:meth:`_idle_poll_ms`); a
        second pending grant (a consumer that holds its batches) or a consumer about to wait
        does."""
        self._granted += n
        if not self._threaded:
            # Inline: send it now, not at the next next(): the worker builds while the
            # consumer steps (a step later, the other worker would often sit idle meanwhile).
            with self.lock:
                if not self._halted and not self._stop:
                    try:
                        self._dispatch()
                    except BaseException as exc:  # as _guarded: the consumer raises it
                        self._halt(exc)
        elif self._sleeping and self._granted - self._used >= 2:
            self._wake()

    def take(self, _clock: Callable[[], float] = time.perf_counter) -> Delivery:
        """The next item in order, waiting for it (up to the loader's ``timeout``, if any). A
        batch, or a batch that failed, grants the next task, as torch refills after each one
        (less what :meth:`skip_grants` holds back). The threaded driver's common case, a batch
        already waiting, is a few lines here: after a long step every line runs from cold
        caches (``benchmarks/README.md``, "next() of a ready batch")."""
        now = _clock()
        entered_at = self._entered_at
        if entered_at is not None:
            period = now - entered_at - (self.waited_s - self._waited_mark)
            average = self._period_s
            self._period_s = average + _PERIOD_WEIGHT * (period - average) if average else period
        self._entered_at, self._waited_mark = now, self.waited_s
        self._taken += 1
        taken_at = self._taken_at
        if taken_at is not None:
            step = now - taken_at
            self._step_s = self._step_s + _STEP_WEIGHT * (step - self._step_s) if self._paced else step
            self._paced = True
        threaded = self._threaded
        hand_over = False
        if (self._step_s < FAST_STEP_S) if threaded else (self._step_s > SLOW_STEP_S):
            # The next() that hands over to the thread is served here, and the thread woken
            # once it is done: the batch is wanted now, and a thread driving meanwhile would
            # read the results this next() polls for, leaving it blocked up to MAX_BLOCK_S.
            hand_over = not threaded
            if threaded:
                self._follow_pace()
                threaded = False
        ready = self._ready
        if ready:  # either driver: the last poll found more than one batch
            item = ready.popleft()
        else:
            try:
                item = self._get_threaded() if threaded else self._drive_inline()
            except BaseException:
                self._taken_at = _clock()
                raise
        if item.kind <= FAILED:
            if self._skipped_grants:
                self._skipped_grants -= 1
            elif threaded and self._threaded:  # grant(1), inline for the common case
                self._granted += 1
                if self._sleeping and self._granted - self._used >= 2:
                    self._wake()
            else:
                self.grant()
        if hand_over:
            self._follow_pace()
        elif not self._started and not self._stop:
            self._start_with_the_first_step()
        self._taken_at = _clock()
        return item

    def skip_grants(self, n: int) -> None:
        """The next ``n`` items grant nothing (a worker retires: fewer tasks in flight)."""
        self._skipped_grants += n

    def _start_with_the_first_step(self) -> None:
        """The first batch is out: the thread starts and drives while the consumer takes its
        first step, so a slow consumer's second batch is waiting for it, decoded. The next
        ``take()`` hands back to the consumer if it stepped fast."""
        with self._park:
            self._threaded = True
        self._started = True
        self._thread.start()

    @property
    def threaded(self) -> bool:
        """Whether the thread drives the engine now (else ``next()`` does)."""
        return self._threaded

    def _follow_pace(self) -> None:
        """Switch drivers as the consumer's pace says."""
        if self._threaded and self._step_s < FAST_STEP_S:
            self._threaded = False
            self._wake()  # it parks at once instead of at its next result
        elif not self._threaded and self._step_s > SLOW_STEP_S:
            with self._park:
                self._threaded = True
                self._park.notify()
            if not self._started and not self._stop:
                self._started = True
                self._thread.start()

    def _get_threaded(self) -> Delivery:
        ready = self._ready
        if ready:  # the thread did the work during the step: the common case, kept short
            return ready.popleft()
        with self._cond:
            if self._granted > self._used:
                self._wake()
        deadline = Deadline(self._timeout_s)
        while True:
            with self._cond:
                if ready:
                    return ready.popleft()
                if self._ended:  # the epoch's last item was taken: nothing will come
                    return _DONE
                if not self._thread.is_alive():
                    raise RuntimeError("the DataLoader's engine thread stopped unexpectedly")
                wait_s = deadline.block_s()
                blocked_at = time.perf_counter()
                self._cond.wait(wait_s)
                self.waited_s += time.perf_counter() - blocked_at
                if ready:
                    return ready.popleft()

    def new_epoch(self, source: IndexSource, base_seed: int | None = None) -> None:
        """Start over on the same workers with a new index source; batches of the old epoch not
        yet taken are dropped. ``base_seed``: the workers' new one (see ``Resume``)."""
        with self.lock:
            self._engine.new_epoch(base_seed=base_seed)
            with self._cond:
                self._ready.clear()
                self._ended = False
            self._source = source
            self._granted = self._used = self._skipped_grants = self._taken = 0
            self._spent = self._halted = False
            self._source_error = None
            self._taken_at = None

    def wake(self) -> None:
        """Make the thread look again (after a control change made under ``lock``)."""
        self._wake()

    def close(self, join_s: float = 5.0) -> None:
        """Stop the thread (not the engine). Idempotent; safe from any thread but the pump's."""
        with self.lock:
            self._stop = True
        with self._park:
            self._park.notify()
        self._wake()
        if self._thread.ident is not None and threading.current_thread() is not self._thread:
            self._thread.join(join_s)
        with self._cond:
            self._ready.clear()
        self._waker.close()

    def _wake(self) -> None:
        self._waker.wake()

    # -- the two drivers -----------------------------------------------------------------------
    def _drive_inline(self) -> Delivery:
        """Drive the engine on this thread until the next item is ready: send what the grants
        allow, then one poll (at once when results are waiting) and take what it found."""
        deadline: Deadline | None = None
        ready_items = self._ready
        while True:
            if ready_items:
                return ready_items.popleft()
            if deadline is None:  # made only where this call has to poll
                deadline = Deadline(self._timeout_s)
            with self.lock:
                if self._stop:
                    raise RuntimeError("the DataLoader's engine was closed")
                if not self._halted and (self._granted > self._used or self._spent):
                    self._guarded(self._dispatch)  # grant() dispatched the rest already
                halted = self._halted
                if not halted:
                    generation, fds = self._engine.watch()
            if ready_items:
                return ready_items.popleft()
            if halted:  # the epoch's DONE or ERROR was taken already
                return _DONE
            wait_ms = max(1, int(deadline.block_s() * 1000))
            poller = self._inline_poller(generation, fds)
            blocked_at = time.perf_counter()
            try:
                ready = poller.poll(wait_ms)
            except InterruptedError:
                ready = []
            self.waited_s += time.perf_counter() - blocked_at
            if ready:
                with self.lock:
                    if not self._halted:
                        # No one to wake: the consumer is the only waiter, and it is here.
                        self._guarded(self._collect, ready, generation, False)

    def _inline_poller(self, generation: int, fds: list[int]) -> select.poll:
        cached = self._inline_poll
        if cached is None or cached[0] != generation or cached[1] != fds:
            poller = select.poll()
            for fd in fds:
                poller.register(fd, select.POLLIN)
            cached = self._inline_poll = (generation, fds, poller)
        return cached[2]

    def _run_thread(self) -> None:
        """The engine thread (``fastload-pump``): parked while the consumer drives, else
        :meth:`_drive_thread`."""
        while True:
            with self._park:
                while not self._threaded and not self._stop:
                    self._park.wait()
            if self._stop or not self._drive_thread():
                return

    def _drive_thread(self) -> bool:
        """The thread's loop while it drives; ``False`` once stopped, ``True`` when parked."""
        poller: select.poll | None = None
        watched: list[int] = []
        generation = -1
        ready: list[tuple[int, int]] | None = None  # what the last poll found; None: poll again
        while True:
            with self.lock:
                if self._stop:
                    return False
                if not self._threaded:
                    return True  # the consumer drives now; what was polled is its to read
                if not self._halted:
                    self._guarded(self._step, ready, generation)
                if self._halted:
                    fds: list[int] = []
                else:
                    generation, fds = self._engine.watch()
                more = self._granted > self._used and not self._spent and not self._halted
                # Nothing in flight: no worker's result will wake the thread for a grant.
                idle = self._engine.in_flight == 0 and not self._spent and not self._halted
            ready = None
            if fds != watched or poller is None:
                poller, watched = select.poll(), fds
                for fd in (*fds, self._waker.fd):
                    poller.register(fd, select.POLLIN)
            if more:
                continue  # a grant arrived while working: use it before blocking
            self._sleeping = True
            events: list[tuple[int, int]] = []
            if self._granted <= self._used or self._spent or self._halted:
                with contextlib.suppress(InterruptedError):
                    events = poller.poll(self._idle_poll_ms() if idle else _IDLE_POLL_MS)
            self._sleeping = False
            ready = [event for event in events if event[0] != self._waker.fd]
            if len(ready) < len(events):
                self._waker.drain()
            if not events:
                ready = None  # timed out, or a grant slipped in: poll the workers afresh

    def _idle_poll_ms(self) -> int:
        """How long the thread sleeps with no task in flight: half the consumer's step, so that
        the grant of a batch taken meanwhile is dispatched well before the batches queued ahead
        run out, and the consumer never has to wake the thread (a system call in ``next()``)."""
        return max(1, min(_IDLE_POLL_MS, int(self._step_s * 500)))

    # -- the work, under lock, by either driver -----------------------------------------------
    def _guarded(self, work: Callable[..., None], *args: Any) -> None:
        try:
            work(*args)
        except BaseException as exc:
            self._halt(exc)

    def _halt(self, exc: BaseException) -> None:
        """The work raised: the consumer raises it; nothing more is sent."""
        self._halted = True
        self._push(Delivery(ERROR, exc, None))

    def _step(self, ready: list[tuple[int, int]] | None, generation: int) -> None:
        self._dispatch()
        self._collect(ready, generation)

    def _dispatch(self) -> None:
        """Send a task for every grant not yet used, while the sampler has batches."""
        engine = self._engine
        while self._granted > self._used and not self._spent:
            try:
                index = self._source()
            except BaseException as exc:  # raised once the batches dispatched before it are out
                self._source_error, index = exc, _END
            ahead = self._used - self._taken  # dispatched and not taken yet
            self._used += 1
            if index is _END:
                self._spent = True
            else:
                # Due once the consumer has taken the tasks dispatched ahead of it.
                engine.put(index, ahead * self._period_s)
        if self._spent:
            self._finish_if_done()

    def _collect(
        self, ready: list[tuple[int, int]] | None, generation: int, wake_consumer: bool = True
    ) -> None:
        """Take what the workers sent (``ready``: what a poll found, or ``None`` to poll now)
        and queue the batches that may now be delivered; ``wake_consumer``: notify a consumer
        waiting for them (not needed where the consumer itself drives)."""
        engine = self._engine
        items = engine.collect(self._refill, ready, generation)
        if items:
            counts = self._counts
            for i, item in enumerate(items):
                if item.counts is None and item.kind is OK:  # the collate did not say them
                    items[i] = item._replace(counts=counts(item.value))
            if wake_consumer:
                self._push_all(items)
            else:
                self._ready.extend(items)  # atomic; the lock held keeps the thread out
        if self._spent:
            self._finish_if_done()

    def _finish_if_done(self) -> None:
        engine = self._engine
        if self._spent and not self._halted and engine.in_flight == 0 and engine.pending == 0:
            self._halted = True
            error, self._source_error = self._source_error, None
            self._push(_DONE if error is None else Delivery(ERROR, error, None))

    def _refill(self) -> None:
        # An iterable dataset's worker ran dry: torch dispatches another task in its place.
        self._used -= 1

    def _push(self, item: Delivery) -> None:
        """Queue the epoch's last item (``DONE`` or ``ERROR``)."""
        with self._cond:
            self._ready.append(item)
            self._ended = True
            self._cond.notify()

    def _push_all(self, items: list[Delivery]) -> None:
        with self._cond:
            self._ready.extend(items)
            self._cond.notify()


__all__ = ["FAST_STEP_S", "SLOW_STEP_S", "IndexSource", "Pump", "end_marker"]
