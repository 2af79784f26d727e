"""Progress when asked for (the CLI asks unless ``--quiet``): tqdm's bar on stderr where stderr
is a terminal and tqdm is installed (an optional extra); elsewhere (CI logs, ``nohup``,
notebooks, no tqdm) a plain line on stderr every :data:`LINE_EVERY_S` seconds."""

from __future__ import annotations

import os
import sys
import time
from types import TracebackType
from typing import Any

#: Seconds between refreshes of the records/s figure.
RATE_REFRESH_S = 0.5
#: Seconds between plain progress lines, where there is no bar.
LINE_EVERY_S = 5.0
#: Test hook: seconds between plain progress lines instead of :data:`LINE_EVERY_S`.
LINE_EVERY_ENV = "_FASTLOAD_PROGRESS_EVERY_S"


class Progress:
    """Counts input bytes (the bar's unit, so tqdm shows MB/s and, when ``total_bytes`` is
    known, an ETA) and records (shown as records/s beside it)."""

    def __init__(self, *, description: str, total_bytes: int | None, enabled: bool) -> None:
        self._bar: Any = None
        self._lines = False
        self._description = description
        self._total = total_bytes
        self._bytes = self._records = 0
        self._start = self._shown = time.monotonic()
        self._every = float(os.environ.get(LINE_EVERY_ENV, LINE_EVERY_S))
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        if tqdm is None or not sys.stderr.isatty():
            self._lines = True
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
        if self._lines:
            self._line(input_bytes, records, status)
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

    def _line(self, input_bytes: int, records: int, status: str) -> None:
        self._bytes += input_bytes
        self._records += records
        now = time.monotonic()
        if now - self._shown < self._every:
            return
        self._shown = now
        done = f"{self._bytes / 1e6:,.1f} MB"
        if self._total:
            done += f" of {self._total / 1e6:,.1f} MB ({100 * self._bytes / self._total:.0f} %)"
        rate = self._records / max(now - self._start, 1e-9)
        records_part = f", {self._records:,} records, {rate:,.0f} records/s" if self._records else ""
        more = f", {status}" if status else ""
        print(
            f"{self._description}: {done}{records_part}, {now - self._start:,.0f} s{more}",
            file=sys.stderr, flush=True,
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
