"""Types shared by the readers, the collation and the engine (layer 0: imports nothing of ours).

A *columnar batch* is what a reader's ``read_batch(indices)`` returns and what ``PadCollate``
consumes: a dict from field name to

* :class:`Ragged` for a variable-length field (all requested samples' values concatenated, in
  the order of the requested indices, plus their lengths),
* a stacked ``numpy.ndarray`` of shape ``[B, *field.shape]`` for a fixed field,
* a ``list`` of Python objects (``str`` or ``bytes``) for an object field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
import numpy.typing as npt

FieldKind = Literal["ragged", "fixed", "object"]


@dataclass(frozen=True)
class Field:
    """What one field of a dataset holds.

    ``shape`` is the per-sample shape for a fixed field, and the shape of one *element* for a
    ragged field (``()`` for token ids, ``(80,)`` for frames of 80 features). Object fields
    (strings, bytes) have ``dtype == numpy.dtype(object)`` and ``shape == ()``.
    """

    name: str
    kind: FieldKind
    dtype: np.dtype
    shape: tuple[int, ...] = ()


class Ragged(NamedTuple):
    """A ragged field of a batch: ``values`` holds the samples back to back along axis 0 and
    ``lengths[i]`` (int64) is sample ``i``'s number of elements, so ``values.shape[0] ==
    lengths.sum()``."""

    values: np.ndarray
    lengths: npt.NDArray[np.int64]


class Spans(NamedTuple):
    """A ragged field left where it lies: sample ``i`` is ``source[starts[i] : starts[i] +
    lengths[i]]``. A reader whose values are memory-mapped hands this to the fast path's padding
    (``read_batch_in_place``), which gathers straight from ``source`` into the batch slot
    instead of concatenating the samples first. ``read_batch`` never returns it."""

    source: np.ndarray
    starts: npt.NDArray[np.int64]
    lengths: npt.NDArray[np.int64]


Column = Ragged | np.ndarray | list
ColumnarBatch = dict[str, Column]


class Counts(NamedTuple):
    """What one batch holds, for the loader's statistics: its rows, and the real and padded
    tokens of its primary ragged field (``None`` where the batch has none or its collate does
    not say)."""

    rows: int
    real_tokens: int | None = None
    padded_tokens: int | None = None
