"""Joining worker processes that are leaving, off the consumer's thread.

A worker told to stop closes its result pipe as the last thing ``worker_main`` does; from then on
it touches nothing the main process owns (no slot, no descriptor, no pipe). What remains is the
exit itself, where the kernel takes apart an address space that fork copied from a parent with
torch loaded, during which a joining parent would sit idle. So the pool waits
only for that goodbye (NOTE [shutdown order] in ``_pool.py``) and hands the processes to
:func:`reap`, whose thread joins them, and sends SIGTERM, then SIGKILL, to one that hangs in its
exit (a user's ``atexit`` handler, say).

The thread starts on first use and lives as long as the process. A forked child starts with a
reaper of its own: its parent's workers are not its to join, so it also drops them from
multiprocessing's own list of children, whose exit handler would otherwise join them (and fail,
exiting the child with status 1, when fork copied one that the parent was closing). At interpreter exit, before
multiprocessing's own exit handler, :func:`flush` waits until everything handed over is joined.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing.util  # noqa: F401  (its exit handler is registered first, so runs after ours)
import os
import queue
import threading
import time
import weakref
from multiprocessing import process as mp_process
from typing import Any

from fastload._threads import start_own_thread

GRACE_S = 5.0  # how long a process that said goodbye may take to exit before SIGTERM
_SIGNAL_WAIT_S = 1.0  # after SIGTERM, and after SIGKILL


def join_or_kill(procs: list[Any], timeout_s: float) -> None:
    """Join every process in ``procs`` against one deadline ``timeout_s`` away, never one per
    process; SIGTERM those still running, then SIGKILL, waiting a second after each; close
    (release the descriptors of) every one that exited."""
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for signal_name in ("terminate", "kill"):
        stragglers = [p for p in procs if p.is_alive()]
        if not stragglers:
            break
        for proc in stragglers:
            with contextlib.suppress(OSError):
                getattr(proc, signal_name)()
        for proc in stragglers:
            proc.join(_SIGNAL_WAIT_S)
    for proc in procs:
        with contextlib.suppress(ValueError):  # one that survived SIGKILL (stuck in the kernel)
            proc.close()


class _Reaper:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[list[Any] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def reap(self, procs: list[Any]) -> None:
        self._queue.put(procs)
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = start_own_thread(self._run, "fastload-reaper")

    def _run(self) -> None:
        while (procs := self._queue.get()) is not None:
            try:
                join_or_kill(procs, GRACE_S)
            except Exception:  # one process's trouble must not leave every later one unjoined
                continue

    def flush(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)  # after everything handed over so far
            thread.join()


_reaper = _Reaper()


#: Every worker process this process started (weakly): what a forked child must not join.
_started: weakref.WeakSet[Any] = weakref.WeakSet()


def track(proc: Any) -> None:
    """Remember ``proc``, a worker just started, as this process's (see the module text)."""
    _started.add(proc)


def reap(procs: list[Any]) -> None:
    """Join ``procs`` (processes that are leaving and will touch nothing of ours again) in the
    background, escalating as :func:`join_or_kill` does after :data:`GRACE_S`."""
    if procs:
        _reaper.reap(procs)


@atexit.register  # registered after multiprocessing's handler, so it runs before it
def flush() -> None:
    """Wait until every process handed to :func:`reap` so far has been joined."""
    _reaper.flush()


def _fresh_in_child() -> None:
    global _reaper, _started
    _reaper = _Reaper()
    children = getattr(mp_process, "_children", None)  # multiprocessing's, copied by fork
    for proc in list(_started):
        if children is not None:
            children.discard(proc)
    _started = weakref.WeakSet()


os.register_at_fork(after_in_child=_fresh_in_child)
