"""Streaming writer of the fastload HDF5 layout (../shared/DESIGN.md).

Why two steps: a memory-mappable dataset must be *contiguous*, and a contiguous HDF5 dataset
cannot grow, yet the number of tokens is known only at the end of the input. So samples are
first appended to raw *spool* files (one per array, in the temporary folder beside the output),
then each shard's file is created with datasets of the now-known sizes and filled from the
spools: by a kernel-side copy into the dataset's storage when the spool already holds the stored
bytes, else converted in blocks of :data:`COPY_BYTES`. Memory stays at a few blocks whatever the
input size; disk briefly holds the spools plus one finished shard.

Deferring the file creation also lets the dtype of token ids whose vocabulary is unknown (JSON
id lists, a user's function) be the smallest that holds every id of every shard, so all shards
share one dtype.

The output is deterministic: no timestamps are stored (h5py creates datasets without them),
attributes are written in a fixed order and hold no time or process data.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, NamedTuple

import h5py
import numpy as np

from fastload._convert._model import Encoded
from fastload._convert._options import LENGTHS_NAME, Compression
from fastload.errors import DataFormatError

#: Bytes read from a spool per copy step: large enough for full-speed HDF5 writes, small
#: enough to keep the writer's memory to a few blocks.
COPY_BYTES = 4 << 20
#: Target bytes of one HDF5 chunk of a compressed dataset: small enough that reading one
#: sample decompresses little, large enough that the chunk index stays small.
CHUNK_BYTES = 64 << 10
#: Largest magnitude float64 holds every integer of.
_EXACT_FLOAT_INT = 2**53


class ShardCounts(NamedTuple):
    samples: int
    #: Elements per ragged field.
    tokens: dict[str, int]


@dataclass(frozen=True)
class OutputField:
    """A field of the output. ``spool_dtype`` is how values wait on disk; ``vocab_size``
    fixes the dtype of token ids in advance; ``numbers`` marks record scalars, spooled as
    float64 and stored as int64 when every value is an integer."""

    name: str
    kind: Literal["ragged", "fixed"]
    spool_dtype: np.dtype
    row_shape: tuple[int, ...] = ()
    vocab_size: int | None = None
    numbers: bool = False


@dataclass
class _Range:
    """What the values of one field spanned, to choose the stored dtype at the end."""

    low: float = np.inf
    high: float = -np.inf
    integral: bool = True

    def update(self, values: np.ndarray) -> None:
        if values.size == 0:
            return
        self.low = min(self.low, float(values.min()))
        self.high = max(self.high, float(values.max()))
        if values.dtype.kind == "f" and self.integral:
            finite = np.isfinite(values).all()
            self.integral = bool(finite and (values == np.round(values)).all())


def smallest_int_dtype(low: float, high: float) -> np.dtype:
    """The smallest unsigned (if ``low >= 0``) or signed integer dtype holding [low, high]."""
    candidates = (
        ("uint8", "uint16", "uint32", "uint64") if low >= 0 else ("int8", "int16", "int32", "int64")
    )
    for name in candidates:
        info = np.iinfo(name)
        if info.min <= low and high <= info.max:
            return np.dtype(name)
    return np.dtype("int64")


class _Spool:
    """An append-only raw array file."""

    def __init__(self, path: Path, dtype: np.dtype) -> None:
        self.path = path
        self.dtype = dtype
        self.rows = 0
        self._file = path.open("wb")

    def append(self, array: np.ndarray) -> None:
        data = np.ascontiguousarray(array, dtype=self.dtype)
        self._file.write(data.data)  # buffered; ndarray.tofile costs a flush and a syscall a call
        self.rows += data.shape[0]

    def close(self) -> None:
        self._file.close()

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


@dataclass
class _Shard:
    """The spools of one output shard: ``values`` per field, ``lengths`` per ragged field."""

    num_samples: int = 0
    values: dict[str, _Spool] = field(default_factory=dict)
    lengths: dict[str, _Spool] = field(default_factory=dict)


def _rows(encoded: Encoded, start: int, stop: int) -> Encoded:
    """Samples ``start:stop`` of ``encoded`` (stats are left with the caller)."""
    ragged = {}
    for name, (values, lengths) in encoded.ragged.items():
        ends = np.cumsum(lengths)
        a = int(ends[start - 1]) if start else 0
        b = int(ends[stop - 1]) if stop else 0
        ragged[name] = (values[a:b], lengths[start:stop])
    fixed = {name: rows[start:stop] for name, rows in encoded.fixed.items()}
    return Encoded(ragged, fixed, encoded.stats)


class SpoolWriter:
    """Receives :class:`Encoded` blocks in output order, cuts them into shards of
    ``shard_size`` samples, and at :meth:`finish` writes each shard's HDF5 file."""

    def __init__(
        self,
        folder: Path,
        fields: list[OutputField],
        *,
        primary: str | None,
        shard_size: int | None,
        dtype_override: np.dtype | None,
    ) -> None:
        self.folder = folder
        self.fields = fields
        self.primary = primary
        self.shard_size = shard_size
        self.dtype_override = dtype_override
        self.shards: list[_Shard] = []
        self.ranges = {f.name: _Range() for f in fields}

    def _open_shard(self) -> _Shard:
        index = len(self.shards)
        shard = _Shard()
        for position, f in enumerate(self.fields):
            stem = self.folder / f"spool-{index:05d}-{position}"
            shard.values[f.name] = _Spool(stem.with_suffix(".values"), f.spool_dtype)
            if f.kind == "ragged":
                shard.lengths[f.name] = _Spool(stem.with_suffix(".lengths"), np.dtype(np.int64))
        self.shards.append(shard)
        return shard

    def _current(self) -> _Shard:
        shard = self.shards[-1] if self.shards else self._open_shard()
        if self.shard_size is not None and shard.num_samples >= self.shard_size:
            for spool in (*shard.values.values(), *shard.lengths.values()):
                spool.close()
            shard = self._open_shard()
        return shard

    def append(self, encoded: Encoded) -> None:
        total = encoded.num_samples
        start = 0
        while start < total:
            shard = self._current()
            room = total - start if self.shard_size is None else self.shard_size - shard.num_samples
            stop = min(total, start + room)
            self._write(
                shard, _rows(encoded, start, stop) if (start, stop) != (0, total) else encoded
            )
            start = stop

    def _write(self, shard: _Shard, encoded: Encoded) -> None:
        for f in self.fields:
            if f.kind == "ragged":
                values, lengths = encoded.ragged[f.name]
                shard.lengths[f.name].append(lengths)
            else:
                values = encoded.fixed[f.name]
            if f.vocab_size is None:  # a known vocabulary fixes the dtype without a scan
                self.ranges[f.name].update(values)
            if values.dtype.kind in "iuf" and f.spool_dtype.kind in "iu":
                self._check_fits(f, values)
            shard.values[f.name].append(values)
        shard.num_samples += encoded.num_samples

    def _check_fits(self, f: OutputField, values: np.ndarray) -> None:
        if values.size == 0 or values.dtype == f.spool_dtype:
            return
        info = np.iinfo(f.spool_dtype)
        low, high = values.min(), values.max()
        if low < info.min or high > info.max:
            bad = high if high > info.max else low
            source = (
                f"--dtype {f.spool_dtype}"
                if self.dtype_override is not None
                else f"a vocabulary of {f.vocab_size}"
            )
            raise DataFormatError(
                f"field {f.name!r}: token id {bad} does not fit {source} "
                f"(range {info.min}..{info.max}); pass a wider --dtype"
            )

    def close(self) -> None:
        """Close every spool file (idempotent); the temporary folder's owner deletes them."""
        for shard in self.shards:
            for spool in (*shard.values.values(), *shard.lengths.values()):
                spool.close()

    def stored_dtype(self, f: OutputField) -> np.dtype:
        """The dtype ``f`` is stored with, from the values seen (call after the last append)."""
        span = self.ranges[f.name]
        if f.numbers:
            fits = span.integral and max(abs(span.low), abs(span.high)) <= _EXACT_FLOAT_INT
            return np.dtype(np.int64) if fits or span.low > span.high else np.dtype(np.float64)
        if f.kind == "ragged" and f.spool_dtype.kind in "iu":
            if self.dtype_override is not None:
                return self.dtype_override
            if f.vocab_size is not None:
                return smallest_int_dtype(0, f.vocab_size - 1)
            return smallest_int_dtype(*(0, 0) if span.low > span.high else (span.low, span.high))
        return f.spool_dtype

    def finish(
        self, paths: list[Path], attrs: Mapping[str, object], *, compression: Compression
    ) -> list[ShardCounts]:
        """Write shard ``i`` to ``paths[i]`` (as many paths as :attr:`shards`) with ``attrs``
        plus its own counts; returns each shard's counts."""
        self.close()
        dtypes = {f.name: self.stored_dtype(f) for f in self.fields}
        counts = []
        for index, (shard, path) in enumerate(zip(self.shards, paths, strict=True)):
            counts.append(self._write_shard(shard, index, path, attrs, dtypes, compression))
            for spool in (*shard.values.values(), *shard.lengths.values()):
                spool.path.unlink()
        return counts

    def _write_shard(
        self,
        shard: _Shard,
        index: int,
        path: Path,
        attrs: Mapping[str, object],
        dtypes: dict[str, np.dtype],
        compression: Compression,
    ) -> ShardCounts:
        tokens = {f.name: shard.values[f.name].rows for f in self.fields if f.kind == "ragged"}
        splices: list[tuple[int, _Spool]] = []
        with h5py.File(path, "w") as out:
            out.attrs["fastload_format"] = 1
            out.attrs["num_samples"] = shard.num_samples
            if self.shard_size is not None:
                out.attrs["shard_index"] = index
                out.attrs["num_shards"] = len(self.shards)
            out.attrs["num_tokens"] = json.dumps(tokens)
            for key, value in attrs.items():
                out.attrs[key] = value
            for f in self.fields:
                spool = shard.values[f.name]
                if f.kind == "ragged":
                    group = out.create_group(f.name)
                    splices += _copy(group, "values", spool, dtypes[f.name], (), compression)
                    _write_offsets(group, shard.lengths[f.name])
                else:
                    splices += _copy(out, f.name, spool, dtypes[f.name], f.row_shape, compression)
            if self.primary is not None:
                lengths = shard.lengths[self.primary]
                splices += _copy(out, LENGTHS_NAME, lengths, lengths.dtype, (), Compression())
                out[LENGTHS_NAME].attrs["field"] = self.primary  # what the reader looks for
        _splice(path, splices)
        return ShardCounts(shard.num_samples, tokens)


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
    spool: _Spool,
    dtype: np.dtype,
    row_shape: tuple[int, ...],
    compression: Compression,
) -> list[tuple[int, _Spool]]:
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


def _splice(path: Path, splices: list[tuple[int, _Spool]]) -> None:
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


def _write_offsets(group: h5py.Group, lengths: _Spool) -> None:
    offsets = group.create_dataset("offsets", shape=(lengths.rows + 1,), dtype=np.int64)
    offsets[0] = 0
    carry = 0
    for start, stop in lengths.blocks():
        ends = carry + np.cumsum(lengths.read(start, stop), dtype=np.int64)
        offsets[start + 1 : stop + 1] = ends
        carry = int(ends[-1])
