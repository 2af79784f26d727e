"""``PackedSource``: a dataset read by packed batch (rows of pieces of samples) instead of by
sample index, for a packing collate.

A packing sampler yields a :class:`~fastload._types.PackedBatch` (or, to a worker, its int64
encoding); ``PackedSource`` reads the batch's distinct samples once with its dataset's own
reads and hands the collate :class:`PackedColumns`: one entry per *piece*, the plan attached.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from fastload._capabilities import DatasetCapabilities, has_lengths, resolve_dataset
from fastload._collate._columnar import samples_to_columnar
from fastload._collate._pack_pieces import check_plan, piece_columns
from fastload._types import Column, Field, PackedBatch, Ragged, Spans
from fastload.errors import DataFormatError


class PackedColumns(dict[str, Any]):
    """A columnar batch of the pieces of :attr:`plan`, in piece order (field name → column):
    each ragged field as :class:`~fastload._types.Spans` (piece ``p`` is its sample's tokens
    ``plan.starts[p]:plan.stops[p]`` where they lie in the values read), each fixed field as
    ``[pieces, *shape]`` (the sample's value, once per piece), each object field as a list of
    one value per piece."""

    plan: PackedBatch

    def __init__(self, columns: Mapping[str, Any], plan: PackedBatch) -> None:
        super().__init__(columns)
        self.plan = plan

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (dict(self), self.plan)


class PackedSource:
    """``dataset`` read by packed batch: ``read_batch(batch)`` takes a
    :class:`~fastload._types.PackedBatch` (or its int64 encoding, or bytes of that) and returns
    :class:`PackedColumns`, reading each distinct sample once (a sample split into several
    pieces is read once).

    Reads go through the dataset's ``read_batch`` where it has one, else through
    ``dataset[i]`` (``__getitems__``, what torch's DataLoader calls); either way the dataset
    must have ``lengths`` (tokens per sample), which the plan is checked against. Its
    capabilities pass through unchanged: ``fields``, ``process_independent_reads``, and
    ``reads_in_place`` with ``read_batch_in_place`` exist here only where the dataset has them;
    ``mapped_ragged`` never does (a one-call build of whole samples would bypass the packing).

    ``seq_len`` is the length of a packed row; ``rows`` (:attr:`pack_rows`) the rows of every
    batch, which a packing collate reads to size the shared-memory slots. ``capabilities`` are
    the dataset's as the loader resolved them (``fastload._capabilities``; resolved here when
    not given): a capability the dataset does not have is absent here too, whatever the
    dataset's attributes of that name hold.

    Every batch is checked, raising ``ValueError`` (:class:`~fastload.errors.DataFormatError`
    where the data disagrees with the dataset's own ``lengths``): its seq_len is this one; each
    piece is 1..seq_len tokens and ends within its sample; no row holds more than seq_len
    tokens; each ragged field of each sample read has ``lengths[sample]`` elements.
    """

    def __init__(
        self, dataset: Any, *, seq_len: int, rows: int, capabilities: DatasetCapabilities | None = None
    ) -> None:
        for option, value in (("seq_len", seq_len), ("rows", rows)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"PackedSource({option}=...) must be an integer >= 1; got {value!r}")
        if not has_lengths(dataset):
            raise TypeError(
                f"PackedSource needs a dataset with `lengths` (tokens per sample) to check the "
                f"packing against; {type(dataset).__name__} has none"
            )
        self.dataset = dataset
        self.capabilities = resolve_dataset(dataset) if capabilities is None else capabilities
        # The dataset's own ``read_batch`` where it reads batches, else one sample at a time.
        self._read_batch = dataset.read_batch if self.capabilities.reads_batches else None
        self.seq_len = int(seq_len)
        self.pack_rows = int(rows)

    # -- what passes through -------------------------------------------------------------------

    @property
    def lengths(self) -> npt.NDArray[np.int64]:
        return np.asarray(self.dataset.lengths)

    @property
    def fields(self) -> dict[str, Field]:
        """The dataset's ``fields``; absent (``AttributeError``) where it has none, so that
        the engine sees the dataset's capabilities, not this wrapper's."""
        fields = self.capabilities.fields
        if fields is None:
            raise AttributeError(f"{type(self.dataset).__name__} has no fields of fastload's")
        return dict(fields)

    @property
    def process_independent_reads(self) -> bool:
        return self.capabilities.process_independent_reads

    @property
    def reads_in_place(self) -> bool:
        return self.capabilities.reads_in_place

    @property
    def read_batch_in_place(self) -> Any:
        """:meth:`read_batch` through the dataset's ``read_batch_in_place`` (ragged fields as
        spans over its memory map); absent where the dataset does not read in place."""
        if not self.reads_in_place:
            raise AttributeError(f"{type(self.dataset).__name__} does not read in place")
        return self._read_in_place

    def __len__(self) -> int:
        return len(self.dataset)

    def prefetch(self, batches: Any, consumed: Any, **options: Any) -> Any:
        """The dataset's prefetch of the samples of ``batches`` (see the readers'), if it has
        one; ``None`` otherwise."""
        if not self.capabilities.remote:
            return None
        return self.dataset.prefetch(batches, consumed, **options)

    def storage_counts(self) -> Any:
        """The dataset's ``storage_counts()`` (a remote reader's), ``None`` where it has none."""
        return self.dataset.storage_counts() if self.capabilities.storage_counts else None

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __repr__(self) -> str:
        return f"PackedSource({self.dataset!r}, seq_len={self.seq_len}, rows={self.pack_rows})"

    # -- reading a packed batch ----------------------------------------------------------------

    def read_batch(self, batch: object) -> PackedColumns:
        """The pieces of ``batch`` (see the class text)."""
        return self._read(batch, self._read_batch or self._read_samples)

    def __getitems__(self, batch: object) -> PackedColumns:
        """:meth:`read_batch`, for torch's DataLoader (its collate gets the columns)."""
        return self.read_batch(batch)

    def _read_in_place(self, batch: object) -> PackedColumns:
        return self._read(batch, self.dataset.read_batch_in_place)

    def _read_samples(self, indices: npt.NDArray[np.int64]) -> dict[str, Column]:
        """A dataset without ``read_batch``: its samples one by one, made columnar."""
        fields = self.capabilities.fields
        ragged = None if fields is None else [n for n, f in fields.items() if f.kind == "ragged"]
        if indices.size:
            return samples_to_columnar([self.dataset[int(i)] for i in indices], ragged=ragged)
        if len(self.dataset) == 0:
            return {}
        # No sample to read (a batch of padding only): sample 0 says the fields and dtypes.
        one = samples_to_columnar([self.dataset[0]], ragged=ragged)
        return {name: _none_of(column) for name, column in one.items()}

    def _read(self, batch: object, read: Any) -> PackedColumns:
        plan = PackedBatch.coerce(batch)
        check_plan(plan, self.seq_len, "PackedSource")
        distinct, position = np.unique(plan.samples, return_inverse=True)
        columns: Mapping[str, Column | Spans] = read(distinct)
        stored = self.lengths[distinct]
        for name, column in columns.items():
            if isinstance(column, (Ragged, Spans)):
                self._check_lengths(name, distinct, stored, np.asarray(column.lengths))
        over = np.flatnonzero(plan.stops > stored[position])
        if over.size:
            p = int(over[0])
            raise ValueError(
                f"piece {p} of the packed batch is tokens {int(plan.starts[p])}:"
                f"{int(plan.stops[p])} of sample {int(plan.samples[p])}, which has "
                f"{int(stored[position[p]])} in {self._name()}: the packing was planned with "
                "other lengths than this dataset's"
            )
        return PackedColumns(piece_columns(columns, position, plan.starts, plan.stops), plan)

    def _check_lengths(
        self,
        name: str,
        samples: npt.NDArray[np.int64],
        stored: npt.NDArray[np.int64],
        found: npt.NDArray[np.int64],
    ) -> None:
        bad = np.flatnonzero(found != stored)
        if bad.size:
            i = int(bad[0])
            raise DataFormatError(
                f"{self._name()}: field {name!r} of sample {int(samples[i])} has "
                f"{int(found[i])} elements, but the dataset's lengths say {int(stored[i])}; "
                "packing cuts every ragged field at the same tokens, so each must have the "
                "length `lengths` gives (or leave the field out of the dataset)"
            )

    def _name(self) -> str:
        """The dataset as an error message names it: as its own ``repr`` does (fastload's
        readers name their files), else by its class. No attribute of the user's object is
        read by name: a ``path`` or ``files`` of its own may hold anything."""
        if type(self.dataset).__repr__ is object.__repr__:
            return type(self.dataset).__name__
        return repr(self.dataset)


def _none_of(column: Column) -> Column:
    """``column`` with no sample left, of the same kind, dtype and element shape."""
    if isinstance(column, Ragged):
        return Ragged(column.values[:0], column.lengths[:0])
    return column[:0]


__all__ = ["PackedColumns", "PackedSource"]
