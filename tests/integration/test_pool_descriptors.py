"""The worker pool's pipes: closed once, by the pool, however its owner dies.

NOTE [raw descriptors] in ``fastload/_engine/_pool.py``: a loader's iterator that dies in a
reference cycle is finalized in the same collection as everything it holds, in no set order.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import sys
from typing import Any

import pytest
import torch

import fastload
from fastload._engine import _reaper
from fastload._engine._pool import WorkerPool
from fastload._engine._worker import WorkerSpec


class Squares(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> int:
        return i * i


def _open_fds() -> set[int]:
    """This process's open descriptors, less multiprocessing's shared heap (``/dev/shm/pym-*``,
    which the pools' progress arrays come from: allocated once, kept for the process)."""
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the listing's own descriptor
            if not os.readlink(f"/proc/self/fd/{name}").startswith("/dev/shm/pym-"):
                fds.add(int(name))
    return fds


@pytest.fixture
def unraisable(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What finalizers raised (``__del__`` errors are otherwise only printed)."""
    seen: list[str] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(f"{u.object!r}: {u.exc_value!r}"))
    return seen


def test_loaders_collected_together_in_cycles_close_each_pipe_once(unraisable: list[str]) -> None:
    gc.collect()
    before = _open_fds()
    loaders = [fastload.DataLoader(Squares(), batch_size=4, num_workers=2, persistent_workers=True) for _ in range(6)]
    for loader in loaders:
        assert [b.tolist() for b in loader] == [[0, 1, 4, 9], [16, 25, 36, 49], [64, 81, 100, 121]]
        list(loader)  # a second epoch on the same workers
    pids = [pid for loader in loaders for pid in loader._iterator.worker_pids]
    assert len(pids) == 12
    del loader, loaders  # each loader and its iterator refer to each other: only gc frees them
    gc.collect()
    assert unraisable == []
    _reaper.flush()  # leaving workers are joined in the background; wait for that here
    assert _open_fds() <= before
    assert not any(c.pid in pids for c in multiprocessing.active_children())


def _spec(wid: int) -> WorkerSpec:
    return WorkerSpec(
        dataset=Squares(),
        auto_collation=True,
        collate_fn=torch.utils.data.default_collate,
        drop_last=False,
        base_seed=0,
        worker_init_fn=None,
        worker_id=wid,
        num_workers=2,
        main_pid=os.getpid(),
        epoch=0,
    )


def test_a_pool_dropped_without_shutdown_closes_its_pipes_and_its_workers_exit(unraisable: list[str]) -> None:
    pool: Any = WorkerPool(multiprocessing.get_context("fork"), 2, _spec)
    pipes = [*pool._tasks, *pool._results]
    procs = list(pool._procs)
    assert len(set(pipes)) == 4 and set(pipes) <= _open_fds()
    pool.cycle = pool
    del pool
    gc.collect()
    assert not set(pipes) & _open_fds()
    for proc in procs:  # end-of-file on its task pipe: the worker leaves by itself
        proc.join(10)
        assert proc.exitcode == 0
    assert unraisable == []


def _results(pool: Any, count: int) -> dict[int, Any]:
    """``{seq: (worker id, payload)}`` for the next ``count`` results."""
    got: dict[int, Any] = {}
    for _ in range(200):
        for wid, (_, seq, _, payload, *_) in pool.wait(0.05):
            got[seq] = (wid, payload.tolist())
        if len(got) == count:
            return got
    raise AssertionError(f"only {got} of {count} results arrived")


def test_a_pool_can_fork_its_first_worker_alone_and_the_rest_once_it_has_work() -> None:
    pool: Any = WorkerPool(multiprocessing.get_context("fork"), 3, _spec, start=1)
    try:
        assert len(pool.pids) == 1
        pool.send(0, (0, 0, [1, 2]))
        assert _results(pool, 1) == {0: (0, [1, 4])}  # answered before the others exist
        pool.start_rest()
        assert len(set(pool.pids)) == 3
        for wid in range(3):
            pool.send(wid, (0, 1 + wid, [wid + 3]))
        assert _results(pool, 3) == {1: (0, [9]), 2: (1, [16]), 3: (2, [25])}
        pool.start_rest()  # nothing left to start
        assert len(pool.pids) == 3
    finally:
        pool.shutdown()
