"""The worker server (``fastload/_engine/_zygote.py``): a process started once that forks the
fast path's workers, so that the training process never forks.

What must hold: the batches are those of forked workers; only specs of fastload's own classes go
through it (a user's reader is forked here, as torch would); the worker gets the caller's
working directory and standard streams as they are when it starts; a worker's death is seen and
its exit status told; the server's death or its switch turned off only means workers are forked
here again; nothing outlives the caller (the server, its spares, its workers).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
from _procs import alive, wait_until
from _token_files import write_token_file
from _user_readers import UserReader

import fastload
from fastload._engine import _zygote
from fastload._engine._pool import WorkerPool
from fastload._engine._pool_protocol import WorkerDied
from fastload._engine._worker import WorkerSpec

N = 240


@pytest.fixture(scope="module")
def h5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_token_file(tmp_path_factory.mktemp("server") / "data.h5", N, 90)


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> _zygote.WorkerServer:
    monkeypatch.delenv(_zygote.ENV, raising=False)
    started = _zygote.warm()
    assert started is not None, "the worker server did not start"
    return started


def _loader(data: Any, workers: int = 2) -> fastload.DataLoader:
    plan = [list(range(i, min(i + 16, N))) for i in range(0, N, 16)][::-1]
    return fastload.DataLoader(
        data, batch_sampler=plan, num_workers=workers, collate_fn=fastload.PadCollate(dtype=torch.int64)
    )


def _batches(loader: fastload.DataLoader) -> list[list[int]]:
    return [b["tokens"].sum(dim=1).tolist() for b in loader]


def _parents(pids: list[int]) -> set[int]:
    return {psutil.Process(pid).ppid() for pid in pids}


def test_the_server_forks_the_workers_and_the_batches_are_those_of_forked_ones(
    h5: Path, server: _zygote.WorkerServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = _batches(_loader(fastload.HDF5Dataset(h5), workers=0))
    for _ in range(3):  # fresh iterators: each asks the server again
        it = iter(_loader(fastload.HDF5Dataset(h5)))
        first = next(it)
        pids = it.worker_pids
        assert _parents(pids) == {server.pid}
        seen = [first["tokens"].sum(dim=1).tolist(), *([b["tokens"].sum(dim=1).tolist() for b in it])]
        assert seen == expected
        del it
        assert wait_until(lambda: not any(alive(p) for p in pids))  # noqa: B023
    monkeypatch.setenv(_zygote.ENV, "0")  # the switch: forked here again
    it = iter(_loader(fastload.HDF5Dataset(h5)))
    next(it)
    assert _parents(it.worker_pids) == {os.getpid()}
    assert [b["tokens"].sum(dim=1).tolist() for b in it] == expected[1:]


class _TestModuleReader(UserReader):
    """A reader of the test's own module: its state at fork time is the user's, so it is
    forked here, never pickled into the server's workers."""


def test_a_users_classes_are_forked_here_not_sent_to_the_server(h5: Path, server: _zygote.WorkerServer) -> None:
    it = iter(_loader(_TestModuleReader(h5)))
    next(it)
    assert _parents(it.worker_pids) == {os.getpid()}
    list(it)


def test_which_specs_the_server_takes() -> None:
    payload, imports = _zygote._payload((fastload.PadCollate(dtype=torch.int64), {"a": np.arange(3)}))
    assert payload and "fastload._collate._pad" in imports and "numpy" in imports
    with pytest.raises(_zygote.Refused, match="test_worker_server"):
        _zygote._payload((_TestModuleReader,))
    with pytest.raises(_zygote.Refused, match="does not pickle"):
        _zygote._payload((lambda: 0,))


def test_a_served_worker_starts_with_the_callers_directory_streams_and_cores(
    h5: Path, server: _zygote.WorkerServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # All changed after the server started: the worker gets them as a forked one would.
    monkeypatch.chdir(tmp_path)
    cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cores)})
    try:
        with warnings.catch_warnings():  # torch's: more workers than the cores we now have
            warnings.filterwarnings("ignore", message=".*worker processes in total")
            it = iter(_loader(fastload.HDF5Dataset(h5)))
            next(it)
    finally:
        os.sched_setaffinity(0, cores)
    ours = [os.readlink(f"/proc/self/fd/{fd}") for fd in (1, 2)]
    for pid in it.worker_pids:
        assert _parents([pid]) == {server.pid}
        # A worker that has not built a batch yet may still be on its way there.
        assert wait_until(lambda: os.readlink(f"/proc/{pid}/cwd") == str(tmp_path))  # noqa: B023
        assert [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in (1, 2)] == ours
        assert wait_until(lambda: os.sched_getaffinity(pid) == {min(cores)})  # noqa: B023
    list(it)


def _spec(h5: Path, wid: int) -> WorkerSpec:
    from fastload._engine._builder import SlotBuilder  # noqa: F401  (the fast path's, unused here)

    return WorkerSpec(
        dataset=fastload.HDF5Dataset(h5), auto_collation=True, collate_fn=fastload.PadCollate(dtype=torch.int64),
        drop_last=False, base_seed=0, worker_init_fn=None, worker_id=wid, num_workers=1,
        main_pid=os.getpid(), epoch=0,
    )


def test_a_served_workers_death_is_seen_with_its_signal(h5: Path, server: _zygote.WorkerServer) -> None:
    import multiprocessing

    pool = WorkerPool(multiprocessing.get_context("fork"), 1, lambda wid: _spec(h5, wid), server=server)
    try:
        (pid,) = pool.pids
        assert _parents([pid]) == {server.pid}
        os.kill(pid, signal.SIGKILL)
        events: list[Any] = []
        deadline = time.monotonic() + 10
        while not events and time.monotonic() < deadline:
            events = pool.wait(0.5)
        ((wid, died),) = events
        assert wid == 0 and isinstance(died, WorkerDied)
        assert died.pid == pid and died.exitcode == -signal.SIGKILL
        pool.respawn(0)  # through the server again
        assert _parents(pool.pids) == {server.pid} and pool.pids != [pid]
    finally:
        pool.shutdown(join_s=2.0)


def test_a_worker_outliving_its_server_goes_on_and_is_reported_dead_once_it_has_exited(
    h5: Path, server: _zygote.WorkerServer
) -> None:
    import multiprocessing

    pool = WorkerPool(multiprocessing.get_context("fork"), 1, lambda wid: _spec(h5, wid), server=server)
    try:
        (pid,) = pool.pids
        os.kill(server.pid, signal.SIGKILL)
        assert wait_until(lambda: server.dead)
        assert pool.wait(0.5) == [] and alive(pid)  # its caller is alive: it goes on
        os.kill(pid, signal.SIGKILL)
        events: list[Any] = []
        deadline = time.monotonic() + 15
        while not events and time.monotonic() < deadline:
            events = pool.wait(0.5)
        assert len(events) == 1, events
        ((_, died),) = events
        assert isinstance(died, WorkerDied) and died.pid == pid, died
        assert not alive(pid)  # reported once it exited: its slot and pipes are no one's now
        assert died.exitcode == 255  # how it died, the server would have said
    finally:
        pool.shutdown(join_s=2.0)


def test_a_dead_server_means_forked_workers_then_a_new_server(h5: Path, server: _zygote.WorkerServer) -> None:
    old = server.pid
    spares = [c.pid for c in psutil.Process(old).children()]
    os.kill(old, signal.SIGKILL)
    assert wait_until(lambda: server.dead)  # reaped: a dying process may still hold its socket
    assert wait_until(lambda: not any(alive(p) for p in spares))  # spares leave with it
    it = iter(_loader(fastload.HDF5Dataset(h5)))
    next(it)
    assert _parents(it.worker_pids) == {os.getpid()}  # forked here; a new server starts meanwhile
    list(it)
    fresh = _zygote.warm()
    assert fresh is not None and fresh.pid != old
    it = iter(_loader(fastload.HDF5Dataset(h5)))
    next(it)
    assert _parents(it.worker_pids) == {fresh.pid}
    list(it)


def test_a_pool_whose_server_died_forks_its_workers_itself(h5: Path, server: _zygote.WorkerServer) -> None:
    import multiprocessing

    os.kill(server.pid, signal.SIGKILL)
    assert wait_until(lambda: server.dead)  # reaped: a dying process may still hold its socket
    pool = WorkerPool(multiprocessing.get_context("fork"), 2, lambda wid: _spec(h5, wid), server=server)
    try:
        assert _parents(pool.pids) == {os.getpid()}
    finally:
        pool.shutdown(join_s=2.0)


def test_spares_are_forked_while_the_caller_is_quiet_and_a_start_takes_them(
    h5: Path, server: _zygote.WorkerServer
) -> None:
    def spares() -> set[int]:
        named = set()
        for child in psutil.Process(server.pid).children():
            try:
                if child.name() == _zygote.SPARE_NAME.decode():
                    named.add(child.pid)
            except psutil.NoSuchProcess:
                continue
        return named

    assert wait_until(lambda: len(spares()) >= 2)
    before = spares()
    it = iter(_loader(fastload.HDF5Dataset(h5)))
    next(it)
    assert set(it.worker_pids) <= before  # no fork on the way: two spares took the requests
    list(it)


_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import psutil
    from fastload._engine import _zygote
    server = _zygote.warm()
    deadline = time.monotonic() + 10
    while len(psutil.Process(server.pid).children()) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    pids = [server.pid, *(c.pid for c in psutil.Process(server.pid).children())]
    print(" ".join(map(str, pids)), flush=True)
    if sys.argv[1] == "hang":
        time.sleep(60)
    """
)


@pytest.mark.parametrize("how", ["exit", "SIGKILL"])
def test_nothing_of_the_server_outlives_its_caller(how: str) -> None:
    with subprocess.Popen(
        [sys.executable, "-c", _SCRIPT, "exit" if how == "exit" else "hang"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    ) as process:
        assert process.stdout is not None
        pids = [int(p) for p in process.stdout.readline().split()]
        assert len(pids) >= 3, pids  # the server and its spares
        if how == "SIGKILL":
            process.kill()
        process.wait(timeout=30)
    assert wait_until(lambda: not any(alive(p) for p in pids), timeout_s=10), [p for p in pids if alive(p)]


def test_a_forked_child_does_not_share_the_parents_server(server: _zygote.WorkerServer) -> None:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.write(w, b"none" if _zygote.worker_server(start=False) is None else b"kept")
        os._exit(0)
    os.close(w)
    said = os.read(r, 8)
    os.close(r)
    os.waitpid(pid, 0)
    assert said == b"none"
    assert _zygote.worker_server(start=False) is server  # the parent's is untouched


def test_a_server_that_dies_before_it_is_ready_is_not_restarted_forever(monkeypatch: pytest.MonkeyPatch) -> None:
    _zygote.shutdown()
    monkeypatch.delenv(_zygote.ENV, raising=False)
    monkeypatch.setattr(_zygote, "_BOOT", "import sys; sys.exit(3)")  # a broken environment
    monkeypatch.setattr(_zygote, "_early_deaths", 0)
    started = []
    try:
        for _ in range(_zygote._MAX_EARLY_DEATHS + 2):
            assert _zygote.worker_server() is None  # never ready: the loader forks
            pid = _zygote.server_pid()
            if pid is not None and pid not in started:
                started.append(pid)
                assert wait_until(lambda: _zygote._server is not None and _zygote._server.dead)
        assert len(started) == _zygote._MAX_EARLY_DEATHS  # then no more interpreters
    finally:
        _zygote.shutdown()
