"""``PackCollate``: several documents per fixed-length row (sequence packing), with the arrays
that keep them apart in attention (document ids, ``cu_seqlens``) and in the loss (labels).

It packs exactly as a :class:`~fastload._collate._pack_source.PackedColumns` batch's plan says
(what ``PackedSource`` reads for a ``PackedBatchSampler``), or a plain batch in order,
next-fit. Like ``PadCollate`` the work is split for the engine's zero-copy path: ``prepare``
plans a batch (its ``layout``, ``counts`` and a ``fill(out)`` into arrays made from the layout).
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

from fastload._capabilities import dataset_fields
from fastload._collate import _kernels
from fastload._collate._call import collate_to_tensors
from fastload._collate._checks import (
    Scalar,
    batch_size,
    check_representable,
    names,
    numpy_dtype,
    optional_positive,
    pad_values,
)
from fastload._collate._columnar import samples_to_columnar
from fastload._collate._kernels import pack_into
from fastload._collate._pack_pieces import PieceColumns, check_plan, next_fit, piece_columns
from fastload._collate._pack_source import PackedColumns, PackedSource
from fastload._protocols import ALIGN, Built, Layout, OneCallBuilder, TooLarge
from fastload._types import Column, Counts, Field, PackedBatch, Ragged, Spans
from fastload.errors import DataFormatError, FieldNotFoundError

POSITIONS, LABELS, DOCUMENTS = "position_ids", "labels", "document_ids"
CU_SEQLENS, MAX_SEQLEN = "cu_seqlens", "max_seqlen"
GENERATED = (POSITIONS, LABELS, DOCUMENTS, CU_SEQLENS, MAX_SEQLEN)
#: With ``device_labels``: each row's real tokens (int32 ``[B]``), in the host batch in place of
#: ``labels``, right after the primary field (which is how :meth:`PackCollate.finish_batch`
#: finds the primary field without the schema).
ROW_TOKENS = "row_tokens"

_INT64, _INT32 = np.dtype(np.int64), np.dtype(np.int32)

#: What the schema needs of a field: its kind, stored dtype and element (or value) shape.
_Described = tuple[str, np.dtype | None, tuple[int, ...]]


@dataclass(frozen=True)
class _Schema:
    """What ``PackCollate`` decided once for batches of one shape of fields: the primary
    field, and the output dtype and pad value of each ragged and fixed field."""

    primary: str
    ragged: tuple[tuple[str, np.dtype, Scalar], ...]
    fixed: tuple[tuple[str, Scalar], ...]
    positions: np.dtype = _INT64
    #: Whether the host batch holds ``labels`` (else ``row_tokens``: ``device_labels``).
    labels: bool = True


class PackCollate:
    """Packs the pieces of a batch's documents into ``rows`` rows of ``seq_len`` tokens each.

    Returns a dict of tensors, ``B`` rows of ``L = seq_len`` tokens:

    * each ragged field as ``[B, L, *element shape]``: each row's pieces back to back from
      column 0, then ``pad_value``. The *primary* field (``primary``, else the first ragged
      field: the token ids) is written in ``dtype``; every other ragged field (a ``loss_mask``)
      keeps its stored dtype and is cut at the same tokens, so it must have the same lengths;
    * ``position_ids`` int64 (``position_dtype``) ``[B, L]``: 0, 1, 2, … restarting at every
      piece and at the row's padding;
    * ``labels`` int64 ``[B, L]``: the primary field's values, ``label_pad`` on the padding and
      on the first token of every piece (no document learns to predict the next one's start);
    * ``document_ids`` int32 ``[B, L]``: the pieces of each row numbered 0, 1, 2, … in row
      order, the row's padding the next number (monotone in a row, as Mamba's ``seq_idx``
      wants; a flex-attention mask compares ids within a row);
    * ``cu_seqlens`` int32 ``[segments + 1]``: the segment boundaries over the flattened
      ``[B * L]`` tokens, from 0 to ``B * L``: every piece is a segment, and so is each row's
      padding (an empty row is one segment of ``L``), so every row start is a boundary;
    * ``max_seqlen``: a 0-d int64 array, the longest segment (flash-attention's varlen
      functions take ``int(batch["max_seqlen"])``; an array, so that it travels in shared
      memory with the rest);
    * each fixed field (shape ``S`` per sample) as ``[B, L, *S]``, each token carrying its
      document's value, the padding ``pad_value``; object fields as a list of one value per
      piece, in piece order.

    What it packs:

    * a :class:`~fastload._collate._pack_source.PackedColumns` batch (``PackedSource``'s read of
      a ``PackedBatchSampler``'s batch) exactly as its plan says; a plan of another
      ``seq_len``, or of other than ``rows`` rows where ``rows`` is given, is refused;
    * a plain columnar batch or a list of sample dicts (as ``PadCollate`` takes them, so this is
      a ``collate_fn`` for torch's DataLoader too) in order, next-fit: each sample cut into
      pieces of at most ``seq_len`` tokens, each piece put in the current row if it fits, else
      in a new one. With ``rows`` the batch has exactly that many rows (an error names the
      tokens when they need more), else as many as it needs. Planned packing, which fills rows
      better, comes with ``PackedBatchSampler``.

    Options: ``pad_value`` is one number or a mapping from field name to number (fields not in
    it: 0), for ragged and fixed fields; ``label_pad`` is the label of padding and of each
    piece's first token (-100: what torch's cross entropy ignores). ``dtype`` is the output
    dtype of the primary field (int64: token ids as an embedding takes them); its stored values
    must cast to it without changing kind. ``fields`` selects the fields to output (default:
    all); no field may bear a generated array's name. ``ragged`` names the ragged fields of a
    list of sample dicts, or is a dataset's ``fields`` (see ``PadCollate``).

    Narrower outputs, for a model that takes them (fewer bytes a token to write and to copy):
    ``position_dtype=torch.int32`` writes ``position_ids`` as int32 (the same values).
    ``device_labels=True`` leaves ``labels`` out of the batch the engine writes and puts
    ``row_tokens`` (each row's real tokens, int32 ``[B]``) after the primary field instead;
    :meth:`finish_batch` builds ``labels`` from the ids, ``position_ids`` and ``row_tokens``
    with torch operations wherever the tensors are. ``fastload.DataLoader`` calls it after the
    copy to the GPU (``device="cuda"``), on the host otherwise; ``__call__`` returns the
    finished batch, so the output is the same either way.
    """

    def __init__(
        self,
        seq_len: int,
        *,
        rows: int | None = None,
        pad_value: Scalar | Mapping[str, Scalar] = 0,
        label_pad: int = -100,
        primary: str | None = None,
        fields: Sequence[str] | None = None,
        dtype: torch.dtype = torch.int64,
        ragged: Collection[str] | Mapping[str, Field] | None = None,
        position_dtype: torch.dtype = torch.int64,
        device_labels: bool = False,
    ) -> None:
        checked_len = optional_positive("seq_len", seq_len)
        if checked_len is None:
            raise ValueError("seq_len must be an integer >= 1; got None")
        self._seq_len = checked_len
        self._rows = optional_positive("rows", rows)
        if self._rows is not None and self._rows * self._seq_len > np.iinfo(np.int32).max:
            raise ValueError(
                f"rows * seq_len = {self._rows * self._seq_len} tokens do not fit cu_seqlens' "
                "int32; use fewer rows or a shorter seq_len"
            )
        self._pad_values, self._pad_default = pad_values(pad_value)
        if isinstance(label_pad, bool) or not isinstance(label_pad, (int, np.integer)):
            raise TypeError(f"label_pad must be an integer (an int64 label); got {label_pad!r}")
        check_representable(LABELS, int(label_pad), _INT64)
        self._label_pad = int(label_pad)
        if primary is not None and not isinstance(primary, str):
            raise TypeError(f"primary must be a field name or None; got {primary!r}")
        self._primary = primary
        self._fields = None if fields is None else names("fields", fields)
        self._dtype = numpy_dtype("dtype", dtype)
        self._position_dtype = numpy_dtype("position_dtype", position_dtype)
        if self._position_dtype not in (_INT32, _INT64):
            raise ValueError(
                f"position_dtype must be torch.int64 or torch.int32 (what models take as "
                f"position ids); got {position_dtype}"
            )
        if self._position_dtype == _INT32 and self._seq_len > np.iinfo(np.int32).max:
            raise ValueError(f"position_dtype=torch.int32 cannot hold the positions of seq_len={self._seq_len}")
        if not isinstance(device_labels, bool):
            raise TypeError(f"device_labels must be True or False; got {device_labels!r}")
        self._device_labels = device_labels
        if isinstance(ragged, Mapping):  # a dataset's ``fields``: name -> Field
            ragged = [name for name, field in ragged.items() if field.kind == "ragged"]
        self._ragged = None if ragged is None else frozenset(names("ragged", ragged))
        self._schemas: dict[tuple[tuple[str, str, np.dtype | None, tuple[int, ...]], ...], _Schema] = {}
        self._arange = np.arange(0, dtype=np.int64)  # grown as batches need; never written

    def __getstate__(self) -> dict[str, Any]:
        # Caches, made again where they are used: a collate pickles the same before and after
        # use (NOTE [parked workers] compares them).
        return {**self.__dict__, "_schemas": {}, "_arange": np.arange(0, dtype=np.int64)}

    @property
    def seq_len(self) -> int:
        return self._seq_len

    @property
    def rows(self) -> int | None:
        return self._rows

    @property
    def device_labels(self) -> bool:
        return self._device_labels

    def finish_batch(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """A batch written with ``device_labels=True`` (``row_tokens`` after the primary field)
        with ``labels`` built in place of ``row_tokens``, on the device of its tensors, keys in
        ``__call__``'s order; any other batch as it is. Queues torch operations only."""
        if ROW_TOKENS not in batch:
            return dict(batch)
        names = list(batch)
        at = names.index(ROW_TOKENS)
        if at == 0:
            raise ValueError(f"{ROW_TOKENS!r} must follow the primary field in a packed batch; got {names}")
        return self._finish(batch, names[at - 1])

    def _finish(self, batch: Mapping[str, Any], primary: str) -> dict[str, Any]:
        labels = finish_packed(batch[primary], batch[POSITIONS], batch[ROW_TOKENS], self._label_pad)
        out: dict[str, Any] = {}
        for name, value in batch.items():
            if name != ROW_TOKENS:
                out[name] = value
            if name == POSITIONS:
                out[LABELS] = labels
        return out

    #: The output is a function of the columnar batch alone (``fastload._protocols``). A
    #: subclass may compute otherwise: it says so itself (see ``__init_subclass__``).
    process_independent = True

    #: Ragged columns may come as ``Spans`` left in a reader's map (``fastload._protocols``).
    takes_spans = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "process_independent" not in vars(cls):
            cls.process_independent = False

    # -- the engine's interface ----------------------------------------------------------------

    def prepare(self, batch: Mapping[str, Any]) -> _Packed:
        """The batch planned once: its ``layout``, a ``fill(out)`` that fills arrays made from
        it, and its ``counts`` (``fastload._protocols.PreparedBatch``)."""
        columns, plan, lengths = self._pieces(batch)
        schema = self._schema({name: _describe(column) for name, column in columns.items()})
        return _Packed(self, columns, schema, plan, lengths)

    def layout(self, batch: Mapping[str, Any]) -> Layout:
        """Name → (shape, numpy dtype) of each array ``collate_into(batch, ...)`` writes: the
        fields in the batch's order, then the generated arrays; object fields are not
        arrays and not listed."""
        return self.prepare(batch).layout

    def collate_into(self, batch: Mapping[str, Any], out: Mapping[str, np.ndarray]) -> None:
        """Write the packed batch into ``out``, whose arrays must match ``layout(batch)``
        exactly (names, shapes, dtypes, C order); object fields are not written."""
        self.prepare(batch).write(out)

    def one_call_builder(self, reader: Any) -> OneCallBuilder | None:
        """A builder of ``reader``'s packed batches in one native call, or ``None`` where that
        does not apply (see the one-call builds below). A subclass that plans batches its own way
        (overrides :meth:`prepare`) gets none."""
        if type(self).prepare is not PackCollate.prepare:
            return None
        if self._fields is not None and len(self._fields) != 1:
            return None
        return pack_express_builder(reader, self)

    def max_layout(self, reader: Any) -> Layout | None:
        """The largest layout a batch of ``reader`` can have, for sizing the shared-memory
        slots: ``rows`` (else, for a ``PackedSource``, its ``pack_rows``) rows of each
        non-object field of its ``fields``, and ``cu_seqlens`` for the most segments a batch can have (``B * L``);
        ``None`` where the rows or the fields are not known."""
        rows = self._rows
        if rows is None and isinstance(reader, PackedSource):
            rows = reader.pack_rows
        fields = reader.capabilities.fields if isinstance(reader, PackedSource) else dataset_fields(reader)
        if rows is None or fields is None:
            return None
        selected = fields if self._fields is None else {n: fields[n] for n in self._fields if n in fields}
        described = {name: (f.kind, f.dtype, f.shape) for name, f in selected.items()}
        schema = self._schema(described)
        return _layout(schema, described, int(rows), self._seq_len, int(rows) * self._seq_len)

    def __call__(self, batch: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Pack a batch (see the class text) into a dict of tensors (and lists for object
        fields)."""
        columnar = batch if isinstance(batch, Mapping) else self._columnar(batch)
        prepared = self.prepare(columnar)
        if not self._device_labels:
            return collate_to_tensors(self, PackCollate, columnar, prepared, GENERATED)
        generated = (ROW_TOKENS, *(name for name in GENERATED if name != LABELS))
        return self._finish(collate_to_tensors(self, PackCollate, columnar, prepared, generated), prepared.schema.primary)

    # -- planning one batch --------------------------------------------------------------------

    def _columnar(self, samples: Sequence[Mapping[str, Any]]) -> Mapping[str, Column]:
        return samples_to_columnar(samples, ragged=self._ragged)

    def _select(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        if self._fields is None:
            return dict(batch)
        missing = [name for name in self._fields if name not in batch]
        if missing:
            raise FieldNotFoundError(
                f"PackCollate(fields=...) names {missing}, which the batch lacks; it has "
                f"{sorted(batch)}"
            )
        return {name: batch[name] for name in self._fields}

    def _pieces(
        self, batch: Mapping[str, Any]
    ) -> tuple[PieceColumns, PackedBatch, npt.NDArray[np.int64]]:
        """The batch's selected fields per piece, its plan, and each piece's length."""
        columns = self._select(batch)
        if isinstance(batch, PackedColumns):
            plan = batch.plan
            lengths = check_plan(plan, self._seq_len, "PackCollate")
            if self._rows is not None and plan.rows != self._rows:
                raise ValueError(
                    f"PackCollate(rows={self._rows}) was handed a packed batch of {plan.rows} "
                    "rows: give the sampler and the collate the same rows"
                )
            if columns and batch_size(columns) != lengths.size:
                raise DataFormatError(
                    f"the packed batch has {lengths.size} pieces but its columns "
                    f"{batch_size(columns)} entries"
                )
            for name, column in columns.items():
                if isinstance(column, (Ragged, Spans)) and not np.array_equal(column.lengths, lengths):
                    raise DataFormatError(
                        f"ragged field {name!r} of the packed batch does not hold its pieces' "
                        f"lengths {lengths[:16].tolist()}; got {column.lengths[:16].tolist()}"
                    )
                if isinstance(column, Ragged):  # pieces back to back: spans over them
                    begins = np.concatenate(([0], np.cumsum(lengths)))[:-1]
                    columns[name] = Spans(column.values, begins, lengths)
            return columns, plan, lengths
        if not columns:
            raise ValueError("PackCollate needs a batch with a ragged field to pack; got none")
        primary = self._schema({name: _describe(c) for name, c in columns.items()}).primary
        sample_lengths = np.asarray(columns[primary].lengths, dtype=np.int64)
        for name, column in columns.items():
            if isinstance(column, (Ragged, Spans)) and not np.array_equal(column.lengths, sample_lengths):
                odd = int(np.flatnonzero(np.asarray(column.lengths) != sample_lengths)[0])
                raise DataFormatError(
                    f"sample {odd} of the batch has {int(column.lengths[odd])} elements of "
                    f"{name!r} but {int(sample_lengths[odd])} of {primary!r}: packing cuts every "
                    "ragged field at the same tokens, so they need the same lengths"
                )
        plan = next_fit(sample_lengths, self._seq_len, self._rows)
        lengths = plan.stops - plan.starts
        return piece_columns(columns, plan.samples, plan.starts, plan.stops), plan, lengths

    def _schema(self, described: Mapping[str, _Described]) -> _Schema:
        signature = tuple((name, *d) for name, d in described.items())
        schema = self._schemas.get(signature)
        if schema is None:
            schema = self._schemas[signature] = self._decide(described)
        return schema

    def _decide(self, described: Mapping[str, _Described]) -> _Schema:
        """The per-field decisions for fields described so, checked once."""
        ragged_names = [name for name, (kind, _, _) in described.items() if kind == "ragged"]
        primary = self._primary
        if primary is None:
            if not ragged_names:
                raise FieldNotFoundError(
                    f"PackCollate packs a ragged field (token ids); the batch's fields "
                    f"{list(described)} have none"
                )
            primary = ragged_names[0]
        elif primary not in ragged_names:
            raise FieldNotFoundError(
                f"PackCollate(primary={primary!r}) is not a ragged field of the batch; its ragged "
                f"fields are {ragged_names}"
            )
        clashes = sorted(set(GENERATED + (ROW_TOKENS,) * self._device_labels) & set(described))
        if clashes:
            raise ValueError(
                f"the batch has fields named {clashes}, which PackCollate generates itself; leave "
                "them out with fields=[...]"
            )
        _, stored, shape = described[primary]
        assert stored is not None
        if shape != () or stored.kind not in "iu":
            raise ValueError(
                f"the primary field {primary!r} holds {stored} elements of shape {shape}, but "
                "labels need one integer token id per element: name the token-id field with "
                "primary=..."
            )
        ragged, fixed = [], []
        for name, (kind, dtype, _) in described.items():
            pad = self._pad_values.get(name, self._pad_default)
            if kind == "ragged":
                assert dtype is not None
                out = self._dtype if name == primary else dtype
                if not np.can_cast(dtype, out, casting="same_kind"):
                    raise ValueError(
                        f"field {name!r} holds {dtype}, which dtype={out} cannot hold without "
                        "changing kind (e.g. float to int); pick a dtype of the same kind"
                    )
                check_representable(name, pad, out)
                ragged.append((name, out, pad))
            elif kind == "fixed":
                assert dtype is not None
                check_representable(name, pad, dtype)
                fixed.append((name, pad))
        return _Schema(primary, tuple(ragged), tuple(fixed), self._position_dtype, not self._device_labels)

    def _positions(self, size: int) -> npt.NDArray[np.int64]:
        """``arange(size)`` as a view of a cached array (never written)."""
        if self._arange.size < size:
            self._arange = np.arange(size, dtype=np.int64)
            self._arange.flags.writeable = False
        return self._arange[:size]


def _describe(column: Column | Spans) -> _Described:
    if isinstance(column, Spans):
        return "ragged", column.source.dtype, column.source.shape[1:]
    if isinstance(column, Ragged):
        return "ragged", column.values.dtype, column.values.shape[1:]
    if isinstance(column, np.ndarray):
        return "fixed", column.dtype, column.shape[1:]
    return "object", None, ()


def _layout(
    schema: _Schema, described: Mapping[str, _Described], rows: int, seq_len: int, segments: int
) -> Layout:
    out_dtypes = {name: dtype for name, dtype, _ in schema.ragged}
    layout: Layout = {}
    for name, (kind, dtype, shape) in described.items():
        if kind != "object":
            assert dtype is not None
            layout[name] = ((rows, seq_len, *shape), out_dtypes.get(name, dtype))
        if name == schema.primary and not schema.labels:
            layout[ROW_TOKENS] = ((rows,), _INT32)
    layout[POSITIONS] = ((rows, seq_len), schema.positions)
    if schema.labels:
        layout[LABELS] = ((rows, seq_len), _INT64)
    layout[DOCUMENTS] = ((rows, seq_len), _INT32)
    layout[CU_SEQLENS] = ((segments + 1,), _INT32)
    layout[MAX_SEQLEN] = ((), _INT64)
    return layout


class _Packed:
    """One batch as ``PackCollate`` planned it: its pieces, where each lands, its segments
    (every piece, and each row's padding run) and the arrays it needs."""

    def __init__(
        self,
        collate: PackCollate,
        columns: PieceColumns,
        schema: _Schema,
        plan: PackedBatch,
        lengths: npt.NDArray[np.int64],
    ) -> None:
        self.collate = collate
        self.columns = columns
        self.schema = schema
        rows, seq_len = plan.rows, collate.seq_len
        if rows * seq_len > np.iinfo(np.int32).max:
            raise ValueError(f"{rows} rows of {seq_len} tokens do not fit cu_seqlens' int32")
        self.rows, self.seq_len, self.lengths = rows, seq_len, lengths
        self.offsets = offsets = plan.row_offsets
        pieces = lengths.size
        per_row = np.diff(offsets)
        row = np.repeat(np.arange(rows, dtype=np.int64), per_row)
        self.ends = ends = np.concatenate(([0], np.cumsum(lengths)))
        self.used = used = ends[offsets[1:]] - ends[offsets[:-1]]
        # Each piece's first token in the flattened [B * L] batch.
        self.first = row * seq_len + ends[:-1] - ends[offsets[:-1]][row]
        # The segments in flat order: row r's pieces, then its padding (dropped where empty).
        piece_at = np.arange(pieces, dtype=np.int64) + row
        padding_at = offsets[1:] + np.arange(rows, dtype=np.int64)
        seg_len = np.empty(pieces + rows, np.int64)
        seg_len[piece_at], seg_len[padding_at] = lengths, seq_len - used
        seg_doc = np.empty(pieces + rows, np.int32)
        seg_doc[piece_at], seg_doc[padding_at] = np.arange(pieces) - offsets[:-1][row], per_row
        seg_piece = np.empty(pieces + rows, np.int64)  # the pad value's row (pieces) for padding
        seg_piece[piece_at], seg_piece[padding_at] = np.arange(pieces), pieces
        kept = seg_len > 0
        self.seg_len, self.seg_doc, self.seg_piece = seg_len[kept], seg_doc[kept], seg_piece[kept]
        self.cu = np.concatenate(([0], np.cumsum(self.seg_len)))
        described = {name: _describe(column) for name, column in columns.items()}
        self.layout = _layout(schema, described, rows, seq_len, self.seg_len.size)

    @property
    def counts(self) -> Counts:
        """Rows, real tokens (the pieces') and padded tokens (``rows * seq_len``)."""
        return Counts(self.rows, int(self.ends[-1]), self.rows * self.seq_len)

    def write(self, out: Mapping[str, np.ndarray]) -> None:
        """Fill ``out``, whose arrays must match :attr:`layout` exactly (checked)."""
        expected = self.layout
        if set(out) != set(expected):
            raise ValueError(f"collate_into needs arrays {sorted(expected)}; got {sorted(out)}")
        for name, (shape, dtype) in expected.items():
            array = out[name]
            if array.shape != shape or array.dtype != dtype or not array.flags.c_contiguous:
                raise ValueError(
                    f"collate_into: array {name!r} must be C-contiguous with shape {shape} and "
                    f"dtype {dtype}; got {array.shape} {array.dtype}"
                    f"{'' if array.flags.c_contiguous else ', not C-contiguous'}"
                )
        self.fill(out)

    def fill(self, out: Mapping[str, np.ndarray]) -> None:
        """:meth:`write` without checking ``out`` (arrays made from :attr:`layout`)."""
        rows, seq_len, lengths = self.rows, self.seq_len, self.lengths
        label_pad = self.collate._label_pad
        host_labels = self.schema.labels
        primary_done = False
        gather: _Gather | None = None
        for name, _, pad in self.schema.ragged:
            column = self.columns[name]
            assert isinstance(column, Spans)
            is_primary = name == self.schema.primary
            # One native pass per field: the primary's also writes labels, positions and ids.
            if pack_into(
                column.source,
                column.starts,
                lengths,
                self.offsets,
                out[name],
                pad_value=pad,
                labels=out[LABELS] if is_primary and host_labels else None,
                label_pad=label_pad,
                positions=out[POSITIONS] if is_primary else None,
                documents=out[DOCUMENTS] if is_primary else None,
            ):
                primary_done |= is_primary
                continue
            gather = gather or _Gather(self)
            values = gather.values(column)
            target = out[name]
            target.fill(pad)
            target[gather.real] = values
            if is_primary and host_labels:
                labels = out[LABELS]
                labels.fill(label_pad)
                labels[gather.real] = values
                np.put(labels, self.first, label_pad)
        seg_len = self.seg_len
        if not primary_done:
            arange = self.collate._positions(rows * seq_len)
            np.subtract(arange, np.repeat(self.cu[:-1], seg_len), out=out[POSITIONS].reshape(-1))
            out[DOCUMENTS].reshape(-1)[...] = np.repeat(self.seg_doc, seg_len)
        if self.schema.fixed:
            source = np.repeat(self.seg_piece, seg_len)
            for name, pad in self.schema.fixed:
                column = self.columns[name]
                assert isinstance(column, np.ndarray)
                padded = np.concatenate((column, np.full((1, *column.shape[1:]), pad, column.dtype)))
                np.take(padded, source, axis=0, out=out[name].reshape(rows * seq_len, *column.shape[1:]))
        if not host_labels:
            out[ROW_TOKENS][...] = self.used
        out[CU_SEQLENS][...] = self.cu
        out[MAX_SEQLEN][...] = int(seg_len.max()) if seg_len.size else 0


class _Gather:
    """The numpy way to place pieces (where the native kernel does not apply): which cells of
    the rows are real, and each real token's offset within its piece."""

    def __init__(self, packed: _Packed) -> None:
        collate, lengths = packed.collate, packed.lengths
        tokens = int(packed.ends[-1])
        # Real tokens fill each row's head: a boolean scatter writes them in row order.
        self.real = collate._positions(packed.seq_len) < packed.used[:, None]
        self.within = collate._positions(tokens) - np.repeat(packed.ends[:-1], lengths)
        self.lengths = lengths

    def values(self, column: Spans) -> np.ndarray:
        return column.source[np.repeat(column.starts, self.lengths) + self.within]


def finish_packed(
    ids: torch.Tensor, positions: torch.Tensor, row_tokens: torch.Tensor, label_pad: int
) -> torch.Tensor:
    """The int64 ``labels`` of packed ``[B, L]`` ids, on their device: the ids, ``label_pad``
    on each piece's first token (position 0) and past each row's ``row_tokens`` real tokens."""
    # Few operations: on the GPU each is a kernel launched from the training loop's thread.
    kept = torch.arange(ids.shape[1], device=ids.device) < row_tokens.unsqueeze(1)
    kept.logical_and_(positions != 0)
    return torch.where(kept, ids.to(torch.int64), label_pad)



# -- one-call builds ---------------------------------------------------------------------------
# One-call builds of packed batches: one ragged field of token ids held whole in a memory map
# (a fastload HDF5 file), packed by ``PackCollate`` (the packing twin of ``_pad.py``'s).
#
# The native ``gather_pack`` reads the plan from the task's own bytes (a ``PackedBatch``'s
# encoding), checks every piece against the samples and ``seq_len``, lays the batch out as
# ``PackCollate`` would and writes the ids, positions, labels, document ids, ``cu_seqlens`` and
# ``max_seqlen`` in one pass over the rows; the general path (``PackedSource`` then
# ``PackCollate.prepare`` and ``fill``) makes some hundred numpy calls for the same batch. A plan
# it does not take goes the general way, which says what is wrong with it.

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
        # In the layout's order (``_layout``); without labels, lab_at holds row_tokens.
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



__all__ = ["GENERATED", "PackCollate", "PackExpressBuilder", "pack_express_builder"]
