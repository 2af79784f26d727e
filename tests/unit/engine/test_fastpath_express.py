"""The fast path's one-call builds (``_collate/_pad.py``): where they apply, they write the same bytes
and describe the same batch as the general builder; where they do not, they stay out."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch

import fastload
from fastload._engine._arena import SlotArena
from fastload._engine._builder import SlotBuilder
from fastload._engine._sizing import slot_bytes_bound
from fastload._engine._slots import SlotBatch, SlotCodec
from fastload._protocols import TooLarge

N = 200


def _write(path: Path, *, values_dtype: Any = np.uint16, elem: tuple[int, ...] = (), label: bool = False, byteorder: str = "=") -> Path:
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 90, N).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    values = rng.integers(1, 120, (int(offsets[-1]), *elem)).astype(np.dtype(values_dtype).newbyteorder(byteorder))
    with h5py.File(path, "w") as f:
        f.attrs["fastload_format"] = 1
        f.attrs["num_samples"] = N
        f.create_dataset("tokens/values", data=values)
        f.create_dataset("tokens/offsets", data=offsets)
        if label:
            f.create_dataset("label", data=rng.integers(0, 5, N).astype(np.int64))
    return path


def _build(ds: Any, collate: Any, plans: list[list[int]], *, express: bool, slot_rows: int = 64) -> list[tuple[Any, dict[str, np.ndarray] | None]]:
    """Build every plan in this process; ``express=False`` keeps the builder on the general
    path throughout."""
    arena = SlotArena(
        slot_bytes=slot_bytes_bound(collate, ds.fields, ds.lengths, rows=slot_rows, max_tokens=None),
        slots=2,
        max_bytes=1 << 28,
    )
    codec = SlotCodec(arena)
    builder = SlotBuilder(ds, collate, os.getpid())
    if not express:
        builder._one_call_tried = True
    out: list[tuple[Any, dict[str, np.ndarray] | None]] = []
    for indices in plans:
        task = codec.task(indices)
        built = builder.build(task)
        if isinstance(built, SlotBatch):
            batch, _ = codec.deliver(task, built)
            out.append((built, {k: v.numpy().copy() for k, v in batch.items()}))
            del batch
        else:
            out.append((built, None))
            codec.drop(task)
    out.append((builder._one_call is not None, None))
    arena.close()
    return out


PLANS = [[3, 1, 4, 1, 5], [9, 2, 6], list(range(0, 200, 7)), [0], [199, 198], list(range(40))]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"dtype": torch.int64, "mask_dtype": torch.bool},
        {"dtype": torch.int32, "pad_value": -1, "padding_side": "left"},
        {"dtype": torch.int64, "max_length": 30, "pad_to_multiple_of": 8},
        {"dtype": torch.float32, "pad_value": 0.5, "mask_dtype": torch.float32},
        {"mask_dtype": torch.int64, "padding_side": "left", "max_length": 5},
    ],
)
def test_express_builds_equal_the_general_builder(tmp_path: Path, options: dict[str, Any]) -> None:
    ds = fastload.HDF5Dataset(_write(tmp_path / "d.h5"))
    fast = _build(ds, fastload.PadCollate(**options), PLANS, express=True)
    slow = _build(ds, fastload.PadCollate(**options), PLANS, express=False)
    assert fast[-1][0] is True and slow[-1][0] is False
    for (a, arrays_a), (b, arrays_b) in zip(fast[:-1], slow[:-1], strict=True):
        assert a == b  # the same descriptor: names, offsets, shapes, dtypes, bytes, counts
        assert arrays_a is not None and arrays_b is not None
        assert arrays_a.keys() == arrays_b.keys()
        for name in arrays_a:
            assert np.array_equal(arrays_a[name], arrays_b[name]), name


def test_express_pads_whole_elements_of_element_shaped_samples(tmp_path: Path) -> None:
    ds = fastload.HDF5Dataset(_write(tmp_path / "d.h5", values_dtype=np.float32, elem=(3,)))
    collate = fastload.PadCollate(ragged=ds.fields)
    fast = _build(ds, collate, PLANS, express=True)
    slow = _build(ds, fastload.PadCollate(ragged=ds.fields), PLANS, express=False)
    assert fast[-1][0] is True
    for (a, arrays_a), (b, arrays_b) in zip(fast[:-1], slow[:-1], strict=True):
        assert a == b
        assert arrays_a is not None and arrays_b is not None
        assert all(np.array_equal(arrays_a[k], arrays_b[k]) for k in arrays_a)


def test_an_oversize_batch_asks_for_the_same_bigger_slot(tmp_path: Path) -> None:
    ds = fastload.HDF5Dataset(_write(tmp_path / "d.h5"))
    plans = [[0, 1], list(range(150))]  # the slot is sized for 8 rows
    fast = _build(ds, fastload.PadCollate(), plans, express=True, slot_rows=8)
    slow = _build(ds, fastload.PadCollate(), plans, express=False, slot_rows=8)
    assert fast[-1][0] is True
    assert isinstance(fast[1][0], TooLarge) and fast[1][0] == slow[1][0]


def test_a_temporary_slot_is_unmapped_in_the_worker_once_built(tmp_path: Path) -> None:
    ds = fastload.HDF5Dataset(_write(tmp_path / "d.h5"))
    arena = SlotArena(slot_bytes=1 << 12, slots=2, max_bytes=1 << 26)
    codec = SlotCodec(arena)
    builder = SlotBuilder(ds, fastload.PadCollate(), os.getpid())
    builder.build(codec.task([1]))
    assert builder._one_call is not None
    task = codec.task(list(range(120)))
    oversize = builder.build(task)
    assert isinstance(oversize, TooLarge)
    bigger = codec.retry(task, oversize)
    assert bigger is not None and bigger.slot.temporary
    assert isinstance(builder.build(bigger), SlotBatch)
    assert bigger.slot.segment not in builder._slots._maps
    codec.drop(bigger)
    arena.close()


def test_an_index_out_of_range_goes_the_general_way_and_raises_its_error(tmp_path: Path) -> None:
    ds = fastload.HDF5Dataset(_write(tmp_path / "d.h5"))
    arena = SlotArena(slot_bytes=1 << 16, slots=2, max_bytes=1 << 24)
    codec = SlotCodec(arena)
    builder = SlotBuilder(ds, fastload.PadCollate(), os.getpid())
    builder.build(codec.task([1, 2]))
    assert builder._one_call is not None
    with pytest.raises(IndexError, match=r"index 200 \(position 1 of the request\) is out of range"):
        builder.build(codec.task([4, 200]))
    negative = builder.build(codec.task([-1, 0]))  # negative indices count from the end, as ever
    assert isinstance(negative, SlotBatch) and negative.counts is not None
    assert negative.counts[1] == int(ds.lengths[-1] + ds.lengths[0])
    arena.close()


class _OwnPlanning(fastload.PadCollate):
    def prepare(self, batch: Any) -> Any:
        return super().prepare(batch)


@pytest.mark.parametrize(
    "case", ["two fields", "byte-swapped values", "planning overridden", "the collate keeps one of two fields", "numpy kernels only"]
)
def test_express_stays_out_where_it_does_not_apply(tmp_path: Path, case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    two = case in ("two fields", "the collate keeps one of two fields")
    path = _write(tmp_path / "d.h5", label=two, byteorder=">" if case == "byte-swapped values" else "=")
    ds = fastload.HDF5Dataset(path)
    collate: Any = fastload.PadCollate()
    if case == "planning overridden":
        collate = _OwnPlanning()
    elif case == "the collate keeps one of two fields":
        collate = fastload.PadCollate(fields=["tokens"])  # the reader still reads both
    elif case == "numpy kernels only":
        from fastload._collate import _kernels

        monkeypatch.setattr(_kernels, "_native", None)
    built = _build(ds, collate, PLANS[:2], express=True)
    assert built[-1][0] is False


def test_every_batch_from_the_first_on_is_a_one_call_build(tmp_path: Path) -> None:
    ds = fastload.HDF5Dataset(_write(tmp_path / "d.h5"))
    general_reads: list[Any] = []
    read_in_place = ds.read_batch_in_place

    def counted(indices: Any) -> Any:
        general_reads.append(indices)
        return read_in_place(indices)

    ds.read_batch_in_place = counted  # type: ignore[method-assign]
    built = _build(ds, fastload.PadCollate(), PLANS, express=True)
    assert built[-1][0] is True
    assert all(isinstance(b, SlotBatch) for b, _ in built[:-1])
    assert general_reads == []  # not even the first batch went the general way
