"""Checks shared by the readers: sample indices, offsets, lengths, options.

None of these reads a payload: offsets and lengths are index data, a few bytes per sample.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np
import numpy.typing as npt

from fastload.errors import DataFormatError


def normalize_indices(indices: npt.ArrayLike, num_samples: int) -> npt.NDArray[np.int64]:
    """``indices`` as a 1-D int64 array with negative entries counted from the end.

    The result may share memory with ``indices`` (it is never written to). Raises ``TypeError``
    for non-integer indices and ``IndexError`` naming the first index that is out of
    ``[-num_samples, num_samples)``.
    """
    array = np.asarray(indices)
    if array.ndim != 1:
        if array.ndim == 0:
            raise TypeError(f"indices must be a sequence of integers; got the scalar {indices!r}")
        raise TypeError(f"indices must be 1-D; got an array of shape {array.shape}")
    if array.size == 0:
        return np.empty(0, np.int64)
    if array.dtype.kind not in "iu":
        raise TypeError(f"indices must be integers; got dtype {array.dtype}")
    if array.dtype == np.int64 and int(array.view(np.uint64).max()) < num_samples:
        return array  # the common case, in one reduction: negatives wrap to huge unsigned values
    low, high = int(array.min()), int(array.max())
    if low >= 0 and high < num_samples:
        return array.astype(np.int64, copy=False)
    if low < -num_samples or high >= num_samples:
        bad = (array < -num_samples) | (array >= num_samples)
        position = int(np.argmax(bad))
        raise IndexError(
            f"index {int(array[position])} (position {position} of the request) is out of range"
            f" for a dataset of {num_samples} samples"
        )
    result = array.astype(np.int64, copy=True)
    result[result < 0] += num_samples
    return result


def normalize_index(index: Any, num_samples: int) -> int:
    """One sample index as a non-negative int, with Python's negative-index rule."""
    try:
        value = operator.index(index)
    except TypeError:
        raise TypeError(
            f"a sample index must be an integer; got {type(index).__name__} {index!r}"
        ) from None
    if not -num_samples <= value < num_samples:
        raise IndexError(f"index {value} is out of range for a dataset of {num_samples} samples")
    return value + num_samples if value < 0 else value


def lengths_from_offsets(
    offsets: npt.NDArray[np.integer[Any]], num_values: int, *, where: str
) -> npt.NDArray[np.int64]:
    """Per-sample lengths ``diff(offsets)`` after checking that ``offsets`` describes a valid
    partition of ``num_values`` values: ``offsets[0] == 0``, non-decreasing, and
    ``offsets[-1] == num_values``.

    ``where`` names the file and field for the error message; the sample index of the first
    violation is named as well.
    """
    if offsets.ndim != 1 or offsets.shape[0] == 0:
        raise DataFormatError(
            f"{where}: offsets must be 1-D with N+1 >= 1 entries; got shape {offsets.shape}"
        )
    if offsets.dtype.kind not in "iu":
        raise DataFormatError(f"{where}: offsets must be integers; got dtype {offsets.dtype}")
    if int(offsets[0]) != 0:
        raise DataFormatError(f"{where}: offsets[0] must be 0; got {int(offsets[0])}")
    lengths = np.diff(offsets.astype(np.int64, copy=False)).astype(np.int64, copy=False)
    negative = lengths < 0
    if negative.any():
        sample = int(np.argmax(negative))
        raise DataFormatError(
            f"{where}: offsets decrease at sample {sample}: offsets[{sample}] ="
            f" {int(offsets[sample])} > offsets[{sample + 1}] = {int(offsets[sample + 1])};"
            " offsets must be non-decreasing"
        )
    if int(offsets[-1]) != num_values:
        raise DataFormatError(
            f"{where}: offsets[-1] (sample {offsets.shape[0] - 1}) is {int(offsets[-1])}, but"
            f" values holds {num_values} elements; the last offset must equal len(values)"
        )
    return lengths


def check_lengths_agree(
    stored: npt.NDArray[np.integer[Any]], computed: npt.NDArray[np.int64], *, where: str
) -> None:
    """Raise :class:`DataFormatError` naming the first sample where a stored lengths index
    disagrees with the lengths computed from the field itself."""
    if stored.shape != computed.shape:
        raise DataFormatError(
            f"{where}: holds {stored.shape[0] if stored.ndim else 'a scalar'} entries but the"
            f" field has {computed.shape[0]} samples; expected shape ({computed.shape[0]},)"
        )
    differ = stored != computed
    if differ.any():
        sample = int(np.argmax(differ))
        raise DataFormatError(
            f"{where}: sample {sample} has length {int(stored[sample])} in the lengths index but"
            f" {int(computed[sample])} in the field itself"
        )


def check_positive_int(name: str, value: object, *, minimum: int) -> int:
    """Validate an integer option; the message names the option, the value and the bound."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int; got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {value}")
    return int(value)
