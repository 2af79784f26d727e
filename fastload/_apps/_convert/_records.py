"""Chunks to records (runs in the worker processes): decode UTF-8, parse JSON Lines, split into
columns, and note every bad record with its physical line.

Line numbers are physical: line ``k`` is the ``k``-th ``\\n``-terminated line of the
(decompressed) file, blank lines included, so an editor's "go to line" lands on it.
"""

from __future__ import annotations

import json
import json.scanner
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt

from fastload._apps._convert._model import (
    MALFORMED_JSON,
    NOT_UTF8,
    WRONG_TYPE,
    Column,
    DocsChunk,
    FieldPlan,
    LinesChunk,
    RowsChunk,
    location,
)

#: A field absent from a JSON record (``None`` is a JSON ``null``, reported differently).
MISSING = object()


@dataclass
class Records:
    """One chunk's records as columns. ``bad`` maps a record to the first problem found with
    it, ``(reason, detail)``; ``positions`` are lines (1-based) or rows (0-based) per ``unit``."""

    files: tuple[str, ...]
    file_index: npt.NDArray[np.int64]
    positions: npt.NDArray[np.int64]
    unit: Literal["line", "row"]
    columns: dict[str, Column]
    input_bytes: int
    bad: dict[int, tuple[str, str]] = field(default_factory=dict)
    #: The fields of JSON records that lack a requested one, for "missing field" messages.
    keys: dict[int, list[str]] | None = None

    def __len__(self) -> int:
        return int(self.positions.shape[0])

    def where(self, i: int) -> str:
        return location(self.files[self.file_index[i]], int(self.positions[i]), self.unit)

    def mark(self, i: int, reason: str, detail: str) -> None:
        self.bad.setdefault(i, (reason, detail))


def utf8_detail(data: bytes, exc: UnicodeDecodeError) -> str:
    return f"invalid byte 0x{data[exc.start]:02x} at column {exc.start + 1}"


def decode_lines(data: bytes, errors: str) -> tuple[list[str], dict[int, str]]:
    """Split ``data`` into lines (without ``\\n``) and decode them; lines that are not UTF-8
    come back empty, listed as ``{line index: detail}`` unless ``errors == "replace"``."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        pass
    else:  # the common case: one C call for the whole chunk
        lines = text.split("\n")
        if text.endswith("\n"):
            lines.pop()
        return lines, {}
    raw = data.split(b"\n")
    if data.endswith(b"\n"):
        raw.pop()
    decoded: list[str] = []
    bad: dict[int, str] = {}
    for i, line in enumerate(raw):
        try:
            decoded.append(line.decode("utf-8"))
        except UnicodeDecodeError as exc:
            if errors == "replace":
                decoded.append(line.decode("utf-8", "replace"))
            else:
                bad[i] = utf8_detail(line, exc)
                decoded.append("")
    return decoded, bad


def _single_file(
    file: str,
    positions: npt.NDArray[np.int64],
    unit: Literal["line", "row"],
    columns: dict[str, Column],
    input_bytes: int,
) -> Records:
    index = np.zeros(positions.shape[0], dtype=np.int64)
    return Records((file,), index, positions, unit, columns, input_bytes)


def _txt_records(chunk: LinesChunk, text_source: str, errors: str) -> Records:
    lines, bad = decode_lines(chunk.data, errors)
    # A CRLF file's lines end in "\r"; the terminator is not part of the sample.
    lines = [s[:-1] if s.endswith("\r") else s for s in lines]
    positions = np.arange(chunk.first_line, chunk.first_line + len(lines), dtype=np.int64)
    records = _single_file(chunk.file, positions, "line", {text_source: lines}, chunk.input_bytes)
    for i, detail in bad.items():
        records.mark(i, NOT_UTF8, detail)
    return records


#: The C scanner behind ``json.loads``, called directly (typeshed mistypes its argument).
_SCAN: Callable[[str, int], tuple[object, int]] = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]


def parse_json_line(line: str) -> object:
    """One JSON value filling ``line`` (surrounding whitespace allowed), via the C scanner
    directly: ``json.loads`` adds two regex passes and three Python calls per line."""
    try:
        value, end = _SCAN(line, 0)
    except StopIteration as stop:
        raise json.JSONDecodeError("Expecting value", line, stop.value) from None
    if end != len(line):
        raise json.JSONDecodeError("Extra data", line, end)
    return value


def _jsonl_records(chunk: LinesChunk, sources: list[str], errors: str) -> Records:
    """Parse each line into the columns directly: no list of parsed objects is kept, which
    keeps a chunk's memory near the size of its text."""
    lines, bad_utf8 = decode_lines(chunk.data, errors)
    positions: list[int] = []
    columns: dict[str, list] = {s: [] for s in sources}
    appenders = [(s, columns[s].append) for s in sources]
    problems: list[tuple[int, str, str]] = []
    keys: dict[int, list[str]] = {}
    for i, line in enumerate(lines):
        obj: dict = {}
        if i in bad_utf8:
            problems.append((len(positions), NOT_UTF8, bad_utf8[i]))
        else:
            line = line.strip()  # returns the same object when there is nothing to strip
            if not line:
                continue  # blank lines separate nothing in JSON Lines; they are not records
            try:
                parsed = parse_json_line(line)
            except json.JSONDecodeError as exc:
                problems.append((len(positions), MALFORMED_JSON, f"{exc.msg} (column {exc.colno})"))
            else:
                if isinstance(parsed, dict):
                    obj = parsed
                else:
                    detail = f"expected a JSON object, got {type(parsed).__name__}"
                    problems.append((len(positions), WRONG_TYPE, detail))
        for source, append in appenders:
            if source in obj:
                append(obj[source])
            else:
                append(MISSING)
                keys[len(positions)] = list(obj)
        positions.append(chunk.first_line + i)
    records = _single_file(
        chunk.file, np.array(positions, dtype=np.int64), "line", dict(columns), chunk.input_bytes
    )
    for i, reason, detail in problems:
        records.mark(i, reason, detail)
    records.keys = keys
    return records


def _docs_records(chunk: DocsChunk, text_source: str, errors: str) -> Records:
    texts: list[str] = []
    positions = np.ones(len(chunk.files), dtype=np.int64)
    problems: dict[int, str] = {}
    for i, data in enumerate(chunk.contents):
        try:
            texts.append(data.decode("utf-8"))
        except UnicodeDecodeError as exc:
            if errors == "replace":
                texts.append(data.decode("utf-8", "replace"))
                continue
            line_start = data.rfind(b"\n", 0, exc.start) + 1
            positions[i] = data.count(b"\n", 0, exc.start) + 1
            column = exc.start - line_start + 1
            problems[i] = f"invalid byte 0x{data[exc.start]:02x} at column {column}"
            texts.append("")
    index = np.arange(len(chunk.files), dtype=np.int64)
    records = Records(
        chunk.files, index, positions, "line", {text_source: texts}, chunk.input_bytes
    )
    for i, detail in problems.items():
        records.mark(i, NOT_UTF8, detail)
    return records


def to_records(
    chunk: LinesChunk | DocsChunk | RowsChunk, plans: tuple[FieldPlan, ...], errors: str
) -> Records:
    """Parse ``chunk`` into columns holding ``plans``' sources; bad records are marked, not
    raised, so the caller applies the error policy in one place."""
    if isinstance(chunk, RowsChunk):
        records = _single_file(
            chunk.file, chunk.positions, chunk.unit, dict(chunk.columns), chunk.input_bytes
        )
        for i, reason, detail in chunk.bad:
            records.mark(i, reason, detail)
        return records
    if isinstance(chunk, DocsChunk):
        return _docs_records(chunk, plans[0].source, errors)
    if chunk.format == "txt":
        return _txt_records(chunk, plans[0].source, errors)
    return _jsonl_records(chunk, [p.source for p in plans], errors)


def record_keys(records: Records, i: int) -> list[str] | None:
    """The fields JSON record ``i`` has, for "missing field" messages; None for other formats."""
    return None if records.keys is None else records.keys.get(i, [])
