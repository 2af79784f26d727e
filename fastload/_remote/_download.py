"""A large object into a local file: ranged GETs by several threads, each range retried on its
own, written with ``os.pwrite`` at the object's own offsets."""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable

from fastload._remote._retry import Retrier
from fastload._threads import own_thread


def check_download_args(*, size: int, start: int, parallel: int, part_bytes: int) -> None:
    if size < 0:
        raise ValueError(f"download(size={size}): must be >= 0 bytes")
    if not 0 <= start <= size:
        raise ValueError(f"download(start={start}): must lie in [0, size={size}]")
    if parallel < 1:
        raise ValueError(f"download(parallel={parallel}): must be >= 1 request at a time")
    if part_bytes < 1:
        raise ValueError(f"download(part_bytes={part_bytes}): must be >= 1")


def download_ranges(
    url: str,
    retrier: Retrier,
    read_at: Callable[[int, int], bytes],
    fd: int,
    *,
    size: int,
    start: int,
    parallel: int,
    part_bytes: int,
    on_bytes: Callable[[int], None] | None,
) -> None:
    """Bytes ``[start, size)`` of the object into ``fd`` at the same offsets, in parts of
    ``part_bytes`` fetched by up to ``parallel`` threads (the caller's among them).

    ``read_at(offset, length)`` is one ranged GET that returns exactly ``length`` bytes or raises
    (a short reply raises :class:`ShortReadError`, which is retried). All parts share one retry
    deadline, so the whole call is bounded by the policy's ``total_s``. After the first failure
    no new part starts, the running ones finish, and the failure is raised: ranges written before
    it stay in the file, so a caller may resume from the first missing byte. ``on_bytes(n)`` is
    called, from any of the threads, after each part is written. Errors of ``os.pwrite`` (a full
    disk) propagate as they are: the caller owns the file.
    """
    parts = [(offset, min(part_bytes, size - offset)) for offset in range(start, size, part_bytes)]
    deadline = retrier.deadline()
    lock = threading.Lock()
    failed = threading.Event()
    errors: list[BaseException] = []
    taken = 0

    def work() -> None:
        nonlocal taken
        while not failed.is_set():
            with lock:
                if taken == len(parts):
                    return
                offset, length = parts[taken]
                taken += 1
            try:
                data = retrier.call(url, functools.partial(read_at, offset, length), deadline=deadline)
                _pwrite_all(fd, data, offset)
                if on_bytes is not None:
                    on_bytes(length)
            except BaseException as exc:
                with lock:
                    errors.append(exc)
                failed.set()
                return

    helpers = [own_thread(work, f"fastload-download-{i}") for i in range(min(parallel, len(parts)) - 1)]
    for helper in helpers:
        helper.start()
    work()
    for helper in helpers:
        helper.join()  # bounded: a part ends by the shared retry deadline or the socket timeout
    if errors:
        raise errors[0]


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written
