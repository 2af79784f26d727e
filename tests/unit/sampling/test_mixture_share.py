"""``share="tokens"``: a mixture of whole-sample batches whose sources' tokens, not samples,
follow the weights in force over any window of batches; resumed exactly and resized."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from fastload import MixtureBatchSampler

SIZES = (3_000, 2_000, 1_000)
# The sources' lengths differ: by samples and by tokens the same weights give other batches.
PARTS = [np.random.default_rng(d).integers(1, 100 * (d + 1), size) for d, size in enumerate(SIZES)]
LENGTHS = np.concatenate(PARTS)
OFFSETS = np.concatenate(([0], np.cumsum(SIZES)))
LONGEST = int(LENGTHS.max())
SCHEDULE = [(0, [3, 2, 1]), (25, [1, 0, 3]), (60, [1, 1, 1])]


def sampler(**options: Any) -> MixtureBatchSampler:
    settings: dict[str, Any] = {"proportions": SCHEDULE, "batch_size": 16, "seed": 3, "share": "tokens"}
    settings.update(options)
    return MixtureBatchSampler(PARTS, **settings)


def tokens_per_source(batch: list[int]) -> np.ndarray:
    source = np.searchsorted(OFFSETS, batch, side="right") - 1
    return np.bincount(source, weights=LENGTHS[batch], minlength=len(SIZES))


def efficiency(batches: list[list[int]]) -> float:
    return sum(int(LENGTHS[b].sum()) for b in batches) / sum(len(b) * int(LENGTHS[b].max()) for b in batches)


def roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(state))


@pytest.mark.parametrize(
    "proportions", [SCHEDULE, lambda step: [1 + step / 20, 1.0, 2.0]], ids=["pieces", "callable"]
)
@pytest.mark.parametrize("budget", [None, 3_000], ids=["rows", "tokens"])
def test_every_window_of_batches_follows_the_weights_by_tokens(proportions: Any, budget: int | None) -> None:
    options: dict[str, Any] = {"proportions": proportions}
    if budget is not None:
        options.update(batch_size=None, max_tokens=budget)
    s = sampler(**options)
    batches = [list(b) for b in s][:150]
    counts = np.array([tokens_per_source(b) for b in batches])
    expected = np.array([np.array(s.proportions_at(k)) * counts[k].sum() for k in range(len(batches))])
    prefix = np.cumsum(counts - expected, axis=0)
    assert np.abs(prefix).max() <= LONGEST + 1e-6  # never a whole sample ahead or behind
    for width in (1, 5, 17, 60):
        for start in range(0, len(batches) - width, 3):
            window = counts[start : start + width].sum(axis=0) - expected[start : start + width].sum(axis=0)
            assert np.abs(window).max() <= 2 * LONGEST + 1e-6, (width, start)
    if budget is None:
        assert all(len(b) == 16 for b in batches)
    else:
        assert max(len(b) * int(LENGTHS[b].max()) for b in batches) <= budget
    # Length-grouped: far less padding than batches of one window each (no grouping).
    ungrouped = [list(b) for b in sampler(window=1, **options)][:150]
    assert efficiency(batches) > efficiency(ungrouped) + 0.1


def test_tokens_and_samples_apportion_differently() -> None:
    by_samples = [list(b) for b in sampler(share="samples", proportions=[1, 1, 1])]
    by_tokens = [list(b) for b in sampler(proportions=[1, 1, 1])]
    samples = np.bincount(np.searchsorted(OFFSETS, [i for b in by_tokens for i in b], side="right") - 1)
    tokens = sum(tokens_per_source(b) for b in by_tokens)
    assert np.abs(tokens / tokens.sum() - 1 / 3).max() < 0.01
    assert samples[0] > 2.5 * samples[2]  # short samples: more of them for the same tokens
    assert sampler(share="samples").share == "samples" and sampler().share == "tokens"
    assert by_samples != by_tokens


@pytest.mark.parametrize("budget", [None, 3_000], ids=["rows", "tokens"])
def test_resume_at_every_7th_batch_equals_the_uninterrupted_run(budget: int | None) -> None:
    options: dict[str, Any] = {} if budget is None else {"batch_size": None, "max_tokens": budget}
    full = [list(b) for b in sampler(**options)]
    for stop in range(0, len(full), 7):
        first = sampler(**options)
        it = iter(first)
        head = [list(next(it)) for _ in range(stop)]
        if stop == 14:
            first.set_proportions([1, 5, 1], step=20)
            full_changed = sampler(**options)
            it2 = iter(full_changed)
            reference = [list(next(it2)) for _ in range(stop)]
            full_changed.set_proportions([1, 5, 1], step=20)
            reference += [list(b) for b in it2]
        resumed = sampler(**options)
        resumed.load_state_dict(roundtrip(first.state_dict()))
        assert head + [list(b) for b in resumed] == (reference if stop == 14 else full), stop


@pytest.mark.parametrize(("before", "after"), [(2, 3), (4, 2)])
def test_a_resize_covers_the_rest_of_the_epoch_once(before: int, after: int) -> None:
    options = {"exhausted": "renormalize"}
    ranks = [sampler(num_replicas=before, rank=r, **options) for r in range(before)]
    streams = [iter(s) for s in ranks]
    delivered = [i for _ in range(9) for it in streams for i in next(it)]
    state = roundtrip(ranks[0].state_dict())
    rest = []
    counts = set()
    for r in range(after):
        s = sampler(num_replicas=after, rank=r, **options)
        s.load_state_dict(state)
        batches = [list(b) for b in s]
        counts.add(len(batches))
        rest += [i for b in batches for i in b]
    assert len(counts) == 1
    assert sorted(delivered + rest) == list(range(sum(SIZES)))


def test_share_is_validated_and_kept_in_the_state() -> None:
    with pytest.raises(ValueError, match="share"):
        sampler(share="rows")
    state = sampler().state_dict()
    with pytest.raises(ValueError, match="share"):
        sampler(share="samples").load_state_dict(state)
