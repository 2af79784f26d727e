"""PackedBatchSampler: its options, errors, the best-fit kernel and its Python twin, drop_last,
warm-up and packing efficiency."""

from __future__ import annotations

import numpy as np
import pytest

from fastload import BatchSizeWarmup, PackedBatchSampler
from fastload._sampling._bestfit import best_fit, best_fit_python
from fastload._types import PackedBatch
from fastload.errors import OversizeSampleError


def lognormal(count: int, seed: int = 0) -> np.ndarray:
    """The benchmarks' set: lognormal lengths, median 200, sigma 0.75, clipped to 8..2048."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(200), 0.75, count), 8, 2048).astype(np.int64)


def test_rows_are_whole_documents_and_batches_have_full_shape() -> None:
    sampler = PackedBatchSampler([5, 3, 8, 2, 7, 1], seq_len=8, rows=2, shuffle=False)
    batches = list(sampler)
    assert all(isinstance(b, PackedBatch) and b.rows == 2 and b.seq_len == 8 for b in batches)
    rows = [b.row(r) for b in batches for r in range(b.rows)]
    # Best-fit decreasing in one window: 8 | 7+1 | 5+3 | 2, then an empty row to fill the batch.
    assert rows == [[(2, 0, 8)], [(4, 0, 7), (5, 0, 1)], [(0, 0, 5), (1, 0, 3)], [(3, 0, 2)]]
    assert sampler.efficiency() == pytest.approx(26 / 32)


def test_max_tokens_gives_the_rows_and_both_must_agree() -> None:
    assert PackedBatchSampler([3] * 10, seq_len=4, max_tokens=13).rows == 3
    with pytest.raises(ValueError, match=r"rows=2 and max_tokens=13 disagree"):
        PackedBatchSampler([3] * 10, seq_len=4, rows=2, max_tokens=13)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"seq_len": 0, "rows": 2}, ValueError, r"seq_len must be >= 1"),
        ({"seq_len": 8}, ValueError, r"give rows .* or max_tokens .*got neither"),
        ({"seq_len": 8, "max_tokens": 7}, ValueError, r"max_tokens=7 is less than seq_len=8"),
        ({"seq_len": 8, "rows": 0}, ValueError, r"rows must be >= 1"),
        ({"seq_len": 8, "rows": 2, "oversize": "skip"}, ValueError, r"oversize"),
        ({"seq_len": 8, "rows": 2, "window": 0}, ValueError, r"window must be >= 1"),
        ({"seq_len": 8, "rows": 2, "shuffle": 1}, TypeError, r"shuffle must be True or False"),
    ],
)
def test_bad_options_name_the_argument(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        PackedBatchSampler([1, 2, 3], **kwargs)


def test_bad_lengths_name_the_sample() -> None:
    with pytest.raises(ValueError, match=r"lengths\[2\] is -4"):
        PackedBatchSampler([1, 2, -4], seq_len=8, rows=1)
    with pytest.raises(TypeError, match=r"lengths must hold integers; got dtype float64"):
        PackedBatchSampler([1.0, 2.5], seq_len=8, rows=1)


def test_oversize_error_names_sample_length_and_seq_len() -> None:
    with pytest.raises(OversizeSampleError, match=r"sample 1 has length 9, more than seq_len=8"):
        PackedBatchSampler([3, 9, 12], seq_len=8, rows=1, oversize="error")


def test_split_cuts_pieces_of_seq_len_and_truncate_counts_what_it_cuts() -> None:
    split = PackedBatchSampler([20, 3], seq_len=8, rows=1, shuffle=False)
    pieces = sorted(p for b in split for r in range(b.rows) for p in b.row(r))
    assert pieces == [(0, 0, 8), (0, 8, 16), (0, 16, 20), (1, 0, 3)]
    assert split.documents == 4
    truncate = PackedBatchSampler([20, 3], seq_len=8, rows=1, oversize="truncate")
    pieces = sorted(p for b in truncate for r in range(b.rows) for p in b.row(r))
    assert pieces == [(0, 0, 8), (1, 0, 3)]
    assert truncate.truncated_tokens == 12


def test_empty_samples_take_no_place_and_are_counted() -> None:
    sampler = PackedBatchSampler([0, 4, 0, 4], seq_len=8, rows=1)
    assert [b.row(0) for b in sampler] == [[(1, 0, 4), (3, 0, 4)]]
    assert sampler.skipped == 2


def test_last_round_is_padding_batches_never_repeats() -> None:
    lengths = [8] * 5  # five full rows: five batches of one row over two ranks
    rank0 = list(PackedBatchSampler(lengths, seq_len=8, rows=1, num_replicas=2, rank=0))
    rank1 = list(PackedBatchSampler(lengths, seq_len=8, rows=1, num_replicas=2, rank=1))
    assert len(rank0) == len(rank1) == 3
    assert rank1[-1].pieces == 0 and rank1[-1].rows == 1  # a row of padding only
    seen = [p for b in rank0 + rank1 for r in range(b.rows) for p in b.row(r)]
    assert sorted(seen) == [(i, 0, 8) for i in range(5)]


def test_drop_last_drops_the_partial_batch_and_the_surplus_round() -> None:
    lengths = [8] * 7  # seven full rows at two rows per batch: three full batches and a half
    assert len(PackedBatchSampler(lengths, seq_len=8, rows=2)) == 4
    assert len(PackedBatchSampler(lengths, seq_len=8, rows=2, drop_last=True)) == 3
    two_ranks = PackedBatchSampler(lengths, seq_len=8, rows=2, drop_last=True, num_replicas=2)
    assert len(two_ranks) == 1
    assert all(len(b) == 2 for b in two_ranks)


def test_warmup_grows_the_rows_of_the_first_steps() -> None:
    warmup = BatchSizeWarmup(start=1, target=4, steps=3)
    lengths = [8] * 40
    sampler = PackedBatchSampler(lengths, seq_len=8, rows=4, warmup=warmup, shuffle=False)
    # Cut front to back from planned batches of 4 rows: 1, 2, then the 1 row left; then 4.
    assert [b.rows for b in sampler][:6] == [1, 2, 1, 4, 4, 4]
    assert sorted(p for b in sampler for r in range(b.rows) for p in b.row(r)) == [
        (i, 0, 8) for i in range(40)
    ]
    with pytest.raises(ValueError, match=r"warmup.target=3 must equal rows=4"):
        PackedBatchSampler(lengths, seq_len=8, rows=4, warmup=BatchSizeWarmup(1, 3, 2))


def test_epochs_and_seeds_change_the_plan_deterministically() -> None:
    lengths = lognormal(3000, seed=1) // 8 + 1
    a = PackedBatchSampler(lengths, seq_len=256, rows=4, seed=1)
    plans = []
    for epoch in range(2):
        a.set_epoch(epoch)
        plans.append([np.asarray(b).tobytes() for b in a])
    assert plans[0] != plans[1]
    other_seed = [np.asarray(b).tobytes() for b in PackedBatchSampler(lengths, seq_len=256, rows=4, seed=2)]
    assert other_seed != plans[0]


def test_state_of_another_plan_is_refused() -> None:
    saved = PackedBatchSampler([3, 4, 5], seq_len=8, rows=1).state_dict()
    with pytest.raises(ValueError, match=r"seq_len"):
        PackedBatchSampler([3, 4, 5], seq_len=16, rows=1).load_state_dict(saved)


@pytest.mark.parametrize(("window", "least"), [(None, 0.995), (100, 0.99), (10, 0.98)])
def test_packing_efficiency_on_the_lognormal_set(window: int | None, least: float) -> None:
    """The issue's bar: >= 0.99 at seq_len 2048 with the default window (100 batches)."""
    sampler = PackedBatchSampler(lognormal(100_000), seq_len=2048, rows=8, window=window)
    assert sampler.efficiency() >= least


@pytest.mark.parametrize(("count", "capacity"), [(0, 8), (1, 1), (500, 1), (3000, 64), (4000, 70_000)])
def test_compiled_best_fit_and_its_python_twin_agree(count: int, capacity: int) -> None:
    rng = np.random.default_rng(count)
    lengths = np.clip(rng.lognormal(np.log(max(capacity / 8, 1)), 0.9, count), 1, capacity).astype(np.int64)
    ends = np.unique(np.append(rng.integers(0, count + 1, 5), count)).astype(np.int64)
    begin = 0
    for end in ends.tolist():
        lengths[begin:end] = -np.sort(-lengths[begin:end])
        begin = end
    compiled, python = best_fit(lengths, ends, capacity), best_fit_python(lengths, ends, capacity)
    assert np.array_equal(compiled[0], python[0]) and np.array_equal(compiled[1], python[1])
    # Every document in exactly one row, no row over capacity.
    assert sorted(compiled[0].tolist()) == list(range(count))
    offsets = np.concatenate(([0], np.cumsum(compiled[1])))
    for r in range(compiled[1].size):
        assert lengths[compiled[0][offsets[r] : offsets[r + 1]]].sum() <= capacity


def test_best_fit_refuses_lengths_out_of_range() -> None:
    for run in (best_fit, best_fit_python):
        with pytest.raises(ValueError, match=r"lengths must be in 1..capacity"):
            run(np.array([9], dtype=np.int64), np.array([1], dtype=np.int64), 8)


def test_a_packed_batch_iterates_as_its_rows_of_sample_start_stop_pieces() -> None:
    batch = PackedBatch(
        samples=np.array([4, 1, 7], np.int64),
        starts=np.array([0, 2, 0], np.int64),
        stops=np.array([3, 6, 5], np.int64),
        row_offsets=np.array([0, 2, 2, 3], np.int64),
        seq_len=8,
    )
    assert list(batch) == [[(4, 0, 3), (1, 2, 6)], [], [(7, 0, 5)]]  # the middle row: padding
    assert len(batch) == batch.rows == 3 and batch.pieces == 3
    assert list(PackedBatch.coerce(np.asarray(batch))) == list(batch)  # as it travels
    for planned in PackedBatchSampler([5, 3, 9, 2, 8, 1], seq_len=8, rows=2, seed=1):
        assert list(planned) == [planned.row(r) for r in range(planned.rows)]
