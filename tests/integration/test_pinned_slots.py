"""Page-locked batch slots and the copies queued from them (issue 27, item 1).

With ``pin_memory=True`` a batch's tensors view a page-locked slot, so ``x.to("cuda",
non_blocking=True)`` returns before the copy has read them. The slot must be neither rewritten by
a worker nor freed while such a copy is pending, and every batch handed out must be page-locked.
On the CPU a :class:`FakeGPU` stands in for the device (its stream runs only when the test or the
engine says so); the ``gpu`` tests run the user's loop as written on a real device.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch
import torch.utils.data
from _fake_gpu import FakeGPU, overlaps
from _token_files import write_token_file

import fastload
import fastload._loader._iterators as iterator_module
from fastload._device import PinnedSlots


def _collate() -> fastload.PadCollate:
    return fastload.PadCollate(dtype=torch.int64, mask_dtype=torch.bool)


@pytest.fixture(scope="module")
def h5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_token_file(tmp_path_factory.mktemp("pinned") / "data.h5", 1_000, 100, seed=11, label=True)


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> FakeGPU:
    """The fake device, as the loader's iterator finds CUDA and its pinned slots."""
    fake = FakeGPU()
    monkeypatch.setattr(iterator_module, "cuda_available", lambda: True)
    monkeypatch.setattr(iterator_module, "pinned_slots", lambda: fake)
    return fake


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


def test_a_slot_is_not_written_again_while_a_copy_queued_from_it_is_pending(
    h5: Path, gpu: FakeGPU, driver: str
) -> None:
    # The user's loop: each batch is copied non_blocking and dropped; the GPU runs behind (here
    # it runs only when the engine waits for it). No batch may land in memory a queued copy has
    # yet to read, every copy reads the bytes of its own batch, and the slots are reused once
    # their copies are done (the arena does not grow instead).
    dataset = fastload.HDF5Dataset(h5)
    reference = list(fastload.DataLoader(dataset, batch_size=8, collate_fn=_collate()))
    loader = fastload.DataLoader(dataset, batch_size=8, num_workers=2, pin_memory=True, collate_fn=_collate())
    slots = loader.prefetch_factor * 2 + 2
    it = iter(loader)
    starts = set()
    queued = 0
    for i in range(len(loader)):
        batch = next(it)
        assert not overlaps(batch, gpu.pending()), f"batch {i} was written under a pending copy"
        assert all(gpu.is_locked(v) for v in batch.values() if isinstance(v, torch.Tensor))
        assert _same(batch, reference[i]), f"batch {i}"
        starts.add(batch["tokens"].data_ptr())
        gpu.copy(batch)
        queued += sum(isinstance(v, torch.Tensor) for v in batch.values())
        del batch
    gpu.catch_up()
    assert gpu.copies == queued and gpu.corrupt == 0
    assert gpu.waits > 0  # the engine waited for copies rather than reuse their slots
    assert len(starts) <= slots  # and reused each slot once its copies were done
    with pytest.raises(StopIteration):
        next(it)
    del it
    gc.collect()
    assert gpu.locked == {}  # every segment unlocked once its copies were done


def test_a_batch_kept_after_its_iterator_is_gone_stays_page_locked_until_its_copies_are_done(
    h5: Path, gpu: FakeGPU
) -> None:
    # The iterator dies at once (next(iter(loader))), closing the workers and the slots, while
    # the batch lives on and a copy from it is queued: its memory stays page-locked (and mapped)
    # until the batch is dropped and the copy has run.
    loader = fastload.DataLoader(fastload.HDF5Dataset(h5), batch_size=8, num_workers=2, pin_memory=True, collate_fn=_collate())
    batch = next(iter(loader))
    gc.collect()
    assert all(gpu.is_locked(v) for v in batch.values() if isinstance(v, torch.Tensor))
    gpu.copy(batch)
    queued = sum(isinstance(v, torch.Tensor) for v in batch.values())
    del batch
    gc.collect()
    assert gpu.copies == queued and gpu.corrupt == 0
    assert gpu.locked == {}


def test_a_temporary_slot_is_page_locked_and_kept_until_the_copies_from_it_are_done(
    tmp_path: Path, gpu: FakeGPU
) -> None:
    # A batch sampler that does not say what its batches hold: the slots are sized from the
    # batches that come, and the one batch holding a 5,000-token sample gets a temporary slot
    # of its own. It is page-locked like the others, and not freed (unlocked, unmapped) while
    # a copy queued from it may still read it.
    path = write_token_file(tmp_path / "one_long.h5", 300, 60, seed=3)
    with h5py.File(path, "r+") as f:  # sample 100 becomes 5,000 tokens long
        lengths = f["lengths"][:]
        values = f["tokens/values"][:]
        offsets = f["tokens/offsets"][:]
        lengths[100] = 5_000
        long = np.full(5_000, 7, dtype=values.dtype)
        values = np.concatenate([values[: offsets[100]], long, values[offsets[101] :]])
        for name, data in [("lengths", lengths), ("tokens/values", values)]:
            del f[name]
            f.create_dataset(name, data=data)
        del f["tokens/offsets"]
        f.create_dataset("tokens/offsets", data=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    plan = [list(range(i, min(i + 8, 300))) for i in range(0, 300, 8)]

    class Plan(torch.utils.data.Sampler[list[int]]):
        def __len__(self) -> int:
            return len(plan)

        def __iter__(self) -> Any:
            return iter(plan)

    dataset = fastload.HDF5Dataset(path)
    reference = list(fastload.DataLoader(dataset, batch_sampler=Plan(), collate_fn=_collate()))
    loader = fastload.DataLoader(dataset, batch_sampler=Plan(), num_workers=2, pin_memory=True, collate_fn=_collate())
    queued = 0
    for i, batch in enumerate(loader):
        assert not overlaps(batch, gpu.pending()), f"batch {i} was written under a pending copy"
        assert all(gpu.is_locked(v) for v in batch.values() if isinstance(v, torch.Tensor)), f"batch {i}"
        assert _same(batch, reference[i]), f"batch {i}"
        gpu.copy(batch)
        queued += sum(isinstance(v, torch.Tensor) for v in batch.values())
        if i == 100 // 8:
            held = [(v.data_ptr(), v) for v in batch.values() if isinstance(v, torch.Tensor)]
            assert max(v.numel() * v.element_size() for _, v in held) > 8 * 5_000  # the long one
            ranges = [(address, v.numel() * v.element_size()) for address, v in held]
            del held
            del batch
            gc.collect()
            # Dropped with its copy queued: still locked (and so still mapped).
            assert all(any(a <= r and r + n <= a + size for a, size in gpu.locked.items()) for r, n in ranges)
        else:
            del batch
    gpu.catch_up()
    assert gpu.copies == queued and gpu.corrupt == 0
    gc.collect()
    assert gpu.locked == {}


# -- on a device: the table of issue 27 ------------------------------------------------------
TABLE_SAMPLES = 20_000
TABLE_BATCH = 64
BUSY_CYCLES = 3_000_000  # torch.cuda._sleep: about 1.5 ms of a busy stream at 1.98 GHz (H200)


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """The issue's file (20,000 samples) and its batches from ``num_workers=0``."""
    path = write_token_file(tmp_path_factory.mktemp("table") / "data.h5", TABLE_SAMPLES, 128, seed=27, label=True)
    reference = list(fastload.DataLoader(fastload.HDF5Dataset(path), batch_size=TABLE_BATCH, collate_fn=_collate()))
    return path, reference


def _to_cuda(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: v.to("cuda", non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _mismatches(copies: list[dict[str, Any]], reference: list[dict[str, Any]]) -> list[int]:
    torch.cuda.synchronize()
    assert len(copies) == len(reference)
    on_host = [{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in c.items()} for c in copies]
    return [i for i, (got, ref) in enumerate(zip(on_host, reference, strict=True)) if not _same(got, ref)]


@pytest.mark.gpu
@pytest.mark.parametrize("workers", [2, 8])
def test_non_blocking_copies_behind_a_busy_stream_get_their_own_batch(
    table: tuple[Path, list[dict[str, Any]]], workers: int
) -> None:
    # Every training loop's idiom: the stream is busy with the step when the copy is queued, so
    # the copy runs long after .to() returned and after the batch was dropped (307 of 313
    # batches carried another batch's bytes before the slots waited for their copies).
    path, reference = table
    loader = fastload.DataLoader(
        fastload.HDF5Dataset(path), batch_size=TABLE_BATCH, num_workers=workers, pin_memory=True, collate_fn=_collate()
    )
    copies = []
    for batch in loader:
        assert batch["tokens"].is_pinned()
        torch.cuda._sleep(BUSY_CYCLES)
        copies.append(_to_cuda(batch))
    assert _mismatches(copies, reference) == []


@pytest.mark.gpu
def test_copies_on_a_side_stream_that_the_step_waits_for_get_their_own_batch(
    table: tuple[Path, list[dict[str, Any]]]
) -> None:
    # The prefetching user: copies queued on a busy side stream, which the current stream waits
    # for before the step; the batch is dropped on the current stream.
    path, reference = table
    loader = fastload.DataLoader(
        fastload.HDF5Dataset(path), batch_size=TABLE_BATCH, num_workers=2, pin_memory=True, collate_fn=_collate()
    )
    side = torch.cuda.Stream()
    copies = []
    for batch in loader:
        with torch.cuda.stream(side):
            torch.cuda._sleep(BUSY_CYCLES)
            copies.append(_to_cuda(batch))
        torch.cuda.current_stream().wait_stream(side)
    assert _mismatches(copies, reference) == []


@pytest.mark.gpu
def test_device_cuda_batches_behind_a_busy_stream_are_their_own(table: tuple[Path, list[dict[str, Any]]]) -> None:
    path, reference = table
    loader = fastload.DataLoader(
        fastload.HDF5Dataset(path), batch_size=TABLE_BATCH, num_workers=2, collate_fn=_collate(), device="cuda"
    )
    copies = []
    for batch in loader:
        assert batch["tokens"].is_cuda
        torch.cuda._sleep(BUSY_CYCLES)
        copies.append(batch)
    assert _mismatches(copies, reference) == []


@pytest.mark.gpu
def test_a_fence_marks_the_current_and_the_default_stream() -> None:
    slots = PinnedSlots()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(BUSY_CYCLES)
        fence = slots.fence()
    assert len(fence) == 2  # the side stream, and the default one
    assert slots.wait(fence, 60.0) and slots.passed(fence)
    assert len(slots.fence()) == 1  # on the default stream: one event
