"""Where a batch is the same whichever worker builds it, tasks are placed in time, not
round-robin (NOTE [tasks placed in time] in ``fastload/_engine/_engine.py``). The rule itself
is tested without processes (``tests/unit/engine``); here: which loaders use it, and that real
workers count what they finish as the engine counts what it sends them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _token_files import write_token_file
from _user_readers import UserReader

import fastload
from fastload._engine._runner import same_in_any_worker


@pytest.fixture(scope="module")
def h5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_token_file(tmp_path_factory.mktemp("placement") / "data.h5", 400, 64, seed=5)


class _UndeclaredReader(fastload.HDF5Dataset):
    """A subclass that does not say its reads are the same in any process (it may read
    otherwise): the base class then takes it as not."""


def _noop_init(worker_id: int) -> None:
    pass


def _options(loader: fastload.DataLoader) -> Any:
    it = iter(loader)
    try:
        return it._runner_options  # type: ignore[attr-defined]
    finally:
        del it


@pytest.mark.parametrize(
    ("make", "init", "expected"),
    [
        (lambda p: fastload.HDF5Dataset(p, fields=["tokens"]), None, True),
        (lambda p: fastload.HDF5Dataset(p), None, True),
        (lambda p: fastload.HDF5Dataset(p, fields=["tokens"]), _noop_init, False),
        (lambda p: _UndeclaredReader(p, fields=["tokens"]), None, False),
        (UserReader, None, False),
    ],
    ids=["one-call", "general", "worker_init_fn", "undeclared subclass", "user reader"],
)
def test_tasks_are_placed_in_time_only_where_any_worker_builds_the_same_batch(
    h5: Path, make: Any, init: Any, expected: bool
) -> None:
    loader = fastload.DataLoader(
        make(h5), batch_size=16, num_workers=2, collate_fn=fastload.PadCollate(), worker_init_fn=init
    )
    assert same_in_any_worker(_options(loader)) is expected


@pytest.mark.parametrize("persistent", [False, True])
def test_workers_count_what_they_finish_as_the_engine_counts_what_it_sends(h5: Path, persistent: bool) -> None:
    dataset = fastload.HDF5Dataset(h5, fields=["tokens"])
    order = torch.randperm(400, generator=torch.Generator().manual_seed(0)).tolist()
    plan = [order[i : i + 16] for i in range(0, 400, 16)]
    loader = fastload.DataLoader(
        dataset, batch_sampler=plan, num_workers=2, collate_fn=fastload.PadCollate(),
        persistent_workers=persistent,
    )
    want = [fastload.PadCollate()(dataset.read_batch(idx))["tokens"] for idx in plan]
    for _ in range(2 if persistent else 1):
        it = iter(loader)
        got = [next(it)["tokens"].clone()]
        engine = it._runner._engine  # type: ignore[attr-defined]  # kept past the epoch's end
        got += [b["tokens"].clone() for b in it]
        assert len(got) == len(want) == 25
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        assert engine._place_in_time
        sent = [book.sent for book in engine._dispatch._books]
        assert sum(sent) >= 25  # each batch once per epoch (earlier epochs' tasks count too)
        assert [engine._pool.finished(w) for w in range(2)] == sent
        del it
