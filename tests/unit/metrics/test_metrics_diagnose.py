"""The one-line diagnosis, on fake loaders and consumers driven through a StallMeter with a
ManualClock: a slow loader and a fast consumer must be told apart, and why the loader is slow."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from fastload._metrics import LoaderStats, ManualClock, StallMeter, diagnose
from fastload._metrics._stats import MIN_BATCHES, STALL_OK
from fastload._types import StorageCounts


class FakeLoader:
    """Each ``next()`` blocks for ``produce_s`` of clock time (a loader that delivers one batch
    per ``produce_s`` no matter how fast it is asked); the first costs ``startup_s`` more."""

    def __init__(
        self, clock: ManualClock, produce_s: float, batches: int, startup_s: float = 1.0
    ) -> None:
        self.clock, self.produce_s, self.batches, self.startup_s = (
            clock,
            produce_s,
            batches,
            startup_s,
        )

    def __iter__(self) -> Iterator[int]:
        self.clock.advance(self.startup_s)
        for _ in range(self.batches):
            self.clock.advance(self.produce_s)
            yield 32


def train(loader: FakeLoader, step_s: float, clock: ManualClock) -> StallMeter:
    meter = StallMeter(clock)
    it = iter(loader)
    while True:
        meter.begin_wait()
        try:
            rows = next(it)
        except StopIteration:
            break
        meter.end_wait(rows)
        clock.advance(step_s)
    meter.end_epoch()
    return meter


def test_a_fast_consumer_on_a_slow_loader_is_loader_bound() -> None:
    clock = ManualClock()
    meter = train(FakeLoader(clock, produce_s=0.050, batches=50), step_s=0.005, clock=clock)
    stats = meter.snapshot(num_workers=2, worker_busy=(0.99, 0.97), worker_read_share=0.1)
    assert stats.stall_fraction == pytest.approx(50 / 55, rel=0.05)
    assert stats.diagnosis == "loader-bound: workers busy 98 %, add workers"


def test_a_slow_consumer_on_a_fast_loader_is_consumer_bound() -> None:
    clock = ManualClock()
    meter = train(FakeLoader(clock, produce_s=0.0001, batches=50), step_s=0.050, clock=clock)
    stats = meter.snapshot(num_workers=2, worker_busy=(0.1, 0.1))
    assert stats.stall_fraction < STALL_OK
    assert stats.diagnosis == "consumer-bound: the step is the bottleneck, the loader is fine"


def test_workers_that_spend_their_time_in_reads_make_a_stall_io_bound() -> None:
    clock = ManualClock()
    meter = train(FakeLoader(clock, produce_s=0.050, batches=50), step_s=0.005, clock=clock)
    stats = meter.snapshot(num_workers=4, worker_busy=(1.0,) * 4, worker_read_share=0.8)
    assert stats.diagnosis.startswith("IO-bound: workers mostly waiting on reads (80 %")


def test_reads_waiting_on_downloads_make_a_stall_storage_bound() -> None:
    clock = ManualClock()
    meter = train(FakeLoader(clock, produce_s=0.050, batches=50), step_s=0.005, clock=clock)
    meter.add_storage(StorageCounts(3.0, 50_000_000, 10, 20), prefetched_bytes=0, busy_s=4.0)
    stats = meter.snapshot(num_workers=2, worker_busy=(1.0, 1.0), worker_read_share=0.9)
    assert stats.diagnosis.startswith("storage-bound: reads waited on shard downloads 75 %")
    assert "20 cache misses" in stats.diagnosis and "download_concurrency" in stats.diagnosis
    # The same loader whose reads seldom wait on the store: the reads themselves are slow.
    quick = train(FakeLoader(clock, produce_s=0.050, batches=50), step_s=0.005, clock=clock)
    quick.add_storage(StorageCounts(0.2, 50_000_000, 28, 2), prefetched_bytes=0, busy_s=4.0)
    stats = quick.snapshot(num_workers=2, worker_busy=(1.0, 1.0), worker_read_share=0.9)
    assert stats.diagnosis.startswith("IO-bound")


def test_idle_workers_while_the_consumer_waits_are_delivery_bound() -> None:
    clock = ManualClock()
    meter = train(FakeLoader(clock, produce_s=0.050, batches=50), step_s=0.005, clock=clock)
    stats = meter.snapshot(num_workers=4, worker_busy=(0.3,) * 4, worker_read_share=0.9)
    assert stats.diagnosis.startswith("delivery-bound: workers idle 70 % of the time")


def test_loading_in_the_training_process_says_so() -> None:
    clock = ManualClock()
    meter = train(FakeLoader(clock, produce_s=0.050, batches=50), step_s=0.005, clock=clock)
    assert meter.snapshot(num_workers=0).diagnosis.startswith(
        "loader-bound: loading runs in the training process (num_workers=0)"
    )


def test_a_stall_without_worker_figures_is_judged_from_the_stall_alone() -> None:
    stats = LoaderStats(steady_batches=MIN_BATCHES, stall_fraction=0.25, num_workers=3)
    assert diagnose(stats) == "loader-bound: the step waits 25 % of the time, add workers"


def test_too_few_batches_give_a_neutral_line() -> None:
    clock = ManualClock()
    meter = train(
        FakeLoader(clock, produce_s=0.050, batches=MIN_BATCHES), step_s=0.005, clock=clock
    )
    stats = meter.snapshot(num_workers=2, worker_busy=(1.0, 1.0))
    assert stats.steady_batches == MIN_BATCHES - 1
    assert stats.diagnosis == (
        f"not enough data yet: {MIN_BATCHES - 1} steady batches measured, {MIN_BATCHES} needed"
    )


def test_start_up_alone_never_counts_as_a_stall() -> None:
    clock = ManualClock()
    loader = FakeLoader(clock, produce_s=0.0, batches=30, startup_s=60.0)
    stats = train(loader, step_s=0.010, clock=clock).snapshot(num_workers=2)
    assert stats.first_batch_s == 60.0
    assert stats.stall_fraction == 0.0
    assert stats.diagnosis.startswith("consumer-bound")


@pytest.mark.parametrize("fast_path", [True, False, None])
def test_delivery_advice_fits_the_path_the_loader_is_on(fast_path: bool | None) -> None:
    stats = LoaderStats(
        steady_batches=MIN_BATCHES, stall_fraction=0.25, num_workers=4, worker_busy=(0.3,) * 4,
        fast_path=fast_path,
    )
    line = diagnose(stats)
    assert line.startswith("delivery-bound")
    if fast_path:
        assert "use the fast path" not in line and "already on the fast path" in line
        assert "raise prefetch_factor" in line
    elif fast_path is False:
        assert "use the fast path (a dataset with read_batch and lengths, and PadCollate)" in line
    else:
        assert "if it is not on it" in line


@pytest.mark.parametrize("fast_path", [True, False, None])
def test_loader_bound_advice_fits_the_path_the_loader_is_on(fast_path: bool | None) -> None:
    stats = LoaderStats(
        steady_batches=MIN_BATCHES, stall_fraction=0.25, num_workers=2, worker_busy=(0.95, 0.95),
        fast_path=fast_path,
    )
    line = diagnose(stats)
    assert line.startswith("loader-bound: workers busy 95 %, add workers")
    assert ("fast path" in line) == (fast_path is False)
    in_process = diagnose(dataclasses.replace(stats, num_workers=0, worker_busy=()))
    assert ("fast path" in in_process) == (fast_path is False)


@pytest.mark.parametrize("fast_path", [True, False, None])
def test_every_other_branch_advises_the_fast_path_only_off_it(fast_path: bool | None) -> None:
    base = LoaderStats(steady_batches=MIN_BATCHES, stall_fraction=0.25, num_workers=2, fast_path=fast_path)
    unknown_busy = diagnose(base)
    assert unknown_busy.startswith("loader-bound: the step waits 25 %")
    assert ("fast path" in unknown_busy) == (fast_path is False)
    io_bound = diagnose(dataclasses.replace(base, worker_busy=(0.9, 0.9), worker_read_share=0.8))
    storage_bound = diagnose(dataclasses.replace(base, storage_wait_share=0.9, cache_misses=3))
    assert io_bound.startswith("IO-bound") and storage_bound.startswith("storage-bound")
    assert "fast path" not in io_bound + storage_bound
    fine = diagnose(dataclasses.replace(base, stall_fraction=0.0))
    assert fine.startswith("consumer-bound") and "fast path" not in fine
