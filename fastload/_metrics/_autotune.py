"""``AutoTuner``: the policy behind ``num_workers="auto"`` — how many workers, decided from
the stall fraction and the workers' busy time. Pure: it reads a clock and counters and returns
a decision; the engine carries it out.

The policy, evaluated once per window of ``window_s`` seconds:

* start at ``min_workers``;
* **add** a worker when the consumer's stall fraction over the window is above
  ``stall_threshold``, a core is free for it (see below), ``memory_ok()``, and the workers
  were *saturated*, busy at least :data:`ADD_BUSY` of the window (when their busy time is
  known): only then were they the limit;
* a stall while the workers are not saturated is not theirs to fix: the limit is the consumer's
  own cost per batch (receiving and handing out batches, which the meter counts as waiting: at
  step 0 the stall is near 100 % whatever the pool), a hiccup of the host, or the cores. The
  model of the time per batch (``benchmarks/README.md``, "The consumer's time per batch"):
  ``n`` workers that take ``b`` seconds to build a batch deliver at most ``n / b`` batches/s,
  a consumer that spends ``c`` seconds of its own and steps ``s`` seconds per batch takes at
  most ``1 / (c + s)``; the best count is the fewest workers that reach the consumer's
  ceiling, ``n* = b / (c + s)``, where their busy fraction ``b / ((c + s) n)`` is just under 1.
  Past it another worker only idles, and takes a core from the consumer. A busy fraction near
  1 cannot be told from saturation (above), so the tuner settles on the fewest workers that
  stay under :data:`ADD_BUSY`, about ``n* / ADD_BUSY``, and never grows past it;
* **retire** a worker when the stall is at most ``stall_threshold``, or is not the workers'
  (above), and the workers are so idle that one fewer would still be busy less than
  ``1 - idle_threshold`` of the time (``mean_busy * n / (n - 1) < 1 - idle_threshold``; a
  margin, so a retirement brings back neither the stall nor saturation);
* **cores**: with ``cpu_clock`` (the CPU seconds of the thread that takes the batches), a
  worker is added only while the workers, it included, and the consumer's share of a core
  (``u``, over the window) fit in ``max_workers`` cores with at most half a core short
  (``n + 1 + u <= max_workers + 0.5``): a consumer busy 60 % of the time leaves 15 of 16
  cores to the workers, one busy half the time on 2 cores leaves both;
* after any change, skip ``cooldown_windows`` windows: they mix the old and new worker counts
  and a new worker's start-up;
* **never oscillate**: once a retirement has been followed by an add (one fewer proved too
  few), the count after that add becomes a floor that later retirements respect. Each reversal
  raises the floor, which is bounded by ``max_workers``, so the count changes finitely often.

The batch order never depends on the decisions (the plan is fixed); only the speed does.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from fastload._metrics._clock import Clock

Decision = Literal["add", "retire", "hold"]

#: The workers' mean busy fraction over a window from which they count as saturated: a stall
#: adds a worker only then. Well under 1: a saturated worker still spends part of each batch
#: reading its task and sending the reply, outside the busy time it reports (on the fast path
#: a batch of 64 builds in about 45 us, its messages take 10-15 us more).
ADD_BUSY = 0.7


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@dataclass(frozen=True)
class _Mark:
    """Counters at the start of the current window."""

    time_s: float
    wait_s: float
    step_s: float
    busy_s: float | None
    cpu_s: float | None


class AutoTuner:
    """Decides, window by window, whether to add a worker, retire one or hold.

    Call :meth:`observe` with the consumer's cumulative ``wait_s`` and ``step_s`` (those of a
    run-wide :class:`~fastload._metrics.StallMeter`) and the workers' cumulative busy seconds
    summed over all workers (``busy_s``; ``None`` if unknown, which disables retiring) as often
    as convenient — every batch is fine; only the first call after each window has elapsed on
    ``clock`` decides. Counters that go backwards (a new meter) start a new window.

    Options (keyword-only, validated): ``min_workers`` (>= 1, the starting count),
    ``max_workers`` (default: the cores this process may use), ``stall_threshold`` in (0, 1),
    ``idle_threshold`` in (0, 1), ``window_s`` > 0, ``cooldown_windows`` >= 0, ``memory_ok``
    (called before each add; default: always true), ``clock`` (monotonic seconds) and
    ``cpu_clock`` (CPU seconds of the consumer's thread, read once a window; default: none,
    and the cores limit is ``max_workers`` alone).
    """

    def __init__(
        self,
        *,
        min_workers: int = 1,
        max_workers: int | None = None,
        stall_threshold: float = 0.02,
        idle_threshold: float = 0.3,
        window_s: float = 1.0,
        cooldown_windows: int = 1,
        memory_ok: Callable[[], bool] | None = None,
        clock: Clock = time.perf_counter,
        cpu_clock: Clock | None = None,
    ) -> None:
        self.min_workers = _int("min_workers", min_workers, minimum=1)
        cores = available_cores() if max_workers is None else max_workers
        self.max_workers = _int("max_workers", cores, minimum=self.min_workers)
        self.stall_threshold = _fraction("stall_threshold", stall_threshold)
        self.idle_threshold = _fraction("idle_threshold", idle_threshold)
        if not (isinstance(window_s, (int, float)) and math.isfinite(window_s) and window_s > 0):
            raise ValueError(f"AutoTuner: window_s must be a number of seconds > 0; got {window_s!r}")
        self.window_s = float(window_s)
        self.cooldown_windows = _int("cooldown_windows", cooldown_windows, minimum=0)
        self._memory_ok = memory_ok
        self._clock = clock
        self._cpu_clock = cpu_clock
        self._workers = self.min_workers
        self._floor = self.min_workers
        self._last_change: Decision = "hold"
        self._cooldown = 0
        self._mark: _Mark | None = None

    @property
    def num_workers(self) -> int:
        """The worker count the tuner wants now (the last decision applied)."""
        return self._workers

    @property
    def floor(self) -> int:
        """The fewest workers the tuner will retire down to (see the module docstring)."""
        return self._floor

    def observe(self, *, wait_s: float, step_s: float, busy_s: float | None = None) -> Decision:
        """Take the cumulative counters; at the end of a window, decide. ``"add"`` and
        ``"retire"`` have already updated :attr:`num_workers` by one."""
        now = self._clock()
        mark = self._mark
        if mark is not None and now - mark.time_s < self.window_s:
            return "hold"
        cpu_s = self._cpu_clock() if self._cpu_clock is not None else None  # once a window
        self._mark = _Mark(now, wait_s, step_s, busy_s, cpu_s)
        if mark is None:
            return "hold"
        elapsed = now - mark.time_s
        wait, step = wait_s - mark.wait_s, step_s - mark.step_s
        if wait < 0 or step < 0 or wait + step <= 0:
            return "hold"  # counters restarted, or the consumer did nothing this window
        if self._cooldown > 0:
            self._cooldown -= 1
            return "hold"
        busy = None
        if busy_s is not None and mark.busy_s is not None and busy_s >= mark.busy_s:
            busy = min(1.0, (busy_s - mark.busy_s) / (elapsed * self._workers))
        consumer = 0.0  # the consumer's share of a core over the window
        if cpu_s is not None and mark.cpu_s is not None and cpu_s >= mark.cpu_s:
            consumer = min(1.0, (cpu_s - mark.cpu_s) / elapsed)
        return self._decide(wait / (wait + step), busy, consumer)

    def _decide(self, stall: float, busy: float | None, consumer: float = 0.0) -> Decision:
        saturated = busy is None or busy >= ADD_BUSY
        if stall > self.stall_threshold and saturated:
            if self._workers + 1 + consumer > self.max_workers + 0.5:
                return "hold"  # no core is free for another worker
            if self._memory_ok is not None and not self._memory_ok():
                return "hold"
            self._workers += 1
            if self._last_change == "retire":
                self._floor = max(self._floor, self._workers)
            return self._changed("add")
        if busy is None or self._workers <= self._floor:
            return "hold"
        remaining_busy = busy * self._workers / (self._workers - 1)
        limit = 1.0 - self.idle_threshold
        if stall > self.stall_threshold:  # not the workers' stall: they must stay unsaturated
            limit = min(limit, ADD_BUSY)
        if remaining_busy < limit:
            self._workers -= 1
            return self._changed("retire")
        return "hold"

    def _changed(self, decision: Decision) -> Decision:
        self._last_change = decision
        self._cooldown = self.cooldown_windows
        return decision


def _int(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"AutoTuner: {name} must be an integer; got {value!r}")
    if value < minimum:
        raise ValueError(f"AutoTuner: {name} must be >= {minimum}; got {value}")
    return value


def _fraction(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ValueError(f"AutoTuner: {name} must be a fraction in (0, 1); got {value!r}")
    return float(value)
