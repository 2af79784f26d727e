"""Numpy kernels on columns: gathering ragged rows, reordering, concatenating and splitting.

Every reader funnels its reads through these, so the hot path has one implementation to tune.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from fastload._types import Column, Field, Ragged

# Mean bytes per sample from which copying one slice per sample beats building a flat element
# index. Measured on 2 cores (random rows of a memory-mapped array, 64 and 4096 samples): at ~11
# int32 elements per sample the flat index wins 3x; at ~200 uint16 elements (400 bytes) slices
# already take 88 us per batch of 64 against 131 us, and the gap widens with length since each
# slice is a plain memcpy.
_SLICE_COPY_MIN_BYTES = 128


def ragged_gather(
    values: np.ndarray, starts: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64]
) -> np.ndarray:
    """Concatenate ``values[starts[i] : starts[i] + lengths[i]]`` over ``i`` along axis 0.

    ``values`` may be a read-only memory map; the result is always a new, writable array of
    ``lengths.sum()`` rows. ``lengths`` must be non-negative and each range must lie inside
    ``values`` (the readers validate offsets before they get here).
    """
    total = int(lengths.sum())
    if total == 0 or len(starts) == 0:
        return np.empty((0, *values.shape[1:]), values.dtype)
    row_bytes = values.itemsize * math.prod(values.shape[1:])
    if total * row_bytes < _SLICE_COPY_MIN_BYTES * len(starts):
        first = np.cumsum(lengths) - lengths
        flat = np.repeat(starts - first, lengths)
        flat += np.arange(total, dtype=np.int64)
        return np.take(values, flat, axis=0)
    if not values.flags.c_contiguous:
        ends = (starts + lengths).tolist()
        pieces = [values[s:e] for s, e in zip(starts.tolist(), ends, strict=True)]
        return np.concatenate(pieces, axis=0)
    # Join slices of a memoryview: a third faster than slicing the array and calling
    # np.concatenate (64 samples of ~200 int32), since a memoryview slice is a lighter object.
    # A 1-D view slices by element; rows of more dimensions are sliced as bytes.
    if values.ndim == 1:
        raw, first, last = values.data, starts, starts + lengths
    else:
        raw, first, last = values.data.cast("B"), starts * row_bytes, (starts + lengths) * row_bytes
    views = [raw[s:e] for s, e in zip(first.tolist(), last.tolist(), strict=True)]
    joined = np.frombuffer(bytearray().join(views), values.dtype)
    return joined if values.ndim == 1 else joined.reshape(total, *values.shape[1:])


def group_positions(
    keys: npt.NDArray[np.integer[Any]],
) -> tuple[npt.NDArray[np.intp], list[npt.NDArray[np.intp]]]:
    """Positions of ``keys`` grouped by key: ``order`` (a stable sort of the positions by key)
    and the groups, consecutive pieces of ``order`` sharing one key, in key order."""
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    cuts = np.flatnonzero(sorted_keys[1:] != sorted_keys[:-1]) + 1
    return order, np.split(order, cuts)


def inverse_permutation(order: npt.NDArray[np.intp]) -> npt.NDArray[np.intp]:
    """The permutation that undoes ``order``."""
    inverse = np.empty_like(order)
    inverse[order] = np.arange(order.size)
    return inverse


def permute_column(column: Column, order: npt.NDArray[np.int64]) -> Column:
    """The samples of ``column`` in the order ``order`` gives (a permutation or any selection)."""
    if isinstance(column, Ragged):
        ends = np.cumsum(column.lengths)
        starts = ends - column.lengths
        lengths = column.lengths[order]
        return Ragged(ragged_gather(column.values, starts[order], lengths), lengths)
    if isinstance(column, np.ndarray):
        return column[order]
    return [column[i] for i in order.tolist()]


def concat_columns(parts: list[Column]) -> Column:
    """The samples of ``parts`` back to back; all parts must be of one field."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if isinstance(first, Ragged):
        ragged = [p for p in parts if isinstance(p, Ragged)]
        return Ragged(
            np.concatenate([p.values for p in ragged], axis=0),
            np.concatenate([p.lengths for p in ragged]),
        )
    if isinstance(first, np.ndarray):
        return np.concatenate(parts, axis=0)
    return [item for part in parts for item in part]


def empty_column(field: Field) -> Column:
    """A column of zero samples of ``field``."""
    if field.kind == "ragged":
        return Ragged(np.empty((0, *field.shape), field.dtype), np.empty(0, np.int64))
    if field.kind == "fixed":
        return np.empty((0, *field.shape), field.dtype)
    return []


def split_column(column: Column) -> list[Any]:
    """One value per sample: an array (a view into ``column``) for ragged fields, a row or a numpy
    scalar for fixed fields, the object itself for object fields."""
    if isinstance(column, Ragged):
        if len(column.lengths) == 0:
            return []
        return np.split(column.values, np.cumsum(column.lengths[:-1]))
    if isinstance(column, np.ndarray):
        return list(column)
    return list(column)
