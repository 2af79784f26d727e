"""Letting a batch go (NOTE [letting a batch go] in ``_engine/_arena.py``): the last view of a
slot dying on the consumer's thread takes no lock and makes no system call, in the arena alone
and in the loop as users write it (the previous batch held through ``next()``, released as
``batch`` is rebound), with either driver; the slot then comes back, and is reused, correctly."""

from __future__ import annotations

import gc
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from _token_files import write_token_file

import fastload
from fastload._engine._arena import SlotArena

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/thread-self/io"), reason="needs Linux's per-thread I/O counts"
)
N = 400


class CountingLock:
    """A lock that counts how often the thread that made it takes it."""

    def __init__(self, lock: Any) -> None:
        self._lock = lock
        self._owner = threading.get_ident()
        self.taken = 0

    def __enter__(self) -> Any:
        self.taken += threading.get_ident() == self._owner
        return self._lock.__enter__()

    def __exit__(self, *exc: object) -> Any:
        return self._lock.__exit__(*exc)


def thread_io_calls() -> tuple[int, int]:
    """This thread's read and write system calls so far (``/proc/thread-self/io``)."""
    with open("/proc/thread-self/io", "rb") as f:
        fields = dict(line.split(b": ") for line in f.read().splitlines())
    return int(fields[b"syscr"]), int(fields[b"syscw"])


def io_calls_of(action: Any) -> tuple[int, int]:
    """The read and write system calls ``action()`` made on this thread, less the reading."""
    a = thread_io_calls()
    b = thread_io_calls()
    action()
    c = thread_io_calls()
    return (c[0] - b[0]) - (b[0] - a[0]), (c[1] - b[1]) - (b[1] - a[1])


def test_letting_a_batch_go_takes_no_lock_and_makes_no_system_call_and_the_slot_comes_back() -> None:
    arena = SlotArena(slot_bytes=10_000, slots=4, max_bytes=1 << 26)
    refs = [arena.reserve() for _ in range(4)]
    views = [torch.from_numpy(arena.export(ref, 64)[:8]) for ref in refs]
    views[0][:] = 7
    lock = arena._lock = CountingLock(arena._lock)
    gc.disable()  # the views die by reference count, as the loop's batch does when rebound
    try:
        for k in range(1, 4):
            assert io_calls_of(lambda k=k: views.__setitem__(k, None)) == (0, 0)
    finally:
        gc.enable()
    assert lock.taken == 0
    assert (arena.in_use, arena.exported) == (1, 1)  # taken in when asked
    total = arena.total_bytes
    again = {(r.segment, r.offset) for r in (arena.reserve() for _ in range(3))}
    assert again == {(r.segment, r.offset) for r in refs[1:]}  # the same slots, nothing grown
    assert arena.total_bytes == total and bool((views[0] == 7).all())  # the held one untouched
    views.clear()
    arena.close()


@pytest.fixture(scope="module")
def h5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_token_file(tmp_path_factory.mktemp("release") / "data.h5", N, 40)


def test_in_the_users_loop_rebinding_batch_takes_no_lock_and_no_system_call(h5: Path, driver: str) -> None:
    loader = fastload.DataLoader(
        fastload.HDF5Dataset(h5), batch_size=8, num_workers=2,
        collate_fn=fastload.PadCollate(dtype=torch.int64, mask_dtype=torch.bool),
    )  # fmt: skip
    it = iter(loader)
    arena = it._runner._arena
    lock = arena._lock = CountingLock(arena._lock)
    rows: list[int] = []
    batch = next(it)
    rows += batch["lengths"].tolist()
    released = []
    gc.disable()  # the batch dies by reference count as it is rebound, as in a user's loop
    try:
        for following in it:
            rows += following["lengths"].tolist()
            taken = lock.taken

            def rebind(following: Any = following) -> None:
                nonlocal batch
                batch = following

            released.append(io_calls_of(rebind))
            assert lock.taken == taken
            del following
    finally:
        gc.enable()
    assert released and all(calls == (0, 0) for calls in released)
    assert rows == fastload.HDF5Dataset(h5).lengths.tolist()  # every batch, in order, intact
    assert arena.total_bytes <= 12 * arena.slot_bytes  # the slots came back and were reused
