"""Padding straight from samples left in place (``Spans``): the numpy window kernel.

A reader whose values are memory-mapped gives the fast path ``Spans(source, starts, lengths)``
instead of a concatenated copy. Whatever kernel runs (window, or its per-row fallback for rows
whose window would leave ``source``), the output must equal padding the concatenated samples.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from fastload import PadCollate
from fastload._collate import _kernels as kernels
from fastload._collate._kernels import ROW_COPY_MIN_BYTES, pad_into
from fastload._types import Ragged, Spans


@pytest.fixture(autouse=True)
def padding_kernel(monkeypatch: pytest.MonkeyPatch) -> str:
    """These tests are about the numpy kernels: the native one stays out of the way."""
    monkeypatch.setattr(kernels, "_native", None)
    return "numpy"


def _layout(rng: np.random.Generator, count: int, low: int, high: int, total: int) -> tuple[np.ndarray, np.ndarray]:
    lengths = rng.integers(low, high, count).astype(np.int64)
    # Away from both ends of the source, so that every window lies inside it.
    starts = rng.integers(min(high, total // 3), max(high + 1, total - high), count).astype(np.int64)
    return starts, lengths


def _both(source: np.ndarray, starts: np.ndarray, lengths: np.ndarray, collate: PadCollate) -> tuple[dict[str, Any], dict[str, Any]]:
    """The collate's output from Spans and from the same samples concatenated."""
    spans = {"ids": Spans(source, starts, lengths)}
    values = np.concatenate([source[s : s + n] for s, n in zip(starts.tolist(), lengths.tolist(), strict=True)])
    ragged = {"ids": Ragged(values, lengths)}
    layout = collate.layout(spans)
    assert layout == collate.layout(ragged)
    out_spans = {name: np.full(shape, 77, dtype) for name, (shape, dtype) in layout.items()}
    out_ragged = {name: np.full(shape, 55, dtype) for name, (shape, dtype) in layout.items()}
    collate.collate_into(spans, out_spans)
    collate.collate_into(ragged, out_ragged)
    return out_spans, out_ragged


def _assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert np.array_equal(a[name], b[name], equal_nan=a[name].dtype.kind == "f"), name


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("max_length", [None, 9])
@pytest.mark.parametrize("pad_value", [0, -3])
def test_spans_pad_exactly_like_the_concatenated_samples(
    side: str, max_length: int | None, pad_value: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(1)
    source = rng.integers(1, 30_000, 5_000).astype(np.uint16)
    starts, lengths = _layout(rng, 32, 0, 40, len(source))
    collate = PadCollate(
        dtype=torch.int64, mask_dtype=torch.bool, padding_side=side, max_length=max_length, pad_value=pad_value
    )
    took: list[bool] = []
    window = kernels._window_rows
    monkeypatch.setattr(kernels, "_window_rows", lambda *a, **k: took.append(window(*a, **k)) or took[-1])
    _assert_same(*_both(source, starts, lengths, collate))
    assert took == [True]  # the window kernel wrote it, not the fallback


def test_float_spans_next_to_nans_pad_with_the_pad_value_not_nan() -> None:
    # The window reads past each sample into its neighbours; a multiply by the mask would turn a
    # neighbour's NaN into NaN padding.
    rng = np.random.default_rng(2)
    source = rng.standard_normal(3_000).astype(np.float32)
    source[::5] = np.nan
    starts, lengths = _layout(rng, 20, 1, 30, len(source))
    lengths[:] = np.minimum(lengths, 4)  # short rows whose windows cover NaNs beyond them
    lengths[0] = 30
    spans, ragged = _both(source, starts, lengths, PadCollate(dtype=torch.float32))
    _assert_same(spans, ragged)
    width = spans["ids"].shape[1]
    padding = np.arange(width)[None, :] >= lengths[:, None]
    assert (spans["ids"][padding] == 0).all()


def test_spans_with_element_shapes_pad_whole_elements() -> None:
    rng = np.random.default_rng(3)
    source = rng.integers(0, 100, (2_000, 3)).astype(np.int32)
    starts, lengths = _layout(rng, 16, 0, 25, len(source))
    _assert_same(*_both(source, starts, lengths, PadCollate(dtype=torch.int64, ragged=["ids"])))


@pytest.mark.parametrize("side", ["right", "left"])
def test_rows_whose_window_would_leave_the_source_fall_back_to_row_copies(side: str) -> None:
    source = np.arange(1, 101, dtype=np.uint16)
    # The last sample ends the source (right padding reads past its end); the first starts it
    # (left padding reads before its start); the long row sets a window wider than both.
    starts = np.array([95, 0, 40], dtype=np.int64)
    lengths = np.array([5, 3, 30], dtype=np.int64)
    collate = PadCollate(dtype=torch.int64, padding_side=side, pad_value=-1)
    _assert_same(*_both(source, starts, lengths, collate))
    tiny = np.arange(1, 4, dtype=np.uint16)  # a source shorter than the padded width
    _assert_same(*_both(tiny, np.array([0, 1]), np.array([3, 2]), collate))


def test_wide_rows_take_the_row_copy_kernel_from_the_source() -> None:
    rng = np.random.default_rng(4)
    wide = ROW_COPY_MIN_BYTES // 8 + 100
    source = rng.integers(0, 30_000, 20 * wide).astype(np.int32)
    starts, lengths = _layout(rng, 6, wide - 50, wide, len(source))
    _assert_same(*_both(source, starts, lengths, PadCollate(dtype=torch.int64)))


def test_the_window_kernel_writes_every_element_of_its_output() -> None:
    # Output slots are reused: stale bytes must never survive as padding or mask.
    rng = np.random.default_rng(5)
    source = rng.integers(1, 1_000, 4_000).astype(np.int64)
    starts, lengths = _layout(rng, 8, 1, 50, len(source))
    width = int(lengths.max())
    out = np.full((8, width), 12345, np.int64)
    mask = np.full((8, width), True)
    pad_into(source, lengths, lengths, out, pad_value=0, left=False, mask_out=mask, starts=starts)
    expected = np.zeros((8, width), np.int64)
    for row, (s, n) in enumerate(zip(starts.tolist(), lengths.tolist(), strict=True)):
        expected[row, :n] = source[s : s + n]
    assert np.array_equal(out, expected)
    assert np.array_equal(mask, np.arange(width)[None, :] < lengths[:, None])


@pytest.mark.parametrize(
    ("source_dtype", "out_dtype"),
    [(np.uint16, np.int64), (np.int32, np.int32), (np.int64, np.int16), (np.bool_, np.uint8), (np.uint8, np.float32)],
)
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("side", ["right", "left"])
def test_the_window_kernel_masks_in_either_dtype_and_any_source_layout(
    source_dtype: Any, out_dtype: Any, contiguous: bool, side: str
) -> None:
    # The zero padding is applied in the narrower of the two dtypes (or the output's, when they
    # match); a strided source takes the slower view constructor. All must give the same bytes.
    rng = np.random.default_rng(6)
    base = rng.integers(1, 120, 6_000).astype(source_dtype)
    source = base if contiguous else base[::2]
    starts, lengths = _layout(rng, 12, 1, 40, len(source))
    left = side == "left"
    width = int(lengths.max())
    out = np.full((12, width), 99, out_dtype)
    mask = np.zeros((12, width), np.bool_)
    pad_into(source, lengths, lengths, out, pad_value=0, left=left, mask_out=mask, starts=starts)
    expected = np.zeros((12, width), out_dtype)
    for row, (start, count) in enumerate(zip(starts.tolist(), lengths.tolist(), strict=True)):
        cols = slice(width - count, width) if left else slice(0, count)
        expected[row, cols] = source[start : start + count]
        assert mask[row, cols].all() and mask[row].sum() == count
    assert np.array_equal(out, expected)
