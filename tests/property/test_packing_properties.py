"""Property tests of the packing plan: every token of every sample exactly once per epoch, on 1,
2 and 3 ranks; full-shape batches; equal counts per rank with padding batches only; exact
resume at any point, twice, and onto another number of ranks."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
from _strategies import shard_windows
from hypothesis import given, settings
from hypothesis import strategies as st

from fastload import PackedBatchSampler
from fastload._sampling._shard_window import ShardWindow
from fastload._types import PackedBatch

SETTINGS = settings(max_examples=60, deadline=None)


@dataclass(frozen=True)
class Setup:
    lengths: list[int]
    options: dict[str, Any]

    def build(self, replicas: int = 1, rank: int = 0) -> PackedBatchSampler:
        return PackedBatchSampler(self.lengths, num_replicas=replicas, rank=rank, **self.options)

    @property
    def seq_len(self) -> int:
        return int(self.options["seq_len"])

    def expected_tokens(self) -> Counter[tuple[int, int]]:
        """(sample, token position) of every token an epoch must hold once."""
        split = self.options["oversize"] == "split"
        return Counter(
            (i, t)
            for i, n in enumerate(self.lengths)
            for t in range(n if split else min(n, self.seq_len))
        )


@st.composite
def setups(draw: st.DrawFn) -> Setup:
    seq_len = draw(st.integers(1, 64))
    lengths = draw(st.lists(st.integers(0, 3 * seq_len), max_size=120))
    options: dict[str, Any] = {
        "seq_len": seq_len,
        "shuffle": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**40)),
        "window": draw(st.sampled_from([None, 1, 2, 7, 100])),
        "oversize": draw(st.sampled_from(["split", "truncate"])),
    }
    if draw(st.booleans()):
        options["rows"] = draw(st.integers(1, 6))
    else:
        options["max_tokens"] = seq_len * draw(st.integers(1, 6)) + draw(st.integers(0, seq_len - 1))
    if options["shuffle"] and draw(st.booleans()):
        options.update(draw(shard_windows(len(lengths))))
    return Setup(lengths, options)


def tokens_of(batches: list[PackedBatch]) -> Counter[tuple[int, int]]:
    return Counter(
        (sample, t)
        for batch in batches
        for sample, start, stop in zip(batch.samples.tolist(), batch.starts.tolist(), batch.stops.tolist(), strict=True)
        for t in range(start, stop)
    )


def check_shape(batch: PackedBatch, sampler: PackedBatchSampler) -> None:
    assert batch.rows == sampler.rows and batch.seq_len == sampler.seq_len
    for r in range(batch.rows):
        pieces = batch.row(r)
        assert sum(stop - start for _, start, stop in pieces) <= batch.seq_len
        assert all(0 <= start < stop for _, start, stop in pieces)


@SETTINGS
@given(setups(), st.sampled_from([1, 2, 3]))
def test_every_token_once_per_epoch_on_any_number_of_ranks(setup: Setup, replicas: int) -> None:
    per_rank = []
    for rank in range(replicas):
        sampler = setup.build(replicas, rank)
        per_rank.append(list(sampler))
        for batch in per_rank[-1]:
            check_shape(batch, sampler)
    assert len({len(batches) for batches in per_rank}) == 1  # equal counts: DDP never hangs
    everything = [batch for batches in per_rank for batch in batches]
    assert tokens_of(everything) == setup.expected_tokens()
    # The last round's filler batches hold no token: never a repeated document.
    full = [batch for batch in everything if len(batch)]
    padding_only = len(everything) - len(full)
    assert padding_only < replicas
    sampler = setup.build(1, 0)
    assert sampler.truncated_tokens == (
        0
        if setup.options["oversize"] == "split"
        else sum(max(0, n - setup.seq_len) for n in setup.lengths)
    )
    assert sampler.skipped == setup.lengths.count(0)


@SETTINGS
@given(setups(), st.integers(0, 3))
def test_a_pure_function_of_its_arguments(setup: Setup, epoch: int) -> None:
    first, second = setup.build(), setup.build()
    first.set_epoch(epoch)
    second.set_epoch(epoch)
    assert [np.asarray(b).tolist() for b in first] == [np.asarray(b).tolist() for b in second]


@SETTINGS
@given(setups(), st.data())
def test_resume_anywhere_twice_and_onto_another_world_size(setup: Setup, data: st.DataObject) -> None:
    before, after = data.draw(st.sampled_from([1, 2, 3])), data.draw(st.sampled_from([1, 2, 3]))
    epoch = data.draw(st.integers(0, 2))
    samplers = [setup.build(before, rank) for rank in range(before)]
    streams = []
    for sampler in samplers:
        sampler.set_epoch(epoch)
        streams.append(iter(sampler))
    total = len(samplers[0])
    stop_at = data.draw(st.integers(0, total))
    seen = [next(stream) for stream in streams for _ in range(stop_at)]
    state = json.loads(json.dumps(samplers[0].state_dict()))

    # Resume once on `after` ranks, stop again part-way, and resume a second time.
    resumed = [setup.build(after, rank) for rank in range(after)]
    for sampler in resumed:
        sampler.load_state_dict(state)
        sampler.set_epoch(epoch)  # the usual loop: load, then set_epoch(saved epoch)
    left = len(resumed[0])
    again_at = data.draw(st.integers(0, left))
    streams = [iter(sampler) for sampler in resumed]
    seen += [next(stream) for stream in streams for _ in range(again_at)]
    second_state = resumed[0].state_dict()
    final = [setup.build(after, rank) for rank in range(after)]
    for sampler in final:
        sampler.load_state_dict(second_state)
        seen += list(sampler)
    assert tokens_of(seen) == setup.expected_tokens()


def test_plan_equals_the_uninterrupted_run_step_for_step() -> None:
    lengths = np.random.default_rng(3).integers(0, 90, 400)
    full = [np.asarray(b).tolist() for b in PackedBatchSampler(lengths, seq_len=64, rows=3, seed=5)]
    first = PackedBatchSampler(lengths, seq_len=64, rows=3, seed=5)
    stream = iter(first)
    head = [np.asarray(next(stream)).tolist() for _ in range(7)]
    resumed = PackedBatchSampler(lengths, seq_len=64, rows=3, seed=0)
    resumed.load_state_dict(first.state_dict())
    assert head + [np.asarray(b).tolist() for b in resumed] == full


@SETTINGS
@given(setups(), st.integers(0, 2), st.data())
def test_a_shard_window_packs_inside_one_group_and_keeps_groups_in_order(
    setup: Setup, epoch: int, data: st.DataObject
) -> None:
    window = data.draw(shard_windows(len(setup.lengths)))
    options = {**setup.options, **window, "shuffle": True, "drop_last": data.draw(st.booleans())}
    sampler = Setup(setup.lengths, options).build()
    sampler.set_epoch(epoch)
    sizes = window["shard_sizes"]
    shard_of = np.repeat(np.arange(len(sizes)), sizes)
    group_of = ShardWindow(window["shuffle_shards"], np.asarray(sizes)).group_of_shards(
        options["seed"], epoch
    )
    batches = list(sampler)
    groups = []
    for batch in batches:
        check_shape(batch, sampler)
        found = set(group_of[shard_of[batch.samples]].tolist())
        assert len(found) <= 1  # none: a padding batch
        groups.extend(found)
    assert groups == sorted(groups)
    tokens = tokens_of(batches)
    assert set(tokens.values()) <= {1} and set(tokens) <= set(setup.expected_tokens())
    if not options["drop_last"]:
        assert tokens == setup.expected_tokens()


@SETTINGS
@given(setups(), st.integers(0, 2), st.integers(0, 2))
def test_a_packing_group_of_every_shard_is_the_global_plan(
    setup: Setup, epoch: int, extra: int
) -> None:
    options = {k: v for k, v in setup.options.items() if k not in ("shard_sizes", "shuffle_shards")}
    options["shuffle"] = True
    half = len(setup.lengths) // 2
    windowed = Setup(setup.lengths, {**options, "shard_sizes": [half, len(setup.lengths) - half],
                                     "shuffle_shards": 2 + extra}).build()
    plain = Setup(setup.lengths, options).build()
    windowed.set_epoch(epoch)
    plain.set_epoch(epoch)
    assert [np.asarray(b).tolist() for b in windowed] == [np.asarray(b).tolist() for b in plain]
