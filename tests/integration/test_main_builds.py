"""While ``next()`` would wait, the main process builds a fast-path batch no worker has started
(``_engine/_claims.py``): every batch still arrives exactly once and in order, a worker drops
a task the main process took without touching its slot, and the main process builds only what
it would build exactly as a worker does (one-call builds; fastload's own readers padded by a
plain ``PadCollate``), never with a ``worker_init_fn``.

The workers are stopped (SIGSTOP) between two epochs of a persistent loader, so that the main
process must build everything the next epoch asks for while their task pipes fill up.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data
from _procs import alive, wait_until
from _token_files import write_token_file
from _user_readers import UserReader

import fastload
from fastload._engine import _claims as claims
from fastload.errors import LoaderTimeoutError

pytestmark = [
    pytest.mark.skipif(not claims.available(), reason="the _atomic extension was not built"),
    pytest.mark.host_tuned,  # the mechanism under test (tests/conftest.py)
]

N = 400


@pytest.fixture(scope="module")
def h5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_token_file(tmp_path_factory.mktemp("main") / "data.h5", N, 100, seed=5, label=True)


def _collate() -> fastload.PadCollate:
    return fastload.PadCollate(dtype=torch.int64)


def _plan(size: int = 16, seed: int = 2) -> list[list[int]]:
    order = np.random.default_rng(seed).permutation(N)
    return [order[i : i + size].tolist() for i in range(0, N, size)]


def _reference(path: Path, plan: Any, fields: list[str] | None = None) -> list[dict[str, Any]]:
    return list(torch.utils.data.DataLoader(fastload.HDF5Dataset(path, fields=fields), batch_sampler=plan, collate_fn=_collate()))


def _same(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)


def _loader(path: Path, plan: Any, **options: Any) -> fastload.DataLoader:
    options.setdefault("collate_fn", _collate())
    dataset = options.pop("dataset", None) or fastload.HDF5Dataset(path, fields=options.pop("fields", ["tokens"]))
    return fastload.DataLoader(dataset, batch_sampler=plan, num_workers=2, persistent_workers=True, **options)


def _after_an_epoch(path: Path, plan: Any, fields: list[str] | None = None) -> tuple[fastload.DataLoader, list[dict[str, Any]], list[int]]:
    """A persistent loader (of ``fields``, by default the token field alone: one-call builds)
    that has run one epoch, checked; the reference batches; its workers' pids."""
    fields = ["tokens"] if fields is None else fields
    loader = _loader(path, plan, fields=fields)
    want = _reference(path, plan, fields)
    _same(list(loader), want)
    return loader, want, loader._iterator.worker_pids


@contextlib.contextmanager
def _stopped(pids: list[int]) -> Iterator[None]:
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def _continue_later(pids: list[int], after_s: float) -> threading.Timer:
    def go() -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    timer = threading.Timer(after_s, go)
    timer.start()
    return timer


@pytest.mark.parametrize("fields", [["tokens"], ["tokens", "label"]], ids=["one-call", "general"])
def test_with_its_workers_stopped_the_main_process_builds_every_batch_in_order(h5: Path, fields: list[str] | None) -> None:
    plan = _plan()
    loader, want, pids = _after_an_epoch(h5, plan, fields)
    before = loader.stats().main_batches
    with _stopped(pids):
        _same(list(loader), want)
        assert loader.stats().main_batches - before == len(plan)
    _same(list(loader), want)  # the workers, running again, drop what the main process built


def test_a_worker_never_writes_into_the_slot_of_a_batch_the_main_process_built(h5: Path) -> None:
    loader, want, pids = _after_an_epoch(h5, _plan(size=8))
    with _stopped(pids):
        held = list(loader)  # built by the main process; each holds its slot
    _same(held, want)
    for batch in held:  # the consumer owns its batches and may write into them
        for tensor in batch.values():
            tensor.zero_()
    # The workers now read every task of that epoch (and then the next epoch's): had one built
    # a task the main process took, its slot (still held here) would hold token ids again.
    _same(list(loader), want)
    assert all(not tensor.any() for batch in held for tensor in batch.values())


def test_a_worker_killed_while_the_main_process_builds_loses_nothing(h5: Path) -> None:
    loader, want, pids = _after_an_epoch(h5, _plan(size=8))
    with _stopped(pids):
        it = iter(loader)
        got = [next(it) for _ in range(3)]
        os.kill(pids[0], signal.SIGKILL)  # its tasks go, with new tickets, to a fresh worker
        assert wait_until(lambda: not alive(pids[0]))
        got.extend(it)
    _same(got, want)
    assert loader._iterator.worker_pids[0] != pids[0]
    _same(list(loader), want)


@pytest.mark.parametrize("fields", [["tokens"], ["tokens", "label"]], ids=["one-call", "general"])
def test_a_worker_killed_while_the_main_process_builds_is_replaced_within_a_few_batches(h5: Path, fields: list[str], driver: str) -> None:
    plan = _plan(size=4)
    loader, want, pids = _after_an_epoch(h5, plan, fields)
    # At most every task in flight is queued ahead of a poll: prefetch_factor (2) x 2 workers.
    bound = 2 * len(pids) + 1
    with _stopped(pids):  # the main process builds every batch of this epoch
        it = iter(loader)
        got = [next(it) for _ in range(3)]
        os.kill(pids[0], signal.SIGKILL)
        assert wait_until(lambda: not alive(pids[0]))
        for _ in range(bound):
            got.append(next(it))
            if pids[0] not in loader._iterator.worker_pids:
                break
        listed = loader._iterator.worker_pids
        assert pids[0] not in listed, f"{bound} batches after its death, worker {pids[0]} is still listed"
        assert len(listed) == 2 and all(alive(pid) for pid in listed if pid != pids[1])
        got.extend(it)
    _same(got, want)
    _same(list(loader), want)


def test_a_batch_the_main_process_cannot_build_is_left_to_a_worker_and_fails_there(h5: Path) -> None:
    plan = _plan()[:6]
    plan[2] = [3, N + 5, 7]  # out of range: the one-call build refuses it
    loader = _loader(h5, plan)
    good = [b for i, b in enumerate(plan) if i != 2]
    want = _reference(h5, good, ["tokens"])

    def epoch() -> tuple[list[dict[str, Any]], list[BaseException]]:
        got: list[dict[str, Any]] = []
        errors: list[BaseException] = []
        it = iter(loader)
        while True:
            try:
                got.append(next(it))
            except StopIteration:
                return got, errors
            except IndexError as exc:
                errors.append(exc)

    got, errors = epoch()
    _same(got, want)
    pids = loader._iterator.worker_pids
    timer = _continue_later(pids, 0.5)  # batch 2 waits for a worker, stopped until then
    try:
        with _stopped(pids):
            got, errors = epoch()
    finally:
        timer.join()
    _same(got, want)
    assert len(errors) == 1
    assert "in DataLoader worker process" in str(errors[0])
    assert f"index {N + 5} (position 1 of the request) is out of range" in str(errors[0])


class _OneHuge:
    """A batch sampler that says batches have 2 rows (so slots are sized for 2) but yields one
    far larger."""

    batch_size = 2

    def __init__(self) -> None:
        self.batches = [[0, 1], [2, 3], list(range(4, 300)), [5, 6], [7, 8]]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def test_an_oversize_batch_the_main_process_took_gets_a_bigger_slot_from_a_worker(h5: Path) -> None:
    plan = _OneHuge()
    loader = _loader(h5, plan)
    want = _reference(h5, plan.batches, ["tokens"])
    _same(list(loader), want)
    pids = loader._iterator.worker_pids
    timer = _continue_later(pids, 0.5)
    try:
        with _stopped(pids):
            _same(list(loader), want)
    finally:
        timer.join()
    assert loader._iterator._runner._codec.oversize_batches == 2  # once per epoch


class _MyPad(fastload.PadCollate):
    """A collate of the user's own (that it changes nothing is not for fastload to know)."""


@pytest.mark.parametrize("case", ["a worker_init_fn", "a reader of the user's own", "a PadCollate subclass"])
def test_the_main_process_builds_nothing_where_it_could_differ_from_a_worker(h5: Path, case: str) -> None:
    options: dict[str, Any] = {"timeout": 0.5}
    if case == "a worker_init_fn":
        options["worker_init_fn"] = _init
    elif case == "a reader of the user's own":
        options["dataset"] = UserReader(h5)
    else:
        options["fields"] = None  # the general builds, which a subclass may plan otherwise
        options["collate_fn"] = _MyPad(dtype=torch.int64)
    plan = _plan()
    loader = _loader(h5, plan, **options)
    list(loader)
    pids = loader._iterator.worker_pids
    with _stopped(pids):
        it = iter(loader)
        with pytest.raises(LoaderTimeoutError):
            next(it)
        assert loader.stats().main_batches == 0
        del it


def _init(worker_id: int) -> None:
    """A worker_init_fn that changes nothing."""
