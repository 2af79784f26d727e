"""Zero-copy numpy views of byte ranges of a file, through one read-only memory map per file.

Used for HDF5 datasets stored contiguously and uncompressed: their bytes sit at a fixed file
offset in exactly numpy's layout, so a view replaces every HDF5 read call.
"""

from __future__ import annotations

import math
import mmap
import os
import weakref
from pathlib import Path

import numpy as np

from fastload.errors import DataFileNotFoundError, DataFormatError


class FileMap:
    """A read-only memory map of a whole file, opened on the first :meth:`view`.

    Views stay valid after :meth:`close` only as long as they are referenced (numpy keeps the
    mapping alive through the view's base); :meth:`close` drops this object's reference.
    """

    def __init__(self, path: str | Path) -> None:
        self._path = str(path)
        self._map: mmap.mmap | None = None
        self._size = 0

    def view(
        self, offset: int, dtype: np.dtype, shape: tuple[int, ...], *, what: str
    ) -> np.ndarray:
        """A read-only array of ``dtype`` and ``shape`` over the file's bytes from ``offset``.

        Raises :class:`DataFormatError` (naming ``what``) when the range runs past the end of the
        file, as it does in a truncated file: reading such a view would kill the process with
        SIGBUS instead of raising.
        """
        count = math.prod(shape)
        nbytes = count * dtype.itemsize
        if count == 0:
            return np.empty(shape, dtype)
        buffer = self._ensure_open()
        if offset < 0 or offset + nbytes > self._size:
            raise DataFormatError(
                f"{self._path}: {what}: its data spans bytes [{offset}, {offset + nbytes}) but the"
                f" file has {self._size} bytes; the file is truncated"
            )
        array = np.ndarray(shape, dtype=dtype, buffer=buffer, offset=offset)
        array.flags.writeable = False
        return array

    def check_size(self) -> None:
        """Raise :class:`DataFormatError` when the file is now shorter than the map: a read of
        the map past its new end would kill the process with SIGBUS (one ``fstat``, ~1 µs)."""
        if self._map is not None:
            actual = self._map.size()  # fstat of the descriptor the map holds
            if actual < self._size:
                raise truncated_error(self._path, self._size, actual)

    def whole(self) -> np.ndarray:
        """The whole file as a read-only uint8 array."""
        return np.frombuffer(self._ensure_open(), np.uint8)

    def close(self) -> None:
        """Drop the map; views already handed out keep it alive until they go away."""
        self._map = None

    def _ensure_open(self) -> mmap.mmap:
        if self._map is None:
            try:
                handle = open(self._path, "rb")  # noqa: SIM115 - closed by the with below
            except FileNotFoundError as exc:
                raise DataFileNotFoundError(
                    f"{self._path}: no such file or directory (it existed when the dataset was"
                    " created: it has been deleted or moved since)",
                    self._path,
                ) from exc
            with handle:
                self._size = os.fstat(handle.fileno()).st_size
                if self._size == 0:
                    raise DataFormatError(f"{self._path}: the file is empty (truncated)")
                # The map holds its own reference to the file; the descriptor can close now.
                self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        return self._map


class SizeWatch:
    """The size of a file that another library memory-maps, and a check that it has not shrunk
    since (through a descriptor held for it: one ``fstat``, ~2 µs)."""

    def __init__(self, path: str) -> None:
        self._path = path
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self._fd = fd
        self._close = weakref.finalize(self, os.close, fd)
        self._size = os.fstat(fd).st_size

    def check(self) -> None:
        """Raise :class:`DataFormatError` when the file is now shorter than when watched."""
        if self._close.alive:
            actual = os.fstat(self._fd).st_size
            if actual < self._size:
                raise truncated_error(self._path, self._size, actual)

    def close(self) -> None:
        self._close()


def truncated_error(path: str, mapped: int, actual: int) -> DataFormatError:
    """The error for a file shorter than when this process mapped it."""
    return DataFormatError(
        f"{path}: the file has {actual} bytes, but had {mapped} when this process mapped it:"
        " it was truncated or rewritten while being read (reading on would kill the process"
        " with SIGBUS); restore the file, or create the dataset again once it is complete"
    )
