"""How workers leave: the pool waits for each one's goodbye (its closed result pipe), and the
reaper joins the exiting processes in the background (``fastload/_engine/_reaper.py``), with real
worker processes."""

from __future__ import annotations

import gc
import multiprocessing
import multiprocessing.util
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

import fastload
from fastload._engine import _reaper

sys.path.insert(0, str(Path(__file__).parent))
from _fault_datasets import Slow
from _procs import wait_until

HERE = Path(__file__).parent


def _gone(pid: int) -> bool:
    """Exited and reaped: no process, not even a zombie, has this pid (among our children)."""
    return pid not in {p.pid for p in psutil.Process().children(recursive=True)}


def _linger_at_exit(seconds: float) -> Callable[[int], None]:
    def init(worker_id: int) -> None:
        # Runs in multiprocessing's exit handler, after worker_main has said goodbye.
        multiprocessing.util.Finalize(None, time.sleep, args=(seconds,), exitpriority=0)

    return init


def test_every_worker_is_joined_after_an_epoch() -> None:
    loader = fastload.DataLoader(Slow(40), batch_size=4, num_workers=2)
    it = iter(loader)
    pids = list(it.worker_pids)
    assert [int(v) for b in it for v in b] == list(range(40))
    _reaper.flush()  # what the interpreter's exit does: wait for the reaper to finish
    assert all(_gone(pid) for pid in pids)
    assert not {c.pid for c in multiprocessing.active_children()} & set(pids)


@pytest.mark.host_tuned  # the leaving worker's nice 19
def test_an_epoch_ends_without_waiting_for_a_worker_that_is_slow_to_exit() -> None:
    loader = fastload.DataLoader(Slow(16), batch_size=4, num_workers=1, worker_init_fn=_linger_at_exit(4.0))
    it = iter(loader)
    (pid,) = it.worker_pids
    started = time.monotonic()
    assert [int(v) for b in it for v in b] == list(range(16))
    assert time.monotonic() - started < 3.0, "the end of the epoch waited for the worker's exit"
    worker = psutil.Process(pid)
    assert worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE
    assert worker.nice() == 19  # a leaving worker never competes with the consumer for a CPU
    assert wait_until(lambda: _gone(pid), 10.0)


def test_a_worker_that_hangs_after_its_goodbye_is_terminated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_reaper, "GRACE_S", 0.3)
    loader = fastload.DataLoader(Slow(8), batch_size=4, num_workers=1, worker_init_fn=_linger_at_exit(120.0))
    it = iter(loader)
    (pid,) = it.worker_pids
    assert len(list(it)) == 2
    _reaper.flush()  # SIGTERM after the grace period, then joined
    assert _gone(pid)


def test_a_forked_child_does_not_wait_for_its_parents_workers() -> None:
    loader = fastload.DataLoader(Slow(8), batch_size=4, num_workers=1, worker_init_fn=_linger_at_exit(3.0))
    it = iter(loader)
    (pid,) = it.worker_pids
    assert len(list(it)) == 2  # the worker now sleeps in its exit; the reaper waits for it
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        started = time.monotonic()
        _reaper.flush()
        os._exit(0 if time.monotonic() - started < 1.0 else 1)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    _reaper.flush()
    assert _gone(pid)


_EXIT_SCRIPT = textwrap.dedent(
    """
    import multiprocessing.util, sys, time
    sys.path.insert(0, {here!r})
    import fastload
    from _fault_datasets import Slow

    def init(worker_id):
        multiprocessing.util.Finalize(None, time.sleep, args=(1.0,), exitpriority=0)

    loader = fastload.DataLoader(Slow(8), batch_size=4, num_workers=2, worker_init_fn=init)
    it = iter(loader)
    print(" ".join(map(str, it.worker_pids)), flush=True)
    assert len(list(it)) == 2
    """
)


def test_the_interpreter_exits_only_after_its_leaving_workers() -> None:
    script = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT.format(here=str(HERE))], capture_output=True, text=True, timeout=60
    )
    assert script.returncode == 0, script.stderr
    pids = [int(p) for p in script.stdout.split()]
    assert len(pids) == 2
    # Joined by the script before it exited: none was left behind to finish its exit alone.
    assert not [pid for pid in pids if psutil.pid_exists(pid)]


def test_workers_are_joined_after_a_loader_with_persistent_workers_is_dropped() -> None:
    loader = fastload.DataLoader(Slow(8), batch_size=4, num_workers=2, persistent_workers=True)
    assert len(list(loader)) == 2
    pids = list(loader._iterator.worker_pids)
    del loader
    gc.collect()  # the loader and its iterator refer to each other
    assert wait_until(lambda: all(_gone(pid) for pid in pids), 10.0)
