"""find_batch_size on a fake step with a known time curve and a fake out-of-memory threshold,
timed by a ManualClock; estimate_memory's arithmetic."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from fastload import estimate_memory, find_batch_size
from fastload._metrics import ManualClock, is_out_of_memory

OOM_ABOVE = 300


class Batch:
    def __init__(self, size: int) -> None:
        self.size = size


def step_ms(size: int) -> float:
    return 2.0 + 0.1 * size  # a fixed launch cost plus per-sample compute


def wait_ms(size: int) -> float:
    return 1.0 + 0.01 * size  # the loader's time per batch not hidden by prefetching


def smallest_busy(target: float) -> int:
    """The known answer: the smallest size with step / (step + wait) >= target."""
    return next(s for s in range(1, 10_000) if step_ms(s) / (step_ms(s) + wait_ms(s)) >= target)


def fake(
    clock: ManualClock,
    *,
    oom_above: int = OOM_ABOVE,
    message: str = "CUDA out of memory. Tried to allocate 2.00 GiB",
) -> tuple[Callable[[Batch], None], Callable[[int], Iterator[Batch]]]:
    def step_fn(batch: Batch) -> None:
        if batch.size > oom_above:
            raise torch.cuda.OutOfMemoryError(message)
        clock.advance(step_ms(batch.size) / 1e3)

    def loader_factory(size: int) -> Iterator[Batch]:
        for _ in range(100):
            clock.advance(wait_ms(size) / 1e3)
            yield Batch(size)

    return step_fn, loader_factory


def test_finds_the_smallest_busy_size_and_the_largest_fitting_within_tolerance() -> None:
    clock = ManualClock()
    report = find_batch_size(*fake(clock), clock=clock, max_batch_size=10_000)
    truth = smallest_busy(0.85)
    assert report.recommended is not None and report.largest_fitting is not None
    assert truth <= report.recommended <= truth * 1.125
    assert OOM_ABOVE / 1.125 <= report.largest_fitting <= OOM_ABOVE
    assert [t.batch_size for t in report.trials] == sorted(t.batch_size for t in report.trials)
    assert {t.fits for t in report.trials if t.batch_size > OOM_ABOVE} == {False}


def test_a_fine_tolerance_finds_the_exact_boundaries() -> None:
    clock = ManualClock()
    report = find_batch_size(*fake(clock), clock=clock, tolerance=0.001, target_busy=0.86)
    assert report.recommended == smallest_busy(0.86)
    assert report.largest_fitting == OOM_ABOVE


def test_each_trial_reports_the_measured_busy_fraction_and_throughput() -> None:
    clock = ManualClock()
    report = find_batch_size(*fake(clock), clock=clock, steps=5, warmup_steps=1)
    trial = next(t for t in report.trials if t.batch_size == 64)
    assert trial.steps == 5
    assert trial.step_s == pytest.approx(step_ms(64) / 1e3)
    assert trial.wait_s == pytest.approx(wait_ms(64) / 1e3)
    assert trial.busy == pytest.approx(step_ms(64) / (step_ms(64) + wait_ms(64)))
    assert trial.samples_per_s == pytest.approx(64 / ((step_ms(64) + wait_ms(64)) / 1e3))
    oom = next(t for t in report.trials if not t.fits)
    assert oom.error == "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    table = str(report)
    assert f"{64:>10}" in table and "out of memory" in table
    assert f"smallest batch size keeping the device 85 % busy: {report.recommended}" in table
    assert f"largest batch size that fits in memory: {report.largest_fitting}" in table


def test_no_size_busy_enough_and_nothing_fitting_are_reported_not_raised() -> None:
    clock = ManualClock()
    busy_never = find_batch_size(*fake(clock), clock=clock, target_busy=0.99, max_batch_size=256)
    assert busy_never.recommended is None and busy_never.largest_fitting == 256
    assert "no batch size kept the device 99 % busy" in str(busy_never)
    nothing = find_batch_size(*fake(clock, oom_above=4), clock=clock, start=8)
    assert nothing.recommended is None and nothing.largest_fitting is None
    assert [t.batch_size for t in nothing.trials] == [8]
    assert "even batch size 8 ran out of memory" in str(nothing)


def test_cpu_allocator_failures_count_as_out_of_memory_and_other_errors_propagate() -> None:
    clock = ManualClock()
    cpu = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 8589934592 bytes"
    step_fn, factory = fake(clock, message=cpu)
    assert find_batch_size(step_fn, factory, clock=clock).largest_fitting is not None
    assert is_out_of_memory(MemoryError())
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("out of memory"))

    def broken(batch: Batch) -> None:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        find_batch_size(broken, factory, clock=clock)


def test_the_failed_steps_batch_is_freed_before_the_next_try() -> None:
    clock = ManualClock()
    step_fn, factory = fake(clock)
    refs: list[weakref.ref[Batch]] = []

    def tracking_factory(size: int) -> Iterator[Batch]:
        assert all(r() is None for r in refs), "a batch of an earlier try is still alive"
        for batch in factory(size):
            refs.append(weakref.ref(batch))
            yield batch

    find_batch_size(step_fn, tracking_factory, clock=clock)


def test_a_loader_with_too_few_batches_is_an_error_naming_the_size() -> None:
    clock = ManualClock()
    step_fn, _ = fake(clock)
    with pytest.raises(
        ValueError, match=r"loader_factory\(8\) yielded fewer than warmup_steps \+ 1 = 3"
    ):
        find_batch_size(step_fn, lambda size: [Batch(size)] * 2, clock=clock)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"target_busy": 0}, "target_busy must be in \\(0, 1\\]; got 0"),
        ({"start": 0}, "start must be an integer >= 1; got 0"),
        ({"start": 64, "max_batch_size": 32}, "max_batch_size=32 is below start=64"),
        ({"steps": 0}, "steps must be an integer >= 1; got 0"),
        ({"warmup_steps": -1}, "warmup_steps must be an integer >= 0; got -1"),
        ({"tolerance": 1.0}, "tolerance must be in \\(0, 1\\); got 1.0"),
    ],
)
def test_find_batch_size_validates_its_options(options: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        find_batch_size(lambda b: None, lambda s: [], **options)  # type: ignore[arg-type]


def test_estimate_memory_sums_the_four_terms() -> None:
    est = estimate_memory(
        parameters=1_000_000,
        bytes_per_param=2,
        optimizer="adam",
        batch_size=8,
        seq_len=512,
        hidden=256,
        layers=4,
        activation_factor=10,
    )
    assert est.params_bytes == 2_000_000
    assert est.grads_bytes == 2_000_000
    assert est.optimizer_bytes == 4_000_000
    assert est.activation_bytes == 8 * 512 * 256 * 4 * 2 * 10
    assert est.total_bytes == 8_000_000 + est.activation_bytes
    assert est.budget_bytes is None and est.max_batch_size is None and est.fits is None


@pytest.mark.parametrize(
    ("optimizer", "states"), [("adam", 2), ("adamw", 2), ("sgd_momentum", 1), ("sgd", 0)]
)
def test_optimizer_states_are_counted_per_optimizer(optimizer: str, states: int) -> None:
    est = estimate_memory(
        parameters=100, optimizer=optimizer, batch_size=1, seq_len=1, hidden=1, layers=1
    )
    assert est.optimizer_bytes == 100 * 4 * states


def test_the_largest_batch_that_fits_the_budget_fits_and_one_more_does_not() -> None:
    common: dict[str, Any] = {"parameters": 10_000_000, "seq_len": 1024, "hidden": 768, "layers": 12}
    budget = 8 * 2**30
    est = estimate_memory(**common, batch_size=1, budget_bytes=budget)
    largest = est.max_batch_size
    assert largest is not None and largest > 0
    assert estimate_memory(**common, batch_size=largest, budget_bytes=budget).fits
    assert not estimate_memory(**common, batch_size=largest + 1, budget_bytes=budget).fits
    fixed = 4 * common["parameters"] * 4  # params + grads + 2 Adam states, fp32
    assert largest == math.floor((budget - fixed) / est.activation_bytes_per_sample)
    too_small = estimate_memory(**common, batch_size=1, budget_bytes=fixed - 1)
    assert too_small.max_batch_size == 0
    assert "does not fit" in str(too_small) and "total" in str(too_small)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"parameters": -1}, "parameters must be an integer >= 0; got -1"),
        ({"seq_len": 0}, "seq_len must be an integer >= 1; got 0"),
        (
            {"optimizer": "lion"},
            "optimizer must be one of 'adam', 'adamw', 'sgd_momentum', 'sgd'; got 'lion'",
        ),
        ({"activation_factor": 0}, "activation_factor must be a number > 0; got 0"),
        ({"budget_bytes": -5}, "budget_bytes must be an integer >= 0; got -5"),
    ],
)
def test_estimate_memory_validates_its_options(options: dict[str, object], message: str) -> None:
    args: dict[str, object] = {
        "parameters": 1,
        "batch_size": 1,
        "seq_len": 1,
        "hidden": 1,
        "layers": 1,
    }
    with pytest.raises(ValueError, match=message):
        estimate_memory(**{**args, **options})  # type: ignore[arg-type]


def test_a_search_stopped_by_max_batch_size_says_so_not_largest_that_fits() -> None:
    clock = ManualClock()
    capped = find_batch_size(*fake(clock), clock=clock, target_busy=0.99, max_batch_size=256)
    assert capped.capped and capped.largest_fitting == 256
    table = str(capped)
    assert "largest batch size that fits in memory" not in table
    assert "batch size 256 fits in memory; the search stopped at max_batch_size=256" in table
    assert "or max_batch_size=256 is too small" in table
    bounded = find_batch_size(*fake(clock), clock=clock, max_batch_size=10_000)
    assert not bounded.capped
    assert f"largest batch size that fits in memory: {bounded.largest_fitting}" in str(bounded)


def test_each_size_tried_is_announced_on_stderr_as_it_starts_and_ends(
    capfd: pytest.CaptureFixture[str],
) -> None:
    clock = ManualClock()
    report = find_batch_size(*fake(clock), clock=clock, max_batch_size=512, steps=3, warmup_steps=1)
    lines = capfd.readouterr().err.splitlines()
    assert len(lines) == 2 * len(report.trials)
    assert lines[0] == "find_batch_size: trying batch size 8 (1 + 3 steps)"
    assert lines[1].startswith("find_batch_size: batch size 8: ") and "device busy" in lines[1]
    assert "find_batch_size: batch size 512: out of memory" in lines
    find_batch_size(*fake(clock), clock=clock, max_batch_size=64, progress=False)
    assert capfd.readouterr().err == ""
