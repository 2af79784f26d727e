"""Types shared by the readers, the collation and the engine (layer 0: imports nothing of ours).

A *columnar batch* is what a reader's ``read_batch(indices)`` returns and what ``PadCollate``
consumes: a dict from field name to

* :class:`Ragged` for a variable-length field (all requested samples' values concatenated, in
  the order of the requested indices, plus their lengths),
* a stacked ``numpy.ndarray`` of shape ``[B, *field.shape]`` for a fixed field,
* a ``list`` of Python objects (``str`` or ``bytes``) for an object field.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

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


class StorageCounts(NamedTuple):
    """What reads of a remote dataset cost in one process (cumulative), or in one batch (a
    difference of two): seconds blocked waiting for a shard to reach the local cache (its
    download, or another process's download of it), bytes this process downloaded, and reads
    whose shard was in the cache (hits) or was not (misses)."""

    waited_s: float = 0.0
    downloaded_bytes: int = 0
    hits: int = 0
    misses: int = 0

    def __add__(self, other: object) -> StorageCounts:
        if not isinstance(other, StorageCounts):
            return NotImplemented
        return StorageCounts(
            self.waited_s + other.waited_s,
            self.downloaded_bytes + other.downloaded_bytes,
            self.hits + other.hits,
            self.misses + other.misses,
        )

    def __sub__(self, other: StorageCounts) -> StorageCounts:
        return self + StorageCounts(
            -other.waited_s, -other.downloaded_bytes, -other.hits, -other.misses
        )


#: First element of a packed batch's int64 encoding: a negative number, never a sample index, so
#: that a reader handed the encoding by mistake fails instead of reading the wrong samples.
PACK_MAGIC = -0x5041434B

_PACK_HEADER = 4  # magic, seq_len, rows, pieces


@dataclass(frozen=True, eq=False)
class PackedBatch:
    """One packed batch: ``rows`` rows of at most ``seq_len`` tokens, each row a run of
    *pieces*, piece ``p`` being tokens ``starts[p]:stops[p]`` of sample ``samples[p]``.

    The pieces of row ``r`` are ``row_offsets[r]:row_offsets[r + 1]``, in the order they lie in
    the row; a row without pieces is padding only. What a packing sampler yields and a packing
    collate builds from; it travels between processes as one int64 array (:meth:`encode`, also
    what ``numpy.asarray`` gives), which :meth:`coerce` turns back into this.
    """

    samples: npt.NDArray[np.int64]
    starts: npt.NDArray[np.int64]
    stops: npt.NDArray[np.int64]
    row_offsets: npt.NDArray[np.int64]
    seq_len: int
    #: The :meth:`encode` array, where the batch was made from it (its columns view it).
    encoded: npt.NDArray[np.int64] | None = field(default=None, repr=False)

    @property
    def rows(self) -> int:
        return int(self.row_offsets.size - 1)

    @property
    def num_tokens(self) -> int:
        """Real tokens of the batch (every piece's length, summed)."""
        return int((self.stops - self.starts).sum())

    @property
    def pieces(self) -> int:
        """The number of pieces, over all rows."""
        return int(self.samples.size)

    def __len__(self) -> int:
        """The number of rows (padding-only ones included)."""
        return self.rows

    def __iter__(self) -> Iterator[list[tuple[int, int, int]]]:
        """Each row as its ``(sample, start, stop)`` pieces (:meth:`row`), in order."""
        return (self.row(r) for r in range(self.rows))

    def row(self, r: int) -> list[tuple[int, int, int]]:
        """Row ``r`` as ``(sample, start, stop)`` pieces."""
        first, last = int(self.row_offsets[r]), int(self.row_offsets[r + 1])
        return list(
            zip(
                self.samples[first:last].tolist(),
                self.starts[first:last].tolist(),
                self.stops[first:last].tolist(),
                strict=True,
            )
        )

    def encode(self) -> npt.NDArray[np.int64]:
        """The batch as one int64 array: a header, the row offsets, then the three piece
        columns."""
        if self.encoded is not None:
            return self.encoded
        header = np.array([PACK_MAGIC, self.seq_len, self.rows, self.pieces], dtype=np.int64)
        return np.concatenate((header, self.row_offsets, self.samples, self.starts, self.stops))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        encoded = self.encode()
        return encoded if dtype is None else encoded.astype(dtype)

    def __repr__(self) -> str:
        return (
            f"PackedBatch(rows={self.rows}, seq_len={self.seq_len}, pieces={self.pieces}, "
            f"tokens={self.num_tokens})"
        )

    @classmethod
    def coerce(cls, batch: object) -> PackedBatch:
        """``batch`` itself, or the batch its :meth:`encode` array (or bytes of it) describes;
        ``ValueError`` for anything else."""
        if isinstance(batch, PackedBatch):
            return batch
        if isinstance(batch, (bytes, bytearray, memoryview)):
            batch = np.frombuffer(batch, dtype=np.int64)
        array = np.asarray(batch)
        if array.ndim != 1 or array.size < _PACK_HEADER or array[0] != PACK_MAGIC:
            raise ValueError(
                "expected a packed batch (what PackedBatchSampler yields); got "
                f"{type(batch).__name__} {array.ravel()[:8].tolist()!r}: use a packing sampler "
                "with a packing collate and dataset (fastload.DataLoader(pack_length=...))"
            )
        seq_len, rows, pieces = (int(v) for v in array[1:_PACK_HEADER])
        if seq_len < 1 or rows < 0 or pieces < 0 or array.size != _PACK_HEADER + rows + 1 + 3 * pieces:
            raise ValueError(f"packed batch header {array[:_PACK_HEADER].tolist()} does not fit its {array.size} values")
        encoded = array.astype(np.int64, copy=False)
        body = encoded[_PACK_HEADER:]
        offsets = body[: rows + 1]
        columns = body[rows + 1 :].reshape(3, pieces)
        return cls(columns[0], columns[1], columns[2], offsets, seq_len, encoded)

    @staticmethod
    def empty_encoding(rows: int, pieces: int, seq_len: int) -> npt.NDArray[np.int64]:
        """An uninitialised encoding of ``rows`` rows and ``pieces`` pieces with its header
        written: ``[header, row_offsets, samples, starts, stops]`` for the caller to fill."""
        encoded = np.empty(_PACK_HEADER + rows + 1 + 3 * pieces, dtype=np.int64)
        encoded[:_PACK_HEADER] = (PACK_MAGIC, seq_len, rows, pieces)
        return encoded
