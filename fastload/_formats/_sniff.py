"""Recognising a file's format from its first bytes, for readers' choice of decoder and for
error messages that say what a wrong file actually is."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import h5py

from fastload.errors import DataFileNotFoundError, DataFormatError

Format = Literal["hdf5", "arrow-file", "arrow-stream", "parquet"]

_ARROW_FILE_MAGIC = b"ARROW1"
_PARQUET_MAGIC = b"PAR1"
# An Arrow IPC stream starts with a message: the continuation marker 0xFFFFFFFF then a metadata
# length (streams written before Arrow 0.15 start with the length directly).
_STREAM_CONTINUATION = b"\xff\xff\xff\xff"


def sniff(path: str | Path) -> Format | None:
    """The format of ``path`` judging by its signature, or ``None`` if it is none of these;
    :class:`DataFileNotFoundError` if it does not exist (any more), :class:`DataFormatError` if it
    cannot be read at all."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(8)
    except FileNotFoundError as exc:
        raise DataFileNotFoundError(f"{path}: no such file or directory", path) from exc
    except OSError as exc:
        raise DataFormatError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
    if head.startswith(_ARROW_FILE_MAGIC):
        return "arrow-file"
    if head.startswith(_PARQUET_MAGIC):
        return "parquet"
    if head.startswith(_STREAM_CONTINUATION):
        return "arrow-stream"
    if h5py.is_hdf5(str(path)):
        return "hdf5"
    return None


def describe(fmt: Format | None) -> str:
    """How to name ``fmt`` in a message."""
    return {
        "hdf5": "an HDF5 file (read it with fastload.HDF5Dataset)",
        "arrow-file": "an Arrow IPC file (read it with fastload.ArrowDataset)",
        "arrow-stream": "an Arrow IPC stream (read it with fastload.ArrowDataset)",
        "parquet": "a Parquet file (read it with fastload.ArrowDataset)",
        None: "not a format fastload reads (no HDF5, Arrow or Parquet signature)",
    }[fmt]
