"""Reading one field of one open HDF5 file, per storage kind (see ``_hdf5_layout.Storage``)."""

from __future__ import annotations

from typing import Any, Protocol

import h5py
import numpy as np
import numpy.typing as npt

from fastload._formats._columns import permute_column, ragged_gather
from fastload._formats._hdf5_heap import HeapReader
from fastload._formats._hdf5_rows import MappedRows, Rows, native
from fastload._formats._hdf5_vlen import Descriptors, vlen_lengths
from fastload._formats._readahead import ByteRanges
from fastload._types import Column, Ragged, Spans

#: A column that is memory-mapped alone, as its kind and the placements of its datasets:
#: ``("offsets", values, offsets)`` or ``("array", rows)``.
ColumnPlacement = tuple[Any, ...]


class H5Column(Protocol):
    uses_hdf5: bool
    """Whether reads go through HDF5 (else only through the file's memory map)."""

    def read(self, rows: npt.NDArray[np.int64]) -> Column:
        """Samples ``rows`` (in range, any order, duplicates allowed), in that order."""
        ...


class RaggedH5Column(H5Column, Protocol):
    def lengths(self) -> npt.NDArray[np.int64]:
        """Per-sample lengths, from index data only."""
        ...


def _mapped(rows: Rows) -> MappedRows | None:
    """``rows`` where they are read through the file's memory map (what can be placed, located
    and read in place), else ``None``."""
    return rows if isinstance(rows, MappedRows) else None


class OffsetsColumn:
    """The fastload layout: ``values`` holds the samples back to back, ``offsets[i]`` is where
    sample ``i`` starts. One gather per batch, no HDF5 call when both are memory-mapped."""

    def __init__(self, values: Rows, offsets: Rows) -> None:
        self._values = values
        self._offsets = offsets
        self.uses_hdf5 = not (isinstance(values, MappedRows) and isinstance(offsets, MappedRows))

    def read(self, rows: npt.NDArray[np.int64]) -> Column:
        starts, lengths = self._spans(rows)
        return Ragged(self._values.ranges(starts, lengths), lengths)

    def read_in_place(self, rows: npt.NDArray[np.int64]) -> Column | Spans:
        """Like :meth:`read`, but :class:`Spans` over the memory map when the values are
        mapped (no copy at all)."""
        starts, lengths = self._spans(rows)
        values = self._values
        located = values.spans(starts, lengths) if isinstance(values, MappedRows) else None
        return located if located is not None else Ragged(self._values.ranges(starts, lengths), lengths)

    def placement(self) -> ColumnPlacement | None:
        """How to map this column again without HDF5, when both its datasets are mapped."""
        values, offsets = _mapped(self._values), _mapped(self._offsets)
        if values is None or offsets is None or values.placement is None or offsets.placement is None:
            return None
        return ("offsets", values.placement, offsets.placement)

    def byte_ranges(self, rows: npt.NDArray[np.int64]) -> ByteRanges | None:
        """Where the values of ``rows`` lie in the file, when they are mapped (reads the
        offsets of ``rows``)."""
        values = _mapped(self._values)
        return None if values is None else values.byte_ranges(*self._spans(rows))

    def mapped(self) -> tuple[np.ndarray, np.ndarray] | None:
        """``(values, offsets)`` as they lie in the file's memory map, native-endian with int64
        offsets, or ``None`` when either is read another way."""
        mapped_values, mapped_offsets = _mapped(self._values), _mapped(self._offsets)
        values = None if mapped_values is None else mapped_values.in_place
        offsets = None if mapped_offsets is None else mapped_offsets.in_place
        if values is None or offsets is None or offsets.dtype != np.int64:
            return None
        return values, offsets

    def _spans(self, rows: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        starts = self._offsets.take(rows)
        lengths = self._offsets.take(rows + 1) - starts
        if starts.dtype != np.int64:  # the layout says int64; other integer types are accepted
            starts, lengths = starts.astype(np.int64), lengths.astype(np.int64)
        return starts, lengths

    def lengths(self) -> npt.NDArray[np.int64]:
        return np.diff(self._offsets.read_all().astype(np.int64, copy=False)).astype(
            np.int64, copy=False
        )


class ArrayColumn:
    """A plain ``[N, ...]`` dataset: a fixed field."""

    def __init__(self, rows: Rows) -> None:
        self._rows = rows
        self.uses_hdf5 = not isinstance(rows, MappedRows)

    def placement(self) -> ColumnPlacement | None:
        """How to map this column again without HDF5, when it is mapped."""
        rows = _mapped(self._rows)
        return None if rows is None or rows.placement is None else ("array", rows.placement)

    def read(self, rows: npt.NDArray[np.int64]) -> Column:
        return self._rows.take(rows)

    def byte_ranges(self, rows: npt.NDArray[np.int64]) -> ByteRanges | None:
        """Where ``rows`` lie in the file, when they are mapped."""
        mapped = _mapped(self._rows)
        return None if mapped is None else mapped.byte_ranges(rows, np.ones(len(rows), np.int64))


class VlenColumn:
    """An h5py variable-length dataset of numbers. Its sequences live in HDF5's global heap:
    read straight from the memory map when the heap is as expected (``_hdf5_heap``), else by
    HDF5 in one call over the sorted distinct rows."""

    def __init__(
        self, dset: h5py.Dataset, descriptors: Descriptors | None, heap: HeapReader | None
    ) -> None:
        self.uses_hdf5 = True  # the fallback needs the file open
        self._dset = dset
        self._descriptors = descriptors
        self._dtype = native(np.dtype(h5py.check_vlen_dtype(dset.dtype)))
        # The heap holds the elements in the file's byte order: only a native one can be viewed.
        element_type = dset.id.get_type().get_super()
        same_layout = element_type.equal(h5py.h5t.py_create(self._dtype))
        self._heap = heap if same_layout else None

    def read(self, rows: npt.NDArray[np.int64]) -> Column:
        if self._heap is not None:
            located = self._heap.locate(rows, self._dtype.itemsize)
            if located is not None:
                starts, lengths = located
                raw = ragged_gather(self._heap.whole(), starts, lengths * self._dtype.itemsize)
                return Ragged(raw.view(self._dtype), lengths)
            self._heap = None  # not the heap layout this code knows: HDF5 from now on
        distinct, inverse = np.unique(rows, return_inverse=True)
        sequences = self._dset[distinct]
        lengths = np.fromiter(map(len, sequences), np.int64, len(sequences))
        values = np.concatenate(list(sequences)).astype(self._dtype, copy=False)
        return permute_column(Ragged(values, lengths), inverse.reshape(-1))

    def lengths(self) -> npt.NDArray[np.int64]:
        return vlen_lengths(self._dset, self._descriptors)


class StringColumn:
    """A string dataset: ``str`` when UTF-8, else ``bytes``. Variable-length strings are read
    from the global heap like :class:`VlenColumn` when possible."""

    def __init__(self, dset: h5py.Dataset, text: bool, heap: HeapReader | None) -> None:
        self.uses_hdf5 = True
        self._dset = dset
        self._text = text
        self._heap = heap

    def read(self, rows: npt.NDArray[np.int64]) -> Column:
        if self._heap is not None:
            located = self._heap.locate(rows, 1)
            if located is not None:
                starts, lengths = located
                blob = ragged_gather(self._heap.whole(), starts, lengths).tobytes()
                ends = np.cumsum(lengths).tolist()
                pieces = [blob[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]
                return [p.decode("utf-8") for p in pieces] if self._text else pieces
            self._heap = None
        distinct, inverse = np.unique(rows, return_inverse=True)
        raw = self._dset[distinct]
        if self._text:
            items: list[str | bytes] = [bytes(b).decode("utf-8") for b in raw]
        else:
            items = [bytes(b) for b in raw]
        return [items[i] for i in inverse.reshape(-1).tolist()]
