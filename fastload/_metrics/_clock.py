"""Clocks: where every measurement of the metrics package reads the time.

Production code reads :func:`time.perf_counter`; tests pass a :class:`ManualClock` and move it
by hand, so no test of the arithmetic depends on how fast the machine is.
"""

from __future__ import annotations

import math
from typing import Protocol


class Clock(Protocol):
    """A zero-argument callable returning monotonic seconds (only differences are meaningful)."""

    def __call__(self) -> float: ...


class ManualClock:
    """A clock that moves only when told to: ``advance(seconds)`` or ``set(seconds)``.

    Invariant: the time never goes backwards, so it satisfies the :class:`Clock` contract.
    """

    def __init__(self, start_s: float = 0.0) -> None:
        self._now_s = _finite("start_s", start_s)

    def __call__(self) -> float:
        return self._now_s

    def advance(self, seconds: float) -> None:
        """Move the time forward by ``seconds`` (>= 0)."""
        seconds = _finite("seconds", seconds)
        if seconds < 0:
            raise ValueError(f"ManualClock.advance: seconds must be >= 0; got {seconds}")
        self._now_s += seconds

    def set(self, now_s: float) -> None:
        """Move the time to ``now_s``, which must not be earlier than the current time."""
        now_s = _finite("now_s", now_s)
        if now_s < self._now_s:
            raise ValueError(
                f"ManualClock.set: now_s={now_s} is earlier than the current time {self._now_s}"
            )
        self._now_s = now_s


def _finite(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"ManualClock: {name} must be a finite number of seconds; got {value}")
    return value
