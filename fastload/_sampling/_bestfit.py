"""Best-fit decreasing, window by window: which row of a packed epoch each document goes to.

Within a window, documents come longest first; each goes to the open row whose free space is the
smallest that still holds it (among equals, the row that reached that free space last), else a
new row. Best-fit decreasing is within 11/9 of the fewest rows possible (plus a constant), and on
many short documents (a language-model corpus) it leaves only the last few rows of a window
partly empty; first-fit decreasing packs as well but costs the same, and next-fit, the one that
needs no search, wastes a tenth of every row on lognormal lengths. The compiled kernel
(``_binpack.c``) costs O(n log seq_len); this module's Python twin gives the same rows, slower,
where the kernel could not be compiled.
"""

from __future__ import annotations

import bisect

import numpy as np
import numpy.typing as npt

try:
    from fastload._sampling import _binpack  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - the build compiles it; the twin below stands in
    _binpack = None


def best_fit(
    lengths: npt.NDArray[np.int64], window_ends: npt.NDArray[np.int64], capacity: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """``(order, row_sizes)``: the documents (positions in ``lengths``) grouped by row, rows in
    the order they were opened, each row's documents in the order placed; and each row's number
    of documents. ``lengths`` (each 1..``capacity``) holds every window's documents longest
    first; window ``w`` ends at ``window_ends[w]``."""
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    window_ends = np.ascontiguousarray(window_ends, dtype=np.int64)
    if _binpack is None:
        return best_fit_python(lengths, window_ends, capacity)
    order, sizes = _binpack.best_fit(lengths, window_ends, int(capacity))
    return np.frombuffer(order, dtype=np.int64), np.frombuffer(sizes, dtype=np.int64)


def best_fit_python(
    lengths: npt.NDArray[np.int64], window_ends: npt.NDArray[np.int64], capacity: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """:func:`best_fit` in Python: the same result, about a hundred times slower."""
    if capacity < 1:
        raise ValueError("best_fit: capacity must be >= 1")
    values = lengths.tolist()
    row_of = [0] * len(values)
    free: list[int] = []
    stacks: dict[int, list[int]] = {}  # free space -> rows with it, the last to reach it on top
    rooms: list[int] = []  # the free spaces some open row has, ascending
    begin = 0
    for end in window_ends.tolist():
        if end < begin or end > len(values):
            raise ValueError("best_fit: window ends must ascend up to n")
        for doc in range(begin, end):
            length = values[doc]
            if not 1 <= length <= capacity:
                raise ValueError("best_fit: lengths must be in 1..capacity")
            at = bisect.bisect_left(rooms, length)
            if at == len(rooms):
                row = len(free)
                free.append(capacity)
            else:
                room = rooms[at]
                stack = stacks[room]
                row = stack.pop()
                if not stack:
                    del stacks[room], rooms[at]
            row_of[doc] = row
            left = free[row] = free[row] - length
            if left > 0:
                if left in stacks:
                    stacks[left].append(row)
                else:
                    stacks[left] = [row]
                    bisect.insort(rooms, left)
        begin = end
        stacks.clear()  # the window's rows are closed
        rooms.clear()
    rows = np.asarray(row_of, dtype=np.int64)
    return np.argsort(rows, kind="stable"), np.bincount(rows, minlength=len(free)).astype(np.int64)


__all__ = ["best_fit", "best_fit_python"]
