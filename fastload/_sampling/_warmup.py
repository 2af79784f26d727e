"""Batch-size warm-up: small batches first, growing to the target over a number of steps.

A large batch early in training wastes samples while the gradient is still large and noisy; a
warm-up starts small and grows (GPT-3 ramped its batch size over the first few billion tokens).
The schedule is a pure function of the step, so it is deterministic and resumable.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fastload._sampling._batch_options import check_int
from fastload._sampling._epoch_plan import EpochPlan


@dataclass(frozen=True)
class BatchSizeWarmup:
    """Grow a batch size linearly from ``start`` to ``target`` over ``steps`` steps.

    ``size_at(step)`` (also ``schedule(step)``) is ``start + (target - start) * step // steps``
    rounded down to a multiple of ``multiple_of`` (never below ``start``) for ``step < steps``,
    and ``target`` from ``step == steps`` on. Integer arithmetic only, so every process computes
    the same sizes.

    The size is in the sampler's unit: rows with ``batch_size``, padded tokens with
    ``max_tokens``. Passed as ``warmup=`` to a length-grouped sampler (whose ``batch_size`` or
    ``max_tokens`` must equal ``target``), it cuts the first batches of the plan smaller; used on
    its own, it is a plain schedule for any loop.
    """

    start: int
    target: int
    steps: int
    multiple_of: int = 1

    def __post_init__(self) -> None:
        check_int("BatchSizeWarmup.start", self.start, minimum=1)
        check_int("BatchSizeWarmup.target", self.target, minimum=self.start)
        check_int("BatchSizeWarmup.steps", self.steps, minimum=0)
        check_int("BatchSizeWarmup.multiple_of", self.multiple_of, minimum=1)

    def size_at(self, step: int) -> int:
        """The batch size (rows or tokens) of optimizer step ``step`` (counted from 0)."""
        if step >= self.steps:
            return self.target
        raw = self.start + (self.target - self.start) * step // self.steps
        return max(self.start, raw // self.multiple_of * self.multiple_of)

    __call__ = size_at


def warmup_recut(
    plan: EpochPlan,
    schedule: BatchSizeWarmup,
    *,
    first_step: int,
    replicas: int,
    by_tokens: bool,
) -> EpochPlan:
    """``plan`` with its first batches split to follow ``schedule``.

    Global batch ``j`` of the result is rank ``j % replicas``'s batch of step
    ``first_step + j // replicas``. Each planned batch is split front to back into pieces of the
    step's size: ``size_at(step)`` rows, or with ``by_tokens`` the longest prefix whose padded size
    fits ``size_at(step)`` tokens (at least one row: a sample longer than the warm-up budget forms
    a batch of its own, still within ``max_tokens``). Once the warm-up is over, the remaining
    batches are kept as planned. Splitting never moves a sample, so the plan still covers the
    epoch exactly once.
    """
    if first_step >= schedule.steps or plan.num_batches == 0:
        return plan
    starts: list[int] = []
    stops: list[int] = []

    def step_of_next_piece() -> int:
        return first_step + len(starts) // replicas

    batch = 0
    # Loops once per warm-up piece: at most steps * replicas iterations, never per sample.
    while batch < plan.num_batches and step_of_next_piece() < schedule.steps:
        start, stop = int(plan.starts[batch]), int(plan.stops[batch])
        while start < stop and step_of_next_piece() < schedule.steps:
            size = schedule.size_at(step_of_next_piece())
            if by_tokens:
                padded_sizes = np.arange(1, stop - start + 1) * plan.padded_lengths(start, stop)
                take = max(1, int(np.count_nonzero(padded_sizes <= size)))
            else:
                take = size
            starts.append(start)
            start = min(start + take, stop)
            stops.append(start)
        if start < stop:  # the warm-up ended inside this batch: its rest stays one batch
            starts.append(start)
            stops.append(stop)
        batch += 1
    return plan.reordered(
        np.concatenate((np.asarray(starts, dtype=np.int64), plan.starts[batch:])),
        np.concatenate((np.asarray(stops, dtype=np.int64), plan.stops[batch:])),
    )
