"""The device prefetcher's one-ahead order, which does not depend on the device.

``OneAhead`` stages batch N+1 (on a GPU: starts its copy) before handing out batch N. A batch that
fails must raise in its own turn, after the batches before it, and the ones after it must still
come: a generator would end at the first error and lose the batch already staged.
"""

from __future__ import annotations

from typing import Any

import pytest

from fastload._device._prefetch import DevicePrefetcher, OneAhead


class Batches:
    """Items 0..n-1, raising ValueError instead of the items in ``bad`` (and going on after)."""

    def __init__(self, n: int, bad: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        self.n, self.bad, self.i, self.taken = n, bad, 0, 0

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> int:
        if self.i >= self.n:
            raise StopIteration
        i, self.i = self.i, self.i + 1
        self.taken += 1
        if i in self.bad:
            raise ValueError(f"batch {i} failed")
        return i


def drain(it: Any) -> list[Any]:
    """Every item, with errors recorded in place, until StopIteration."""
    got: list[Any] = []
    while True:
        try:
            got.append(next(it))
        except StopIteration:
            return got
        except ValueError as exc:
            got.append(str(exc))


def test_each_item_is_staged_one_ahead_of_its_hand_out() -> None:
    source = Batches(4)
    log: list[str] = []
    ended: list[bool] = []
    it = OneAhead(
        source,
        lambda x: log.append(f"stage {x}") or x,
        lambda x: log.append(f"out {x}") or x,
        lambda: ended.append(True),
    )
    assert next(it) == 0
    assert log == ["stage 0", "stage 1", "out 0"]  # batch 1's copy starts before batch 0 is used
    assert drain(it) == [1, 2, 3]
    assert log == ["stage 0", "stage 1", "out 0", "stage 2", "out 1", "stage 3", "out 2", "out 3"]
    assert ended == [True]  # once, when the consumer asked past the last item
    with pytest.raises(StopIteration):
        next(it)
    assert ended == [True] and source.taken == 4


@pytest.mark.parametrize("bad", [{0}, {2}, {4}, {1, 2}, {0, 1, 2, 3, 4}])
def test_a_failed_item_raises_in_its_turn_and_the_rest_still_come(bad: set[int]) -> None:
    it = OneAhead(Batches(5, bad), lambda x: x * 10, lambda x: x + 1)
    expected = [f"batch {i} failed" if i in bad else i * 10 + 1 for i in range(5)]
    assert drain(it) == expected


def test_a_stage_that_raises_is_that_items_error() -> None:
    def stage(x: int) -> int:
        if x == 1:
            raise ValueError("copy of batch 1 failed")
        return x

    assert drain(OneAhead(Batches(3), stage, lambda x: x)) == [0, "copy of batch 1 failed", 2]


def test_an_empty_source_ends_at_once_and_still_calls_on_end() -> None:
    ended: list[bool] = []
    it = OneAhead(Batches(0), lambda x: x, lambda x: x, lambda: ended.append(True))
    assert drain(it) == [] and ended == [True]


def test_without_a_cuda_device_the_prefetcher_passes_batches_and_errors_through() -> None:
    prefetcher = DevicePrefetcher(Batches(4, {2}), device=None)
    assert drain(iter(prefetcher)) == [0, 1, "batch 2 failed", 3]
