"""Mixtures whose weights change during training: schedules, ``set_proportions``, exact
per-source accounting, exhaustion policies and resume on the same or another number of ranks."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from fastload import MixtureBatchSampler

SIZES = (3_000, 2_000, 1_000)
PARTS = [np.random.default_rng(d).integers(1, 300, size) for d, size in enumerate(SIZES)]
LENGTHS = np.concatenate(PARTS)
OFFSETS = np.concatenate(([0], np.cumsum(SIZES)))
SCHEDULE = [(0, [3, 2, 1]), (30, [1, 0, 3]), (70, [1, 1, 1])]


def sampler(**options: Any) -> MixtureBatchSampler:
    settings: dict[str, Any] = {"proportions": SCHEDULE, "batch_size": 16, "seed": 3}
    settings.update(options)
    return MixtureBatchSampler(PARTS, **settings)


def per_source(batch: list[int] | np.ndarray) -> np.ndarray:
    return np.bincount(np.searchsorted(OFFSETS, batch, side="right") - 1, minlength=len(SIZES))


def target(s: MixtureBatchSampler, batches: list[list[int]], first_step: int = 0) -> np.ndarray:
    """Each source's expected samples over ``batches`` (one rank, one per step)."""
    return sum(
        (np.array(s.proportions_at(first_step + k)) * len(b) for k, b in enumerate(batches)),
        np.zeros(len(SIZES)),
    )


def roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(state))


@pytest.mark.parametrize(
    "proportions",
    [SCHEDULE, lambda step: [1 + step / 20, 1.0, 2.0]],
    ids=["pieces", "callable"],
)
@pytest.mark.parametrize("budget", [None, 2_000], ids=["rows", "tokens"])
def test_every_window_of_batches_follows_the_weights_in_force(proportions: Any, budget: int | None) -> None:
    options: dict[str, Any] = {"proportions": proportions}
    if budget is not None:
        options.update(batch_size=None, max_tokens=budget)
    s = sampler(**options)
    batches = [list(b) for b in s][:150]  # "repeat": the sources never run out
    counts = np.array([per_source(b) for b in batches])
    expected = np.array([np.array(s.proportions_at(k)) * len(b) for k, b in enumerate(batches)])
    prefix_error = np.cumsum(counts, axis=0) - np.cumsum(expected, axis=0)
    assert np.abs(prefix_error).max() < 1 + 1e-9  # never a whole sample ahead or behind
    for width in (1, 5, 17, 60):
        for start in range(0, len(batches) - width, 3):
            window = counts[start : start + width].sum(axis=0) - expected[start : start + width].sum(axis=0)
            assert np.abs(window).max() < 2 + 1e-9, (width, start)
    if budget is not None:
        assert max(len(b) * int(LENGTHS[b].max()) for b in batches) <= budget


def test_a_piece_starts_exactly_at_its_step() -> None:
    batches = [list(b) for b in sampler()]
    assert all(per_source(b)[1] == 0 for b in batches[30:70])
    assert all(per_source(b)[1] > 0 for b in batches[:30])


def test_batches_are_length_grouped_inside_the_mixture() -> None:
    batches = [list(b) for b in sampler(proportions=[1, 1, 1])]
    real = sum(int(LENGTHS[b].sum()) for b in batches)
    padded = sum(len(b) * int(LENGTHS[b].max()) for b in batches)
    assert real / padded > 0.85


def test_consumed_counts_what_was_delivered_in_the_epoch_and_the_run() -> None:
    s = sampler(exhausted="renormalize")
    it = iter(s)
    delivered = [next(it) for _ in range(20)]
    got = s.consumed()
    assert got["epoch"]["samples"] == sum(per_source(b) for b in delivered).tolist()
    tokens = [int(LENGTHS[[i for b in delivered for i in b if OFFSETS[d] <= i < OFFSETS[d + 1]]].sum()) for d in range(3)]
    assert got["epoch"]["tokens"] == tokens
    assert s.consumed(batches_consumed=5)["epoch"]["samples"] == sum(per_source(b) for b in delivered[:5]).tolist()
    rest = list(it)
    assert s.consumed()["epoch"]["samples"] == list(SIZES)  # renormalize: every sample once
    assert s.state_dict()["mixture"]["consumed"]["epoch"]["samples"] == list(SIZES)
    s.set_epoch(1)
    first = list(next(iter(s)))
    run = s.consumed()["run"]["samples"]
    assert run == (np.array(SIZES) + per_source(first)).tolist()
    assert len(delivered) + len(rest) > 0


@pytest.mark.parametrize("workers_view", ["rows", "tokens"])
def test_resume_at_every_7th_batch_equals_the_uninterrupted_run(workers_view: str) -> None:
    options: dict[str, Any] = {} if workers_view == "rows" else {"batch_size": None, "max_tokens": 3_000}
    full = [list(b) for b in sampler(**options)]
    for stop in range(0, len(full), 7):
        first = sampler(**options)
        it = iter(first)
        head = [list(next(it)) for _ in range(stop)]
        resumed = sampler(**options)
        resumed.load_state_dict(roundtrip(first.state_dict()))
        assert head + [list(b) for b in resumed] == full, stop


def test_set_proportions_applies_from_the_next_batch_and_survives_a_resume() -> None:
    s = sampler()
    it = iter(s)
    head = [list(next(it)) for _ in range(10)]
    s.set_proportions([0, 0, 1])
    after = [list(next(it)) for _ in range(5)]
    assert all(per_source(b).tolist() == [0, 0, 16] for b in after)
    state = roundtrip(s.state_dict())
    rest = [list(b) for b in it]
    resumed = sampler()
    resumed.load_state_dict(state)
    assert [list(b) for b in resumed] == rest
    # The change holds in the next epochs too.
    resumed.set_epoch(1)
    assert all(per_source(b).tolist()[:2] == [0, 0] for b in list(resumed)[:10])
    assert head


def test_set_proportions_after_a_resume_equals_the_same_change_uninterrupted() -> None:
    reference = sampler()
    it = iter(reference)
    head = [list(next(it)) for _ in range(12)]
    reference.set_proportions([1, 5, 0])
    full = head + [list(b) for b in it]

    first = sampler()
    it = iter(first)
    [next(it) for _ in range(8)]
    resumed = sampler()
    resumed.load_state_dict(roundtrip(first.state_dict()))
    it = iter(resumed)
    middle = [list(next(it)) for _ in range(4)]
    resumed.set_proportions([1, 5, 0])
    assert head[8:] == middle
    assert head[:8] + middle + [list(b) for b in it] == full


def test_set_proportions_at_a_later_step_and_its_errors() -> None:
    s = sampler()
    it = iter(s)
    [next(it) for _ in range(3)]
    s.set_proportions([0, 1, 0], step=20)
    batches = [list(b) for b in it]
    assert per_source(batches[17]).tolist() == [0, 16, 0]  # step 20
    assert per_source(batches[16]).tolist() != [0, 16, 0]
    with pytest.raises(ValueError, match="before the next batch"):
        s.set_proportions([1, 1, 1], step=0)
    with pytest.raises(ValueError, match="3 weights"):
        s.set_proportions([1, 1])
    with pytest.raises(ValueError, match="must not all be 0"):
        s.set_proportions([0, 0, 0])


def _resize(before: int, after: int, stop: int, **options: Any) -> tuple[list[int], list[int]]:
    """Samples delivered on ``before`` ranks in ``stop`` steps, and those the ``after`` ranks
    then deliver (the state saved on rank 0 loaded into every new rank)."""
    ranks = [sampler(num_replicas=before, rank=r, **options) for r in range(before)]
    streams = [iter(s) for s in ranks]
    delivered = [i for _ in range(stop) for it in streams for i in next(it)]
    state = roundtrip(ranks[0].state_dict())
    assert all(roundtrip(s.state_dict()) == state for s in ranks)
    rest: list[int] = []
    counts = set()
    for r in range(after):
        s = sampler(num_replicas=after, rank=r, **options)
        s.load_state_dict(state)
        batches = [list(b) for b in s]
        counts.add(len(batches))
        rest += [i for b in batches for i in b]
    assert len(counts) == 1  # every rank the same number of batches
    return delivered, rest


@pytest.mark.parametrize(("before", "after"), [(2, 3), (4, 2)])
@pytest.mark.parametrize("policy", ["renormalize", "repeat"])
@pytest.mark.parametrize("budget", [None, 2_500], ids=["rows", "tokens"])
def test_a_resize_covers_the_rest_of_the_epoch_once(before: int, after: int, policy: str, budget: int | None) -> None:
    options: dict[str, Any] = {"exhausted": policy}
    if budget is not None:
        options.update(batch_size=None, max_tokens=budget)
    epoch = sorted(i for r in range(before) for b in sampler(num_replicas=before, rank=r, **options) for i in b)
    delivered, rest = _resize(before, after, 9, **options)
    assert sorted(delivered + rest) == epoch
    if policy == "renormalize":
        assert sorted(delivered + rest) == list(range(sum(SIZES)))  # nothing twice


def test_the_schedule_continues_at_its_step_after_a_resize() -> None:
    # Two ranks to one: the piece of step 30 (no source 1) starts at the new rank's step 30.
    ranks = [sampler(num_replicas=2, rank=r, exhausted="renormalize") for r in range(2)]
    streams = [iter(s) for s in ranks]
    for _ in range(10):
        for it in streams:
            next(it)
    one = sampler(exhausted="renormalize")
    one.load_state_dict(roundtrip(ranks[0].state_dict()))
    batches = [list(b) for b in one]
    assert all(per_source(b)[1] > 0 for b in batches[:20])  # steps 10 .. 29
    assert all(per_source(b)[1] == 0 for b in batches[20:60])  # steps 30 .. 69


def test_repeat_starts_new_passes_and_counts_them() -> None:
    s = sampler(proportions=[1, 1, 4], num_samples=6_000, exhausted="repeat")
    batches = [list(b) for b in s]
    totals = sum(per_source(b) for b in batches)
    assert totals.tolist() == [1_000, 1_000, 4_000]
    counted = np.bincount(np.concatenate(batches), minlength=6_000)
    assert set(counted[5_000:].tolist()) == {4}  # source 2: four whole passes
    assert s.consumed()["passes"] == [1, 1, 4]


def test_stop_ends_the_epoch_when_a_weighted_source_runs_out() -> None:
    s = sampler(proportions=[1, 1, 4], exhausted="stop")
    batches = [list(b) for b in s]
    totals = sum(per_source(b) for b in batches)
    assert totals[2] <= 1_000 and totals[2] > 1_000 - 16 * 4 / 6 - 2
    assert len(set(np.concatenate(batches).tolist())) == int(totals.sum())  # nothing twice


def test_renormalize_gives_an_exhausted_sources_weight_to_the_others() -> None:
    s = sampler(proportions=[1, 1, 4], exhausted="renormalize")
    batches = [list(b) for b in s]
    assert sorted(i for b in batches for i in b) == list(range(6_000))
    late = [per_source(b) for b in batches[-40:]]
    assert all(c[2] == 0 for c in late)  # source 2 ran out first; the others took its place


def test_the_default_policy_is_repeat() -> None:
    assert sampler().exhausted == "repeat"
    with pytest.raises(ValueError, match="exhausted"):
        sampler(exhausted="wrap")


def test_bad_schedules_are_named() -> None:
    with pytest.raises(ValueError, match="first piece must start at step 0"):
        sampler(proportions=[(5, [1, 1, 1])])
    with pytest.raises(ValueError, match="increasing step order"):
        sampler(proportions=[(0, [1, 1, 1]), (0, [1, 2, 3])])
    with pytest.raises(ValueError, match=r"proportions\[1\] weights\[2\] is -1"):
        sampler(proportions=[(0, [1, 1, 1]), (4, [1, 2, -1])])
    with pytest.raises(ValueError, match=r"proportions\(0\) must hold 3 weights"):
        sampler(proportions=lambda step: [1, 1])


def test_a_state_of_another_schedule_is_refused() -> None:
    state = sampler().state_dict()
    with pytest.raises(ValueError, match="proportions"):
        sampler(proportions=[1, 1, 1]).load_state_dict(state)
