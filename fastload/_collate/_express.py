"""One-call builds for the commonest fast-path batch: a single ragged field held whole in a
memory map (a fastload HDF5 file), padded by ``PadCollate``.

The native ``gather_pad`` checks the indices, reads each sample's span from the offsets, lays
the batch out as ``PadCollate`` would (ids, mask, lengths, each at a multiple of ``ALIGN``) and
pads into the buffer, where the general path makes some 60 Python-level calls (the measured
difference is in ``benchmarks/README.md``, "Measurements behind the design"). A batch it cannot take (an index out of range, say)
goes the general way, which says what is wrong.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from fastload._capabilities import resolve_dataset
from fastload._collate import _kernels
from fastload._collate._pad import PadCollate, SingleField
from fastload._protocols import ALIGN, Built, TooLarge
from fastload._types import Counts, Spans

_FITS, _TOO_LARGE, _CANNOT = 0, 1, 2  # gather_pad's status


class ExpressBuilder:
    """A :class:`~fastload._protocols.OneCallBuilder` over one mapped ragged field."""

    def __init__(self, name: str, values: np.ndarray, offsets: np.ndarray, single: SingleField) -> None:
        native = _kernels._native
        assert native is not None
        codes = _kernels.NATIVE_TYPES
        rule = single.rule
        self._gather = native.gather_pad
        self._values, self._offsets = values, offsets
        self._args = (
            codes[rule.dtype],
            codes[single.mask_dtype],
            0 if rule.dtype.kind == "f" else int(rule.pad_value),
            float(rule.pad_value),
            single.left,
            single.max_length or 0,
            single.multiple,
            ALIGN,
        )
        self._source = (codes[values.dtype], math.prod(values.shape[1:]))
        assert rule.mask_name is not None  # express_builder takes only a field with a mask
        self._names: tuple[str, str, str] = (name, rule.mask_name, rule.lengths_name)
        self._dtypes = (rule.dtype.str, single.mask_dtype.str, np.dtype(np.int64).str)
        self._elem = tuple(values.shape[1:])
        self.last_s = 0.0

    def build_into(
        self, indices: bytes, buffer: np.ndarray, offset: int, capacity: int
    ) -> Built | TooLarge | None:
        started = time.perf_counter()
        vt, items = self._source
        ot, mt, pad_int, pad_float, left, max_length, multiple, align = self._args
        status, rows, width, real, nbytes, mask_at, lengths_at = self._gather(
            self._values, vt, items, self._offsets, indices, buffer, offset, capacity,
            ot, mt, pad_int, pad_float, left, max_length, multiple, align,
        )  # fmt: skip
        if status == _CANNOT:
            return None
        if status == _TOO_LARGE:
            return TooLarge(nbytes)
        self.last_s = time.perf_counter() - started
        name, mask, lengths = self._names
        ids_t, mask_t, lengths_t = self._dtypes
        arrays: tuple[tuple[str, int, tuple[int, ...], str], ...] = (
            (name, 0, (rows, width, *self._elem), ids_t),
            (mask, mask_at, (rows, width), mask_t),
            (lengths, lengths_at, (rows,), lengths_t),
        )
        return Built(arrays, nbytes, Counts(rows, real, rows * width))


def express_builder(reader: Any, collate: PadCollate) -> ExpressBuilder | None:
    """The one-call builder of ``reader``'s batches padded by ``collate``, or ``None`` where
    one-call builds do not apply: judged from the reader alone (its in-place reads would give
    ``Spans`` over the very arrays its ``mapped_ragged()`` returns). Maps the file in this
    process."""
    if _kernels._native is None or not resolve_dataset(reader).mapped_ragged:
        return None
    found = reader.mapped_ragged()
    if found is None:
        return None
    name, values, offsets = found
    if not (values.flags.c_contiguous and offsets.flags.c_contiguous):
        return None
    none = np.zeros(0, np.int64)
    single = collate.single_field(name, Spans(values, none, none))
    codes = _kernels.NATIVE_TYPES
    if single is None or single.rule.mask_name is None:
        return None
    if any(d not in codes for d in (values.dtype, single.rule.dtype, single.mask_dtype)):
        return None
    return ExpressBuilder(name, values, offsets, single)
