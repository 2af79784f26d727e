"""Forked workers do not drag the parent's heap through their garbage collector.

The pool forks each worker with the parent's objects in the collector's permanent generation
(``gc.freeze``), then hands them back to the parent. In the worker they stay frozen: a full
collection there walks only the worker's own objects, instead of writing to (and so copying) every
page of the parent's heap.
"""

from __future__ import annotations

import gc
import multiprocessing
from typing import Any

import pytest
import torch

import fastload


class Report(torch.utils.data.Dataset):
    """Sample i is what worker i sees of the collector: its frozen count, and how many objects
    a full collection there examined besides those."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> tuple[int, int]:
        gc.collect()
        return gc.get_freeze_count(), len(gc.get_objects())


def _tracked(obj: object) -> bool:
    """Whether the collector walks ``obj`` here (frozen objects are not among ``get_objects``)."""
    return any(o is obj for o in gc.get_objects())


def _reports(**kwargs: Any) -> list[tuple[int, int]]:
    loader = fastload.DataLoader(Report(), batch_size=None, num_workers=2, **kwargs)
    return [(int(a), int(b)) for a, b in loader]


@pytest.fixture
def big_parent_heap() -> Any:
    heap = [[i] for i in range(200_000)]  # tracked objects (lists) the workers must not walk
    yield heap
    del heap


def test_workers_keep_the_parents_objects_frozen_and_the_parent_gets_them_back(big_parent_heap: Any) -> None:
    assert gc.get_freeze_count() == 0
    reports = _reports()
    assert gc.get_freeze_count() == 0 and _tracked(big_parent_heap[-1])  # the parent's is as it was
    for frozen, walked in reports:
        assert frozen >= len(big_parent_heap)  # the parent's heap is frozen in the worker
        assert walked < frozen  # and not among the objects a collection there walks


def test_a_parent_that_froze_objects_itself_is_left_alone(big_parent_heap: Any) -> None:
    gc.freeze()
    try:
        assert not _tracked(big_parent_heap[-1])
        _reports()
        assert not _tracked(big_parent_heap[-1])  # still frozen: the loader did not unfreeze it
        assert gc.get_freeze_count() >= len(big_parent_heap)
    finally:
        gc.unfreeze()


def test_spawned_workers_start_from_a_fresh_heap() -> None:
    reports = _reports(multiprocessing_context=multiprocessing.get_context("spawn"))
    assert gc.get_freeze_count() == 0
    assert all(frozen == 0 for frozen, _ in reports)  # nothing inherited, nothing frozen
