"""The device prefetcher's order, lifetimes, measuring and errors, on the CPU.

``FakeOps`` stands in for the device's streams and events (``DeviceOps``): it records every call
in a log shared with the batch source, "copies" by cloning CPU tensors, and lets the test decide
when an event completes (and at which time, for the idle measurement). What it cannot show —
that CUDA really orders the copies and the step as the calls ask — the ``gpu`` tests of
``tests/integration/test_fastpath.py`` check on a GPU.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
import torch.utils.data

import fastload
from fastload._device._copy_ahead import DevicePrefetcher, PrefetchIterator
from fastload._device._cuda import CudaOps
from fastload._device._ops import DeviceOps, map_tensors


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


class FakeEvent:
    """Completes when the test says so (``FakeOps.complete``) or its stream is synchronized."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.stream: FakeStream | None = None
        self.done_at_ms: float | None = None

    def __repr__(self) -> str:
        return self.name


class FakeOps:
    """``DeviceOps`` on the CPU. Events recorded on the side stream are named after the batch
    copied last (``copied 3``), those on the consumer's stream ``step N``."""

    def __init__(
        self, log: list[str], fail_copy: frozenset[int] = frozenset(), *, complete_on_record: bool = False
    ) -> None:
        self.log = log
        self.fail_copy = fail_copy  # batches whose copy raises (after queueing the first tensor)
        self.complete_on_record = complete_on_record  # a device that is never behind
        self.now_ms = 0.0  # the time at which completed events complete
        self.events: list[FakeEvent] = []
        self.copied: dict[int, FakeEvent] = {}  # batch -> the event after its copy
        self._last_copy = -1
        self._steps = 0

    def new_stream(self) -> FakeStream:
        self.log.append("new side stream")
        return FakeStream("side")

    def current_stream(self) -> FakeStream:
        return FakeStream("consumer")

    def timed_event(self) -> FakeEvent:
        event = FakeEvent("event")
        self.events.append(event)
        return event

    def record(self, event: FakeEvent, stream: FakeStream) -> None:
        event.stream = stream
        if stream.name == "side":
            event.name = f"copied {self._last_copy}"
            self.copied[self._last_copy] = event
        else:
            self._steps += 1
            event.name = f"step {self._steps}"
        self.log.append(f"record {event} on {stream}")
        if self.complete_on_record:
            event.done_at_ms = self.now_ms

    def query(self, event: FakeEvent) -> bool:
        return event.done_at_ms is not None

    def wait(self, stream: FakeStream, event: FakeEvent) -> None:
        self.log.append(f"{stream} waits for {event}")

    def synchronize(self, stream: FakeStream) -> None:
        self.log.append(f"synchronize {stream}")
        for event in self.events:
            if event.stream is stream and event.done_at_ms is None:
                event.done_at_ms = self.now_ms

    def elapsed_s(self, start: FakeEvent, end: FakeEvent) -> float:
        # As CUDA, which raises cudaErrorNotReady: reading an event before it completes would
        # mean the prefetcher waits (or reads garbage) to measure.
        assert start.done_at_ms is not None and end.done_at_ms is not None, (start, end)
        return (end.done_at_ms - start.done_at_ms) / 1e3

    def to_device(self, data: Any, copy_on: FakeStream, used_on: FakeStream) -> Any:
        assert (copy_on.name, used_on.name) == ("side", "consumer")
        self._last_copy = label = _label(data)
        self.log.append(f"copy {label}")
        copies = iter(range(10**9))

        def copy(tensor: torch.Tensor) -> torch.Tensor:
            if label in self.fail_copy and next(copies) == 1:
                raise RuntimeError(f"copy of batch {label} failed")
            return tensor.clone()

        return map_tensors(data, copy)

    def run_on(self, fn: Any, data: Any, stream: FakeStream, used_on: FakeStream) -> Any:
        assert (stream.name, used_on.name) == ("side", "consumer")
        self.log.append(f"finish {_label(data)} on {stream}")
        return fn(data)

    def complete(self, *events: FakeEvent, at_ms: float | None = None) -> None:
        for event in events:
            event.done_at_ms = self.now_ms if at_ms is None else at_ms


def _label(data: Any) -> int:
    """The batch's first sample (the loader's items are ``(batch, counts)`` pairs)."""
    while isinstance(data, tuple):
        data = data[0]
    first = data["x"] if "x" in data else next(iter(data.values()))
    return int(first.flatten()[0])


class Batches:
    """Host batches 0..n-1 (``{"x": [i, i], "y": [i]}``), raising ValueError instead of the
    batches in ``bad`` and going on after them, logging each take in the shared log."""

    def __init__(self, n: int, log: list[str], bad: frozenset[int] = frozenset()) -> None:
        self.n, self.log, self.bad, self.i = n, log, bad, 0
        self.handed: dict[int, weakref.ref[torch.Tensor]] = {}  # batch -> its host tensor

    def __iter__(self) -> Batches:
        return self

    def __len__(self) -> int:
        return self.n

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.i >= self.n:
            self.log.append("end")
            raise StopIteration
        i, self.i = self.i, self.i + 1
        self.log.append(f"take {i}")
        if i in self.bad:
            raise ValueError(f"batch {i} failed")
        batch = {"x": torch.full((2,), i), "y": torch.tensor([i])}
        self.handed[i] = weakref.ref(batch["x"])
        return batch

    def alive(self, i: int) -> bool:
        """Whether anything still holds batch ``i``'s host tensors."""
        return self.handed[i]() is not None


def _setup(
    n: int, bad: frozenset[int] = frozenset(), fail_copy: frozenset[int] = frozenset()
) -> tuple[Batches, FakeOps, Any]:
    log: list[str] = []
    source, ops = Batches(n, log, bad), FakeOps(log, fail_copy)
    return source, ops, iter(DevicePrefetcher(source, device="cuda", ops=ops))


def drain(it: Any) -> list[Any]:
    """Each batch's label, or the message of the error raised in its place, until StopIteration."""
    got: list[Any] = []
    while True:
        try:
            got.append(_label(next(it)))
        except StopIteration:
            return got
        except (ValueError, RuntimeError) as exc:
            got.append(str(exc))


def test_the_fake_and_cudas_ops_have_every_operation_of_the_protocol() -> None:
    operations = {name for name in vars(DeviceOps) if not name.startswith("_")}
    assert len(operations) == 10
    assert operations <= set(dir(FakeOps)) and operations <= set(dir(CudaOps))


# -- order ----------------------------------------------------------------------------------------
def test_the_next_batchs_copy_starts_before_a_batch_is_handed_out() -> None:
    _source, ops, it = _setup(3)
    batch = next(it)
    assert _label(batch) == 0 and isinstance(it, PrefetchIterator)
    assert ops.log == [
        "new side stream",
        "take 0", "copy 0", "record copied 0 on side",
        "take 1", "copy 1", "record copied 1 on side",  # batch 1 is in flight ...
        "consumer waits for copied 0",  # ... before batch 0 is handed out
    ]
    del ops.log[:]
    assert _label(next(it)) == 1
    assert ops.log == [
        "take 2", "copy 2", "record copied 2 on side",
        "record step 1 on consumer",  # the step on batch 0, for the idle time
        "consumer waits for copied 1",
    ]


def test_the_consumer_waits_for_each_batchs_own_copy_before_it_gets_the_batch() -> None:
    _source, ops, it = _setup(4)
    for i in range(4):
        next(it)
        assert ops.log[-1] == f"consumer waits for copied {i}"


def test_batches_are_the_copies_with_their_containers_and_values() -> None:
    source, _ops, it = _setup(2)
    batch = next(it)
    assert set(batch) == {"x", "y"} and batch["x"].tolist() == [0, 0] and batch["y"].tolist() == [0]
    assert source.handed[0]() is not batch["x"]  # a copy, not the host tensor


# -- lifetimes of the host batches ----------------------------------------------------------------
@pytest.mark.usefixtures("refcounts_only")
def test_a_host_batch_lives_until_its_copy_event_completes_and_is_dropped_after() -> None:
    source, ops, it = _setup(5)
    batches = [next(it), next(it), next(it)]  # copies of 0..3 started, none completed
    assert all(source.alive(i) for i in range(4))  # the DMA may still read every one of them
    ops.complete(ops.copied[1])  # out of order: batch 0's copy still runs
    next(it)
    assert all(source.alive(i) for i in range(5))  # dropped in copy order, never ahead of it
    ops.complete(ops.copied[0])
    assert source.alive(0)  # nothing looks before the next next()
    next(it)
    assert not source.alive(0) and not source.alive(1)
    assert all(source.alive(i) for i in (2, 3, 4))
    del batches


@pytest.mark.usefixtures("refcounts_only")
def test_the_end_of_the_epoch_synchronizes_both_streams_and_drops_every_host_batch() -> None:
    source, ops, it = _setup(3)
    assert drain(it) == [0, 1, 2]
    assert "synchronize" not in " ".join(ops.log[:-2])
    assert ops.log[-2:] == ["synchronize side", "synchronize consumer"]
    assert not any(source.alive(i) for i in range(3))


@pytest.mark.usefixtures("refcounts_only")
def test_close_mid_epoch_waits_for_the_copies_and_drops_the_host_batches() -> None:
    source, ops, it = _setup(5)
    next(it)
    it.close()
    assert ops.log[-2:] == ["synchronize side", "synchronize consumer"]
    assert not source.alive(0) and not source.alive(1)
    with pytest.raises(StopIteration):
        next(it)
    it.close()  # idempotent
    assert ops.log.count("synchronize side") == 1 and source.i == 2


# -- the GPU's idle time --------------------------------------------------------------------------
def test_gpu_idle_adds_up_only_from_completed_events_and_never_synchronizes() -> None:
    _source, ops, it = _setup(4)
    next(it), next(it)  # step 1 (on batch 0) done <-> batch 1 copied: both still running
    assert it.gpu_idle_s == 0.0
    ops.complete(ops.events[-1], at_ms=4.0)  # step 1
    next(it)  # batch 1's copy still runs: step 1 cannot be read yet
    assert it.gpu_idle_s == 0.0
    ops.complete(ops.copied[1], at_ms=10.0)  # the GPU sat 6 ms between step 1 and batch 1
    ops.complete(ops.copied[2], at_ms=11.0)
    next(it)
    assert it.gpu_idle_s == pytest.approx(0.006)
    assert not any(line.startswith("synchronize") for line in ops.log)


def test_a_copy_done_before_the_step_adds_no_idle_time() -> None:
    _source, ops, it = _setup(3)
    next(it)
    ops.complete(ops.copied[1], at_ms=1.0)
    next(it)
    ops.complete(ops.events[-1], at_ms=5.0)  # step 1 ended after batch 1 was there
    next(it)
    assert it.gpu_idle_s == 0.0


def test_the_end_of_the_epoch_counts_the_idle_times_still_running() -> None:
    _source, ops, it = _setup(2)
    next(it)
    ops.complete(ops.copied[1], at_ms=3.0)
    next(it)  # step 1 still running
    ops.now_ms = 1.0
    with pytest.raises(StopIteration):
        next(it)  # synchronize: step 1 completes at 1 ms, 2 ms before batch 1's copy
    assert it.gpu_idle_s == pytest.approx(0.002)


def test_the_prefetchers_idle_time_sums_its_epochs() -> None:
    log: list[str] = []

    class Epochs:
        def __iter__(self) -> Batches:
            return Batches(2, log)

    ops = FakeOps(log)
    prefetcher = DevicePrefetcher(Epochs(), device=None, ops=ops)
    for epoch in range(2):
        it = iter(prefetcher)
        next(it)
        ops.complete(ops.copied[1], at_ms=7.0)
        next(it)
        ops.complete(ops.events[-1], at_ms=2.0)  # step 1: the GPU then waited 5 ms
        assert list(it) == []
        assert prefetcher.gpu_idle_s == pytest.approx(0.005 * (epoch + 1))


# -- errors keep their place ----------------------------------------------------------------------
@pytest.mark.usefixtures("refcounts_only")
@pytest.mark.parametrize("bad", [{0}, {2}, {4}, {1, 2}, {0, 1, 2, 3, 4}])
def test_a_batch_that_fails_when_taken_raises_in_its_turn_and_the_epoch_goes_on(bad: set[int]) -> None:
    source, ops, it = _setup(5, bad=frozenset(bad))
    assert drain(it) == [f"batch {i} failed" if i in bad else i for i in range(5)]
    assert ops.log[-2:] == ["synchronize side", "synchronize consumer"]  # the epoch ended cleanly
    assert not any(source.alive(i) for i in range(5) if i not in bad)


def test_the_error_is_raised_by_the_next_call_after_the_batch_before_it() -> None:
    source, _ops, it = _setup(4, bad=frozenset({2}))
    assert _label(next(it)) == 0
    assert _label(next(it)) == 1  # batch 2 has already failed, staged behind batch 1
    assert source.i == 3
    with pytest.raises(ValueError, match="batch 2 failed"):
        next(it)
    assert source.i == 3  # nothing taken ahead while raising
    assert _label(next(it)) == 3


@pytest.mark.usefixtures("refcounts_only")
def test_a_copy_that_fails_is_that_batchs_error_and_keeps_its_host_batch_until_its_event() -> None:
    source, ops, it = _setup(4, fail_copy=frozenset({1}))
    assert _label(next(it)) == 0
    with pytest.raises(RuntimeError, match="copy of batch 1 failed"):
        next(it)
    assert source.alive(1)  # its first tensor's copy was queued: the DMA may still read it
    assert "record copied 1 on side" in ops.log
    ops.complete(*ops.copied.values())
    assert _label(next(it)) == 2
    assert not source.alive(1)
    assert drain(it) == [3]


def test_a_keyboard_interrupt_propagates_at_once_and_loses_no_batch() -> None:
    log: list[str] = []

    class Interrupted(Batches):
        def __next__(self) -> dict[str, torch.Tensor]:
            if self.i == 1 and not hasattr(self, "interrupted"):
                self.interrupted = True
                raise KeyboardInterrupt
            return super().__next__()

    it = iter(DevicePrefetcher(Interrupted(3, log), device=None, ops=FakeOps(log)))
    with pytest.raises(KeyboardInterrupt):
        next(it)  # batch 0 was staged when taking batch 1 was interrupted
    assert drain(it) == [0, 1, 2]


# -- the epoch's ends, len(), the CPU path --------------------------------------------------------
def test_stop_iteration_ends_the_epoch_once_and_takes_nothing_after() -> None:
    _source, ops, it = _setup(2)
    assert drain(it) == [0, 1]
    with pytest.raises(StopIteration):
        next(it)
    assert ops.log.count("end") == 1 and ops.log.count("synchronize side") == 1


def test_an_empty_epoch_ends_at_once_and_still_synchronizes() -> None:
    _source, ops, it = _setup(0)
    assert drain(it) == []
    assert ops.log == ["new side stream", "end", "synchronize side", "synchronize consumer"]


def test_len_is_the_number_of_host_batches() -> None:
    log: list[str] = []
    assert len(DevicePrefetcher(Batches(7, log), device=None, ops=FakeOps(log))) == 7
    assert len(DevicePrefetcher(Batches(7, log), device="cpu")) == 7


@pytest.mark.parametrize("device", [None, "cpu", torch.device("cpu")])
def test_without_a_cuda_device_batches_and_errors_pass_through_unchanged(device: Any) -> None:
    source = Batches(4, [], bad=frozenset({2}))
    it = iter(DevicePrefetcher(source, device=device))
    first = next(it)
    assert first["x"] is source.handed[0]()  # the host batch itself: no copy, no stream
    assert drain(it) == [1, "batch 2 failed", 3]
    assert DevicePrefetcher(source, device=device).gpu_idle_s == 0.0


# -- through the loader ---------------------------------------------------------------------------
class Numbers(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Sample ``i`` is ``{"x": [i, i], "y": i}``; sample ``bad`` raises ValueError."""

    def __init__(self, n: int, bad: int | None) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if i == self.bad:
            raise ValueError(f"sample {i} is corrupt")
        return {"x": torch.tensor([i, i]), "y": torch.tensor(i)}


class FakeCuda:
    """``device="cuda"`` accepted on a machine without CUDA, with a :class:`FakeOps` (whose
    events complete as they are recorded) in place of ``torch.cuda``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.fail_copy: frozenset[int] = frozenset()
        self.made: list[FakeOps] = []
        for where in ("fastload._loader._options.cuda_device", "fastload._device._copy_ahead.cuda_device"):
            monkeypatch.setattr(where, self._cuda_device)
        monkeypatch.setattr("fastload._device._copy_ahead.CudaOps", self._ops)

    @staticmethod
    def _cuda_device(device: Any) -> torch.device | None:
        return torch.device("cuda") if device is not None and torch.device(device).type == "cuda" else None

    def _ops(self, device: torch.device) -> FakeOps:
        self.made.append(FakeOps([], self.fail_copy, complete_on_record=True))
        return self.made[-1]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize(("bad", "fail_copy"), [(5, None), (0, None), (17, None), (None, 4)])
def test_through_the_loader_a_failed_batch_raises_in_its_turn_and_is_not_counted(
    monkeypatch: pytest.MonkeyPatch, workers: int, bad: int | None, fail_copy: int | None
) -> None:
    # 18 samples in batches of 4: the last batch holds 2, so rows counted against the wrong
    # batch would change the total.
    fake = FakeCuda(monkeypatch)
    fake.fail_copy = frozenset() if fail_copy is None else frozenset({fail_copy})
    loader = fastload.DataLoader(Numbers(18, bad), batch_size=4, num_workers=workers, device="cuda")
    it = iter(loader)
    got = drain(it)
    failed = (bad if bad is not None else fail_copy or 0) // 4
    assert got[:failed] + got[failed + 1 :] == [4 * i for i in range(5) if i != failed]
    error = f"sample {bad} is corrupt" if bad is not None else f"copy of batch {fail_copy} failed"
    assert error in got[failed]
    rows = [4, 4, 4, 4, 2]
    stats = it.stats()
    assert (stats.batches, stats.samples) == (4, 18 - rows[failed])
    assert stats.gpu_idle_s == 0.0 and len(fake.made) == 1
    assert fake.made[0].log[-2:] == ["synchronize side", "synchronize consumer"]


def test_the_slots_are_released_only_after_the_last_copy_from_them_has_finished(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    # The fast path's slots are page-locked: freeing them (cudaHostUnregister) while the side
    # stream still copies the epoch's last batch out of one would pull the memory from under
    # the DMA. The epoch's end synchronizes both streams first, then the workers stop and the
    # slots go.
    import sys
    from pathlib import Path

    from fastload._engine._arena import SlotArena

    sys.path.insert(0, str(Path(__file__).parents[3] / "integration"))
    from _token_files import write_token_file

    fake = FakeCuda(monkeypatch)
    close = SlotArena.close

    def logged_close(arena: SlotArena) -> None:
        if fake.made:
            fake.made[-1].log.append("slots released")
        close(arena)

    monkeypatch.setattr(SlotArena, "close", logged_close)
    ds = fastload.HDF5Dataset(write_token_file(tmp_path / "t.h5", 64, 40))
    loader = fastload.DataLoader(ds, batch_size=8, num_workers=2, device="cuda")
    assert sum(len(b["lengths"]) for b in loader) == 64  # the epoch's end
    it = iter(loader)
    next(it)
    del it  # leaving an epoch early
    gc.collect()
    for log in (fake.made[0].log, fake.made[1].log):
        assert log.index("synchronize side") < log.index("slots released")


# -- a finishing step: packed labels built where the batch lands ---------------------------------
@pytest.mark.parametrize("workers", [0, 2])
def test_packed_labels_are_built_after_the_copy_and_equal_the_host_built_ones(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, workers: int
) -> None:
    # device="cuda" makes the loader's own PackCollate leave labels out of the slots and build
    # them from the copied ids on the side stream (here FakeOps: the CPU), after each copy.
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[3] / "integration"))
    from _token_files import write_token_file

    path = write_token_file(tmp_path / "t.h5", 120, 90)
    host = [
        {k: v.clone() for k, v in b.items()}
        for b in fastload.DataLoader(fastload.HDF5Dataset(path), pack_length=32, batch_size=4, num_workers=workers)
    ]
    fake = FakeCuda(monkeypatch)
    loader = fastload.DataLoader(fastload.HDF5Dataset(path), pack_length=32, batch_size=4, num_workers=workers, device="cuda")
    assert loader.collate_fn.device_labels  # type: ignore[attr-defined]
    got = list(loader)
    assert len(got) == len(host) > 3
    for mine, theirs in zip(got, host, strict=True):
        assert list(mine) == list(theirs)  # the same keys, in the same order: no row_tokens
        for name, tensor in theirs.items():
            assert mine[name].dtype == tensor.dtype and torch.equal(mine[name], tensor), name
    log = fake.made[0].log
    copies = [i for i, line in enumerate(log) if line.startswith("copy ")]
    finishes = [i for i, line in enumerate(log) if line.startswith("finish ")]
    assert len(finishes) == len(copies) == len(host)
    assert all(c + 1 == f for c, f in zip(copies, finishes, strict=True))  # each right after its copy
