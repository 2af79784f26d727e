"""Faults never hang and never lose data: dead workers, poison samples, a dead parent, and every
way out of an epoch, with real processes."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch

import fastload
from fastload._engine import _reaper
from fastload.errors import WorkerCrashedError

sys.path.insert(0, str(Path(__file__).parent))
from _fault_datasets import DiesOnce, Hangs, Poison, Slow
from _procs import alive, live_children

HERE = Path(__file__).parent


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if alive(p)]
    return left


def _values(batches: list[torch.Tensor]) -> list[int]:
    return [int(v) for b in batches for v in b]


@pytest.mark.parametrize("how", ["exit", "segfault", "kill"])
def test_a_worker_that_dies_once_is_replaced_and_the_epoch_is_complete_and_ordered(
    tmp_path: Path, how: str
) -> None:
    ds = DiesOnce(64, victim=21, marker=tmp_path / "died", how=how)
    loader = fastload.DataLoader(ds, batch_size=4, num_workers=2)
    assert _values(list(loader)) == list(range(64))
    assert (tmp_path / "died").exists()


def test_killing_a_worker_mid_epoch_redispatches_its_batches(tmp_path: Path) -> None:
    loader = fastload.DataLoader(Slow(80, delay_s=0.005), batch_size=4, num_workers=2)
    it = iter(loader)
    got = [next(it) for _ in range(3)]
    old = it.worker_pids
    os.kill(old[0], signal.SIGKILL)
    got.extend(it)
    assert _values(got) == list(range(80))
    assert it.worker_pids == []  # shut down at the end of the epoch


def test_a_replacement_worker_gets_a_new_pid(tmp_path: Path) -> None:
    loader = fastload.DataLoader(Slow(400, delay_s=0.002), batch_size=4, num_workers=2)
    it = iter(loader)
    next(it)
    victim = it.worker_pids[1]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while victim in it.worker_pids and time.monotonic() < deadline:
        next(it)
    assert victim not in it.worker_pids
    assert len(it.worker_pids) == 2
    del it


def _new_children(before: set[int], timeout_s: float = 5) -> set[int]:
    """Children of this process not in ``before`` still alive after ``timeout_s`` (other tests
    may have left a forkserver or resource tracker running: those are not ours)."""
    deadline = time.monotonic() + timeout_s
    while True:
        new = {p.pid for p in live_children()} - before
        if not new or time.monotonic() > deadline:
            return new
        time.sleep(0.05)


def test_a_sample_that_kills_every_worker_raises_naming_the_batch_and_indices() -> None:
    before = {p.pid for p in live_children()}
    loader = fastload.DataLoader(Poison(40, victim=13), batch_size=4, num_workers=2)
    with pytest.raises(WorkerCrashedError, match=r"batch 3 from sample indices \[12, 13, 14, 15\]"):
        list(loader)
    assert _new_children(before) == set()


def _exit_at_start(worker_id: int) -> None:
    os._exit(1)


def test_workers_that_die_as_they_start_raise_instead_of_being_respawned_forever() -> None:
    before = {p.pid for p in live_children()}
    loader = fastload.DataLoader(torch.arange(16), batch_size=4, num_workers=2, worker_init_fn=_exit_at_start)
    with pytest.raises(WorkerCrashedError, match=r"died 3 times without building a batch"):
        list(loader)
    assert _new_children(before) == set()


def test_worker_crash_error_is_a_runtime_error_like_torchs() -> None:
    assert issubclass(WorkerCrashedError, RuntimeError)


def test_timeout_raises_when_a_worker_hangs() -> None:
    before = {p.pid for p in live_children()}
    loader = fastload.DataLoader(Hangs(16, victim=5), batch_size=2, num_workers=1, timeout=0.5)
    it = iter(loader)
    next(it)
    next(it)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"DataLoader timed out after 0\.5 seconds"):
        next(it)
    assert time.monotonic() - start < 3
    assert _new_children(before) == set()


@pytest.mark.parametrize("exit_path", ["end", "break", "del_loader", "exception"])
def test_every_exit_path_leaves_no_child_process(exit_path: str) -> None:
    loader = fastload.DataLoader(Slow(64, delay_s=0.001), batch_size=4, num_workers=2)
    it = iter(loader)
    pids = list(it.worker_pids)
    assert len(pids) == 2
    if exit_path == "end":
        list(it)
    elif exit_path == "break":
        for _ in it:
            break
        del it
    elif exit_path == "del_loader":
        next(it)
        del it, loader
    else:
        with pytest.raises(ZeroDivisionError):
            for _ in it:
                1 / 0  # noqa: B018
        del it
    gc.collect()
    assert _wait_gone(pids, 30) == []


def test_persistent_workers_survive_epochs_and_stop_with_the_loader() -> None:
    loader = fastload.DataLoader(Slow(16), batch_size=4, num_workers=2, persistent_workers=True)
    assert _values(list(loader)) == list(range(16))
    pids = list(loader._iterator.worker_pids)
    assert _values(list(loader)) == list(range(16))
    assert loader._iterator.worker_pids == pids
    del loader
    gc.collect()
    assert _wait_gone(pids, 30) == []


def test_thirty_epochs_grow_neither_file_descriptors_nor_child_processes() -> None:
    proc = psutil.Process()
    loader = fastload.DataLoader(Slow(32), batch_size=4, num_workers=2)

    def epochs(n: int) -> None:
        for _ in range(n):
            assert _values(list(loader)) == list(range(32))
        gc.collect()

    before = {p.pid for p in live_children()}
    epochs(3)
    assert _new_children(before) == set()
    _reaper.flush()
    fds = proc.num_fds()
    epochs(30)
    assert _new_children(before) == set()
    _reaper.flush()  # the last epoch's workers are joined in the background
    assert proc.num_fds() <= fds + 2  # allow for lazily opened interpreter files


_PARENT_SCRIPT = textwrap.dedent(
    """
    import faulthandler, signal, sys, time
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a test that times out asks for stacks
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's Ctrl-C, even when
    # the suite was started in the background, where SIGINT arrives ignored
    sys.path.insert(0, {here!r})
    import torch.multiprocessing
    import fastload
    from _fault_datasets import Slow
    loader = fastload.DataLoader(Slow(10_000, delay_s=0.01), batch_size=2, num_workers=2,
                                 multiprocessing_context={ctx!r})
    it = iter(loader)
    next(it)
    print(" ".join(map(str, it.worker_pids)), flush=True)
    {tail}
    """
)


def _shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.mark.parametrize("ctx", ["fork", "spawn", "forkserver"])
def test_workers_exit_by_themselves_when_the_parent_is_sigkilled(ctx: str) -> None:
    before = _shm_entries()
    script = _PARENT_SCRIPT.format(here=str(HERE), ctx=ctx, tail="for _ in it: pass")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        line = parent.stdout.readline()  # type: ignore[union-attr]
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2, line
        parent.send_signal(signal.SIGKILL)
        parent.wait(30)
        assert _wait_gone(pids, 30) == []
    finally:
        if parent.poll() is None:
            parent.kill()
        parent.stdout.close()  # type: ignore[union-attr]
    leftovers = {e for e in _shm_entries() - before if "torch" in e or "fastload" in e}
    assert leftovers == set()


def test_keyboard_interrupt_in_the_training_loop_leaves_no_worker_behind() -> None:
    tail = "for _ in it: time.sleep(0.01)"
    script = _PARENT_SCRIPT.format(here=str(HERE), ctx="fork", tail=tail)
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]  # type: ignore[union-attr]
        assert len(pids) == 2
        time.sleep(0.3)
        parent.send_signal(signal.SIGINT)
        try:
            _, err = parent.communicate(timeout=60)  # bounds a hang; exits in well under 1 s idle
        except subprocess.TimeoutExpired:
            parent.send_signal(signal.SIGUSR1)  # every thread's stack, for the report
            time.sleep(1)
            parent.kill()
            _, err = parent.communicate()
            raise AssertionError(f"the loop did not end 60 s after Ctrl-C; its threads:\n{err[-6000:]}") from None
        assert parent.returncode != 0
        assert "KeyboardInterrupt" in err
        assert _wait_gone(pids, 30) == []
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.communicate()
