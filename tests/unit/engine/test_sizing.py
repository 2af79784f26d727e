"""Slot sizing from the batches that come (``_engine/_sizing.py``): pure rules, no processes."""

from __future__ import annotations

import numpy as np
import pytest

import fastload
from fastload._engine._sizing import HEADROOM, OUTLIERS, WINDOW, BatchBytes, SlotSizing, batch_bytes
from fastload._types import Field


def test_the_first_batch_sizes_the_slots_with_headroom() -> None:
    sizing = SlotSizing()
    assert sizing.observe(1000) == sizing.capacity >= 1000 * HEADROOM
    assert sizing.observe(1100) is None  # fits


def test_a_lone_outlier_gets_a_temporary_slot_and_repeated_ones_grow_the_slots() -> None:
    sizing = SlotSizing()
    sizing.observe(1000)
    capacity = sizing.capacity
    assert sizing.observe(5000) is None  # one outlier: the caller gives it a temporary slot
    for _ in range(WINDOW):
        assert sizing.observe(900) is None
    assert sizing.observe(6000) is None  # the first outlier left the window: lone again
    grown = sizing.observe(6000)  # OUTLIERS within a window
    assert OUTLIERS == 2 and grown is not None and grown >= 6000 * HEADROOM > capacity


def test_batch_bytes_bound_the_collates_layout_from_above_within_a_length_step() -> None:
    fields = {"tokens": Field("tokens", "ragged", np.dtype(np.uint16))}
    lengths = np.array([5, 17, 300, 1, 64, 1000], dtype=np.int64)
    collate = fastload.PadCollate()
    estimate = BatchBytes(collate, fields, lengths)
    for rows in ([0, 1], [2, 3, 4], [5], [1, 1, 1, 1]):
        raw = np.array(rows, dtype=np.int64).tobytes()
        exact = batch_bytes(collate, fields, len(rows), int(lengths[rows].max()))
        got = estimate(raw)
        assert got is not None and exact <= got <= 1.2 * exact + 4096


@pytest.mark.parametrize("rows", [[], [6], [-7]])
def test_indices_the_lengths_cannot_answer_for_leave_the_answer_to_the_worker(rows: list[int]) -> None:
    fields = {"tokens": Field("tokens", "ragged", np.dtype(np.uint16))}
    estimate = BatchBytes(fastload.PadCollate(), fields, np.arange(1, 7, dtype=np.int64))
    assert estimate(np.array(rows, dtype=np.int64).tobytes()) is None
