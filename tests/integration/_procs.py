"""Looking at processes that may exit, or be reaped by fastload's reaper thread, while a test
looks at them: psutil raises ``NoSuchProcess`` for one that goes between two calls."""

from __future__ import annotations

import psutil


def alive(pid: int) -> bool:
    """Running and not a zombie; a process that exits or is reaped as we look is not alive."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def live_children() -> list[psutil.Process]:
    """This process's descendants that are alive (as :func:`alive` says)."""
    return [p for p in psutil.Process().children(recursive=True) if alive(p.pid)]
