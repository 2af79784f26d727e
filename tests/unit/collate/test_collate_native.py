"""The native padding kernel against the numpy kernels: the same bytes for every dtype pair,
side, truncation, element shape and mask dtype; its own bounds checks; where it steps aside."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from fastload._collate import _kernels as kernels
from fastload._collate._kernels import NATIVE_TYPES, pad_into

INTEGERS = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64]
FLOATS = [np.float32, np.float64]


@pytest.fixture(autouse=True)
def padding_kernel() -> str:
    """This module calls both kernels itself."""
    if kernels._native is None:
        pytest.fail("fastload._collate._native was not built (pip install -e . needs a C compiler)")
    return "both"


def _pairs() -> list[tuple[Any, Any]]:
    """Every (stored, output) pair PadCollate allows (same kind), bool to bool included."""
    pairs = [(np.bool_, np.bool_), (np.bool_, np.uint8)]
    for a, b in itertools.product(INTEGERS + FLOATS, repeat=2):
        if np.can_cast(a, b, casting="same_kind"):
            pairs.append((a, b))
    return pairs


def _case(rng: np.random.Generator, source_dtype: Any, elem: tuple[int, ...], spans: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    lengths = rng.integers(0, 30, 13).astype(np.int64)
    lengths[3] = 30  # the widest row
    if np.dtype(source_dtype) == np.bool_:
        source = rng.integers(0, 2, (2_000, *elem)).astype(np.bool_)
    else:
        source = rng.integers(0, 100, (2_000, *elem)).astype(source_dtype)
    if not spans:
        return source[: int(lengths.sum())], lengths, None
    # Anywhere in the source, right up to both of its ends.
    starts = rng.integers(0, len(source) - 30, len(lengths)).astype(np.int64)
    starts[0], lengths[0] = len(source) - 7, 7
    starts[1] = 0
    return source, lengths, starts


def _run(native: bool, monkeypatch: pytest.MonkeyPatch, *args: Any, **kwargs: Any) -> None:
    with monkeypatch.context() as patch:
        if not native:
            patch.setattr(kernels, "_native", None)
        pad_into(*args, **kwargs)


@pytest.mark.parametrize(("source_dtype", "out_dtype"), _pairs())
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("spans", [True, False])
def test_every_dtype_pair_pads_to_the_same_bytes_as_numpy(
    source_dtype: Any, out_dtype: Any, side: str, spans: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(abs(hash((np.dtype(source_dtype).str, np.dtype(out_dtype).str, side, spans))) % 2**32)
    source, lengths, starts = _case(rng, source_dtype, (), spans)
    kept = np.minimum(lengths, 25)  # truncation: rows keep their first 25 elements
    width = int(kept.max()) + 3  # pad_to_multiple_of leaves columns beyond the longest row
    pad = 1 if np.dtype(out_dtype) == np.bool_ else 7
    outs = []
    for native in (True, False):
        out = np.full((len(lengths), width), 55, out_dtype)
        mask = np.full((len(lengths), width), 9, np.int64)
        _run(native, monkeypatch, source, lengths, kept, out, pad_value=pad, left=side == "left", mask_out=mask, starts=starts)
        outs.append((out, mask))
    assert np.array_equal(outs[0][0], outs[1][0])
    assert np.array_equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("mask_dtype", [np.bool_, np.uint8, np.int32, np.int64, np.float32, np.float64, None])
@pytest.mark.parametrize("elem", [(), (3,), (2, 2)])
@pytest.mark.parametrize("pad", [0, -3])
def test_element_shapes_pad_values_and_mask_dtypes_match_numpy(
    mask_dtype: Any, elem: tuple[int, ...], pad: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(7)
    source, lengths, starts = _case(rng, np.int32, elem, spans=True)
    width = int(lengths.max())
    outs = []
    for native in (True, False):
        out = np.full((len(lengths), width, *elem), 55, np.int64)
        mask = None if mask_dtype is None else np.full((len(lengths), width), 9, mask_dtype)
        _run(native, monkeypatch, source, lengths, lengths, out, pad_value=pad, left=False, mask_out=mask, starts=starts)
        outs.append((out, mask))
    assert np.array_equal(outs[0][0], outs[1][0])
    if mask_dtype is not None:
        assert outs[0][1] is not None and outs[1][1] is not None
        assert np.array_equal(outs[0][1], outs[1][1])


def test_float_padding_with_a_non_zero_pad_value_and_nans_in_the_source(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(8)
    source = rng.standard_normal(500).astype(np.float32)
    source[::3] = np.nan
    lengths = rng.integers(1, 20, 9).astype(np.int64)
    starts = rng.integers(0, 480, 9).astype(np.int64)
    out = np.zeros((9, 20), np.float32)
    pad_into(source, lengths, lengths, out, pad_value=-1.5, left=True, mask_out=None, starts=starts)
    for row, (s, n) in enumerate(zip(starts.tolist(), lengths.tolist(), strict=True)):
        assert np.array_equal(out[row, 20 - n :], source[s : s + n], equal_nan=True)
        assert (out[row, : 20 - n] == -1.5).all()


def test_a_strided_source_or_output_is_left_to_numpy_and_still_correct(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bool] = []
    native = kernels._native_rows
    monkeypatch.setattr(kernels, "_native_rows", lambda *a, **k: calls.append(native(*a, **k)) or calls[-1])
    source = np.arange(400, dtype=np.int32)[::2]  # not contiguous
    lengths = np.array([3, 5], np.int64)
    out = np.full((2, 5), 9, np.int64)
    pad_into(source, lengths, lengths, out, pad_value=0, left=False, mask_out=None, starts=np.array([10, 20]))
    assert calls == [False]
    assert out.tolist() == [[20, 22, 24, 0, 0], [40, 42, 44, 46, 48]]


def test_dtypes_it_does_not_know_are_left_to_numpy() -> None:
    assert np.dtype(np.float16) not in NATIVE_TYPES
    assert np.dtype(">i4") not in NATIVE_TYPES  # byte-swapped
    source = np.arange(6, dtype=np.float16)
    out = np.full((2, 4), 9, np.float16)
    pad_into(source, np.array([4, 2]), np.array([4, 2]), out, pad_value=0, left=False, mask_out=None)
    assert out.tolist() == [[0, 1, 2, 3], [4, 5, 0, 0]]


def test_a_row_that_does_not_fit_the_source_raises_and_writes_nothing() -> None:
    native = kernels._native
    assert native is not None
    source = np.arange(100, dtype=np.uint16)
    out = np.full((2, 10), 7, np.int64)
    starts = np.array([0, 95], np.int64)
    kept = np.array([4, 8], np.int64)  # row 1 would read past the end
    code = NATIVE_TYPES
    with pytest.raises(ValueError, match=r"row 1: 8 elements from element 95 do not fit \(source holds 100"):
        native.pad_rows(source, code[source.dtype], starts, kept, out, code[out.dtype], 10, 1, 0, 0.0, False, None, 0)
    assert (out == 7).all()
    with pytest.raises(ValueError, match="out is smaller"):
        small = np.zeros((1, 2), np.int64)
        native.pad_rows(source, code[source.dtype], starts[:1], kept[:1], small, code[out.dtype], 10, 1, 0, 0.0, False, None, 0)
    with pytest.raises(ValueError, match="rows are 3 wide"):
        native.pad_rows(source, code[source.dtype], starts[:1], kept[:1], out, code[out.dtype], 3, 1, 0, 0.0, False, None, 0)
