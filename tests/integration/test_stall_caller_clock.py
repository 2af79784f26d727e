"""``stats()`` answers "is my GPU waiting?" with the time the caller spends in ``next()``, all of
it: the meter agrees with a timer around each ``next()`` call, in every mode the iterator runs
in. (The stall of a real training loop is measured from the caller's side in
``benchmarks/bench_engine.py``; this checks that the meter does not under-report it.)"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import fastload

sys.path.insert(0, str(Path(__file__).parent))
from _fault_datasets import Slow
from _token_files import write_token_file

TOLERANCE = 0.10  # of the caller's wait per batch ...
FLOOR_S = 20e-6  # ... or this much per batch, whichever is larger


@pytest.fixture(scope="module")
def h5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_token_file(tmp_path_factory.mktemp("stall") / "tokens.h5", 20_000, 256)


def _run_queue_s() -> float:
    """Seconds this thread has spent runnable but not running (preempted), from the kernel's
    schedstat; 0 where the kernel does not say."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def _caller_waits(loader: Any, batches: int, step_s: float) -> tuple[list[float], Any, float]:
    """Seconds the caller spent in each ``next()`` call of the steady batches (all but the
    first, which the meter reports as start-up), the epoch's stats taken before the epoch
    ends, and the seconds the caller was preempted during those calls."""
    it = iter(loader)
    waits = []
    preempted = 0.0
    for i in range(batches):
        queued = _run_queue_s()
        started = time.perf_counter()
        batch = next(it)
        if i:
            waits.append(time.perf_counter() - started)
            preempted += _run_queue_s() - queued
        del batch
        if step_s:
            time.sleep(step_s)
    stats = loader.stats("epoch")
    del it
    return waits, stats, preempted


def _loader(mode: str, h5: Path) -> tuple[Any, int, float]:
    if mode == "generic":
        return fastload.DataLoader(Slow(4000), batch_size=8, num_workers=2), 80, 0.005
    ds = fastload.HDF5Dataset(h5)
    common: dict[str, Any] = {"batch_size": 32, "length_grouped": True}
    if mode == "inline":
        return fastload.DataLoader(ds, num_workers=2, **common), 400, 0.0
    if mode == "threaded":
        return fastload.DataLoader(ds, num_workers=2, **common), 60, 0.010
    if mode == "in-process":
        return fastload.DataLoader(ds, num_workers=0, **common), 60, 0.010
    device = "cuda" if mode == "cuda" else "cpu"
    return fastload.DataLoader(ds, num_workers=2, device=device, **common), 60, 0.010


MODES = [
    "inline",
    "threaded",
    "in-process",
    "generic",
    "device-cpu",
    pytest.param("cuda", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("mode", MODES)
def test_the_meter_agrees_with_a_timer_around_each_next_call(mode: str, h5: Path) -> None:
    if mode == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device; none on this machine")
    loader, batches, step_s = _loader(mode, h5)
    waits, stats, preempted = _caller_waits(loader, batches, step_s)
    assert stats.steady_batches == len(waits)
    # The typical batch: the meter's median wait (its histogram's, within 2.5 %) against the
    # caller's. The medians hold still when the test is preempted between its timer and the
    # meter's (the suite runs with both cores busy).
    caller = statistics.median(waits)
    meter = stats.p50_wait_ms / 1e3
    assert abs(meter - caller) <= max(TOLERANCE * caller, FLOOR_S), (
        f"{mode}: the meter's median wait is {meter * 1e6:.1f} µs, the caller's clock says "
        f"{caller * 1e6:.1f} µs"
    )
    # And over the whole run: the stall fraction the meter reports against the caller's. The
    # meter's clock runs inside the caller's, so it can never report more; it may report less
    # by the time the caller was preempted outside the meter's clock (the kernel counts it: CI
    # once saw 4.5 ms of it in 79 batches), and no more than that.
    caller_total, steady = sum(waits), len(waits)
    assert stats.wait_s <= caller_total, (
        f"{mode}: the meter waited {stats.wait_s:.6f} s in all, longer than the caller's "
        f"{caller_total:.6f} s around the same calls"
    )
    slack = max(TOLERANCE * caller_total, 2 * FLOOR_S * steady) + preempted
    assert caller_total - stats.wait_s <= slack, (
        f"{mode}: the meter waited {stats.wait_s:.6f} s in all, the caller {caller_total:.6f} s "
        f"(of which {preempted:.6f} s preempted)"
    )


class _SlowHandler(logging.Handler):
    """A logging handler that takes 2 ms per record: work the loader does inside ``next()``."""

    def emit(self, record: logging.LogRecord) -> None:
        time.sleep(0.002)


def test_the_loaders_own_work_inside_next_counts_as_waiting(h5: Path) -> None:
    # Logging the stats (log_every_s) runs inside next(): the caller waits for it, so the meter
    # must count it (it was counted as step, after the meter's end of the wait).
    handler = _SlowHandler(logging.INFO)
    logger = logging.getLogger("fastload")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        loader = fastload.DataLoader(
            fastload.HDF5Dataset(h5), batch_size=32, num_workers=2, log_every_s=1e-9
        )
        waits, stats, _ = _caller_waits(loader, 30, 0.002)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    assert statistics.median(waits) > 0.002
    assert stats.wait_s >= 0.9 * sum(waits)
