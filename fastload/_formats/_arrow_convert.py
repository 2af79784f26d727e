"""Converting a (small, freshly taken) Arrow array into a column, nulls included.

This is the general path: it serves Parquet row groups, compressed Arrow batches, bool fields,
string fields and fields with nulls. Memory-mapped numeric fields without nulls take the
faster ``_arrow_mapped`` path instead.

Nulls: without ``null_fill`` a null raises :class:`DataFormatError` naming the sample. With it,
a null number (a fixed field's value, or an element of a ragged or fixed-size list) reads as
``null_fill``; a null list reads as an empty sample; a null string or binary reads as ``""`` or
``b""``.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from fastload._formats._arrow_schema import ArrowField, storage_array
from fastload._formats._columns import ragged_gather
from fastload._types import Column, Field, Ragged
from fastload.errors import DataFormatError

NullFill = int | float | bool


def null_rows(array: pa.Array) -> npt.NDArray[np.bool_] | None:
    """Per row of ``array``: whether it is null or holds a null at any depth; ``None`` when
    there is no null at all (the common case, decided from null counts alone)."""
    array = storage_array(array)
    t = array.type
    inner: npt.NDArray[np.bool_] | None = None
    if pa.types.is_fixed_size_list(t):
        size = t.list_size
        child = storage_array(array.values).slice(array.offset * size, len(array) * size)
        child_rows = null_rows(child)
        if child_rows is not None:
            inner = np.asarray(child_rows.reshape(len(array), size).any(axis=1))
    elif pa.types.is_list(t) or pa.types.is_large_list(t):
        child_rows = null_rows(storage_array(array.values))
        if child_rows is not None:
            offsets = array.offsets.to_numpy().astype(np.int64)
            counts = np.concatenate([[0], np.cumsum(child_rows)])
            inner = (counts[offsets[1:]] - counts[offsets[:-1]]) > 0
    own = array.is_null().to_numpy(zero_copy_only=False) if array.null_count else None
    if own is None:
        return inner
    return own if inner is None else own | inner


def check_fill(null_fill: NullFill | None, field: Field, where: str) -> None:
    """Raise unless ``null_fill`` is set and exactly representable in ``field``'s dtype."""
    if null_fill is None:
        raise DataFormatError(
            f"{where}: holds nulls; pass null_fill=<number> to read null numbers as that number"
            " (null lists read as empty, null strings as '')"
        )
    if field.kind == "object":
        return
    converted = np.asarray(null_fill).astype(field.dtype)
    if converted.item() != null_fill:
        raise ValueError(
            f"null_fill={null_fill!r} cannot be stored in field {field.name!r} of dtype"
            f" {field.dtype} (it would read as {converted.item()!r})"
        )


def to_column(
    array: pa.Array,
    spec: ArrowField,
    null_fill: NullFill | None,
    rows: npt.NDArray[np.int64],
    where: str,
) -> Column:
    """``array`` as the column of ``spec``'s field; ``rows`` are the dataset indices of its
    entries and ``where`` names the file, both for the error raised on a null without
    ``null_fill``."""
    array = storage_array(array)
    mask = null_rows(array)
    if mask is not None and mask.any():
        if null_fill is None:
            sample = int(rows[int(np.argmax(mask))])
            raise DataFormatError(
                f"{where}: field {spec.field.name!r}: sample {sample} is null or holds a null;"
                " pass null_fill=<number> to read nulls (null lists read as empty, null strings"
                " as '')"
            )
        check_fill(null_fill, spec.field, f"{where}: field {spec.field.name!r}")
    field = spec.field
    if field.kind == "object":
        empty: str | bytes = "" if spec.text else b""
        return [empty if item is None else item for item in array.to_pylist()]
    if field.kind == "fixed":
        return _dense(array, null_fill)
    offsets = array.offsets.to_numpy().astype(np.int64)
    lengths = np.diff(offsets)
    if array.null_count:
        lengths[array.is_null().to_numpy(zero_copy_only=False)] = 0
    leaf = _dense(storage_array(array.values), null_fill)
    return Ragged(ragged_gather(leaf, offsets[:-1], lengths), lengths)


def _dense(array: pa.Array, null_fill: NullFill | None) -> np.ndarray:
    """A numeric or fixed-size-list array as ``[len, *shape]``, nulls replaced by the fill.

    Callers have rejected nulls in the samples read unless ``null_fill`` is set; a list's child
    may still hold nulls outside every sample read, which are filled with 0 and never used.
    """
    null_fill = 0 if null_fill is None else null_fill
    array = storage_array(array)
    t = array.type
    if pa.types.is_fixed_size_list(t):
        size = t.list_size
        child = storage_array(array.values).slice(array.offset * size, len(array) * size)
        inner = _dense(child, null_fill)
        out = inner.reshape(len(array), size, *inner.shape[1:])
        if array.null_count:
            out = out.copy()
            out[array.is_null().to_numpy(zero_copy_only=False)] = null_fill
        return out
    if array.null_count:
        fill = np.asarray(null_fill).astype(t.to_pandas_dtype()).item()
        array = pc.fill_null(array, pa.scalar(fill, type=t))
    # A copy the caller owns: Arrow's own memory is read-only, and torch warns on such arrays.
    return array.to_numpy(zero_copy_only=False, writable=True)


def list_lengths(
    array: pa.Array,
    spec: ArrowField,
    null_fill: NullFill | None,
    rows: npt.NDArray[np.int64],
    where: str,
) -> npt.NDArray[np.int64]:
    """Per-sample lengths of a list array from its offsets alone (null lists count as empty when
    ``null_fill`` is set, and raise otherwise)."""
    lengths = np.diff(array.offsets.to_numpy().astype(np.int64))
    if array.null_count:
        null = array.is_null().to_numpy(zero_copy_only=False)
        if null_fill is None:
            raise DataFormatError(
                f"{where}: field {spec.field.name!r}: sample {int(rows[int(np.argmax(null))])} is"
                " null; pass null_fill=<number> to read null lists as empty"
            )
        lengths[null] = 0
    return lengths
