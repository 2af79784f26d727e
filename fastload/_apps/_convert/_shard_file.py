"""Writing one shard's HDF5 file from its spools: a pure function of a picklable
:class:`ShardJob`, so that shards can be written one after another by the converter or in
parallel by other processes (``--engine ray``) with the same bytes.

Datasets are created with the sizes the spools hold; a dataset whose spool already holds the
stored bytes is filled by a kernel-side copy into its storage, others are converted in blocks of
:data:`COPY_BYTES`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import h5py
import numpy as np

from fastload._apps._convert._convert_options import LENGTHS_NAME, Compression

#: Bytes read from a spool per copy step: large enough for full-speed HDF5 writes, small
#: enough to keep the writer's memory to a few blocks.
COPY_BYTES = 4 << 20
#: Target bytes of one HDF5 chunk of a compressed dataset: small enough that reading one
#: sample decompresses little, large enough that the chunk index stays small.
CHUNK_BYTES = 64 << 10


class ShardCounts(NamedTuple):
    samples: int
    #: Elements per ragged field.
    tokens: dict[str, int]


@dataclass(frozen=True)
class SpoolData:
    """A finished spool: ``rows`` rows of ``dtype`` in the raw file ``path``."""

    path: Path
    dtype: np.dtype
    rows: int

    def read(self, start: int, stop: int, row_shape: tuple[int, ...] = ()) -> np.ndarray:
        """Rows ``start:stop``, each of ``row_shape``."""
        row_items = int(np.prod(row_shape, dtype=np.int64))
        offset = start * row_items * self.dtype.itemsize
        flat = np.fromfile(
            self.path, dtype=self.dtype, count=(stop - start) * row_items, offset=offset
        )
        return flat.reshape((stop - start, *row_shape))

    def blocks(self, row_shape: tuple[int, ...] = ()) -> list[tuple[int, int]]:
        """Row ranges of about :data:`COPY_BYTES` each, covering every row."""
        row_bytes = self.dtype.itemsize * int(np.prod(row_shape, dtype=np.int64))
        step = max(1, COPY_BYTES // max(1, row_bytes))
        return [(a, min(a + step, self.rows)) for a in range(0, self.rows, step)]


@dataclass(frozen=True)
class FieldLayout:
    """How one field is stored: ``ragged`` (values + offsets) or fixed rows of ``row_shape``."""

    name: str
    ragged: bool
    dtype: np.dtype
    row_shape: tuple[int, ...] = ()


@dataclass(frozen=True)
class ShardJob:
    """Everything needed to write shard ``index`` to ``path``: its spools (``values`` per
    field, ``lengths`` per ragged field), the stored layout, and the attributes. ``num_shards``
    is None for a single-file output, which records no shard numbering."""

    path: Path
    index: int
    num_shards: int | None
    num_samples: int
    fields: tuple[FieldLayout, ...]
    primary: str | None
    values: Mapping[str, SpoolData]
    lengths: Mapping[str, SpoolData]
    attrs: Mapping[str, object]
    compression: Compression


def write_shard(job: ShardJob) -> ShardCounts:
    """Write ``job.path`` (created or truncated); returns the shard's counts. The output
    depends on the job alone: no time, process or path data is stored."""
    tokens = {f.name: job.values[f.name].rows for f in job.fields if f.ragged}
    splices: list[tuple[int, SpoolData]] = []
    with h5py.File(job.path, "w") as out:
        out.attrs["fastload_format"] = 1
        out.attrs["num_samples"] = job.num_samples
        if job.num_shards is not None:
            out.attrs["shard_index"] = job.index
            out.attrs["num_shards"] = job.num_shards
        out.attrs["num_tokens"] = json.dumps(tokens)
        for key, value in job.attrs.items():
            out.attrs[key] = value
        for f in job.fields:
            spool = job.values[f.name]
            if f.ragged:
                group = out.create_group(f.name)
                splices += _copy(group, "values", spool, f.dtype, (), job.compression)
                _write_offsets(group, job.lengths[f.name])
            else:
                splices += _copy(out, f.name, spool, f.dtype, f.row_shape, job.compression)
        if job.primary is not None:
            lengths = job.lengths[job.primary]
            splices += _copy(out, LENGTHS_NAME, lengths, lengths.dtype, (), Compression())
            out[LENGTHS_NAME].attrs["field"] = job.primary  # what the reader looks for
    _splice(job.path, splices)
    return ShardCounts(job.num_samples, tokens)


def remove_spools(job: ShardJob) -> None:
    """Delete the spool files of a written shard."""
    for spool in (*job.values.values(), *job.lengths.values()):
        spool.path.unlink(missing_ok=True)


def _create(
    parent: h5py.Group, name: str, shape: tuple[int, ...], dtype: np.dtype, compression: Compression
) -> h5py.Dataset:
    if compression.kind == "none" or shape[0] == 0:
        return parent.create_dataset(name, shape=shape, dtype=dtype)  # contiguous
    row_bytes = dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
    chunk_rows = int(min(shape[0], max(1, CHUNK_BYTES // max(1, row_bytes))))
    options = {"compression_opts": compression.level} if compression.kind == "gzip" else {}
    return parent.create_dataset(
        name,
        shape=shape,
        dtype=dtype,
        chunks=(chunk_rows, *shape[1:]),
        compression=compression.kind,
        **options,
    )


def _copy(
    parent: h5py.Group,
    name: str,
    spool: SpoolData,
    dtype: np.dtype,
    row_shape: tuple[int, ...],
    compression: Compression,
) -> list[tuple[int, SpoolData]]:
    """Create dataset ``name`` from ``spool``. When the spool already holds the stored bytes
    (same dtype, no compression), only the dataset's storage is reserved here and its byte
    offset returned, for :func:`_splice` to fill once HDF5 has closed the file; otherwise the
    rows are converted and written through h5py in blocks."""
    shape = (spool.rows, *row_shape)
    if compression.kind == "none" and spool.rows and dtype == spool.dtype:
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)  # the storage exists, at a known offset
        dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)  # and HDF5 never writes into it
        dataset = parent.create_dataset(name, shape=shape, dtype=dtype, dcpl=dcpl)
        return [(dataset.id.get_offset(), spool)]
    dataset = _create(parent, name, shape, dtype, compression)
    for start, stop in spool.blocks(row_shape):
        dataset[start:stop] = spool.read(start, stop, row_shape).astype(dtype, copy=False)
    return []


def _splice(path: Path, splices: list[tuple[int, SpoolData]]) -> None:
    """Copy each spool's bytes into ``path`` at its dataset's offset: a contiguous dataset's
    storage is exactly its raw bytes, so this is what h5py would write, minus the read into
    this process and the write back (``copy_file_range`` copies inside the kernel)."""
    with path.open("r+b") as out:
        for offset, spool in splices:
            size = spool.path.stat().st_size
            with spool.path.open("rb") as source:
                _copy_range(source.fileno(), out.fileno(), size, offset)


def _copy_range(source: int, target: int, size: int, offset: int) -> None:
    done = 0
    kernel_copy = getattr(os, "copy_file_range", None)
    while done < size and kernel_copy is not None:
        try:
            copied = kernel_copy(source, target, size - done, done, offset + done)
        except OSError:  # not supported by this filesystem or kernel: copy through memory
            break
        if copied == 0:
            break
        done += copied
    while done < size:
        block = os.pread(source, min(COPY_BYTES, size - done), done)
        if not block:
            raise OSError(f"spool ended {size - done} bytes early")
        done += os.pwrite(target, block, offset + done)


def _write_offsets(group: h5py.Group, lengths: SpoolData) -> None:
    offsets = group.create_dataset("offsets", shape=(lengths.rows + 1,), dtype=np.int64)
    offsets[0] = 0
    carry = 0
    for start, stop in lengths.blocks():
        ends = carry + np.cumsum(lengths.read(start, stop), dtype=np.int64)
        offsets[start + 1 : stop + 1] = ends
        carry = int(ends[-1])
