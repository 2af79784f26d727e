"""Property tests of length-grouped sampling: exact cover, budgets, determinism, rank partition,
and exact resume (also onto another world size), over random lengths and options."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
from _strategies import shard_windows
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fastload import LengthGroupedBatchSampler
from fastload._sampling._shard_window import ShardWindow

SETTINGS = settings(max_examples=60, deadline=None)


@dataclass(frozen=True)
class Setup:
    lengths: list[int]
    options: dict[str, Any]

    def build(self, replicas: int = 1, rank: int = 0) -> LengthGroupedBatchSampler:
        return LengthGroupedBatchSampler(
            self.lengths, num_replicas=replicas, rank=rank, **self.options
        )

    def kept(self) -> set[int]:
        """The samples an epoch must cover (skipped oversize samples excluded)."""
        budget = self.options.get("max_tokens")
        multiple = self.options.get("pad_to_multiple_of") or 1
        if budget is None or self.options["oversize"] != "skip":
            return set(range(len(self.lengths)))
        return {i for i, n in enumerate(self.lengths) if -(-n // multiple) * multiple <= budget}

    def groups(self) -> int:
        """Groups of shards per epoch (1 without a shard window): each has a partial batch."""
        if "shuffle_shards" not in self.options:
            return 1
        return -(-len(self.options["shard_sizes"]) // self.options["shuffle_shards"])


@st.composite
def setups(draw: st.DrawFn) -> Setup:
    lengths = draw(st.lists(st.integers(0, 300), max_size=200))
    mode = draw(st.sampled_from(["rows", "tokens", "both"]))
    options: dict[str, Any] = {
        "shuffle": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**40)),
        "drop_last": draw(st.booleans()),
        "pad_to_multiple_of": draw(st.sampled_from([None, 1, 4, 16])),
        "window": draw(st.sampled_from([None, 1, 2, 7, 100])),
        "longest_first": draw(st.booleans()),
        "oversize": draw(st.sampled_from(["skip", "truncate"])),
    }
    if mode in ("rows", "both"):
        options["batch_size"] = draw(st.integers(1, 24))
    if mode in ("tokens", "both"):
        options["max_tokens"] = draw(st.integers(16, 1200))
    if options["shuffle"] and draw(st.booleans()):
        options.update(draw(shard_windows(len(lengths))))
    return Setup(lengths, options)


def flat(batches: list[list[int]]) -> Counter[int]:
    return Counter(i for batch in batches for i in batch)


@SETTINGS
@given(setup=setups(), epoch=st.integers(0, 4))
def test_every_epoch_is_an_exact_cover(setup: Setup, epoch: int) -> None:
    sampler = setup.build()
    sampler.set_epoch(epoch)
    batches = list(sampler)
    seen = flat(batches)
    assert set(seen.values()) <= {1}
    assert set(seen) <= setup.kept()
    missing = len(setup.kept()) - len(seen)
    if setup.options["drop_last"] and "max_tokens" not in setup.options:
        # only the partial batch (of each group of shards) is dropped
        assert 0 <= missing < setup.options["batch_size"] * setup.groups()
    else:
        assert missing == 0
    assert all(batch for batch in batches)


@SETTINGS
@given(setup=setups(), epoch=st.integers(0, 4))
def test_no_batch_exceeds_the_token_budget_or_the_row_cap(setup: Setup, epoch: int) -> None:
    sampler = setup.build()
    sampler.set_epoch(epoch)
    budget = setup.options.get("max_tokens")
    rows = setup.options.get("batch_size")
    multiple = setup.options.get("pad_to_multiple_of") or 1
    truncate = sampler.truncate_length
    for batch in sampler:
        longest = max(setup.lengths[i] for i in batch)
        if truncate is not None:
            longest = min(longest, truncate)
        if budget is not None:
            assert len(batch) * (-(-longest // multiple) * multiple) <= budget
        if rows is not None:
            assert len(batch) <= rows


@SETTINGS
@given(setup=setups(), epoch=st.integers(0, 4), replicas=st.integers(1, 4))
def test_the_same_seed_gives_the_same_plan(setup: Setup, epoch: int, replicas: int) -> None:
    first, second = setup.build(replicas, replicas - 1), setup.build(replicas, replicas - 1)
    first.set_epoch(epoch)
    list(setup.build())  # another sampler's iteration in between changes nothing
    second.set_epoch(epoch)
    assert list(first) == list(second)


@SETTINGS
@given(setup=setups(), epoch=st.integers(0, 3), replicas=st.integers(1, 5))
def test_ranks_partition_the_epoch_with_equal_counts(
    setup: Setup, epoch: int, replicas: int
) -> None:
    streams = []
    for rank in range(replicas):
        sampler = setup.build(replicas, rank)
        sampler.set_epoch(epoch)
        streams.append(list(sampler))
        assert len(sampler) == len(streams[-1])
    assert len({len(stream) for stream in streams}) == 1
    batches = [batch for stream in streams for batch in stream]
    seen = flat(batches)
    if setup.options["drop_last"]:
        assert set(seen.values()) <= {1}
    else:
        assert set(seen) == setup.kept()
        # Global batches are disjoint, so a repeated sample means a repeated (padding) batch.
        distinct = {tuple(batch) for batch in batches}
        assert sum(seen.values()) - sum(len(batch) for batch in distinct) >= 0
        assert len(batches) - len(distinct) < replicas


@SETTINGS
@given(
    setup=setups(),
    epoch=st.integers(0, 3),
    replicas=st.integers(1, 4),
    fraction=st.floats(0.0, 1.0),
)
def test_resume_at_any_point_equals_the_uninterrupted_run(
    setup: Setup, epoch: int, replicas: int, fraction: float
) -> None:
    rank = replicas - 1
    reference = setup.build(replicas, rank)
    reference.set_epoch(epoch)
    uninterrupted = list(reference)
    stop = int(fraction * len(uninterrupted))
    source = setup.build(replicas, rank)
    source.set_epoch(epoch)
    iterator = iter(source)
    taken = [next(iterator) for _ in range(stop)]
    state = json.loads(json.dumps(source.state_dict()))
    resumed = setup.build(replicas, rank)
    resumed.load_state_dict(state)
    resumed.set_epoch(epoch)
    assert len(resumed) == len(uninterrupted) - stop
    assert taken + list(resumed) == uninterrupted


@SETTINGS
@given(
    setup=setups(),
    before=st.integers(1, 4),
    after=st.integers(1, 4),
    fraction=st.floats(0.0, 1.0),
)
def test_elastic_resume_covers_the_rest_of_the_epoch_exactly_once(
    setup: Setup, before: int, after: int, fraction: float
) -> None:
    assume(before != after)  # the same world size continues the same deal (tested above)
    options = {**setup.options, "drop_last": False}
    elastic = Setup(setup.lengths, options)
    per_rank = len(elastic.build(before, 0))
    stop = int(fraction * per_rank)
    seen: Counter[int] = Counter()
    state: dict[str, Any] = {}
    for rank in range(before):
        source = elastic.build(before, rank)
        iterator = iter(source)
        seen.update(flat([next(iterator) for _ in range(stop)]))
        state = json.loads(json.dumps(source.state_dict()))
    rest_streams = []
    for rank in range(after):
        resumed = elastic.build(after, rank)
        resumed.load_state_dict(state)
        rest_streams.append(list(resumed))
    assert len({len(stream) for stream in rest_streams}) == 1
    rest_batches = [batch for stream in rest_streams for batch in stream]
    rest = flat(rest_batches)
    if stop * before <= len(elastic.build()):  # no padding consumed before the save
        assert set(seen.values()) <= {1}
        assert not set(seen) & set(rest)
        assert set(seen) | set(rest) == elastic.kept()
        assert len(rest_batches) - len({tuple(batch) for batch in rest_batches}) < after
    else:  # the whole epoch, padding included, was consumed: nothing is left
        assert set(seen) == elastic.kept()
        assert not rest_batches


@SETTINGS
@given(setup=setups(), epoch=st.integers(0, 3), data=st.data())
def test_a_shard_window_keeps_batches_in_one_group_and_groups_in_order(
    setup: Setup, epoch: int, data: st.DataObject
) -> None:
    assume(setup.options["shuffle"])
    window = data.draw(shard_windows(len(setup.lengths)))
    sizes, per_group = window["shard_sizes"], window["shuffle_shards"]
    sampler = Setup(setup.lengths, {**setup.options, **window}).build()
    sampler.set_epoch(epoch)
    shard_of = np.repeat(np.arange(len(sizes)), sizes)
    group_of = ShardWindow(per_group, np.asarray(sizes)).group_of_shards(
        setup.options["seed"], epoch
    )
    groups = []
    for batch in sampler:
        found = set(group_of[shard_of[batch]].tolist())
        assert len(found) == 1
        groups.extend(found)
    assert groups == sorted(groups)


@SETTINGS
@given(setup=setups(), epoch=st.integers(0, 3), replicas=st.integers(1, 3), extra=st.integers(0, 2))
def test_a_group_of_every_shard_is_the_global_plan(
    setup: Setup, epoch: int, replicas: int, extra: int
) -> None:
    assume(setup.options["shuffle"])
    options = {k: v for k, v in setup.options.items() if k not in ("shard_sizes", "shuffle_shards")}
    sizes = [len(setup.lengths) // 2, len(setup.lengths) - len(setup.lengths) // 2]
    windowed = Setup(setup.lengths, {**options, "shard_sizes": sizes, "shuffle_shards": 2 + extra})
    plain = Setup(setup.lengths, options)
    first, second = windowed.build(replicas, replicas - 1), plain.build(replicas, replicas - 1)
    first.set_epoch(epoch)
    second.set_epoch(epoch)
    assert list(first) == list(second)
