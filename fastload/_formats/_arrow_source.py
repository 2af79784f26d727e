"""Opening one Arrow IPC file, Arrow IPC stream or Parquet file as a sequence of *segments*
(record batches, or Parquet row groups) with random access to each.

IPC files and streams are memory-mapped. When uncompressed, decoding a record batch only
points Arrow at the mapping, so every batch is decoded once at open and kept: zero-copy, no
memory of its own. Compressed IPC (Feather v2 defaults to LZ4) and Parquet must decode, so their
segments are decoded on demand (the caller caches them).
"""

from __future__ import annotations

import abc
from typing import Protocol

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.parquet as pq

from fastload._formats._sniff import describe, sniff
from fastload.errors import DataFormatError

# What a damaged Arrow or Parquet file makes pyarrow raise.
ARROW_ERRORS: tuple[type[BaseException], ...] = (pa.ArrowException, OSError)


class Segments(Protocol):
    """One shard as segments; see the module docstring."""

    schema: pa.Schema
    rows: npt.NDArray[np.int64]
    mapped_file: pa.Buffer | None
    """The whole file's mapping, when every segment is a zero-copy view of it (see
    :meth:`kept`)."""

    def kept(self) -> list[pa.RecordBatch]:
        """All segments, already decoded; only when :attr:`mapped_file` is set."""
        ...

    def decode(self, segment: int, columns: list[str]) -> pa.RecordBatch:
        """Segment ``segment`` with at least the top-level ``columns``."""
        ...

    def may_hold_nulls(self, segment: int, column: str) -> bool:
        """Whether checking segment ``segment`` of top-level ``column`` for nulls at construction
        is worthwhile (False when it surely has none, or when only decoding could tell)."""
        ...

    def close(self) -> None: ...


def open_segments(path: str) -> Segments:
    """Open ``path`` by its signature, raising :class:`DataFormatError` for anything else or a
    truncated or damaged file."""
    fmt = sniff(path)
    try:
        if fmt == "arrow-file":
            return _IpcFile(path)
        if fmt == "arrow-stream":
            return _IpcStream(path)
        if fmt == "parquet":
            return _Parquet(path)
    except ARROW_ERRORS as exc:
        raise DataFormatError(
            f"{path}: cannot be read as {describe(fmt).split(' (')[0]}; it is truncated or"
            f" damaged ({type(exc).__name__}: {exc})"
        ) from exc
    raise DataFormatError(f"{path}: not an Arrow or Parquet file: it is {describe(fmt)}")


def _whole(source: pa.MemoryMappedFile) -> pa.Buffer:
    source.seek(0)
    buffer = source.read_buffer()
    source.seek(0)
    return buffer


def _inside(batch: pa.RecordBatch, file: pa.Buffer) -> bool:
    """Whether every buffer of ``batch`` points into ``file`` (it was not decompressed)."""
    low, high = file.address, file.address + file.size
    for column in batch.columns:
        for buffer in column.buffers():
            if buffer is not None and buffer.size and not low <= buffer.address < high:
                return False
    return True


class _Batches(abc.ABC):
    """Shared by the IPC readers: keep zero-copy batches, or only their row counts."""

    schema: pa.Schema
    rows: npt.NDArray[np.int64]
    mapped_file: pa.Buffer | None

    def _index(self, source: pa.MemoryMappedFile, count: int) -> None:
        file = _whole(source)
        first = self._decode(0) if count else None
        self.mapped_file = file if first is None or _inside(first, file) else None
        if self.mapped_file is not None:
            self._kept = [self._decode(i) for i in range(count)]
            self.rows = np.array([b.num_rows for b in self._kept], np.int64)
        else:
            # Compressed: decode each batch once, for its row count only.
            self._kept = []
            self.rows = np.array([self._decode(i).num_rows for i in range(count)], np.int64)

    @abc.abstractmethod
    def _decode(self, segment: int) -> pa.RecordBatch:
        """Record batch ``segment`` of the file, decoded."""

    def kept(self) -> list[pa.RecordBatch]:
        return self._kept

    def decode(self, segment: int, columns: list[str]) -> pa.RecordBatch:
        return self._kept[segment] if self._kept else self._decode(segment)

    def may_hold_nulls(self, segment: int, column: str) -> bool:
        # Null counts are batch metadata: checking costs nothing when the batches are mapped,
        # and one decoding pass at construction when they are compressed.
        return True


class _IpcFile(_Batches):
    def __init__(self, path: str) -> None:
        self._source = pa.memory_map(path, "r")
        self._reader = pa.ipc.open_file(self._source)
        self.schema = self._reader.schema
        self._index(self._source, self._reader.num_record_batches)

    def _decode(self, segment: int) -> pa.RecordBatch:
        return self._reader.get_batch(segment)

    def close(self) -> None:
        self._kept = []
        self._source.close()


class _IpcStream(_Batches):
    """A stream has no index of its batches; its messages are read once, zero-copy from the
    mapping, and each record batch message is decoded when needed."""

    def __init__(self, path: str) -> None:
        self._source = pa.memory_map(path, "r")
        reader = pa.ipc.MessageReader.open_stream(self._source)
        first = reader.read_next_message()
        if first.type != "schema":
            raise DataFormatError(
                f"{path}: the stream starts with a {first.type!r} message, not a schema"
            )
        self.schema = pa.ipc.read_schema(first)
        self._messages: list[pa.ipc.Message] = []
        while True:
            try:
                message = reader.read_next_message()
            except StopIteration:
                break
            if message.type != "record batch":
                raise DataFormatError(
                    f"{path}: message {len(self._messages) + 1} is a {message.type!r};"
                    " dictionary-encoded columns are not supported (cast them to plain types)"
                )
            self._messages.append(message)
        self._index(self._source, len(self._messages))

    def _decode(self, segment: int) -> pa.RecordBatch:
        return pa.ipc.read_record_batch(self._messages[segment], self.schema)

    def close(self) -> None:
        self._kept = []
        self._messages = []
        self._source.close()


class _Parquet:
    """Row groups, decoded on demand with only the columns asked for."""

    mapped_file = None

    def __init__(self, path: str) -> None:
        self._file = pq.ParquetFile(path, memory_map=True)
        self.schema = self._file.schema_arrow
        metadata = self._file.metadata
        self.rows = np.array(
            [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)], np.int64
        )

    def kept(self) -> list[pa.RecordBatch]:
        return []

    def may_hold_nulls(self, segment: int, column: str) -> bool:
        # Statistics count an empty list as a null of its leaf column, so they are conclusive
        # only for leaves outside lists; nulls inside lists are found when the rows are read.
        group = self._file.metadata.row_group(segment)
        for j in range(group.num_columns):
            chunk = group.column(j)
            parts = chunk.path_in_schema.split(".")
            if parts[0] != column or "list" in parts[1:]:
                continue
            stats = chunk.statistics
            if stats is not None and stats.has_null_count and stats.null_count > 0:
                return True
        return False

    def decode(self, segment: int, columns: list[str]) -> pa.RecordBatch:
        # One thread: this runs inside a loader's worker processes, one per core already.
        table = self._file.read_row_group(segment, columns=columns, use_threads=False)
        batches = table.combine_chunks().to_batches()
        if batches:
            return batches[0]
        return pa.RecordBatch.from_pylist([], schema=table.schema)

    def close(self) -> None:
        self._file.close()
