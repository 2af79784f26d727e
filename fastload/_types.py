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
from typing import Literal, NamedTuple, Protocol, runtime_checkable

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
    (``_read_batch_in_place``), which gathers straight from ``source`` into the batch slot
    instead of concatenating the samples first. ``read_batch`` never returns it."""

    source: np.ndarray
    starts: npt.NDArray[np.int64]
    lengths: npt.NDArray[np.int64]


Column = Ragged | np.ndarray | list
ColumnarBatch = dict[str, Column]


@runtime_checkable
class BatchReader(Protocol):
    """What the fast path needs of a dataset; fastload's readers implement it and so may a
    user's own class (no base class required).

    Contract: ``read_batch`` accepts indices in any order, duplicates included, and returns the
    samples in that order; ``lengths[i]`` is the length of sample ``i`` of the field that drives
    length grouping, available without reading any payload.
    """

    @property
    def lengths(self) -> npt.NDArray[np.int64]: ...

    @property
    def fields(self) -> dict[str, Field]: ...

    def __len__(self) -> int: ...

    def read_batch(self, indices: npt.ArrayLike) -> ColumnarBatch: ...
