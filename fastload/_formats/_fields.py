"""Choosing fields: validating ``fields=`` and ``length_field=``, and checking that all shards
describe the same fields."""

from __future__ import annotations

from collections.abc import Sequence

from fastload._types import Field
from fastload.errors import DataFormatError, FieldNotFoundError


def requested_names(fields: Sequence[str] | None) -> list[str] | None:
    """``fields=`` as a list of distinct names (``None``: all fields)."""
    if fields is None:
        return None
    if isinstance(fields, str) or not all(isinstance(f, str) for f in fields):
        raise TypeError(f"fields must be a list of field names; got {fields!r}")
    if len(set(fields)) != len(fields):
        raise ValueError(f"fields names a field twice: {list(fields)!r}")
    return list(fields)


def pick_length_field(fields: dict[str, Field], length_field: str | None, where: str) -> str | None:
    """``length_field``, checked to be a ragged field among ``fields``; by default the first
    ragged field, or ``None`` if there is none."""
    if length_field is None:
        return next((n for n, f in fields.items() if f.kind == "ragged"), None)
    if length_field not in fields:
        raise FieldNotFoundError(
            f"{where}: length_field {length_field!r} is not among the fields read"
            f" ({', '.join(repr(n) for n in fields) or 'none'})"
        )
    if fields[length_field].kind != "ragged":
        raise DataFormatError(
            f"{where}: length_field {length_field!r} is a {fields[length_field].kind} field;"
            " lengths come from a ragged field"
        )
    return length_field


def check_same_fields(
    file: str, fields: dict[str, Field], first_file: str, first: dict[str, Field]
) -> None:
    """Every shard must offer the same fields, in the same order, with the same kind, dtype and
    shape as the first shard."""
    if fields == first and list(fields) == list(first):
        return
    if list(fields) != list(first):
        raise DataFormatError(
            f"{file}: has fields {list(fields)}, but the first shard {first_file} has"
            f" {list(first)}; all shards must hold the same fields"
        )
    for name, mine in fields.items():
        theirs = first[name]
        if mine != theirs:
            raise DataFormatError(
                f"{file}: field {name!r} is {mine.kind} {mine.dtype} {list(mine.shape)}, but in"
                f" the first shard {first_file} it is {theirs.kind} {theirs.dtype}"
                f" {list(theirs.shape)}"
            )
