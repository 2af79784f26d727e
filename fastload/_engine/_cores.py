"""Which CPUs the fast path's workers run on: every CPU the main process may use but the one
its consumer runs on, unless a trial shows a starved consumer better served with them
everywhere.

On the fast path a worker builds a batch in about as much CPU time as the consumer takes to
receive it and step, so on a small machine the consumer is the bottleneck, and every moment a
worker holds the consumer's CPU is a moment the consumer waits for it; the scheduler finds the
placement that avoids this only some of the time.

The price would be a worker-bound loader (heavy batches, few cores) losing a CPU. So the first
time the consumer spends more than ``STARVED`` of a window of ``WINDOW`` batches waiting in
``next()``, the workers get every CPU for a trial: one window released, one confined again,
and they keep every CPU only if the released window delivered batches faster than both
confined ones by ``GAIN``. Windows start once ``WARMUP`` batches are out, because a fresh
worker's first batches are slow (page faults into the file and the slots). The trial is there
because a starved consumer does not always mean the workers lack a CPU (another busy process
on the machine, say). A trial that fails is tried again after ``RETRY`` windows, then after
twice as many each time. (The measurements behind these rules are in ``benchmarks/README.md``,
"Measurements behind the design".)

Only the fast path does this (the generic path's workers are usually the bottleneck), only
where the main process may run on two CPUs or more, and a ``worker_init_fn`` that sets its
own affinity wins: the workers apply the confinement before calling it, and it is lifted only
from workers still confined as they were.
"""

from __future__ import annotations

import contextlib
import os

WARMUP = 128  # batches delivered before the first window opens
WINDOW = 64  # batches per window
STARVED = 0.25  # share of a window's time spent waiting for batches that starts a trial
GAIN = 1.05  # how much faster the released window must deliver for the release to stay
RETRY = 8  # windows after a failed trial before the next one (doubling each time)

RELEASE, CONFINE = "release", "confine"  # what ConsumerCore.observe asks for


def _current_cpu() -> int | None:
    """The CPU the calling thread last ran on (Linux), or ``None``."""
    try:
        with open("/proc/thread-self/stat") as f:
            # Field 39 ("processor"), counted after the parenthesised command name.
            return int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, IndexError, ValueError):
        return None


class ConsumerCore:
    """Decided on the consumer's thread: set up as the iterator starts its workers, then fed
    every delivery by :meth:`observe` until :attr:`deciding` turns false."""

    def __init__(self) -> None:
        self.worker_cpus: frozenset[int] | None = None  # None: the workers run anywhere
        self._allowed: frozenset[int] = frozenset()
        self._confined: frozenset[int] = frozenset()
        self._delivered = 0
        self._window: tuple[float | None, float] = (None, 0.0)  # (start, waited_s by then)
        self._phase = "off"  # "confined", "trial-released", "trial-confined", "off"
        self._rates: list[float] = []  # batches per second: confined before, released
        self._hold = 0  # windows to let pass before the next trial
        self._retry = RETRY
        if not hasattr(os, "sched_getaffinity"):
            return
        allowed = frozenset(os.sched_getaffinity(0))
        cpu = _current_cpu()
        if cpu is not None and cpu in allowed and len(allowed) >= 2:
            self._allowed = allowed
            self._confined = self.worker_cpus = allowed - {cpu}
            self._phase = "confined"

    @property
    def confining(self) -> bool:
        return self.worker_cpus is not None

    @property
    def deciding(self) -> bool:
        """Whether deliveries are still watched (false once the workers run anywhere for good,
        or where nothing was confined)."""
        return self._phase != "off"

    def observe(self, now: float, waited_s: float) -> str | None:
        """A batch was delivered at ``now`` (seconds); the consumer has waited ``waited_s`` for
        batches in all so far. Returns :data:`RELEASE` or :data:`CONFINE` when the window just
        closed says so (the caller then calls :meth:`release` or :meth:`confine`), else ``None``."""
        self._delivered += 1
        if self._delivered < WARMUP or (self._delivered - WARMUP) % WINDOW:
            return None
        return self.observe_window(now, waited_s)

    def observe_window(self, now: float, waited_s: float) -> str | None:
        """:meth:`observe` at a window's boundary (the ``WARMUP``-th delivery, then every
        ``WINDOW``-th), for a caller that counts the deliveries itself."""
        started, waited_before = self._window
        self._window = (now, waited_s)
        if started is None or now <= started:
            return None
        rate = WINDOW / (now - started)
        phase = self._phase
        if phase == "confined":
            if self._hold:
                self._hold -= 1
            elif waited_s - waited_before > STARVED * (now - started):
                self._rates = [rate]
                self._phase = "trial-released"
                return RELEASE
        elif phase == "trial-released":
            self._rates.append(rate)
            self._phase = "trial-confined"
            return CONFINE
        elif phase == "trial-confined":
            before, released = self._rates
            if released > GAIN * max(before, rate):
                self._phase = "off"
                return RELEASE
            self._phase = "confined"
            self._hold, self._retry = self._retry, 2 * self._retry
        return None

    def release(self, pids: list[int]) -> None:
        """Let the workers (and any started later) run on every CPU; a worker whose affinity
        its ``worker_init_fn`` changed is left alone."""
        if self.worker_cpus is not None:
            self.worker_cpus = None
            self._place(pids, self._confined, self._allowed)

    def confine(self, pids: list[int]) -> None:
        """Hold the workers (and any started later) off the consumer's CPU again."""
        if self.worker_cpus is None and self._confined:
            self.worker_cpus = self._confined
            self._place(pids, self._allowed, self._confined)

    @staticmethod
    def _place(pids: list[int], were: frozenset[int], cpus: frozenset[int]) -> None:
        for pid in pids:
            with contextlib.suppress(OSError):  # gone already: it was respawned or retired
                if frozenset(os.sched_getaffinity(pid)) == were:
                    os.sched_setaffinity(pid, cpus)


__all__ = ["CONFINE", "GAIN", "RELEASE", "RETRY", "STARVED", "WARMUP", "WINDOW", "ConsumerCore"]
