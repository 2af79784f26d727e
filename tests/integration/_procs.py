"""Looking at processes that may exit, or be reaped by fastload's reaper thread, while a test
looks at them (psutil raises ``NoSuchProcess`` for one that goes between two calls), and
waiting for what happens in the background."""

from __future__ import annotations

import time
from collections.abc import Callable

import psutil

from fastload._engine import _zygote


def alive(pid: int) -> bool:
    """Running and not a zombie; a process that exits or is reaped as we look is not alive."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def live_children() -> list[psutil.Process]:
    """This process's descendants that are alive (as :func:`alive` says), less the worker
    server and the spares it forks whenever it is idle (``fastload/_engine/_zygote.py``): they
    live as long as this process, and come and go between any two looks. The workers it
    serves are listed."""
    server = _zygote.server_pid()
    return [
        p for p in psutil.Process().children(recursive=True)
        if p.pid != server and alive(p.pid) and not _spare(p)
    ]


def _spare(process: psutil.Process) -> bool:
    try:
        return process.name() == _zygote.SPARE_NAME.decode()
    except psutil.NoSuchProcess:
        return False


def wait_until(predicate: Callable[[], object], timeout_s: float = 5.0) -> bool:
    """Whether ``predicate()`` turned true within ``timeout_s`` (looked at every 10 ms)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return bool(predicate())
