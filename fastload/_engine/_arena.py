"""Batch slots in shared memory: created and freed by the main process, written by workers.

A *segment* is an anonymous shared file (``memfd_create``; a file in the temp dir, deleted at
once, where memfd is missing) mapped by the main process. Workers map the same file by opening
``/proc/<main pid>/fd/<fd>``, so no name ever exists in ``/dev/shm``: a SIGKILL of any process
leaks nothing, and Docker's 64 MB ``/dev/shm`` limit does not apply (the memory still counts
against the container's memory limit, which the preflight checks).

A segment holds regular slots of one size, ``slot_bytes`` apart. A slot is *free*, *reserved*
for a task, or *exported* to the consumer as tensors viewing it; it becomes free again only when
the last tensor viewing it is garbage-collected (a weak reference with a callback on the numpy
array under all the views), so a consumer that keeps a batch can never see it overwritten. A
batch larger than a regular slot gets a temporary segment of its own.

The regular size may change while the arena lives (:meth:`SlotArena.resize`, when the batches
that come turn out larger than the slots): the segments of the old size are then *retired*. Their
slots are never handed out again, and each retired segment is freed once its last slot is back.
Segment ids only grow, so :attr:`SlotArena.live_from`, the first id of the current size, tells a
worker which of the segments it has mapped it may unmap.

NOTE [letting a batch go]: the last view of a slot dies on the consumer's thread, as the loop
rebinds ``batch`` (after ``next()`` returned, where no meter sees it), so the weak reference's
callback does O(1) work with no lock and no system call: it asks a page-locked slot's device
for a fence and appends the reference to ``_returned`` (a deque: one append under the GIL).
Whoever next needs the arena's counts or a slot (:meth:`SlotArena.reserve`, on whichever thread
dispatches; the statistics; :meth:`SlotArena.close`) takes the returned slots in under the lock.
Nothing is woken: the engine finds the slot when it next dispatches.

NOTE [pending copies]: a slot page-locked for a device may still be read by a copy the consumer
queued from it (``x.to("cuda", non_blocking=True)`` returns before the copy runs). So when the
last view of such a slot dies, the arena asks the device for a *fence* (an event after the
copies queued so far: O(1), no system call, on the consumer's thread) and the slot is *fencing*:
it is handed out again, or its segment freed, only once the fence has passed. Where slots are
handed out (:meth:`SlotArena.reserve`, on whichever thread dispatches) the oldest fences are
polled; when no slot is free and some are fencing, the oldest fence is waited for (up to
``FENCE_WAIT_S``: the GPU is behind, and the loader need not run further ahead of it) before the
arena grows. A closed arena frees its page-locked segments once the last view has died and
every fence has passed (waiting then, bounded, for copies still queued).
"""

from __future__ import annotations

import _thread
import contextlib
import mmap
import os
import tempfile
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import numpy as np

from fastload._protocols import ALIGN
from fastload._threads import start_own_thread
from fastload.errors import SharedMemoryError

_PAGE = mmap.PAGESIZE

#: The longest a slot waits for the copies queued from it (NOTE [pending copies]) before the
#: arena grows instead, or, once closed, leaves the memory page-locked rather than free it.
FENCE_WAIT_S = 30.0

# Closed arenas whose page-locked segments wait for their last views: kept alive, since their
# views' weak references (and so their callbacks) die with them.
_CLOSING: set[SlotArena] = set()

# Segments a closed arena could not free because a copy from them never completed: they stay
# mapped and page-locked for the life of the process rather than be reused under a copy.
_ABANDONED: list[_Segment] = []

# This process's id, kept current across fork without a system call per batch (a forked child's
# copy of an arena fences nothing).
_PID = os.getpid()


def _forked() -> None:
    global _PID
    _PID = os.getpid()


os.register_at_fork(after_in_child=_forked)


def align(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


class SlotRef(NamedTuple):
    """Where a task writes its batch: a slot of a segment, as a worker can find it (a tuple:
    made and pickled once per batch)."""

    segment: int  # segment id, unique for the arena's life
    fd: int  # the segment's descriptor number in the main process
    size: int  # the segment's size in bytes
    offset: int  # the slot's byte offset in the segment
    capacity: int  # the bytes a batch may use
    temporary: bool = False  # a one-off slot for an oversize batch: unmapped after use


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


def anonymous_file(size: int, name: str = "fastload-slots") -> int:
    """A shared memory file of ``size`` bytes with no name anywhere (``memfd_create``; where it is
    missing, a file in the temp dir, deleted at once); its descriptor."""
    if hasattr(os, "memfd_create"):
        try:
            fd = os.memfd_create(name, os.MFD_CLOEXEC)
        except OSError:
            pass
        else:
            os.ftruncate(fd, size)
            return fd
    warnings.warn(
        "memfd_create is unavailable; fastload's shared memory falls back to a deleted file in "
        f"{tempfile.gettempdir()} (set TMPDIR to a tmpfs for speed)",
        RuntimeWarning,
        stacklevel=4,
    )
    fd, path = tempfile.mkstemp(prefix=f"{name}-")
    os.unlink(path)
    os.ftruncate(fd, size)
    return fd


class SlotDevice(Protocol):
    """The device that copies batches out of the slots (``fastload._device.PinnedSlots`` for
    CUDA; a test's fake): it page-locks the slots and fences the copies queued from them."""

    def page_lock(self, address: int, nbytes: int) -> Callable[[], None] | None:
        """Page-lock ``nbytes`` at ``address``; the function that undoes it, or ``None`` where
        the memory stays pageable (copies from it are then synchronous: no fence is needed)."""

    def fence(self) -> Any:
        """A mark after every copy the calling thread may have queued so far (an event on its
        current stream). Cheap: called once per batch as its slot is released."""

    def passed(self, fence: Any) -> bool:
        """Whether every copy before ``fence`` has completed."""

    def wait(self, fence: Any, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for ``fence`` to pass; whether it has."""


class _Segment:
    def __init__(self, seg_id: int, size: int, pin: SlotDevice | None) -> None:
        self.id = seg_id
        self.size = size
        self.fd = anonymous_file(size)
        try:
            self.mm = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(self.fd)
            raise
        self._unpin = None
        if pin is not None:
            view = np.frombuffer(self.mm, dtype=np.uint8)
            self._unpin = pin.page_lock(view.ctypes.data, size)
            del view

    @property
    def pinned(self) -> bool:
        """Page-locked: copies from it may still run after ``.to()`` returned."""
        return self._unpin is not None

    def close(self) -> None:
        if self._unpin is not None:
            self._unpin()
        os.close(self.fd)
        with contextlib.suppress(BufferError):  # tensors still view it: unmapped when they die
            self.mm.close()


#: How long after a Ctrl-C lost in a release callback it is raised again (the callback has
#: long returned by then).
_INTERRUPT_AGAIN_S = 0.05


def _interrupt_main_later() -> None:
    time.sleep(_INTERRUPT_AGAIN_S)
    _thread.interrupt_main()


class SlotArena:
    """The main process's pool of batch slots.

    ``reserve()`` hands out a free slot, growing the arena when none is free, up to
    ``max_bytes`` in all; ``export(ref, nbytes)`` returns a writable uint8 array over the slot
    that frees the slot when it is garbage-collected (once the copies queued from it have
    completed, where ``pin`` page-locked it: NOTE [pending copies]); ``release(ref)`` frees a
    slot that was never exported. ``temporary(nbytes)`` makes a one-off slot for an oversize batch;
    ``resize(capacity)`` changes the size of the regular slots handed out from then on.
    ``slot_bytes`` is the stride of regular slots: their ``capacity`` for a batch (at least the
    ``slot_bytes`` asked for, in whole pages); 0 until the first ``resize`` where the arena
    was made with no slots (its batches' size not yet known). ``slots`` is how many regular
    slots each size starts with. Thread-safe: a finalizer may run on any thread.
    """

    def __init__(
        self, *, slot_bytes: int, slots: int, max_bytes: int, pin: SlotDevice | None = None
    ) -> None:
        self._pin = pin
        self._pid = os.getpid()  # a forked child's copy of the arena fences nothing
        self.max_bytes = max_bytes
        self._slots = max(1, slots)
        # Reentrant: a garbage collection triggered by an allocation made under the lock may
        # run a closed arena's callback, which takes it.
        self._lock = threading.RLock()
        self._segments: dict[int, _Segment] = {}
        # id() of each exported slot's weak reference -> (that reference, the slot); the
        # reference's callback returns the slot (NOTE [letting a batch go]).
        self._exports: dict[int, tuple[weakref.ref[np.ndarray], SlotRef]] = {}
        # Weak references of exported slots whose last view died, with their fences (None:
        # none needed), not yet taken in (NOTE [letting a batch go]).
        self._returned: deque[tuple[weakref.ref[np.ndarray], Any]] = deque()
        self._free: deque[SlotRef] = deque()
        # Slots whose last view died while copies from them may be pending, with their fences,
        # oldest first (NOTE [pending copies]).
        self._fencing: deque[tuple[Any, SlotRef]] = deque()
        self._temporary_ids: set[int] = set()
        self._retired: dict[int, int] = {}  # retired segment id -> its slots not yet back
        self._next_id = 0
        self._bytes = 0
        self._closed = False
        self._sized = 0  # regular slots of the current size
        self.live_from = 0  # regular segments below this id are retired
        self._exported = 0  # slots currently viewed by consumer tensors
        self._held = 0  # slots reserved for a task or viewed by the consumer, temporary ones too
        self.slot_bytes = 0
        if slot_bytes > 0:
            self._set_size(slot_bytes)
            self._check_fits(self.slot_bytes * slots)
            self._grow(slots)

    @staticmethod
    def stride(capacity: int) -> int:
        """The bytes a regular slot holding ``capacity`` bytes of batch takes in a segment."""
        return align(capacity, _PAGE)

    def _set_size(self, capacity: int) -> None:
        self.slot_bytes = self.stride(capacity)

    def _check_fits(self, needed: int) -> None:
        if self._bytes + needed > self.max_bytes:
            raise SharedMemoryError(
                f"batch slots need {(self._bytes + needed) / 2**20:.1f} MiB ({self._slots} "
                f"slots of {self.slot_bytes / 2**20:.2f} MiB, the largest batch expected) but "
                f"at most {self.max_bytes / 2**20:.1f} MiB may be used (about a quarter of the "
                "available memory, or max_shared_bytes). Lower batch_size / max_tokens or "
                "prefetch_factor, or free memory."
            )

    def _new_segment(self, size: int) -> _Segment:
        seg = _Segment(self._next_id, size, self._pin)
        self._next_id += 1
        self._segments[seg.id] = seg
        self._bytes += size
        return seg

    def _grow(self, slots: int) -> None:
        seg = self._new_segment(self.slot_bytes * slots)
        for k in range(slots):
            ref = SlotRef(seg.id, seg.fd, seg.size, k * self.slot_bytes, self.slot_bytes)
            self._free.append(ref)
        self._sized += slots

    @property
    def total_bytes(self) -> int:
        return self._bytes

    @property
    def capacity(self) -> int:
        """The bytes a batch may use in a regular slot handed out now (0: none yet)."""
        return self.slot_bytes

    @property
    def in_use(self) -> int:
        """Slots reserved for a task or viewed by the consumer (temporary slots included)."""
        with self._lock:
            self._take_returned_locked()
            return self._held

    @property
    def exported(self) -> int:
        """Slots the consumer's tensors still view."""
        with self._lock:
            self._take_returned_locked()
            return self._exported

    @property
    def held(self) -> int:
        """As :attr:`in_use`."""
        return self.in_use

    def _take_returned_locked(self) -> None:
        """Take in the slots whose last view died (NOTE [letting a batch go]): free, or
        fencing while copies from them may be pending."""
        returned = self._returned
        while returned:
            watch, fence = returned.popleft()
            _, ref = self._exports.pop(id(watch))
            self._exported -= 1
            if fence is not None:
                self._fencing.append((fence, ref))  # freed where slots are handed out
            elif not self._closed:
                self._release_locked(ref)

    def resize(self, capacity: int) -> None:
        """Regular slots handed out from now on hold ``capacity`` bytes of batch; the slots of
        the old size are retired (see the module text)."""
        with self._lock:
            free_of: dict[int, int] = {}
            for ref in self._free:
                free_of[ref.segment] = free_of.get(ref.segment, 0) + 1
            self._free.clear()
            for seg_id, seg in list(self._segments.items()):
                if seg_id in self._temporary_ids or seg_id in self._retired:
                    continue
                out = seg.size // self.slot_bytes - free_of.get(seg_id, 0)
                if out:
                    self._retired[seg_id] = out
                else:
                    self._close_segment(seg_id)
            self.live_from = self._next_id
            self._sized = 0
            self._set_size(capacity)

    def _close_segment(self, seg_id: int) -> None:
        seg = self._segments.pop(seg_id)
        self._bytes -= seg.size
        seg.close()

    @property
    def fencing(self) -> int:
        """Slots no tensor views any more that wait for the copies queued from them."""
        with self._lock:
            self._take_returned_locked()
            return len(self._fencing)

    def reserve(self) -> SlotRef:
        """A free slot, for a task. Slots whose copies have completed are freed first; where
        none is free but some wait for their copies, the oldest is waited for (up to
        ``FENCE_WAIT_S``) rather than the arena grown (NOTE [pending copies])."""
        waited = False
        while True:
            with self._lock:
                # Once per batch: no call where there is nothing to take in or reclaim.
                if self._returned:
                    self._take_returned_locked()
                fencing = self._fencing
                if fencing:
                    self._reclaim_locked()
                if self._free or not fencing or waited:
                    return self._reserve_locked()
                oldest = fencing[0][0]
            assert self._pin is not None
            self._pin.wait(oldest, FENCE_WAIT_S)  # not under the lock: views die meanwhile
            waited = True

    def _reclaim_locked(self) -> None:
        """Free the fencing slots, oldest first, whose fences have passed."""
        fencing = self._fencing
        while fencing:
            assert self._pin is not None
            if not self._pin.passed(fencing[0][0]):
                return
            self._release_locked(fencing.popleft()[1])

    def _reserve_locked(self) -> SlotRef:
        if not self._free:
            if self.slot_bytes == 0:
                raise RuntimeError("SlotArena.reserve() before the slots were sized (resize)")
            grow = self._sized // 2 or self._slots
            if self._bytes + grow * self.slot_bytes > self.max_bytes:
                if self._sized == 0:
                    self._check_fits(grow * self.slot_bytes)  # raises: the first of a size
                copying = (
                    f" and {len(self._fencing)} by copies to the GPU queued from them and not "
                    f"done after {FENCE_WAIT_S:.0f} s"
                    if self._fencing
                    else ""
                )
                raise SharedMemoryError(
                    f"all {self._sized} batch slots of {self.slot_bytes / 2**20:.2f} MiB "
                    f"({self._bytes / 2**20:.1f} MiB in all) are in use, {self._exported} of "
                    f"them by batches the consumer still holds{copying}, and growing past "
                    f"{self.max_bytes / 2**20:.1f} MiB (max_shared_bytes) is not allowed. "
                    "Keep fewer batches alive, or .clone() the tensors you keep."
                )
            self._grow(grow)
        self._held += 1
        return self._free.popleft()

    def temporary(self, nbytes: int, batch: str = "a batch") -> SlotRef:
        """A slot of its own for one batch larger than the regular ones (``batch`` says which,
        for the error); its segment is freed with the slot. It counts against ``max_bytes``
        as the regular slots do."""
        size = align(nbytes, _PAGE)
        with self._lock:
            if self._bytes + size > self.max_bytes:
                raise SharedMemoryError(
                    f"{batch} needs {size / 2**20:.1f} MiB of shared memory, more than a "
                    f"regular slot holds; a temporary slot of that size on top of the "
                    f"{self._bytes / 2**20:.1f} MiB of slots held would exceed "
                    f"max_shared_bytes ({self.max_bytes / 2**20:.1f} MiB). Raise "
                    f"max_shared_bytes to at least {-(-(self._bytes + size) // 2**20)} MiB, or "
                    "make the batch smaller: a lower batch_size or max_tokens, or cut long "
                    "samples (PadCollate(max_length=...))."
                )
            seg = self._new_segment(size)
            self._temporary_ids.add(seg.id)
            self._held += 1
        return SlotRef(seg.id, seg.fd, seg.size, 0, size, temporary=True)

    def release(self, ref: SlotRef) -> None:
        with self._lock:
            if not self._closed:
                self._release_locked(ref)

    def _release_locked(self, ref: SlotRef) -> None:
        self._held -= 1
        if ref.temporary:
            self._temporary_ids.discard(ref.segment)
            self._close_segment(ref.segment)
        elif ref.segment < self.live_from:
            left = self._retired[ref.segment] - 1
            if left:
                self._retired[ref.segment] = left
            else:
                del self._retired[ref.segment]
                self._close_segment(ref.segment)
        else:
            self._free.append(ref)

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
            self._exported += 1
            self._exports[id(watch)] = (watch, ref)
        return arr

    def _on_collected(self, watch: weakref.ref[np.ndarray]) -> None:
        # On the consumer's thread as it lets a batch go: O(1), no lock, no system call
        # (NOTE [letting a batch go]).
        try:
            self._take_back(watch)
        except KeyboardInterrupt:
            # Ctrl-C landed in this callback, whose exceptions Python only prints; raised again
            # from here it would land here again. A timer hands it back to the consumer's
            # thread once the callback has returned, where the training loop sees it.
            start_own_thread(_interrupt_main_later, "fastload-interrupt")

    def _take_back(self, watch: weakref.ref[np.ndarray]) -> None:
        fence = None
        if self._pin is not None:
            _, ref = self._exports[id(watch)]
            seg = self._segments.get(ref.segment)
            if seg is not None and seg.pinned and self._pid == _PID:
                fence = self._pin.fence()
        self._returned.append((watch, fence))
        if self._closed:  # read after the append: close() takes in whatever it found before
            with self._lock:
                self._take_returned_locked()
                last = not self._exported
            if last:  # the last view of a closed arena
                self._free_pinned()

    def close(self) -> None:
        """Free every segment (call after the workers are gone). Slots still viewed by consumer
        tensors stay mapped until those tensors die; a page-locked segment that such a slot or
        a pending copy uses is freed once the last view has died and its copies have completed
        (NOTE [pending copies])."""
        with self._lock:
            if self._closed:
                return
            self._closed = True  # before taking in: see _on_collected
            self._take_returned_locked()
            # Copied first: a view collected meanwhile (an allocation may run the collector)
            # changes both.
            out = [*self._exports.values(), *self._fencing]
            used = {ref.segment for _, ref in out}
            for seg_id, seg in list(self._segments.items()):
                if not (seg.pinned and seg_id in used):
                    del self._segments[seg_id]
                    seg.close()
            self._free.clear()
            # Not the weak references: a batch collected after close still counts itself out.
            last = not self._exported
            if self._segments and not last:
                _CLOSING.add(self)
        if last:
            self._free_pinned()

    def _free_pinned(self) -> None:
        """Free the page-locked segments a closed arena kept, once the copies queued from them
        have completed (waiting for them, bounded: this runs once, when the last view died)."""
        with self._lock:
            segments = list(self._segments.values())
            self._segments.clear()
            fences = [fence for fence, _ in self._fencing]
            self._fencing.clear()
            _CLOSING.discard(self)
        if not segments or self._pid != _PID:
            return
        assert self._pin is not None
        for fence in fences:
            if not (self._pin.passed(fence) or self._pin.wait(fence, FENCE_WAIT_S)):
                _ABANDONED.extend(segments)
                warnings.warn(
                    f"a copy to the GPU from fastload's batch slots has not completed after "
                    f"{FENCE_WAIT_S:.0f} s; {sum(s.size for s in segments) / 2**20:.1f} MiB of "
                    "page-locked slots stay mapped until the process exits",
                    RuntimeWarning,
                    stacklevel=2,
                )
                return
        for seg in segments:
            seg.close()


class WorkerSlots:
    """A worker's view of the main process's segments, mapped on first use and cached."""

    def __init__(self, main_pid: int) -> None:
        self._main_pid = main_pid
        self._maps: dict[int, tuple[mmap.mmap, np.ndarray]] = {}
        self._live_from = 0

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

    def mapped(self, segment: int) -> np.ndarray | None:
        """Segment ``segment`` if this worker has mapped it already (see :meth:`segment`)."""
        mapped = self._maps.get(segment)
        return None if mapped is None else mapped[1]

    @property
    def live_from(self) -> int:
        """The lowest segment id not retired, as the last task said."""
        return self._live_from

    def retire_below(self, live_from: int) -> None:
        """The main process retired every regular segment below ``live_from``
        (:attr:`SlotArena.live_from`): unmap those, so that their memory can go once the main
        process frees them."""
        if live_from > self._live_from:
            self._live_from = live_from
            for segment in [s for s in self._maps if s < live_from]:
                self.forget(segment)

    def done_with(self, ref: SlotRef) -> None:
        """A batch was built into ``ref``: unmap a segment that will not be written again."""
        if ref.temporary or ref.segment < self._live_from:
            self.forget(ref.segment)

    def forget(self, segment: int) -> None:
        mapped = self._maps.pop(segment, None)
        if mapped is not None:
            mm, array = mapped
            del mapped, array
            with contextlib.suppress(BufferError):
                mm.close()
