"""The descriptors of an h5py variable-length dataset, read without reading its sequences.

HDF5 stores each element of a variable-length dataset (sequences, or variable-length strings)
as a descriptor in the dataset's own storage: a little-endian uint32 length (elements, or bytes
for a string), then a global-heap ID (the heap collection's file address, ``sizeof_addr``
bytes, and a uint32 object index). The sequences themselves live in the global heap. Reading
descriptors costs ``4 + sizeof_addr + 4`` bytes per sample, whatever the sequences' sizes.
(HDF5 File Format Specification, "Variable-length Data" and "Global Heap".)
"""

from __future__ import annotations

import zlib
from collections.abc import Hashable
from typing import Any

import h5py
import numpy as np
import numpy.typing as npt

from fastload._formats._block_cache import BlockCache
from fastload._formats._mmap import FileMap

# Filters whose inverse is simple enough to apply to raw descriptor chunks here; a dataset with
# any other filter (LZF, SZIP, plugins) has its descriptors read by nobody but HDF5.
_DEFLATE = h5py.h5z.FILTER_DEFLATE
_SHUFFLE = h5py.h5z.FILTER_SHUFFLE
_BLOCK_SAMPLES = 65536


class Descriptors:
    """The descriptors of one 1-D variable-length dataset: a view of the memory map when the
    storage is contiguous, else chunks decoded here (deflate and shuffle only) and cached."""

    def __init__(
        self,
        dset: h5py.Dataset,
        dtype: np.dtype,
        view: np.ndarray | None,
        filters: list[int],
        cache: BlockCache[Any],
        cache_key: Hashable,
    ) -> None:
        self._dset = dset
        self.dtype = dtype
        self._view = view
        self._filters = filters
        self._cache = cache
        self._key = cache_key
        self._num_rows = dset.shape[0]
        self._chunk_rows = int(dset.chunks[0]) if dset.chunks else 0

    @classmethod
    def open(
        cls, dset: h5py.Dataset, file_map: FileMap, cache: BlockCache[Any], cache_key: Hashable
    ) -> Descriptors | None:
        """Descriptors of ``dset``, or ``None`` when only HDF5 can read them (compact storage,
        or filters other than deflate and shuffle)."""
        sizeof_addr = dset.file.id.get_create_plist().get_sizes()[0]
        if sizeof_addr not in (2, 4, 8) or dset.ndim != 1:
            return None
        dtype = np.dtype([("length", "<u4"), ("collection", f"<u{sizeof_addr}"), ("index", "<u4")])
        dcpl = dset.id.get_create_plist()
        layout = dcpl.get_layout()
        if layout == h5py.h5d.CONTIGUOUS:
            offset = dset.id.get_offset()
            if dset.shape[0] == 0 or offset is None:
                return cls(dset, dtype, np.zeros(dset.shape[0], dtype), [], cache, cache_key)
            if dset.id.get_storage_size() != dset.shape[0] * dtype.itemsize:
                return None
            view = file_map.view(offset, dtype, dset.shape, what=f"dataset {dset.name!r}")
            return cls(dset, dtype, view, [], cache, cache_key)
        if layout == h5py.h5d.CHUNKED:
            filters = [dcpl.get_filter(i)[0] for i in range(dcpl.get_nfilters())]
            if set(filters) <= {_DEFLATE, _SHUFFLE}:
                return cls(dset, dtype, None, filters, cache, cache_key)
        return None

    def take(self, rows: npt.NDArray[np.int64]) -> np.ndarray:
        """The descriptors of ``rows`` (in range, any order)."""
        if self._view is not None:
            return self._view[rows]
        size = self._chunk_rows
        needed = np.unique(rows // size)
        chunks = [self._cached_chunk(int(c)) for c in needed.tolist()]
        buffer = np.concatenate(chunks)
        return buffer[np.searchsorted(needed, rows // size) * size + rows % size]

    def lengths(self) -> npt.NDArray[np.int64]:
        """Every sample's length."""
        if self._view is not None:
            return self._view["length"].astype(np.int64)
        lengths = np.zeros(self._num_rows, np.int64)  # unwritten chunks: empty sequences
        for i in range(self._dset.id.get_num_chunks()):
            start = self._dset.id.get_chunk_info(i).chunk_offset[0]
            chunk = self._decode(start)
            lengths[start : start + len(chunk)] = chunk["length"]
        return lengths

    def _cached_chunk(self, chunk: int) -> np.ndarray:
        key = (self._key, chunk)
        found = self._cache.get(key)
        if found is None:
            found = self._decode(chunk * self._chunk_rows)
            if len(found) < self._chunk_rows:  # pad the last chunk so positions stay regular
                found = np.concatenate([found, np.zeros(self._chunk_rows - len(found), self.dtype)])
            self._cache.put(key, found, found.nbytes)
        return found

    def _decode(self, start: int) -> np.ndarray:
        """The descriptors of the chunk starting at row ``start`` (zeros if never written)."""
        count = min(self._chunk_rows, self._num_rows - start)
        info = self._dset.id.get_chunk_info_by_coord((start,))
        if info.byte_offset is None:
            return np.zeros(count, self.dtype)
        filter_mask, raw = self._dset.id.read_direct_chunk((start,))
        for position in reversed(range(len(self._filters))):
            if filter_mask & (1 << position):  # this filter was skipped for this chunk
                continue
            if self._filters[position] == _DEFLATE:
                raw = zlib.decompress(raw)
            else:
                raw = _unshuffle(raw, self.dtype.itemsize)
        return np.frombuffer(raw, self.dtype, count=count).copy()


def vlen_lengths(dset: h5py.Dataset, descriptors: Descriptors | None) -> npt.NDArray[np.int64]:
    """The number of elements of each sample of the 1-D variable-length dataset ``dset``, from
    its ``descriptors``; without them (filters only HDF5 can undo), from the sequences
    themselves, read in blocks of 65,536 samples."""
    if descriptors is not None:
        return descriptors.lengths()
    num_samples = dset.shape[0]
    lengths = np.empty(num_samples, np.int64)
    for start in range(0, num_samples, _BLOCK_SAMPLES):
        block = dset[start : start + _BLOCK_SAMPLES]
        lengths[start : start + len(block)] = np.fromiter(map(len, block), np.int64, len(block))
    return lengths


def _unshuffle(raw: bytes, itemsize: int) -> bytes:
    """Invert HDF5's shuffle filter: byte ``j`` of every element was stored in plane ``j``."""
    data = np.frombuffer(raw, np.uint8)
    count = len(data) // itemsize
    body = data[: count * itemsize].reshape(itemsize, count).T
    return body.tobytes() + data[count * itemsize :].tobytes()
