"""Where the workers run (``_engine/_cores.py``), with real worker processes: the fast path's
stay off the consumer's CPU unless a trial, begun when the consumer is seen starved, finds them
faster on every CPU; the generic path's, and any a ``worker_init_fn`` placed itself, are left
alone."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from _procs import wait_until
from _token_files import write_token_file
from _user_readers import UserReader

import fastload
from fastload._engine._cores import WARMUP, WINDOW

pytestmark = [
    pytest.mark.skipif(
        not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
        reason="needs two CPUs",
    ),
    pytest.mark.host_tuned,  # the mechanism under test (tests/conftest.py)
]
N = 400


@pytest.fixture(scope="module")
def h5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_token_file(tmp_path_factory.mktemp("cpus") / "data.h5", N, 40)


def _collate() -> fastload.PadCollate:
    return fastload.PadCollate(dtype=torch.int64, mask_dtype=torch.bool)


def _cpus(pids: list[int]) -> list[set[int]]:
    return [os.sched_getaffinity(pid) for pid in pids]


_ALL = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()


def _everywhere(worker_id: int) -> None:
    # A user's own choice: every CPU. (Not the parent's affinity read at this moment: its main
    # thread holds itself to one CPU for a moment while it starts the engine thread.)
    os.sched_setaffinity(0, _ALL)


def test_fast_path_workers_run_off_the_consumers_cpu_and_generic_ones_anywhere(h5: Path) -> None:
    allowed = os.sched_getaffinity(0)
    it = iter(
        fastload.DataLoader(
            fastload.HDF5Dataset(h5), batch_size=8, num_workers=2, collate_fn=_collate()
        )
    )
    for _ in range(2):
        next(it)
    confined = it._runner._cores.worker_cpus
    assert confined is not None and len(confined) == len(allowed) - 1 and confined < allowed
    # Each worker places itself as it starts (the main process may have built the first batches
    # before one had: see _engine/_claims.py).
    wait_until(lambda: _cpus(it.worker_pids) == [set(confined)] * 2)
    assert _cpus(it.worker_pids) == [set(confined)] * 2
    assert sum(len(b["lengths"]) for b in it) == N - 16
    generic = iter(fastload.DataLoader(torch.arange(40), batch_size=8, num_workers=2))
    next(generic)
    assert _cpus(generic.worker_pids) == [allowed] * 2
    list(generic)


def test_a_worker_init_fn_that_places_its_worker_is_obeyed(h5: Path) -> None:
    loader = fastload.DataLoader(
        fastload.HDF5Dataset(h5),
        batch_size=8,
        num_workers=2,
        collate_fn=_collate(),
        worker_init_fn=_everywhere,
    )
    it = iter(loader)
    next(it), next(it)
    assert it._runner._cores.confining  # fastload would have kept them off the consumer's CPU
    assert _cpus(it.worker_pids) == [_ALL] * 2
    list(it)


def test_a_starved_consumer_gets_its_workers_every_cpu_when_a_trial_shows_them_faster(
    h5: Path,
) -> None:
    allowed = os.sched_getaffinity(0)
    it = iter(
        fastload.DataLoader(UserReader(h5), batch_size=1, num_workers=2, collate_fn=_collate())
    )
    pids = it.worker_pids
    cores = it._runner._cores
    assert cores.worker_cpus is not None
    confined = [set(cores.worker_cpus)] * 2
    # The trial's timings come from the test, not from racing the machine (a busy host can make
    # the released window slower): confined, a window of WINDOW batches takes 2 ms a batch, all
    # of it waited; released, 1 ms. What is real is the placement that follows each decision.
    decide = cores.observe_window
    clock = {"now_s": 0.0, "waited_s": 0.0}

    def scripted(now: float, waited_s: float) -> str | None:
        spent = WINDOW * (0.002 if cores.confining else 0.001)
        clock["now_s"] += spent
        clock["waited_s"] += spent
        return decide(clock["now_s"], clock["waited_s"])

    cores.observe_window = scripted  # type: ignore[method-assign]
    seen: list[Any] = []
    for k, batch in enumerate(it, start=1):
        seen.extend(batch["lengths"].tolist())
        if k == WARMUP - 1:  # the warm-up is never judged, however starved
            assert _cpus(pids) == confined and cores.confining
        if k == WARMUP + WINDOW + 1:  # the first window was starved: the trial's release
            assert _cpus(pids) == [allowed] * 2 and not cores.confining
        if k == WARMUP + 2 * WINDOW + 1:  # the trial's confined window
            assert _cpus(pids) == confined and cores.confining
        if k == WARMUP + 3 * WINDOW + 1:  # released twice as fast: for good
            assert _cpus(pids) == [allowed] * 2
            assert not cores.confining and not cores.deciding
    assert seen == fastload.HDF5Dataset(h5).lengths.tolist()
