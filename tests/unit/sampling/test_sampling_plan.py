"""The pure epoch plan: windows, sorting, fixed-size and token-budget cuts, batch order."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest

from fastload._sampling._batch_options import BatchingOptions
from fastload._sampling._epoch_plan import EpochPlan, plan_epoch
from fastload._sampling._keys import LengthCodec, bit_width


def lognormal_lengths(count: int, seed: int = 0) -> npt.NDArray[np.int64]:
    """The issue's reference distribution: lognormal, median 200, sigma 0.75, clipped 8..2048."""
    rng = np.random.default_rng(seed)
    raw = rng.lognormal(np.log(200), 0.75, count)
    return np.clip(np.round(raw), 8, 2048).astype(np.int64)


def make_plan(
    lengths: npt.NDArray[np.int64],
    *,
    batch_size: int | None = None,
    max_tokens: int | None = None,
    pad_to_multiple_of: int | None = None,
    window: int | None = 100,
    shuffle: bool = True,
    drop_last: bool = False,
    longest_first: bool = False,
    seed: int = 0,
    epoch: int = 0,
    num_replicas: int = 1,
    label_bits: int | None = None,
) -> EpochPlan:
    options = BatchingOptions.create(
        batch_size=batch_size,
        max_tokens=max_tokens,
        pad_to_multiple_of=pad_to_multiple_of,
        window=window,
        shuffle=shuffle,
        drop_last=drop_last,
        longest_first=longest_first,
    )
    multiple = options.pad_to_multiple_of
    padded = -(-lengths // multiple) * multiple
    mean = float(padded.mean()) if padded.size else 1.0
    windows = -(-lengths.size // options.samples_per_window(lengths.size, mean))
    codec = LengthCodec.build(
        padded, label_bits=bit_width(windows) if label_bits is None else label_bits
    )
    payloads = codec.encode(np.arange(lengths.size, dtype=np.int64), padded)  # all samples
    return plan_epoch(
        payloads,
        codec,
        padded,
        options,
        mean_padded_length=mean,
        seed=seed,
        epoch=epoch,
        num_replicas=num_replicas,
    )


def batches(plan: EpochPlan) -> list[npt.NDArray[np.int64]]:
    return [plan.batch(b) for b in range(plan.num_batches)]


def padding_efficiency(
    lengths: npt.NDArray[np.int64], groups: list[npt.NDArray[np.int64]]
) -> float:
    real = sum(int(lengths[g].sum()) for g in groups)
    padded = sum(len(g) * int(lengths[g].max()) for g in groups)
    return real / padded


def test_fixed_size_batches_are_full_except_one_and_cover_every_sample_once() -> None:
    lengths = lognormal_lengths(10_007)
    plan = make_plan(lengths, batch_size=64, window=10)
    sizes = sorted(len(b) for b in batches(plan))
    assert sizes[1:] == [64] * (len(sizes) - 1)
    assert sizes[0] == 10_007 % 64
    assert np.array_equal(np.sort(np.concatenate(batches(plan))), np.arange(10_007))


def test_drop_last_drops_only_the_partial_batch() -> None:
    lengths = lognormal_lengths(1_000)
    plan = make_plan(lengths, batch_size=64, drop_last=True, window=3)
    assert [len(b) for b in batches(plan)] == [64] * (1_000 // 64)
    assert len(np.unique(np.concatenate(batches(plan)))) == 1_000 // 64 * 64


@pytest.mark.parametrize("multiple", [None, 8, 64])
@pytest.mark.parametrize("row_cap", [None, 16])
def test_token_budget_batches_never_exceed_the_budget(
    multiple: int | None, row_cap: int | None
) -> None:
    lengths = lognormal_lengths(5_000, seed=1)
    plan = make_plan(lengths, max_tokens=4096, batch_size=row_cap, pad_to_multiple_of=multiple)
    m = multiple or 1
    for batch in batches(plan):
        longest = -(-int(lengths[batch].max()) // m) * m
        assert len(batch) * longest <= 4096
        if row_cap is not None:
            assert len(batch) <= row_cap
    assert np.array_equal(np.sort(np.concatenate(batches(plan))), np.arange(5_000))


def test_samples_within_a_batch_ascend_in_length() -> None:
    lengths = lognormal_lengths(3_000, seed=2)
    for plan in (make_plan(lengths, batch_size=32), make_plan(lengths, max_tokens=8192)):
        for batch in batches(plan):
            assert np.all(np.diff(lengths[batch]) >= 0)


def test_greedy_cut_matches_a_sequential_reference_within_each_window() -> None:
    lengths = lognormal_lengths(2_000, seed=3)
    plan = make_plan(lengths, max_tokens=3000, window=None, shuffle=False)
    ordered = plan.indices
    expected_stops = []
    start = 0
    while start < ordered.size:  # the obvious per-sample greedy loop
        stop = start + 1
        while stop < ordered.size and (stop + 1 - start) * lengths[ordered[stop]] <= 3000:
            stop += 1
        expected_stops.append(stop)
        start = stop
    assert sorted(plan.stops.tolist()) == expected_stops


def test_length_grouping_reaches_the_padding_efficiency_goal_with_defaults() -> None:
    lengths = lognormal_lengths(200_000, seed=4)
    grouped = padding_efficiency(lengths, batches(make_plan(lengths, batch_size=64)))
    rng = np.random.default_rng(0)
    random = padding_efficiency(lengths, np.array_split(rng.permutation(200_000), 200_000 // 64))
    assert grouped >= 0.95
    assert random < 0.4


def test_token_budget_utilisation_is_at_least_ninety_percent_on_average() -> None:
    lengths = lognormal_lengths(100_000, seed=5)
    plan = make_plan(lengths, max_tokens=16_384)
    assert float((plan.padded_sizes() / 16_384).mean()) >= 0.9


def test_same_seed_and_epoch_give_the_same_plan_and_others_differ() -> None:
    lengths = lognormal_lengths(4_000, seed=6)
    first = make_plan(lengths, batch_size=16, seed=7, epoch=2)
    again = make_plan(lengths, batch_size=16, seed=7, epoch=2)
    assert [b.tolist() for b in batches(first)] == [b.tolist() for b in batches(again)]
    for other in (
        make_plan(lengths, batch_size=16, seed=8, epoch=2),
        make_plan(lengths, batch_size=16, seed=7, epoch=3),
    ):
        assert [b.tolist() for b in batches(other)] != [b.tolist() for b in batches(first)]


def test_without_shuffle_windows_are_contiguous_and_the_seed_is_irrelevant() -> None:
    lengths = lognormal_lengths(1_000, seed=8)
    plan = make_plan(lengths, batch_size=10, window=5, shuffle=False, seed=1)
    other_seed = make_plan(lengths, batch_size=10, window=5, shuffle=False, seed=2)
    assert [b.tolist() for b in batches(plan)] == [b.tolist() for b in batches(other_seed)]
    for number, batch in enumerate(batches(plan)):  # window w holds samples 50w .. 50w + 49
        assert set((batch // 50).tolist()) == {number // 5}


def test_longest_first_puts_one_largest_batch_per_rank_in_front() -> None:
    lengths = lognormal_lengths(5_000, seed=9)
    plan = make_plan(lengths, max_tokens=8192, longest_first=True, num_replicas=4)
    sizes = plan.padded_sizes()
    assert np.array_equal(sizes[:4], np.sort(sizes)[::-1][:4])
    unmoved = make_plan(lengths, max_tokens=8192)
    assert sorted(map(tuple, (b.tolist() for b in batches(plan)))) == sorted(
        map(tuple, (b.tolist() for b in batches(unmoved)))
    )


def test_ranked_key_encoding_plans_exactly_like_the_packed_one() -> None:
    lengths = lognormal_lengths(3_000, seed=10)
    packed = make_plan(lengths, max_tokens=4096, window=4)
    # Reserving almost every key bit for labels forces the ranked encoding.
    ranked = make_plan(lengths, max_tokens=4096, window=4, label_bits=63 - 12)
    assert [b.tolist() for b in batches(packed)] == [b.tolist() for b in batches(ranked)]


def test_a_whole_epoch_window_pads_no_worse_than_the_default_window() -> None:
    lengths = lognormal_lengths(20_000, seed=11)
    whole = padding_efficiency(lengths, batches(make_plan(lengths, batch_size=64, window=None)))
    default = padding_efficiency(lengths, batches(make_plan(lengths, batch_size=64)))
    assert whole >= default


def test_zero_length_samples_and_an_empty_population_are_planned() -> None:
    lengths = np.array([0, 0, 5, 0, 3], dtype=np.int64)
    plan = make_plan(lengths, max_tokens=6)
    assert sorted(np.concatenate(batches(plan)).tolist()) == [0, 1, 2, 3, 4]
    assert make_plan(np.zeros(0, dtype=np.int64), batch_size=4).num_batches == 0
