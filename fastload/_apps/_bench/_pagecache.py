"""The page cache of local files, for ``fastload bench --cold``: evict a file's pages, and count
how many are still resident (Linux ``mincore``).

Eviction is ``posix_fadvise(POSIX_FADV_DONTNEED)`` after ``os.sync()``: it needs no root, and
drops only clean pages that no process has mapped or locked; a page some process holds stays
(:func:`resident_bytes` then says how much), so a cold run is as cold as the machine allows.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
from collections.abc import Iterable

import numpy as np


def can_evict() -> bool:
    """Whether this platform has ``posix_fadvise`` (Linux and most Unixes; not macOS or
    Windows)."""
    return hasattr(os, "posix_fadvise") and hasattr(os, "POSIX_FADV_DONTNEED")


def evict(paths: Iterable[str]) -> int:
    """Write dirty pages back (``os.sync()``), then ask the kernel to drop the cached pages of
    each file in ``paths``; the bytes of the files. Raises ``OSError`` for a file that cannot
    be opened, or (``ENOTSUP``) where :func:`can_evict` is false: the platform lacks
    ``posix_fadvise``."""
    if not can_evict():
        raise OSError(
            errno.ENOTSUP,
            f"evicting files from the page cache needs posix_fadvise, which {sys.platform} lacks",
        )
    os.sync()  # DONTNEED skips dirty pages: a file written just before would stay resident
    total = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            total += os.fstat(fd).st_size
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return total


def resident_pages(path: str) -> np.ndarray | None:
    """Per page of ``path``, whether it is in the page cache (bool array), from ``mincore``
    on a map of the file that touches no page; ``None`` off Linux or for an empty file."""
    if not sys.platform.startswith("linux"):
        return None
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size == 0:
            return None
        mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    view = np.frombuffer(mapping, np.uint8)
    address = ctypes.c_void_p(view.ctypes.data)
    del view  # the map can close only once no buffer of it is exported
    try:
        vector = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mincore(address, ctypes.c_size_t(size), vector) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"mincore on {path}: {os.strerror(error)}")
        return (np.frombuffer(memoryview(vector).cast("B"), np.uint8) & 1).astype(bool)
    finally:
        mapping.close()


def resident_bytes(paths: Iterable[str]) -> int | None:
    """Bytes of ``paths`` in the page cache (whole pages), or ``None`` off Linux."""
    total = 0
    for path in paths:
        pages = resident_pages(path)
        if pages is None and not sys.platform.startswith("linux"):
            return None
        total += 0 if pages is None else int(pages.sum()) * mmap.PAGESIZE
    return total
