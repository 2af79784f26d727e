"""Dealing an epoch's global batches to ranks, and the cursor that makes resume exact.

A *deal* hands the global plan's batches ``start, start + 1, ...`` round-robin to ``replicas``
ranks: position ``start + j * replicas + rank`` is rank ``rank``'s ``j``-th batch. Every rank gets
the same count, because DDP hangs when one rank runs out of batches before the others:

* by default the tail is **padded** by repeating the deal's first batches (``start``,
  ``start + 1``, ...), so a few samples are seen twice in that epoch; a plan with padding
  batches of its own (packing: rows of padding only) takes positions past its end instead;
* with ``drop_last`` the last ``(num_batches - start) % replicas`` batches are **dropped**.

Resuming with the same world size continues the same deal. Resuming with another world size
starts a new deal at the first global batch not yet consumed by any rank
(``start + consumed * replicas``), so the rest of the epoch covers exactly the unseen batches.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True)
class Cursor:
    """Where a rank's batch stream of one epoch stands.

    ``plan_replicas`` is the world size the epoch's plan was built for (``longest_first`` and the
    warm-up depend on it); ``start`` and ``replicas`` describe the current deal; ``consumed`` is
    how many of the deal's batches every rank has consumed.
    """

    epoch: int
    plan_replicas: int
    start: int
    replicas: int
    consumed: int

    @classmethod
    def fresh(cls, epoch: int, replicas: int) -> Cursor:
        """The start of ``epoch`` on ``replicas`` ranks."""
        return cls(epoch=epoch, plan_replicas=replicas, start=0, replicas=replicas, consumed=0)

    def advanced(self, batches: int) -> Cursor:
        return replace(self, consumed=self.consumed + batches)

    def redealt(self, num_batches: int, replicas: int) -> Cursor:
        """This cursor on ``replicas`` ranks: unchanged for the same world size, else a new deal
        that begins at the first global batch no rank has consumed."""
        if replicas == self.replicas:
            return self
        start = min(self.start + self.consumed * self.replicas, num_batches)
        return replace(self, start=start, replicas=replicas, consumed=0)


def per_rank_count(num_batches: int, start: int, replicas: int, *, drop_last: bool) -> int:
    """How many batches each rank gets from a deal of the plan's batches ``start ..
    num_batches - 1`` over ``replicas`` ranks."""
    remaining = max(num_batches - start, 0)
    return remaining // replicas if drop_last else -(-remaining // replicas)


def rank_positions(
    num_batches: int, cursor: Cursor, rank: int, *, drop_last: bool, wrap: bool = True
) -> npt.NDArray[np.int64]:
    """Global plan positions of the batches rank ``rank`` still has to consume, in order.
    Without ``wrap``, the padding of the last round is positions past the plan's end (the plan's
    own padding batches) instead of the deal's first batches again."""
    count = per_rank_count(num_batches, cursor.start, cursor.replicas, drop_last=drop_last)
    steps = np.arange(cursor.consumed, count, dtype=np.int64)
    offsets = steps * cursor.replicas + rank  # offsets into the deal
    remaining = num_batches - cursor.start
    if wrap and remaining > 0:
        offsets %= remaining  # padding wraps around to the deal's first batches
    return cursor.start + offsets
