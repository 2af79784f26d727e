"""The worker auto-tuning policy in a controlled simulation: a fluid model of a loader whose
workers each produce ``rate`` batches/s feeding a consumer whose step takes ``step_s`` and
whose own work per batch (receiving and handing it out, inside ``next()``) takes ``own_s``."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field

import pytest

from fastload._metrics import AutoTuner, ManualClock, available_cores
from fastload._metrics._autotune import ADD_BUSY


@dataclass
class FluidLoader:
    """Over ``dt`` seconds with ``n`` workers: if ``n·rate >= 1/(step_s + own_s)`` the consumer
    never waits for a worker and the workers idle the surplus; else it waits for every batch
    beyond ``n·rate``. The meter counts the consumer's own work as waiting (it is inside
    ``next()``); ``cpu_s`` is the consumer thread's CPU: its own work, and its step where the
    step runs on the CPU (``step_on_cpu``)."""

    rate: float  # batches per second per worker
    step_s: float
    jitter: float = 0.0  # relative noise on the rate, per window
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    own_s: float = 0.0
    step_on_cpu: bool = False
    wait_s: float = 0.0
    consumer_step_s: float = 0.0
    busy_s: float = 0.0
    cpu_s: float = 0.0

    def run(self, n: int, dt: float) -> None:
        rate = self.rate * (1 + self.jitter * self.rng.uniform(-1, 1))
        supply, demand = n * rate, 1 / (self.step_s + self.own_s)
        batches = min(supply, demand) * dt
        stepping = batches * self.step_s
        self.consumer_step_s += stepping
        self.wait_s += dt - stepping
        self.busy_s += n * dt * min(1.0, demand / supply)
        self.cpu_s += batches * self.own_s + (stepping if self.step_on_cpu else 0.0)


def simulate(
    tuner: AutoTuner,
    model: FluidLoader,
    clock: ManualClock,
    windows: int,
    *,
    calls_per_window: int = 4,
) -> list[int]:
    """Observe several times per window (as a per-batch hook would); return the worker count
    after every window."""
    counts = []
    dt = tuner.window_s / calls_per_window
    tuner.observe(wait_s=model.wait_s, step_s=model.consumer_step_s, busy_s=model.busy_s)
    for _ in range(windows):
        for _ in range(calls_per_window):
            clock.advance(dt)
            model.run(tuner.num_workers, dt)
            tuner.observe(wait_s=model.wait_s, step_s=model.consumer_step_s, busy_s=model.busy_s)
        counts.append(tuner.num_workers)
    return counts


def test_one_worker_that_keeps_up_is_never_joined_by_another() -> None:
    clock = ManualClock()
    tuner = AutoTuner(max_workers=8, clock=clock)
    counts = simulate(tuner, FluidLoader(rate=100, step_s=0.020), clock, windows=100)
    assert set(counts) == {1}


def test_a_loader_that_cannot_keep_up_grows_to_the_core_count_and_stays() -> None:
    clock = ManualClock()
    tuner = AutoTuner(clock=clock)  # max_workers defaults to the usable cores
    assert tuner.max_workers == available_cores()
    counts = simulate(tuner, FluidLoader(rate=5, step_s=0.001), clock, windows=100)
    assert counts[-1] == available_cores()
    assert counts == sorted(counts)  # only ever added


def test_it_settles_on_the_fewest_workers_that_keep_up() -> None:
    clock = ManualClock()
    tuner = AutoTuner(max_workers=16, clock=clock)
    # 10 batches/s per worker against 33.3 batches/s of demand: 3 fall short, 4 suffice.
    counts = simulate(tuner, FluidLoader(rate=10, step_s=0.030), clock, windows=100)
    assert counts[-50:] == [4] * 50


def test_idle_workers_are_retired_when_the_step_slows_down() -> None:
    clock = ManualClock()
    tuner = AutoTuner(max_workers=16, clock=clock)
    model = FluidLoader(rate=10, step_s=0.030)
    assert simulate(tuner, model, clock, windows=50)[-1] == 4
    model.step_s = 0.150  # 6.7 batches/s: one worker is enough
    counts = simulate(tuner, model, clock, windows=50)
    assert counts[-20:] == [1] * 20
    assert counts == sorted(counts, reverse=True)


def test_noisy_rates_near_the_boundary_settle_instead_of_oscillating() -> None:
    clock = ManualClock()
    tuner = AutoTuner(max_workers=16, idle_threshold=0.05, clock=clock)
    # Demand 36 batches/s; 4 workers give 40 ± 20 %: sometimes short, sometimes idle.
    model = FluidLoader(rate=10, step_s=1 / 36, jitter=0.2)
    counts = simulate(tuner, model, clock, windows=2_000)
    changes = sum(a != b for a, b in itertools.pairwise(counts))
    assert changes <= 2 * tuner.max_workers
    assert len(set(counts[-1_000:])) == 1


def test_a_consumer_bound_loader_stops_short_of_idle_workers() -> None:
    # 10 batches/s per worker against a consumer that spends 10 ms of its own per batch and no
    # step (the meter sees ~100 % stall whatever the pool): 10 workers reach its ceiling of
    # 100 batches/s. Growing while the workers were busy half the time went to 21.
    clock = ManualClock()
    tuner = AutoTuner(max_workers=64, clock=clock)
    counts = simulate(tuner, FluidLoader(rate=10, step_s=0.0, own_s=0.010), clock, windows=200)
    best = 10
    assert best <= counts[-1] <= math.ceil(best / ADD_BUSY)
    assert counts[-100:] == [counts[-1]] * 100


def test_workers_are_retired_when_the_stall_becomes_the_consumers_own_cost() -> None:
    clock = ManualClock()
    tuner = AutoTuner(max_workers=16, clock=clock)
    model = FluidLoader(rate=10, step_s=0.030)
    assert simulate(tuner, model, clock, windows=50)[-1] == 4
    # Now the consumer itself takes 100 ms a batch: one worker keeps up; the stall stays.
    model.step_s, model.own_s = 0.0, 0.100
    counts = simulate(tuner, model, clock, windows=50)
    assert counts[-20:] == [2] * 20  # the fewest that stay under ADD_BUSY (one is saturated)
    assert counts == sorted(counts, reverse=True)


def test_a_busy_consumer_keeps_a_core_from_the_workers() -> None:
    # The step runs on the CPU and takes 40 ms of each batch: with 3 workers (15 batches/s)
    # the consumer is busy 60 % of the time, so a fourth worker would not fit in 4 cores.
    clock = ManualClock()
    model = FluidLoader(rate=5, step_s=0.040, step_on_cpu=True)
    tuner = AutoTuner(max_workers=4, clock=clock, cpu_clock=lambda: model.cpu_s)
    counts = simulate(tuner, model, clock, windows=60)
    assert counts[-30:] == [3] * 30
    clock, model = ManualClock(), FluidLoader(rate=5, step_s=0.040, step_on_cpu=True)
    tuner = AutoTuner(max_workers=4, clock=clock)  # the consumer's CPU unknown: every core
    assert simulate(tuner, model, clock, windows=60)[-1] == 4


def test_no_worker_is_added_without_memory_for_it() -> None:
    clock = ManualClock()
    tuner = AutoTuner(max_workers=8, memory_ok=lambda: False, clock=clock)
    counts = simulate(tuner, FluidLoader(rate=5, step_s=0.001), clock, windows=20)
    assert set(counts) == {1}


def test_decisions_come_once_per_window_and_a_cooldown_follows_each_change() -> None:
    clock = ManualClock()
    tuner = AutoTuner(max_workers=8, window_s=1.0, cooldown_windows=2, clock=clock)
    model = FluidLoader(rate=5, step_s=0.001)
    decisions = []
    tuner.observe(wait_s=0, step_s=0, busy_s=0)
    for _ in range(12):
        clock.advance(0.5)
        model.run(tuner.num_workers, 0.5)
        decisions.append(tuner.observe(wait_s=model.wait_s, step_s=model.consumer_step_s))
    # windows end every other call; after each add, two windows are skipped
    assert decisions == ["hold", "add"] + ["hold"] * 5 + ["add"] + ["hold"] * 4


def test_counters_that_restart_begin_a_new_window() -> None:
    clock = ManualClock()
    tuner = AutoTuner(max_workers=8, clock=clock)
    tuner.observe(wait_s=50.0, step_s=50.0)
    clock.advance(2.0)
    assert tuner.observe(wait_s=1.0, step_s=0.0) == "hold"  # a new meter: not a negative stall
    clock.advance(2.0)
    assert tuner.observe(wait_s=2.0, step_s=0.0) == "add"


def test_without_busy_time_workers_are_never_retired() -> None:
    clock = ManualClock()
    tuner = AutoTuner(min_workers=1, max_workers=8, clock=clock)
    model = FluidLoader(rate=5, step_s=0.001)
    for _ in range(30):
        clock.advance(1.0)
        model.run(tuner.num_workers, 1.0)
        tuner.observe(wait_s=model.wait_s, step_s=model.consumer_step_s)
    model.step_s = 10.0
    for _ in range(30):
        clock.advance(1.0)
        model.run(tuner.num_workers, 1.0)
        assert tuner.observe(wait_s=model.wait_s, step_s=model.consumer_step_s) != "retire"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"min_workers": 0}, "min_workers must be >= 1; got 0"),
        ({"min_workers": 4, "max_workers": 2}, "max_workers must be >= 4; got 2"),
        ({"stall_threshold": 1.5}, "stall_threshold must be a fraction in \\(0, 1\\); got 1.5"),
        ({"idle_threshold": 0}, "idle_threshold must be a fraction in \\(0, 1\\); got 0"),
        ({"window_s": -1}, "window_s must be a number of seconds > 0; got -1"),
        ({"cooldown_windows": -1}, "cooldown_windows must be >= 0; got -1"),
    ],
)
def test_options_are_validated_at_construction(options: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AutoTuner(**options)  # type: ignore[arg-type]


def test_a_stall_while_the_workers_idle_adds_no_worker() -> None:
    # A hiccup of the host (or slow delivery) stalls the consumer while the one worker idles:
    # another worker would idle too. The same stall with a busy worker adds one.
    clock = ManualClock()
    tuner = AutoTuner(max_workers=8, clock=clock)
    tuner.observe(wait_s=0.0, step_s=0.0, busy_s=0.0)
    clock.advance(1.0)
    assert tuner.observe(wait_s=0.2, step_s=0.8, busy_s=0.01) == "hold"
    clock.advance(1.0)
    assert tuner.observe(wait_s=0.4, step_s=1.6, busy_s=0.95) == "add"
    assert tuner.num_workers == 2
