"""A worker's direct replies (NOTE [direct replies] in ``_engine/_worker.py``): where
``SlotBuilder.direct_reply`` answers a task from its bytes, the reply and the slot's bytes are
those of the general way; everywhere else it declines, and the general way answers."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch

import fastload
from fastload._engine._arena import SlotArena
from fastload._engine._builder import SlotBuilder
from fastload._engine._messages import OK, Reply, Resume
from fastload._engine._slots import SlotBatch, SlotCodec, SlotTask, decode_reply, task_seq
from fastload.errors import DataFormatError

N = 300
SLOT = 1 << 16


def _write(path: Path, label: bool = False) -> Path:
    rng = np.random.default_rng(1)
    lengths = rng.integers(0, 60, N).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    with h5py.File(path, "w") as f:
        f.attrs["fastload_format"] = 1
        f.attrs["num_samples"] = N
        f.create_dataset("tokens/values", data=rng.integers(1, 5000, int(offsets[-1])).astype(np.uint16))
        f.create_dataset("tokens/offsets", data=offsets)
        if label:
            f.create_dataset("label", data=rng.integers(0, 5, N).astype(np.int64))
    return path


class _Setup:
    """A real arena and codec in this process, and a builder as a worker holds one."""

    def __init__(self, path: Path, collate: Any = None) -> None:
        self.ds = fastload.HDF5Dataset(path)
        self.arena = SlotArena(slot_bytes=SLOT, slots=4, max_bytes=1 << 26)
        self.arena.resize(SLOT)
        self.codec = SlotCodec(self.arena)
        self.builder = SlotBuilder(self.ds, collate or fastload.PadCollate(dtype=torch.int64), os.getpid())

    def message(self, task: SlotTask, seq: int = 7, epoch: int = 2) -> bytes:
        return self.codec.task_message(epoch, seq, task)

    def general(self, data: bytes) -> Any:
        """What the worker's general way builds for ``data``, as the main process reads it."""
        epoch, seq, task = self.builder.task_message(data)
        built = self.builder.build(task)
        reply = Reply(epoch, seq, OK, built, 0.0, self.builder.last_read_s, None)
        return decode_reply(self.builder.result_bytes(reply)), task

    def slot_bytes(self, task: SlotTask, nbytes: int) -> bytes:
        return bytes(self.arena.export(task.slot, nbytes))

    def close(self) -> None:
        self.arena.close()


def _same_reply(direct: Reply, general: Reply) -> None:
    assert direct.epoch == general.epoch and direct.seq == general.seq and direct.kind is OK
    assert direct.payload == general.payload  # arrays, objects, bytes used, counts
    assert direct.storage is None and general.storage is None
    assert direct.busy_s >= 0 and direct.read_s is not None


@pytest.mark.parametrize(
    "options",
    [
        {"dtype": torch.int64, "mask_dtype": torch.bool},
        {"dtype": torch.int32, "pad_value": -1, "padding_side": "left"},
        {"dtype": torch.int64, "max_length": 20, "pad_to_multiple_of": 8},
    ],
)
def test_a_direct_reply_is_the_general_ways_reply_and_writes_the_same_bytes(tmp_path: Path, options: dict[str, Any]) -> None:
    setup = _Setup(_write(tmp_path / "d.h5"), fastload.PadCollate(**options))
    for seq, indices in enumerate([[3, 1, 4, 1, 5], [299, 0], list(range(0, 300, 11))]):
        task = setup.codec.task(indices)
        data = setup.message(task, seq=seq)
        assert task_seq(data) == seq
        answer = setup.builder.direct_reply(data)
        assert answer is not None
        direct = decode_reply(answer)
        written = setup.slot_bytes(task, direct.payload.nbytes)
        general, _ = setup.general(data)  # the same task again, into the same slot
        _same_reply(direct, general)
        assert setup.slot_bytes(task, general.payload.nbytes) == written
        setup.codec.drop(task)
    setup.close()


def test_a_direct_reply_maps_a_segment_once_and_lets_a_retired_one_go(tmp_path: Path) -> None:
    setup = _Setup(_write(tmp_path / "d.h5"))
    first = setup.codec.task([1, 2])
    assert setup.builder.direct_reply(setup.message(first)) is not None
    assert list(setup.builder._slots._maps) == [first.slot.segment]
    setup.codec.drop(first)
    setup.arena.resize(SLOT * 2)  # the old segment is retired; tasks now name the new one
    second = setup.codec.task([3])
    assert second.slot.segment >= setup.arena.live_from > first.slot.segment
    assert setup.builder.direct_reply(setup.message(second)) is not None
    assert list(setup.builder._slots._maps) == [second.slot.segment]
    setup.codec.drop(second)
    setup.close()


def test_what_a_direct_reply_declines_the_general_way_builds_or_refuses(tmp_path: Path) -> None:
    setup = _Setup(_write(tmp_path / "d.h5"))
    builder, codec = setup.builder, setup.codec
    # A pickled message (a new epoch, say) is no task of its own.
    assert builder.direct_reply(pickle.dumps(Resume(1), pickle.HIGHEST_PROTOCOL)) is None
    # A negative index (from the end, as in numpy): the general way reads it.
    negative = codec.task([-1, 0])
    assert builder.direct_reply(setup.message(negative)) is None
    general, _ = setup.general(setup.message(negative))
    assert general.payload.counts[1] == int(setup.ds.lengths[-1] + setup.ds.lengths[0])
    codec.drop(negative)
    # An index out of range: the general way names it.
    bad = codec.task([4, N])
    assert builder.direct_reply(setup.message(bad)) is None
    with pytest.raises(IndexError, match=rf"index {N} \(position 1 of the request\) is out of range"):
        setup.general(setup.message(bad))
    codec.drop(bad)
    # A batch larger than the slot: the general way asks for a bigger one.
    big = codec.task(list(range(N)))
    assert builder.direct_reply(setup.message(big)) is None
    general, _ = setup.general(setup.message(big))
    assert not isinstance(general.payload, SlotBatch) and general.payload.nbytes > SLOT
    bigger = codec.retry(big, general.payload)
    # A temporary slot: built the general way, which unmaps it after.
    assert bigger is not None and bigger.slot.temporary
    assert builder.direct_reply(setup.message(bigger)) is None
    built, _ = setup.general(setup.message(bigger))
    assert isinstance(built.payload, SlotBatch) and bigger.slot.segment not in builder._slots._maps
    codec.drop(bigger)
    setup.close()


def test_a_file_cut_short_is_declined_and_the_general_way_names_it(tmp_path: Path) -> None:
    path = _write(tmp_path / "d.h5")
    setup = _Setup(path)
    task = setup.codec.task([5, 6])
    assert setup.builder.direct_reply(setup.message(task)) is not None  # maps the file
    os.truncate(path, os.path.getsize(path) // 2)
    assert setup.builder.direct_reply(setup.message(task)) is None
    with pytest.raises(DataFormatError, match=r"d\.h5"):
        setup.general(setup.message(task))
    setup.codec.drop(task)
    setup.close()


def test_no_direct_reply_where_the_collate_builds_in_more_than_one_call(tmp_path: Path) -> None:
    setup = _Setup(_write(tmp_path / "d.h5", label=True))  # two fields: the general builder
    task = setup.codec.task([1, 2])
    assert setup.builder.direct_reply(setup.message(task)) is None
    general, _ = setup.general(setup.message(task))
    assert isinstance(general.payload, SlotBatch) and {a[0] for a in general.payload.arrays} >= {"tokens", "label"}
    setup.codec.drop(task)
    setup.close()
