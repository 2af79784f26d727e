"""Readahead hints: telling the kernel which byte ranges of a local file will be read soon, so
that a cold disk is read ahead of the step (``ShardedDataset.willneed``).

Two parts: :func:`coalesce_ranges`, a pure function from the byte ranges of some samples to the
few page-aligned ranges worth one ``posix_fadvise`` call each, and :class:`AdviseFiles`, the
descriptors one process keeps open to make those calls.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections import OrderedDict

import numpy as np
import numpy.typing as npt

#: Coalesced ranges advised per ``willneed`` call at most: each is one system call, and a
#: prefetcher calls once per batch, so a few hundred bound its cost to well under a millisecond.
MAX_ADVISED_RANGES = 512

#: Files one process keeps a descriptor open on for hints; the least recently advised is closed
#: first, so a dataset of many shards does not use up the process's descriptors.
MAX_ADVISED_FILES = 32

#: Byte ranges of one file: ``(starts, lengths)``, int64 arrays of one length.
ByteRanges = tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]


def coalesce_ranges(
    starts: npt.NDArray[np.int64],
    lengths: npt.NDArray[np.int64],
    priority: npt.NDArray[np.int64],
    *,
    page_bytes: int = mmap.PAGESIZE,
    max_ranges: int = MAX_ADVISED_RANGES,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """The byte ranges ``[starts[i], starts[i] + lengths[i])`` of one file widened to whole
    pages (the kernel reads no less) and merged where they overlap or touch, as ``(starts,
    lengths, priority)`` sorted by offset, a merged range's priority the smallest of its parts'.
    Empty ranges are dropped.

    When more than ``max_ranges`` remain, those holding the smallest ``priority`` (a caller
    passes each range's position in its request, so the earliest needed win) are kept and the
    rest dropped: a hint is worth less the later its bytes are read, and the next call covers
    them. Cost: one sort of the ranges, O(n log n), no Python loop.
    """
    keep = lengths > 0
    starts, lengths, priority = starts[keep], lengths[keep], priority[keep]
    if starts.size == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64)
    begin = starts // page_bytes * page_bytes
    end = -(-(starts + lengths) // page_bytes) * page_bytes
    order = np.argsort(begin, kind="stable")
    begin, end, priority = begin[order], end[order], priority[order]
    # A range starts a new group unless it begins at or before the furthest end so far.
    reach = np.maximum.accumulate(end)
    first = np.ones(begin.size, bool)
    first[1:] = begin[1:] > reach[:-1]
    heads = np.flatnonzero(first)
    merged_begin = begin[heads]
    merged_end = np.maximum.reduceat(end, heads)
    rank = np.minimum.reduceat(priority, heads)
    if heads.size > max_ranges:
        chosen = earliest(rank, max_ranges)
        merged_begin, merged_end, rank = merged_begin[chosen], merged_end[chosen], rank[chosen]
    lengths_out = merged_end - merged_begin
    return merged_begin.astype(np.int64), lengths_out.astype(np.int64), rank.astype(np.int64)


def earliest(priority: npt.NDArray[np.int64], count: int) -> npt.NDArray[np.intp]:
    """The positions of the ``count`` smallest ``priority`` values (ties: the first), in
    increasing position order."""
    return np.sort(np.argsort(priority, kind="stable")[:count])


class AdviseFiles:
    """Read-only descriptors of the files this process has advised, for ``posix_fadvise``.

    Opening a descriptor changes nothing a reader sees (no lock, no map, no HDF5 state), so
    hints can be given in any process, for shards it has not opened. Thread-safe: a prefetcher
    thread and reading threads may share one. Belongs to one process (a child closes its
    inherited copy, like the readers)."""

    def __init__(self, max_files: int = MAX_ADVISED_FILES) -> None:
        self._max_files = max_files
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def advise(self, path: str, starts: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64]) -> int:
        """Advise ``POSIX_FADV_WILLNEED`` for each range of ``path``; the bytes advised. The
        kernel starts reading and returns (it may wait for a free slot in the disk's queue). A
        file that cannot be opened is not advised (0): the read that follows reports it."""
        if starts.size == 0 or not hasattr(os, "posix_fadvise"):
            return 0
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                try:
                    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                except OSError:
                    return 0
                self._fds[path] = fd
                while len(self._fds) > self._max_files:
                    os.close(self._fds.popitem(last=False)[1])
            self._fds.move_to_end(path)
            for start, length in zip(starts.tolist(), lengths.tolist(), strict=True):
                os.posix_fadvise(fd, start, length, os.POSIX_FADV_WILLNEED)
        return int(lengths.sum())

    def close(self) -> None:
        with self._lock:
            while self._fds:
                os.close(self._fds.popitem()[1])
