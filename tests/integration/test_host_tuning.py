"""Host tuning behind one switch (``_engine/_host.py``): a leaving worker drops to nice 19 only
where it is on; the batches are the same either way, and the workers' CPUs are the parent's."""

from __future__ import annotations

import multiprocessing
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import fastload
from fastload._engine._host import ENV, HostPolicy, WorkerHost

sys.path.insert(0, str(Path(__file__).parent))
from _token_files import write_token_file

N = 600


@pytest.fixture(scope="module")
def h5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_token_file(tmp_path_factory.mktemp("host") / "tokens.h5", N, 120)


@pytest.mark.parametrize(
    ("option", "env", "tuned"),
    [(None, None, True), (None, "0", False), (None, "off", False), (None, "1", True), (True, "0", True), (False, "1", False)],
)
def test_the_option_wins_over_the_environment_which_wins_over_the_default(
    option: bool | None, env: str | None, tuned: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if env is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, env)
    assert HostPolicy.resolve(option).tuned is tuned


def _in_a_child(host: WorkerHost, queue: Any) -> None:
    host.leave()
    queue.put((os.sched_getscheduler(0), frozenset(os.sched_getaffinity(0)), os.getpriority(os.PRIO_PROCESS, 0)))


@pytest.mark.parametrize("tuned", [True, False])
def test_a_leaving_worker_lowers_its_priority_only_when_tuned(tuned: bool) -> None:
    ctx = multiprocessing.get_context("fork")
    queue = ctx.SimpleQueue()
    allowed = frozenset(os.sched_getaffinity(0))
    child = ctx.Process(target=_in_a_child, args=(WorkerHost(tuned), queue))
    child.start()
    policy, cpus, nice = queue.get()
    child.join(5)
    assert policy == os.sched_getscheduler(0)  # the scheduling policy is never touched
    assert cpus == allowed  # nor where it runs
    assert nice == (19 if tuned else os.getpriority(os.PRIO_PROCESS, 0))


@pytest.mark.parametrize("tuned", [True, False])
def test_either_way_the_batches_are_the_same_and_the_workers_run_where_the_parent_may(h5: Path, tuned: bool) -> None:
    def loader(tuned: bool) -> fastload.DataLoader[Any]:
        return fastload.DataLoader(
            fastload.HDF5Dataset(h5), batch_size=16, length_grouped=True, seed=3, num_workers=2, host_tuning=tuned
        )

    it = iter(loader(tuned))
    for pid in it.worker_pids:  # untouched by fastload: the parent's CPUs
        assert os.sched_getaffinity(pid) == os.sched_getaffinity(0)
    got = [b["tokens"].clone() for b in it]
    want = [b["tokens"].clone() for b in fastload.DataLoader(
        fastload.HDF5Dataset(h5), batch_size=16, length_grouped=True, seed=3, num_workers=0
    )]
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
