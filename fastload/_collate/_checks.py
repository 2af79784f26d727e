"""Checking ``PadCollate``'s options and values: each bad one fails at construction (or at the
first batch whose dtype it cannot take) with a message naming it, the value and the remedy."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fastload._types import Ragged, Spans
from fastload.errors import DataFormatError

Scalar = bool | int | float


def numpy_dtype(option: str, dtype: torch.dtype) -> np.dtype:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{option} must be a torch.dtype; got {dtype!r}")
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError as error:
        raise ValueError(
            f"{option}={dtype} has no numpy equivalent for the shared-memory batch; collate to "
            "torch.float32 and convert on the device"
        ) from error


def check_pad_value(option: str, value: object) -> Scalar:
    if not isinstance(value, (bool, int, float, np.integer, np.floating)):
        raise TypeError(f"{option} must be a number; got {value!r}")
    return value.item() if isinstance(value, np.generic) else value


def optional_positive(option: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{option} must be an integer >= 1 or None; got {value!r}")
    return int(value)


def names(option: str, names: Collection[str]) -> list[str]:
    if isinstance(names, str) or not all(isinstance(name, str) for name in names):
        raise TypeError(f"{option} must be a sequence of field names; got {names!r}")
    return list(names)


def check_representable(name: str, pad_value: Scalar, dtype: np.dtype) -> None:
    kind = np.dtype(dtype).kind
    if kind in "iu":
        info = np.iinfo(dtype)
        if float(pad_value) != int(pad_value) or not info.min <= int(pad_value) <= info.max:
            raise ValueError(
                f"pad_value {pad_value!r} for field {name!r} does not fit its dtype {dtype} "
                f"({info.min}..{info.max}); pass dtype= (e.g. torch.int64) or another pad_value"
            )
    elif kind == "b" and pad_value not in (0, 1):
        raise ValueError(f"pad_value {pad_value!r} for boolean field {name!r} must be 0 or 1")


def batch_size(columns: Mapping[str, Any]) -> int:
    """The number of rows of a columnar batch, checked to be the same in every field."""
    size: int | None = None
    for name, column in columns.items():
        if isinstance(column, Spans):
            rows = len(column.lengths)
        elif isinstance(column, Ragged):
            rows = len(column.lengths)
            if column.values.shape[0] != int(column.lengths.sum()):
                raise DataFormatError(
                    f"ragged field {name!r} has {column.values.shape[0]} values but its lengths "
                    f"add up to {int(column.lengths.sum())}"
                )
        else:
            rows = len(column)
        if size is None:
            size = rows
        elif rows != size:
            sizes = {n: len(c.lengths) if isinstance(c, (Spans, Ragged)) else len(c) for n, c in columns.items()}
            raise DataFormatError(f"the fields of the batch disagree on its size: {sizes}")
    return size or 0


def check_generated_names(columns: Mapping[str, Any], rules: Sequence[Any]) -> None:
    """No field of the batch bears a name the collate generates (a mask, a lengths array)."""
    generated = [rule.lengths_name for rule in rules]
    generated += [rule.mask_name for rule in rules if rule.mask_name is not None]
    clashes = sorted(set(generated) & set(columns))
    if clashes:
        raise ValueError(
            f"the batch has fields named {clashes}, which PadCollate generates itself; leave "
            "them out with fields=[...] (the mask and lengths are rebuilt from the padding)"
        )


def pad_values(pad_value: Any) -> tuple[dict[str, Scalar], Scalar]:
    """``(per-field pad values, default)`` of a collate's ``pad_value`` option: one value for
    every field, or a mapping from field name to value (other fields pad with 0), each
    checked."""
    if isinstance(pad_value, Mapping):
        per_field = {
            str(name): check_pad_value(f"pad_value[{name!r}]", value)
            for name, value in pad_value.items()
        }
        return per_field, 0
    return {}, check_pad_value("pad_value", pad_value)

