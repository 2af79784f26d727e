"""One-call packed builds (``gather_pack``) against the general path, on a real fastload HDF5
file: the same arrays, byte for byte, for every batch of a plan; the general path for plans the
call does not take; ``TooLarge`` for a slot too small."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

import fastload
from fastload._collate import PackCollate, PackedSource, _kernels
from fastload._collate._pack import pack_express_builder
from fastload._engine._sizing import plan_layout
from fastload._protocols import Built, TooLarge
from fastload._types import PackedBatch

SEQ_LEN, ROWS = 48, 3


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 130, 400)  # a third longer than a row: split into pieces
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    path = tmp_path_factory.mktemp("express") / "ids.h5"
    with h5py.File(path, "w") as f:
        f.attrs["fastload_format"] = 1
        f.attrs["num_samples"] = lengths.size
        f.create_dataset("input_ids/values", data=rng.integers(1, 60_000, int(offsets[-1])).astype(np.uint16))
        f.create_dataset("input_ids/offsets", data=offsets)
        f.create_dataset("lengths", data=lengths)
    return path


def general(source: PackedSource, collate: PackCollate, plan: PackedBatch) -> dict[str, np.ndarray]:
    prepared = collate.prepare(source.read_batch_in_place(plan))
    out = {name: np.empty(shape, dtype) for name, (shape, dtype) in prepared.layout.items()}
    prepared.fill(out)
    return out


def one_call(builder, plan: PackedBatch, capacity: int = 1 << 22) -> Built | TooLarge | None:  # type: ignore[no-untyped-def]
    buffer = np.full(capacity + 256, 0xAB, dtype=np.uint8)
    built = builder.build_into(np.asarray(plan).tobytes(), buffer, 128, capacity)
    if isinstance(built, Built):
        one_call.arrays = {  # type: ignore[attr-defined]
            name: np.ndarray(shape, np.dtype(dt), buffer=buffer, offset=128 + at) for name, at, shape, dt in built.arrays
        }
    return built


@pytest.fixture(autouse=True)
def native_only(padding_kernel: str, token_file: Path) -> None:
    """Without the native kernel (the numpy run of every collate test) there is no one-call
    build: the builder is None and the general path does all the work."""
    if padding_kernel == "numpy":
        source = PackedSource(fastload.HDF5Dataset(str(token_file)), seq_len=SEQ_LEN, rows=ROWS)
        assert _kernels._native is None and pack_express_builder(source, PackCollate(SEQ_LEN)) is None
        pytest.skip("no one-call build without the native kernel (checked)")


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"dtype": torch.int32},
        {"position_dtype": torch.int32},
        {"device_labels": True},
        {"dtype": torch.int32, "position_dtype": torch.int32, "device_labels": True},
    ],
)
def test_every_batch_of_a_plan_matches_the_general_path(token_file: Path, options: dict) -> None:  # type: ignore[type-arg]
    dataset = fastload.HDF5Dataset(str(token_file))
    source = PackedSource(dataset, seq_len=SEQ_LEN, rows=ROWS)
    collate = PackCollate(SEQ_LEN, rows=ROWS, pad_value=7, label_pad=-1, **options)
    builder = pack_express_builder(source, collate)
    assert builder is not None
    sampler = fastload.PackedBatchSampler(dataset.lengths, seq_len=SEQ_LEN, rows=ROWS, num_replicas=7)
    padding = PackedBatch(*((np.zeros(0, np.int64),) * 3), np.zeros(ROWS + 1, np.int64), SEQ_LEN)
    plans = [*sampler, padding]
    for plan in plans:
        built = one_call(builder, plan)
        assert isinstance(built, Built)
        expected = general(source, collate, plan)
        got = one_call.arrays  # type: ignore[attr-defined]
        assert list(got) == list(expected)  # the same names in the same order as the layout
        for name in expected:
            assert got[name].dtype == expected[name].dtype, name
            assert np.array_equal(got[name], expected[name]), name
        assert built.nbytes == plan_layout(collate.prepare(source.read_batch(plan)).layout)[1]
        assert built.counts == collate.prepare(source.read_batch(plan)).counts


def test_plans_it_does_not_take_go_the_general_way(token_file: Path) -> None:
    dataset = fastload.HDF5Dataset(str(token_file))
    builder = pack_express_builder(PackedSource(dataset, seq_len=SEQ_LEN, rows=ROWS), PackCollate(SEQ_LEN))
    assert builder is not None
    length = int(dataset.lengths[3])
    bad = [
        ([[(400, 0, 5)]], SEQ_LEN),  # no such sample
        ([[(3, 0, length + 1)]], SEQ_LEN),  # past the sample's end
        ([[(3, 0, 1), (4, 0, SEQ_LEN)]], SEQ_LEN),  # a row over seq_len
        ([[(3, 0, 1)]], SEQ_LEN + 1),  # another seq_len
    ]
    for rows, seq_len in bad:
        pieces = [p for row in rows for p in row]
        columns = np.array(pieces, dtype=np.int64).T
        plan = PackedBatch(columns[0], columns[1], columns[2], np.array([0, len(pieces)]), seq_len)
        assert one_call(builder, plan) is None
    good = next(iter(fastload.PackedBatchSampler(dataset.lengths, seq_len=SEQ_LEN, rows=ROWS)))
    small = one_call(builder, good, capacity=64)
    assert isinstance(small, TooLarge) and small.nbytes > 64


def test_it_applies_only_where_it_writes_what_the_collate_would(token_file: Path) -> None:
    dataset = fastload.HDF5Dataset(str(token_file))
    source = PackedSource(dataset, seq_len=SEQ_LEN, rows=ROWS)
    assert pack_express_builder(source, PackCollate(SEQ_LEN + 1)) is None  # another seq_len
    assert pack_express_builder(dataset, PackCollate(SEQ_LEN)) is None  # not read by packed batch

    class OwnPlanning(PackCollate):
        def prepare(self, batch):  # type: ignore[no-untyped-def]
            return super().prepare(batch)

    assert OwnPlanning(SEQ_LEN).one_call_builder(source) is None
    assert PackCollate(SEQ_LEN).one_call_builder(source) is not None
