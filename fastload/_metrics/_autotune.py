"""``AutoTuner``: the policy behind ``num_workers="auto"`` — how many workers, decided from
the stall fraction and the workers' busy time. Pure: it reads a clock and counters and returns
a decision; the engine carries it out.

The policy, evaluated once per window of ``window_s`` seconds:

* start at ``min_workers``;
* **add** a worker when the consumer's stall fraction over the window is above
  ``stall_threshold``, fewer than ``max_workers`` run (a core is free), ``memory_ok()``, and
  the workers were busy at least :data:`ADD_BUSY` of the window (when their busy time is
  known): a stall while the workers idle is not theirs to fix (a hiccup of the host, or the
  delivery of batches), and another worker would only idle too;
* **retire** a worker when the stall is at most ``stall_threshold`` and the workers are so idle
  that one fewer would still be busy less than ``1 - idle_threshold`` of the time
  (``mean_busy * n / (n - 1) < 1 - idle_threshold``; a margin, so a retirement does not bring
  the stall back);
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

#: The workers' mean busy fraction over a window below which a stall adds no worker.
ADD_BUSY = 0.5


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
    (called before each add; default: always true) and ``clock`` (monotonic seconds).
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
        if mark is None:
            self._mark = _Mark(now, wait_s, step_s, busy_s)
            return "hold"
        elapsed = now - mark.time_s
        if elapsed < self.window_s:
            return "hold"
        self._mark = _Mark(now, wait_s, step_s, busy_s)
        wait, step = wait_s - mark.wait_s, step_s - mark.step_s
        if wait < 0 or step < 0 or wait + step <= 0:
            return "hold"  # counters restarted, or the consumer did nothing this window
        if self._cooldown > 0:
            self._cooldown -= 1
            return "hold"
        busy = None
        if busy_s is not None and mark.busy_s is not None and busy_s >= mark.busy_s:
            busy = min(1.0, (busy_s - mark.busy_s) / (elapsed * self._workers))
        return self._decide(wait / (wait + step), busy)

    def _decide(self, stall: float, busy: float | None) -> Decision:
        if stall > self.stall_threshold:
            if self._workers >= self.max_workers or (busy is not None and busy < ADD_BUSY):
                return "hold"
            if self._memory_ok is not None and not self._memory_ok():
                return "hold"
            self._workers += 1
            if self._last_change == "retire":
                self._floor = max(self._floor, self._workers)
            return self._changed("add")
        if busy is None or self._workers <= self._floor:
            return "hold"
        remaining_busy = busy * self._workers / (self._workers - 1)
        if remaining_busy < 1.0 - self.idle_threshold:
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
