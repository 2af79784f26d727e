"""One HDF5 file opened in the current process: the file, its memory map, a reader per field."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np
import numpy.typing as npt

from fastload._formats._block_cache import BlockCache
from fastload._formats._hdf5_columns import (
    ArrayColumn,
    ColumnPlacement,
    H5Column,
    OffsetsColumn,
    RaggedH5Column,
    StringColumn,
    VlenColumn,
)
from fastload._formats._hdf5_heap import HeapReader
from fastload._formats._hdf5_layout import LENGTHS_INDEX, H5Field
from fastload._formats._hdf5_rows import map_rows, open_rows
from fastload._formats._hdf5_vlen import Descriptors
from fastload._formats._mmap import FileMap
from fastload._formats._readahead import ByteRanges
from fastload._formats._sniff import describe, sniff
from fastload._formats._validate import lengths_from_offsets
from fastload._types import Column, Spans
from fastload.errors import DataFormatError, FastloadError

#: What h5py raises where HDF5's checks of a file's metadata fail: its error stack is mapped
#: onto these builtins (``RuntimeError`` for a failed link iteration, ``KeyError`` for an
#: object that cannot be opened, ``ValueError`` for a bad datatype or dataspace).
H5_ERRORS: tuple[type[BaseException], ...] = (OSError, RuntimeError, KeyError, ValueError)


@contextmanager
def damaged_h5(path: str) -> Iterator[None]:
    """Re-raise what h5py raises for damaged metadata while the block runs as a
    :class:`DataFormatError` naming ``path`` (fastload's own errors, and a file that is gone,
    pass unchanged)."""
    try:
        yield
    except (FastloadError, FileNotFoundError):
        raise
    except H5_ERRORS as exc:
        raise DataFormatError(
            f"{path}: its HDF5 metadata is damaged ({type(exc).__name__}: {exc}); the file"
            " cannot be read as it is: write it again"
        ) from exc


def open_h5(path: str) -> h5py.File:
    """Open ``path`` read-only without file locking (which fails on many network file systems
    and is pointless for a reader), or raise :class:`DataFormatError` saying what the file is
    instead."""
    fmt = sniff(path)
    if fmt != "hdf5":
        raise DataFormatError(f"{path}: not an HDF5 file: it is {describe(fmt)}")
    try:
        try:
            return h5py.File(path, "r", locking=False)
        except OSError as exc:
            # HDF5 shares one open file per process and refuses a second open whose locking
            # flag differs from the first; if the caller already has it open, follow suit.
            if "locking" not in str(exc):
                raise
            return h5py.File(path, "r")
    except OSError as exc:
        raise DataFormatError(
            f"{path}: has an HDF5 signature but cannot be opened; it is truncated or damaged ({exc})"
        ) from exc


@dataclass(frozen=True)
class ShardPlacement:
    """Where every field of one file lies in its bytes, when all of them are memory-mapped:
    enough for another process to read the file through a map alone, without opening it in
    HDF5 (about 5 ms of a worker's start). ``identity`` is the file's device, inode, size and
    modification time when the placement was found; a file changed or replaced since is opened
    anew."""

    identity: tuple[int, int, int, int]
    columns: dict[str, ColumnPlacement]


def file_identity(path: str) -> tuple[int, int, int, int]:
    info = os.stat(path)
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns


#: The kinds of column that can lie in the file's memory map (placed, located, read in place).
_MAPPABLE = (OffsetsColumn, ArrayColumn)


class _ColumnReads:
    """What a shard does with its columns, however they were opened."""

    _columns: dict[str, H5Column]
    _ragged: dict[str, RaggedH5Column]

    def read(self, field: str, rows: npt.NDArray[np.int64]) -> Column:
        return self._columns[field].read(rows)

    def read_in_place(self, field: str, rows: npt.NDArray[np.int64]) -> Column | Spans:
        """Like :meth:`read`; a memory-mapped ragged field comes back as ``Spans``."""
        column = self._columns[field]
        return column.read_in_place(rows) if isinstance(column, OffsetsColumn) else column.read(rows)

    def mapped_ragged(self, field: str) -> tuple[np.ndarray, np.ndarray] | None:
        """``field``'s values and int64 offsets as mapped views, when it is stored in the
        fastload layout and both are memory-mapped (else ``None``)."""
        column = self._columns[field]
        return column.mapped() if isinstance(column, OffsetsColumn) else None

    def lengths(self, field: str) -> npt.NDArray[np.int64]:
        return self._ragged[field].lengths()

    def byte_ranges(self, field: str, rows: npt.NDArray[np.int64]) -> ByteRanges | None:
        """Where the payload of ``rows`` of ``field`` lies in the file (``None`` unless it is
        memory-mapped)."""
        column = self._columns[field]
        return column.byte_ranges(rows) if isinstance(column, _MAPPABLE) else None


class MappedShard(_ColumnReads):
    """A file read through its memory map alone, from a :class:`ShardPlacement` found in
    another process: no HDF5 call at all."""

    def __init__(self, path: str, fields: dict[str, H5Field], placement: ShardPlacement) -> None:
        self._path = path
        self._map = FileMap(path)
        self._columns = {}
        self._ragged = {}
        for name, where in placement.columns.items():
            what = f"field {name!r}"
            if where[0] == "offsets":
                column = OffsetsColumn(map_rows(self._map, where[1], what=what), map_rows(self._map, where[2], what=what))
                self._ragged[name] = self._columns[name] = column
            else:
                self._columns[name] = ArrayColumn(map_rows(self._map, where[1], what=what))
        if set(self._columns) != set(fields):
            raise DataFormatError(f"{path}: the placement found earlier does not cover its fields")

    def release_unused_file(self) -> None:
        """Nothing to release: no HDF5 file is open."""

    def check_mapped(self) -> None:
        """Raise :class:`DataFormatError` when the file shrank since it was mapped."""
        self._map.check_size()

    def close(self) -> None:
        self._map.close()


class H5Shard(_ColumnReads):
    """One HDF5 file opened in the current process, with a reader per field."""

    def __init__(
        self, path: str, shard: int, fields: dict[str, H5Field], cache: BlockCache[Any]
    ) -> None:
        self._path = path
        self._file = open_h5(path)
        self._map = FileMap(path)
        try:
            self._columns = {}
            self._ragged = {}
            for name, spec in fields.items():
                self._columns[name] = self._open_column(spec, shard, cache)
        except BaseException:
            self.close()
            raise

    def placement(self, fields: list[str]) -> ShardPlacement | None:
        """Where ``fields`` lie, when every one of them is memory-mapped (else ``None``)."""
        columns = {}
        for name in fields:
            column = self._columns[name]
            where = column.placement() if isinstance(column, _MAPPABLE) else None
            if where is None:
                return None
            columns[name] = where
        return ShardPlacement(file_identity(self._path), columns)

    def release_unused_file(self) -> None:
        """Close the HDF5 file if every field is read through the memory map alone, so that
        the fast path holds no HDF5 state at all (the map stays open)."""
        if not any(column.uses_hdf5 for column in self._columns.values()):
            self._file.close()

    def checked_lengths(self, field: str, spec: H5Field) -> npt.NDArray[np.int64]:
        """Lengths of the ragged ``field`` after validating its offsets (fastload layout)."""
        if spec.storage != "offsets":
            return self.lengths(field)
        group = self._file[spec.path]
        offsets = open_rows(group["offsets"], self._map, BlockCache(0), "offsets").read_all()
        where = f"{self._path}: field {field!r} ({spec.path}/offsets)"
        return lengths_from_offsets(offsets, group["values"].shape[0], where=where)

    def lengths_index(self) -> npt.NDArray[np.integer]:
        dset = self._file[LENGTHS_INDEX]
        if dset.ndim != 1 or dset.dtype.kind not in "iu":
            raise DataFormatError(
                f"{self._path}: /{LENGTHS_INDEX} has dtype {dset.dtype} and shape {dset.shape};"
                " expected int64 [N]"
            )
        return np.asarray(dset[...])

    def check_mapped(self) -> None:
        """Raise :class:`DataFormatError` when the file shrank since it was mapped."""
        self._map.check_size()

    def close(self) -> None:
        self._map.close()
        if self._file.id.valid:
            self._file.close()

    def _open_column(self, spec: H5Field, shard: int, cache: BlockCache[Any]) -> H5Column:
        obj = self._file.get(spec.path)
        if obj is None:
            raise DataFormatError(f"{self._path}: {spec.path} has disappeared since construction")
        if spec.storage == "offsets":
            values = open_rows(obj["values"], self._map, cache, (shard, spec.path, "values"))
            offsets = open_rows(obj["offsets"], self._map, cache, (shard, spec.path, "offsets"))
            column = self._ragged[spec.field.name] = OffsetsColumn(values, offsets)
            return column
        if spec.storage in ("vlen", "string"):
            variable = spec.storage == "vlen" or h5py.check_string_dtype(obj.dtype).length is None
            descriptors = (
                Descriptors.open(obj, self._map, cache, (shard, spec.path)) if variable else None
            )
            heap = HeapReader.open(obj, self._map, descriptors, cache.capacity_bytes)
            if spec.storage == "string":
                return StringColumn(obj, spec.text, heap)
            vlen = self._ragged[spec.field.name] = VlenColumn(obj, descriptors, heap)
            return vlen
        return ArrayColumn(open_rows(obj, self._map, cache, (shard, spec.path)))
