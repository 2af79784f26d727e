"""The fast path's CPU placement (``_engine/_cores.py``): the workers' CPUs are every allowed CPU
but the consumer's, and they are released, for good, once a window shows the consumer starved."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from fastload._engine import _cores
from fastload._engine._cores import STARVED, WARMUP, WINDOW, ConsumerCore

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


def _deliver(core: ConsumerCore, batches: int, *, step_s: float, wait_s: float, start: tuple[float, float]) -> tuple[bool, tuple[float, float]]:
    """Feed ``batches`` deliveries each ``step_s`` apart, the consumer having waited ``wait_s``
    of each; returns whether any said release, and the clock and total wait reached."""
    now, waited = start
    released = False
    for _ in range(batches):
        now += step_s
        waited += wait_s
        released |= core.observe(now, waited)
    return released, (now, waited)


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
def test_a_starved_window_after_the_warmup_releases_and_a_starved_warmup_does_not() -> None:
    core = ConsumerCore()
    # Starved all through the warm-up (fresh workers are slow): no release.
    released, at = _deliver(core, WARMUP, step_s=1e-3, wait_s=0.9e-3, start=(0.0, 0.0))
    assert not released
    # A window just under the bar: kept.
    released, at = _deliver(core, WINDOW, step_s=1e-3, wait_s=(STARVED - 0.05) * 1e-3, start=at)
    assert not released
    # The next window over it: released, as the window closes and not before.
    released, at = _deliver(core, WINDOW - 1, step_s=1e-3, wait_s=(STARVED + 0.05) * 1e-3, start=at)
    assert not released
    assert core.observe(at[0] + 1e-3, at[1] + (STARVED + 0.05) * 1e-3)


@two_cpus
def test_release_restores_every_cpu_to_confined_workers_only(sleepers: list[subprocess.Popen[bytes]]) -> None:
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


@two_cpus
def test_a_thread_started_here_begins_on_the_callers_cpu_and_then_gets_every_cpu_back() -> None:
    allowed = _cores.allowed_cpus()
    seen: dict[str, frozenset[int]] = {}

    def target() -> None:
        seen["at start"] = frozenset(os.sched_getaffinity(0))
        _cores.restore_cpus(allowed)
        seen["after restore"] = frozenset(os.sched_getaffinity(0))

    thread = threading.Thread(target=target)
    _cores.start_here(thread)
    assert frozenset(os.sched_getaffinity(0)) == allowed  # the caller's own CPUs are back at once
    thread.join(5)
    assert len(seen["at start"]) == 1 and seen["at start"] <= allowed
    assert seen["after restore"] == allowed


def test_a_thread_started_here_by_a_caller_held_to_one_cpu_keeps_it() -> None:
    """Nothing to narrow: the thread starts, as any thread, with the caller's single CPU."""
    before = frozenset(os.sched_getaffinity(0))
    one = {min(before)}
    os.sched_setaffinity(0, one)
    try:
        seen: list[frozenset[int]] = []
        thread = threading.Thread(target=lambda: seen.append(frozenset(os.sched_getaffinity(0))))
        _cores.start_here(thread)
        thread.join(5)
        assert seen == [frozenset(one)]
        assert frozenset(os.sched_getaffinity(0)) == frozenset(one)
    finally:
        os.sched_setaffinity(0, before)
