"""A fixed-size histogram of durations on a logarithmic scale, for wait-time quantiles.

Memory is constant (one int64 counter per bucket, a few hundred buckets) however long training
runs, and recording is O(1). The price is a bounded relative error; see :class:`LogHistogram`.
"""

from __future__ import annotations

import math

import numpy as np

#: Durations below this (seconds) share one bucket and report as 0: a wait of less than a
#: microsecond is "no wait" for every purpose of these metrics.
MIN_S = 1e-6
#: Durations above this (seconds) are clamped into the last bucket.
MAX_S = 1e4
#: Ratio between the edges of consecutive buckets. Reporting a bucket's geometric midpoint
#: keeps the relative error of every reported quantile within ``sqrt(RATIO) - 1`` (2.47 %).
RATIO = 1.05
_LOG_RATIO = math.log(RATIO)


class LogHistogram:
    """Counts durations in buckets ``[MIN_S·RATIO^k, MIN_S·RATIO^(k+1))``.

    :meth:`quantile` returns the nearest-rank quantile of the recorded values with this error
    bound: for a true quantile ``v`` in ``[MIN_S, MAX_S]`` the result ``r`` satisfies
    ``|r - v| <= (sqrt(RATIO) - 1) * v`` (2.47 %); below ``MIN_S`` it returns 0 (absolute error
    under 1 µs); above ``MAX_S`` it returns about ``MAX_S``.
    """

    def __init__(self) -> None:
        # Bucket 0 holds values below MIN_S; bucket k >= 1 holds [MIN_S·R^(k-1), MIN_S·R^k).
        self._buckets = math.ceil(math.log(MAX_S / MIN_S) / math.log(RATIO)) + 1
        self._counts = np.zeros(self._buckets, dtype=np.int64)
        self._total = 0

    @property
    def count(self) -> int:
        """How many values were recorded."""
        return self._total

    def _bucket(self, seconds: float) -> int:
        if seconds < MIN_S:
            return 0
        return min(self._buckets - 1, 1 + int(math.log(seconds / MIN_S) / _LOG_RATIO))

    def record(self, seconds: float) -> None:
        """Count one duration (seconds, >= 0)."""
        self._counts[self._bucket(seconds)] += 1
        self._total += 1

    def record_all(self, values: list[float]) -> None:
        """Count each of ``values`` as :meth:`record` would, in one call."""
        np.add.at(self._counts, [self._bucket(s) for s in values], 1)
        self._total += len(values)

    def absorb(self, other: LogHistogram) -> None:
        """Add the counts of ``other`` (a histogram with the same buckets) to these."""
        self._counts += other._counts
        self._total += other._total

    def quantile(self, q: float) -> float | None:
        """The nearest-rank ``q``-quantile in seconds (``0 <= q <= 1``), within the bound of the
        class docstring; ``None`` when nothing was recorded."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile: q must be in [0, 1]; got {q}")
        if self._total == 0:
            return None
        rank = max(1, math.ceil(q * self._total))  # nearest rank, 1-based
        index = int(np.searchsorted(np.cumsum(self._counts), rank))
        if index == 0:
            return 0.0
        return MIN_S * RATIO ** (index - 0.5)
