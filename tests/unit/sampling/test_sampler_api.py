"""LengthGroupedBatchSampler's public behaviour: options, oversize policies, ranks, epochs, len."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
import torch.utils.data

from fastload import LengthGroupedBatchSampler
from fastload.errors import FastloadError, OversizeSampleError


def lengths_of(count: int, seed: int = 0, high: int = 500) -> npt.NDArray[np.int64]:
    return np.random.default_rng(seed).integers(1, high, count).astype(np.int64)


def test_it_is_a_torch_batch_sampler_yielding_lists_of_python_ints() -> None:
    sampler = LengthGroupedBatchSampler(lengths_of(100), batch_size=8)
    assert isinstance(sampler, torch.utils.data.Sampler)
    batch = next(iter(sampler))
    assert isinstance(batch, list)
    assert all(type(index) is int for index in batch)


def test_a_torch_dataloader_accepts_it_as_batch_sampler() -> None:
    lengths = lengths_of(50)
    dataset = torch.utils.data.TensorDataset(torch.arange(50))
    sampler = LengthGroupedBatchSampler(lengths, batch_size=8, seed=1)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
    seen = torch.cat([indices for (indices,) in loader]).tolist()
    assert sorted(seen) == list(range(50))
    assert len(loader) == len(sampler) == 7


def test_iter_arrays_yields_the_same_batches_as_read_only_int64_arrays() -> None:
    sampler = LengthGroupedBatchSampler(lengths_of(300), max_tokens=2000, seed=4)
    arrays = list(sampler.iter_arrays())
    assert [a.tolist() for a in arrays] == list(sampler)
    assert all(a.dtype == np.int64 and not a.flags.writeable for a in arrays)


def test_len_is_exact_for_each_epoch_and_rank() -> None:
    lengths = lengths_of(1_001, seed=2)
    for epoch in range(3):
        for rank in range(3):
            sampler = LengthGroupedBatchSampler(
                lengths, max_tokens=3000, num_replicas=3, rank=rank, seed=5
            )
            sampler.set_epoch(epoch)
            assert len(sampler) == len(list(sampler))


def test_set_epoch_changes_the_order_and_returning_to_an_epoch_repeats_it() -> None:
    sampler = LengthGroupedBatchSampler(lengths_of(500), batch_size=16, seed=3)
    first = list(sampler)
    sampler.set_epoch(1)
    second = list(sampler)
    sampler.set_epoch(0)
    assert second != first
    assert list(sampler) == first


def test_the_plan_does_not_depend_on_the_instance_or_the_order_of_construction() -> None:
    lengths = lengths_of(400)
    a = LengthGroupedBatchSampler(lengths, max_tokens=1500, seed=9)
    list(LengthGroupedBatchSampler(lengths_of(10), batch_size=2, seed=1))
    b = LengthGroupedBatchSampler(lengths.tolist(), max_tokens=1500, seed=9)
    a.set_epoch(4)
    b.set_epoch(4)
    assert list(a) == list(b)


def test_lengths_are_copied_to_a_read_only_int64_array() -> None:
    source = np.array([3, 1, 2], dtype=np.int32)
    sampler = LengthGroupedBatchSampler(source, batch_size=2)
    source[0] = 100
    assert sampler.lengths.tolist() == [3, 1, 2]
    assert sampler.lengths.dtype == np.int64
    assert not sampler.lengths.flags.writeable


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({}, ValueError, ["batch_size", "max_tokens", "neither"]),
        ({"batch_size": 0}, ValueError, ["batch_size", ">= 1", "0"]),
        ({"batch_size": 2.5}, TypeError, ["batch_size", "integer", "2.5"]),
        ({"batch_size": True}, TypeError, ["batch_size", "True"]),
        ({"max_tokens": -3}, ValueError, ["max_tokens", ">= 1", "-3"]),
        (
            {"max_tokens": 8, "pad_to_multiple_of": 16},
            ValueError,
            ["pad_to_multiple_of=16", "max_tokens=8"],
        ),
        ({"batch_size": 4, "window": 0}, ValueError, ["window", ">= 1", "0"]),
        ({"batch_size": 4, "seed": -1}, ValueError, ["seed", ">= 0", "-1"]),
        ({"batch_size": 4, "oversize": "drop"}, ValueError, ["oversize", "'skip'", "'drop'"]),
        ({"batch_size": 4, "shuffle": 1}, TypeError, ["shuffle", "True or False"]),
        (
            {"batch_size": 4, "num_replicas": 2, "rank": 2},
            ValueError,
            ["rank", "num_replicas=2", "rank=2"],
        ),
        ({"batch_size": 4, "num_replicas": 0}, ValueError, ["num_replicas", ">= 1"]),
    ],
)
def test_bad_options_fail_at_construction_naming_option_value_and_bound(
    kwargs: dict[str, object], error: type[Exception], words: list[str]
) -> None:
    with pytest.raises(error) as caught:
        LengthGroupedBatchSampler(lengths_of(10), **kwargs)  # type: ignore[arg-type]
    for word in words:
        assert word in str(caught.value)


@pytest.mark.parametrize(
    ("lengths", "words"),
    [
        ([[1, 2]], ["1-D", "(1, 2)"]),
        ([1.5, 2.0], ["integers", "float64"]),
        ([4, -1, 3], ["lengths[1]", "-1", ">= 0"]),
    ],
)
def test_bad_lengths_are_rejected_with_the_offending_value(
    lengths: list[object], words: list[str]
) -> None:
    with pytest.raises((ValueError, TypeError)) as caught:
        LengthGroupedBatchSampler(lengths, batch_size=2)  # type: ignore[arg-type]
    for word in words:
        assert word in str(caught.value)


def test_an_oversize_sample_is_an_error_naming_index_length_and_budget() -> None:
    lengths = np.array([10, 20, 5000, 30, 7000], dtype=np.int64)
    with pytest.raises(OversizeSampleError) as caught:
        LengthGroupedBatchSampler(lengths, max_tokens=4096)
    message = str(caught.value)
    for word in ("sample 2", "length 5000", "max_tokens=4096", "2 samples", "skip", "truncate"):
        assert word in message
    assert isinstance(caught.value, FastloadError)
    assert isinstance(caught.value, ValueError)


def test_rounding_to_the_multiple_can_make_a_sample_oversize() -> None:
    with pytest.raises(OversizeSampleError, match="padded to 112"):
        LengthGroupedBatchSampler([100], max_tokens=100, pad_to_multiple_of=16)


def test_skip_leaves_oversize_samples_out_and_counts_them() -> None:
    lengths = np.array([10, 20, 5000, 30, 7000, 4096], dtype=np.int64)
    sampler = LengthGroupedBatchSampler(lengths, max_tokens=4096, oversize="skip")
    assert sampler.skipped == 2
    assert sorted(i for batch in sampler for i in batch) == [0, 1, 3, 5]


def test_truncate_keeps_oversize_samples_alone_in_their_batch_at_the_truncate_length() -> None:
    lengths = np.array([10, 20, 5000, 30, 7000, 40], dtype=np.int64)
    sampler = LengthGroupedBatchSampler(
        lengths, max_tokens=4100, pad_to_multiple_of=64, oversize="truncate"
    )
    assert sampler.truncate_length == 4096
    assert sampler.skipped == 0
    batches = list(sampler)
    assert sorted(i for batch in batches for i in batch) == list(range(6))
    assert [2] in batches and [4] in batches


def test_oversize_policy_is_moot_without_a_token_budget() -> None:
    sampler = LengthGroupedBatchSampler([10, 10**6], batch_size=1, oversize="skip")
    assert sampler.skipped == 0
    assert sampler.truncate_length is None


def test_ranks_default_to_one_process_without_torch_distributed() -> None:
    sampler = LengthGroupedBatchSampler(lengths_of(10), batch_size=2)
    assert (sampler.num_replicas, sampler.rank) == (1, 0)


def test_ranks_split_the_epoch_with_equal_counts_padding_from_the_start() -> None:
    lengths = lengths_of(103, seed=6)
    global_batches = list(LengthGroupedBatchSampler(lengths, batch_size=10, seed=2))
    per_rank = [
        list(LengthGroupedBatchSampler(lengths, batch_size=10, seed=2, num_replicas=4, rank=r))
        for r in range(4)
    ]
    assert {len(batches) for batches in per_rank} == {3}
    dealt = [per_rank[j % 4][j // 4] for j in range(12)]
    assert dealt == global_batches + global_batches[:1]


def test_drop_last_gives_ranks_equal_counts_by_dropping_the_tail() -> None:
    lengths = lengths_of(103, seed=6)
    per_rank = [
        list(
            LengthGroupedBatchSampler(
                lengths, batch_size=10, seed=2, num_replicas=4, rank=r, drop_last=True
            )
        )
        for r in range(4)
    ]
    assert {len(batches) for batches in per_rank} == {2}
    seen = [i for batches in per_rank for batch in batches for i in batch]
    assert len(seen) == len(set(seen)) == 80
