"""Packing over a mixture (``MixtureBatchSampler(..., pack_length=)``): the weights choose the
documents of the packed rows, by tokens or by documents; exact resume; resume onto another
number of ranks covers the epoch's documents once."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from fastload import MixtureBatchSampler
from fastload._types import PackedBatch
from fastload.errors import OversizeSampleError

SIZES = (1_500, 1_000, 500)
PARTS = [np.random.default_rng(d).integers(1, 200, size) for d, size in enumerate(SIZES)]
OFFSETS = np.concatenate(([0], np.cumsum(SIZES)))
SEQ_LEN = 256
ROWS = 4
SCHEDULE = [(0, [3, 2, 1]), (12, [1, 0, 3]), (30, [1, 1, 1])]


def sampler(**options: Any) -> MixtureBatchSampler:
    settings: dict[str, Any] = {
        "proportions": SCHEDULE,
        "pack_length": SEQ_LEN,
        "batch_size": ROWS,
        "seed": 5,
        "exhausted": "renormalize",
    }
    settings.update(options)
    return MixtureBatchSampler(PARTS, **settings)


def source(samples: Any) -> np.ndarray:
    return np.searchsorted(OFFSETS, np.asarray(samples), side="right") - 1


def per_source(batch: PackedBatch, *, tokens: bool = True) -> np.ndarray:
    weights = (batch.stops - batch.starts) if tokens else np.ones(batch.pieces)
    return np.bincount(source(batch.samples), weights=weights, minlength=len(SIZES))


def pieces(batches: list[PackedBatch]) -> list[tuple[int, int, int]]:
    return [piece for batch in batches for row in batch for piece in row]


def encoded(batches: list[PackedBatch]) -> list[list[int]]:
    return [batch.encode().tolist() for batch in batches]


def roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(state))


def shares_follow_the_weights(s: MixtureBatchSampler, batches: list[PackedBatch], *, tokens: bool) -> None:
    """Over the batches so far each source is within one document of its weights in force,
    so over any window within one document at each end."""
    counts = np.array([per_source(b, tokens=tokens) for b in batches])
    expected = np.array([np.array(s.proportions_at(k)) * counts[k].sum() for k in range(len(batches))])
    unit = SEQ_LEN if tokens else 1
    prefix = np.cumsum(counts - expected, axis=0)
    assert np.abs(prefix).max() <= unit + 1e-6
    for width in (1, 3, 10, 25):
        for start in range(len(batches) - width):
            window = counts[start : start + width].sum(axis=0) - expected[start : start + width].sum(axis=0)
            assert np.abs(window).max() <= 2 * unit + 1e-6, (width, start)


@pytest.mark.parametrize(
    "proportions", [SCHEDULE, lambda step: [1 + step / 10, 1.0, 2.0]], ids=["pieces", "callable"]
)
def test_every_window_of_packed_batches_follows_the_weights_by_tokens(proportions: Any) -> None:
    s = sampler(proportions=proportions, exhausted="repeat")
    batches = list(s)
    assert s.share == "tokens"
    assert all(isinstance(b, PackedBatch) and b.rows == ROWS for b in batches)
    shares_follow_the_weights(s, batches, tokens=True)
    if proportions is SCHEDULE:  # the piece of step 12 starts exactly there
        assert all(per_source(b)[1] == 0 for b in batches[12:30]) and per_source(batches[11])[1] > 0
    real = sum(b.num_tokens for b in batches[:-1])
    assert real / ((len(batches) - 1) * ROWS * SEQ_LEN) > 0.97  # rows stay full


def test_share_samples_apportions_documents() -> None:
    s = sampler(exhausted="repeat", share="samples")
    batches = list(s)
    shares_follow_the_weights(s, batches, tokens=False)


def test_renormalize_packs_every_sample_once_and_accounts_for_it() -> None:
    s = sampler()
    batches = list(s)
    got = pieces(batches)
    assert sorted(sample for sample, _, _ in got) == list(range(sum(SIZES)))
    lengths = np.concatenate(PARTS)
    assert all(stop - start == lengths[sample] and start == 0 for sample, start, stop in got)
    consumed = s.consumed()["epoch"]
    assert consumed["samples"] == list(SIZES)
    assert consumed["tokens"] == [int(part.sum()) for part in PARTS]
    assert s.samples_per_dataset == list(SIZES)


def test_resume_at_every_7th_batch_equals_the_uninterrupted_run() -> None:
    full = encoded(list(sampler()))
    for stop in range(0, len(full), 7):
        first = sampler()
        it = iter(first)
        head = encoded([next(it) for _ in range(stop)])
        resumed = sampler()
        resumed.load_state_dict(roundtrip(first.state_dict()))
        assert head + encoded(list(resumed)) == full, stop


def test_set_proportions_packs_from_the_next_batch_and_survives_a_resume() -> None:
    s = sampler(exhausted="repeat")
    it = iter(s)
    [next(it) for _ in range(5)]
    s.set_proportions([0, 0, 1])
    after = [next(it) for _ in range(4)]
    assert all(per_source(b)[:2].tolist() == [0, 0] for b in after)
    state = roundtrip(s.state_dict())
    rest = encoded(list(it))
    resumed = sampler(exhausted="repeat")
    resumed.load_state_dict(state)
    assert encoded(list(resumed)) == rest


def _resize(before: int, after: int, stop: int, **options: Any) -> tuple[list[Any], list[Any], set[int]]:
    ranks = [sampler(num_replicas=before, rank=r, **options) for r in range(before)]
    streams = [iter(s) for s in ranks]
    delivered = [piece for _ in range(stop) for it in streams for row in next(it) for piece in row]
    state = roundtrip(ranks[0].state_dict())
    assert all(roundtrip(s.state_dict()) == state for s in ranks)
    rest: list[Any] = []
    counts = set()
    for r in range(after):
        s = sampler(num_replicas=after, rank=r, **options)
        s.load_state_dict(state)
        batches = list(s)
        assert all(b.rows == ROWS for b in batches)
        counts.add(len(batches))
        rest += pieces(batches)
    return delivered, rest, counts


@pytest.mark.parametrize(("before", "after"), [(2, 3), (4, 2)])
@pytest.mark.parametrize("policy", ["renormalize", "repeat"])
def test_a_resize_covers_the_rest_of_the_epoch_once(before: int, after: int, policy: str) -> None:
    options = {"exhausted": policy, "oversize": "split", "pack_length": 128}
    epoch = sorted(
        piece for r in range(before) for piece in pieces(list(sampler(num_replicas=before, rank=r, **options)))
    )
    delivered, rest, counts = _resize(before, after, 6, **options)
    assert len(counts) == 1  # every rank the same number of batches (padding batches fill)
    assert sorted(delivered + rest) == epoch
    if policy == "renormalize":
        assert len(set(epoch)) == len(epoch)  # nothing twice
        lengths = np.concatenate(PARTS)
        assert sum(stop - start for _, start, stop in epoch) == int(lengths.sum())


def test_the_last_round_is_padding_not_repeats() -> None:
    ranks = [sampler(num_replicas=3, rank=r) for r in range(3)]
    batches = [list(s) for s in ranks]
    assert len({len(b) for b in batches}) == 1
    got = [piece for rank in batches for piece in pieces(rank)]
    assert len(got) == len(set(got))
    assert sum(b.num_tokens == 0 for rank in batches for b in rank) < 3


def test_oversize_split_truncate_and_error_name_the_source() -> None:
    long_parts = [np.array([10, 600, 20]), np.array([700, 5])]
    split = MixtureBatchSampler(
        long_parts, proportions=[1, 1], pack_length=256, batch_size=2, exhausted="renormalize"
    )
    assert sorted(pieces(list(split))) == [
        (0, 0, 10), (1, 0, 256), (1, 256, 512), (1, 512, 600), (2, 0, 20),
        (3, 0, 256), (3, 256, 512), (3, 512, 700), (4, 0, 5),
    ]
    truncate = MixtureBatchSampler(
        long_parts, proportions=[1, 1], pack_length=256, batch_size=2, oversize="truncate", exhausted="renormalize"
    )
    assert sorted(pieces(list(truncate)))[1] == (1, 0, 256)
    with pytest.raises(OversizeSampleError, match=r"lengths\[0\] \(dataset 0\): sample 1 has length 600"):
        MixtureBatchSampler(long_parts, proportions=[1, 1], pack_length=256, batch_size=2, oversize="error")


def test_options_that_packing_cannot_honour_are_refused() -> None:
    with pytest.raises(ValueError, match="longest_first=True does not apply with pack_length"):
        sampler(longest_first=True)
    with pytest.raises(ValueError, match="pad_to_multiple_of=8 does not apply with pack_length"):
        sampler(pad_to_multiple_of=8)
    with pytest.raises(ValueError, match="window=10 does not apply with pack_length"):
        sampler(window=10)
    with pytest.raises(ValueError, match="share"):
        sampler(share="bytes")
    with pytest.raises(ValueError, match="oversize"):
        sampler(oversize="skip")
    assert sampler(batch_size=None, max_tokens=4 * SEQ_LEN).rows == 4
    with pytest.raises(ValueError, match=r"dataset 1 has weight > 0 .* no sample to give \(every one is empty\)"):
        MixtureBatchSampler([np.array([3, 4]), np.array([0, 0])], proportions=[1, 1], pack_length=8, batch_size=1)


def test_a_packed_state_does_not_load_into_an_unpacked_mixture() -> None:
    state = sampler().state_dict()
    with pytest.raises(ValueError, match="pack"):
        sampler(pack_length=None, batch_size=16).load_state_dict(state)


def test_stop_ends_the_packed_epoch_when_a_weighted_source_runs_out() -> None:
    s = sampler(proportions=[1, 1, 4], exhausted="stop")
    got = pieces(list(s))
    assert len(got) == len(set(got))  # nothing twice
    samples = source([sample for sample, _, _ in got])
    totals = np.bincount(samples, minlength=3)
    assert totals[2] == SIZES[2] and totals[0] < SIZES[0] and totals[1] < SIZES[1]


def test_repeat_packs_new_passes_and_counts_them() -> None:
    s = sampler(proportions=[1, 1, 4], exhausted="repeat")
    got = pieces(list(s))
    totals = np.bincount(source([sample for sample, _, _ in got]), minlength=3)
    assert totals.sum() == sum(SIZES)  # num_samples: the epoch's documents
    assert totals[2] > 2 * SIZES[2]  # source 2 read in several passes
    assert s.consumed()["passes"][2] == -(-int(totals[2]) // SIZES[2])
    assert s.consumed()["epoch"]["samples"] == totals.tolist()


def test_padding_batches_of_the_last_round_are_not_counted() -> None:
    ranks = [sampler(num_replicas=4, rank=r) for r in range(4)]  # 309 batches: 3 of padding
    assert sum(b.num_tokens == 0 for b in iter(ranks[3])) == 1
    for s in ranks:
        list(s)
        assert s.consumed()["epoch"]["samples"] == list(SIZES)
