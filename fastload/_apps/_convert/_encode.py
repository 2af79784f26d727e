"""Records to token arrays (runs in the worker processes): validate every field of every record,
tokenize text, apply the error policy and the length limits.

A record is kept whole or not at all: a problem in any of its fields skips the record (or, under
``--on-error raise``, raises for the first bad record of the chunk in input order).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt

from fastload._apps._convert._model import (
    MISSING_FIELD,
    NOT_UTF8,
    TOKENIZER_FAILED,
    WRONG_TYPE,
    ChunkStats,
    Encoded,
    FieldPlan,
    IdsColumn,
    LinesChunk,
    NoticeChunk,
    RecordChunk,
    ScalarColumn,
)
from fastload._apps._convert._records import MISSING, Records, record_keys, to_records
from fastload._apps._convert._tokenize import TokenizerSpec, count_words, make_tokenizer
from fastload.errors import DataFormatError

#: Integers above this magnitude lose precision in the float64 column that carries numbers.
_EXACT_FLOAT_INT = 2**53


@dataclass(frozen=True)
class EncodePlan:
    """Everything a worker needs, pickled to it once. ``fields[0]`` is the primary field (the
    one ``/lengths`` indexes) when it is ragged."""

    fields: tuple[FieldPlan, ...]
    tokenizer: TokenizerSpec
    on_error: Literal["raise", "skip"]
    errors: Literal["strict", "replace"]
    min_length: int
    max_length: int | None
    overlong: Literal["truncate", "drop"]

    @property
    def primary(self) -> str | None:
        first = self.fields[0]
        return first.name if first.kind != "scalar" else None


def bad_record_message(where: str, reason: str, detail: str) -> str:
    return f"{where}: {reason}: {detail} (--on-error skip skips such records)"


def notice(chunk: NoticeChunk, on_error: str) -> ChunkStats:
    """Raise for a whole-file problem, or count it as skipped."""
    if on_error == "raise":
        raise DataFormatError(bad_record_message(chunk.file, chunk.reason, chunk.detail))
    stats = ChunkStats(input_bytes=chunk.input_bytes)
    stats.skip(chunk.reason, f"{chunk.file}: {chunk.detail}")
    return stats


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def missing_field(records: Records, i: int, source: str, value: object) -> tuple[str, str]:
    if value is None:
        return MISSING_FIELD, f"field {source!r} is null"
    keys = record_keys(records, i)
    has = f" (the record has: {', '.join(keys) or 'no fields'})" if keys is not None else ""
    return MISSING_FIELD, f"no field {source!r}{has}; choose another with --text-field/--fields"


def _texts(records: Records, plan: FieldPlan) -> list[str]:
    """The column as strings, ``""`` in place of each bad value (marked on ``records``)."""
    column = records.columns[plan.source]
    assert isinstance(column, list)
    if set(map(type, column)) <= {str}:  # the common case, checked at C speed
        return column
    texts = []
    for i, value in enumerate(column):
        if type(value) is str:
            texts.append(value)
            continue
        if value is MISSING or value is None:
            records.mark(i, *missing_field(records, i, plan.source, value))
        else:
            detail = f"field {plan.source!r} is {_type_name(value)}, expected a string like the first record's"
            records.mark(i, WRONG_TYPE, detail)
        texts.append("")
    return texts


def _ids(records: Records, plan: FieldPlan) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """The column as concatenated int64 ids and per-record lengths (0 for a bad record)."""
    column = records.columns[plan.source]
    if isinstance(column, IdsColumn):
        for null in np.flatnonzero(~column.valid):
            records.mark(int(null), MISSING_FIELD, f"field {plan.source!r} is null")
        return column.values, column.lengths
    assert isinstance(column, list)
    arrays: list[np.ndarray] = []
    for i, value in enumerate(column):
        array = None
        if value is MISSING or value is None:
            records.mark(i, *missing_field(records, i, plan.source, value))
        elif not isinstance(value, list):
            records.mark(
                i,
                WRONG_TYPE,
                f"field {plan.source!r} is {_type_name(value)}, expected a list of token ids",
            )
        elif not value:
            array = np.zeros(0, dtype=np.int64)
        else:
            array = np.array(value)
            if array.dtype != np.int64 or array.ndim != 1:
                first = next((v for v in value if type(v) is not int), value[0])
                records.mark(
                    i,
                    WRONG_TYPE,
                    f"field {plan.source!r} holds {first!r}; token ids must be integers within int64",
                )
                array = None
        arrays.append(np.zeros(0, dtype=np.int64) if array is None else array)
    lengths = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
    values = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
    return values, lengths


def _number(value: object) -> float | str:
    """A JSON/CSV value as a float, or why it is not a number."""
    if type(value) in (int, bool):
        if abs(value) > _EXACT_FLOAT_INT:  # type: ignore[arg-type]
            return f"{value} is too large to store exactly (limit 2**53)"
        return float(value)  # type: ignore[arg-type]
    if type(value) is float:
        return value
    if isinstance(value, str):
        try:
            return _number(int(value))
        except ValueError:
            pass
        try:
            return float(value)
        except ValueError:
            return f"{value!r} is not a number"
    return f"{_type_name(value)} is not a number"


def _scalars(records: Records, plan: FieldPlan) -> npt.NDArray[np.float64]:
    column = records.columns[plan.source]
    if isinstance(column, ScalarColumn):
        for null in np.flatnonzero(~column.valid):
            records.mark(int(null), MISSING_FIELD, f"field {plan.source!r} is null")
        return column.values
    assert isinstance(column, list)
    out = np.zeros(len(column), dtype=np.float64)
    for i, value in enumerate(column):
        if value is MISSING or value is None:
            records.mark(i, *missing_field(records, i, plan.source, value))
            continue
        if isinstance(value, str) and not value.strip():
            records.mark(i, MISSING_FIELD, f"field {plan.source!r} is empty")
            continue
        number = _number(value)
        if isinstance(number, str):
            records.mark(i, WRONG_TYPE, f"field {plan.source!r}: {number}")
        else:
            out[i] = number
    return out


def select(encoded: Encoded, keep: npt.NDArray[np.bool_]) -> None:
    """Keep only the samples where ``keep`` is True, in every field, in place."""
    for name, (values, lengths) in encoded.ragged.items():
        if lengths[~keep].any():
            values = values[np.repeat(keep, lengths)]
        # else only empty samples go (blank lines, mostly): every value stays
        encoded.ragged[name] = (values, lengths[keep])
    for name, rows in encoded.fixed.items():
        encoded.fixed[name] = rows[keep]


def truncate(
    values: np.ndarray, lengths: npt.NDArray[np.int64], max_length: int
) -> tuple[np.ndarray, npt.NDArray[np.int64]]:
    """Cut every sample to its first ``max_length`` elements."""
    starts = np.cumsum(lengths) - lengths
    within = np.arange(values.shape[0]) - np.repeat(starts, lengths)
    return values[within < max_length], np.minimum(lengths, max_length)


def apply_length_limits(
    encoded: Encoded, primary: str | None, *, min_length: int, max_length: int | None, overlong: str
) -> None:
    """Drop samples whose primary field is shorter than ``min_length``; truncate or drop those
    longer than ``max_length``; count each in ``encoded.stats`` (empty samples apart)."""
    if primary is None:
        return
    lengths = encoded.ragged[primary][1]
    keep = lengths >= min_length
    empty = int((~keep & (lengths == 0)).sum())
    encoded.stats.dropped_empty += empty
    encoded.stats.dropped_short += int((~keep).sum()) - empty
    too_long = keep & (lengths > max_length) if max_length is not None else None
    if too_long is not None and overlong == "drop":
        encoded.stats.dropped_long += int(too_long.sum())
        keep &= ~too_long
    if not keep.all():
        select(encoded, keep)
    if too_long is not None and max_length is not None and overlong == "truncate":
        encoded.stats.truncated += int(too_long.sum())
        encoded.ragged[primary] = truncate(*encoded.ragged[primary], max_length)


def _split_lines(data: bytes) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]]:
    """Lines of ``data`` as UTF-8 bytes without their terminators (LF or CR LF), with no Python
    per line: ``bytes.replace`` (a C loop) removes the terminators, numpy finds the line ends."""
    if b"\r" in data:  # memchr; searching for b"\r\n" directly is 100x slower
        data = data.replace(b"\r\n", b"\n")
    newlines = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 10)
    ends = newlines if data.endswith(b"\n") else np.append(newlines, len(data))
    starts = np.concatenate(([0], newlines + 1))[: ends.shape[0]]
    values = np.frombuffer(data.replace(b"\n", b""), dtype=np.uint8)
    return values, (ends - starts).astype(np.int64)


@dataclass
class Checked:
    """A chunk's columns after validation, by output name; bad records hold placeholders
    (``""``, no ids, 0.0) and are marked on their :class:`Records`."""

    texts: dict[str, list[str]] = field(default_factory=dict)
    ids: dict[str, tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]] = field(
        default_factory=dict
    )
    numbers: dict[str, npt.NDArray[np.float64]] = field(default_factory=dict)


def validate(records: Records, plan: EncodePlan) -> Checked:
    """Check every field of every record against ``plan``'s kinds."""
    checked = Checked()
    for f in plan.fields:
        if f.kind == "text":
            checked.texts[f.name] = _texts(records, f)
        elif f.kind == "ids":
            checked.ids[f.name] = _ids(records, f)
        else:
            checked.numbers[f.name] = _scalars(records, f)
    return checked


def apply_error_policy(records: Records, on_error: str, stats: ChunkStats) -> npt.NDArray[np.bool_]:
    """The mask of good records; raises for the first bad one in input order under
    ``--on-error raise``, else counts each bad one in ``stats``."""
    keep = np.ones(len(records), dtype=bool)
    if not records.bad:
        return keep
    if on_error == "raise":
        first = min(records.bad)
        reason, detail = records.bad[first]
        raise DataFormatError(bad_record_message(records.where(first), reason, detail))
    for i in sorted(records.bad):
        reason, detail = records.bad[i]
        stats.skip(reason, f"{records.where(i)}: {detail}")
    keep[list(records.bad)] = False
    return keep


class ChunkEncoder:
    """``chunk -> Encoded`` for one worker; builds the tokenizer once."""

    def __init__(self, plan: EncodePlan) -> None:
        self.plan = plan
        self.tokenizer = make_tokenizer(plan.tokenizer)
        self._failure_reason = TOKENIZER_FAILED if plan.tokenizer.kind == "callable" else NOT_UTF8

    def __call__(self, chunk: RecordChunk) -> Encoded:
        if isinstance(chunk, NoticeChunk):
            return Encoded({}, {}, notice(chunk, self.plan.on_error))
        encoded = self._fast_text(chunk)
        if encoded is None:
            encoded = self._encode(to_records(chunk, self.plan.fields, self.plan.errors))
        p = self.plan
        apply_length_limits(
            encoded,
            p.primary,
            min_length=p.min_length,
            max_length=p.max_length,
            overlong=p.overlong,
        )
        return encoded

    def _fast_text(self, chunk: RecordChunk) -> Encoded | None:
        """Plain text lines with byte tokens need no Python per line; None if not applicable
        or the chunk is not valid UTF-8 (then the general path locates the bad lines)."""
        if not (
            isinstance(chunk, LinesChunk)
            and chunk.format == "txt"
            and self.plan.tokenizer.kind == "bytes"
        ):
            return None
        if not chunk.data.isascii():  # ASCII is UTF-8; isascii is far cheaper than decoding
            try:
                chunk.data.decode("utf-8")
            except UnicodeDecodeError:
                return None
        values, lengths = _split_lines(chunk.data)
        stats = ChunkStats(records=int(lengths.shape[0]), input_bytes=chunk.input_bytes)
        return Encoded({self.plan.fields[0].name: (values, lengths)}, {}, stats)

    def _encode(self, records: Records) -> Encoded:
        checked = validate(records, self.plan)
        encoded = Encoded({}, {}, ChunkStats(records=len(records), input_bytes=records.input_bytes))
        for f in self.plan.fields:
            if f.kind == "text":
                tokenized = self.tokenizer.encode(checked.texts[f.name])
                for i, detail in tokenized.failures:
                    records.mark(i, self._failure_reason, detail)
                encoded.ragged[f.name] = (tokenized.values, tokenized.lengths)
            elif f.kind == "ids":
                encoded.ragged[f.name] = checked.ids[f.name]
            else:
                encoded.fixed[f.name] = checked.numbers[f.name]
        keep = apply_error_policy(records, self.plan.on_error, encoded.stats)
        if not keep.all():
            select(encoded, keep)
        return encoded


class WordCounter:
    """``chunk -> Counter`` of whitespace-separated words in the text fields of good records:
    the first pass of ``--tokenizer whitespace``. Bad records raise or are left out exactly as
    in the encoding pass."""

    def __init__(self, plan: EncodePlan) -> None:
        self.plan = plan

    def __call__(self, chunk: RecordChunk) -> tuple[Counter[str], int]:
        if isinstance(chunk, NoticeChunk):
            return Counter(), notice(chunk, self.plan.on_error).input_bytes
        records = to_records(chunk, self.plan.fields, self.plan.errors)
        checked = validate(records, self.plan)
        keep = apply_error_policy(records, self.plan.on_error, ChunkStats())
        counts: Counter[str] = Counter()
        for texts in checked.texts.values():
            count_words([t for t, k in zip(texts, keep, strict=True) if k], counts)
        return counts, records.input_bytes
