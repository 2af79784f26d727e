"""Building a dataset's index (``fastload index``, and the converter after it writes shards):
the readers describe the shards, a pass over each file gives its size and SHA-256."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from fastload._formats._arrow_dataset import _SUFFIXES as ARROW_SUFFIXES
from fastload._formats._arrow_dataset import ArrowDataset
from fastload._formats._base import ShardedDataset
from fastload._formats._hdf5_dataset import _SUFFIXES as HDF5_SUFFIXES
from fastload._formats._hdf5_dataset import HDF5Dataset
from fastload._remote._index import INDEX_NAME, DatasetIndex, ShardEntry
from fastload._types import Field
from fastload.errors import DataFileNotFoundError

_CHUNK = 8 << 20
#: The file name endings of shards, HDF5's then Arrow's and Parquet's.
SHARD_SUFFIXES = HDF5_SUFFIXES + ARROW_SUFFIXES


def sha256_of(path: str | os.PathLike[str]) -> str:
    """The SHA-256 (hex) of the file at ``path``, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def shard_files(folder: Path) -> tuple[str, list[Path]]:
    """The format and the shard files of ``folder`` (recursively, sorted by their path relative
    to it): HDF5 files, else Arrow IPC and Parquet files; a folder that mixes them, or holds
    neither, is refused."""
    if not folder.is_dir():
        raise DataFileNotFoundError(f"{folder}: is not a directory of shards", folder)
    found = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != INDEX_NAME)
    hdf5 = [p for p in found if shard_kind(p.name) == "hdf5"]
    arrow = [p for p in found if shard_kind(p.name) == "arrow"]
    if hdf5 and arrow:
        raise DataFileNotFoundError(
            f"{folder}: holds both HDF5 ({hdf5[0].name}) and Arrow/Parquet ({arrow[0].name}) "
            "shards; one index describes shards of one format",
            folder,
        )
    if not hdf5 and not arrow:
        raise DataFileNotFoundError(
            f"{folder}: holds no shard ({', '.join(SHARD_SUFFIXES)})", folder
        )
    return ("hdf5", hdf5) if hdf5 else ("arrow", arrow)


def build_index(folder: str | os.PathLike[str]) -> DatasetIndex:
    """The index of the shards in ``folder`` (see :func:`shard_files`), every shard read by its
    reader, which validates it as a dataset created over it would."""
    root = Path(folder)
    kind, files = shard_files(root)
    return index_of(root, kind, files)


def index_of(root: Path, kind: str, files: Sequence[Path]) -> DatasetIndex:
    """The index of ``files`` (``kind`` ``hdf5`` or ``arrow``, all under ``root``, in sample
    order), with paths relative to ``root``: for a folder that holds other files too."""
    dataset: ShardedDataset = HDF5Dataset(files) if kind == "hdf5" else ArrowDataset(files, cache_dir=False)
    try:
        sizes = [int(n) for n in (dataset._shard_starts[1:] - dataset._shard_starts[:-1])]
        shards = tuple(
            ShardEntry(file.relative_to(root).as_posix(), samples, file.stat().st_size, sha256_of(file))
            for file, samples in zip(files, sizes, strict=True)
        )
        return DatasetIndex(kind, dataset.fields, dataset.length_field, shards, dataset.lengths)
    finally:
        dataset.close()


def shard_kind(name: str) -> str | None:
    """``hdf5`` or ``arrow`` for a shard's file name by its suffix, else ``None``."""
    if name.endswith(HDF5_SUFFIXES):
        return "hdf5"
    return "arrow" if name.endswith(ARROW_SUFFIXES) else None


def describe_shard(path: Path, kind: str) -> tuple[dict[str, Field], str | None, npt.NDArray[np.int64]]:
    """The fields, length field and per-sample lengths of one shard file, read by its reader
    (which validates it), for an index built one shard at a time."""
    dataset: ShardedDataset = HDF5Dataset([path]) if kind == "hdf5" else ArrowDataset([path], cache_dir=False)
    try:
        return dataset.fields, dataset.length_field, np.array(dataset.lengths, dtype=np.int64)
    finally:
        dataset.close()


def write_index(folder: str | os.PathLike[str], index: DatasetIndex) -> Path:
    """Write ``index`` as ``folder/fastload-index.json``, atomically (a reader sees the old
    index or the new one, never a part), with the mode a shard written there gets (``0666``
    less the umask; ``mkstemp`` alone would leave it ``0600``, unreadable to the shards'
    other readers)."""
    final = Path(folder) / INDEX_NAME
    handle, temporary = tempfile.mkstemp(prefix=f".{INDEX_NAME}.", dir=final.parent)
    try:
        os.fchmod(handle, 0o666 & ~_umask())
        with os.fdopen(handle, "wb") as out:
            out.write(index.to_json())
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, final)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return final


def _umask() -> int:
    """The process's umask, read without changing it where Linux reports it (setting it to
    read it back would race with files other threads create meanwhile)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


__all__ = ["SHARD_SUFFIXES", "build_index", "describe_shard", "index_of", "sha256_of", "shard_files", "shard_kind", "write_index"]
