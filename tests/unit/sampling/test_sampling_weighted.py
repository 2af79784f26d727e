"""Weighted sampling and dataset mixing, with length grouping kept."""

from __future__ import annotations

from collections import Counter

import numpy as np
import numpy.typing as npt
import pytest

from fastload import MixtureBatchSampler, WeightedLengthGroupedSampler


def lengths_of(count: int, seed: int = 0) -> npt.NDArray[np.int64]:
    return np.random.default_rng(seed).integers(1, 300, count).astype(np.int64)


def drawn(sampler: WeightedLengthGroupedSampler | MixtureBatchSampler) -> Counter[int]:
    return Counter(i for batch in sampler for i in batch)


def test_weighted_draws_follow_the_weights_and_never_pick_weight_zero() -> None:
    lengths = lengths_of(4)
    weights = [0.0, 1.0, 3.0, 6.0]
    counts: Counter[int] = Counter()
    sampler = WeightedLengthGroupedSampler(lengths, weights, num_samples=5_000, batch_size=50)
    for epoch in range(4):
        sampler.set_epoch(epoch)
        counts += drawn(sampler)
    assert counts[0] == 0
    total = sum(counts.values())
    assert total == 20_000
    for index, weight in ((1, 0.1), (2, 0.3), (3, 0.6)):
        assert abs(counts[index] / total - weight) < 0.015


def test_weighted_batches_are_still_length_grouped_and_within_budget() -> None:
    lengths = lengths_of(2_000, seed=1)
    weights = np.random.default_rng(2).random(2_000)
    sampler = WeightedLengthGroupedSampler(lengths, weights, max_tokens=2048, seed=3)
    batches = list(sampler)
    assert sum(len(b) for b in batches) == 2_000
    for batch in batches:
        assert len(batch) * int(lengths[batch].max()) <= 2048
        assert np.all(np.diff(lengths[batch]) >= 0)


def test_without_replacement_every_draw_is_distinct() -> None:
    lengths = lengths_of(300, seed=4)
    weights = np.linspace(0.0, 1.0, 300)
    sampler = WeightedLengthGroupedSampler(
        lengths, weights, num_samples=200, replacement=False, batch_size=16
    )
    counts = drawn(sampler)
    assert sum(counts.values()) == 200 and set(counts.values()) == {1}
    assert 0 not in counts
    with pytest.raises(ValueError, match="num_samples=300 exceeds the 299 samples"):
        WeightedLengthGroupedSampler(lengths, weights, replacement=False, batch_size=16)


def test_weighted_draw_depends_only_on_seed_and_epoch_and_resumes_exactly() -> None:
    lengths = lengths_of(500, seed=5)
    weights = np.arange(1, 501, dtype=float)

    def build() -> WeightedLengthGroupedSampler:
        return WeightedLengthGroupedSampler(lengths, weights, max_tokens=1500, seed=8)

    uninterrupted = list(build())
    source = build()
    iterator = iter(source)
    taken = [next(iterator) for _ in range(5)]
    resumed = build()
    resumed.load_state_dict(source.state_dict())
    assert taken + list(resumed) == uninterrupted
    changed = WeightedLengthGroupedSampler(lengths, weights[::-1], max_tokens=1500, seed=8)
    with pytest.raises(ValueError, match="weights_crc32"):
        changed.load_state_dict(source.state_dict())


def test_weights_are_validated() -> None:
    with pytest.raises(ValueError, match=r"weights\[1\] is -1.0"):
        WeightedLengthGroupedSampler([1, 2], [1.0, -1.0], batch_size=1)
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        WeightedLengthGroupedSampler([1, 2], [1.0], batch_size=1)
    with pytest.raises(ValueError, match="every weight is 0"):
        WeightedLengthGroupedSampler([1, 2], [0.0, 0.0], batch_size=1)


def test_skipped_oversize_samples_are_never_drawn() -> None:
    sampler = WeightedLengthGroupedSampler(
        [10, 5000, 20], [1.0, 100.0, 1.0], num_samples=50, max_tokens=100, oversize="skip"
    )
    assert set(drawn(sampler)) <= {0, 2}


def test_mixture_takes_exact_proportions_from_each_dataset_in_global_indices() -> None:
    parts = [lengths_of(100, seed=1), lengths_of(1_000, seed=2), lengths_of(10, seed=3)]
    sampler = MixtureBatchSampler(
        parts, proportions=[0.5, 0.3, 0.2], num_samples=1_000, batch_size=32
    )
    assert sampler.offsets.tolist() == [0, 100, 1_100, 1_110]
    assert sampler.samples_per_dataset == [500, 300, 200]
    counts = drawn(sampler)
    per_dataset = [0, 0, 0]
    for index, times in counts.items():
        per_dataset[int(np.searchsorted(sampler.offsets, index, side="right")) - 1] += times
    assert per_dataset == [500, 300, 200]
    # Dataset 0 (100 samples, asked for 500) repeats every sample 5 times; dataset 2, 20 times.
    assert {counts[i] for i in range(100)} == {5}
    assert {counts[i] for i in range(1_100, 1_110)} == {20}
    # Dataset 1 (1000 samples, asked for 300) gives 300 distinct ones.
    assert sum(1 for i in range(100, 1_100) if counts[i]) == 300


def test_mixture_batches_are_length_grouped_across_datasets() -> None:
    parts = [lengths_of(3_000, seed=4), lengths_of(3_000, seed=5)]
    sampler = MixtureBatchSampler(parts, proportions=[1, 1], batch_size=64, seed=2)
    lengths = np.concatenate(parts)
    batches = list(sampler)
    real = sum(int(lengths[b].sum()) for b in batches)
    padded = sum(len(b) * int(lengths[b].max()) for b in batches)
    assert real / padded > 0.9


def test_mixture_subsets_change_with_the_epoch() -> None:
    sampler = MixtureBatchSampler(
        [lengths_of(1_000)], proportions=[1.0], num_samples=100, batch_size=10
    )
    first = set(drawn(sampler))
    sampler.set_epoch(1)
    assert set(drawn(sampler)) != first


def test_mixture_rejects_a_dataset_that_cannot_contribute() -> None:
    with pytest.raises(ValueError, match="dataset 1 has weight > 0 in proportions but no sample"):
        MixtureBatchSampler([[1, 2, 3], []], proportions=[1, 1], num_samples=10, batch_size=2)
    with pytest.raises(ValueError, match="proportions must not all be 0"):
        MixtureBatchSampler([[1, 2]], proportions=[0.0], batch_size=2)
    with pytest.raises(ValueError, match="at least one dataset"):
        MixtureBatchSampler([], proportions=[], batch_size=2)
