"""Record inputs to chunks, in the main process: text and JSON Lines in blocks of whole lines,
CSV/TSV parsed row by row, JSON arrays element by element, Arrow and Parquet in record batches.

The main process only cuts the input; parsing JSON Lines and everything after happens in the
workers. CSV is parsed here because a quoted field may span lines, so only a sequential reader
knows where a record starts.
"""

from __future__ import annotations

import _csv
import csv
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import numpy as np

from fastload._apps._convert._discover import InputFile
from fastload._apps._convert._model import (
    CSV_WIDTH,
    EMPTY_INPUT,
    MALFORMED_CSV,
    MALFORMED_JSON,
    NOT_UTF8,
    WRONG_TYPE,
    Column,
    DocsChunk,
    FieldPlan,
    LinesChunk,
    NoticeChunk,
    RecordChunk,
    RowsChunk,
)
from fastload._apps._convert._records import MISSING, decode_lines, utf8_detail
from fastload._apps._convert._streams import ByteStream, line_blocks, read_all
from fastload._apps._convert._tables import table_chunks
from fastload.errors import DataFormatError

#: Rows per chunk for columnar inputs and JSON arrays; a row holds a whole document at most.
TABLE_ROWS = 1024
#: Python's csv module refuses fields over 128 KiB by default; documents in a CSV are larger.
CSV_FIELD_LIMIT = 2**31 - 1


@dataclass(frozen=True)
class ReadOptions:
    block_bytes: int
    per_file: bool
    errors: str


def _line_chunks(
    file: InputFile, fmt: Literal["txt", "jsonl"], options: ReadOptions
) -> Iterator[RecordChunk]:
    """Blocks of whole lines; a file with nothing but whitespace is an empty input."""
    with ByteStream(file) as stream:
        content = False
        for first_line, data in line_blocks(stream, options.block_bytes):
            content = content or not data.isspace()
            yield LinesChunk(file.display, first_line, data, fmt, stream.consumed())
        rest = stream.rest()
    if not content:
        yield NoticeChunk(file.display, EMPTY_INPUT, "no records", rest)


def _docs_chunks(files: list[InputFile], options: ReadOptions) -> Iterator[DocsChunk]:
    """Whole files, grouped until a group holds ``block_bytes``."""
    names: list[str] = []
    contents: list[bytes] = []
    size = held = 0
    for file in files:
        with ByteStream(file) as stream:
            contents.append(read_all(stream))
        names.append(file.display)
        size += file.size
        held += len(contents[-1])
        if held >= options.block_bytes:
            yield DocsChunk(tuple(names), tuple(contents), size)
            names, contents, size, held = [], [], 0, 0
    if names:
        yield DocsChunk(tuple(names), tuple(contents), size)


def _csv_chunks(
    file: InputFile, plans: tuple[FieldPlan, ...], options: ReadOptions
) -> Iterator[RecordChunk]:
    """Rows as columns; a row of the wrong width or with non-UTF-8 bytes is passed on as bad,
    at its place, so the worker applies the error policy in input order."""
    csv.field_size_limit(CSV_FIELD_LIMIT)
    bad_lines: dict[int, str] = {}
    with ByteStream(file) as stream:

        def decoded() -> Iterator[str]:
            for number, raw in enumerate(stream.lines(), start=1):
                try:
                    yield raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    if options.errors != "replace":
                        bad_lines[number] = utf8_detail(raw, exc)
                    yield raw.decode("utf-8", "replace")

        if file.format == "tsv":  # TSV has no quoting: a quote character is just text
            reader = csv.reader(decoded(), delimiter="\t", quoting=csv.QUOTE_NONE)
        else:
            reader = csv.reader(decoded())
        try:
            header = next(reader)
        except StopIteration:
            yield NoticeChunk(file.display, EMPTY_INPUT, "no header and no rows", stream.rest())
            return
        missing = [p.source for p in plans if p.source not in header]
        if missing:
            raise DataFormatError(
                f"{file.display}:1: no column {missing[0]!r} in the header "
                f"(columns: {', '.join(header)}); choose with --text-field/--fields/--label-field"
            )
        index = {p.source: header.index(p.source) for p in plans}
        yield from _csv_rows(file, reader, header, index, bad_lines, stream, options)


def _csv_rows(
    file: InputFile,
    reader: _csv.Reader,
    header: list[str],
    index: dict[str, int],
    bad_lines: dict[int, str],
    stream: ByteStream,
    options: ReadOptions,
) -> Iterator[RecordChunk]:
    columns: dict[str, list] = {s: [] for s in index}
    positions: list[int] = []
    bad: list[tuple[int, str, str]] = []
    chunk_chars = 0
    rows = 0
    previous_end = reader.line_num

    def flush() -> RowsChunk:
        chunk = RowsChunk(
            file.display,
            np.array(positions, dtype=np.int64),
            "line",
            {source: values.copy() for source, values in columns.items()},
            tuple(bad),
            stream.consumed(),
        )
        for values in columns.values():
            values.clear()
        positions.clear()
        bad.clear()
        return chunk

    while True:
        try:
            row = next(reader)
        except StopIteration:
            break
        except csv.Error as exc:  # the reader cannot resynchronize; the rest of the file is lost
            yield from ([flush()] if positions else [])
            detail = f"{exc} at line {reader.line_num}; the rest of the file is not read"
            yield NoticeChunk(file.display, MALFORMED_CSV, detail, stream.rest())
            return
        start, previous_end = previous_end + 1, reader.line_num
        if not row:
            continue  # a blank line is not a record
        rows += 1
        record = len(positions)
        positions.append(start)
        utf8 = next(
            (bad_lines.pop(n) for n in range(start, previous_end + 1) if n in bad_lines), None
        )
        if utf8 is not None:
            bad.append((record, NOT_UTF8, utf8))
        elif len(row) != len(header):
            bad.append(
                (record, CSV_WIDTH, f"the row has {len(row)} fields, the header has {len(header)}")
            )
        for source, column in index.items():
            columns[source].append(row[column] if column < len(row) else MISSING)
        chunk_chars += sum(map(len, row))
        if chunk_chars >= options.block_bytes:
            yield flush()
            chunk_chars = 0
    if positions:
        yield flush()
    rest = stream.rest()
    if rows == 0:
        yield NoticeChunk(file.display, EMPTY_INPUT, "a header but no rows", rest)


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position] in " \t\r\n":
        position += 1
    return position


def _array_elements(text: str) -> Iterator[tuple[int, object]]:
    """``(line, value)`` for each element of the JSON array that ``text`` holds (its first
    non-space character is ``[``); raises json.JSONDecodeError, which carries the line, where
    the text stops being one."""
    decoder = json.JSONDecoder()
    position = _skip_space(text, text.index("[") + 1)
    if text.startswith("]", position):
        return
    line, counted = 1, 0
    while True:
        line += text.count("\n", counted, position)
        counted = position
        value, position = decoder.raw_decode(text, position)
        yield line, value
        position = _skip_space(text, position)
        if text.startswith("]", position):
            return
        if not text.startswith(",", position):
            raise json.JSONDecodeError("Expecting ',' delimiter or ']'", text, position)
        position = _skip_space(text, position + 1)


def _json_array_chunks(
    file: InputFile, plans: tuple[FieldPlan, ...], data: bytes, options: ReadOptions
) -> Iterator[RecordChunk]:
    """Elements of a top-level JSON array. The file is read whole (JSON Lines streams; a
    ``.json`` array is expected to fit in memory), then decoded element by element so that
    each record keeps its physical line."""
    lines, bad = decode_lines(data, options.errors)
    if bad:
        line = min(bad)
        yield NoticeChunk(
            f"{file.display}:{line + 1}", NOT_UTF8, f"{bad[line]}; the file is not read", file.size
        )
        return
    sources = list(dict.fromkeys(p.source for p in plans))
    rows: list[dict] = []
    positions: list[int] = []
    problems: list[tuple[int, str, str]] = []
    total = 0

    def chunk(input_bytes: int) -> RowsChunk:
        columns: dict[str, Column] = {s: [r.get(s, MISSING) for r in rows] for s in sources}
        out = RowsChunk(
            file.display,
            np.array(positions, dtype=np.int64),
            "line",
            columns,
            tuple(problems),
            input_bytes,
        )
        rows.clear()
        positions.clear()
        problems.clear()
        return out

    malformed = None
    try:
        for line, value in _array_elements("\n".join(lines)):
            if not isinstance(value, dict):
                problems.append(
                    (len(rows), WRONG_TYPE, f"expected a JSON object, got {type(value).__name__}")
                )
                value = {}
            rows.append(value)
            positions.append(line)
            total += 1
            if len(rows) >= TABLE_ROWS:
                yield chunk(0)
    except json.JSONDecodeError as exc:
        detail = f"{exc.msg} (column {exc.colno}); the rest of the file is not read"
        malformed = NoticeChunk(f"{file.display}:{exc.lineno}", MALFORMED_JSON, detail, file.size)
    if malformed is not None:
        if rows:
            yield chunk(0)
        yield malformed
    elif total == 0:
        yield NoticeChunk(file.display, EMPTY_INPUT, "an empty JSON array", file.size)
    else:
        yield chunk(file.size)


def _json_chunks(
    file: InputFile, plans: tuple[FieldPlan, ...], options: ReadOptions
) -> Iterator[RecordChunk]:
    """A ``.json`` file is a JSON array of records, or JSON Lines under another name."""
    with ByteStream(file) as stream:
        head = stream.read(4096)
    if head.removeprefix(b"\xef\xbb\xbf").lstrip()[:1] != b"[":
        yield from _line_chunks(file, "jsonl", options)
        return
    with ByteStream(file) as stream:
        data = read_all(stream)
    yield from _json_array_chunks(file, plans, data, options)


def record_chunks(
    files: tuple[InputFile, ...], plans: tuple[FieldPlan, ...], options: ReadOptions
) -> Iterator[RecordChunk]:
    """Every record input, in order, as chunks."""
    if options.per_file:
        yield from _docs_chunks(list(files), options)
        return
    for file in files:
        if file.format in ("txt", "jsonl"):
            yield from _line_chunks(file, "txt" if file.format == "txt" else "jsonl", options)
        elif file.format == "json":
            yield from _json_chunks(file, plans, options)
        elif file.format in ("csv", "tsv"):
            yield from _csv_chunks(file, plans, options)
        else:
            yield from table_chunks(file, plans, TABLE_ROWS)
