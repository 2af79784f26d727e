"""Which CPUs the fast path's workers run on: every CPU the main process may use but the one
its consumer runs on, until the consumer is seen waiting for them.

On the fast path a worker builds a batch in about as much CPU time as the consumer takes to
receive it and step, so with two cores the consumer is the bottleneck, and every moment a
worker holds the consumer's CPU is a moment the consumer waits for it. The scheduler only
finds the placement that avoids this (the consumer alone on one CPU, the workers sharing the
rest) some of the time: measured here with 2 workers on 2 cores, in fresh 1000-batch runs, the
consumer waited 20-120 µs per batch for its own CPU for hundreds of batches at a stretch.
Keeping the workers off it: +9 % samples/s (paired median of 24 interleaved runs; the variants
tried on the way measured 0 to +22 %, this machine being noisy).

The price would be a worker-bound loader (heavy batches, few cores) losing a CPU. So the
confinement ends, for good, the first time the consumer spends more than ``STARVED`` of a
window of ``WINDOW`` batches waiting in ``next()``; windows start once ``WARMUP`` batches are
out, because a fresh worker's first batches are slow (page faults into the file and the slots:
the consumer waited 44-63 % of the first 32 batches, 1-21 % of the third, about 1 % after the
fourth). Measured with batches that cost the workers 400 µs of CPU each: 121k samples/s never
confined, 90k confined throughout, 105k released after the first window.

Only the fast path does this (the generic path's workers are usually the bottleneck), only
where the main process may run on two CPUs or more, and a ``worker_init_fn`` that sets its
own affinity wins: the workers apply the confinement before calling it, and it is lifted only
from workers still confined as they were.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import threading

WARMUP = 128  # batches delivered before the first window opens
WINDOW = 64  # batches per window
STARVED = 0.25  # share of a window's time spent waiting for batches that ends the confinement


def _current_cpu() -> int | None:
    """The CPU the calling thread last ran on (Linux), or ``None``."""
    try:
        with open("/proc/thread-self/stat") as f:
            # Field 39 ("processor"), counted after the parenthesised command name.
            return int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, IndexError, ValueError):
        return None


class ConsumerCore:
    """Decided once, on the consumer's thread, as the iterator starts its workers."""

    def __init__(self) -> None:
        self.worker_cpus: frozenset[int] | None = None  # None: the workers run anywhere
        self._allowed: frozenset[int] = frozenset()
        self._delivered = 0
        self._window: tuple[float | None, float] = (None, 0.0)  # (start, waited_s by then)
        if not hasattr(os, "sched_getaffinity"):
            return
        allowed = frozenset(os.sched_getaffinity(0))
        cpu = _current_cpu()
        if cpu is not None and cpu in allowed and len(allowed) >= 2:
            self._allowed = allowed
            self.worker_cpus = allowed - {cpu}

    @property
    def confining(self) -> bool:
        return self.worker_cpus is not None

    def observe(self, now: float, waited_s: float) -> bool:
        """A batch was delivered at ``now`` (seconds); the consumer has waited ``waited_s`` for
        batches in all so far. ``True`` when the window just closed says: release them."""
        self._delivered += 1
        if self._delivered < WARMUP or (self._delivered - WARMUP) % WINDOW:
            return False
        started, waited_before = self._window
        self._window = (now, waited_s)
        return started is not None and waited_s - waited_before > STARVED * (now - started)

    def release(self, pids: list[int]) -> None:
        """Let the workers (and any started later) run on every CPU again; a worker whose
        affinity its ``worker_init_fn`` changed is left alone."""
        confined, self.worker_cpus = self.worker_cpus, None
        if confined is None:
            return
        for pid in pids:
            with contextlib.suppress(OSError):  # gone already: it was respawned or retired
                if frozenset(os.sched_getaffinity(pid)) == confined:
                    os.sched_setaffinity(pid, self._allowed)


def start_here(thread: threading.Thread) -> None:
    """Start ``thread`` on the CPU the caller runs on; it gets the caller's CPUs back as it
    begins (:func:`restore_cpus`, which its target calls first).

    ``Thread.start`` waits for the new thread to run. Placed by the scheduler, a thread started
    beside busy workers waited for one of their CPUs: 0.3-2.2 ms here (median 0.9), while the
    caller's own CPU sat idle in that wait. Held to the caller's CPU, it runs at once."""
    cpu = _current_cpu()
    allowed = allowed_cpus()
    if cpu is None or allowed is None or cpu not in allowed or len(allowed) < 2:
        thread.start()
        return
    try:
        os.sched_setaffinity(0, {cpu})  # this thread only; the new one inherits it
    except OSError:
        thread.start()
        return
    try:
        thread.start()
    finally:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, allowed)


def restore_cpus(allowed: frozenset[int] | None) -> None:
    """In a thread started by :func:`start_here`: run on ``allowed`` (what :func:`allowed_cpus`
    said before the start) again; ``None``: leave it as it is."""
    if allowed is not None:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, allowed)


def allowed_cpus() -> frozenset[int] | None:
    """The CPUs the calling thread may run on (Linux), or ``None``."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    try:
        return frozenset(os.sched_getaffinity(0))
    except OSError:
        return None


def confine(cpus: frozenset[int] | None) -> None:
    """In a worker, before ``worker_init_fn``: run on ``cpus`` (``None``: leave it as it is)."""
    if cpus is not None:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cpus)


__all__ = ["STARVED", "WARMUP", "WINDOW", "ConsumerCore", "allowed_cpus", "confine", "restore_cpus", "start_here"]
