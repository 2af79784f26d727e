"""StallMeter arithmetic on a ManualClock: no test depends on how fast the machine is."""

from __future__ import annotations

import math

import pytest

from fastload._metrics import ENGINE_FIELDS, LoaderStats, ManualClock, StallMeter
from fastload._types import StorageCounts


def feed(
    meter: StallMeter,
    clock: ManualClock,
    waits: list[float],
    step_s: float,
    *,
    rows: int = 4,
    real: int | None = 30,
    padded: int | None = 40,
) -> None:
    """One batch per wait: wait inside next(), then a step of ``step_s``; then the final next()
    that ends the epoch (which closes the last step)."""
    for wait in waits:
        meter.begin_wait()
        clock.advance(wait)
        meter.end_wait(rows, real, padded)
        clock.advance(step_s)
    meter.begin_wait()


def test_stall_fraction_is_steady_wait_over_wait_plus_step_and_excludes_the_first_batch() -> None:
    clock = ManualClock()
    meter = StallMeter(clock)
    feed(meter, clock, [5.0, 0.1, 0.3], step_s=0.6)  # first wait (5 s) is start-up
    stats = meter.snapshot()
    assert stats.first_batch_s == 5.0
    assert stats.wait_s == pytest.approx(0.4)
    assert stats.step_s == pytest.approx(1.8)  # three steps, the last closed by the final next()
    assert stats.stall_fraction == pytest.approx(0.4 / 2.2)
    assert (stats.batches, stats.steady_batches, stats.samples) == (3, 2, 12)


def test_throughput_counts_the_batches_whose_step_was_timed_over_steady_time() -> None:
    clock = ManualClock()
    meter = StallMeter(clock)
    feed(meter, clock, [1.0, 0.25, 0.25, 0.25], step_s=0.75, rows=8, real=60, padded=80)
    stats = meter.snapshot()
    elapsed = 3 * 0.25 + 4 * 0.75
    assert stats.samples_per_s == pytest.approx(4 * 8 / elapsed)
    assert stats.batches_per_s == pytest.approx(4 / elapsed)
    assert stats.padded_tokens_per_s == pytest.approx(4 * 80 / elapsed)
    assert stats.padding_efficiency == pytest.approx(0.75)


def test_wait_quantiles_are_nearest_rank_within_the_histogram_bound() -> None:
    clock = ManualClock()
    meter = StallMeter(clock)
    waits_ms = [1.0] * 98 + [50.0, 200.0]
    feed(meter, clock, [10.0] + [w / 1e3 for w in waits_ms], step_s=0.01)
    stats = meter.snapshot()
    assert stats.p50_wait_ms == pytest.approx(1.0, rel=0.025)
    assert stats.p99_wait_ms == pytest.approx(50.0, rel=0.025)


def test_tokens_are_unknown_once_any_batch_lacks_them() -> None:
    clock = ManualClock()
    meter = StallMeter(clock)
    meter.begin_wait()
    meter.end_wait(4, 30, 40)
    meter.begin_wait()
    meter.end_wait(4)
    stats = meter.snapshot()
    assert stats.padding_efficiency is None
    assert stats.padded_tokens_per_s is None


def test_each_epoch_has_its_own_start_up_and_totals_while_the_run_accumulates() -> None:
    clock = ManualClock()
    meter = StallMeter(clock)
    feed(meter, clock, [3.0, 0.5], step_s=0.5)
    first = meter.end_epoch()
    feed(meter, clock, [0.2, 0.1, 0.1], step_s=0.1)
    second = meter.end_epoch()
    run = meter.snapshot()
    assert (first.epoch, second.epoch, meter.epoch) == (0, 1, 2)
    assert first.first_batch_s == 3.0
    assert second.first_batch_s == pytest.approx(0.2)
    assert first.stall_fraction == pytest.approx(0.5 / 1.5)
    assert second.stall_fraction == pytest.approx(0.2 / 0.5)
    assert run.first_batch_s == 3.0  # the run's start-up is its first epoch's
    assert (meter.wait_s, meter.step_s) == (run.wait_s, run.step_s)
    assert run.wait_s == pytest.approx(0.7)  # neither epoch's first batch
    assert run.step_s == pytest.approx(1.3)
    assert (run.batches, run.steady_batches) == (5, 3)


def test_a_step_left_open_at_the_end_of_an_epoch_is_not_counted() -> None:
    clock = ManualClock()
    meter = StallMeter(clock)
    meter.begin_wait()
    meter.end_wait(2)
    clock.advance(100.0)  # the loop broke out: when the step ended is unknown
    summary = meter.end_epoch()
    assert summary.step_s == 0.0


def test_a_wait_that_delivered_no_batch_is_dropped() -> None:
    clock = ManualClock()
    meter = StallMeter(clock)
    feed(meter, clock, [1.0, 0.1], step_s=1.0)  # ends with an open wait (the final next())
    clock.advance(7.0)  # next() raised after 7 s: no batch
    meter.begin_wait()  # the consumer tries again
    clock.advance(0.1)
    meter.end_wait(4)
    stats = meter.snapshot()
    assert stats.wait_s == pytest.approx(0.2)


def test_snapshot_merges_engine_fields_and_diagnoses() -> None:
    clock = ManualClock()
    meter = StallMeter(clock)
    feed(meter, clock, [1.0] + [0.5] * 20, step_s=0.1)
    stats = meter.snapshot(num_workers=2, worker_busy=[0.99, 0.97], queue_depth=0, epoch=7)
    assert stats.worker_busy == (0.99, 0.97)
    assert stats.epoch == 7
    assert stats.diagnosis == "loader-bound: workers busy 98 %, add workers"
    with pytest.raises(TypeError, match="unknown engine fields \\['wait_s'\\]"):
        meter.snapshot(wait_s=0.0)
    assert "wait_s" not in ENGINE_FIELDS


def test_epoch_scope_covers_only_the_current_epoch() -> None:
    clock = ManualClock()
    meter = StallMeter(clock)
    feed(meter, clock, [1.0, 0.5], step_s=0.5)
    meter.end_epoch()
    feed(meter, clock, [1.0, 0.0], step_s=0.5)
    assert meter.snapshot(scope="epoch").stall_fraction == 0.0
    assert meter.snapshot(scope="run").stall_fraction == pytest.approx(0.5 / 2.5)
    with pytest.raises(ValueError, match="scope must be 'run' or 'epoch'; got 'all'"):
        meter.snapshot(scope="all")


def test_end_wait_without_begin_wait_is_an_error() -> None:
    meter = StallMeter(ManualClock())
    with pytest.raises(RuntimeError, match="without a matching begin_wait"):
        meter.end_wait(1)


def test_an_empty_meter_reports_zeros_and_unknowns() -> None:
    stats = StallMeter(ManualClock()).snapshot()
    assert stats.stall_fraction == 0.0 and stats.samples_per_s == 0.0
    assert stats.p99_wait_ms is None and stats.first_batch_s is None
    assert stats.diagnosis.startswith("not enough data yet: 0 steady batches")


def test_stats_serialize_and_summarize_in_one_line() -> None:
    stats = LoaderStats(
        batches=11,
        steady_batches=10,
        samples_per_s=1234.0,
        stall_fraction=0.125,
        p99_wait_ms=3.25,
        first_batch_s=0.5,
        padding_efficiency=0.9,
        num_workers=2,
        worker_busy=(0.5, 0.7),
    ).with_diagnosis()
    data = stats.as_dict()
    assert data["worker_busy"] == [0.5, 0.7]
    assert set(data) == {f for f in LoaderStats.__dataclass_fields__}
    text = str(stats)
    assert "\n" not in text
    assert "1,234 samples/s" in text and "stall 12.5 %" in text and "2 workers busy 60 %" in text
    assert text.endswith(stats.diagnosis)


def test_manual_clock_never_goes_backwards() -> None:
    clock = ManualClock(10.0)
    clock.advance(0.5)
    assert clock() == 10.5
    with pytest.raises(ValueError, match=r"seconds must be >= 0; got -1\.0"):
        clock.advance(-1.0)
    with pytest.raises(ValueError, match="earlier than the current time"):
        clock.set(1.0)
    with pytest.raises(ValueError, match="finite"):
        clock.advance(math.inf)


def test_long_runs_fold_the_logged_waits_into_the_same_totals() -> None:
    # begin_wait/end_wait only log timestamps and fold every few hundred batches; totals read
    # part-way (snapshot, wait_s) and at the end must equal the exact sums.
    clock = ManualClock()
    meter = StallMeter(clock)
    waits = [0.5] + [0.001 * (1 + k % 7) for k in range(1999)]
    for k, wait in enumerate(waits):
        meter.begin_wait()
        clock.advance(wait)
        meter.end_wait(2, 3, 4)
        clock.advance(0.01)
        if k == 700:
            mid = meter.snapshot()
            assert mid.batches == 701 and mid.wait_s == pytest.approx(sum(waits[1:701]))
            assert meter.step_s == pytest.approx(700 * 0.01)
    meter.begin_wait()
    stats = meter.snapshot()
    assert (stats.batches, stats.steady_batches, stats.samples) == (2000, 1999, 4000)
    assert stats.wait_s == pytest.approx(sum(waits[1:]))
    assert stats.step_s == pytest.approx(2000 * 0.01)
    assert stats.padding_efficiency == pytest.approx(0.75)
    assert stats.first_batch_s == 0.5
    assert meter.end_epoch().batches == 2000


def _folded_one_by_one(meter: StallMeter) -> StallMeter:
    """``meter`` with its log folded entry by entry, through the general methods alone."""
    log, meter._log = meter._log, []
    for entry in log:
        if isinstance(entry, tuple):
            meter._apply_end(*entry)
        else:
            meter._apply_begin(entry)
    return meter


@pytest.mark.parametrize("seed", range(40))
def test_the_steady_fold_gives_the_same_stats_as_folding_entry_by_entry(seed: int) -> None:
    # Epochs of batches with and without token counts, loops that break out, next() calls that
    # raise, float and int timestamps, folds at arbitrary points: the one-loop fold of steady
    # batches must agree to the last bit with the per-entry methods.
    import random

    rng = random.Random(seed)
    clocks = [ManualClock(), ManualClock()]
    meters = [StallMeter(clocks[0]), StallMeter(clocks[1])]
    for _ in range(rng.randrange(1, 400)):
        action = rng.random()
        wait, step = rng.expovariate(1e3), rng.expovariate(1e2)
        if rng.random() < 0.05:
            wait = float(rng.randrange(3))  # exact values, on and below bucket edges
        counts = (rng.randrange(1, 9), 30, 40) if rng.random() < 0.9 else (3, None, None)
        for meter, clock in zip(meters, clocks, strict=True):
            if action < 0.9:
                meter.begin_wait()
                clock.advance(wait)
                meter.end_wait(*counts)
                clock.advance(step)
            elif action < 0.95:
                meter.begin_wait()  # a next() that raised: its wait is dropped
                clock.advance(wait)
            else:
                meter.end_epoch()
        if rng.random() < 0.02:
            meters[0]._fold()
            _folded_one_by_one(meters[1])
    meters[0]._fold()
    _folded_one_by_one(meters[1])
    fast, reference = (m.snapshot() for m in meters)
    assert fast == reference
    assert fast.batches > 0
    assert meters[0]._current.waits._counts.tolist() == meters[1]._current.waits._counts.tolist()
    assert meters[0]._earlier.waits._counts.tolist() == meters[1]._earlier.waits._counts.tolist()


def test_record_gives_the_same_stats_as_begin_and_end_wait_across_folds() -> None:
    # record() is what the loader's iterator calls with times it takes itself; 700 batches
    # cross the fold threshold, where the entry a fold made room for must still be counted.
    clocks = [ManualClock(), ManualClock()]
    meters = [StallMeter(clocks[0]), StallMeter(clocks[1])]
    for i in range(700):
        wait, step = 1e-4 * (1 + i % 7), 1e-3 * (1 + i % 3)
        meters[0].begin_wait()
        clocks[0].advance(wait)
        meters[0].end_wait(4, 30, 40)
        clocks[0].advance(step)
        begin = clocks[1]()
        clocks[1].advance(wait)
        entry = meters[1].record(begin, 4, 30, 40)
        entry[0] = clocks[1]()
        clocks[1].advance(step)
    assert meters[1].snapshot() == meters[0].snapshot()
    assert meters[1].snapshot().batches == 700


def test_a_recorded_batch_whose_next_has_not_returned_waits_for_its_end() -> None:
    # Between record() and the caller storing the end time, a snapshot (another thread asking
    # for stats) leaves the entry for the next fold rather than counting a batch without an end.
    clock = ManualClock()
    meter = StallMeter(clock)
    feed(meter, clock, [0.001] * 3, 0.01)
    entry = meter.record(clock(), 4, 30, 40)
    assert meter.snapshot(scope="epoch").batches == 3
    clock.advance(0.002)
    entry[0] = clock()
    assert meter.snapshot(scope="epoch").batches == 4
    assert meter.snapshot(scope="epoch").wait_s == pytest.approx(0.001 * 2 + 0.002)  # not the first


def test_storage_counts_sum_per_epoch_and_over_the_run() -> None:
    clock = ManualClock()
    meter = StallMeter(clock)
    assert meter.snapshot().downloaded_bytes is None  # a local dataset reports none
    feed(meter, clock, [1.0, 0.5, 0.5], step_s=1.0)
    meter.add_storage(StorageCounts(0.4, 1_000_000, 3, 1), prefetched_bytes=3_000_000, busy_s=0.8)
    first = meter.end_epoch()
    feed(meter, clock, [0.1, 0.1], step_s=1.0)
    meter.add_storage(StorageCounts(0.0, 0, 4, 0), prefetched_bytes=0, busy_s=0.2)
    second = meter.snapshot(scope="epoch")
    run = meter.snapshot()
    assert first.downloaded_bytes == 4_000_000
    # 4 MB over the epoch's 1 s first batch, 1 s of steady waits and 3 s of steps
    assert first.download_mb_per_s == pytest.approx(4_000_000 / 5.0 / 1e6)
    assert (first.cache_hits, first.cache_misses, first.storage_wait_s) == (3, 1, 0.4)
    assert first.storage_wait_share == pytest.approx(0.4 / 0.8)
    assert (second.downloaded_bytes, second.cache_hits, second.cache_misses) == (0, 4, 0)
    assert (run.downloaded_bytes, run.cache_hits, run.cache_misses) == (4_000_000, 7, 1)
    assert run.storage_wait_share == pytest.approx(0.4 / 1.0)


def test_without_workers_the_storage_wait_is_a_share_of_the_consumers_wait() -> None:
    clock = ManualClock()
    meter = StallMeter(clock)
    feed(meter, clock, [1.0, 0.5, 0.5], step_s=1.0)  # first batch 1 s, steady waits 1 s
    meter.add_storage(StorageCounts(1.5, 10, 0, 2), prefetched_bytes=0, busy_s=0.0)
    assert meter.snapshot().storage_wait_share == pytest.approx(1.5 / 2.0)


def test_the_first_batch_counts_from_the_start_of_the_epoch_when_given() -> None:
    clock = ManualClock()
    meter = StallMeter(clock)
    meter.start_epoch(clock())  # iter(): workers start, shards open
    clock.advance(4.5)
    feed(meter, clock, [0.4, 0.1], step_s=0.1)
    summary = meter.end_epoch()
    assert summary.first_batch_s == pytest.approx(4.9)
    assert summary.wait_s == pytest.approx(0.1)  # start-up stays out of the stall


def test_one_epoch_number_and_per_epoch_counts() -> None:
    clock = ManualClock()
    meter = StallMeter(clock)
    for epoch in (3, 4):
        meter.start_epoch(clock(), epoch)
        feed(meter, clock, [1.0, 0.5], step_s=0.5)
        summary = meter.end_epoch()
        run, last = meter.snapshot(), meter.snapshot(scope="epoch")
        assert summary.epoch == run.epoch == last.epoch == epoch
        assert last == summary and (last.scope, last.batches) == ("epoch", 2)
        assert (run.scope, run.epoch_batches, run.epochs) == ("run", 2, epoch - 2)
    assert run.batches == 4 and str(run).startswith("run (2 epochs, latest 4) | 4 batches in all (2 in epoch 4)")
    meter.start_epoch(clock())  # unnumbered: the next one
    assert meter.snapshot(scope="epoch").epoch == 5
