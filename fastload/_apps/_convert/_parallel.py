"""An ordered, bounded map over worker processes: the converter's only concurrency.

Output order is the input order whatever the number of workers, so ``--workers N`` changes the
speed and never a byte of the result. At most ``2 * workers`` items are in flight, which bounds
memory however long the input is.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from fastload._threads import start_own_thread
from fastload.errors import WorkerCrashedError

T = TypeVar("T")
R = TypeVar("R")

#: How often a worker checks that its parent is still alive.
PARENT_POLL_S = 0.5

_function: Callable[[Any], Any] | None = None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed parent nobody has reaped yet is a zombie: dead for our purpose
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return True


def _exit_when_orphaned(parent_pid: int) -> None:
    # A worker blocked on its task queue never notices a SIGKILLed parent (its parent is the
    # fork server, and the queue's pipe stays open), so it polls the process that submitted the
    # work; os._exit because nothing of the worker's is worth saving.
    while _alive(parent_pid):
        time.sleep(PARENT_POLL_S)
    os._exit(1)


def _initialize(
    make: Callable[[Any], Callable[[Any], Any]], argument: Any, parent_pid: int
) -> None:
    global _function
    start_own_thread(_exit_when_orphaned, "fastload-orphan-watch", (parent_pid,))
    _function = make(argument)


def _call(item: Any) -> Any:
    assert _function is not None, "worker used before its initializer ran"
    return _function(item)


def ordered_map(
    make: Callable[[Any], Callable[[T], R]],
    argument: Any,
    items: Iterable[T],
    *,
    workers: int,
) -> Iterator[R]:
    """Yield ``make(argument)(item)`` for each item, in order.

    ``workers == 0`` runs in this process. Otherwise ``workers`` processes forked from a fork
    server (so that no h5py, tokenizer or thread state of this process is inherited) each build
    their function once from the picklable ``make`` and ``argument``. An exception raised for an item is re-raised here, at
    that item's turn; a worker that dies raises WorkerCrashedError. The executor's management
    thread watches the workers, so a wait on a result cannot outlive a dead worker.
    """
    if workers == 0:
        function = make(argument)
        for item in items:
            yield function(item)
        return
    context = multiprocessing.get_context("forkserver")
    # The fork server imports this module (hence fastload and its dependencies) once; each
    # worker is then a cheap fork of that clean, single-threaded process, never of this one.
    context.set_forkserver_preload([__name__])
    pool = ProcessPoolExecutor(
        max_workers=workers,
        mp_context=context,
        initializer=_initialize,
        initargs=(make, argument, os.getpid()),
    )
    pending: deque[Future[R]] = deque()
    try:
        for item in items:
            pending.append(pool.submit(_call, item))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except BrokenProcessPool as exc:
        raise WorkerCrashedError(
            f"a converter worker process died unexpectedly ({exc}); "
            f"retry with fewer --workers or --workers 0 to see the failure in this process"
        ) from exc
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
