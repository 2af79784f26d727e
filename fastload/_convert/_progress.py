"""The progress bar: tqdm on stderr when asked for (the CLI asks when stderr is a terminal),
nothing otherwise, and nothing either when tqdm is not installed (an optional extra)."""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import Any

#: Seconds between refreshes of the records/s figure.
RATE_REFRESH_S = 0.5


class Progress:
    """Counts input bytes (the bar's unit, so tqdm shows MB/s and, when ``total_bytes`` is
    known, an ETA) and records (shown as records/s beside it)."""

    def __init__(self, *, description: str, total_bytes: int | None, enabled: bool) -> None:
        self._bar: Any = None
        self._records = 0
        self._start = self._shown = time.monotonic()
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(
            total=total_bytes,
            desc=description,
            unit="B",
            unit_scale=True,
            file=sys.stderr,
            dynamic_ncols=True,
            leave=False,
        )

    def advance(self, *, input_bytes: int, records: int, status: str = "") -> None:
        """Add ``input_bytes`` and ``records``; ``status`` (the engine's tasks done and left)
        is shown after the records/s figure."""
        if self._bar is None:
            return
        self._records += records
        self._bar.update(input_bytes)
        now = time.monotonic()
        if now - self._shown >= RATE_REFRESH_S:
            self._shown = now
            rate = self._records / max(now - self._start, 1e-9)
            more = f", {status}" if status else ""
            self._bar.set_postfix_str(
                f"{self._records:,} records, {rate:,.0f} rec/s{more}", refresh=False
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
