"""PadCollate on columnar batches: padding, masks, lengths, truncation, dtypes, layout and
collate_into, and the errors for batches or options it cannot serve."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

from fastload import PadCollate
from fastload._collate._kernels import ROW_COPY_MIN_BYTES
from fastload._types import ColumnarBatch, Ragged
from fastload.errors import DataFormatError, FieldNotFoundError


def ragged(rows: Sequence[npt.ArrayLike], dtype: Any = np.int32) -> Ragged:
    arrays = [np.asarray(row, dtype=dtype) for row in rows]
    lengths = np.array([len(a) for a in arrays], dtype=np.int64)
    nonempty = [a for a in arrays if len(a)]
    values = np.concatenate(nonempty) if nonempty else np.zeros((0, *arrays[0].shape[1:]), dtype)
    return Ragged(values, lengths)


def reference_pad(
    rows: list[np.ndarray], width: int, pad: float, *, left: bool = False
) -> np.ndarray:
    """The obvious per-row padding, to compare the vectorized kernels against."""
    tail = rows[0].shape[1:] if rows else ()
    out = np.full((len(rows), width, *tail), pad, dtype=np.float64)
    for i, row in enumerate(rows):
        if left:
            out[i, width - len(row) :] = row
        else:
            out[i, : len(row)] = row
    return out


def random_rows(count: int, low: int, high: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 30_000, n).astype(np.int32) for n in rng.integers(low, high, count)]


# Short rows take the mask kernel, long rows (> ROW_COPY_MIN_BYTES as int64) the row-copy one.
ROW_COPY_MIN_INT64 = ROW_COPY_MIN_BYTES // 8
KERNEL_SIZES = {"mask": (0, 60), "rows": (ROW_COPY_MIN_INT64 + 50, ROW_COPY_MIN_INT64 + 400)}


@pytest.mark.parametrize("kernel", sorted(KERNEL_SIZES))
@pytest.mark.parametrize("side", ["right", "left"])
def test_ragged_rows_are_padded_to_the_longest_row_with_mask_and_lengths(
    kernel: str, side: str
) -> None:
    rows = random_rows(16, *KERNEL_SIZES[kernel])
    assert (max(map(len, rows)) * 8 >= ROW_COPY_MIN_BYTES) == (kernel == "rows")
    out = PadCollate(pad_value=-1, padding_side=side, dtype=torch.int64)({"ids": ragged(rows)})
    width = max(map(len, rows))
    left = side == "left"
    assert out["ids"].dtype == torch.int64
    assert np.array_equal(out["ids"].numpy(), reference_pad(rows, width, -1, left=left))
    mask = reference_pad([np.ones(len(r)) for r in rows], width, 0, left=left)
    assert out["attention_mask"].dtype == torch.int64
    assert np.array_equal(out["attention_mask"].numpy(), mask)
    assert out["lengths"].tolist() == [len(r) for r in rows]


@pytest.mark.parametrize("kernel", sorted(KERNEL_SIZES))
@pytest.mark.parametrize("side", ["right", "left"])
def test_max_length_keeps_the_first_elements_of_each_row(kernel: str, side: str) -> None:
    rows = random_rows(12, *KERNEL_SIZES[kernel], seed=1)
    rows[0] = rows[0][:1]  # one row shorter than the limit
    limit = int(np.median([len(r) for r in rows]))
    collate = PadCollate(max_length=limit, padding_side=side, dtype=torch.int64)
    out = collate({"ids": ragged(rows)})
    row_bytes = out["ids"].shape[1] * 8
    assert (row_bytes >= ROW_COPY_MIN_BYTES) == (kernel == "rows")
    cut = [r[:limit] for r in rows]
    width = max(map(len, cut))
    assert np.array_equal(out["ids"].numpy(), reference_pad(cut, width, 0, left=side == "left"))
    assert out["lengths"].tolist() == [len(r) for r in cut]


def test_the_padded_length_is_rounded_up_to_the_multiple() -> None:
    out = PadCollate(pad_to_multiple_of=8)({"ids": ragged([[1, 2, 3], [4] * 9])})
    assert out["ids"].shape == (2, 16)
    assert out["attention_mask"].sum(dim=1).tolist() == [3, 9]


def test_elements_with_a_shape_of_their_own_are_padded_along_the_row() -> None:
    rng = np.random.default_rng(2)
    rows = [rng.standard_normal((n, 3)).astype(np.float32) for n in (4, 0, 2)]
    out = PadCollate(pad_value=0.5)({"frames": ragged(rows, np.float32)})
    assert out["frames"].shape == (3, 4, 3)
    assert out["frames"].dtype == torch.float32
    assert np.array_equal(out["frames"].numpy(), reference_pad(rows, 4, 0.5))


def test_fixed_fields_are_stacked_and_object_fields_passed_through_in_field_order() -> None:
    batch: ColumnarBatch = {
        "text": ["a", "b"],
        "ids": ragged([[1], [2, 3]]),
        "label": np.array([7, 8], dtype=np.int16),
        "emb": np.ones((2, 4), dtype=np.float32),
    }
    out = PadCollate()(batch)
    assert list(out) == ["text", "ids", "label", "emb", "attention_mask", "lengths"]
    assert out["text"] == ["a", "b"]
    assert out["label"].dtype == torch.int16 and out["label"].tolist() == [7, 8]
    assert out["emb"].shape == (2, 4)


def test_other_ragged_fields_get_their_own_lengths_and_their_own_width() -> None:
    batch: ColumnarBatch = {
        "ids": ragged([[1, 2], [3, 4, 5]]),
        "labels": ragged([[9], [8, 7, 6, 5]]),
    }
    out = PadCollate(pad_value={"labels": -100})(batch)
    assert out["ids"].tolist() == [[1, 2, 0], [3, 4, 5]]
    assert out["labels"].tolist() == [[9, -100, -100, -100], [8, 7, 6, 5]]
    assert out["lengths"].tolist() == [2, 3]
    assert out["labels_lengths"].tolist() == [1, 4]
    chosen = PadCollate(primary="labels")(batch)
    assert chosen["lengths"].tolist() == [1, 4]
    assert chosen["ids_lengths"].tolist() == [2, 3]
    assert chosen["attention_mask"].shape == (2, 4)


def test_per_field_dtypes_and_a_boolean_mask() -> None:
    batch: ColumnarBatch = {
        "ids": ragged([[1, 2], [3]]),
        "w": ragged([[0.5], [1.5, 2.5]], np.float64),
    }
    out = PadCollate(dtype={"ids": torch.int64, "w": torch.float32}, mask_dtype=torch.bool)(batch)
    assert (out["ids"].dtype, out["w"].dtype) == (torch.int64, torch.float32)
    assert out["attention_mask"].tolist() == [[True, True], [True, False]]


def test_empty_rows_and_an_empty_batch() -> None:
    out = PadCollate()({"ids": ragged([[], []])})
    assert out["ids"].shape == (2, 0)
    empty = PadCollate()({"ids": Ragged(np.zeros(0, np.int32), np.zeros(0, np.int64))})
    assert empty["ids"].shape == (0, 0)
    assert empty["lengths"].shape == (0,)


def test_layout_describes_the_output_without_allocating_and_matches_call() -> None:
    batch: ColumnarBatch = {
        "ids": ragged([[1, 2, 3], [4]]),
        "label": np.array([1, 2]),
        "text": ["x", "y"],
    }
    collate = PadCollate(pad_to_multiple_of=4, dtype=torch.int64)
    layout = collate.layout(batch)
    assert layout == {
        "ids": ((2, 4), np.dtype(np.int64)),
        "label": ((2,), np.dtype(np.int64)),
        "attention_mask": ((2, 4), np.dtype(np.int64)),
        "lengths": ((2,), np.dtype(np.int64)),
    }
    out = collate(batch)
    for name, (shape, dtype) in layout.items():
        assert tuple(out[name].shape) == shape
        assert out[name].numpy().dtype == dtype


def test_collate_into_writes_into_views_of_one_caller_buffer() -> None:
    batch: ColumnarBatch = {"ids": ragged(random_rows(8, 1, 40, seed=3)), "y": np.arange(8.0)}
    collate = PadCollate(dtype=torch.int64)
    layout = collate.layout(batch)
    sizes = {name: int(np.prod(shape)) * dtype.itemsize for name, (shape, dtype) in layout.items()}
    slot = np.full(sum(sizes.values()), 0xAB, dtype=np.uint8)  # stands in for shared memory
    arrays, offset = {}, 0
    for name, (shape, dtype) in layout.items():
        arrays[name] = slot[offset : offset + sizes[name]].view(dtype).reshape(shape)
        offset += sizes[name]
    collate.collate_into(batch, arrays)
    expected = collate(batch)
    for name, array in arrays.items():
        assert np.shares_memory(array, slot)
        assert np.array_equal(array, expected[name].numpy())


def test_collate_into_rejects_arrays_that_do_not_match_the_layout() -> None:
    batch: ColumnarBatch = {"ids": ragged([[1, 2], [3]])}
    collate = PadCollate()
    good = {name: np.empty(shape, dtype) for name, (shape, dtype) in collate.layout(batch).items()}
    with pytest.raises(ValueError, match="needs arrays"):
        collate.collate_into(batch, {k: v for k, v in good.items() if k != "lengths"})
    with pytest.raises(ValueError, match=r"'ids' must have shape \(2, 2\) and dtype int64"):
        collate.collate_into(batch, {**good, "ids": np.empty((2, 3), np.int64)})


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"padding_side": "top"}, ValueError, ["padding_side", "'top'"]),
        ({"pad_to_multiple_of": 0}, ValueError, ["pad_to_multiple_of", ">= 1", "0"]),
        ({"max_length": -2}, ValueError, ["max_length", ">= 1", "-2"]),
        ({"dtype": "int64"}, TypeError, ["dtype", "torch.dtype", "'int64'"]),
        ({"dtype": torch.bfloat16}, ValueError, ["bfloat16", "numpy"]),
        ({"pad_value": "x"}, TypeError, ["pad_value", "number", "'x'"]),
        ({"fields": "ids"}, TypeError, ["fields", "sequence"]),
        ({"primary": 3}, TypeError, ["primary", "3"]),
    ],
)
def test_bad_options_fail_at_construction(
    kwargs: dict[str, Any], error: type[Exception], words: list[str]
) -> None:
    with pytest.raises(error) as caught:
        PadCollate(**kwargs)
    for word in words:
        assert word in str(caught.value)


def test_a_pad_value_the_output_dtype_cannot_hold_is_rejected_naming_the_field() -> None:
    batch: ColumnarBatch = {"ids": ragged([[1], [2, 3]], np.uint16)}
    with pytest.raises(
        ValueError, match=r"pad_value -100 for field 'ids' does not fit its dtype uint16"
    ):
        PadCollate(pad_value=-100, dtype=torch.uint16)(batch)
    assert PadCollate(pad_value=-100)(batch)["ids"].tolist() == [
        [1, -100],
        [2, 3],
    ]


def test_narrow_integer_ids_come_out_as_int64_unless_dtype_says_otherwise() -> None:
    batch: ColumnarBatch = {
        "ids": ragged([[1, 2], [3]], np.uint16),
        "loss_mask": ragged([[1, 0], [1]], np.uint8),
        "audio": ragged([[0.5], [1.5]], np.float32),
    }
    out = PadCollate()(batch)
    assert out["ids"].dtype == torch.int64
    assert out["loss_mask"].dtype == torch.uint8 and out["audio"].dtype == torch.float32
    assert torch.nn.Embedding(8, 2)(out["ids"]).shape == (2, 2, 2)
    assert PadCollate(dtype=torch.uint16)({"ids": batch["ids"]})["ids"].dtype == torch.uint16
    assert PadCollate(dtype={"ids": torch.uint16})(batch)["ids"].dtype == torch.uint16
    assert PadCollate(primary="audio")(batch)["ids"].dtype == torch.uint16


def test_a_dtype_of_another_kind_is_rejected() -> None:
    batch: ColumnarBatch = {"x": ragged([[0.5]], np.float32)}
    with pytest.raises(ValueError, match="field 'x' holds float32"):
        PadCollate(dtype=torch.int64)(batch)


def test_unknown_fields_and_primary_name_what_the_batch_has() -> None:
    batch: ColumnarBatch = {"ids": ragged([[1]]), "label": np.array([0])}
    with pytest.raises(FieldNotFoundError, match=r"names \['nope'\].*\['ids', 'label'\]"):
        PadCollate(fields=["ids", "nope"])(batch)
    with pytest.raises(FieldNotFoundError, match=r"primary='label'.*\['ids'\]"):
        PadCollate(primary="label")(batch)
    assert list(PadCollate(fields=["label"])(batch)) == ["label"]


def test_fields_named_like_the_generated_outputs_clash() -> None:
    batch: ColumnarBatch = {"ids": ragged([[1]]), "attention_mask": ragged([[1]])}
    with pytest.raises(ValueError, match=r"\['attention_mask'\].*fields="):
        PadCollate()(batch)
    assert "attention_mask" in PadCollate(fields=["ids"])(batch)


def test_a_batch_whose_fields_disagree_on_its_size_is_a_data_error() -> None:
    with pytest.raises(DataFormatError, match="disagree on its size"):
        PadCollate()({"ids": ragged([[1], [2]]), "label": np.array([1, 2, 3])})
    with pytest.raises(DataFormatError, match="3 values but its lengths add up to 2"):
        PadCollate()({"ids": Ragged(np.arange(3), np.array([1, 1]))})
