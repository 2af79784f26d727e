"""Turning a list of sample dicts (what torch's DataLoader hands a ``collate_fn``) into a
columnar batch, so that both inputs share one padding path.

How a field's kind is decided, from its values:

* ``str`` or ``bytes`` → *object*: passed through as a list;
* with ``ragged=`` given, the fields it names are *ragged* and every other field *fixed*;
* otherwise a 1-D value — ``list``, ``tuple``, 1-D ``numpy`` array or 1-D tensor — is *ragged*
  (padded along its only axis), and scalars and arrays of any other rank are *fixed* (stacked).
  A ragged field with elements of their own (audio frames ``[T, 80]``) or a fixed 1-D vector
  must therefore be named in ``ragged=`` (or left out of it).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fastload._types import ColumnarBatch, Ragged
from fastload.errors import DataFormatError


def samples_to_columnar(
    samples: Sequence[Mapping[str, Any]], *, ragged: Collection[str] | None
) -> ColumnarBatch:
    """The columnar form of ``samples`` (all with the same keys, in the first sample's order)."""
    if not samples:
        raise ValueError("cannot collate an empty list of samples")
    names = list(samples[0])
    for position, sample in enumerate(samples):
        if not isinstance(sample, Mapping):
            raise TypeError(
                f"sample {position} of the batch is a {type(sample).__name__}; PadCollate "
                "collates dicts of fields (or a columnar batch from read_batch)"
            )
        if set(sample) != set(names):
            raise DataFormatError(
                f"sample {position} of the batch has fields {sorted(sample)}, but sample 0 has "
                f"{sorted(names)}"
            )
    batch: ColumnarBatch = {}
    for name in names:
        values = [sample[name] for sample in samples]
        first = values[0]
        if isinstance(first, (str, bytes)):
            batch[name] = values
        elif _is_ragged(name, first, ragged):
            batch[name] = _ragged_column(name, values)
        else:
            batch[name] = _fixed_column(name, values)
    return batch


def _is_ragged(name: str, value: object, ragged: Collection[str] | None) -> bool:
    if ragged is not None:
        return name in ragged
    if isinstance(value, (list, tuple)):
        return True
    return isinstance(value, (np.ndarray, torch.Tensor)) and value.ndim == 1


def _as_array(value: object) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def _ragged_column(name: str, values: list[Any]) -> Ragged:
    arrays = [_as_array(value) for value in values]
    for position, array in enumerate(arrays):
        if array.ndim == 0:
            raise DataFormatError(
                f"field {name!r} is ragged but sample {position} of the batch holds a scalar "
                f"({array!r}); ragged values are sequences"
            )
    lengths = np.array([array.shape[0] for array in arrays], dtype=np.int64)
    # An empty Python list becomes a float64 array; leaving empty rows out of the
    # concatenation keeps the dtype of the real values.
    nonempty = [array for array in arrays if array.shape[0]] or arrays[:1]
    try:
        concatenated = np.concatenate(nonempty)
    except ValueError as error:
        shapes = sorted({array.shape[1:] for array in arrays})
        raise DataFormatError(
            f"field {name!r}: the elements of its rows differ in shape ({shapes}); every row "
            "of a ragged field needs elements of one shape"
        ) from error
    if concatenated.shape[0] != int(lengths.sum()):  # only empty rows: keep no elements
        concatenated = concatenated[:0]
    return Ragged(concatenated, lengths)


def _fixed_column(name: str, values: list[Any]) -> np.ndarray:
    arrays = [_as_array(value) for value in values]
    shapes = {array.shape for array in arrays}
    if len(shapes) > 1:
        first = arrays[0].shape
        odd = next(i for i, array in enumerate(arrays) if array.shape != first)
        raise DataFormatError(
            f"field {name!r} is fixed-shape but sample 0 has shape {first} and sample {odd} "
            f"has {arrays[odd].shape}; name it in PadCollate(ragged=...) if it varies in length"
        )
    return np.stack(arrays)
