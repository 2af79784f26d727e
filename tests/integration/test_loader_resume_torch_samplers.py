"""Exact resume of a plain drop-in loader over torch's own samplers, with real worker processes
and a real HDF5 file: the usual loop (save mid-epoch, a new loader loads the state, then
``set_epoch(e)`` before each epoch) yields, batch for batch, what an uninterrupted run does, and
leaves torch's RNGs where that run leaves them."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
)

import fastload

sys.path.insert(0, str(Path(__file__).parent))
from _token_files import write_token_file

N = 400  # 50 batches of 8 per epoch; 25 per rank on 2 ranks
SEED = 2024


@pytest.fixture(scope="module")
def h5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_token_file(tmp_path_factory.mktemp("resume_torch") / "data.h5", N, 40, seed=5)
    with h5py.File(path, "a") as f:
        f.create_dataset("idx", data=np.arange(N, dtype=np.int64))  # which sample a row is
    return path


def _dataset(h5: Path) -> fastload.HDF5Dataset:
    return fastload.HDF5Dataset(h5, fields=["tokens", "idx"])


# Each makes a loader's keyword arguments afresh (generators and samplers included).
KINDS: dict[str, Callable[[Any], dict[str, Any]]] = {
    "length_grouped": lambda ds: {"batch_size": 8, "length_grouped": True, "seed": 3},
    "shuffle": lambda ds: {"batch_size": 8, "shuffle": True},
    "shuffle_generator": lambda ds: {
        "batch_size": 8,
        "shuffle": True,
        "generator": torch.Generator().manual_seed(11),
    },
    "sequential": lambda ds: {"batch_size": 8, "sampler": SequentialSampler(ds)},
    "distributed_rank0": lambda ds: {
        "batch_size": 8,
        "sampler": DistributedSampler(ds, num_replicas=2, rank=0, seed=9),
    },
    "distributed_rank1": lambda ds: {
        "batch_size": 8,
        "sampler": DistributedSampler(ds, num_replicas=2, rank=1, seed=9),
    },
    "batch_sampler": lambda ds: {
        "batch_sampler": BatchSampler(RandomSampler(ds), 8, drop_last=True),
    },
}


def _loader(h5: Path, kind: str, num_workers: int, **options: Any) -> fastload.DataLoader:
    ds = _dataset(h5)
    return fastload.DataLoader(ds, num_workers=num_workers, **KINDS[kind](ds), **options)


def _ids(batch: dict[str, torch.Tensor]) -> list[int]:
    return batch["idx"].tolist()


def _run(loader: fastload.DataLoader, epochs: range) -> list[list[list[int]]]:
    """The usual training loop (and Hugging Face's Trainer): ``set_epoch`` before each epoch.
    Each epoch's batches of sample ids."""
    out = []
    for epoch in epochs:
        loader.set_epoch(epoch)
        out.append([_ids(b) for b in loader])
    return out


def _after(loader: fastload.DataLoader) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Where the run leaves torch's global RNG and the loader's generator."""
    generator = loader.generator
    return torch.get_rng_state(), None if generator is None else generator.get_state()


def _save(h5: Path, kind: str, num_workers: int, stop_after: int | str) -> tuple[list[list[int]], dict[str, Any]]:
    """The first batches of epoch 0 and the state right after them (through JSON, as a
    checkpoint keeps it); workers have prefetched more. ``"last"`` stops after the epoch's last
    batch, before the loop learns that the epoch has ended."""
    torch.manual_seed(SEED)
    loader = _loader(h5, kind, num_workers)
    loader.set_epoch(0)
    count = len(loader) if stop_after == "last" else int(stop_after)
    it = iter(loader)
    taken = [_ids(next(it)) for _ in range(count)]
    state = json.loads(json.dumps(loader.state_dict()))
    del it
    return taken, state


def _check_the_usual_loop(h5: Path, kind: str, num_workers: int, stop_after: int | str) -> None:
    torch.manual_seed(SEED)
    reference = _loader(h5, kind, num_workers)
    uninterrupted = _run(reference, range(3))
    rng_after = _after(reference)
    assert (uninterrupted[0] == uninterrupted[1]) == (kind == "sequential")

    taken, state = _save(h5, kind, num_workers, stop_after)
    torch.manual_seed(SEED)  # the global RNG as it was when the run began
    resumed = _loader(h5, kind, num_workers)
    resumed.load_state_dict(state)
    got = _run(resumed, range(3))
    assert taken + got[0] == uninterrupted[0]
    assert got[1:] == uninterrupted[1:]
    rng_resumed = _after(resumed)
    assert torch.equal(rng_resumed[0], rng_after[0]), "the global RNG differs after the run"
    if rng_after[1] is not None:
        assert torch.equal(rng_resumed[1], rng_after[1]), "the generator differs after the run"  # type: ignore[arg-type]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", [k for k in KINDS if k != "length_grouped"])
def test_the_usual_resume_loop_equals_an_uninterrupted_run(h5: Path, kind: str, num_workers: int) -> None:
    _check_the_usual_loop(h5, kind, num_workers, 20)


@pytest.mark.parametrize("stop_after", [0, "last"])
@pytest.mark.parametrize("kind", ["shuffle", "shuffle_generator", "distributed_rank1"])
def test_resuming_at_an_epochs_first_or_last_batch(h5: Path, kind: str, stop_after: int | str) -> None:
    _check_the_usual_loop(h5, kind, 2, stop_after)


def test_a_state_counts_only_the_batches_the_consumer_received(h5: Path) -> None:
    torch.manual_seed(SEED)
    epoch0 = [_ids(b) for b in _loader(h5, "shuffle", 0)]
    torch.manual_seed(SEED)
    loader = _loader(h5, "shuffle", 2, prefetch_factor=4)
    it = iter(loader)
    taken = [_ids(next(it)) for _ in range(3)]  # 8 batches are in flight
    state = loader.state_dict()
    del it
    assert state["sampler"]["batches_consumed"] == 3
    resumed = _loader(h5, "shuffle", 0)
    resumed.load_state_dict(state)
    assert taken + [_ids(b) for b in resumed] == epoch0


def test_len_and_state_dict_right_after_loading(h5: Path) -> None:
    _, state = _save(h5, "shuffle", 0, 20)
    loader = _loader(h5, "shuffle", 0)
    loader.load_state_dict(state)
    assert len(loader) == 30
    assert loader.state_dict() == state
    loader.set_epoch(0)
    assert (len(loader), loader.state_dict()) == (30, state)
    loader.set_epoch(1)
    assert len(loader) == 50
    assert loader.state_dict()["sampler"]["batches_consumed"] == 0


def test_a_distributed_samplers_own_set_epoch_after_loading(h5: Path) -> None:
    def make() -> tuple[fastload.DataLoader, DistributedSampler[int]]:
        ds = _dataset(h5)
        sampler: DistributedSampler[int] = DistributedSampler(ds, num_replicas=2, rank=0)
        return fastload.DataLoader(ds, batch_size=8, sampler=sampler, num_workers=2), sampler

    reference, sampler = make()
    sampler.set_epoch(1)
    epoch1 = [_ids(b) for b in reference]
    sampler.set_epoch(2)
    epoch2 = [_ids(b) for b in reference]

    saver, sampler = make()
    sampler.set_epoch(1)  # the DDP loop: the sampler's own set_epoch, not the loader's
    it = iter(saver)
    taken = [_ids(next(it)) for _ in range(5)]
    state = saver.state_dict()
    del it

    kept, sampler = make()
    kept.load_state_dict(state)
    sampler.set_epoch(1)
    assert taken + [_ids(b) for b in kept] == epoch1
    moved, sampler = make()
    moved.load_state_dict(state)
    sampler.set_epoch(2)
    assert [_ids(b) for b in moved] == epoch2


def test_a_state_taken_after_the_distributed_samplers_set_epoch_starts_that_epoch(h5: Path) -> None:
    ds = _dataset(h5)
    sampler: DistributedSampler[int] = DistributedSampler(ds, num_replicas=2, rank=0)
    loader = fastload.DataLoader(ds, batch_size=8, sampler=sampler)
    list(loader)
    sampler.set_epoch(1)  # the finished epoch's 25 batches are not epoch 1's
    state = loader.state_dict()["sampler"]
    assert (state["epoch"], state["batches_consumed"]) == (1, 0)


class _Squares(Dataset[int]):
    def __len__(self) -> int:
        return 30

    def __getitem__(self, index: int) -> int:
        return index * index


@pytest.mark.parametrize("num_workers", [0, 2])
def test_without_auto_collation_samples_are_counted(num_workers: int) -> None:
    def make() -> fastload.DataLoader:
        return fastload.DataLoader(_Squares(), batch_size=None, shuffle=True, num_workers=num_workers)

    def epoch_of(loader: fastload.DataLoader, epoch: int) -> list[int]:
        loader.set_epoch(epoch)
        return [int(x) for x in loader]

    torch.manual_seed(SEED)
    reference = make()
    expected = epoch_of(reference, 0) + epoch_of(reference, 1)
    torch.manual_seed(SEED)
    saver = make()
    it = iter(saver)
    taken = [int(next(it)) for _ in range(7)]
    state = saver.state_dict()
    del it
    assert state["sampler"]["batches_consumed"] == 7
    torch.manual_seed(SEED)
    resumed = make()
    resumed.load_state_dict(state)
    assert taken + epoch_of(resumed, 0) + epoch_of(resumed, 1) == expected


def test_a_length_grouped_state_does_not_load_into_a_shuffled_loader(h5: Path) -> None:
    _, state = _save(h5, "length_grouped", 0, 3)
    with pytest.raises(ValueError, match="sampler='LengthGroupedBatchSampler'"):
        _loader(h5, "shuffle", 0).load_state_dict(state)
    _, state = _save(h5, "shuffle", 0, 3)
    with pytest.raises(ValueError, match="batch_size=8 but this sampler has batch_size=16"):
        fastload.DataLoader(_dataset(h5), batch_size=16, shuffle=True).load_state_dict(state)
    with pytest.raises(ValueError, match="generator=False"):
        _loader(h5, "shuffle_generator", 0).load_state_dict(state)


def test_a_distributed_state_does_not_load_onto_another_world_size(h5: Path) -> None:
    _, state = _save(h5, "distributed_rank0", 0, 3)
    ds = _dataset(h5)
    loader = fastload.DataLoader(ds, batch_size=8, sampler=DistributedSampler(ds, num_replicas=4, rank=0))
    with pytest.raises(ValueError, match="num_replicas=2 ranks"):
        loader.load_state_dict(state)


def test_an_unknown_sampler_says_what_would_make_it_resumable(h5: Path) -> None:
    loader = fastload.DataLoader(_dataset(h5), batch_size=4, sampler=SubsetRandomSampler(range(10)))
    with pytest.raises(TypeError, match="BatchSampler over a SubsetRandomSampler has no state_dict"):
        loader.state_dict()
    with pytest.raises(TypeError, match="SubsetRandomSampler"):
        loader.load_state_dict({"sampler": {}})


class _Stream(IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter(range(5))


def test_an_iterable_dataset_cannot_be_resumed() -> None:
    loader = fastload.DataLoader(_Stream(), batch_size=2)
    with pytest.raises(TypeError, match="IterableDataset"):
        loader.state_dict()


class _CountingBatches:
    """A user's batch sampler with its own state: batches of 4 in order, resumable."""

    def __init__(self) -> None:
        self.start = 0

    def __iter__(self) -> Any:
        start, self.start = self.start, 0
        return iter([list(range(i, i + 4)) for i in range(start * 4, N, 4)])

    def __len__(self) -> int:
        return N // 4 - self.start

    def state_dict(self, *, batches_consumed: int) -> dict[str, Any]:
        return {"batches": batches_consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.start = state["batches"]


def test_a_users_own_resumable_batch_sampler_keeps_working(h5: Path) -> None:
    loader = fastload.DataLoader(_dataset(h5), batch_sampler=_CountingBatches(), num_workers=2)
    it = iter(loader)
    [next(it) for _ in range(6)]
    state = loader.state_dict()
    del it
    resumed = fastload.DataLoader(_dataset(h5), batch_sampler=_CountingBatches())
    resumed.load_state_dict(state)
    assert [_ids(b)[0] for b in resumed][:2] == [24, 28]
