"""Which fields to read from record inputs, and how each is stored.

The kind of every field (text to tokenize, token ids, or a number) is fixed before the
conversion starts, from the first input: its Arrow schema, its CSV header (CSV values are text;
label fields are numbers), or its first valid JSON record. Later records that disagree are bad
records. Fixing kinds up front is what lets chunks be encoded independently, in any worker.
"""

from __future__ import annotations

from itertools import takewhile

from fastload._apps._convert._convert_options import ConvertOptions
from fastload._apps._convert._discover import InputFile
from fastload._apps._convert._encode import bad_record_message, missing_field, notice
from fastload._apps._convert._inputs import ReadOptions, record_chunks
from fastload._apps._convert._model import (
    WRONG_TYPE,
    FieldPlan,
    NoticeChunk,
    RecordKind,
)
from fastload._apps._convert._records import MISSING, Records, to_records
from fastload._apps._convert._tables import arrow_kind, schema_of
from fastload.errors import DataFormatError, UsageError


def _json_kind(value: object, role: str) -> RecordKind | str:
    """The kind a JSON value makes its field, or why it cannot be stored in that role."""
    if isinstance(value, str):
        return "text" if role != "label" else "a label must be a number, got a string"
    if isinstance(value, list):
        return "ids" if role != "label" else "a label must be a number, got a list"
    if isinstance(value, bool | int | float):
        return (
            "scalar"
            if role != "text"
            else "the text field must hold text or a list of token ids, got a number"
        )
    return f"{type(value).__name__} values cannot be stored"


def _roles(options: ConvertOptions) -> list[tuple[str, str, str]]:
    """``(source, output name, role)`` for every requested field; the text field first."""
    roles = [(options.text_field, options.output_field, "text")]
    roles += [(f, f, "field") for f in options.fields]
    roles += [(f, f, "label") for f in options.label_fields]
    return roles


def _from_first_record(
    records: Records, index: int, options: ConvertOptions
) -> tuple[FieldPlan, ...] | str:
    plans = []
    for source, name, role in _roles(options):
        value = records.columns[source][index]  # type: ignore[index]
        if value is MISSING or value is None:
            return bad_record_message(
                records.where(index), *missing_field(records, index, source, value)
            )
        kind = _json_kind(value, role)
        if kind not in ("text", "ids", "scalar"):
            return bad_record_message(records.where(index), WRONG_TYPE, f"field {source!r}: {kind}")
        plans.append(FieldPlan(source, name, kind))  # type: ignore[arg-type]
    return tuple(plans)


def _json_plans(
    files: tuple[InputFile, ...], options: ConvertOptions, read: ReadOptions
) -> tuple[FieldPlan, ...]:
    """Kinds from the first record that holds every field, scanning the leading JSON inputs.

    Under ``--on-error raise`` the first bad record met raises, as the conversion would. When
    no record is valid, text kinds are assumed: the conversion then skips every record and ends
    with its usual "no samples" error and counts.
    """
    leading = tuple(takewhile(lambda f: f.format in ("json", "jsonl"), files))
    provisional = tuple(
        FieldPlan(s, n, "scalar" if role == "label" else "text") for s, n, role in _roles(options)
    )
    for chunk in record_chunks(leading, provisional, read):
        if isinstance(chunk, NoticeChunk):
            notice(chunk, options.on_error)
            continue
        records = to_records(chunk, provisional, options.errors)
        for i in range(len(records)):
            problem = records.bad.get(i)
            found = (
                bad_record_message(records.where(i), *problem)
                if problem
                else _from_first_record(records, i, options)
            )
            if isinstance(found, tuple):
                return found
            if options.on_error == "raise":
                raise DataFormatError(found)
    return provisional


def _table_plans(file: InputFile, options: ConvertOptions) -> tuple[FieldPlan, ...]:
    schema = schema_of(file)
    plans = []
    for source, name, role in _roles(options):
        if source not in schema.names:
            hint = " (choose with --text-field)" if role == "text" else ""
            raise DataFormatError(
                f"{file.display} has no column {source!r}{hint}; columns: {', '.join(schema.names)}"
            )
        data_type = schema.field(source).type
        kind = arrow_kind(data_type)
        allowed = {
            "text": ("text", "ids"),
            "label": ("scalar",),
            "field": ("text", "ids", "scalar"),
        }[role]
        if kind not in allowed:
            raise DataFormatError(
                f"{file.display}: column {source!r} has type {data_type}; a {role} column must be "
                + {
                    "text": "a string or a list of integers",
                    "label": "a number",
                    "field": "a string, a list of integers or a number",
                }[role]
            )
        plans.append(FieldPlan(source, name, kind))
    return tuple(plans)


def infer_plans(
    files: tuple[InputFile, ...], options: ConvertOptions, read: ReadOptions
) -> tuple[FieldPlan, ...]:
    """The fields to read, the text field first. Raises UsageError for options that do not
    fit the inputs and DataFormatError for inputs that lack what the options name."""
    formats = {f.format for f in files}
    if options.per_file or "txt" in formats:
        if options.per_file and formats != {"txt"}:
            raise UsageError(
                f"--per-file reads text files; got {', '.join(sorted(formats - {'txt'}))} inputs too (use --format txt to read every file as text)"
            )
        if formats != {"txt"}:
            raise UsageError(
                "text (.txt) inputs cannot be mixed with record inputs: their lines have no named fields"
            )
        if options.fields or options.label_fields:
            raise UsageError("--fields/--label-field need named fields; lines of text have none")
        return (FieldPlan(options.text_field, options.output_field, "text"),)
    first = files[0]
    if first.format in ("csv", "tsv"):
        return tuple(
            FieldPlan(s, n, "scalar" if role == "label" else "text")
            for s, n, role in _roles(options)
        )
    if first.format in ("parquet", "arrow"):
        return _table_plans(first, options)
    return _json_plans(files, options, read)
