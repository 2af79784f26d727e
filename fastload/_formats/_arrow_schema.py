"""Which Arrow columns are fields, of what kind, and how to get a field's array from a batch.

* ``list``/``large_list`` of numbers (or of fixed-size lists of numbers): ragged, with the
  element shape of the inner fixed-size lists;
* numbers, bools and ``fixed_size_list`` of those (nested for several dimensions): fixed;
* ``string``/``large_string`` (``str``) and ``binary``/``large_binary``/``fixed_size_binary``
  (``bytes``): object;
* ``struct`` columns are flattened into fields named ``"column/child"``;
* extension types (such as Hugging Face ``datasets``' ``Array2D``) are read as their storage
  type. Everything else (dictionaries, timestamps, decimals, maps, nested variable-length lists)
  is unsupported.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from fastload._types import Field
from fastload.errors import DataFormatError, FieldNotFoundError

_SUPPORTED = (
    "fields must be numbers or bools, fixed-size lists of those, lists of those, strings,"
    " binary, or structs of these"
)


@dataclass(frozen=True)
class ArrowField:
    """A field and the path to its array: a top-level column, then struct children."""

    field: Field
    path: tuple[str, ...]
    text: bool = False


def storage_type(t: pa.DataType) -> pa.DataType:
    """``t``, or the storage of an extension type (recursively)."""
    while isinstance(t, pa.BaseExtensionType):
        t = t.storage_type
    return t


def discover(schema: pa.Schema) -> tuple[dict[str, ArrowField], dict[str, str]]:
    """The fields of ``schema`` in column order, and why the columns that are not fields are not."""
    fields: dict[str, ArrowField] = {}
    problems: dict[str, str] = {}
    for column in schema:
        _discover(column.name, (column.name,), column.type, fields, problems)
    return fields, problems


def _discover(
    name: str,
    path: tuple[str, ...],
    t: pa.DataType,
    fields: dict[str, ArrowField],
    problems: dict[str, str],
) -> None:
    t = storage_type(t)
    if pa.types.is_struct(t):
        for i in range(t.num_fields):
            child = t.field(i)
            _discover(f"{name}/{child.name}", (*path, child.name), child.type, fields, problems)
        return
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        fields[name] = ArrowField(Field(name, "object", np.dtype(object)), path, text=True)
        return
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        fields[name] = ArrowField(Field(name, "object", np.dtype(object)), path)
        return
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        inner = _fixed_shape(storage_type(t.value_type))
        if inner is None:
            problems[name] = f"is {t}; a list must hold numbers or fixed-size lists of numbers"
            return
        dtype, shape = inner
        fields[name] = ArrowField(Field(name, "ragged", dtype, shape), path)
        return
    fixed = _fixed_shape(t)
    if fixed is None:
        problems[name] = f"has type {t}, which is not supported; {_SUPPORTED}"
        return
    fields[name] = ArrowField(Field(name, "fixed", fixed[0], fixed[1]), path)


def _fixed_shape(t: pa.DataType) -> tuple[np.dtype, tuple[int, ...]] | None:
    """(dtype, shape) of one value of a numeric or fixed-size-list type, else ``None``."""
    shape: list[int] = []
    while pa.types.is_fixed_size_list(t):
        shape.append(t.list_size)
        t = storage_type(t.value_type)
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
        return np.dtype(t.to_pandas_dtype()), tuple(shape)
    return None


def field_array(batch: pa.RecordBatch, path: tuple[str, ...]) -> pa.Array:
    """The array of the field at ``path`` in ``batch``, as its storage type.

    Struct children are taken with the struct's offset applied and its nulls merged into the
    child (``StructArray.flatten``), zero-copy when the struct has no nulls.
    """
    array = storage_array(batch.column(path[0]))
    for child in path[1:]:
        struct_type = array.type
        position = struct_type.get_field_index(child)
        array = storage_array(array.flatten()[position])
    return array


def storage_array(array: pa.Array) -> pa.Array:
    """``array``, or the storage of an extension array (recursively)."""
    while isinstance(array, pa.ExtensionArray):
        array = array.storage
    return array


def select_fields(
    file: str, schema: pa.Schema, requested: list[str] | None
) -> dict[str, ArrowField]:
    """The fields to read from ``file``: ``requested`` in its order, or all of them.

    Raises :class:`FieldNotFoundError` for a name the schema lacks (listing those it has), and
    :class:`DataFormatError` for a column that cannot be a field; with ``requested=None`` any
    such column is an error, naming it and suggesting ``fields=``.
    """
    found, problems = discover(schema)
    if requested is None:
        if problems:
            listed = "; ".join(f"{name!r} {why}" for name, why in problems.items())
            raise DataFormatError(
                f"{file}: cannot read column {listed}. Pass fields=[...] to read only the others"
                f" ({', '.join(repr(n) for n in found) or 'none'})"
            )
        return found
    chosen: dict[str, ArrowField] = {}
    for name in requested:
        if name in problems:
            raise DataFormatError(f"{file}: field {name!r} {problems[name]}")
        if name not in found:
            raise FieldNotFoundError(
                f"{file}: no field {name!r}; the file has: "
                f"{', '.join(repr(n) for n in [*found, *problems]) or '(no columns)'}"
            )
        chosen[name] = found[name]
    return chosen
