"""``ResumableTorchSampler``: torch's own samplers, item for item and draw for draw, plus exact
resume at any point."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
)

from fastload import LengthGroupedBatchSampler
from fastload._sampling._torch_resume import ResumableTorchSampler, resumable_torch_sampler

DATA = range(23)

SAMPLERS: dict[str, Callable[[], Any]] = {
    "sequential": lambda: SequentialSampler(DATA),
    "random": lambda: RandomSampler(DATA),
    "random_generator": lambda: RandomSampler(DATA, generator=torch.Generator().manual_seed(3)),
    "random_replacement": lambda: RandomSampler(DATA, replacement=True, num_samples=70),
    "distributed": lambda: DistributedSampler(DATA, num_replicas=3, rank=1, seed=4),
    "batch_random": lambda: BatchSampler(RandomSampler(DATA), 4, drop_last=False),
    "batch_random_generator": lambda: BatchSampler(
        RandomSampler(DATA, generator=torch.Generator().manual_seed(8)), 5, drop_last=True
    ),
    "batch_distributed": lambda: BatchSampler(
        DistributedSampler(DATA, num_replicas=2, rank=0, drop_last=True), 3, drop_last=False
    ),
}


def _epochs(sampler: Any, count: int, *, wrap: bool) -> list[list[Any]]:
    source = ResumableTorchSampler(sampler) if wrap else sampler
    out = []
    inner = getattr(sampler, "sampler", sampler)
    for epoch in range(count):
        if isinstance(inner, DistributedSampler):
            inner.set_epoch(epoch)  # what a training loop does
        out.append(list(source))
    return out


def _generator_of(sampler: Any) -> torch.Generator | None:
    return getattr(getattr(sampler, "sampler", sampler), "generator", None)


@pytest.mark.parametrize("kind", SAMPLERS)
def test_it_yields_torchs_items_and_leaves_the_rngs_as_torch_does(kind: str) -> None:
    torch.manual_seed(0)
    plain = SAMPLERS[kind]()
    expected = _epochs(plain, 3, wrap=False)
    expected_rng = torch.get_rng_state()
    torch.manual_seed(0)
    wrapped = SAMPLERS[kind]()
    assert _epochs(wrapped, 3, wrap=True) == expected
    assert torch.equal(torch.get_rng_state(), expected_rng)
    generator = _generator_of(wrapped)
    if generator is not None:
        assert torch.equal(generator.get_state(), _generator_of(plain).get_state())  # type: ignore[union-attr]


def test_nothing_is_drawn_before_the_first_item() -> None:
    torch.manual_seed(0)
    before = torch.get_rng_state()
    iter(ResumableTorchSampler(RandomSampler(DATA)))
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("kind", SAMPLERS)
def test_resuming_at_any_point_continues_the_epoch_and_the_next_one_as_uninterrupted(kind: str) -> None:
    torch.manual_seed(1)
    reference = ResumableTorchSampler(SAMPLERS[kind]())
    first, second = [], []
    for epoch, out in enumerate((first, second)):
        reference.set_epoch(epoch)
        out.extend(reference)
    for stop in range(len(first) + 1):
        torch.manual_seed(1)
        saver = ResumableTorchSampler(SAMPLERS[kind]())
        saver.set_epoch(0)
        it = iter(saver)
        taken = [next(it) for _ in range(stop)]
        state = json.loads(json.dumps(saver.state_dict()))

        torch.manual_seed(1)  # the global RNG as it was when the run began
        resumed = ResumableTorchSampler(SAMPLERS[kind]())
        resumed.load_state_dict(state)
        assert len(resumed) == len(first) - stop
        resumed.set_epoch(0)
        assert resumed.state_dict() == state
        assert taken + list(resumed) == first, stop
        resumed.set_epoch(1)
        assert list(resumed) == second, stop

        if stop == 0:
            continue  # nothing drawn yet: the epoch's order is drawn when it runs
        torch.manual_seed(7)  # a begun epoch is pinned by its state, whatever the RNGs hold
        other = SAMPLERS[kind]()
        if _generator_of(other) is not None:
            _generator_of(other).manual_seed(99)  # type: ignore[union-attr]
        pinned = ResumableTorchSampler(other)
        pinned.load_state_dict(state)
        assert taken + list(pinned) == first, stop


def test_a_resumed_epoch_leaves_the_generator_where_the_uninterrupted_one_does() -> None:
    uninterrupted = RandomSampler(DATA, generator=torch.Generator().manual_seed(3))
    list(ResumableTorchSampler(uninterrupted))
    saver = ResumableTorchSampler(RandomSampler(DATA, generator=torch.Generator().manual_seed(3)))
    it = iter(saver)
    next(it)
    state = saver.state_dict()
    generator = torch.Generator().manual_seed(99)  # whatever state the new run's generator has
    resumed = ResumableTorchSampler(RandomSampler(DATA, generator=generator))
    resumed.load_state_dict(state)
    list(resumed)
    assert torch.equal(generator.get_state(), uninterrupted.generator.get_state())


def test_distributed_samplers_own_set_epoch_keeps_a_position_of_its_epoch_only() -> None:
    def make() -> tuple[DistributedSampler[int], ResumableTorchSampler]:
        sampler: DistributedSampler[int] = DistributedSampler(DATA, num_replicas=2, rank=1, seed=5)
        return sampler, ResumableTorchSampler(sampler)

    inner, saver = make()
    inner.set_epoch(4)
    epoch4 = list(saver)
    inner.set_epoch(3)
    epoch3 = list(saver)
    it = iter(saver)
    taken = [next(it) for _ in range(4)]
    state = saver.state_dict()

    inner, resumed = make()
    resumed.load_state_dict(state)
    assert inner.epoch == 3
    inner.set_epoch(3)
    assert taken + list(resumed) == epoch3

    inner, moved = make()
    moved.load_state_dict(state)
    inner.set_epoch(4)
    assert len(moved) == len(epoch4)
    assert list(moved) == epoch4


def test_one_ranks_distributed_state_resumes_another_rank() -> None:
    rank0 = ResumableTorchSampler(DistributedSampler(DATA, num_replicas=2, rank=0))
    it = iter(rank0)
    next(it), next(it)
    rank1_sampler: DistributedSampler[int] = DistributedSampler(DATA, num_replicas=2, rank=1)
    rank1 = ResumableTorchSampler(rank1_sampler)
    rank1.load_state_dict(rank0.state_dict())
    assert list(rank1) == list(rank1_sampler)[2:]


@pytest.mark.parametrize(
    ("saved", "loading", "message"),
    [
        (lambda: SequentialSampler(DATA), lambda: RandomSampler(DATA), "sampler='SequentialSampler'"),
        (lambda: SequentialSampler(DATA), lambda: SequentialSampler(range(24)), "dataset_length=23"),
        (
            lambda: BatchSampler(SequentialSampler(DATA), 4, False),
            lambda: BatchSampler(SequentialSampler(DATA), 5, False),
            "batch_size=4",
        ),
        (
            lambda: RandomSampler(DATA),
            lambda: RandomSampler(DATA, generator=torch.Generator()),
            "generator=False",
        ),
        (
            lambda: DistributedSampler(DATA, num_replicas=2, rank=0),
            lambda: DistributedSampler(DATA, num_replicas=3, rank=0),
            "num_replicas=2 ranks.*same one",
        ),
        (
            lambda: DistributedSampler(DATA, num_replicas=2, rank=0, seed=1),
            lambda: DistributedSampler(DATA, num_replicas=2, rank=0, seed=2),
            "seed=1",
        ),
    ],
)
def test_a_state_saved_with_other_settings_raises_naming_the_mismatch(
    saved: Callable[[], Any], loading: Callable[[], Any], message: str
) -> None:
    state = ResumableTorchSampler(saved()).state_dict()
    with pytest.raises(ValueError, match=message):
        ResumableTorchSampler(loading()).load_state_dict(state)


def test_states_of_length_grouped_and_torch_samplers_are_told_apart() -> None:
    grouped = LengthGroupedBatchSampler(list(range(1, 24)), batch_size=4)
    torchs = ResumableTorchSampler(BatchSampler(RandomSampler(DATA), 4, False))
    with pytest.raises(ValueError, match="sampler='LengthGroupedBatchSampler'"):
        torchs.load_state_dict(grouped.state_dict())
    with pytest.raises(ValueError, match=r"sampler='BatchSampler\(RandomSampler\)'"):
        grouped.load_state_dict(torchs.state_dict())
    sharded = LengthGroupedBatchSampler(list(range(1, 24)), batch_size=4, num_replicas=2, rank=0)
    distributed = ResumableTorchSampler(DistributedSampler(DATA, num_replicas=3, rank=0))
    with pytest.raises(ValueError, match="sampler='LengthGroupedBatchSampler'"):
        distributed.load_state_dict(sharded.state_dict())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"batches_consumed": 24}, "24 items of epoch 0 were consumed"),
        ({"batches_consumed": 3}, "neither epoch_seed nor generator_state"),
        ({"epoch": -1}, "epoch"),
        ({"generator_state": "AAAA"}, "has no generator"),
        ({"format": 2}, "format 2"),
    ],
)
def test_a_state_with_bad_values_raises(change: dict[str, Any], message: str) -> None:
    sampler = ResumableTorchSampler(RandomSampler(DATA))
    state = {**sampler.state_dict(), **change}
    with pytest.raises(ValueError, match=message):
        sampler.load_state_dict(state)


def test_a_generator_state_of_another_size_raises() -> None:
    sampler = ResumableTorchSampler(RandomSampler(DATA, generator=torch.Generator()))
    iter(sampler).__next__()
    state = {**sampler.state_dict(), "generator_state": "AAAA"}
    with pytest.raises(ValueError, match="3 bytes"):
        sampler.load_state_dict(state)


def test_only_torchs_own_samplers_get_a_stand_in() -> None:
    class Shuffled(RandomSampler):
        pass

    assert resumable_torch_sampler(SubsetRandomSampler([1, 2])) is None
    assert resumable_torch_sampler(BatchSampler(Shuffled(DATA), 2, False)) is None
    assert resumable_torch_sampler([[0, 1], [2]]) is None
    assert resumable_torch_sampler(BatchSampler(SequentialSampler(DATA), 2, False)) is not None
