"""Exact resume: state_dict / load_state_dict at any point, on the same or another world size."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from fastload import BatchSizeWarmup, LengthGroupedBatchSampler


def lengths_of(count: int, seed: int = 0) -> npt.NDArray[np.int64]:
    return np.random.default_rng(seed).integers(1, 400, count).astype(np.int64)


LENGTHS = lengths_of(997)


def sampler(replicas: int = 1, rank: int = 0, **options: Any) -> LengthGroupedBatchSampler:
    options.setdefault("max_tokens", 2048)
    options.setdefault("seed", 11)
    return LengthGroupedBatchSampler(LENGTHS, num_replicas=replicas, rank=rank, **options)


def consume(
    source: LengthGroupedBatchSampler, count: int
) -> tuple[list[list[int]], dict[str, Any]]:
    """Take ``count`` batches from a fresh iteration, then snapshot (through JSON, as a
    checkpoint would)."""
    iterator = iter(source)
    taken = [next(iterator) for _ in range(count)]
    return taken, json.loads(json.dumps(source.state_dict()))


@pytest.mark.parametrize("stop_after", [0, 1, 17, "end"])
def test_resuming_continues_with_exactly_the_uninterrupted_batches(stop_after: int | str) -> None:
    uninterrupted = list(sampler())
    count = len(uninterrupted) if stop_after == "end" else int(stop_after)
    taken, state = consume(sampler(), count)
    resumed = sampler()
    resumed.load_state_dict(state)
    assert len(resumed) == len(uninterrupted) - count
    assert taken + list(resumed) == uninterrupted


def test_resuming_twice_in_one_epoch_still_matches_the_uninterrupted_run() -> None:
    uninterrupted = list(sampler())
    first, state = consume(sampler(), 5)
    middle = sampler()
    middle.load_state_dict(state)
    second, state = consume(middle, 7)
    last = sampler()
    last.load_state_dict(state)
    assert first + second + list(last) == uninterrupted


def test_later_epochs_proceed_normally_after_a_resumed_epoch() -> None:
    reference = sampler()
    reference.set_epoch(1)
    epoch_one = list(reference)
    _, state = consume(sampler(), 3)
    resumed = sampler()
    resumed.load_state_dict(state)
    list(resumed)
    resumed.set_epoch(1)
    assert list(resumed) == epoch_one


def test_set_epoch_to_the_saved_epoch_keeps_the_resume_point() -> None:
    source = sampler()
    source.set_epoch(2)
    uninterrupted = list(source)
    taken, state = consume(source, 4)
    resumed = sampler()
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # the usual loop calls set_epoch(epoch) after loading a checkpoint
    assert taken + list(resumed) == uninterrupted


def test_iterating_again_after_the_resumed_pass_restarts_the_epoch() -> None:
    _, state = consume(sampler(), 6)
    resumed = sampler()
    resumed.load_state_dict(state)
    list(resumed)
    assert list(resumed) == list(sampler())


def test_prefetched_batches_do_not_count_when_batches_consumed_is_given() -> None:
    source = sampler()
    iterator = iter(source)
    delivered = [next(iterator) for _ in range(4)]
    prefetched = [next(iterator) for _ in range(3)]  # fetched ahead, never delivered
    state = source.state_dict(batches_consumed=4)
    resumed = sampler()
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert rest[:3] == prefetched
    assert delivered + rest == list(sampler())


def test_state_before_any_iteration_and_right_after_loading_is_a_valid_resume_point() -> None:
    fresh = sampler()
    assert fresh.state_dict()["batches_consumed"] == 0
    _, state = consume(sampler(), 9)
    loaded = sampler()
    loaded.load_state_dict(state)
    assert loaded.state_dict() == state  # a checkpoint right after resuming loses nothing
    assert loaded.state_dict(batches_consumed=2)["batches_consumed"] == 11


def test_batches_consumed_beyond_what_was_yielded_is_rejected() -> None:
    source = sampler()
    total = len(source)
    iter(source)
    with pytest.raises(ValueError, match=f"batches_consumed={total + 1} exceeds the {total}"):
        source.state_dict(batches_consumed=total + 1)


def test_the_state_is_plain_json_and_restores_the_seed() -> None:
    taken, state = consume(sampler(seed=5), 2)
    assert state["seed"] == 5
    other_seed = sampler(seed=99)
    other_seed.load_state_dict(state)
    assert taken + list(other_seed) == list(sampler(seed=5))
    assert other_seed.seed == 5


@pytest.mark.parametrize(
    ("options", "word"),
    [
        ({"max_tokens": 4096}, "options"),
        ({"window": 7}, "options"),
        ({"max_tokens": None, "batch_size": 8}, "options"),
    ],
)
def test_a_state_from_a_differently_configured_sampler_is_rejected(
    options: dict[str, Any], word: str
) -> None:
    _, state = consume(sampler(), 2)
    with pytest.raises(ValueError, match=word):
        sampler(**options).load_state_dict(state)


def test_a_state_from_other_lengths_is_rejected() -> None:
    _, state = consume(sampler(), 2)
    changed = LENGTHS.copy()
    changed[0] += 1
    other = LengthGroupedBatchSampler(changed, max_tokens=2048, seed=11)
    with pytest.raises(ValueError, match="lengths_crc32"):
        other.load_state_dict(state)


def test_a_damaged_state_names_what_is_wrong_and_leaves_the_sampler_unchanged() -> None:
    _, state = consume(sampler(), 2)
    target = sampler(seed=3)
    with pytest.raises(ValueError, match="lacks batches_consumed"):
        target.load_state_dict({k: v for k, v in state.items() if k != "batches_consumed"})
    with pytest.raises(ValueError, match="consumed"):
        target.load_state_dict({**state, "batches_consumed": 10_000})
    assert target.seed == 3
    assert list(target) == list(sampler(seed=3))


def rank_streams(
    replicas: int, state: dict[str, Any] | None = None, **options: Any
) -> list[list[list[int]]]:
    streams = []
    for rank in range(replicas):
        source = sampler(replicas, rank, **options)
        if state is not None:
            source.load_state_dict(state)
        streams.append(list(source))
    return streams


@pytest.mark.parametrize(("before", "after"), [(4, 3), (3, 4), (2, 5), (4, 1), (1, 2)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_elastic_resume_covers_exactly_the_unseen_samples_with_equal_counts(
    before: int, after: int, drop_last: bool
) -> None:
    consumed = 3
    seen: Counter[int] = Counter()
    state: dict[str, Any] = {}
    for rank in range(before):
        taken, state = consume(sampler(before, rank, drop_last=drop_last), consumed)
        seen.update(i for batch in taken for i in batch)
    assert set(seen.values()) == {1}
    rest = rank_streams(after, state, drop_last=drop_last)
    unseen = list(sampler(drop_last=drop_last))[consumed * before :]  # the global plan's rest
    if drop_last:
        rounds = len(unseen) // after  # the last round's remainder is dropped
        expected = unseen[: rounds * after]
    else:  # padded by repeating the first unseen batches
        rounds = -(-len(unseen) // after)
        expected = [unseen[j % len(unseen)] for j in range(rounds * after)]
    assert [len(stream) for stream in rest] == [rounds] * after
    assert [rest[j % after][j // after] for j in range(rounds * after)] == expected
    rest_seen = {i for stream in rest for batch in stream for i in batch}
    assert not rest_seen & set(seen)
    if not drop_last:
        assert rest_seen | set(seen) == set(range(LENGTHS.size))


def test_elastic_resume_then_resume_again_on_the_new_world_size() -> None:
    state: dict[str, Any] = {}
    seen: Counter[int] = Counter()
    for rank in range(4):
        taken, state = consume(sampler(4, rank), 2)
        seen.update(i for batch in taken for i in batch)
    for rank in range(2):
        middle = sampler(2, rank)
        middle.load_state_dict(state)
        iterator = iter(middle)
        taken = [next(iterator) for _ in range(3)]
        seen.update(i for batch in taken for i in batch)
        next_state = middle.state_dict()
    assert next_state["deal_start"] == 8 and next_state["batches_consumed"] == 3
    rest = rank_streams(2, next_state)
    seen.update(i for stream in rest for batch in stream for i in batch)
    assert set(seen) == set(range(LENGTHS.size))


def test_resume_with_a_warmup_matches_the_uninterrupted_run() -> None:
    warmup = BatchSizeWarmup(start=256, target=2048, steps=20)
    uninterrupted = list(sampler(warmup=warmup))
    taken, state = consume(sampler(warmup=warmup), 8)
    resumed = sampler(warmup=warmup)
    resumed.load_state_dict(state)
    assert taken + list(resumed) == uninterrupted


def test_batches_taken_as_arrays_count_towards_the_state_too() -> None:
    source = sampler()
    arrays = source.iter_arrays()
    taken = [next(arrays).tolist() for _ in range(6)]
    resumed = sampler()
    resumed.load_state_dict(source.state_dict())
    assert taken + list(resumed) == list(sampler())
