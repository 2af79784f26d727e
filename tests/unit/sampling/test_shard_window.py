"""The shard-window shuffle (``shuffle_shards``, ``shard_sizes``) of the length-grouped and packed
samplers: its errors, that one group is the global plan, that batches stay inside groups of K
shards visited one after the other, resume identity, longest-first and warm-up."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import numpy as np
import pytest

from fastload import BatchSizeWarmup, LengthGroupedBatchSampler, PackedBatchSampler
from fastload._sampling._shard_window import ShardWindow

LENGTHS = np.random.default_rng(0).integers(1, 400, 3_000).astype(np.int64)
# 40 shards of uneven sizes, one of them empty, in index order.
SIZES = np.diff(np.concatenate(([0], np.sort(np.random.default_rng(1).integers(0, 3_000, 39)), [3_000])))
SHARD_OF = np.repeat(np.arange(SIZES.size), SIZES)


def grouped(**options: Any) -> LengthGroupedBatchSampler:
    options.setdefault("seed", 7)
    options.setdefault("shard_sizes", SIZES)
    return LengthGroupedBatchSampler(LENGTHS, **options)


def packed(**options: Any) -> PackedBatchSampler:
    options.setdefault("seed", 7)
    options.setdefault("seq_len", 512)
    options.setdefault("rows", 4)
    options.setdefault("shard_sizes", SIZES)
    return PackedBatchSampler(LENGTHS, **options)


def samples_of(batch: Any) -> list[int]:
    return batch if isinstance(batch, list) else batch.samples.tolist()


def batch_groups(batches: list[Any], shards_per_group: int, seed: int, epoch: int) -> list[int]:
    """The group of every batch, asserting that each batch's samples are in one group."""
    group_of_shard = ShardWindow(shards_per_group, SIZES).group_of_shards(seed, epoch)
    groups = []
    for batch in batches:
        found = set(group_of_shard[SHARD_OF[samples_of(batch)]].tolist())
        assert len(found) <= 1, f"a batch spans groups {found}"
        groups.extend(found)
    return groups


@pytest.mark.parametrize("build", [grouped, packed])
@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"shuffle_shards": 0}, ValueError, r"shuffle_shards must be >= 1; got 0"),
        ({"shuffle_shards": 2.5}, TypeError, r"shuffle_shards must be an integer"),
        ({"shuffle_shards": 4, "shuffle": False}, ValueError, r"shuffle_shards=4 .*shuffle=True"),
        ({"shuffle_shards": 4, "shard_sizes": None}, ValueError, r"shuffle_shards=4 needs shard_sizes"),
        ({"shard_sizes": [1_000, 1_000]}, ValueError, r"shard_sizes sum to 2000 .* lengths has 3000"),
        ({"shard_sizes": [3_001, -1]}, ValueError, r"shard_sizes\[1\] is -1"),
        ({"shard_sizes": []}, ValueError, r"shard_sizes must be a non-empty 1-D"),
        ({"shard_sizes": [1_500.0, 1_500.0]}, TypeError, r"shard_sizes must hold integers"),
    ],
)
def test_bad_shard_options_fail_at_construction_naming_the_option(
    build: Any, options: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        build(batch_size=32, **options) if build is grouped else build(**options)


def test_shard_sizes_alone_change_nothing() -> None:
    plain = LengthGroupedBatchSampler(LENGTHS, batch_size=32, seed=7)
    assert grouped(batch_size=32).state_dict() == plain.state_dict()
    assert list(grouped(batch_size=32)) == list(plain)


@pytest.mark.parametrize("shards_per_group", [SIZES.size, SIZES.size + 1, 10_000])
@pytest.mark.parametrize(
    "options",
    [
        {"batch_size": 32},
        {"batch_size": 32, "drop_last": True},
        {"max_tokens": 4_096, "longest_first": True, "num_replicas": 3, "rank": 2},
        {"max_tokens": 4_096, "batch_size": 20, "window": None, "pad_to_multiple_of": 8},
        {"batch_size": 32, "warmup": BatchSizeWarmup(4, 32, 30)},
    ],
)
def test_one_group_of_every_shard_is_the_global_plan(
    shards_per_group: int, options: dict[str, Any]
) -> None:
    plain = LengthGroupedBatchSampler(LENGTHS, seed=7, **options)
    windowed = grouped(shuffle_shards=shards_per_group, **options)
    for epoch in (0, 3):
        plain.set_epoch(epoch)
        windowed.set_epoch(epoch)
        assert list(windowed) == list(plain)


@pytest.mark.parametrize(
    "options", [{}, {"drop_last": True}, {"window": None}, {"max_tokens": 1_100, "rows": None}]
)
def test_one_packing_group_of_every_shard_is_the_global_plan(options: dict[str, Any]) -> None:
    plain = PackedBatchSampler(LENGTHS, **{"seq_len": 512, "rows": 4, "seed": 7, **options})
    windowed = packed(shuffle_shards=SIZES.size, **options)
    assert [np.asarray(b).tolist() for b in windowed] == [np.asarray(b).tolist() for b in plain]


@pytest.mark.parametrize("shards_per_group", [1, 3, 16])
@pytest.mark.parametrize(
    "options",
    [{"batch_size": 32}, {"batch_size": 32, "drop_last": True}, {"max_tokens": 4_096}],
)
def test_batches_stay_in_a_group_and_groups_come_one_after_another(
    shards_per_group: int, options: dict[str, Any]
) -> None:
    sampler = grouped(shuffle_shards=shards_per_group, **options)
    sampler.set_epoch(2)
    batches = list(sampler)
    groups = batch_groups(batches, shards_per_group, seed=7, epoch=2)
    assert groups == sorted(groups)
    seen = Counter(i for batch in batches for i in batch)
    assert set(seen.values()) == {1}
    if options.get("drop_last"):  # every group drops its own partial batch
        assert all(len(batch) == 32 for batch in batches)
        assert 0 <= LENGTHS.size - len(seen) < 32 * -(-SIZES.size // shards_per_group)
    else:
        assert len(seen) == LENGTHS.size
        group_of_shard = ShardWindow(shards_per_group, SIZES).group_of_shards(7, 2)
        assert set(groups) == set(group_of_shard[SIZES > 0].tolist())  # every group with samples


def test_with_one_shard_per_group_every_shard_is_visited_once_and_whole() -> None:
    batches = list(grouped(batch_size=16, shuffle_shards=1))
    runs = [int(SHARD_OF[batch[0]]) for batch in batches]
    assert all(len(set(SHARD_OF[batch].tolist())) == 1 for batch in batches)
    order = [shard for i, shard in enumerate(runs) if i == 0 or runs[i - 1] != shard]
    assert sorted(order) == sorted(set(np.flatnonzero(SIZES).tolist()))  # each shard one run


def test_the_shard_order_is_seeded_and_changes_with_the_epoch() -> None:
    def first_shards(seed: int, epoch: int) -> list[int]:
        sampler = grouped(batch_size=16, shuffle_shards=1, seed=seed)
        sampler.set_epoch(epoch)
        return [int(SHARD_OF[batch[0]]) for batch in list(sampler)[:40]]

    assert first_shards(1, 0) == first_shards(1, 0)
    assert first_shards(1, 0) != first_shards(1, 1)
    assert first_shards(1, 0) != first_shards(2, 0)


def test_longest_first_takes_the_largest_batches_of_the_first_group_only() -> None:
    sampler = grouped(max_tokens=4_096, shuffle_shards=4, longest_first=True, num_replicas=2)
    plan = sampler._plan(0, 2)  # the global batches, before the deal
    global_batches = [plan.batch(b) for b in range(plan.num_batches)]
    groups = batch_groups([b.tolist() for b in global_batches], 4, seed=7, epoch=0)
    first_group = [b for b, g in zip(global_batches, groups, strict=True) if g == groups[0]]
    sizes = [len(b) * int(LENGTHS[b].max()) for b in first_group]
    assert sizes[:2] == sorted(sizes, reverse=True)[:2]
    assert groups == sorted(groups)


def test_warmup_splits_the_first_batches_and_keeps_the_groups_in_order() -> None:
    warmup = BatchSizeWarmup(4, 32, 20)
    sampler = grouped(batch_size=32, shuffle_shards=2, warmup=warmup)
    batches = list(sampler)
    assert all(len(b) <= warmup(step) for step, b in enumerate(batches[:20]))
    assert len(batches[0]) == 4 and len(batches[25]) == 32
    groups = batch_groups(batches, 2, seed=7, epoch=0)
    assert groups == sorted(groups)
    assert sorted(i for b in batches for i in b) == list(range(LENGTHS.size))


@pytest.mark.parametrize("shards_per_group", [1, 5])
def test_packed_batches_stay_in_a_group_and_hold_every_token_once(shards_per_group: int) -> None:
    sampler = packed(shuffle_shards=shards_per_group, num_replicas=1)
    sampler.set_epoch(1)
    batches = list(sampler)
    groups = batch_groups(batches, shards_per_group, seed=7, epoch=1)
    assert groups == sorted(groups)
    assert all(b.rows == 4 for b in batches)
    tokens = Counter(
        (sample, t)
        for b in batches
        for sample, start, stop in zip(b.samples.tolist(), b.starts.tolist(), b.stops.tolist(), strict=True)
        for t in range(start, stop)
    )
    assert set(tokens.values()) == {1} and len(tokens) == int(LENGTHS.sum())
    assert sampler.efficiency() > 0.9


def test_packed_drop_last_drops_each_groups_partial_batch_only() -> None:
    kept = list(packed(shuffle_shards=3, drop_last=True))
    every = list(packed(shuffle_shards=3))
    full_rows = [b for b in every if all(len(b.row(r)) for r in range(b.rows))]
    assert {tuple(b.samples.tolist()) for b in kept} == {tuple(b.samples.tolist()) for b in full_rows}
    assert len(every) - len(kept) <= -(-SIZES.size // 3)


@pytest.mark.parametrize("build", [grouped, packed])
def test_a_state_loads_only_into_the_same_shard_window(build: Any) -> None:
    options = {"batch_size": 32} if build is grouped else {}
    source = build(shuffle_shards=3, **options)
    stream = iter(source)
    head = [next(stream) for _ in range(5)]
    state = json.loads(json.dumps(source.state_dict()))
    for other in (
        {"shuffle_shards": 4},
        {"shuffle_shards": None},
        {"shuffle_shards": 3, "shard_sizes": np.concatenate(([SIZES[0] + SIZES[1]], SIZES[2:]))},
    ):
        with pytest.raises(ValueError, match=r"saved with options="):
            build(**{**options, **other}).load_state_dict(state)
    resumed = build(shuffle_shards=3, **options)
    resumed.load_state_dict(state)
    key = (lambda b: b) if build is grouped else (lambda b: np.asarray(b).tolist())
    assert [key(b) for b in head + list(resumed)] == [key(b) for b in build(shuffle_shards=3, **options)]


def test_a_state_without_a_shard_window_has_no_shard_key() -> None:
    state = LengthGroupedBatchSampler(LENGTHS, batch_size=32).state_dict()
    assert "shard_window" not in state["options"]
    assert "shard_window" in grouped(batch_size=32, shuffle_shards=2).state_dict()["options"]


def test_oversize_skip_leaves_the_same_samples_out_of_a_grouped_epoch() -> None:
    lengths = LENGTHS.copy()
    lengths[::7] = 5_000
    sampler = LengthGroupedBatchSampler(
        lengths, max_tokens=4_096, oversize="skip", shuffle_shards=4, shard_sizes=SIZES, seed=7
    )
    seen = sorted(i for batch in sampler for i in batch)
    assert seen == [i for i in range(lengths.size) if lengths[i] <= 4_096]
    groups = batch_groups(list(sampler), 4, seed=7, epoch=0)
    assert groups == sorted(groups)


def test_packed_warmup_cuts_the_first_batches_and_keeps_the_groups_in_order() -> None:
    warmup = BatchSizeWarmup(1, 4, 12)
    sampler = packed(shuffle_shards=4, warmup=warmup)
    batches = list(sampler)
    assert all(b.rows <= warmup(step) for step, b in enumerate(batches[:12]))
    assert batches[0].rows == 1 and batches[20].rows == 4
    groups = batch_groups(batches, 4, seed=7, epoch=0)
    assert groups == sorted(groups)


@pytest.mark.parametrize("build", [grouped, packed])
def test_resume_with_a_warmup_over_epochs_matches_the_uninterrupted_run(build: Any) -> None:
    options: dict[str, Any] = (
        {"batch_size": 32, "warmup": BatchSizeWarmup(4, 32, 150)}
        if build is grouped
        else {"warmup": BatchSizeWarmup(1, 4, 150)}
    )
    key = (lambda b: b) if build is grouped else (lambda b: np.asarray(b).tolist())
    reference = build(shuffle_shards=5, num_replicas=2, rank=1, **options)
    reference.set_epoch(1)  # the warm-up runs on from epoch 0's steps
    uninterrupted = [key(b) for b in reference]
    source = build(shuffle_shards=5, num_replicas=2, rank=1, **options)
    source.set_epoch(1)
    stream = iter(source)
    head = [key(next(stream)) for _ in range(9)]
    resumed = build(shuffle_shards=5, num_replicas=2, rank=1, **options)
    resumed.load_state_dict(json.loads(json.dumps(source.state_dict())))
    assert head + [key(b) for b in resumed] == uninterrupted
