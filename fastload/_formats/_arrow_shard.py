"""One Arrow IPC or Parquet file opened in the current process."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from fastload._formats._arrow_check import check_batch
from fastload._formats._arrow_convert import (
    NullFill,
    check_fill,
    list_lengths,
    null_rows,
    to_column,
)
from fastload._formats._arrow_mapped import MappedColumn, build_mapped
from fastload._formats._arrow_schema import ArrowField, field_array
from fastload._formats._arrow_source import Segments, open_segments
from fastload._formats._block_cache import BlockCache
from fastload._formats._columns import group_positions, inverse_permutation, permute_column
from fastload._formats._mmap import SizeWatch
from fastload._formats._readahead import ByteRanges
from fastload._types import Column


class ArrowShard:
    """One Arrow/Parquet file opened in the current process: numeric fields of a memory-mapped
    file through :class:`MappedColumn`, every other field by Arrow's ``take`` on each record
    batch (or row group) the rows fall in, decoded segments going through ``cache``. Messages
    name the file ``shown`` (default ``path``). ``checked``: the mapped record batches passed
    their checks before (a remote shard checked when it entered the cache), so they are not
    checked again."""

    def __init__(
        self,
        path: str,
        shard: int,
        first_sample: int,
        fields: dict[str, ArrowField],
        null_fill: NullFill | None,
        cache: BlockCache[Any],
        shown: str | None = None,
        *,
        checked: bool = False,
    ) -> None:
        self._path = path if shown is None else shown
        self._shard = shard
        self._first_sample = first_sample
        self._fields = fields
        self._null_fill = null_fill
        self._cache = cache
        self._columns = sorted({spec.path[0] for spec in fields.values()})
        self._segments: Segments = open_segments(path)
        try:
            self._size = SizeWatch(path)
        except BaseException:
            self._segments.close()
            raise
        self._starts = np.concatenate([[0], np.cumsum(self._segments.rows)])[:-1].astype(np.int64)
        self._mapped: dict[str, MappedColumn] = {}
        file = self._segments.mapped_file
        if file is not None:
            views: dict[np.dtype, np.ndarray] = {}

            def view_of(dtype: np.dtype) -> np.ndarray:
                if dtype not in views:
                    views[dtype] = np.frombuffer(
                        file, dtype=dtype, count=file.size // dtype.itemsize
                    )
                return views[dtype]

            batches = self._segments.kept()
            if not checked:
                for s, batch in enumerate(batches):
                    self._check(s, batch)
            for name, spec in fields.items():
                arrays = [field_array(b, spec.path) for b in batches]
                mapped = build_mapped(spec, arrays, self._starts, file, view_of)
                if mapped is not None:
                    self._mapped[name] = mapped

    def read(self, field: str, rows: npt.NDArray[np.int64]) -> Column:
        mapped = self._mapped.get(field)
        if mapped is not None:
            return mapped.read(rows)
        spec = self._fields[field]
        segment = np.searchsorted(self._starts, rows, side="right") - 1
        order, groups = group_positions(segment)
        pieces = []
        for group in groups:
            s = int(segment[group[0]])
            array = field_array(self._segment(s), spec.path)
            pieces.append(array.take(pa.array(rows[group] - self._starts[s])))
        combined = pieces[0] if len(pieces) == 1 else pa.concat_arrays(pieces)
        samples = rows[order] + self._first_sample
        column = to_column(combined, spec, self._null_fill, samples, self._path)
        return permute_column(column, inverse_permutation(order))

    def byte_ranges(self, field: str, rows: npt.NDArray[np.int64]) -> ByteRanges | None:
        """Where the values of ``rows`` of ``field`` lie in the file, for a field read from
        the memory map (``None`` for one that Arrow reads)."""
        mapped = self._mapped.get(field)
        return None if mapped is None else mapped.byte_ranges(rows)

    def lengths(self, field: str) -> npt.NDArray[np.int64]:
        mapped = self._mapped.get(field)
        if mapped is not None:
            return mapped.lengths()
        spec = self._fields[field]
        parts = []
        for s in range(len(self._starts)):
            batch = self._segments.decode(s, [spec.path[0]])
            if self._segments.mapped_file is None:
                self._check(s, batch, {field: spec})
            array = field_array(batch, spec.path)
            rows = np.arange(len(array), dtype=np.int64) + self._starts[s] + self._first_sample
            parts.append(list_lengths(array, spec, self._null_fill, rows, self._path))
        return np.concatenate(parts) if parts else np.empty(0, np.int64)

    def check_mapped(self) -> None:
        """Raise :class:`DataFormatError` when the file shrank since pyarrow mapped it."""
        self._size.check()

    def close(self) -> None:
        self._mapped = {}
        self._segments.close()
        self._size.close()

    def _check(
        self, segment: int, batch: pa.RecordBatch, fields: dict[str, ArrowField] | None = None
    ) -> None:
        """Check a record batch once, as it is decoded in this process (``_arrow_check``)."""
        first = self._first_sample + int(self._starts[segment])
        check_batch(batch, self._fields if fields is None else fields, first, self._path)

    def _segment(self, segment: int) -> pa.RecordBatch:
        if self._segments.mapped_file is not None:
            return self._segments.decode(segment, self._columns)
        key = (self._shard, segment)
        batch = self._cache.get(key)
        if batch is None:
            batch = self._segments.decode(segment, self._columns)
            self._check(segment, batch)
            self._cache.put(key, batch, batch.nbytes)
        return batch


def check_nulls(
    segments: Segments,
    fields: dict[str, ArrowField],
    null_fill: NullFill | None,
    first_sample: int,
    path: str,
) -> None:
    """Raise for a null in one of ``fields`` when ``null_fill`` is not set, naming the sample
    (``first_sample`` is the shard's first sample index in the dataset); otherwise check that
    ``null_fill`` fits every field that has nulls."""
    columns = sorted({spec.path[0] for spec in fields.values()})
    start = first_sample
    for s, count in enumerate(segments.rows.tolist()):
        for spec in fields.values():
            if not segments.may_hold_nulls(s, spec.path[0]):
                continue
            mask = null_rows(field_array(segments.decode(s, columns), spec.path))
            if mask is None or not mask.any():
                continue
            where = f"{path}: field {spec.field.name!r}"
            if null_fill is None:
                where = f"{where}: sample {start + int(np.argmax(mask))} is null or holds a null"
            check_fill(null_fill, spec.field, where)
        start += count
