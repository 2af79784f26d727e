"""Where the workers run (``_engine/_cores.py``), with real worker processes: the fast path's
stay off the consumer's CPU until the consumer is seen starved; the generic path's, and any a
``worker_init_fn`` placed itself, are left alone."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _token_files import write_token_file
from _user_readers import UserReader

import fastload
from fastload._engine._cores import WARMUP, WINDOW

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs"
)
N = 400


@pytest.fixture(scope="module")
def h5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_token_file(tmp_path_factory.mktemp("cpus") / "data.h5", N, 40)


def _collate() -> fastload.PadCollate:
    return fastload.PadCollate(dtype=torch.int64, mask_dtype=torch.bool)


def _cpus(pids: list[int]) -> list[set[int]]:
    return [os.sched_getaffinity(pid) for pid in pids]


class _Slow(UserReader):
    def hook(self, indices: np.ndarray) -> None:
        time.sleep(0.002)  # the workers cannot keep up with a consumer that does nothing


def _everywhere(worker_id: int) -> None:
    os.sched_setaffinity(0, os.sched_getaffinity(os.getppid()))  # a user's own choice: every CPU


def test_fast_path_workers_run_off_the_consumers_cpu_and_generic_ones_anywhere(h5: Path) -> None:
    allowed = os.sched_getaffinity(0)
    it = iter(fastload.DataLoader(fastload.HDF5Dataset(h5), batch_size=8, num_workers=2, collate_fn=_collate()))
    for _ in range(2):  # one batch from each worker: both have started
        next(it)
    confined = it._cores.worker_cpus
    assert confined is not None and len(confined) == len(allowed) - 1 and confined < allowed
    assert _cpus(it.worker_pids) == [set(confined)] * 2
    assert sum(len(b["lengths"]) for b in it) == N - 16
    generic = iter(fastload.DataLoader(torch.arange(40), batch_size=8, num_workers=2))
    next(generic)
    assert _cpus(generic.worker_pids) == [allowed] * 2
    list(generic)


def test_a_worker_init_fn_that_places_its_worker_is_obeyed(h5: Path) -> None:
    loader = fastload.DataLoader(
        fastload.HDF5Dataset(h5), batch_size=8, num_workers=2, collate_fn=_collate(), worker_init_fn=_everywhere
    )
    it = iter(loader)
    next(it), next(it)
    assert it._cores.confining  # fastload would have kept them off the consumer's CPU
    assert _cpus(it.worker_pids) == [os.sched_getaffinity(0)] * 2
    list(it)


def test_a_starved_consumer_gets_its_workers_every_cpu_back_after_the_warmup(h5: Path) -> None:
    allowed = os.sched_getaffinity(0)
    it = iter(fastload.DataLoader(_Slow(h5), batch_size=1, num_workers=2, collate_fn=_collate()))
    pids = it.worker_pids
    seen: list[Any] = []
    for k, batch in enumerate(it):
        seen.extend(batch["lengths"].tolist())
        if k == WARMUP - 2:  # the warm-up is never judged, however starved
            assert _cpus(pids) != [allowed] * 2 and it._cores.confining
        if k == WARMUP + WINDOW:  # the first window was starved
            assert not it._cores.confining
            assert _cpus(pids) == [allowed] * 2
    assert seen == fastload.HDF5Dataset(h5).lengths.tolist()
