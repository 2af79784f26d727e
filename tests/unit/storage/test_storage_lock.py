"""Shared locks: many holders at once, none while an exclusive one is held, and an exclusive one
refused while any shared one is held — also when the holder is another process, and until that
process dies."""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path

from fastload._storage._lock import lock, try_lock

_FORK = multiprocessing.get_context("fork")


def _hold(path: str, shared: bool, ready: multiprocessing.synchronize.Event) -> None:
    held = try_lock(Path(path), shared=shared)
    assert held is not None
    ready.set()
    signal.pause()  # until killed: the kernel drops the lock with the process


def _holder(path: Path, *, shared: bool) -> multiprocessing.process.BaseProcess:
    ready = _FORK.Event()
    process = _FORK.Process(target=_hold, args=(str(path), shared, ready), daemon=True)
    process.start()
    assert ready.wait(10), "the holder did not take its lock"
    return process


def _kill(process: multiprocessing.process.BaseProcess) -> None:
    assert process.pid is not None
    os.kill(process.pid, signal.SIGKILL)
    process.join(10)


def test_shared_locks_coexist_and_keep_an_exclusive_one_out_until_their_holder_dies(
    tmp_path: Path,
) -> None:
    path = tmp_path / ".entry.lock"
    other = _holder(path, shared=True)
    try:
        mine = try_lock(path, shared=True)
        assert mine is not None
        mine.release()
        assert try_lock(path) is None
    finally:
        _kill(other)
    exclusive = lock(path, timeout_s=5)
    exclusive.release()


def test_an_exclusive_lock_keeps_shared_ones_out_and_its_holder_is_named(tmp_path: Path) -> None:
    path = tmp_path / ".entry.lock"
    other = _holder(path, shared=False)
    try:
        assert try_lock(path, shared=True) is None
        assert f"pid {other.pid} on " in path.read_text()
    finally:
        _kill(other)
    shared = try_lock(path, shared=True)
    assert shared is not None
    shared.release()



def test_a_child_forked_while_a_lock_is_held_or_awaited_does_not_keep_it(tmp_path: Path) -> None:
    """A loader forks its workers while its main process may hold a lock, or wait on one and
    take it after the fork; a flock lives as long as any copy of its descriptor, so the child
    would hold it for its whole life. The child drops its copies as it starts."""
    import multiprocessing
    import threading
    import time

    from fastload._storage._lock import lock, try_lock

    held_path, awaited_path = tmp_path / "held.lock", tmp_path / "awaited.lock"
    blocker = lock(awaited_path, timeout_s=5)  # held by this thread until the waiter forks
    held = lock(held_path, timeout_s=5)
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(lock(awaited_path, timeout_s=10)))

    # blocker is released from another thread after the fork: the waiter then takes the lock.
    waiter.start()
    time.sleep(0.2)
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(3,))
    child.start()
    try:
        blocker.release()
        waiter.join(5)
        (awaited,) = got
        held.release()
        awaited.release()  # type: ignore[attr-defined]
        assert try_lock(held_path) is not None
        assert try_lock(awaited_path) is not None  # free, though the child still runs
        assert child.is_alive()
    finally:
        child.terminate()
        child.join(10)
        if child.is_alive():  # a child that ignores SIGTERM must not hang the suite
            child.kill()
            child.join()
