"""Host tuning behind one switch (``_engine/_host.py``): with it off, fastload leaves scheduling
to the operating system and every batch to a worker; the batches are the same either way."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
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
    host.enter()
    entered = (os.sched_getscheduler(0), frozenset(os.sched_getaffinity(0)))
    host.leave()
    queue.put((*entered, os.getpriority(os.PRIO_PROCESS, 0)))


@pytest.mark.parametrize("tuned", [True, False])
def test_a_worker_applies_the_policy_to_itself_only_when_tuned(tuned: bool) -> None:
    ctx = multiprocessing.get_context("fork")
    queue = ctx.SimpleQueue()
    allowed = frozenset(os.sched_getaffinity(0))
    one = frozenset([min(allowed)])
    child = ctx.Process(target=_in_a_child, args=(WorkerHost(tuned, one), queue))
    child.start()
    policy, cpus, nice = queue.get()
    child.join(5)
    assert policy == os.sched_getscheduler(0)  # the scheduling policy is never touched
    if tuned:
        assert cpus == one and nice == 19
    else:
        assert cpus == allowed and nice == os.getpriority(os.PRIO_PROCESS, 0)


def test_with_tuning_off_the_batches_are_the_same_and_every_one_comes_from_a_worker(h5: Path) -> None:
    def loader(tuned: bool) -> fastload.DataLoader[Any]:
        return fastload.DataLoader(
            fastload.HDF5Dataset(h5), batch_size=16, length_grouped=True, seed=3, num_workers=2, host_tuning=tuned
        )

    on, off = loader(True), loader(False)
    it = iter(off)
    for pid in it.worker_pids:  # untouched by fastload: the parent's CPUs
        assert os.sched_getaffinity(pid) == os.sched_getaffinity(0)
    # Stop the workers for a moment: a tuned main process would build the waiting batches itself.
    for pid in it.worker_pids:
        os.kill(pid, signal.SIGSTOP)
    resume = threading.Timer(0.3, lambda: [os.kill(p, signal.SIGCONT) for p in it.worker_pids])
    resume.start()
    got = [b["tokens"].clone() for b in it]
    resume.join()
    want = [b["tokens"].clone() for b in on]
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert off.stats().main_batches == 0
