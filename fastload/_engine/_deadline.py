"""The loader's ``timeout``: one deadline, one message, for every place that waits for a batch."""

from __future__ import annotations

import time

from fastload.errors import LoaderTimeoutError

#: The longest single block of any wait: each wake re-checks that the workers (and the engine
#: thread) are alive, whatever the timeout.
MAX_BLOCK_S = 1.0


class Deadline:
    """``timeout_s`` (as the user gave it; 0 or less: none) from now, or from :meth:`restart`."""

    __slots__ = ("_at", "timeout_s")

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._at: float | None = None
        self.restart()

    def restart(self) -> None:
        """Something arrived: the timeout counts from now again."""
        self._at = time.monotonic() + self.timeout_s if self.timeout_s > 0 else None

    def block_s(self, longest_s: float = MAX_BLOCK_S) -> float:
        """How long the next block may last (at most ``longest_s``); raises
        :class:`~fastload.errors.LoaderTimeoutError` once the deadline has passed."""
        if self._at is None:
            return longest_s
        left = self._at - time.monotonic()
        if left <= 0:
            raise LoaderTimeoutError(f"DataLoader timed out after {self.timeout_s} seconds")
        return min(longest_s, left)
