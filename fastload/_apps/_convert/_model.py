"""Plain data passed between the converter's stages, and pickled to its worker processes.

A *chunk* is a slice of one input that the main process reads sequentially; a worker turns it
into an :class:`Encoded` block of token arrays. Chunks are formed from the input alone (never
from the worker count), which is what makes the output independent of ``--workers``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt

#: How a record field is stored: ``text`` is tokenized into a ragged field, ``ids`` (a list of
#: integers) is kept as a ragged field of token ids, ``scalar`` (a number) becomes a fixed field.
RecordKind = Literal["text", "ids", "scalar"]

#: Why a record was skipped under ``--on-error skip``; also the words used in error messages.
MALFORMED_JSON = "malformed JSON"
MISSING_FIELD = "missing field"
WRONG_TYPE = "wrong type"
NOT_UTF8 = "non-UTF-8 bytes"
CSV_WIDTH = "wrong CSV row width"
MALFORMED_CSV = "malformed CSV"
TOKENIZER_FAILED = "tokenizer failed"
EMPTY_INPUT = "empty input"


@dataclass(frozen=True)
class FieldPlan:
    """One field of a record input: read from column ``source``, written as ``name``."""

    source: str
    name: str
    kind: RecordKind


@dataclass(frozen=True)
class IdsColumn:
    """A column of integer lists already in arrays (from Arrow): record ``i`` holds
    ``values[starts[i]:starts[i] + lengths[i]]``; ``valid[i]`` is False where the list is null."""

    values: npt.NDArray[np.int64]
    lengths: npt.NDArray[np.int64]
    valid: npt.NDArray[np.bool_]


@dataclass(frozen=True)
class ScalarColumn:
    """A column of numbers already in an array (from Arrow); ``valid[i]`` is False for a null."""

    values: npt.NDArray[np.float64]
    valid: npt.NDArray[np.bool_]


Column = list | IdsColumn | ScalarColumn


@dataclass(frozen=True)
class LinesChunk:
    """Whole lines of one ``.txt`` or JSON Lines file; line ``first_line + i`` (1-based) is the
    ``i``-th line of ``data``. ``data`` ends with a newline except at the end of the file."""

    file: str
    first_line: int
    data: bytes
    format: Literal["txt", "jsonl"]
    input_bytes: int


@dataclass(frozen=True)
class DocsChunk:
    """Whole files read with ``--per-file``: each file is one sample."""

    files: tuple[str, ...]
    contents: tuple[bytes, ...]
    input_bytes: int


@dataclass(frozen=True)
class RowsChunk:
    """Records already split into columns by the main process (CSV, JSON arrays, Arrow, Parquet).

    ``positions[i]`` is record ``i``'s physical line (1-based, ``unit="line"``) or row index
    (0-based, ``unit="row"``); ``bad`` lists records found bad while parsing as
    ``(record index, reason, detail)``.
    """

    file: str
    positions: npt.NDArray[np.int64]
    unit: Literal["line", "row"]
    columns: dict[str, Column]
    bad: tuple[tuple[int, str, str], ...]
    input_bytes: int


@dataclass(frozen=True)
class NoticeChunk:
    """A problem with a whole file found by the main process (an empty input, unparsable
    rest of a file), sent down the same ordered stream so that it is raised or counted at its
    place in input order, exactly like a bad record."""

    file: str
    reason: str
    detail: str
    input_bytes: int


RecordChunk = LinesChunk | DocsChunk | RowsChunk | NoticeChunk


def location(file: str, position: int, unit: Literal["line", "row"]) -> str:
    """``file:line`` for text inputs, ``file row N`` for columnar ones (rows are 0-based)."""
    return f"{file}:{position}" if unit == "line" else f"{file} row {position}"


@dataclass
class ChunkStats:
    """Counts of one chunk, summed over the run; ``first_skip`` keeps, for each skip reason, the
    location and detail of its first occurrence in input order."""

    records: int = 0
    input_bytes: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    first_skip: dict[str, str] = field(default_factory=dict)
    dropped_short: int = 0
    #: Samples dropped by --min-length that were empty (blank lines, no tokens): said apart
    #: from those that held a few tokens.
    dropped_empty: int = 0
    dropped_long: int = 0
    truncated: int = 0

    def skip(self, reason: str, where: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        self.first_skip.setdefault(reason, where)

    def merge(self, later: ChunkStats) -> None:
        """Add the counts of a chunk that comes after every chunk merged so far."""
        self.records += later.records
        self.input_bytes += later.input_bytes
        for reason, count in later.skipped.items():
            self.skipped[reason] = self.skipped.get(reason, 0) + count
        for reason, where in later.first_skip.items():
            self.first_skip.setdefault(reason, where)
        self.dropped_short += later.dropped_short
        self.dropped_empty += later.dropped_empty
        self.dropped_long += later.dropped_long
        self.truncated += later.truncated


@dataclass
class Encoded:
    """Samples ready for the writer.

    ``ragged[name] = (values, lengths)`` with ``lengths`` int64 and ``values.shape[0] ==
    lengths.sum()``; ``fixed[name]`` has one row per sample. Every field holds the same number of
    samples.
    """

    ragged: dict[str, tuple[np.ndarray, npt.NDArray[np.int64]]]
    fixed: dict[str, np.ndarray]
    stats: ChunkStats

    @property
    def num_samples(self) -> int:
        for _, lengths in self.ragged.values():
            return int(lengths.shape[0])
        for rows in self.fixed.values():
            return int(rows.shape[0])
        return 0
