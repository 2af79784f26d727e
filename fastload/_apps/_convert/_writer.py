"""Streaming writer of the fastload HDF5 layout (../shared/DESIGN.md).

Why two steps: a memory-mappable dataset must be *contiguous*, and a contiguous HDF5 dataset
cannot grow, yet the number of tokens is known only at the end of the input. So samples are
first appended to raw *spool* files (one per array, in the temporary folder beside the output),
then each shard's file is created with datasets of the now-known sizes and filled from the
spools: by a kernel-side copy into the dataset's storage when the spool already holds the stored
bytes, else converted in blocks (``_shard_file.py``). Memory stays at a few blocks whatever the
input size; disk briefly holds the spools plus one finished shard.

Deferring the file creation also lets the dtype of token ids whose vocabulary is unknown (JSON
id lists, a user's function) be the smallest that holds every id of every shard, so all shards
share one dtype.

The output is deterministic: no timestamps are stored (h5py creates datasets without them),
attributes are written in a fixed order and hold no time or process data.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from fastload._apps._convert._convert_options import Compression
from fastload._apps._convert._model import Encoded
from fastload._apps._convert._shard_file import (
    FieldLayout,
    ShardCounts,
    ShardJob,
    SpoolData,
    remove_spools,
    write_shard,
)
from fastload.errors import DataFormatError

#: Largest magnitude float64 holds every integer of.
_EXACT_FLOAT_INT = 2**53

#: Writes every job's shard and returns the counts in job order: one after another here, in
#: parallel by ``--engine ray``. Any runner gives the same bytes.
ShardRunner = Callable[[Sequence[ShardJob]], list[ShardCounts]]


def write_in_order(jobs: Sequence[ShardJob]) -> list[ShardCounts]:
    """The local runner: each shard in this process, in order, its spools deleted once it is
    written (so that disk holds the spools plus one finished shard)."""
    counts = []
    for job in jobs:
        counts.append(write_shard(job))
        remove_spools(job)
    return counts


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

    def data(self) -> SpoolData:
        """The finished spool, for reading (call after :meth:`close`)."""
        return SpoolData(self.path, self.dtype, self.rows)


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
        self,
        paths: list[Path],
        attrs: Mapping[str, object],
        *,
        compression: Compression,
        run: ShardRunner = write_in_order,
    ) -> list[ShardCounts]:
        """Write shard ``i`` to ``paths[i]`` (as many paths as :attr:`shards`) with ``attrs``
        plus its own counts, by ``run``, which deletes each shard's spools once it is written;
        returns each shard's counts."""
        self.close()
        layout = tuple(
            FieldLayout(f.name, f.kind == "ragged", self.stored_dtype(f), f.row_shape)
            for f in self.fields
        )
        num_shards = len(self.shards) if self.shard_size is not None else None
        jobs = [
            ShardJob(
                path=path,
                index=index,
                num_shards=num_shards,
                num_samples=shard.num_samples,
                fields=layout,
                primary=self.primary,
                values={name: spool.data() for name, spool in shard.values.items()},
                lengths={name: spool.data() for name, spool in shard.lengths.items()},
                attrs=dict(attrs),
                compression=compression,
            )
            for index, (shard, path) in enumerate(zip(self.shards, paths, strict=True))
        ]
        return run(jobs)
