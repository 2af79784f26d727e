"""Variable-length HDF5 data read straight from the global heap through the memory map.

HDF5 reads a variable-length dataset one heap object at a time, allocating a Python object
each; a batch of 64 samples costs milliseconds. The bytes, though, sit in the file plainly:
each sample's descriptor (in the dataset's own storage, see ``_hdf5_vlen``) holds its element
count and a global-heap ID, the address of a heap *collection* plus an object index, and the collection
lists its objects with their sizes (HDF5 File Format Specification, "Global Heap"):

    collection: "GCOL", version 1, 3 reserved bytes, collection size (sizeof_size bytes),
                then objects, each: index (uint16), reference count (uint16), 4 reserved
                bytes, size (sizeof_size bytes), data padded to a multiple of 8 bytes;
                index 0 marks the free space that ends the list.

A batch then costs one parse per collection not yet seen (cached per process) and one numpy
gather. Anything unexpected (another heap version, a missing object, a size that disagrees
with the element count) makes :meth:`HeapReader.locate` return ``None`` and the caller reads
through HDF5 instead, so a file this code does not understand is still read correctly.
"""

from __future__ import annotations

import struct

import h5py
import numpy as np
import numpy.typing as npt

from fastload._formats._hdf5_vlen import Descriptors
from fastload._formats._mmap import FileMap

_SIGNATURE = b"GCOL"
_OBJECT_WIDE = struct.Struct("<HHIQ")  # sizeof_size == 8
_OBJECT_NARROW = struct.Struct("<HHII")  # sizeof_size == 4
# Memory a parsed collection takes, per object (a dict entry and a tuple of two ints).
_TABLE_BYTES_PER_OBJECT = 160


class HeapReader:
    """Locates the samples of one variable-length dataset in the file."""

    def __init__(
        self,
        descriptors: Descriptors,
        file_bytes: np.ndarray,
        base: int,
        sizeof_size: int,
        capacity_bytes: int,
    ) -> None:
        self._descriptors = descriptors
        self._bytes = file_bytes
        self._buffer = file_bytes.data  # a memoryview: what struct reads headers through
        self._base = base
        self._sizeof_size = sizeof_size
        # Parsed collections, by address. A plain dict, emptied when it outgrows its budget:
        # a lookup per sample must cost a dict access, not an LRU's lock and reordering.
        self._tables: dict[int, dict[int, tuple[int, int]]] = {}
        self._held_bytes = 0
        self._capacity_bytes = capacity_bytes

    @classmethod
    def open(
        cls,
        dset: h5py.Dataset,
        file_map: FileMap,
        descriptors: Descriptors | None,
        capacity_bytes: int,
    ) -> HeapReader | None:
        """A reader for the variable-length (sequence or string) dataset ``dset``, or ``None``
        when its descriptors can only be read through HDF5. Parsed collections are kept up to
        about ``capacity_bytes``."""
        file_type = dset.id.get_type()
        variable = isinstance(file_type, h5py.h5t.TypeVlenID) or (
            isinstance(file_type, h5py.h5t.TypeStringID) and file_type.is_variable_str()
        )
        sizeof_size = dset.file.id.get_create_plist().get_sizes()[1]
        if not variable or descriptors is None or sizeof_size not in (4, 8):
            return None
        base = dset.file.userblock_size
        return cls(descriptors, file_map.whole(), base, sizeof_size, capacity_bytes)

    def locate(
        self, rows: npt.NDArray[np.int64], item_bytes: int
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]] | None:
        """File offsets and element counts of samples ``rows``, each sample being ``length *
        item_bytes`` bytes; ``None`` if the heap is not as expected."""
        found = self._descriptors.take(rows)
        lengths = found["length"].astype(np.int64)
        nonempty = np.flatnonzero(lengths)
        tables: dict[int, dict[int, tuple[int, int]]] = {}  # one lookup per collection
        offsets: list[int] = []
        sizes: list[int] = []
        collections = found["collection"][nonempty].tolist()
        for collection, index in zip(collections, found["index"][nonempty].tolist(), strict=True):
            table = tables.get(collection)
            if table is None:
                table = self._collection(collection)
                if table is None:
                    return None
                tables[collection] = table
            entry = table.get(index)
            if entry is None:
                return None
            offsets.append(entry[0])
            sizes.append(entry[1])
        if (np.array(sizes, np.int64) != lengths[nonempty] * item_bytes).any():
            return None
        starts = np.zeros(len(rows), np.int64)
        starts[nonempty] = offsets
        return starts, lengths

    def whole(self) -> np.ndarray:
        """The file's bytes, to gather the located samples from."""
        return self._bytes

    def _collection(self, address: int) -> dict[int, tuple[int, int]] | None:
        objects = self._tables.get(address)
        if objects is None:
            objects = self._parse(self._base + address)
            if objects is None:
                return None
            cost = _TABLE_BYTES_PER_OBJECT * max(1, len(objects))
            if self._held_bytes + cost > self._capacity_bytes:
                self._tables.clear()
                self._held_bytes = 0
            self._tables[address] = objects
            self._held_bytes += cost
        return objects

    def _parse(self, start: int) -> dict[int, tuple[int, int]] | None:
        """``{object index: (file offset of its data, its size in bytes)}`` for the collection
        at file offset ``start``."""
        data = self._buffer
        wide = self._sizeof_size == 8
        # Collection header: signature, version, 3 reserved bytes, size. Object header: index,
        # reference count, 4 reserved bytes, size. Both are 8 + sizeof_size bytes.
        header = 8 + self._sizeof_size
        read_object = (_OBJECT_WIDE if wide else _OBJECT_NARROW).unpack_from
        if start < 0 or start + header > len(data) or bytes(data[start : start + 4]) != _SIGNATURE:
            return None
        if data[start + 4] != 1:
            return None
        (collection_bytes,) = struct.unpack_from("<Q" if wide else "<I", data, start + 8)
        end = min(start + collection_bytes, len(data))
        objects: dict[int, tuple[int, int]] = {}
        position = start + header
        while position + header <= end:
            index, _, _, size = read_object(data, position)
            if index == 0:  # the free space: nothing follows
                break
            if position + header + size > end:
                return None  # an object running past its collection: damaged, let HDF5 say so
            objects[index] = (position + header, size)
            position += header + ((size + 7) & ~7)
        return objects
