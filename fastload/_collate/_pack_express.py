"""One-call builds of packed batches: one ragged field of token ids held whole in a memory map
(a fastload HDF5 file), packed by ``PackCollate`` (the packing twin of ``_express.py``).

The native ``gather_pack`` reads the plan from the task's own bytes (a ``PackedBatch``'s
encoding), checks every piece against the samples and ``seq_len``, lays the batch out as
``PackCollate`` would and writes the ids, positions, labels, document ids, ``cu_seqlens`` and
``max_seqlen`` in one pass over the rows; the general path (``PackedSource`` then
``PackCollate.prepare`` and ``fill``) makes some hundred numpy calls for the same batch. A plan
it does not take goes the general way, which says what is wrong with it.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from fastload._collate import _kernels
from fastload._collate._pack import (
    CU_SEQLENS,
    DOCUMENTS,
    LABELS,
    MAX_SEQLEN,
    POSITIONS,
    ROW_TOKENS,
    PackCollate,
)
from fastload._collate._pack_source import PackedSource
from fastload._protocols import ALIGN, Built, TooLarge
from fastload._types import Counts

_WRITTEN, _TOO_LARGE, _CANNOT = 0, 1, 2  # gather_pack's status
_I64, _I32 = np.dtype(np.int64).str, np.dtype(np.int32).str


class PackExpressBuilder:
    """A :class:`~fastload._protocols.OneCallBuilder` of packed batches over one mapped field."""

    def __init__(
        self,
        name: str,
        values: np.ndarray,
        offsets: np.ndarray,
        collate: PackCollate,
        out: np.dtype,
        pad: Any,
        positions: np.dtype,
        labels: bool,
    ) -> None:
        native = _kernels._native
        assert native is not None
        codes = _kernels.NATIVE_TYPES
        self._gather = native.gather_pack
        self._values, self._offsets = values, offsets
        self._source = (codes[values.dtype], math.prod(values.shape[1:]))
        self._out = (codes[out], int(pad), float(pad), collate._label_pad, collate.seq_len, ALIGN)
        self._name, self._ids_dtype = name, out.str
        self._positions = (positions.itemsize, positions.str)
        self._labels = labels
        self.last_s = 0.0

    def build_into(self, indices: bytes, buffer: np.ndarray, offset: int, capacity: int) -> Built | TooLarge | None:
        started = time.perf_counter()
        vt, items = self._source
        ot, pad_int, pad_float, label_pad, seq_len, align = self._out
        status, rows, segments, real, nbytes, pos_at, lab_at, doc_at, cu_at, max_at = self._gather(
            self._values, vt, items, self._offsets, indices, buffer, offset, capacity,
            ot, pad_int, pad_float, label_pad, seq_len, align, self._positions[0], self._labels,
        )  # fmt: skip
        if status == _CANNOT:
            return None
        if status == _TOO_LARGE:
            return TooLarge(nbytes)
        self.last_s = time.perf_counter() - started
        cells = (rows, seq_len)
        # In the layout's order (``_pack._layout``); without labels, lab_at holds row_tokens.
        head: tuple[tuple[str, int, tuple[int, ...], str], ...] = (
            ((self._name, 0, cells, self._ids_dtype), (POSITIONS, pos_at, cells, self._positions[1]),
             (LABELS, lab_at, cells, _I64))
            if self._labels
            else ((self._name, 0, cells, self._ids_dtype), (ROW_TOKENS, lab_at, (rows,), _I32),
                  (POSITIONS, pos_at, cells, self._positions[1]))
        )  # fmt: skip
        arrays = (
            *head,
            (DOCUMENTS, doc_at, cells, _I32),
            (CU_SEQLENS, cu_at, (segments + 1,), _I32),
            (MAX_SEQLEN, max_at, (), _I64),
        )
        return Built(arrays, nbytes, Counts(rows, real, rows * seq_len))


def pack_express_builder(reader: Any, collate: PackCollate) -> PackExpressBuilder | None:
    """The one-call builder of ``reader``'s packed batches, or ``None`` where it does not apply:
    ``reader`` reads packed batches (a ``PackedSource``) of a dataset whose ``mapped_ragged()``
    is its only field, of scalar integer ids, written by this collate in a native dtype. Maps the
    file in this process."""
    if _kernels._native is None or not isinstance(reader, PackedSource) or reader.seq_len != collate.seq_len:
        return None
    if not reader.capabilities.mapped_ragged:  # the dataset's, as the loader resolved them
        return None
    found = reader.dataset.mapped_ragged()
    if found is None:
        return None
    name, values, offsets = found
    if not (values.flags.c_contiguous and offsets.flags.c_contiguous) or values.shape[1:] != ():
        return None
    schema = collate._schema({name: ("ragged", values.dtype, ())})
    if schema.fixed or [n for n, _, _ in schema.ragged] != [name] or schema.primary != name:
        return None
    (_, out, pad), = schema.ragged
    codes = _kernels.NATIVE_TYPES
    if values.dtype not in codes or out not in codes or out.kind not in "iu":
        return None
    return PackExpressBuilder(name, values, offsets, collate, out, pad, schema.positions, schema.labels)


__all__ = ["PackExpressBuilder", "pack_express_builder"]
