"""SlotBuilder, the fast path's worker half, run in this process against a real slot arena."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import h5py
import numpy as np
import pytest
import torch

import fastload
from fastload._engine._arena import SlotArena
from fastload._engine._builder import SlotBuilder
from fastload._engine._messages import OK, Reply
from fastload._engine._sizing import slot_bytes_bound
from fastload._engine._slots import SlotBatch, SlotCodec, decode_reply
from fastload._types import Counts, StorageCounts

DELAY_S = 0.05


class _SlowCollate(fastload.PadCollate):
    """Padding that takes at least DELAY_S, whichever way the builder asks for it."""

    def prepare(self, batch: Any) -> Any:
        prepared = super().prepare(batch)

        def fill(out: Any) -> None:
            time.sleep(DELAY_S)
            prepared.fill(out)

        return SimpleNamespace(layout=prepared.layout, fill=fill, counts=prepared.counts)


class _CopiesOnly:
    """A user's reader: read_batch only, no in-place reads."""

    def __init__(self, inner: fastload.HDF5Dataset) -> None:
        self.inner = inner

    def read_batch(self, indices: Any) -> Any:
        return self.inner.read_batch(indices)


@pytest.fixture()
def h5(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 50, 100)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f.attrs["fastload_format"] = 1
        f.attrs["num_samples"] = 100
        f.create_dataset("tokens/values", data=rng.integers(0, 1000, int(offsets[-1])).astype(np.uint16))
        f.create_dataset("tokens/offsets", data=offsets)
    return tmp_path / "d.h5"


@pytest.mark.parametrize("in_place", [True, False])
def test_the_gather_from_the_map_counts_as_read_time_only_for_samples_read_in_place(h5: Path, in_place: bool) -> None:
    ds = fastload.HDF5Dataset(h5)
    collate = _SlowCollate(dtype=torch.int64)
    arena = SlotArena(
        slot_bytes=slot_bytes_bound(collate, ds.fields, ds.lengths, rows=8, max_tokens=None), slots=2, max_bytes=1 << 26
    )
    codec = SlotCodec(arena)
    builder = SlotBuilder(ds if in_place else _CopiesOnly(ds), collate, os.getpid())
    task = codec.task([5, 9, 3, 77])
    descriptor = builder.build(task)
    batch, _ = codec.deliver(task, descriptor)
    assert batch["tokens"].tolist()[0][: int(ds.lengths[5])] == ds[5]["tokens"].tolist()
    assert (builder.last_read_s >= DELAY_S) == in_place
    del batch
    arena.close()


class _TwoHalvesOnly:
    """A user's collate offering just the two halves of the zero-copy path."""

    def __init__(self) -> None:
        self._inner = fastload.PadCollate(dtype=torch.int64)
        self.calls: list[str] = []

    def layout(self, batch: Any) -> Any:
        self.calls.append("layout")
        return self._inner.layout(batch)

    def collate_into(self, batch: Any, out: Any) -> None:
        self.calls.append("collate_into")
        self._inner.collate_into(batch, out)


def test_a_collate_with_only_layout_and_collate_into_builds_the_same_batch(h5: Path) -> None:
    ds = fastload.HDF5Dataset(h5)
    mine, theirs = _TwoHalvesOnly(), fastload.PadCollate(dtype=torch.int64)
    arena = SlotArena(
        slot_bytes=slot_bytes_bound(theirs, ds.fields, ds.lengths, rows=8, max_tokens=None), slots=2, max_bytes=1 << 26
    )
    codec = SlotCodec(arena)
    batches = []
    for collate in (mine, theirs):
        task = codec.task([5, 9, 3, 77])
        batches.append(codec.deliver(task, SlotBuilder(ds, collate, os.getpid()).build(task))[0])
    assert mine.calls == ["layout", "collate_into"]
    assert batches[0].keys() == batches[1].keys()
    assert all(torch.equal(batches[0][k], batches[1][k]) for k in batches[0])
    del batches
    arena.close()


@pytest.mark.parametrize(
    "storage", [None, StorageCounts(0.25, 4096, 3, 1)], ids=["local", "remote"]
)
def test_a_reply_travels_with_its_storage_counts(storage: StorageCounts | None) -> None:
    batch = SlotBatch((("x", 0, (2, 3), "<i8"),), None, 48, Counts(2, 6, 6))
    reply = Reply(3, 7, OK, batch, 0.5, 0.125, storage)
    assert decode_reply(SlotBuilder.result_bytes(reply)) == reply
