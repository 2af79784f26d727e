"""The fast path for Arrow IPC: numeric fields read straight from the file's memory map.

In an uncompressed IPC file or stream every buffer of every record batch lies in the file, so
one typed numpy view of the whole mapping addresses them all: a batch's element ``j`` of a
field is element ``first[batch] + j * per_item`` of that view. Reading any rows, spread over any
number of record batches, is then a single vectorized gather, with no per-batch loop and no
Arrow call. List offsets are read the same way.

A field qualifies when it is numeric (not bool: Arrow packs bools into bits), has no nulls, and
all its buffers lie in the mapping at offsets aligned to their item size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from fastload._formats._arrow_convert import null_rows
from fastload._formats._arrow_schema import ArrowField, storage_array
from fastload._formats._columns import ragged_gather
from fastload._formats._readahead import ByteRanges
from fastload._types import Column, Ragged

ViewOf = Callable[[np.dtype], np.ndarray]


class MappedColumn:
    """One field of one memory-mapped shard; see the module docstring."""

    def __init__(
        self,
        spec: ArrowField,
        segment_starts: npt.NDArray[np.int64],
        segment_rows: npt.NDArray[np.int64],
        values: np.ndarray,
        first: npt.NDArray[np.int64],
        per_item: int,
        offsets: np.ndarray | None = None,
        offsets_first: npt.NDArray[np.int64] | None = None,
    ) -> None:
        self._field = spec.field
        self._segment_starts = segment_starts
        self._segment_rows = segment_rows
        self._values = values
        self._first = first
        self._per_item = per_item
        self._offsets = offsets
        self._offsets_first = offsets_first
        # Per record batch, what to add to a shard row to get its position in the mapping, so
        # that a read needs one lookup per row instead of a subtraction and a lookup.
        self._row_shift = first - segment_starts * per_item
        self._offsets_shift = None if offsets_first is None else offsets_first - segment_starts

    def read(self, rows: npt.NDArray[np.int64]) -> Column:
        if len(self._segment_starts) == 1:
            segment: npt.NDArray[np.intp] | int = 0
        else:
            segment = np.searchsorted(self._segment_starts, rows, side="right") - 1
        if self._offsets is None or self._offsets_shift is None:
            positions = self._row_shift[segment] + rows * self._per_item
            if self._per_item == 1:
                return self._values[positions]
            counts = np.full(len(rows), self._per_item, np.int64)
            values = ragged_gather(self._values, positions, counts)
            return values.reshape(len(rows), *self._field.shape)
        at = self._offsets_shift[segment] + rows
        starts = self._offsets[at].astype(np.int64)  # int32 for list: widen before scaling
        lengths = self._offsets[at + 1] - starts
        positions = self._first[segment] + starts * self._per_item
        values = ragged_gather(self._values, positions, lengths * self._per_item)
        return Ragged(values.reshape(-1, *self._field.shape), lengths)

    def byte_ranges(self, rows: npt.NDArray[np.int64]) -> ByteRanges:
        """Where the values of ``rows`` lie in the file (the mapping starts at its byte 0;
        list offsets are read to find them)."""
        if len(self._segment_starts) == 1:
            segment: npt.NDArray[np.intp] | int = 0
        else:
            segment = np.searchsorted(self._segment_starts, rows, side="right") - 1
        item_bytes = self._values.itemsize * self._per_item
        if self._offsets is None or self._offsets_shift is None:
            positions = self._row_shift[segment] + rows * self._per_item
            return positions * self._values.itemsize, np.full(len(rows), item_bytes, np.int64)
        at = self._offsets_shift[segment] + rows
        starts = self._offsets[at].astype(np.int64)
        lengths = self._offsets[at + 1] - starts
        positions = self._first[segment] + starts * self._per_item
        return positions * self._values.itemsize, lengths.astype(np.int64) * item_bytes

    def lengths(self) -> npt.NDArray[np.int64]:
        assert self._offsets is not None and self._offsets_first is not None
        parts = [
            np.diff(self._offsets[first : first + count + 1].astype(np.int64))
            for first, count in zip(
                self._offsets_first.tolist(), self._segment_rows.tolist(), strict=True
            )
        ]
        return np.concatenate(parts) if parts else np.empty(0, np.int64)


def build_mapped(
    spec: ArrowField,
    arrays: Sequence[pa.Array],
    segment_starts: npt.NDArray[np.int64],
    file: pa.Buffer,
    view_of: ViewOf,
) -> MappedColumn | None:
    """A :class:`MappedColumn` for the field whose array in record batch ``s`` is
    ``arrays[s]``, or ``None`` if the field does not qualify (see the module docstring).
    ``view_of(dtype)`` is the whole mapping ``file`` viewed as ``dtype``."""
    if spec.field.kind == "object" or spec.field.dtype.kind not in "iuf":
        return None
    ragged = spec.field.kind == "ragged"
    first = np.zeros(len(arrays), np.int64)
    offsets_first = np.zeros(len(arrays), np.int64)
    per_item = 1
    offsets_dtype: np.dtype | None = None
    for s, raw in enumerate(arrays):
        array = storage_array(raw)
        if len(array) == 0:
            continue
        if null_rows(array) is not None:
            return None
        if ragged:
            offsets_dtype = np.dtype(np.int64 if pa.types.is_large_list(array.type) else np.int32)
            at = _element_index(array.buffers()[1], offsets_dtype, file)
            if at is None:
                return None
            offsets_first[s] = at + array.offset
            array = storage_array(array.values)
            leaf_first, per_item = _leaf_position(array, array.offset)
        else:
            leaf_first, per_item = _leaf_position(array, array.offset)
        leaf = _leaf(array)
        at = _element_index(leaf.buffers()[1], spec.field.dtype, file)
        if at is None:
            return None
        first[s] = at + leaf_first
    rows = np.array([len(a) for a in arrays], np.int64)
    values = view_of(spec.field.dtype)
    if not ragged:
        return MappedColumn(spec, segment_starts, rows, values, first, per_item)
    offsets = view_of(offsets_dtype if offsets_dtype is not None else np.dtype(np.int32))
    return MappedColumn(spec, segment_starts, rows, values, first, per_item, offsets, offsets_first)


def _leaf_position(array: pa.Array, first: int) -> tuple[int, int]:
    """For an array of numbers or (nested) fixed-size lists whose item 0 sits at buffer index
    ``first``: the leaf buffer index of item 0's first number, and the numbers per item."""
    per_item = 1
    while pa.types.is_fixed_size_list(array.type):
        size = array.type.list_size
        array = storage_array(array.values)
        first = first * size + array.offset
        per_item *= size
    return first, per_item


def _leaf(array: pa.Array) -> pa.Array:
    while pa.types.is_fixed_size_list(array.type):
        array = storage_array(array.values)
    return array


def _element_index(buffer: pa.Buffer | None, dtype: np.dtype, file: pa.Buffer) -> int | None:
    """The index of ``buffer``'s first element in ``file`` viewed as ``dtype``, if ``buffer``
    lies inside ``file`` at an offset aligned to the item size."""
    if buffer is None:
        return None
    if buffer.size == 0:  # nothing to read through it (a batch of only empty lists)
        return 0
    start = buffer.address - file.address
    if start < 0 or start + buffer.size > file.size or start % dtype.itemsize:
        return None
    return start // dtype.itemsize
