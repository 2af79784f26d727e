"""Row access to one numeric HDF5 dataset along axis 0: a zero-copy memory map when the data is
contiguous and uncompressed, chunk-aligned cached reads otherwise."""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Protocol

import h5py
import numpy as np
import numpy.typing as npt

from fastload._formats._block_cache import BlockCache
from fastload._formats._columns import ragged_gather
from fastload._formats._mmap import FileMap
from fastload._formats._readahead import ByteRanges
from fastload._types import Spans

# Rows per block when reading a dataset that is neither mappable nor chunked (compact or
# external storage, or never written): about this many bytes per HDF5 read.
_VIRTUAL_BLOCK_BYTES = 1 << 20


class Rows(Protocol):
    """Rows of a dataset, returned as new native-endian arrays."""

    def take(self, rows: npt.NDArray[np.int64]) -> np.ndarray:
        """``data[rows]`` for in-range ``rows`` in any order."""
        ...

    def ranges(self, starts: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64]) -> np.ndarray:
        """``data[starts[i] : starts[i] + lengths[i]]`` concatenated over ``i``."""
        ...

    def read_all(self) -> np.ndarray:
        """The whole dataset (for index data such as offsets)."""
        ...


def native(dtype: np.dtype) -> np.dtype:
    """``dtype`` in the machine's byte order, without h5py's metadata."""
    return np.dtype(dtype.str).newbyteorder("=")


#: Where a mapped dataset lies in its file: byte offset, dtype string (file byte order), shape.
Placement = tuple[int, str, tuple[int, ...]]


class MappedRows:
    """A contiguous, uncompressed dataset viewed in place through the file's memory map."""

    def __init__(self, view: np.ndarray, placement: Placement | None = None) -> None:
        self._view = view
        self.placement = placement  # enough to map it again without HDF5
        # None when the file's byte order is the machine's: no conversion call on the hot path.
        self._swap_to = None if view.dtype.isnative else native(view.dtype)

    def take(self, rows: npt.NDArray[np.int64]) -> np.ndarray:
        out = self._view[rows]
        return out if self._swap_to is None else out.astype(self._swap_to)

    def ranges(self, starts: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64]) -> np.ndarray:
        out = ragged_gather(self._view, starts, lengths)
        return out if self._swap_to is None else out.astype(self._swap_to)

    def read_all(self) -> np.ndarray:
        return self._view if self._swap_to is None else self._view.astype(self._swap_to)

    def spans(self, starts: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64]) -> Spans | None:
        """The rows left in the map (``None`` when they need a byte swap first)."""
        return Spans(self._view, starts, lengths) if self._swap_to is None else None

    def byte_ranges(self, starts: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64]) -> ByteRanges | None:
        """Where rows ``starts[i] : starts[i] + lengths[i]`` lie in the file, as byte ranges
        (``None`` without a placement)."""
        if self.placement is None:
            return None
        row_bytes = math.prod(self._view.shape[1:]) * self._view.itemsize
        return self.placement[0] + starts * row_bytes, lengths * row_bytes

    @property
    def in_place(self) -> np.ndarray | None:
        """The mapped view itself, when its bytes need no swap (else ``None``)."""
        return self._view if self._swap_to is None else None


class BlockRows:
    """A chunked (possibly compressed) dataset, read in whole blocks of ``block_rows`` rows (its
    chunk height) so that each chunk is decoded once and then served from a per-process cache.

    Missing blocks that are consecutive are fetched with one HDF5 read.
    """

    def __init__(self, dset: h5py.Dataset, cache: BlockCache[np.ndarray], key: Hashable) -> None:
        self._dset = dset
        self._cache = cache
        self._key = key
        self._native = native(dset.dtype)
        self._num_rows = dset.shape[0]
        if dset.chunks is not None:
            self._block_rows = int(dset.chunks[0])
        else:
            row_bytes = max(1, dset.dtype.itemsize * math.prod(dset.shape[1:]))
            self._block_rows = max(1, _VIRTUAL_BLOCK_BYTES // row_bytes)

    def take(self, rows: npt.NDArray[np.int64]) -> np.ndarray:
        return self.ranges(rows, np.ones(len(rows), np.int64))

    def ranges(self, starts: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64]) -> np.ndarray:
        size = self._block_rows
        nonempty = lengths > 0
        first = starts[nonempty] // size
        last = (starts[nonempty] + lengths[nonempty] - 1) // size
        spans = last - first + 1
        covered = np.repeat(first - (np.cumsum(spans) - spans), spans)
        covered += np.arange(covered.size, dtype=np.int64)
        needed = np.unique(covered)
        if needed.size == 0:
            return np.empty((0, *self._dset.shape[1:]), self._native)
        buffer = np.concatenate(self._blocks(needed), axis=0)
        # ``needed`` is sorted and every block a range touches is in it, so a range is contiguous
        # in ``buffer``: it starts at its first block's rank times the block height.
        buffer_starts = np.zeros(len(starts), np.int64)
        buffer_starts[nonempty] = np.searchsorted(needed, first) * size + starts[nonempty] % size
        return ragged_gather(buffer, buffer_starts, lengths)

    def read_all(self) -> np.ndarray:
        return np.asarray(self._dset[...]).astype(self._native, copy=False)

    def _blocks(self, needed: npt.NDArray[np.int64]) -> list[np.ndarray]:
        found: dict[int, np.ndarray] = {}
        missing: list[int] = []
        for block in needed.tolist():
            cached = self._cache.get((self._key, block))
            if cached is None:
                missing.append(block)
            else:
                found[block] = cached
        if missing:
            runs = np.split(np.asarray(missing), np.flatnonzero(np.diff(missing) != 1) + 1)
            for run in runs:
                begin, end = int(run[0]), int(run[-1]) + 1
                data = self._dset[
                    begin * self._block_rows : min(end * self._block_rows, self._num_rows)
                ]
                data = np.asarray(data).astype(self._native, copy=False)
                for block in range(begin, end):
                    piece = data[
                        (block - begin) * self._block_rows : (block - begin + 1) * self._block_rows
                    ]
                    if end - begin > 1:  # own its memory, so evicting it frees what it counts
                        piece = piece.copy()
                    found[block] = piece
                    self._cache.put((self._key, block), piece, piece.nbytes)
        return [found[block] for block in needed.tolist()]


def is_mappable(dset: h5py.Dataset) -> bool:
    """Whether ``dset`` lies in the file as one contiguous, allocated, unfiltered block in numpy's
    byte layout of its dtype (so a view at its offset reads exactly what HDF5 would)."""
    dcpl = dset.id.get_create_plist()
    if dcpl.get_layout() != h5py.h5d.CONTIGUOUS or dcpl.get_external_count() > 0:
        return False
    if dset.id.get_offset() is None:
        return False
    return bool(dset.id.get_type().equal(h5py.h5t.py_create(dset.dtype)))


def open_rows(
    dset: h5py.Dataset, file_map: FileMap, cache: BlockCache[np.ndarray], cache_key: Hashable
) -> Rows:
    """The fastest row access ``dset`` allows; ``cache_key`` identifies the dataset among all
    those sharing ``cache``."""
    if dset.size and is_mappable(dset):
        placement = (int(dset.id.get_offset()), dset.dtype.str, tuple(dset.shape))
        return map_rows(file_map, placement, what=f"dataset {dset.name!r}")
    return BlockRows(dset, cache, cache_key)


def map_rows(file_map: FileMap, placement: Placement, *, what: str) -> MappedRows:
    """Rows mapped from a :data:`Placement` (found by HDF5 in this or another process)."""
    offset, dtype, shape = placement
    return MappedRows(file_map.view(offset, np.dtype(dtype), shape, what=what), placement)
