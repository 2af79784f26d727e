"""The fast path's engine runner (``_engine/_pump.py``): batches are received, decoded and the
next tasks dispatched on a thread of the main process while the consumer steps slowly (so
``next()`` only takes a finished batch), and by ``next()`` itself while it steps fast.

What must hold with the thread as without it, and across switches between the two: torch's bound
on how far the sampler runs ahead, exact and ordered epochs, errors raised at ``next()`` with the
epoch then stopped, timeouts, and nothing left behind (threads, processes) however the iteration
ends.
"""

from __future__ import annotations

import gc
import itertools
import os
import select
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _procs import alive, live_children, wait_until
from _token_files import write_token_file
from _user_readers import UserReader

import fastload
from fastload._engine import _pump
from fastload.errors import LoaderTimeoutError, WorkerCrashedError

N = 240


@pytest.fixture(scope="module")
def h5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_token_file(tmp_path_factory.mktemp("pump") / "data.h5", N, 90)


def _collate() -> fastload.PadCollate:
    return fastload.PadCollate(dtype=torch.int64, mask_dtype=torch.bool)


def _pump_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "fastload-pump" and t.is_alive()]


@pytest.fixture(autouse=True)
def _no_pump_thread_from_earlier_tests() -> None:
    # An iterator that an earlier test dropped in a reference cycle (a kept traceback, say) stops
    # its thread when it is collected: collect it, so that these tests count only their own.
    def gone() -> bool:
        gc.collect()
        return not _pump_threads()

    assert wait_until(gone), "an engine thread of an earlier test outlived its iterator"


class _CountingPlan:
    """A batch sampler that records how many batches have been taken from it."""

    def __init__(self, batches: list[list[int]], fail_at: int | None = None) -> None:
        self.batches = batches
        self.taken = 0
        self.fail_at = fail_at

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Any:
        for k, batch in enumerate(self.batches):
            if k == self.fail_at:
                raise RuntimeError(f"the plan has no batch {k}")
            self.taken += 1
            yield batch


class _SlowAt(UserReader):
    def __init__(self, path: Path, at: int, delay_s: float) -> None:
        super().__init__(path)
        self.at, self.delay_s = at, delay_s

    def hook(self, indices: np.ndarray) -> None:
        if self.at in indices.tolist():
            time.sleep(self.delay_s)


class _Slow(UserReader):
    def hook(self, indices: np.ndarray) -> None:
        time.sleep(0.03)  # batches are still being built when the sampler fails


class _KillsWorkerAt(UserReader):
    def __init__(self, path: Path, at: int) -> None:
        super().__init__(path)
        self.at = at

    def hook(self, indices: np.ndarray) -> None:
        if self.at in indices.tolist():
            os._exit(3)


def _plan(size: int = 8) -> list[list[int]]:
    order = np.random.default_rng(5).permutation(N)
    return [order[i : i + size].tolist() for i in range(0, N, size)]


def test_the_fast_path_starts_its_thread_with_the_first_batch_and_the_generic_path_never(h5: Path) -> None:
    it = iter(fastload.DataLoader(fastload.HDF5Dataset(h5), batch_size=8, num_workers=2, collate_fn=_collate()))
    assert it.fast_path and it._runner._pump is not None
    assert not _pump_threads() and not it._runner._pump.threaded  # the first batch is taken inline
    next(it)
    assert it._runner._pump.threaded and len(_pump_threads()) == 1  # it drives during the first step
    _, threaded = _batches_seen(it, lambda k: 0)  # fast steps: next() takes over, the thread parks
    assert not all(threaded)
    assert wait_until(lambda: not _pump_threads())  # and stops with the epoch
    generic = iter(fastload.DataLoader(torch.arange(40), batch_size=8, num_workers=2))
    assert not generic._runner.fast and not _pump_threads()
    list(generic)


def test_a_runner_that_fails_to_start_its_workers_leaves_no_thread_and_no_process(
    h5: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fastload._engine._engine import Engine

    def fork_fails(self: Engine) -> None:
        raise BlockingIOError(11, "Resource temporarily unavailable (fork)")

    monkeypatch.setattr(Engine, "start_workers", fork_fails)
    loader = fastload.DataLoader(fastload.HDF5Dataset(h5), batch_size=8, num_workers=2, collate_fn=_collate())
    before = {p.pid for p in live_children()}  # other tests' servers and fork servers
    try:
        iter(loader)
    except BlockingIOError as exc:
        kept = exc  # as a caller that logs it later: its traceback holds the half-made runner
    assert kept.__traceback__ is not None
    assert wait_until(lambda: not _pump_threads() and not {p.pid for p in live_children()} - before)


def test_a_pool_whose_second_fork_fails_stops_the_first_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    from fastload._engine._pool import WorkerPool

    start, calls = WorkerPool._start, []

    def second_fork_fails(self: WorkerPool, wid: int) -> None:
        calls.append(wid)
        if len(calls) == 2:
            raise BlockingIOError(11, "Resource temporarily unavailable (fork)")
        start(self, wid)

    monkeypatch.setattr(WorkerPool, "_start", second_fork_fails)
    before = {p.pid for p in live_children()}  # other tests' servers and fork servers
    try:
        iter(fastload.DataLoader(torch.arange(40), batch_size=8, num_workers=2))
    except BlockingIOError as exc:
        kept = exc  # as a caller that logs it later: its traceback holds the half-made pool
    assert calls == [0, 1] and kept.__traceback__ is not None
    assert wait_until(lambda: not {p.pid for p in live_children()} - before)


def test_the_sampler_runs_ahead_by_prefetch_factor_times_workers_and_no_more(h5: Path) -> None:
    plan = _CountingPlan(_plan())
    loader = fastload.DataLoader(
        fastload.HDF5Dataset(h5), batch_sampler=plan, num_workers=2, prefetch_factor=3, collate_fn=_collate()
    )
    it = iter(loader)
    held = []
    for consumed in range(5):
        assert wait_until(lambda c=consumed: plan.taken == c + 6)
        time.sleep(0.05)  # give a wrong implementation the time to overrun
        assert plan.taken == consumed + 6
        held.append(next(it))
    rest = list(it)
    assert len(held) + len(rest) == len(plan)


def test_batches_are_built_before_the_consumer_asks_and_decoded_too_by_the_thread(h5: Path, driver: str) -> None:
    it = iter(fastload.DataLoader(fastload.HDF5Dataset(h5), batch_size=8, num_workers=2, collate_fn=_collate()))
    pump = it._runner._pump
    if driver == "threaded":
        assert wait_until(lambda: len(pump._ready) == 4), "2 workers x prefetch 2 batches should be waiting"
    else:  # inline: the 4 tasks went out with iter(); the replies wait in the builders' pipes
        pool = pump._engine._pool
        assert wait_until(lambda: pool.finished(0) + pool.finished(1) == 4)
        # Which worker built which depends on how fast each was (NOTE [tasks placed in time]).
        builders = sum(pool.finished(w) > 0 for w in range(2))
        _, fds = pump._engine.watch()
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        assert wait_until(lambda: len(poller.poll(0)) == builders)
        assert not pump._ready
    first = next(it)
    assert isinstance(first["tokens"], torch.Tensor)  # a decoded batch, not a descriptor
    assert len(list(it)) == len(it) - 1


def test_a_consumer_that_holds_every_batch_with_one_task_in_flight_does_not_hang(h5: Path, driver: str) -> None:
    loader = fastload.DataLoader(
        fastload.HDF5Dataset(h5), batch_size=8, num_workers=1, prefetch_factor=1, collate_fn=_collate()
    )
    held = list(loader)  # every batch kept alive: no slot is ever freed to wake the thread
    assert sum(len(b["lengths"]) for b in held) == N
    expected = np.concatenate([b["lengths"].numpy() for b in held])
    assert expected.tolist() == fastload.HDF5Dataset(h5).lengths.tolist()


def test_a_sampler_error_reaches_next_after_the_batches_before_it_and_stops_the_epoch(h5: Path, driver: str) -> None:
    plan = _CountingPlan(_plan(), fail_at=7)
    it = iter(fastload.DataLoader(_Slow(h5), batch_sampler=plan, num_workers=2, collate_fn=_collate()))
    pids = it.worker_pids
    got = []
    with pytest.raises(RuntimeError, match="the plan has no batch 7"):
        while True:
            got.append(next(it)["lengths"].tolist())
    assert got == [fastload.HDF5Dataset(h5).lengths[b].tolist() for b in plan.batches[:7]]
    with pytest.raises(StopIteration):
        next(it)
    assert wait_until(lambda: not _pump_threads())
    assert wait_until(lambda: not any(alive(p) for p in pids))


def test_next_after_the_end_of_a_persistent_epoch_stops_again_at_once(h5: Path, driver: str) -> None:
    loader = fastload.DataLoader(
        fastload.HDF5Dataset(h5), batch_size=8, num_workers=2, persistent_workers=True, timeout=5,
        collate_fn=_collate(),
    )
    it = iter(loader)
    assert len(list(it)) == len(loader)
    for _ in range(2):
        with pytest.raises(StopIteration):
            next(it)
    assert len(list(iter(loader))) == len(loader)  # and the next epoch is whole


def test_timeout_raises_on_the_fast_path_within_the_bound(h5: Path, driver: str) -> None:
    plan = _plan()
    loader = fastload.DataLoader(
        _SlowAt(h5, at=plan[2][0], delay_s=30), batch_sampler=plan, num_workers=2, timeout=0.5, collate_fn=_collate()
    )
    it = iter(loader)
    next(it), next(it)
    started = time.monotonic()
    with pytest.raises(LoaderTimeoutError, match=r"timed out after 0\.5 seconds"):
        next(it)
    assert time.monotonic() - started < 3.0
    assert wait_until(lambda: not _pump_threads())


def test_a_batch_that_keeps_killing_workers_ends_the_epoch_with_a_named_error(h5: Path, driver: str) -> None:
    plan = _plan()
    victim = plan[3][2]
    before = {p.pid for p in live_children()}  # other tests may leave a forkserver behind
    it = iter(fastload.DataLoader(_KillsWorkerAt(h5, at=victim), batch_sampler=plan, num_workers=2, collate_fn=_collate()))
    got = [next(it) for _ in range(3)]
    with pytest.raises(WorkerCrashedError, match=rf"(?s)building batch 3 from sample indices \[.*{victim}"):
        next(it)
    assert len(got) == 3
    assert wait_until(lambda: not _pump_threads())
    assert wait_until(lambda: not {p.pid for p in live_children()} - before)


@pytest.mark.parametrize("how", ["break", "del", "exception"])
def test_leaving_an_epoch_early_stops_the_thread_and_the_workers(h5: Path, how: str) -> None:
    loader = fastload.DataLoader(fastload.HDF5Dataset(h5), batch_size=8, num_workers=2, collate_fn=_collate())
    it = iter(loader)
    pids = it.worker_pids
    next(it)
    if how == "break":
        for _ in it:
            break
        del it
    elif how == "del":
        del it
    else:
        try:
            for _ in it:
                raise KeyError("in the training step")
        except KeyError:
            pass
        del it
    del loader
    gc.collect()
    assert wait_until(lambda: not _pump_threads())
    assert wait_until(lambda: not any(alive(p) for p in pids))


def test_persistent_workers_keep_one_runner_across_epochs_and_each_epoch_is_exact(h5: Path, driver: str) -> None:
    loader = fastload.DataLoader(
        fastload.HDF5Dataset(h5), batch_size=8, shuffle=True, num_workers=2, persistent_workers=True,
        collate_fn=_collate(), generator=torch.Generator().manual_seed(0),
    )
    everything = sorted(fastload.HDF5Dataset(h5).lengths.tolist())
    for epoch in range(4):
        if epoch == 2:  # abandon this one half-way: its prefetched batches must not leak into the next
            for k, _ in enumerate(loader):
                if k == 5:
                    break
            continue
        seen = sorted(x for b in loader for x in b["lengths"].tolist())
        assert seen == everything
        assert len(_pump_threads()) == 1  # one, kept: never a second


def _batches_seen(it: Any, pace_s: Any) -> tuple[list[list[int]], list[bool]]:
    """Every batch's lengths, and whether the thread drove when it was taken; ``pace_s(k)`` is
    the consumer's step after batch ``k``."""
    seen, threaded = [], []
    for k, batch in enumerate(it):
        seen.append(batch["lengths"].tolist())
        threaded.append(it._runner._pump.threaded)
        del batch
        if pace_s(k):
            time.sleep(pace_s(k))
    return seen, threaded


def test_a_fast_consumer_drives_the_engine_itself(h5: Path) -> None:
    plan = _plan(4)
    it = iter(fastload.DataLoader(fastload.HDF5Dataset(h5), batch_sampler=plan, num_workers=2, collate_fn=_collate()))
    seen, threaded = _batches_seen(it, lambda k: 0)
    assert seen == [fastload.HDF5Dataset(h5).lengths[b].tolist() for b in plan]
    assert threaded[0]  # the thread drives during the first step, then the consumer takes over
    assert not all(threaded[20:])  # (a scheduling hiccup may switch it back for a while)


def test_dropping_the_iterator_while_the_thread_is_parked_stops_it_and_the_workers(
    h5: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_pump, "FAST_STEP_S", -1.0)  # the thread drives the first batches
    monkeypatch.setattr(_pump, "SLOW_STEP_S", -1.0)
    it = iter(fastload.DataLoader(fastload.HDF5Dataset(h5), batch_size=2, num_workers=2, collate_fn=_collate()))
    pids = it.worker_pids
    for _ in range(5):
        next(it)
    assert it._runner._pump.threaded and len(_pump_threads()) == 1
    monkeypatch.setattr(_pump, "FAST_STEP_S", 1e9)  # then next() does, from the next batch on
    monkeypatch.setattr(_pump, "SLOW_STEP_S", 2e9)
    for _ in range(5):
        next(it)
    assert not it._runner._pump.threaded and len(_pump_threads()) == 1  # parked, not gone
    del it
    gc.collect()
    assert wait_until(lambda: not _pump_threads())
    assert wait_until(lambda: not any(alive(p) for p in pids))


class _Cycle:
    """An object only a reference cycle keeps: what the collector must still free."""

    def __init__(self, payload: Any = None) -> None:
        self.me, self.payload = self, payload


def test_an_iterator_collected_on_the_engine_thread_mid_step_is_closed_and_collection_goes_on(
    h5: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An iterator dropped in a reference cycle (a loop ended by an exception the caller kept) is
    # freed by the cyclic collector, which runs on whichever thread allocates past its
    # threshold: here the engine's own, in the middle of a step, with the lock closing takes
    # held. Before, closing waited for that lock forever, and every later collection in the
    # process returned at once (a clean-clone CI run: engine threads and iterators piling up
    # test after test, then a segfault at exit). The collection is forced there, once.
    step = _pump.Pump._step
    collected_on_the_thread = threading.Event()

    def step_then_collect(pump: _pump.Pump, *args: Any) -> None:
        step(pump, *args)
        if threading.current_thread().name == "fastload-pump" and not collected_on_the_thread.is_set():
            collected_on_the_thread.set()
            gc.collect()

    monkeypatch.setattr(_pump, "FAST_STEP_S", -1.0)  # the thread drives throughout
    monkeypatch.setattr(_pump, "SLOW_STEP_S", -1.0)
    gc.collect()
    gc.disable()  # only the collection forced on the engine's thread frees the cycle below
    try:
        it = iter(fastload.DataLoader(fastload.HDF5Dataset(h5), batch_size=8, num_workers=2, collate_fn=_collate()))
        pids = it.worker_pids
        for _ in range(3):
            next(it)
        cycle = _Cycle(it)
        held = weakref.ref(cycle)
        del it, cycle
        assert held() is not None  # only the cycle holds the iterator now
        monkeypatch.setattr(_pump.Pump, "_step", step_then_collect)  # the thread's next step
        # Bounds for a loaded host, not races: each wait ends as soon as it holds.
        assert wait_until(collected_on_the_thread.is_set, timeout_s=30)
        assert wait_until(lambda: held() is None, timeout_s=30)  # the collection there took the cycle
        assert wait_until(lambda: not _pump_threads(), timeout_s=30)  # then the iterator closed
        assert wait_until(lambda: not any(alive(p) for p in pids), timeout_s=30)
        later = weakref.ref(_Cycle())
        gc.collect()
        assert later() is None  # the collector still collects
    finally:
        gc.enable()


def test_a_slow_consumer_keeps_the_thread_driving(h5: Path) -> None:
    plan = _plan(16)
    it = iter(fastload.DataLoader(fastload.HDF5Dataset(h5), batch_sampler=plan, num_workers=2, collate_fn=_collate()))
    seen, threaded = _batches_seen(it, lambda k: 0.004)
    assert seen == [fastload.HDF5Dataset(h5).lengths[b].tolist() for b in plan]
    assert all(threaded)


def test_switching_drivers_back_and_forth_keeps_the_epoch_exact_and_ordered(h5: Path) -> None:
    plan = _plan(2)  # 120 batches: fast stretches of 30, slow stretches of 10
    it = iter(fastload.DataLoader(fastload.HDF5Dataset(h5), batch_sampler=plan, num_workers=2, collate_fn=_collate()))
    seen, threaded = _batches_seen(it, lambda k: 0.004 if k % 40 >= 30 else 0)
    assert seen == [fastload.HDF5Dataset(h5).lengths[b].tolist() for b in plan]
    switches = sum(a != b for a, b in itertools.pairwise(threaded))
    assert switches >= 4, threaded


def test_a_worker_killed_while_next_drives_is_replaced_and_the_epoch_is_exact(h5: Path, driver: str) -> None:
    plan = _plan()
    victim = plan[9][0]
    reader = _KillsWorkerOnceAt(h5, at=victim, marker=h5.parent / f"killed-{driver}")
    it = iter(fastload.DataLoader(reader, batch_sampler=plan, num_workers=2, collate_fn=_collate()))
    seen = [b["lengths"].tolist() for b in it]
    assert seen == [fastload.HDF5Dataset(h5).lengths[b].tolist() for b in plan]
    assert it.stats().respawns == 1


class _KillsWorkerOnceAt(UserReader):
    def __init__(self, path: Path, at: int, marker: Path) -> None:
        super().__init__(path)
        self.at, self.marker = at, marker

    def hook(self, indices: np.ndarray) -> None:
        if self.at in indices.tolist() and not self.marker.exists():
            self.marker.touch()
            os._exit(7)


