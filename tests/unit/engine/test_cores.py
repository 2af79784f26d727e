"""The fast path's CPU placement (``_engine/_cores.py``): the workers' CPUs are every allowed CPU
but the consumer's; a window that shows the consumer starved starts a trial (a window released,
one confined again), and they keep every CPU only if the released window was faster."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from fastload._engine import _cores
from fastload._engine._cores import (
    CONFINE,
    GAIN,
    RELEASE,
    RETRY,
    STARVED,
    WARMUP,
    WINDOW,
    ConsumerCore,
)

two_cpus = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs"
)


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait()


def _deliver(core: ConsumerCore, batches: int, *, step_s: float, wait_s: float, start: tuple[float, float]) -> tuple[list[str], tuple[float, float]]:
    """Feed ``batches`` deliveries each ``step_s`` apart, the consumer having waited ``wait_s``
    of each; returns what the core asked for on the way, and the clock and total wait reached."""
    now, waited = start
    asked: list[str] = []
    for _ in range(batches):
        now += step_s
        waited += wait_s
        decision = core.observe(now, waited)
        if decision is not None:
            asked.append(decision)
    return asked, (now, waited)


def _starved_core() -> tuple[ConsumerCore, tuple[float, float]]:
    """A core whose first window after the warm-up was starved: it has asked for the trial's
    release."""
    core = ConsumerCore()
    asked, at = _deliver(core, WARMUP + WINDOW, step_s=1e-3, wait_s=0.5e-3, start=(0.0, 0.0))
    assert asked == [RELEASE]
    return core, at


@two_cpus
def test_the_workers_get_every_allowed_cpu_but_the_consumers() -> None:
    before = _cores._current_cpu()
    core = ConsumerCore()
    after = _cores._current_cpu()
    allowed = set(os.sched_getaffinity(0))
    assert core.confining and core.worker_cpus is not None
    assert len(core.worker_cpus) == len(allowed) - 1 and core.worker_cpus < allowed
    if before == after:  # (the thread did not move while it looked)
        assert allowed - core.worker_cpus == {before}


@two_cpus
def test_a_consumer_allowed_one_cpu_confines_nothing() -> None:
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    try:
        assert not ConsumerCore().confining
    finally:
        os.sched_setaffinity(0, allowed)


@two_cpus
def test_a_starved_window_after_the_warmup_starts_a_trial_and_a_starved_warmup_does_not() -> None:
    core = ConsumerCore()
    # Starved all through the warm-up (fresh workers are slow): nothing asked.
    asked, at = _deliver(core, WARMUP, step_s=1e-3, wait_s=0.9e-3, start=(0.0, 0.0))
    assert asked == []
    # A window just under the bar: kept.
    asked, at = _deliver(core, WINDOW, step_s=1e-3, wait_s=(STARVED - 0.05) * 1e-3, start=at)
    assert asked == []
    # The next window over it: the trial's release, as the window closes and not before.
    asked, at = _deliver(core, WINDOW - 1, step_s=1e-3, wait_s=(STARVED + 0.05) * 1e-3, start=at)
    assert asked == []
    assert core.observe(at[0] + 1e-3, at[1] + (STARVED + 0.05) * 1e-3) == RELEASE
    assert core.deciding


@two_cpus
def test_a_release_that_delivers_faster_than_both_confined_windows_stays() -> None:
    core, at = _starved_core()  # confined: 1 ms per batch
    asked, at = _deliver(core, WINDOW, step_s=0.5e-3, wait_s=0.0, start=at)  # released: twice as fast
    assert asked == [CONFINE]
    asked, at = _deliver(core, WINDOW, step_s=1e-3, wait_s=0.5e-3, start=at)  # confined again: slow
    assert asked == [RELEASE]
    assert not core.deciding  # for good: nothing more is watched


@two_cpus
@pytest.mark.parametrize("released_step_s", [1e-3, 1e-3 / GAIN * 1.01, 2e-3])
def test_a_release_that_is_not_faster_ends_confined_and_is_tried_again_later(released_step_s: float) -> None:
    # As on a machine where another process is busy: the consumer starves, and giving the
    # workers its CPU as well does not help.
    core, at = _starved_core()
    asked, at = _deliver(core, WINDOW, step_s=released_step_s, wait_s=0.5e-3, start=at)
    assert asked == [CONFINE]
    asked, at = _deliver(core, WINDOW, step_s=1e-3, wait_s=0.5e-3, start=at)
    assert asked == []  # stays confined
    assert core.deciding
    # Starved all along: the next trial comes after RETRY windows, the one after that after 2 * RETRY.
    asked, at = _deliver(core, RETRY * WINDOW, step_s=1e-3, wait_s=0.5e-3, start=at)
    assert asked == []
    asked, at = _deliver(core, WINDOW, step_s=1e-3, wait_s=0.5e-3, start=at)
    assert asked == [RELEASE]
    asked, at = _deliver(core, 2 * WINDOW, step_s=1e-3, wait_s=0.5e-3, start=at)
    assert asked == [CONFINE]  # the trial fails again
    asked, at = _deliver(core, 2 * RETRY * WINDOW, step_s=1e-3, wait_s=0.5e-3, start=at)
    assert asked == []
    asked, at = _deliver(core, WINDOW, step_s=1e-3, wait_s=0.5e-3, start=at)
    assert asked == [RELEASE]


@two_cpus
def test_a_faster_release_is_judged_against_the_confined_window_after_it_too() -> None:
    # The window before the trial was slow for a passing reason (the trial's confined window
    # is as fast as the released one): the workers stay confined.
    core, at = _starved_core()
    asked, at = _deliver(core, WINDOW, step_s=0.5e-3, wait_s=0.0, start=at)
    assert asked == [CONFINE]
    asked, at = _deliver(core, WINDOW, step_s=0.5e-3, wait_s=0.0, start=at)
    assert asked == []
    assert core.confining and core.deciding


@two_cpus
def test_release_and_confine_move_only_the_workers_placed_by_the_core(sleepers: list[subprocess.Popen[bytes]]) -> None:
    core = ConsumerCore()
    assert core.worker_cpus is not None
    allowed = set(os.sched_getaffinity(0))
    confined, chose_its_own = sleepers
    os.sched_setaffinity(confined.pid, core.worker_cpus)
    own = {min(core.worker_cpus)} if len(core.worker_cpus) > 1 else set(allowed - core.worker_cpus)
    os.sched_setaffinity(chose_its_own.pid, own)  # as a worker_init_fn might
    core.release([confined.pid, chose_its_own.pid, 2**22 + 12345])  # and one already gone
    assert os.sched_getaffinity(confined.pid) == allowed
    assert os.sched_getaffinity(chose_its_own.pid) == own
    assert not core.confining
    core.release([confined.pid])  # idempotent
    core.confine([confined.pid, chose_its_own.pid])  # a failed trial: back off the consumer's CPU
    assert os.sched_getaffinity(confined.pid) == core.worker_cpus
    assert os.sched_getaffinity(chose_its_own.pid) == own
    assert core.confining
