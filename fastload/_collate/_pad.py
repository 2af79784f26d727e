"""``PadCollate``: pad ragged fields to the batch's longest row, stack fixed fields.

Works on a columnar batch (a reader's ``read_batch``) and on a list of sample dicts (a
``collate_fn`` for torch's DataLoader). For the engine's zero-copy path the work is split in
two: ``layout`` says which arrays the batch needs without allocating anything, and
``collate_into`` fills arrays the caller provides (views of shared memory). ``__call__`` is
those two plus an allocation and ``torch.from_numpy``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from fastload._capabilities import resolve_dataset
from fastload._collate import _kernels
from fastload._collate._call import collate_to_tensors
from fastload._collate._checks import (
    Scalar,
    batch_size,
    check_generated_names,
    check_representable,
    names,
    numpy_dtype,
    optional_positive,
    pad_values,
)
from fastload._collate._columnar import samples_to_columnar
from fastload._collate._kernels import pad_into
from fastload._protocols import ALIGN, Built, Layout, OneCallBuilder, TooLarge
from fastload._types import Column, Counts, Field, Ragged, Spans
from fastload.errors import FieldNotFoundError

#: A columnar batch as PadCollate reads it (``Columns``, or any mapping like it).
Columns = Mapping[str, Column | Spans]

MASK_NAME = "attention_mask"
LENGTHS_NAME = "lengths"
PADDING_SIDES = ("right", "left")


@dataclass(frozen=True)
class _FieldRule:
    """How one ragged field is written, fixed for as long as its stored dtype stays the same."""

    name: str
    dtype: np.dtype  # output dtype of the padded values
    pad_value: Scalar
    lengths_name: str
    mask_name: str | None


@dataclass(frozen=True)
class _Schema:
    """What ``PadCollate`` decided once for batches of one shape of columns (names, kinds and
    dtypes): the rule of each ragged field, in the batch's order."""

    ragged: tuple[_FieldRule, ...]


@dataclass(frozen=True)
class SingleField:
    """See :meth:`PadCollate.single_field`: the field's rule (its output dtype, pad value and
    the names of its mask and lengths) and the collate's options."""

    rule: _FieldRule
    mask_dtype: np.dtype
    max_length: int | None
    multiple: int
    left: bool


@dataclass(slots=True)
class _RaggedOut:
    """How one ragged field of one batch is written."""

    rule: _FieldRule
    column: Ragged | Spans
    kept: npt.NDArray[np.int64]  # row lengths after truncation to max_length
    width: int  # padded length: the longest kept row, rounded up to the multiple


class PadCollate:
    """Pads each ragged field to its longest row in the batch and stacks the fixed fields.

    Returns a dict of tensors:

    * each ragged field as ``[B, L, *element shape]``, ``L`` being the batch's longest row
      (after ``max_length``) rounded up to ``pad_to_multiple_of``, filled with ``pad_value``
      beyond each row (``padding_side="left"`` puts the padding first);
    * for the *primary* ragged field (``primary``, else the first ragged field):
      ``attention_mask`` ``[B, L]`` (``mask_dtype``, 1 on real elements) and ``lengths`` ``[B]``
      (int64, after truncation); every other ragged field ``x`` gets ``x_lengths`` ``[B]``
      (its mask is ``torch.arange(L) < x_lengths[:, None]``, reversed for left padding);
    * each fixed field stacked as ``[B, *shape]`` in its own dtype;
    * object fields (``str``/``bytes``) as Python lists.

    Options: ``pad_value`` and ``dtype`` (the output dtype of padded values) may be one value
    or a mapping from field name to value (fields not in the mapping: pad 0, default dtype).
    By default the primary ragged field, when stored as integers narrower than int64 (token ids
    stored as uint16), comes out as int64, what ``nn.Embedding`` and the losses take, as
    :class:`~fastload.PackCollate`'s does; every other field keeps its stored dtype. Pass
    ``dtype=`` (e.g. ``torch.uint16``, or ``{"input_ids": torch.uint16}``) for the narrow type.
    ``max_length`` keeps the first ``max_length`` elements of each row. ``fields`` selects the
    fields to output (default: all).

    A columnar batch says which fields are ragged. For a list of sample dicts, ``ragged`` names
    them — or pass the dataset's ``fields`` mapping (``ragged=ds.fields``). Without it, a 1-D
    value (list, tuple, 1-D array or tensor) is ragged, any other array or scalar fixed, and a
    ``str``/``bytes`` an object; so ragged fields with elements of their own (audio frames
    ``[T, 80]``) and fixed 1-D vectors need ``ragged=``.
    """

    def __init__(
        self,
        *,
        pad_value: Scalar | Mapping[str, Scalar] = 0,
        pad_to_multiple_of: int | None = None,
        padding_side: str = "right",
        dtype: torch.dtype | Mapping[str, torch.dtype] | None = None,
        max_length: int | None = None,
        mask_dtype: torch.dtype = torch.int64,
        fields: Sequence[str] | None = None,
        primary: str | None = None,
        ragged: Collection[str] | Mapping[str, Field] | None = None,
    ) -> None:
        self._pad_values, self._pad_default = pad_values(pad_value)
        self._multiple = optional_positive("pad_to_multiple_of", pad_to_multiple_of) or 1
        if padding_side not in PADDING_SIDES:
            raise ValueError(f"padding_side must be 'right' or 'left'; got {padding_side!r}")
        self._left = padding_side == "left"
        if isinstance(dtype, Mapping):
            self._dtypes = {
                str(name): numpy_dtype(f"dtype[{name!r}]", value) for name, value in dtype.items()
            }
            self._dtype_default: np.dtype | None = None
        else:
            self._dtypes = {}
            self._dtype_default = None if dtype is None else numpy_dtype("dtype", dtype)
        self._max_length = optional_positive("max_length", max_length)
        self._mask_dtype = numpy_dtype("mask_dtype", mask_dtype)
        self._fields = None if fields is None else names("fields", fields)
        if primary is not None and not isinstance(primary, str):
            raise TypeError(f"primary must be a field name or None; got {primary!r}")
        self._primary = primary
        if isinstance(ragged, Mapping):  # a dataset's ``fields``: name -> Field
            ragged = [name for name, field in ragged.items() if field.kind == "ragged"]
        self._ragged = None if ragged is None else frozenset(names("ragged", ragged))
        # Column signature (name, kind, stored dtype per column) -> what is fixed for it.
        self._schemas: dict[tuple[tuple[str, type, np.dtype | None], ...], _Schema] = {}

    def __getstate__(self) -> dict[str, Any]:
        # What was decided for the columns seen is a cache, made again where it is used: a
        # collate pickles the same before and after use (NOTE [parked workers] compares them).
        return {**self.__dict__, "_schemas": {}}

    @property
    def pad_to_multiple_of(self) -> int | None:
        """The multiple padded lengths are rounded up to (``fastload._protocols.RoundingCollate``)."""
        return None if self._multiple == 1 else self._multiple

    # -- the two halves of the zero-copy path -----------------------------------------------

    #: The output is a function of the columnar batch alone (``fastload._protocols``). A
    #: subclass may compute otherwise: it says so itself (see ``__init_subclass__``).
    process_independent = True

    #: Ragged columns may come as ``Spans`` left in a reader's map (``fastload._protocols``).
    takes_spans = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "process_independent" not in vars(cls):
            cls.process_independent = False

    def layout(self, batch: Columns) -> Layout:
        """Name → (shape, numpy dtype) of each array ``collate_into(batch, ...)`` writes;
        allocates nothing. Object fields are not arrays and not listed."""
        return self.prepare(batch).layout

    def collate_into(self, batch: Columns, out: Mapping[str, np.ndarray]) -> None:
        """Write the padded batch into ``out``, whose arrays must match ``layout(batch)``
        exactly (names, shapes, dtypes); object fields are not written."""
        self.prepare(batch).write(out)

    def prepare(self, batch: Columns) -> _Prepared:
        """The batch planned once: its ``layout``, a ``fill(out)`` that fills arrays made from
        it, and its ``counts`` (what ``layout`` followed by ``collate_into`` do, without
        planning the batch twice; ``fastload._protocols.PreparedBatch``)."""
        columns, ragged, rows = self._plan(batch)
        return _Prepared(self, columns, ragged, self._layout(columns, ragged, rows), rows)

    def one_call_builder(self, reader: Any) -> OneCallBuilder | None:
        """A builder of ``reader``'s batches padded by this collate in one native call, or
        ``None`` where that does not apply (see the one-call builds below). A subclass that plans batches
        its own way (overrides :meth:`prepare`) gets none."""
        if type(self).prepare is not PadCollate.prepare:
            return None
        return express_builder(reader, self)

    def __call__(self, batch: Columns | Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Collate a columnar batch or a list of sample dicts into a dict of tensors (and lists
        for object fields)."""
        columnar = (
            batch if isinstance(batch, Mapping) else samples_to_columnar(batch, ragged=self._ragged)
        )
        return collate_to_tensors(self, PadCollate, columnar, self.prepare(columnar))

    def single_field(self, name: str, column: Ragged | Spans) -> SingleField | None:
        """How batches made of ``column`` alone (the ragged field ``name``) are written, for a
        builder that pads them itself (the one-call builds below); ``None`` when
        this collate would not output exactly ``name``, its mask and its lengths. Checks what
        :meth:`prepare` checks, raising the same errors."""
        if (self._fields is not None and self._fields != [name]) or self._primary not in (None, name):
            return None
        columns = {name: column}
        signature = ((name, type(column), _stored_dtype(column)),)
        schema = self._schemas.get(signature)
        if schema is None:
            schema = self._schemas[signature] = self._schema(columns)
        (rule,) = schema.ragged
        return SingleField(rule, self._mask_dtype, self._max_length, self._multiple, self._left)

    # -- planning one batch --------------------------------------------------------------------

    def _select(self, batch: Columns) -> Columns:
        if self._fields is None:
            return batch
        missing = [name for name in self._fields if name not in batch]
        if missing:
            raise FieldNotFoundError(
                f"PadCollate(fields=...) names {missing}, which the batch lacks; it has "
                f"{sorted(batch)}"
            )
        return {name: batch[name] for name in self._fields}

    def _layout(self, columns: Columns, ragged: list[_RaggedOut], rows: int) -> Layout:
        specs = {spec.rule.name: spec for spec in ragged}
        layout: Layout = {}
        for name, column in columns.items():  # the fields first, in the batch's order
            if isinstance(column, np.ndarray):
                layout[name] = ((rows, *column.shape[1:]), column.dtype)
            elif name in specs:
                spec = specs[name]
                shape = (rows, spec.width, *_values(spec.column).shape[1:])
                layout[name] = (shape, spec.rule.dtype)
        for spec in ragged:  # then the masks and lengths they generate
            if spec.rule.mask_name is not None:
                layout[spec.rule.mask_name] = ((rows, spec.width), self._mask_dtype)
            layout[spec.rule.lengths_name] = ((rows,), _INT64)
        return layout

    def _plan(self, batch: Columns) -> tuple[Columns, list[_RaggedOut], int]:
        """The selected columns, how each ragged one is written, and the batch size."""
        columns = self._select(batch)
        signature = tuple((name, type(column), _stored_dtype(column)) for name, column in columns.items())
        schema = self._schemas.get(signature)
        if schema is None:
            schema = self._schemas[signature] = self._schema(columns)
        rows = batch_size(columns)
        multiple, max_length = self._multiple, self._max_length
        specs = []
        for rule in schema.ragged:
            column = columns[rule.name]
            assert isinstance(column, (Ragged, Spans))
            lengths = np.asarray(column.lengths, dtype=np.int64)
            kept = lengths if max_length is None else np.minimum(lengths, max_length)
            longest = int(kept.max()) if kept.size else 0
            specs.append(_RaggedOut(rule, column, kept, -(-longest // multiple) * multiple))
        return columns, specs, rows

    def _schema(self, columns: Columns) -> _Schema:
        """The per-field decisions for columns of this signature, checked once."""
        ragged_names = [
            name for name, column in columns.items() if isinstance(column, (Ragged, Spans))
        ]
        primary = self._primary
        if primary is None:
            primary = ragged_names[0] if ragged_names else None
        elif primary not in ragged_names:
            raise FieldNotFoundError(
                f"PadCollate(primary={primary!r}) is not a ragged field of the batch; its ragged "
                f"fields are {ragged_names}"
            )
        rules = []
        for name in ragged_names:
            column = columns[name]
            assert isinstance(column, (Ragged, Spans))
            stored = _values(column).dtype
            default = self._dtype_default
            if default is None:
                default = _INT64 if name == primary and _narrow_integer(stored) else stored
            dtype = np.dtype(self._dtypes.get(name, default))
            pad_value = self._pad_values.get(name, self._pad_default)
            if not np.can_cast(stored, dtype, casting="same_kind"):
                raise ValueError(
                    f"field {name!r} holds {stored}, which dtype={dtype} cannot hold without "
                    "changing kind (e.g. float to int); pick a dtype of the same kind"
                )
            check_representable(name, pad_value, dtype)
            is_primary = name == primary
            rules.append(
                _FieldRule(
                    name=name,
                    dtype=dtype,
                    pad_value=pad_value,
                    lengths_name=LENGTHS_NAME if is_primary else f"{name}_{LENGTHS_NAME}",
                    mask_name=MASK_NAME if is_primary else None,
                )
            )
        check_generated_names(columns, rules)
        return _Schema(tuple(rules))


_INT64 = np.dtype(np.int64)


def _narrow_integer(dtype: np.dtype) -> bool:
    """Integers narrower than int64 (token ids stored as uint16): widened by default, since
    ``nn.Embedding`` and the losses take int64 indices."""
    return dtype.kind in "iu" and dtype.itemsize < 8


def _stored_dtype(column: Column | Spans) -> np.dtype | None:
    """The dtype a column's elements are stored in (``None`` for object fields)."""
    if isinstance(column, Spans):
        return column.source.dtype
    if isinstance(column, Ragged):
        return column.values.dtype
    return column.dtype if isinstance(column, np.ndarray) else None


def _values(column: Ragged | Spans) -> np.ndarray:
    """Where a ragged column's elements lie (their dtype and element shape)."""
    return column.source if isinstance(column, Spans) else column.values


@dataclass(slots=True)
class _Prepared:
    """One batch as ``PadCollate`` planned it: the selected columns, how each ragged one is
    written, and the arrays it needs."""

    collate: PadCollate
    columns: Columns
    ragged: list[_RaggedOut]
    layout: Layout
    rows: int

    def write(self, out: Mapping[str, np.ndarray]) -> None:
        """Fill ``out``, whose arrays must match :attr:`layout` exactly (checked)."""
        expected = self.layout
        if set(out) != set(expected):
            raise ValueError(f"collate_into needs arrays {sorted(expected)}; got {sorted(out)}")
        for name, (shape, dtype) in expected.items():
            if out[name].shape != shape or out[name].dtype != dtype:
                raise ValueError(
                    f"collate_into: array {name!r} must have shape {shape} and dtype {dtype}; "
                    f"got {out[name].shape} {out[name].dtype}"
                )
        self.fill(out)

    def fill(self, out: Mapping[str, np.ndarray]) -> None:
        """:meth:`write` without checking ``out``, for a caller that made its arrays from
        :attr:`layout` itself."""
        for name, column in self.columns.items():
            if isinstance(column, np.ndarray):
                np.copyto(out[name], column)
        left = self.collate._left
        for spec in self.ragged:
            source, rule = spec.column, spec.rule
            pad_into(
                _values(source),
                source.lengths,
                spec.kept,
                out[rule.name],
                pad_value=rule.pad_value,
                left=left,
                mask_out=None if rule.mask_name is None else out[rule.mask_name],
                starts=source.starts if isinstance(source, Spans) else None,
            )
            out[rule.lengths_name][...] = spec.kept

    @property
    def counts(self) -> Counts:
        """Rows, real tokens and padded tokens of the primary ragged field (what the loader's
        statistics count), or just the rows when there is no ragged field."""
        rows = self.rows
        for spec in self.ragged:
            if spec.rule.mask_name is not None:
                return Counts(rows, int(spec.kept.sum()), rows * spec.width)
        return Counts(rows)


# -- one-call builds ---------------------------------------------------------------------------
# One-call builds for the commonest fast-path batch: a single ragged field held whole in a
# memory map (a fastload HDF5 file), padded by ``PadCollate``.
#
# The native ``gather_pad`` checks the indices, reads each sample's span from the offsets, lays
# the batch out as ``PadCollate`` would (ids, mask, lengths, each at a multiple of ``ALIGN``) and
# pads into the buffer, where the general path makes some 60 Python-level calls (the measured
# difference is in ``benchmarks/README.md``, "Measurements behind the design"). A batch it cannot take (an index out of range, say)
# goes the general way, which says what is wrong.

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
