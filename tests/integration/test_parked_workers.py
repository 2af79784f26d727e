"""A finished iterator's workers wait for the next iterator over the same data (NOTE [parked
workers] in ``fastload/_engine/_parking.py``): taken only where nothing could tell them from
fresh ones, with the same batches; never past their time, the process, or a changed file."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
from _procs import alive, wait_until
from _token_files import write_token_file

import fastload
from fastload._engine import _parking, _zygote

N = 240
pytestmark = pytest.mark.parked_workers


@pytest.fixture(autouse=True)
def _served() -> None:
    """Workers come from the worker server, unless a test turns it off."""
    if _zygote.warm() is None:
        pytest.skip("no worker server on this platform")


def _file(path: Path, seed: int = 0) -> Path:
    return write_token_file(path, N, 50, seed=seed)


def _plan(seed: int = 1) -> list[list[int]]:
    order = np.random.default_rng(seed).permutation(N)
    return [order[i : i + 16].tolist() for i in range(0, N, 16)]


def _loader(path: Path, plan: list[list[int]], **options: Any) -> fastload.DataLoader:
    collate = options.pop("collate_fn", None) or fastload.PadCollate(dtype=torch.int64, mask_dtype=torch.bool)
    return fastload.DataLoader(
        fastload.HDF5Dataset(path, fields=["tokens"]), batch_sampler=plan, num_workers=2, collate_fn=collate, **options
    )


def _epoch(loader: Any) -> tuple[list[int], list[dict[str, torch.Tensor]]]:
    """The epoch's batches (copied out of their slots) and the pids of the workers that built them."""
    it = iter(loader)
    pids = list(it.worker_pids)
    batches = [{k: v.clone() for k, v in b.items()} for b in it]
    return pids, batches


def _check(path: Path, plan: list[list[int]], batches: list[dict[str, torch.Tensor]]) -> None:
    ds = fastload.HDF5Dataset(path, fields=["tokens"])
    assert len(batches) == len(plan)
    for batch, indices in zip(batches, plan, strict=True):
        for row, i in enumerate(indices):
            sample = torch.as_tensor(np.asarray(ds[i]["tokens"]), dtype=torch.int64)
            assert int(batch["lengths"][row]) == len(sample)
            assert torch.equal(batch["tokens"][row, : len(sample)], sample)
            assert not batch["tokens"][row, len(sample) :].any()


def test_a_new_loader_over_the_same_data_takes_the_parked_workers(tmp_path: Path) -> None:
    path, plan = _file(tmp_path / "d.h5"), _plan()
    first, batches = _epoch(_loader(path, plan))
    _check(path, plan, batches)
    assert _parking.parked() == 1 and all(alive(p) for p in first)
    # Another loader, another dataset object, the same file and options; another order.
    other = _plan(seed=2)
    second, batches = _epoch(_loader(path, other))
    assert second == first
    _check(path, other, batches)


def test_the_epochs_of_a_loader_without_persistent_workers_share_them(tmp_path: Path) -> None:
    path, plan = _file(tmp_path / "d.h5"), _plan()
    loader = _loader(path, plan)
    pids = [_epoch(loader)[0] for _ in range(3)]
    assert pids[0] == pids[1] == pids[2]
    _check(path, plan, _epoch(loader)[1])


def test_a_loader_left_mid_epoch_parks_them_and_the_next_gets_exact_batches(tmp_path: Path) -> None:
    path, plan = _file(tmp_path / "d.h5"), _plan()
    it = iter(_loader(path, plan))
    first = list(it.worker_pids)
    next(it), next(it)
    del it  # tasks were in flight: their results belong to no one now
    pids, batches = _epoch(_loader(path, plan))
    assert pids == first
    _check(path, plan, batches)


@pytest.mark.parametrize(
    "change",
    ["the file rewritten in place", "the file replaced", "another collate", "another worker count", "another prefetch"],
)
def test_what_could_differ_is_not_taken(tmp_path: Path, change: str) -> None:
    path, plan = _file(tmp_path / "d.h5"), _plan()
    first, _ = _epoch(_loader(path, plan))
    options: dict[str, Any] = {}
    if change == "the file rewritten in place":
        inode = os.stat(path).st_ino
        _file(path, seed=5)  # h5py truncates and rewrites the same file
        assert os.stat(path).st_ino == inode
    elif change == "the file replaced":
        _file(tmp_path / "new.h5", seed=5)
        os.replace(tmp_path / "new.h5", path)
    elif change == "another collate":
        options["collate_fn"] = fastload.PadCollate(dtype=torch.int32, mask_dtype=torch.bool)
    elif change == "another worker count":
        options["num_workers"] = 1
    else:
        options["prefetch_factor"] = 4
    if "num_workers" in options:
        loader = fastload.DataLoader(
            fastload.HDF5Dataset(path, fields=["tokens"]), batch_sampler=plan,
            collate_fn=fastload.PadCollate(dtype=torch.int64, mask_dtype=torch.bool), **options,
        )  # fmt: skip
    else:
        loader = _loader(path, plan, **options)
    second, batches = _epoch(loader)
    assert not set(second) & set(first)
    if "file" in change:
        _check(path, plan, batches)
    # The one that was not taken waits for its own kind, and a later loader like it takes it.
    assert _parking.parked() == 2


@pytest.mark.parametrize("seconds", ["0.3", "0"])
def test_parked_workers_leave_when_their_time_is_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seconds: str) -> None:
    """``0``: not parked at all, they leave with the epoch, as torch's."""
    monkeypatch.setenv(_parking.ENV, seconds)
    path, plan = _file(tmp_path / "d.h5"), _plan()
    pids, _ = _epoch(_loader(path, plan))
    assert _parking.parked() == (seconds != "0")
    assert wait_until(lambda: not any(alive(p) for p in pids), 30), "workers outlived their time"
    assert _parking.parked() == 0


def test_a_parked_worker_that_died_is_not_taken(tmp_path: Path) -> None:
    path, plan = _file(tmp_path / "d.h5"), _plan()
    first, _ = _epoch(_loader(path, plan))
    os.kill(first[1], signal.SIGKILL)
    assert wait_until(lambda: not alive(first[1]), 30)
    second, batches = _epoch(_loader(path, plan))
    assert first[1] not in second
    _check(path, plan, batches)
    if first[0] not in second:  # closed with its runner (unless the runner's thread, polling
        # while parked, saw the death first and replaced the worker: then it was taken whole)
        assert wait_until(lambda: not alive(first[0]), 30), "the survivor of a dead pair was not closed"


def test_workers_the_caller_forked_are_parked_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_zygote.ENV, "0")  # no worker server: the caller forks them
    path, plan = _file(tmp_path / "d.h5"), _plan()
    first, _ = _epoch(_loader(path, plan))
    assert all(p in {c.pid for c in psutil.Process().children()} for p in first)
    second, batches = _epoch(_loader(path, plan))
    assert second == first
    _check(path, plan, batches)


def test_persistent_and_other_loaders_keep_their_own(tmp_path: Path) -> None:
    path, plan = _file(tmp_path / "d.h5"), _plan()
    persistent = _loader(path, plan, persistent_workers=True)
    mine, _ = _epoch(persistent)
    assert _parking.parked() == 0  # a persistent loader keeps its workers itself
    first, _ = _epoch(_loader(path, plan))
    assert not set(first) & set(mine)
    assert _epoch(persistent)[0] == mine


def test_break_state_dict_and_resume_with_parking_on(tmp_path: Path) -> None:
    """The loop as users write it: ``break``, ``state_dict()``, a new loader resumes; the epoch
    is exact whoever's workers build it (a resumed iterator starts its own)."""
    path = _file(tmp_path / "d.h5")

    def shuffled() -> fastload.DataLoader:
        return fastload.DataLoader(
            fastload.HDF5Dataset(path, fields=["tokens"]), batch_size=16, shuffle=True,
            generator=torch.Generator().manual_seed(7), num_workers=2,
            collate_fn=fastload.PadCollate(dtype=torch.int64, mask_dtype=torch.bool),
        )  # fmt: skip

    whole = [b["tokens"].clone() for b in shuffled()]
    loader = shuffled()
    got = []
    for i, batch in enumerate(loader):
        got.append(batch["tokens"].clone())
        if i == 4:
            break
    state = loader.state_dict()
    resumed = shuffled()
    resumed.load_state_dict(state)
    got += [b["tokens"].clone() for b in resumed]
    assert len(got) == len(whole)
    assert all(torch.equal(a, b) for a, b in zip(got, whole, strict=True))
    assert len([b for b in resumed]) == len(whole)  # its next epoch, whole


def _parked_in_a_child(queue: Any) -> None:
    queue.put(_parking.parked())


def test_a_forked_child_does_not_hold_its_parents_parked_workers(tmp_path: Path) -> None:
    path, plan = _file(tmp_path / "d.h5"), _plan()
    _epoch(_loader(path, plan))
    assert _parking.parked() == 1
    ctx = multiprocessing.get_context("fork")
    queue = ctx.SimpleQueue()
    child = ctx.Process(target=_parked_in_a_child, args=(queue,))
    child.start()
    child.join(30)
    assert child.exitcode == 0 and queue.get() == 0


_SCRIPT = textwrap.dedent(
    """
    import atexit, sys, torch, fastload
    from fastload._engine import _parking, _zygote
    _zygote.warm()
    # Registered after the engine's exit handlers: runs before them, and should find nothing
    # parked (the parked runners are closed first of all, by a handler registered at parking).
    atexit.register(lambda: print("parked at exit:", _parking.parked(), file=sys.stderr))
    loader = fastload.DataLoader(fastload.HDF5Dataset({path!r}, fields=["tokens"]), batch_size=16,
                                 num_workers=2, collate_fn=fastload.PadCollate(dtype=torch.int64),
                                 multiprocessing_context={context!r})
    it = iter(loader)
    print(*it.worker_pids, flush=True)
    for batch in it:
        pass
    """
)


@pytest.mark.parametrize("start", ["served", "forked", "forkserver"])
def test_nothing_parked_outlives_the_process(tmp_path: Path, start: str) -> None:
    # Workers from the worker server, forked by the caller (multiprocessing's children, as a
    # forkserver's are: its exit handler joins them), or from multiprocessing's forkserver (a
    # remote dataset's): each process exits cleanly, its parked workers closed before anything.
    path = _file(tmp_path / "d.h5")
    env = {**os.environ, _parking.ENV: "600", "FASTLOAD_WORKER_SERVER": "0" if start == "forked" else "1"}
    script = _SCRIPT.format(path=str(path), context="forkserver" if start == "forkserver" else None)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert "parked at exit: 0" in done.stderr, done.stderr
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 2
    assert wait_until(lambda: not any(alive(p) for p in pids), 30), "parked workers outlived their process"


def test_a_bad_parking_time_is_a_clear_error_at_iter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_parking.ENV, "soon")
    loader = _loader(_file(tmp_path / "d.h5"), _plan())
    with pytest.raises(ValueError, match="FASTLOAD_PARK_S must be a number of seconds"):
        iter(loader)
    monkeypatch.setenv(_parking.ENV, "-1")
    with pytest.raises(ValueError, match=">= 0"):
        _parking.park_seconds()


@pytest.mark.parametrize("collate", [fastload.PadCollate(dtype=torch.int64), fastload.PackCollate(64, rows=8)])
def test_a_collate_pickles_the_same_after_use(tmp_path: Path, collate: Any) -> None:
    """The parking key compares pickles: a collate's caches must not change its own."""
    import pickle

    before = pickle.dumps(collate)
    ds = fastload.HDF5Dataset(_file(tmp_path / "d.h5"), fields=["tokens"])
    collate([ds[i] for i in range(6)])
    assert pickle.dumps(collate) == before
