"""PackCollate: the arrays of a packed batch on hand-made plans (exact values), their invariants
on random ones, next-fit packing of plain batches, the largest layout, and each error."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastload._collate import PackCollate
from fastload._collate._pack_source import PackedColumns, PackedSource
from fastload._types import Field, PackedBatch, Ragged, Spans
from fastload.errors import DataFormatError, FieldNotFoundError

SAMPLES = [
    [10, 11, 12, 13, 14],
    [20, 21, 22],
    [30, 31, 32, 33, 34, 35, 36],
]


def plan(rows: list[list[tuple[int, int, int]]], seq_len: int) -> PackedBatch:
    pieces = [piece for row in rows for piece in row]
    column = np.array(pieces, dtype=np.int64).reshape(-1, 3).T
    offsets = np.concatenate(([0], np.cumsum([len(row) for row in rows]))).astype(np.int64)
    return PackedBatch(column[0].copy(), column[1].copy(), column[2].copy(), offsets, seq_len)


def packed(batch: PackedBatch, samples: list[list[int]], **extra: Any) -> PackedColumns:
    """The per-piece columns of ``batch`` over ``samples`` concatenated (as PackedSource
    builds them), ``loss_mask`` (each token's parity), plus per-piece ``extra`` columns."""
    values = np.concatenate([np.asarray(s, np.int32) for s in samples] or [np.zeros(0, np.int32)])
    begins = np.concatenate(([0], np.cumsum([len(s) for s in samples], dtype=np.int64)))[:-1]
    starts = begins[batch.samples] + batch.starts
    lengths = batch.stops - batch.starts
    columns: dict[str, Any] = {
        "ids": Spans(values, starts, lengths),
        "loss_mask": Spans((values % 2).astype(np.uint8), starts, lengths),
    }
    columns.update(extra)
    return PackedColumns(columns, batch)


def hand_made() -> PackedBatch:
    """Row 0: sample 0; row 1: sample 1 then the head of sample 2; row 2: the rest of sample 2;
    row 3: padding only."""
    return plan([[(0, 0, 5)], [(1, 0, 3), (2, 0, 3)], [(2, 3, 7)], []], seq_len=6)


def test_a_hand_made_plan_gives_exactly_the_expected_arrays() -> None:
    batch = hand_made()
    score = np.array([[0.5, 1.0], [1.5, 2.0], [2.5, 3.0]], np.float32)[batch.samples]
    names = [f"s{i}" for i in batch.samples.tolist()]
    out = PackCollate(6, pad_value={"ids": 0, "score": -1})(packed(batch, SAMPLES, score=score, name=names))
    assert list(out) == [
        "ids", "loss_mask", "score", "name",
        "position_ids", "labels", "document_ids", "cu_seqlens", "max_seqlen",
    ]  # fmt: skip
    ids = [
        [10, 11, 12, 13, 14, 0],
        [20, 21, 22, 30, 31, 32],
        [33, 34, 35, 36, 0, 0],
        [0, 0, 0, 0, 0, 0],
    ]
    assert out["ids"].dtype == torch.int64 and out["ids"].tolist() == ids
    assert out["loss_mask"].dtype == torch.uint8
    assert out["loss_mask"].tolist() == [
        [0, 1, 0, 1, 0, 0],
        [0, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 0],
        [0, 0, 0, 0, 0, 0],
    ]
    assert out["position_ids"].tolist() == [
        [0, 1, 2, 3, 4, 0],
        [0, 1, 2, 0, 1, 2],
        [0, 1, 2, 3, 0, 1],
        [0, 1, 2, 3, 4, 5],
    ]
    x = -100
    assert out["labels"].dtype == torch.int64
    assert out["labels"].tolist() == [
        [x, 11, 12, 13, 14, x],
        [x, 21, 22, x, 31, 32],
        [x, 34, 35, 36, x, x],
        [x, x, x, x, x, x],
    ]
    assert out["document_ids"].dtype == torch.int32
    assert out["document_ids"].tolist() == [
        [0, 0, 0, 0, 0, 1],
        [0, 0, 0, 1, 1, 1],
        [0, 0, 0, 0, 1, 1],
        [0, 0, 0, 0, 0, 0],
    ]
    assert out["cu_seqlens"].dtype == torch.int32
    assert out["cu_seqlens"].tolist() == [0, 5, 6, 9, 12, 16, 18, 24]
    assert out["max_seqlen"].shape == () and int(out["max_seqlen"]) == 6
    assert out["score"].shape == (4, 6, 2)
    assert out["score"][0, :, 0].tolist() == [0.5] * 5 + [-1.0]
    assert out["score"][1, :, 1].tolist() == [2.0] * 3 + [3.0] * 3
    assert out["score"][2, :, 0].tolist() == [2.5] * 4 + [-1.0] * 2
    assert (out["score"][3] == -1).all()
    assert out["name"] == ["s0", "s1", "s2", "s2"]


def test_counts_give_the_real_and_padded_tokens() -> None:
    counts = PackCollate(6).prepare(packed(hand_made(), SAMPLES)).counts
    assert (counts.rows, counts.real_tokens, counts.padded_tokens) == (4, 15, 24)


def test_a_batch_of_padding_only_is_one_segment_per_row() -> None:
    empty = plan([[], []], seq_len=4)
    out = PackCollate(4, rows=2)(packed(empty, SAMPLES))
    assert out["ids"].tolist() == [[0] * 4] * 2
    assert out["labels"].tolist() == [[-100] * 4] * 2
    assert out["position_ids"].tolist() == [[0, 1, 2, 3]] * 2
    assert out["document_ids"].tolist() == [[0] * 4] * 2
    assert out["cu_seqlens"].tolist() == [0, 4, 8]
    assert int(out["max_seqlen"]) == 4


def test_a_full_row_has_no_padding_segment() -> None:
    full = plan([[(2, 0, 4), (1, 0, 2)]], seq_len=6)
    out = PackCollate(6)(packed(full, SAMPLES))
    assert out["cu_seqlens"].tolist() == [0, 4, 6]
    assert out["document_ids"].tolist() == [[0, 0, 0, 0, 1, 1]]


def test_the_pieces_of_a_split_sample_in_two_batches_make_up_the_sample() -> None:
    collate = PackCollate(4)
    head = collate(packed(plan([[(2, 0, 4)]], 4), SAMPLES))
    tail = collate(packed(plan([[(0, 0, 1), (2, 4, 7)]], 4), SAMPLES))
    assert head["ids"].tolist() == [[30, 31, 32, 33]]
    assert tail["ids"].tolist() == [[10, 34, 35, 36]]
    assert tail["labels"].tolist() == [[-100, -100, 35, 36]]
    assert tail["position_ids"].tolist() == [[0, 0, 1, 2]]


def test_ragged_columns_may_come_as_the_pieces_back_to_back() -> None:
    batch = hand_made()
    spans = packed(batch, SAMPLES)
    values = {
        name: np.concatenate([c.source[s : s + n] for s, n in zip(c.starts, c.lengths, strict=True)])
        for name, c in spans.items()
    }
    ragged = PackedColumns({n: Ragged(v, batch.stops - batch.starts) for n, v in values.items()}, batch)
    a, b = PackCollate(6)(spans), PackCollate(6)(ragged)
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_the_primary_field_and_its_dtype_are_chosen() -> None:
    out = PackCollate(6, primary="ids", dtype=torch.int32)(packed(hand_made(), SAMPLES))
    assert out["ids"].dtype == torch.int32 and out["labels"].dtype == torch.int64
    by_mask = PackCollate(6, primary="loss_mask")(packed(hand_made(), SAMPLES))
    assert by_mask["labels"][0].tolist() == [-100, 1, 0, 1, 0, -100]
    assert by_mask["ids"].dtype == torch.int32  # not primary: kept as stored


def test_fields_selects_the_output() -> None:
    out = PackCollate(6, fields=["ids"])(packed(hand_made(), SAMPLES))
    assert "loss_mask" not in out and "ids" in out
    with pytest.raises(FieldNotFoundError, match="missing"):
        PackCollate(6, fields=["missing"])(packed(hand_made(), SAMPLES))


# -- invariants on random plans ----------------------------------------------------------------


def random_batch(data: st.DataObject) -> tuple[PackedColumns, list[np.ndarray], int]:
    """Samples of random lengths, packed next-fit in pieces of random cut points."""
    seq_len = data.draw(st.integers(1, 12), label="seq_len")
    lengths = data.draw(st.lists(st.integers(1, 30), min_size=0, max_size=8), label="lengths")
    samples = [np.arange(n, dtype=np.int64) + 100 * (i + 1) for i, n in enumerate(lengths)]
    pieces = []
    for i, n in enumerate(lengths):
        start = 0
        while start < n:
            stop = min(n, start + data.draw(st.integers(1, seq_len)))
            pieces.append((i, start, stop))
            start = stop
    rows: list[list[tuple[int, int, int]]] = [[]]
    used = 0
    for piece in pieces:
        size = piece[2] - piece[1]
        if used + size > seq_len or data.draw(st.booleans()):
            rows.append([])
            used = 0
        rows[-1].append(piece)
        used += size
    rows += [[]] * data.draw(st.integers(0, 2))  # trailing padding rows
    batch = plan(rows, seq_len)
    return packed(batch, [s.tolist() for s in samples]), samples, seq_len


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_every_output_keeps_its_invariants_on_random_plans(data: st.DataObject) -> None:
    columns, samples, seq_len = random_batch(data)
    batch = columns.plan
    out = {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in PackCollate(seq_len)(columns).items()}
    rows = batch.rows
    cu = out["cu_seqlens"]
    assert cu[0] == 0 and cu[-1] == rows * seq_len and (np.diff(cu) > 0).all()
    boundaries = set(cu.tolist())
    assert {r * seq_len for r in range(rows)} <= boundaries
    assert int(out["max_seqlen"]) == (int(np.diff(cu).max()) if rows else 0)
    flat_ids = out["ids"].reshape(-1)
    flat_labels = out["labels"].reshape(-1)
    real = np.zeros(rows * seq_len, bool)
    for r in range(rows):
        column = 0
        for piece, (sample, start, stop) in enumerate(batch.row(r)):
            first = r * seq_len + column
            assert {first, first + stop - start} <= boundaries
            assert flat_ids[first : first + stop - start].tolist() == samples[sample][start:stop].tolist()
            assert flat_labels[first] == -100
            assert flat_labels[first + 1 : first + stop - start].tolist() == samples[sample][start + 1 : stop].tolist()
            assert out["position_ids"][r, column : column + stop - start].tolist() == list(range(stop - start))
            assert (out["document_ids"][r, column : column + stop - start] == piece).all()
            real[first : first + stop - start] = True
            column += stop - start
        tail = seq_len - column
        assert out["position_ids"][r, column:].tolist() == list(range(tail))
        assert (out["document_ids"][r, column:] == len(batch.row(r))).all()
        assert (np.diff(out["document_ids"][r]) >= 0).all()
    assert (flat_labels[~real] == -100).all() and (flat_ids[~real] == 0).all()
    # Within a segment the positions count up from 0: a segment starts where a position is 0.
    assert np.array_equal(np.flatnonzero(out["position_ids"].reshape(-1) == 0), cu[:-1])


# -- plain batches, packed next-fit -------------------------------------------------------------


def test_a_list_of_samples_is_packed_in_order_next_fit() -> None:
    samples = [{"ids": s, "label": i, "name": f"s{i}"} for i, s in enumerate(SAMPLES)]
    out = PackCollate(6)(samples)
    # Sample 2 (7 tokens) is cut into 6 + 1; next-fit never goes back to an earlier row.
    assert out["ids"].tolist() == [
        [10, 11, 12, 13, 14, 0],
        [20, 21, 22, 0, 0, 0],
        [30, 31, 32, 33, 34, 35],
        [36, 0, 0, 0, 0, 0],
    ]
    assert out["label"].tolist() == [[0] * 5 + [0], [1] * 3 + [0] * 3, [2] * 6, [2] + [0] * 5]
    assert out["name"] == ["s0", "s1", "s2", "s2"]
    assert out["labels"][3].tolist() == [-100] * 6


def test_next_fit_fills_the_current_row_while_pieces_fit() -> None:
    out = PackCollate(8)([{"ids": [1, 2]}, {"ids": [3, 4, 5]}, {"ids": [6, 7, 8, 9]}, {"ids": [10]}])
    assert out["ids"].tolist() == [[1, 2, 3, 4, 5, 0, 0, 0], [6, 7, 8, 9, 10, 0, 0, 0]]
    assert out["document_ids"].tolist() == [[0, 0, 1, 1, 1, 2, 2, 2], [0, 0, 0, 0, 1, 2, 2, 2]]


def test_a_columnar_batch_packs_as_its_list_of_samples() -> None:
    values = np.concatenate([np.asarray(s, np.int32) for s in SAMPLES])
    lengths = np.array([len(s) for s in SAMPLES], np.int64)
    columnar = {"ids": Ragged(values, lengths), "loss_mask": Ragged(values % 2, lengths)}
    as_list = [{"ids": s, "loss_mask": np.asarray(s, np.int32) % 2} for s in SAMPLES]
    a, b = PackCollate(6, rows=5)(columnar), PackCollate(6, rows=5)(as_list)
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert a["ids"].shape == (5, 6) and (a["ids"][4] == 0).all()


def test_next_fit_with_too_few_rows_names_the_tokens() -> None:
    with pytest.raises(ValueError, match=r"15 tokens in 3 samples need 4 rows .* rows=2"):
        PackCollate(6, rows=2)([{"ids": s} for s in SAMPLES])


def test_plain_ragged_fields_of_other_lengths_are_refused() -> None:
    samples = [{"ids": [1, 2, 3], "loss_mask": [1, 1, 1]}, {"ids": [4, 5], "loss_mask": [1]}]
    with pytest.raises(DataFormatError, match=r"sample 1 .* 1 elements of 'loss_mask' but 2 of 'ids'"):
        PackCollate(4)(samples)


# -- the engine's interface ---------------------------------------------------------------------


def test_collate_into_fills_arrays_made_from_the_layout_as_call_does() -> None:
    collate = PackCollate(6)
    columns = packed(hand_made(), SAMPLES, name=["a", "b", "c", "d"])
    layout = collate.layout(columns)
    assert "name" not in layout
    assert list(layout)[-5:] == ["position_ids", "labels", "document_ids", "cu_seqlens", "max_seqlen"]
    out = {name: np.full(shape, 99, dtype) for name, (shape, dtype) in layout.items()}
    collate.collate_into(columns, out)
    expected = collate(columns)
    for name in layout:
        assert np.array_equal(out[name], expected[name].numpy()), name


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda out: out.pop("labels"), "needs arrays"),
        (lambda out: out.update(labels=np.zeros((4, 5), np.int64)), r"'labels' must .* shape \(4, 6\)"),
        (lambda out: out.update(ids=np.zeros((4, 6), np.int32)), r"'ids' must .* dtype int64"),
        (lambda out: out.update(ids=np.zeros((6, 4), np.int64).T), "not C-contiguous"),
    ],
)
def test_collate_into_refuses_arrays_unlike_the_layout(change: Any, message: str) -> None:
    collate = PackCollate(6)
    columns = packed(hand_made(), SAMPLES)
    out = {name: np.zeros(shape, dtype) for name, (shape, dtype) in collate.layout(columns).items()}
    change(out)
    with pytest.raises(ValueError, match=message):
        collate.collate_into(columns, out)


class _Fields:
    """A dataset with fastload's ``fields`` (all ``max_layout`` reads of it)."""

    def __init__(self, fields: dict[str, Field]) -> None:
        self.fields = fields
        self.lengths = np.ones(1, np.int64)

    def __len__(self) -> int:
        return 1


def _Reader(fields: dict[str, Field], pack_rows: int | None) -> Any:
    """What max_layout looks at: a reader's fields and, from a PackedSource, its rows."""
    dataset = _Fields(fields)
    return dataset if pack_rows is None else PackedSource(dataset, seq_len=5, rows=pack_rows)


FIELDS = {
    "ids": Field("ids", "ragged", np.dtype(np.uint16)),
    "frames": Field("frames", "ragged", np.dtype(np.float32), (3,)),
    "score": Field("score", "fixed", np.dtype(np.float64), (2,)),
    "name": Field("name", "object", np.dtype(object)),
}


def test_max_layout_holds_every_batch_of_its_rows() -> None:
    collate = PackCollate(5)
    largest = collate.max_layout(_Reader(FIELDS, pack_rows=3))
    assert largest is not None
    assert largest["ids"] == ((3, 5), np.dtype(np.int64))
    assert largest["frames"] == ((3, 5, 3), np.dtype(np.float32))
    assert largest["score"] == ((3, 5, 2), np.dtype(np.float64))
    assert largest["cu_seqlens"] == ((16,), np.dtype(np.int32)) and "name" not in largest
    rng = np.random.default_rng(0)
    for _ in range(30):
        lengths = rng.integers(1, 12, rng.integers(1, 5))
        samples = [
            {"ids": np.arange(n, dtype=np.uint16), "frames": np.ones((n, 3), np.float32),
             "score": np.zeros(2), "name": "x"}
            for n in lengths
        ]  # fmt: skip
        try:
            layout = PackCollate(5, rows=3, ragged=FIELDS)(samples)
        except ValueError:
            continue  # more than 3 rows of tokens: no such batch
        for name, tensor in layout.items():
            if isinstance(tensor, torch.Tensor):
                shape, dtype = largest[name]
                assert tensor.numel() <= int(np.prod(shape)) and tensor.numpy().dtype == dtype


def test_max_layout_needs_the_rows_and_the_fields() -> None:
    assert PackCollate(5).max_layout(_Reader(FIELDS, pack_rows=None)) is None
    assert PackCollate(5).max_layout(object()) is None
    with_rows = PackCollate(5, rows=2).max_layout(_Reader(FIELDS, pack_rows=None))
    assert with_rows is not None and with_rows["ids"][0] == (2, 5)


def test_a_subclass_is_not_process_independent_unless_it_says_so() -> None:
    class Mine(PackCollate):
        pass

    class Declared(PackCollate):
        process_independent = True

    assert PackCollate.process_independent and PackCollate.takes_spans
    assert not Mine.process_independent and Declared.process_independent


def test_seq_len_and_rows_are_read_only() -> None:
    collate = PackCollate(7, rows=2)
    assert (collate.seq_len, collate.rows) == (7, 2)
    with pytest.raises(AttributeError):
        collate.seq_len = 8  # type: ignore[misc]


# -- errors -------------------------------------------------------------------------------------


def test_a_plan_of_another_seq_len_is_refused() -> None:
    with pytest.raises(ValueError, match=r"seq_len=8 .* seq_len=6"):
        PackCollate(8)(packed(hand_made(), SAMPLES))


def test_a_plan_of_other_rows_is_refused() -> None:
    with pytest.raises(ValueError, match=r"rows=3\) was handed a packed batch of 4 rows"):
        PackCollate(6, rows=3)(packed(hand_made(), SAMPLES))


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([[(2, 0, 7)]], r"piece 0 \(tokens 0:7 of sample 2\) is longer than seq_len=6"),
        ([[(0, 3, 3)]], r"piece 0 \(tokens 3:3 of sample 0\) is empty"),
        ([[(1, 0, 3)], [(0, 0, 5), (1, 0, 2)]], r"row 1 .* holds 7 tokens, more than seq_len=6"),
    ],
)
def test_a_plan_that_does_not_fit_its_rows_is_refused(rows: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PackCollate(6)(packed(plan(rows, 6), SAMPLES))


def test_fields_named_like_a_generated_array_are_refused() -> None:
    batch = hand_made()
    columns = packed(batch, SAMPLES, labels=np.zeros(batch.pieces, np.int64))
    with pytest.raises(ValueError, match=r"\['labels'\], which PackCollate generates"):
        PackCollate(6)(columns)


def test_a_primary_field_that_is_not_token_ids_is_refused() -> None:
    batch = hand_made()
    values = np.ones((15, 3), np.float32)
    frames = Spans(values, np.zeros(batch.pieces, np.int64), batch.stops - batch.starts)
    with pytest.raises(ValueError, match=r"primary field 'frames' holds float32"):
        PackCollate(6, primary="frames")(PackedColumns({"frames": frames}, batch))
    with pytest.raises(FieldNotFoundError, match=r"primary='nope'"):
        PackCollate(6, primary="nope")(packed(batch, SAMPLES))
    with pytest.raises(FieldNotFoundError, match="have none"):
        PackCollate(6)([{"label": 1}])


def test_a_dtype_of_another_kind_or_a_pad_value_that_does_not_fit_is_refused() -> None:
    with pytest.raises(ValueError, match=r"'ids' holds int32, which dtype=bool"):
        PackCollate(6, dtype=torch.bool)(packed(hand_made(), SAMPLES))
    with pytest.raises(ValueError, match=r"pad_value 300 for field 'loss_mask'"):
        PackCollate(6, pad_value=300)(packed(hand_made(), SAMPLES))


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"seq_len": 0}, ValueError, "seq_len must be"),
        ({"seq_len": 4, "rows": 0}, ValueError, "rows must be"),
        ({"seq_len": 4, "label_pad": 0.5}, TypeError, "label_pad must be an integer"),
        ({"seq_len": 4, "pad_value": "x"}, TypeError, "pad_value must be a number"),
        ({"seq_len": 2**20, "rows": 2**12}, ValueError, "cu_seqlens' int32"),
    ],
)
def test_bad_options_fail_at_construction(options: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        PackCollate(**options)


def test_the_native_packing_kernel_checks_before_it_writes(padding_kernel: str) -> None:
    """A piece past the end of the source, or a row over seq_len, raises and leaves the
    output untouched (the numpy kernels never get such a plan: PackedSource checks first)."""
    from fastload._collate import _kernels

    if padding_kernel != "native":
        assert not _kernels.pack_into(
            np.arange(10), np.array([0]), np.array([3]), np.array([0, 1]), np.zeros((1, 4), np.int64), pad_value=0
        )
        return
    out = np.full((1, 4), 7, dtype=np.int64)
    for starts, lengths, match in (([8], [3], "outside the source"), ([0, 4], [3, 2], "more than seq_len")):
        with pytest.raises(ValueError, match=match):
            _kernels.pack_into(
                np.arange(10),
                np.array(starts),
                np.array(lengths),
                np.array([0, len(starts)]),
                out,
                pad_value=0,
            )
        assert (out == 7).all()
