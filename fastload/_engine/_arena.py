"""Batch slots in shared memory: created and freed by the main process, written by workers.

A *segment* is an anonymous shared file (``memfd_create``; a file in the temp dir, deleted at
once, where memfd is missing) mapped by the main process. Workers map the same file by opening
``/proc/<main pid>/fd/<fd>``, so no name ever exists in ``/dev/shm``: a SIGKILL of any process
leaks nothing, and Docker's 64 MB ``/dev/shm`` limit does not apply (the memory still counts
against the container's memory limit, which the preflight checks).

A segment holds ``slots`` slots of ``slot_bytes`` each. A slot is *free*, *reserved* for a task,
or *exported* to the consumer as tensors viewing it; it becomes free again only when the last
tensor viewing it is garbage-collected (a weak reference with a callback on the numpy array under
all the views), so a consumer that keeps a batch can never see it overwritten. Each regular slot
ends in a claim word (``_claims.py``) after its ``capacity`` bytes for the batch.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from fastload._engine._claims import CLAIM_BYTES
from fastload.errors import SharedMemoryError

ALIGN = 64  # every array in a slot starts on a 64-byte boundary (cache line; any dtype's view)
_PAGE = mmap.PAGESIZE


def align(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


class SlotRef(NamedTuple):
    """Where a task writes its batch: a slot of a segment, as a worker can find it (a tuple:
    made and pickled once per batch)."""

    segment: int  # segment id, unique for the arena's life
    fd: int  # the segment's descriptor number in the main process
    size: int  # the segment's size in bytes
    offset: int  # the slot's byte offset in the segment
    capacity: int  # the bytes a batch may use (a regular slot's claim word follows them)
    temporary: bool = False  # a one-off slot for an oversize batch: unmapped after use

    @property
    def claim_at(self) -> int:
        """Where in its segment the slot's claim word lies (``_claims.py``): right after the
        bytes a batch may use."""
        return self.offset + self.capacity


def available_memory_bytes() -> int | None:
    """``MemAvailable`` from /proc/meminfo, or ``None`` where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _anonymous_file(size: int) -> int:
    if hasattr(os, "memfd_create"):
        try:
            fd = os.memfd_create("fastload-slots", os.MFD_CLOEXEC)
        except OSError:
            pass
        else:
            os.ftruncate(fd, size)
            return fd
    warnings.warn(
        "memfd_create is unavailable; fastload's batch slots fall back to a deleted file in "
        f"{tempfile.gettempdir()} (set TMPDIR to a tmpfs for speed)",
        RuntimeWarning,
        stacklevel=4,
    )
    fd, path = tempfile.mkstemp(prefix="fastload-slots-")
    os.unlink(path)
    os.ftruncate(fd, size)
    return fd


Pinner = Callable[[int, int], "Callable[[], None] | None"]


class _Segment:
    def __init__(self, seg_id: int, size: int, pin: Pinner | None) -> None:
        self.id = seg_id
        self.size = size
        self.array: np.ndarray | None = None  # the whole segment, for the main process's builds
        self.fd = _anonymous_file(size)
        try:
            self.mm = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(self.fd)
            raise
        self._unpin = None
        if pin is not None:
            view = np.frombuffer(self.mm, dtype=np.uint8)
            self._unpin = pin(view.ctypes.data, size)
            del view

    def close(self) -> None:
        self.array = None
        if self._unpin is not None:
            self._unpin()
        os.close(self.fd)
        with contextlib.suppress(BufferError):  # tensors still view it: unmapped when they die
            self.mm.close()


class SlotArena:
    """The main process's pool of batch slots.

    ``reserve()`` hands out a free slot, growing the arena when none is free, up to
    ``max_bytes`` in all; ``export(ref, nbytes)`` returns a writable uint8 array over the slot
    that frees the slot when it is garbage-collected; ``release(ref)`` frees a slot that was
    never exported. ``temporary(nbytes)`` makes a one-off slot for an oversize batch.
    ``slot_bytes`` is the stride of regular slots: their ``capacity`` for a batch (at least the
    ``slot_bytes`` asked for) plus the claim word. Thread-safe: a finalizer may run on any thread.
    """

    def __init__(
        self, *, slot_bytes: int, slots: int, max_bytes: int, pin: Pinner | None = None
    ) -> None:
        self.slot_bytes = align(slot_bytes + CLAIM_BYTES, _PAGE)
        self._pin = pin
        self.max_bytes = max_bytes
        needed = self.slot_bytes * slots
        if needed > max_bytes:
            raise SharedMemoryError(
                f"batch slots need {needed / 2**20:.1f} MiB ({slots} slots of "
                f"{self.slot_bytes / 2**20:.2f} MiB, the largest possible batch) but at most "
                f"{max_bytes / 2**20:.1f} MiB may be used (about a quarter of the available "
                "memory, or max_shared_bytes). Lower batch_size / max_tokens or prefetch_factor, "
                "or free memory."
            )
        # Reentrant: a finalizer freeing a slot may run in the middle of arena code (a garbage
        # collection triggered by an allocation made under the lock).
        self._lock = threading.RLock()
        #: Called (outside the lock, on whatever thread dropped the batch) after a batch's slot
        #: is freed by the garbage collector: the engine thread may dispatch into it.
        self.on_release: Callable[[], None] | None = None
        self._segments: dict[int, _Segment] = {}
        # id() of each exported slot's weak reference -> (that reference, the slot); the
        # reference's callback frees the slot.
        self._exports: dict[int, tuple[weakref.ref[np.ndarray], SlotRef]] = {}
        self._free: deque[SlotRef] = deque()
        self._temporary_ids: set[int] = set()
        self._next_id = 0
        self._bytes = 0
        self._closed = False
        self.exported = 0  # slots currently viewed by consumer tensors
        self._grow(slots)

    def _new_segment(self, size: int) -> _Segment:
        seg = _Segment(self._next_id, size, self._pin)
        self._next_id += 1
        self._segments[seg.id] = seg
        self._bytes += size
        return seg

    def _grow(self, slots: int) -> None:
        seg = self._new_segment(self.slot_bytes * slots)
        for k in range(slots):
            ref = SlotRef(seg.id, seg.fd, seg.size, k * self.slot_bytes, self.slot_bytes - CLAIM_BYTES)
            self._free.append(ref)

    @property
    def total_bytes(self) -> int:
        return self._bytes

    @property
    def in_use(self) -> int:
        """Slots reserved for a task or viewed by the consumer (temporary slots included)."""
        with self._lock:
            regular = sum(seg.size for seg in self._segments.values() if seg.id not in self._temporary_ids)
            return regular // self.slot_bytes - len(self._free) + len(self._temporary_ids)

    def reserve(self) -> SlotRef:
        with self._lock:
            if not self._free:
                grow = max(1, len(self._segments) and (self._bytes // self.slot_bytes) // 2)
                if self._bytes + grow * self.slot_bytes > self.max_bytes:
                    raise SharedMemoryError(
                        f"all {self._bytes // self.slot_bytes} batch slots "
                        f"({self._bytes / 2**20:.1f} MiB) are in use, {self.exported} of them by "
                        "batches the consumer still holds, and growing past "
                        f"{self.max_bytes / 2**20:.1f} MiB (max_shared_bytes) is not allowed. "
                        "Keep fewer batches alive, or .clone() the tensors you keep."
                    )
                self._grow(grow)
            return self._free.popleft()

    def temporary(self, nbytes: int) -> SlotRef:
        """A slot of its own for one batch larger than ``slot_bytes``; its segment is freed with
        the slot."""
        size = align(nbytes, _PAGE)
        with self._lock:
            seg = self._new_segment(size)
            self._temporary_ids.add(seg.id)
        return SlotRef(seg.id, seg.fd, seg.size, 0, size, temporary=True)

    def release(self, ref: SlotRef) -> None:
        with self._lock:
            if not self._closed:
                self._release_locked(ref)

    def _release_locked(self, ref: SlotRef) -> None:
        if ref.temporary:
            self._temporary_ids.discard(ref.segment)
            seg = self._segments.pop(ref.segment)
            self._bytes -= seg.size
            seg.close()
        else:
            self._free.append(ref)

    def memory(self, ref: SlotRef) -> mmap.mmap:
        """The main process's map of the segment holding ``ref`` (for its claim word)."""
        return self._segments[ref.segment].mm

    def segment(self, ref: SlotRef) -> np.ndarray:
        """The whole segment holding ``ref`` as a writable uint8 array, for a batch built in the
        main process (the slot starts at ``ref.offset``); as :meth:`WorkerSlots.segment`, so
        that a builder takes either. Made once per segment and dropped when the segment
        closes."""
        seg = self._segments[ref.segment]
        if seg.array is None:
            seg.array = np.frombuffer(seg.mm, dtype=np.uint8)
        return seg.array

    def forget(self, segment: int) -> None:
        """As :meth:`WorkerSlots.forget`: nothing to do, the arena owns its segments."""

    def export(self, ref: SlotRef, nbytes: int) -> np.ndarray:
        """A writable uint8 array over the first ``nbytes`` of the slot; the slot is freed when
        the array (and every view of it, numpy or torch) is garbage-collected."""
        seg = self._segments[ref.segment]
        # Views of this array have it as their base (numpy stops collapsing bases at the mmap
        # under it), so it lives exactly as long as the batch's tensors. A weak reference with
        # a callback costs a fifth of a weakref.finalize, once per batch.
        arr = np.frombuffer(seg.mm, dtype=np.uint8, count=nbytes, offset=ref.offset)
        watch = weakref.ref(arr, self._on_collected)
        with self._lock:
            self.exported += 1
            self._exports[id(watch)] = (watch, ref)
        return arr

    def _on_collected(self, watch: weakref.ref[np.ndarray]) -> None:
        with self._lock:
            self.exported -= 1
            _, ref = self._exports.pop(id(watch))
            if self._closed:
                return
            if ref.temporary:
                self._release_locked(ref)
            else:
                self._free.append(ref)  # as _release_locked does: this runs once per batch
        if self.on_release is not None:
            self.on_release()

    def close(self) -> None:
        """Free every segment (call after the workers are gone). Slots still viewed by consumer
        tensors stay mapped until those tensors die."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for seg in self._segments.values():
                seg.close()
            self._segments.clear()
            self._free.clear()
            # Not the weak references: a batch collected after close still counts itself out.


class WorkerSlots:
    """A worker's view of the main process's segments, mapped on first use and cached."""

    def __init__(self, main_pid: int) -> None:
        self._main_pid = main_pid
        self._maps: dict[int, tuple[mmap.mmap, np.ndarray]] = {}

    def segment(self, ref: SlotRef) -> np.ndarray:
        """The whole segment holding ``ref`` as a writable uint8 array (the slot starts at
        ``ref.offset``); arrays built on it must be dropped before :meth:`forget`."""
        mapped = self._maps.get(ref.segment)
        if mapped is None:
            fd = os.open(f"/proc/{self._main_pid}/fd/{ref.fd}", os.O_RDWR)
            try:
                mm = mmap.mmap(fd, ref.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            mapped = self._maps[ref.segment] = (mm, np.frombuffer(mm, dtype=np.uint8))
        return mapped[1]

    def view(self, ref: SlotRef) -> np.ndarray:
        """The slot itself, as a writable uint8 array of ``ref.capacity`` bytes."""
        return self.segment(ref)[ref.offset : ref.offset + ref.capacity]

    def forget(self, segment: int) -> None:
        mapped = self._maps.pop(segment, None)
        if mapped is not None:
            mm, array = mapped
            del mapped, array
            with contextlib.suppress(BufferError):
                mm.close()
