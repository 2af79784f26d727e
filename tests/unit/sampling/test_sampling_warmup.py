"""Batch-size warm-up: the schedule, and the sampler's first batches following it."""

from __future__ import annotations

import numpy as np
import pytest

from fastload import BatchSizeWarmup, LengthGroupedBatchSampler

LENGTHS = np.random.default_rng(0).integers(1, 300, 3_000).astype(np.int64)


def test_the_schedule_ramps_linearly_and_holds_the_target_after() -> None:
    schedule = BatchSizeWarmup(start=8, target=64, steps=8, multiple_of=8)
    # 8 + 56 * step // 8, rounded down to a multiple of 8
    assert [schedule(step) for step in range(10)] == [8, 8, 16, 24, 32, 40, 48, 56, 64, 64]
    assert BatchSizeWarmup(start=4, target=4, steps=0).size_at(0) == 4


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"start": 0, "target": 8, "steps": 2}, ["start", ">= 1"]),
        ({"start": 16, "target": 8, "steps": 2}, ["target", ">= 16"]),
        ({"start": 1, "target": 8, "steps": -1}, ["steps", ">= 0"]),
        ({"start": 1, "target": 8, "steps": 2, "multiple_of": 0}, ["multiple_of", ">= 1"]),
    ],
)
def test_bad_schedules_are_rejected(kwargs: dict[str, int], words: list[str]) -> None:
    with pytest.raises(ValueError) as caught:
        BatchSizeWarmup(**kwargs)
    for word in words:
        assert word in str(caught.value)


def test_warmup_batches_follow_the_schedule_in_rows_and_cover_the_epoch() -> None:
    schedule = BatchSizeWarmup(start=4, target=32, steps=30, multiple_of=4)
    sampler = LengthGroupedBatchSampler(LENGTHS, batch_size=32, warmup=schedule, seed=1)
    batches = list(sampler)
    for step, batch in enumerate(batches):
        assert 1 <= len(batch) <= schedule(step)
    assert sum(len(b) == schedule(s) for s, b in enumerate(batches[:30])) >= 20
    assert sorted(i for b in batches for i in b) == list(range(3_000))


def test_warmup_in_tokens_cuts_batches_to_the_growing_budget() -> None:
    schedule = BatchSizeWarmup(start=1024, target=4096, steps=40)
    sampler = LengthGroupedBatchSampler(LENGTHS, max_tokens=4096, warmup=schedule, seed=2)
    batches = list(sampler)
    for step, batch in enumerate(batches):
        padded = len(batch) * int(LENGTHS[batch].max())
        assert padded <= schedule(step) or len(batch) == 1
        assert padded <= 4096
    assert sorted(i for b in batches for i in b) == list(range(3_000))


def test_on_several_ranks_the_step_counts_per_rank() -> None:
    schedule = BatchSizeWarmup(start=2, target=32, steps=10)
    streams = [
        list(
            LengthGroupedBatchSampler(
                LENGTHS, batch_size=32, warmup=schedule, num_replicas=3, rank=r, seed=3
            )
        )
        for r in range(3)
    ]
    assert len({len(s) for s in streams}) == 1
    for stream in streams:
        for step, batch in enumerate(stream[:10]):
            assert len(batch) <= schedule(step)


def test_a_warmup_longer_than_an_epoch_continues_into_the_next() -> None:
    lengths = LENGTHS[:200]
    schedule = BatchSizeWarmup(start=1, target=16, steps=300)
    sampler = LengthGroupedBatchSampler(lengths, batch_size=16, warmup=schedule, seed=4)
    epoch_zero = list(sampler)
    sampler.set_epoch(1)
    epoch_one = list(sampler)
    step = len(epoch_zero)
    assert all(len(b) <= schedule(step + k) for k, b in enumerate(epoch_one))
    assert max(len(b) for b in epoch_one) < 16
    assert sorted(i for b in epoch_one for i in b) == list(range(200))


def test_the_warmup_target_must_match_the_sampler() -> None:
    with pytest.raises(ValueError, match=r"warmup\.target=64 must equal batch_size=32"):
        LengthGroupedBatchSampler(
            LENGTHS, batch_size=32, warmup=BatchSizeWarmup(start=1, target=64, steps=5)
        )
    with pytest.raises(ValueError, match="must equal max_tokens=4096"):
        LengthGroupedBatchSampler(
            LENGTHS,
            batch_size=32,
            max_tokens=4096,
            warmup=BatchSizeWarmup(start=1, target=32, steps=5),
        )
