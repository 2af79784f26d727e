"""Batch slots: reuse only after the last view dies, growth up to a bound, no names in /dev/shm."""

from __future__ import annotations

import gc
import os
import signal
import time
from typing import Any

import numpy as np
import pytest
import torch

from fastload._engine._arena import SlotArena, WorkerSlots
from fastload.errors import SharedMemoryError

MiB = 2**20


def _arena(slots: int = 2, max_bytes: int = 64 * MiB) -> SlotArena:
    return SlotArena(slot_bytes=10_000, slots=slots, max_bytes=max_bytes)


def test_slot_bytes_are_rounded_up_to_whole_pages() -> None:
    arena = _arena()
    assert arena.slot_bytes % os.sysconf("SC_PAGE_SIZE") == 0
    assert arena.slot_bytes >= 10_000
    arena.close()


def test_reserved_slots_are_distinct() -> None:
    arena = _arena(slots=3)
    refs = [arena.reserve() for _ in range(3)]
    assert len({(r.segment, r.offset) for r in refs}) == 3
    arena.close()


def test_an_exported_slot_is_reused_only_after_every_view_is_gone() -> None:
    arena = _arena(slots=1)
    ref = arena.reserve()
    base = arena.export(ref, 64)
    tensor = torch.from_numpy(base)[8:16].view(torch.int64)
    del base
    gc.collect()
    assert arena.exported == 1
    again = arena.reserve()  # the only slot is still viewed: the arena grows instead
    assert (again.segment, again.offset) != (ref.segment, ref.offset)
    del tensor
    gc.collect()
    assert arena.exported == 0
    reused = arena.reserve()
    assert (reused.segment, reused.offset) == (ref.segment, ref.offset)
    arena.close()


def test_growth_stops_at_max_bytes_with_a_clear_error() -> None:
    arena = SlotArena(slot_bytes=MiB, slots=2, max_bytes=3 * MiB)  # 1 MiB apart
    held = [arena.export(arena.reserve(), 8) for _ in range(3)]
    with pytest.raises(SharedMemoryError, match="in use, 3 of them by batches the consumer"):
        arena.reserve()
    del held
    arena.close()


def test_a_slot_holds_what_was_asked_for_in_whole_pages() -> None:
    arena = _arena()
    first, second = arena.reserve(), arena.reserve()
    assert first.capacity >= 10_000 and first.capacity % 4096 == 0
    assert first.offset + first.capacity == second.offset == arena.slot_bytes
    arena.close()


def test_preflight_refuses_more_than_max_bytes_and_says_how_much_is_needed() -> None:
    with pytest.raises(SharedMemoryError, match=r"need 8\.0 MiB \(8 slots"):
        SlotArena(slot_bytes=MiB, slots=8, max_bytes=4 * MiB)


def test_a_temporary_slot_is_freed_when_released() -> None:
    arena = _arena()
    before = arena.total_bytes
    ref = arena.temporary(5 * MiB)
    assert ref.temporary and ref.capacity >= 5 * MiB
    assert arena.total_bytes > before
    arena.release(ref)
    assert arena.total_bytes == before
    arena.close()


def test_a_worker_view_shares_memory_with_the_main_process() -> None:
    arena = _arena()
    ref = arena.reserve()
    view = WorkerSlots(os.getpid()).segment(ref)[ref.offset : ref.offset + ref.capacity]
    assert view.nbytes == ref.capacity
    view[:32].view(np.int64)[:] = [1, 2, 3, 4]
    del view
    seen = arena.export(ref, 32).view(np.int64)
    assert seen.tolist() == [1, 2, 3, 4]
    del seen
    arena.close()


def test_no_name_appears_in_dev_shm() -> None:
    before = set(os.listdir("/dev/shm"))
    arena = SlotArena(slot_bytes=MiB, slots=4, max_bytes=64 * MiB)
    assert set(os.listdir("/dev/shm")) == before
    arena.close()


def test_close_with_live_views_keeps_them_readable() -> None:
    arena = _arena()
    ref = arena.reserve()
    base = arena.export(ref, 16)
    base[:] = 7
    arena.close()
    assert base.tolist() == [7] * 16
    arena.close()  # idempotent


def test_resize_retires_the_old_slots_and_frees_each_segment_once_its_slots_are_back() -> None:
    arena = SlotArena(slot_bytes=10_000, slots=3, max_bytes=1 << 26)
    held = arena.reserve()
    viewed = arena.export(arena.reserve(), 64)
    old_segment = held.segment
    arena.resize(100_000)
    assert arena.capacity >= 100_000 and arena.live_from > old_segment
    fresh = arena.reserve()
    assert fresh.capacity >= 100_000 and fresh.segment >= arena.live_from
    assert old_segment in arena._segments  # two of its slots are still out
    arena.release(held)
    assert old_segment in arena._segments
    del viewed  # the consumer drops its batch: the last slot of the old size comes back
    assert arena.in_use == 1  # taken in (NOTE [letting a batch go])
    assert old_segment not in arena._segments
    assert all(ref.capacity >= 100_000 for ref in arena._free)  # old slots never handed out again
    arena.release(fresh)
    assert arena.in_use == 0
    arena.close()


def test_an_arena_made_without_slots_is_sized_by_its_first_resize() -> None:
    arena = SlotArena(slot_bytes=0, slots=4, max_bytes=1 << 26)
    assert arena.total_bytes == 0 and arena.capacity == 0
    with pytest.raises(RuntimeError, match="before the slots were sized"):
        arena.reserve()
    arena.resize(5_000)
    refs = [arena.reserve() for _ in range(4)]
    assert len({r.segment for r in refs}) == 1 and arena.total_bytes == 4 * arena.slot_bytes
    arena.close()


def test_a_worker_unmaps_retired_segments_and_the_ones_it_will_not_write_again() -> None:
    arena = SlotArena(slot_bytes=10_000, slots=2, max_bytes=1 << 26)
    worker = WorkerSlots(os.getpid())
    old = arena.reserve()
    worker.segment(old)
    arena.resize(50_000)
    new = arena.reserve()
    worker.segment(new)
    worker.retire_below(arena.live_from)
    assert set(worker._maps) == {new.segment}
    worker.segment(old)  # a task re-sent into an old slot (its worker died) maps it again ...
    worker.done_with(old)  # ... and unmaps it once built
    assert set(worker._maps) == {new.segment}
    worker.done_with(new)
    assert set(worker._maps) == {new.segment}  # a live slot stays mapped
    arena.release(old)
    arena.release(new)
    arena.close()


class _Stream:
    """A ``SlotDevice`` whose fences pass only when the test (or a wait) says so."""

    def __init__(self) -> None:
        self.locked: set[int] = set()
        self.fences = 0
        self.passed_upto = 0  # fences below this number have passed
        self.waited: list[int] = []

    def page_lock(self, address: int, nbytes: int) -> Any:
        self.locked.add(address)
        return lambda: self.locked.discard(address)

    def fence(self) -> int:
        self.fences += 1
        return self.fences - 1

    def passed(self, fence: int) -> bool:
        return fence < self.passed_upto

    def wait(self, fence: int, timeout_s: float) -> bool:
        self.waited.append(fence)
        self.passed_upto = max(self.passed_upto, fence + 1)
        return True


def test_a_pinned_slot_is_handed_out_again_only_once_the_fence_of_its_release_has_passed() -> None:
    stream = _Stream()
    arena = SlotArena(slot_bytes=10_000, slots=2, max_bytes=1 << 26, pin=stream)
    first = arena.reserve()
    base = arena.export(first, 64)
    del base  # released with a copy possibly queued: fenced
    assert stream.fences == 1 and arena.fencing == 1
    other = arena.reserve()  # the free slot, not the fencing one
    assert (other.segment, other.offset) != (first.segment, first.offset) and stream.waited == []
    again = arena.reserve()  # none free: waits for the oldest fence rather than grow
    assert stream.waited == [0] and (again.segment, again.offset) == (first.segment, first.offset)
    assert arena.fencing == 0 and arena.total_bytes == 2 * arena.slot_bytes
    arena.release(other)
    arena.release(again)
    arena.close()
    assert stream.locked == set()


def test_a_slot_whose_fence_passed_is_freed_without_waiting() -> None:
    stream = _Stream()
    arena = SlotArena(slot_bytes=10_000, slots=1, max_bytes=1 << 26, pin=stream)
    ref = arena.reserve()
    del_me = arena.export(ref, 64)
    del del_me
    stream.passed_upto = 1
    assert arena.reserve() == ref and stream.waited == []
    arena.close()


def test_a_closed_arena_frees_its_pinned_memory_after_the_last_view_and_its_copies() -> None:
    stream = _Stream()
    arena = SlotArena(slot_bytes=10_000, slots=2, max_bytes=1 << 26, pin=stream)
    kept = arena.export(arena.reserve(), 64)
    dropped = arena.export(arena.reserve(), 64)
    del dropped  # its copy is pending when the arena closes
    arena.close()
    assert len(stream.locked) == 1  # still viewed, and a copy from it may be queued
    kept[:] = 3  # and still mapped
    del kept
    assert stream.waited == [0, 1] and stream.locked == set()


def test_a_temporary_slot_counts_against_max_bytes() -> None:
    arena = SlotArena(slot_bytes=MiB, slots=2, max_bytes=16 * MiB)  # 2 MiB held
    ref = arena.temporary(14 * MiB)  # exactly fills the bound
    arena.release(ref)
    bound = r"samples \[7\] needs 14\.0 MiB .* max_shared_bytes \(16\.0 MiB\)\. Raise .* at least 17 MiB"
    with pytest.raises(SharedMemoryError, match=bound):
        arena.temporary(14 * MiB + 1, "the batch of 1 samples [7]")
    assert arena.total_bytes == 2 * MiB
    arena.close()


class _CtrlCInRelease(_Stream):
    """A device whose fence is where Ctrl-C lands: as if SIGINT arrived while the consumer's
    thread ran the release callback of the batch it let go."""

    def fence(self) -> int:
        raise KeyboardInterrupt


def test_ctrl_c_landing_in_the_release_of_a_batch_reaches_the_training_loop() -> None:
    # An exception in a weakref callback is only printed, never raised: Ctrl-C pressed while
    # `batch` is rebound would be lost and the loop would go on.
    arena = SlotArena(slot_bytes=10_000, slots=2, max_bytes=1 << 26, pin=_CtrlCInRelease())
    base = arena.export(arena.reserve(), 64)
    # A terminal's Ctrl-C, even where the suite was started in the background (SIGINT ignored).
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        deadline = time.monotonic() + 30  # bounds a wait for the interrupt, not a race
        with pytest.raises(KeyboardInterrupt):
            del base
            while time.monotonic() < deadline:  # the training loop's next steps
                time.sleep(0.001)
    finally:
        signal.signal(signal.SIGINT, before)
    arena.close()
