"""Property tests of packing over a mixture: with ``exhausted="renormalize"`` every token of
every sample exactly once per epoch on any number of ranks, also across a resize at any point;
full-shape batches whose rows hold at most ``pack_length`` tokens; the same plan for the same
seed."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fastload import MixtureBatchSampler
from fastload._types import PackedBatch

SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def mixtures(draw: st.DrawFn) -> dict[str, Any]:
    sources = draw(st.integers(1, 4))
    seq_len = draw(st.integers(4, 64))
    # Every source has a token to give (a source of empty samples only is refused, with weight).
    parts = [
        [draw(st.integers(1, 150)), *draw(st.lists(st.integers(0, 150), max_size=60))] for _ in range(sources)
    ]
    weights = [draw(st.integers(1, 5)) for _ in range(sources)]
    later = [draw(st.integers(0, 5)) for _ in range(sources)]
    if not any(later):
        later[0] = 1
    return {
        "parts": parts,
        "proportions": [(0, weights), (draw(st.integers(1, 6)), later)],
        "pack_length": seq_len,
        "batch_size": draw(st.integers(1, 4)),
        "oversize": draw(st.sampled_from(["split", "truncate"])),
        "share": draw(st.sampled_from(["tokens", "samples"])),
        "drop_last": False,
        "seed": draw(st.integers(0, 2**16)),
    }


def build(setup: dict[str, Any], replicas: int = 1, rank: int = 0) -> MixtureBatchSampler:
    options = {k: v for k, v in setup.items() if k != "parts"}
    parts = [np.array(part, dtype=np.int64) for part in setup["parts"]]
    return MixtureBatchSampler(parts, exhausted="renormalize", num_replicas=replicas, rank=rank, **options)


def tokens_of(batches: list[PackedBatch]) -> Counter[tuple[int, int]]:
    return Counter(
        (sample, t)
        for batch in batches
        for row in batch
        for sample, start, stop in row
        for t in range(start, stop)
    )


@SETTINGS
@given(mixtures(), st.integers(1, 3))
def test_rows_fit_and_ranks_get_equal_full_shape_batches(setup: dict[str, Any], replicas: int) -> None:
    ranks = [list(build(setup, replicas, r)) for r in range(replicas)]
    assert len({len(batches) for batches in ranks}) == 1
    for batches in ranks:
        for batch in batches:
            assert batch.rows == setup["batch_size"]
            for row in batch:
                assert sum(stop - start for _, start, stop in row) <= setup["pack_length"]
    seen = tokens_of([b for batches in ranks for b in batches])
    assert max(seen.values(), default=1) == 1  # nothing twice
    assert [list(b.encode()) for b in ranks[0]] == [list(b.encode()) for b in build(setup, replicas, 0)]


@SETTINGS
@given(mixtures(), st.integers(1, 4), st.integers(1, 4), st.integers(0, 8))
def test_a_resize_at_any_point_keeps_every_token_at_most_once(
    setup: dict[str, Any], before: int, after: int, stop: int
) -> None:
    whole = tokens_of([b for r in range(before) for b in build(setup, before, r)])
    ranks = [build(setup, before, r) for r in range(before)]
    streams = [iter(s) for s in ranks]
    count = min(stop, len(ranks[0]))
    delivered = [next(it) for _ in range(count) for it in streams]
    state = json.loads(json.dumps(ranks[0].state_dict()))
    rest = []
    for r in range(after):
        resumed = build(setup, after, r)
        resumed.load_state_dict(state)
        rest += list(resumed)
    assert tokens_of(delivered + rest) == whole
