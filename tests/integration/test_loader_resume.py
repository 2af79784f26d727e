"""Exact resume through ``fastload.DataLoader.state_dict()``, with workers running and batches
prefetched but not consumed, on one rank and across a change of world size."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch

import fastload

sys.path.insert(0, str(Path(__file__).parent))
from test_fastpath import _write

N = 500


@pytest.fixture(scope="module")
def h5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("resume") / "data.h5"
    _write(path, N)
    with h5py.File(path, "a") as f:
        f.create_dataset("idx", data=np.arange(N, dtype=np.int64))  # which sample a row is
    return path


def _loader(h5: Path, **options: Any) -> fastload.DataLoader:
    options = {"batch_size": 16, "length_grouped": True, "seed": 7, "num_workers": 2, **options}
    return fastload.DataLoader(fastload.HDF5Dataset(h5, fields=["tokens", "idx"]), **options)


def _ids(batch: dict[str, torch.Tensor]) -> list[int]:
    return batch["idx"].tolist()


def _epoch(loader: fastload.DataLoader) -> list[list[int]]:
    return [_ids(b) for b in loader]


def test_each_iter_starts_the_next_epoch_and_set_epoch_repeats_one(h5: Path) -> None:
    loader = _loader(h5)
    first, second = _epoch(loader), _epoch(loader)
    assert first != second
    loader.set_epoch(0)
    assert _epoch(loader) == first


@pytest.mark.parametrize("stop_after", [0, 1, 5, 31, 32])
def test_resume_mid_epoch_continues_with_exactly_the_uninterrupted_batches(h5: Path, stop_after: int) -> None:
    reference = _loader(h5)
    epoch0, epoch1 = _epoch(reference), _epoch(reference)
    assert len(epoch0) == 32

    interrupted = _loader(h5)
    it = iter(interrupted)
    consumed = [_ids(next(it)) for _ in range(stop_after)]  # workers have prefetched more
    state = interrupted.state_dict()
    del it

    resumed = _loader(h5)
    resumed.load_state_dict(state)
    assert consumed + _epoch(resumed) == epoch0
    assert _epoch(resumed) == epoch1


def test_resume_twice_within_one_epoch(h5: Path) -> None:
    epoch0 = _epoch(_loader(h5))
    got: list[list[int]] = []
    state = None
    for take in (4, 9):
        loader = _loader(h5, persistent_workers=True)
        if state is not None:
            loader.load_state_dict(state)
        it = iter(loader)
        got.extend(_ids(next(it)) for _ in range(take))
        state = loader.state_dict()
        del it, loader
    loader = _loader(h5)
    loader.load_state_dict(state)
    assert got + _epoch(loader) == epoch0


def test_state_dict_is_plain_data(h5: Path) -> None:
    import json

    loader = _loader(h5)
    it = iter(loader)
    next(it)
    json.dumps(loader.state_dict())
    del it


def test_elastic_resume_from_two_ranks_onto_three_covers_the_rest_once(h5: Path) -> None:
    lengths = fastload.HDF5Dataset(h5).lengths

    def rank_loader(rank: int, world: int) -> fastload.DataLoader:
        sampler = fastload.LengthGroupedBatchSampler(lengths, batch_size=8, seed=1, num_replicas=world, rank=rank)
        return fastload.DataLoader(
            fastload.HDF5Dataset(h5, fields=["tokens", "idx"]), batch_sampler=sampler, num_workers=1
        )

    seen: list[int] = []
    states = []
    for rank in range(2):
        loader = rank_loader(rank, 2)
        it = iter(loader)
        for _ in range(6):
            seen.extend(next(it)["idx"].tolist())
        states.append(loader.state_dict())
        del it
    for rank in range(3):
        loader = rank_loader(rank, 3)
        loader.load_state_dict(states[0])
        seen.extend(x for b in loader for x in b["idx"].tolist())
    # every sample at least once; repeats only from the documented padding of a last round
    assert set(seen) == set(range(N))
    assert len(seen) - N < 3 * 8


def test_a_plain_loader_is_resumable_too(h5: Path) -> None:
    loader = fastload.DataLoader(fastload.HDF5Dataset(h5), batch_size=4)
    assert loader.state_dict()["sampler"]["sampler"] == "BatchSampler(SequentialSampler)"


def _save_at(h5: Path, epoch: int, batches: int, **options: Any) -> tuple[list[list[int]], dict[str, Any]]:
    """The first ``batches`` batches of ``epoch`` and the state right after them (through JSON,
    as a checkpoint would keep it); workers have prefetched more than that."""
    import json

    loader = _loader(h5, **options)
    loader.set_epoch(epoch)
    it = iter(loader)
    taken = [_ids(next(it)) for _ in range(batches)]
    state = json.loads(json.dumps(loader.state_dict()))
    del it
    return taken, state


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("stop_after", [0, 20, 32])
def test_the_usual_resume_loop_with_set_epoch_equals_an_uninterrupted_run(
    h5: Path, num_workers: int, stop_after: int
) -> None:
    reference = _loader(h5, num_workers=num_workers)
    uninterrupted = []
    for epoch in range(3):
        reference.set_epoch(epoch)
        uninterrupted.extend(_epoch(reference))

    taken, state = _save_at(h5, 0, stop_after, num_workers=num_workers)
    resumed = _loader(h5, num_workers=num_workers)
    resumed.load_state_dict(state)
    got = list(taken)
    for epoch in range(3):  # what a training loop (and Hugging Face's Trainer) does
        resumed.set_epoch(epoch)
        got.extend(_epoch(resumed))
    assert got == uninterrupted


def test_set_epoch_keeps_a_loaded_position_only_for_its_own_epoch(h5: Path) -> None:
    reference = _loader(h5)
    reference.set_epoch(1)
    epoch1, epoch2 = _epoch(reference), _epoch(reference)
    taken, state = _save_at(h5, 1, 20)
    assert taken == epoch1[:20]

    kept = _loader(h5)
    kept.load_state_dict(state)
    kept.set_epoch(1)
    assert len(kept) == 12
    assert kept.state_dict() == state  # nothing consumed since the load
    assert _epoch(kept) == epoch1[20:]

    moved = _loader(h5)
    moved.load_state_dict(state)
    moved.set_epoch(2)
    assert len(moved) == 32
    assert _epoch(moved) == epoch2


def test_the_samplers_own_set_epoch_after_loading_keeps_the_position(h5: Path) -> None:
    reference = _loader(h5)
    reference.set_epoch(1)
    epoch1 = _epoch(reference)
    _, state = _save_at(h5, 1, 5)
    resumed = _loader(h5)
    resumed.load_state_dict(state)
    resumed.batch_sampler.set_epoch(1)
    assert _epoch(resumed) == epoch1[5:]



@pytest.mark.parametrize("persistent_workers", [False, True])
@pytest.mark.parametrize("caller", ["loader", "sampler"])
def test_a_state_taken_after_set_epoch_starts_that_epoch(
    h5: Path, persistent_workers: bool, caller: str
) -> None:
    loader = _loader(h5, persistent_workers=persistent_workers)
    _epoch(loader)
    # the finished epoch's 32 batches are not epoch 1's
    (loader if caller == "loader" else loader.batch_sampler).set_epoch(1)
    state = loader.state_dict()
    assert (state["sampler"]["epoch"], state["sampler"]["batches_consumed"]) == (1, 0)


def test_loading_a_state_of_other_settings_raises_at_once(h5: Path) -> None:
    _, state = _save_at(h5, 0, 3)
    loader = _loader(h5, batch_size=8)
    with pytest.raises(ValueError, match="batch_size"):
        loader.load_state_dict(state)
