"""``find_batch_size``: the batch size to train with, found by trying sizes on the real step.

For each size tried, a fresh loader (``loader_factory(batch_size)``) feeds ``warmup_steps +
steps`` batches to ``step_fn``; the time inside the loader's ``next()`` is *wait*, the time in
``step_fn`` is *step*. The device's busy fraction is ``step / (step + wait)`` over the measured
(post-warm-up) steps and the throughput is ``batch_size * steps / (step + wait)``.

The search:

1. **grow**: ``start``, ``2·start``, ``4·start``, ... until a size runs out of memory or
   ``max_batch_size`` is reached (``max_batch_size`` itself is tried last);
2. **largest that fits**: bisect between the largest size that ran and the smallest that ran
   out of memory, until they are within ``tolerance`` of each other;
3. **smallest that keeps the device busy**: bisect between the largest size under
   ``target_busy`` and the smallest at or above it, to the same tolerance.

Out of memory is an exception from ``step_fn`` that is a ``MemoryError``, or a
``RuntimeError`` whose message says ``out of memory`` (``torch.cuda.OutOfMemoryError`` is one)
or ``can't allocate memory`` (torch's CPU allocator). It is caught, recorded, and the references
to that step are dropped before the next try. Any other exception propagates.
"""

from __future__ import annotations

import gc
import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from fastload._metrics._clock import Clock

_OOM_MESSAGES = ("out of memory", "can't allocate memory")


@dataclass(frozen=True)
class BatchSizeTrial:
    """One batch size tried: ``fits`` is false when a step ran out of memory (``error`` is its
    message); times are means per measured step in seconds; ``busy`` is the device's busy
    fraction, ``samples_per_s`` the throughput (both ``None`` when it did not fit)."""

    batch_size: int
    fits: bool
    steps: int
    step_s: float | None
    wait_s: float | None
    busy: float | None
    samples_per_s: float | None
    error: str | None = None


@dataclass(frozen=True)
class BatchSizeReport:
    """What :func:`find_batch_size` found.

    ``recommended``: the smallest size tried whose busy fraction reached ``target_busy``
    (``None`` if none did). ``largest_fitting``: the largest size that ran without running out
    of memory (``None`` if even ``start`` did not). ``trials``: every size tried, ascending.
    ``max_batch_size``: the search's cap; where ``capped`` holds, the largest size that fits
    is only the cap, and larger sizes may fit too.
    """

    target_busy: float
    recommended: int | None
    largest_fitting: int | None
    trials: tuple[BatchSizeTrial, ...]
    max_batch_size: int | None = None

    @property
    def capped(self) -> bool:
        """Whether the search stopped at ``max_batch_size`` with every size fitting."""
        return (
            self.largest_fitting is not None
            and self.largest_fitting == self.max_batch_size
            and all(t.fits for t in self.trials)
        )

    def __str__(self) -> str:
        lines = [f"{'batch size':>10}  {'samples/s':>12}  {'busy':>6}  {'step ms':>9}  {'wait ms':>9}"]
        for t in self.trials:
            if not t.fits:
                lines.append(f"{t.batch_size:>10}  out of memory")
                continue
            assert t.busy is not None and t.samples_per_s is not None
            assert t.step_s is not None and t.wait_s is not None
            lines.append(
                f"{t.batch_size:>10}  {t.samples_per_s:>12,.0f}  {t.busy * 100:>5.1f}%"
                f"  {t.step_s * 1e3:>9.2f}  {t.wait_s * 1e3:>9.2f}"
            )
        target = f"{self.target_busy * 100:.0f} %"
        if self.recommended is not None:
            lines.append(f"smallest batch size keeping the device {target} busy: {self.recommended}")
        elif self.largest_fitting is not None:
            too_small = (
                f"max_batch_size={self.max_batch_size} is too small" if self.capped
                else "the largest size that fits is still too small"
            )
            lines.append(
                f"no batch size kept the device {target} busy: the loader is the bottleneck "
                f"(add workers) or {too_small}"
            )
        if self.capped:
            lines.append(
                f"batch size {self.largest_fitting} fits in memory; the search stopped at "
                f"max_batch_size={self.max_batch_size}, not at a size that ran out of memory "
                "(raise max_batch_size to search further)"
            )
        elif self.largest_fitting is not None:
            lines.append(f"largest batch size that fits in memory: {self.largest_fitting}")
        else:
            lines.append(f"even batch size {self.trials[0].batch_size} ran out of memory")
        return "\n".join(lines)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` means a step ran out of (device or host) memory."""
    if isinstance(error, MemoryError):
        return True
    message = str(error).lower()
    return isinstance(error, RuntimeError) and any(m in message for m in _OOM_MESSAGES)


def find_batch_size(
    step_fn: Callable[[Any], object],
    loader_factory: Callable[[int], Iterable[Any]],
    *,
    target_busy: float = 0.85,
    start: int = 8,
    max_batch_size: int = 4096,
    steps: int = 10,
    warmup_steps: int = 2,
    tolerance: float = 0.125,
    clock: Clock = time.perf_counter,
    progress: bool = True,
) -> BatchSizeReport:
    """Find the smallest batch size that keeps the device at least ``target_busy`` busy and
    the largest that fits in memory (the search is in the module docstring).

    ``step_fn(batch)`` runs one training step (forward, backward, optimizer; on CUDA it should
    end with a synchronizing call such as ``loss.item()``, or the step's time lands in the next
    wait). ``loader_factory(batch_size)`` returns an iterable of batches of that size with at
    least ``warmup_steps + steps`` batches. ``tolerance`` is the relative width at which a
    bisection stops (0.125: the answer is within 12.5 % of the true boundary). ``progress``:
    a line on stderr as each size starts and ends (terminal or not: a search takes minutes).
    """
    if not 0 < target_busy <= 1:
        raise ValueError(f"find_batch_size: target_busy must be in (0, 1]; got {target_busy!r}")
    _positive("start", start)
    _positive("max_batch_size", max_batch_size)
    if max_batch_size < start:
        raise ValueError(
            f"find_batch_size: max_batch_size={max_batch_size} is below start={start}"
        )
    _positive("steps", steps)
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"find_batch_size: warmup_steps must be an integer >= 0; got {warmup_steps!r}")
    if not 0 < tolerance < 1:
        raise ValueError(f"find_batch_size: tolerance must be in (0, 1); got {tolerance!r}")

    trials: dict[int, BatchSizeTrial] = {}

    def trial(size: int) -> BatchSizeTrial:
        if size not in trials:
            if progress:
                _say(f"trying batch size {size} ({warmup_steps} + {steps} steps)")
            trials[size] = _try(step_fn, loader_factory, size, steps, warmup_steps, clock)
            if progress:
                _say(_outcome(trials[size]))
        return trials[size]

    size = start
    while True:
        if not trial(size).fits or size == max_batch_size:
            break
        size = min(2 * size, max_batch_size)

    fitting = [s for s, t in trials.items() if t.fits]
    failing = [s for s, t in trials.items() if not t.fits]
    largest = max(fitting, default=None)
    if largest is not None and failing:
        largest = _bisect(largest, min(failing), lambda s: trial(s).fits, tolerance)

    def busy_enough(s: int) -> bool:
        t = trial(s)
        return t.fits and t.busy is not None and t.busy >= target_busy

    passing = [s for s in trials if busy_enough(s)]
    recommended = min(passing, default=None)
    if recommended is not None:
        below = [s for s in trials if s < recommended and trials[s].fits]
        if below:  # narrow the gap between the last size under the target and the first above
            _bisect(max(below), recommended, lambda s: not busy_enough(s), tolerance)
            recommended = min(s for s in trials if busy_enough(s))
    return BatchSizeReport(
        target_busy=target_busy,
        recommended=recommended,
        largest_fitting=largest,
        trials=tuple(trials[s] for s in sorted(trials)),
        max_batch_size=max_batch_size,
    )


def _say(line: str) -> None:
    print(f"find_batch_size: {line}", file=sys.stderr, flush=True)


def _outcome(t: BatchSizeTrial) -> str:
    if not t.fits:
        return f"batch size {t.batch_size}: out of memory"
    assert t.busy is not None and t.samples_per_s is not None
    return f"batch size {t.batch_size}: {t.samples_per_s:,.0f} samples/s, device busy {t.busy * 100:.1f} %"


def _bisect(good: int, bad: int, is_good: Callable[[int], bool], tolerance: float) -> int:
    """The largest ``s`` found with ``is_good(s)`` between ``good`` (true) and ``bad``
    (false), narrowed until ``bad - good <= max(1, tolerance * good)``."""
    while bad - good > max(1, math.floor(tolerance * good)):
        middle = (good + bad) // 2
        if is_good(middle):
            good = middle
        else:
            bad = middle
    return good


def _try(
    step_fn: Callable[[Any], object],
    loader_factory: Callable[[int], Iterable[Any]],
    size: int,
    steps: int,
    warmup_steps: int,
    clock: Clock,
) -> BatchSizeTrial:
    wait_s = step_s = 0.0
    measured = 0
    error: str | None = None
    batches: Iterator[Any] = iter(loader_factory(size))
    try:
        for index in range(warmup_steps + steps):
            t0 = clock()
            try:
                batch = next(batches)
            except StopIteration:
                break
            t1 = clock()
            try:
                step_fn(batch)
            except (MemoryError, RuntimeError) as exc:
                if not is_out_of_memory(exc):
                    raise
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                break
            finally:
                del batch
            t2 = clock()
            if index >= warmup_steps:
                wait_s += t1 - t0
                step_s += t2 - t1
                measured += 1
    finally:
        del batches
    if error is not None:
        gc.collect()  # free the failed step's tensors (cycles through its traceback) now
    if error is not None:
        return BatchSizeTrial(size, False, measured, None, None, None, None, error)
    if measured == 0:
        raise ValueError(
            f"find_batch_size: loader_factory({size}) yielded fewer than "
            f"warmup_steps + 1 = {warmup_steps + 1} batches; nothing was measured"
        )
    total = wait_s + step_s
    return BatchSizeTrial(
        batch_size=size,
        fits=True,
        steps=measured,
        step_s=step_s / measured,
        wait_s=wait_s / measured,
        busy=step_s / total if total > 0 else 1.0,
        samples_per_s=size * measured / total if total > 0 else math.inf,
    )


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"find_batch_size: {name} must be an integer >= 1; got {value!r}")
