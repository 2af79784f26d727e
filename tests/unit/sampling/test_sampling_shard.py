"""Dealing global batches to ranks: equal counts, padding and dropping, the elastic cursor."""

from __future__ import annotations

import pytest

from fastload._sampling._ranks import Cursor, per_rank_count, rank_positions


def deal(num_batches: int, cursor: Cursor, *, drop_last: bool) -> list[list[int]]:
    return [
        rank_positions(num_batches, cursor, rank, drop_last=drop_last).tolist()
        for rank in range(cursor.replicas)
    ]


def test_batches_go_round_robin_and_the_tail_is_padded_from_the_start() -> None:
    assert deal(10, Cursor.fresh(0, 4), drop_last=False) == [
        [0, 4, 8],
        [1, 5, 9],
        [2, 6, 0],
        [3, 7, 1],
    ]


def test_drop_last_drops_the_tail_instead() -> None:
    assert deal(10, Cursor.fresh(0, 4), drop_last=True) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_fewer_batches_than_ranks_still_gives_every_rank_one() -> None:
    assert deal(1, Cursor.fresh(0, 3), drop_last=False) == [[0], [0], [0]]
    assert deal(1, Cursor.fresh(0, 3), drop_last=True) == [[], [], []]
    assert deal(0, Cursor.fresh(0, 3), drop_last=False) == [[], [], []]


@pytest.mark.parametrize("drop_last", [False, True])
def test_counts_are_equal_on_every_rank(drop_last: bool) -> None:
    for num_batches in range(0, 30):
        for replicas in range(1, 7):
            counts = {
                len(p) for p in deal(num_batches, Cursor.fresh(0, replicas), drop_last=drop_last)
            }
            assert counts == {per_rank_count(num_batches, 0, replicas, drop_last=drop_last)}


def test_a_consumed_cursor_continues_the_same_deal() -> None:
    full = deal(10, Cursor.fresh(0, 4), drop_last=False)
    resumed = deal(10, Cursor.fresh(0, 4).advanced(2), drop_last=False)
    assert resumed == [positions[2:] for positions in full]


def test_redealing_on_another_world_size_starts_at_the_first_unconsumed_batch() -> None:
    cursor = Cursor.fresh(3, 4).advanced(2)  # batches 0..7 consumed by 4 ranks
    moved = cursor.redealt(num_batches=20, replicas=3)
    assert (moved.epoch, moved.plan_replicas, moved.start, moved.replicas, moved.consumed) == (
        3,
        4,
        8,
        3,
        0,
    )
    rest = deal(20, moved, drop_last=False)
    assert sorted(p for positions in rest for p in positions) == list(range(8, 20))
    assert cursor.redealt(num_batches=20, replicas=4) is cursor


def test_redealing_after_the_padding_was_consumed_leaves_nothing() -> None:
    cursor = Cursor.fresh(0, 4).advanced(3)  # 12 positions consumed of 10 batches + 2 padding
    moved = cursor.redealt(num_batches=10, replicas=2)
    assert moved.start == 10
    assert deal(10, moved, drop_last=False) == [[], []]
