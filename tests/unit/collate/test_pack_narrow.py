"""``PackCollate``'s narrow outputs: int32 ``position_ids`` (``position_dtype``) hold the values
of the int64 ones, and ``device_labels`` leaves ``labels`` out of the host batch (each row's
real tokens instead) for ``finish_batch`` to build them where the batch lands, equal to the
host-built ones. Both padding kernels (conftest), every batch of random plans."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_pack_collate import SAMPLES, hand_made, packed, plan

from fastload._collate import PackCollate
from fastload._collate._pack import LABELS, POSITIONS, ROW_TOKENS, finish_packed


def outputs(collate: PackCollate, batch: Any) -> dict[str, np.ndarray]:
    """What the engine's slot holds: the arrays of the layout, filled."""
    prepared = collate.prepare(batch)
    out = {name: np.empty(shape, dtype) for name, (shape, dtype) in prepared.layout.items()}
    prepared.fill(out)
    return out


def test_int32_positions_hold_the_values_of_the_int64_ones() -> None:
    batch = packed(hand_made(), SAMPLES)
    wide = outputs(PackCollate(6), batch)
    narrow = outputs(PackCollate(6, position_dtype=torch.int32), batch)
    assert wide[POSITIONS].dtype == np.int64 and narrow[POSITIONS].dtype == np.int32
    assert list(narrow) == list(wide)
    for name in wide:
        assert np.array_equal(narrow[name], wide[name]), name
        if name != POSITIONS:
            assert narrow[name].dtype == wide[name].dtype, name


def test_call_returns_int32_positions_for_a_list_of_samples() -> None:
    samples = [{"ids": np.asarray(s, np.int32)} for s in SAMPLES]
    wide = PackCollate(6)(samples)
    narrow = PackCollate(6, position_dtype=torch.int32, dtype=torch.int32)(samples)
    assert narrow[POSITIONS].dtype == torch.int32 and narrow["ids"].dtype == torch.int32
    assert list(narrow) == list(wide)
    for name, tensor in wide.items():
        assert torch.equal(narrow[name].long(), tensor.long()), name


def test_device_labels_leave_labels_out_and_finish_builds_them_equal() -> None:
    batch = packed(hand_made(), SAMPLES)
    wide = outputs(PackCollate(6, label_pad=-7), batch)
    collate = PackCollate(6, label_pad=-7, device_labels=True, position_dtype=torch.int32)
    host = outputs(collate, batch)
    assert LABELS not in host and host[ROW_TOKENS].dtype == np.int32
    assert host[ROW_TOKENS].tolist() == [5, 6, 4, 0]  # each row's real tokens
    finished = collate.finish_batch({name: torch.from_numpy(a) for name, a in host.items()})
    assert ROW_TOKENS not in finished
    assert finished[LABELS].dtype == torch.int64
    assert torch.equal(finished[LABELS], torch.from_numpy(wide[LABELS]))
    assert list(finished) == list(PackCollate(6)(batch))  # the keys, in __call__'s order


def test_call_with_device_labels_returns_the_full_batch() -> None:
    batch = packed(hand_made(), SAMPLES)
    wide = PackCollate(6)(batch)
    narrow = PackCollate(6, device_labels=True)(batch)
    assert list(narrow) == list(wide)
    for name, tensor in wide.items():
        assert narrow[name].dtype == tensor.dtype and torch.equal(narrow[name], tensor), name


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_narrow_outputs_equal_the_wide_ones_on_random_plans(data: st.DataObject) -> None:
    seq_len = data.draw(st.integers(1, 9))
    lengths = data.draw(st.lists(st.integers(1, 12), min_size=1, max_size=8))
    samples = [list(range(100 * (i + 1), 100 * (i + 1) + n)) for i, n in enumerate(lengths)]
    rows: list[list[tuple[int, int, int]]] = [[]]
    for sample, n in enumerate(lengths):
        for start in range(0, n, seq_len):
            stop = min(n, start + seq_len)
            if sum(b - a for _, a, b in rows[-1]) + stop - start > seq_len:
                rows.append([])
            rows[-1].append((sample, start, stop))
    rows += [[]] * data.draw(st.integers(0, 2))  # rows of padding only
    batch = packed(plan(rows, seq_len), samples)
    wide = outputs(PackCollate(seq_len), batch)
    collate = PackCollate(seq_len, position_dtype=torch.int32, device_labels=True)
    finished = collate.finish_batch({k: torch.from_numpy(v) for k, v in outputs(collate, batch).items()})
    assert set(finished) == set(wide)
    for name, array in wide.items():
        assert torch.equal(finished[name].long(), torch.from_numpy(array).long()), name
    assert finished[POSITIONS].dtype == torch.int32


def test_finish_runs_where_the_tensors_are() -> None:
    """The labels are built by torch operations on the batch's own tensors: on the device the
    batch was copied to (a ``gpu`` test checks CUDA), here the CPU, and in the same order."""
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    positions = torch.tensor([[0, 1, 0, 0], [0, 1, 0, 1]], dtype=torch.int32)
    rows = torch.tensor([3, 2], dtype=torch.int32)
    labels = finish_packed(ids, positions, rows, label_pad=-100)
    assert labels.tolist() == [[-100, 6, -100, -100], [-100, 9, -100, -100]]


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"position_dtype": torch.int16}, ValueError, "position_dtype"),
        ({"position_dtype": torch.float32}, ValueError, "position_dtype"),
        ({"position_dtype": "int32"}, TypeError, "position_dtype"),
        ({"device_labels": 1}, TypeError, "device_labels"),
    ],
)
def test_bad_narrow_options_fail_at_construction(options: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        PackCollate(6, **options)
