"""Columnar inputs: Parquet, Arrow IPC files and streams (Hugging Face ``save_to_disk`` folders
hold Arrow streams). Read in record batches of a bounded number of rows; token-id lists and
numbers move as arrays, never as per-element Python objects."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from fastload._apps._convert._discover import InputFile
from fastload._apps._convert._model import (
    EMPTY_INPUT,
    Column,
    FieldPlan,
    IdsColumn,
    NoticeChunk,
    RecordKind,
    RowsChunk,
    ScalarColumn,
)
from fastload.errors import DataFormatError

#: Bytes an Arrow IPC *file* (as opposed to a stream) starts with.
ARROW_FILE_MAGIC = b"ARROW1"
_EXACT_FLOAT_INT = 2**53


def arrow_kind(data_type: pa.DataType) -> RecordKind | None:
    """How a column of ``data_type`` is stored, or None if it cannot be."""
    if pa.types.is_dictionary(data_type):
        data_type = data_type.value_type
    if (
        pa.types.is_string(data_type)
        or pa.types.is_large_string(data_type)
        or pa.types.is_string_view(data_type)
    ):
        return "text"
    if (pa.types.is_list(data_type) or pa.types.is_large_list(data_type)) and pa.types.is_integer(
        data_type.value_type
    ):
        return "ids"
    if (
        pa.types.is_integer(data_type)
        or pa.types.is_floating(data_type)
        or pa.types.is_boolean(data_type)
    ):
        return "scalar"
    return None


def schema_of(file: InputFile) -> pa.Schema:
    if file.format == "parquet":
        return pq.ParquetFile(file.path).schema_arrow
    with pa.memory_map(str(file.path)) as source:
        if source.read(len(ARROW_FILE_MAGIC)) == ARROW_FILE_MAGIC:
            source.seek(0)
            return pa.ipc.open_file(source).schema
        source.seek(0)
        return pa.ipc.open_stream(source).schema


def _batches(file: InputFile, sources: list[str], rows: int) -> Iterator[pa.RecordBatch]:
    if file.format == "parquet":
        yield from pq.ParquetFile(file.path).iter_batches(batch_size=rows, columns=sources)
        return
    with pa.memory_map(str(file.path)) as source:
        is_file = source.read(len(ARROW_FILE_MAGIC)) == ARROW_FILE_MAGIC
        source.seek(0)
        if is_file:
            reader = pa.ipc.open_file(source)
            stored = (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:
            stored = iter(pa.ipc.open_stream(source))
        for batch in stored:  # memory-mapped: slicing copies nothing
            for start in range(0, batch.num_rows, rows):
                yield batch.slice(start, rows).select(sources)


def _column(array: pa.Array, plan: FieldPlan, file: InputFile) -> Column:
    if pa.types.is_dictionary(array.type):
        array = array.dictionary_decode()
    valid = np.asarray(array.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    if plan.kind == "text":
        return array.to_pylist()
    if plan.kind == "ids":
        values = array.flatten()  # skips the contents of null lists, honours slicing
        if values.null_count:
            raise DataFormatError(
                f"{file.display}: column {plan.source!r} has null token ids inside its lists"
            )
        lengths = pc.fill_null(pc.list_value_length(array), 0).to_numpy(zero_copy_only=False)
        ids = values.to_numpy(zero_copy_only=False)
        if ids.dtype == np.uint64 and ids.size and ids.max() > np.iinfo(np.int64).max:
            raise DataFormatError(
                f"{file.display}: column {plan.source!r} has token ids beyond int64"
            )
        return IdsColumn(
            ids.astype(np.int64, copy=False), lengths.astype(np.int64, copy=False), valid
        )
    if pa.types.is_integer(array.type) and len(array) > array.null_count:
        extremes = pc.min_max(array)
        if max(abs(extremes["min"].as_py()), abs(extremes["max"].as_py())) > _EXACT_FLOAT_INT:
            raise DataFormatError(
                f"{file.display}: column {plan.source!r} has integers beyond 2**53, which cannot be stored exactly"
            )
    numbers = pc.fill_null(array.cast(pa.float64()), 0.0).to_numpy(zero_copy_only=False)
    return ScalarColumn(numbers, valid)


def _num_rows(file: InputFile) -> int:
    if file.format == "parquet":
        return int(pq.ParquetFile(file.path).metadata.num_rows)
    with pa.memory_map(str(file.path)) as source:  # headers only: the data stays unread
        is_file = source.read(len(ARROW_FILE_MAGIC)) == ARROW_FILE_MAGIC
        source.seek(0)
        if is_file:
            reader = pa.ipc.open_file(source)
            return sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
        return sum(batch.num_rows for batch in pa.ipc.open_stream(source))


def table_chunks(
    file: InputFile, plans: tuple[FieldPlan, ...], rows: int
) -> Iterator[RowsChunk | NoticeChunk]:
    """``file`` in chunks of at most ``rows`` rows holding ``plans``' columns (a NoticeChunk if
    it has no rows). A column that is absent, or of another kind than in the first input,
    raises DataFormatError. Progress bytes are the file's size spread over its rows."""
    schema = schema_of(file)
    for plan in plans:
        if plan.source not in schema.names:
            raise DataFormatError(
                f"{file.display} has no column {plan.source!r} (columns: {', '.join(schema.names)})"
            )
        kind = arrow_kind(schema.field(plan.source).type)
        if kind != plan.kind:
            raise DataFormatError(
                f"{file.display}: column {plan.source!r} has type {schema.field(plan.source).type}, "
                f"but earlier inputs made it a {plan.kind} field"
            )
    total = _num_rows(file)
    if total == 0:
        yield NoticeChunk(file.display, EMPTY_INPUT, "no rows", file.size)
        return
    sources = list(dict.fromkeys(p.source for p in plans))
    position = 0
    for batch in _batches(file, sources, rows):
        columns = {p.source: _column(batch.column(p.source), p, file) for p in plans}
        positions = np.arange(position, position + batch.num_rows, dtype=np.int64)
        done = position + batch.num_rows
        input_bytes = file.size * done // total - file.size * position // total
        position = done
        yield RowsChunk(file.display, positions, "row", columns, (), input_bytes)
