"""The stateful shell of fastload's planned batch samplers: epochs, ranks, ``len``, iteration
and exact resume, for any plan of global batches.

A subclass plans an epoch's global batches (``_plan``, a pure function of its settings, the seed,
the epoch and the number of ranks); ``_shard`` deals them to ranks, a ``Cursor`` records how far
the epoch has gone and ``_state`` turns it into a plain dict. Where the batches do not divide
evenly among the ranks, the last round is filled by the plan: with repeats of the deal's first
batches (``wraps``), or with the plan's own padding batches (positions past its end).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch.distributed
from torch.utils.data import Sampler

from fastload._sampling._batch_options import check_int, check_optional_int
from fastload._sampling._ranks import Cursor, per_rank_count, rank_positions
from fastload._sampling._state import dump_state, load_state
from fastload._types import PackedBatch


class GlobalPlan(Protocol):
    """An epoch's global batches, in training order."""

    @property
    def num_batches(self) -> int: ...

    def batch(self, position: int) -> Any:
        """Global batch ``position`` (past ``num_batches``: a padding batch, for plans whose
        sampler does not wrap)."""


def default_world() -> tuple[int, int]:
    """``(world size, rank)`` of the initialised default process group, else ``(1, 0)``."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return 1, 0


def resolve_world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """``(num_replicas, rank)``: as given, else those of the default process group."""
    world, own_rank = default_world()
    replicas = check_optional_int("num_replicas", num_replicas, minimum=1) or world
    chosen = own_rank if rank is None else check_int("rank", rank, minimum=0)
    if chosen >= replicas:
        raise ValueError(f"rank must be < num_replicas={replicas}; got rank={chosen}")
    return replicas, chosen


class _RankIterator:
    """Yields one rank's remaining batches of a plan and counts them (for ``state_dict``)."""

    def __init__(
        self, plan: GlobalPlan, positions: npt.NDArray[np.int64], *, as_lists: bool
    ) -> None:
        self._plan = plan
        self._positions = positions.tolist()
        self._as_lists = as_lists
        self.yielded = 0

    def __iter__(self) -> _RankIterator:
        return self

    def __len__(self) -> int:
        return len(self._positions) - self.yielded

    @property
    def total(self) -> int:
        return len(self._positions)

    def __next__(self) -> Any:
        if self.yielded >= len(self._positions):
            raise StopIteration
        batch = self._plan.batch(self._positions[self.yielded])
        self.yielded += 1
        return batch.tolist() if self._as_lists and isinstance(batch, np.ndarray) else batch


class PlannedBatchSampler(Sampler[Any], abc.ABC):
    """Epochs, ranks, ``len``, iteration and exact resume over a subclass's epoch plans.

    Subclasses provide ``_plan`` (the global batches of an epoch for a number of ranks) and
    ``_identity`` (what shaped the plan: a saved state loads only into the same), and set
    ``wraps`` and ``_drop_last``.
    """

    #: Whether the last round of ranks repeats the deal's first batches (else the plan's
    #: positions past its end, its padding batches, fill it).
    wraps = True

    #: Called with no argument whenever an iteration starts (``iter()`` or ``iter_arrays()``),
    #: if set. ``fastload.DataLoader`` sets it on the sampler it owns, to notice the sampler
    #: being iterated by a loader that is not fastload's (a framework that rebuilt the loader as
    #: torch's); the sampler itself knows nothing of loaders.
    on_iter: Callable[[], None] | None = None

    def __init__(self, *, seed: int, num_replicas: int | None, rank: int | None, drop_last: bool) -> None:
        super().__init__()
        self._seed = check_int("seed", seed, minimum=0)
        self._num_replicas, self._rank = resolve_world(num_replicas, rank)
        self._drop_last = bool(drop_last)
        self._epoch = 0
        self._pending: Cursor | None = None  # set by load_state_dict, used by the next __iter__
        self._current = Cursor.fresh(0, self._num_replicas)  # where the latest stream began
        self._iterator: _RankIterator | None = None  # the latest stream
        self._epoch_steps: dict[tuple[int, int, int], int] = {}  # per-rank steps of epochs

    @abc.abstractmethod
    def _plan(self, epoch: int, plan_replicas: int) -> GlobalPlan:
        """The global plan of ``epoch`` for ``plan_replicas`` ranks."""

    @abc.abstractmethod
    def _identity(self) -> dict[str, Any]:
        """What shaped the plan (JSON-able): a state is only loaded into a sampler with the
        same."""

    def _steps_before(self, epoch: int, plan_replicas: int, *, enough: int) -> int:
        """Per-rank steps of the epochs before ``epoch`` (for a warm-up), counted until they
        reach ``enough``: past that, the exact number no longer matters."""
        steps = 0
        for earlier in range(epoch):
            if steps >= enough:
                break
            key = (self._seed, earlier, plan_replicas)
            if key not in self._epoch_steps:
                plan = self._plan(earlier, plan_replicas)
                self._epoch_steps[key] = per_rank_count(
                    plan.num_batches, 0, plan_replicas, drop_last=self._drop_last
                )
            steps += self._epoch_steps[key]
        return steps

    # -- public properties -------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def num_replicas(self) -> int:
        return self._num_replicas

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def drop_last(self) -> bool:
        """Whether batches that do not divide evenly among the ranks are dropped."""
        return self._drop_last

    # -- epochs and iteration ----------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Plan ``epoch`` next. A resume point loaded for this same epoch is kept, so the usual
        ``load_state_dict`` then ``set_epoch(saved epoch)`` resumes where the run stopped."""
        epoch = check_int("epoch", epoch, minimum=0)
        if self._pending is not None and self._pending.epoch == epoch:
            return
        self._pending = None
        self._epoch = epoch
        self._current = Cursor.fresh(epoch, self._num_replicas)
        self._iterator = None

    def __len__(self) -> int:
        """Batches this rank's ``iter()`` yields: the epoch's count, or after ``load_state_dict``
        the count left in the resumed epoch (until an iteration restarts the epoch)."""
        cursor = self._pending if self._pending is not None else self._current
        plan = self._plan(cursor.epoch, cursor.plan_replicas)
        total = per_rank_count(
            plan.num_batches, cursor.start, cursor.replicas, drop_last=self._drop_last
        )
        return total - cursor.consumed

    def __iter__(self) -> Iterator[Any]:
        """This rank's batches of the current epoch (from the resume point after
        ``load_state_dict``)."""
        return self._start(as_lists=True)

    def iter_arrays(self) -> Iterator[Any]:
        """Like ``iter()``, but index batches come as read-only int64 arrays (no Python ints
        made), for the engine's fast path. Counts towards ``state_dict`` the same way."""
        return self._start(as_lists=False)

    def upcoming(self) -> Iterator[npt.NDArray[np.int64]]:
        """The sample indices of the batches the latest ``iter()`` has still to yield, in
        order, without consuming them: what a prefetcher reads ahead of the workers (a packed
        batch gives the samples of its pieces)."""
        stream = self._iterator
        if stream is None:
            return iter(())
        plan, positions = stream._plan, stream._positions[stream.yielded :]

        def batches() -> Iterator[npt.NDArray[np.int64]]:
            for position in positions:
                batch = plan.batch(position)
                yield np.asarray(batch.samples if isinstance(batch, PackedBatch) else batch, dtype=np.int64)

        return batches()

    def _start(self, *, as_lists: bool) -> _RankIterator:
        if self.on_iter is not None:
            self.on_iter()
        if self._pending is not None:
            cursor, self._pending = self._pending, None
        else:
            cursor = Cursor.fresh(self._epoch, self._num_replicas)
        plan = self._plan(cursor.epoch, cursor.plan_replicas)
        positions = rank_positions(
            plan.num_batches, cursor, self._rank, drop_last=self._drop_last, wrap=self.wraps
        )
        self._current = cursor
        self._iterator = _RankIterator(plan, positions, as_lists=as_lists)
        return self._iterator

    # -- exact resume --------------------------------------------------------------------------

    def state_dict(self, *, batches_consumed: int | None = None) -> dict[str, Any]:
        """A JSON-able snapshot from which ``load_state_dict`` resumes exactly.

        ``batches_consumed`` is how many batches of the latest ``iter()`` the consumer has
        received; it defaults to how many that iterator has yielded. A loader that prefetches
        passes the number it delivered, so prefetched batches are not counted as seen. The same
        state is valid on every rank (all DDP ranks consume the same number of batches).
        """
        if self._pending is None and self._iterator is not None:
            base, available, yielded = self._current, self._iterator.total, self._iterator.yielded
        else:  # nothing iterated since construction, set_epoch or load_state_dict
            base = self._pending if self._pending is not None else self._current
            available, yielded = len(self), 0
        consumed = (
            yielded
            if batches_consumed is None
            else check_int("batches_consumed", batches_consumed, minimum=0)
        )
        if consumed > available:
            raise ValueError(
                f"batches_consumed={consumed} exceeds the {available} batches this rank's "
                f"iteration of epoch {base.epoch} yields"
            )
        return dump_state(base.advanced(consumed), seed=self._seed, identity=self._identity())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Make the next ``iter()`` continue the saved epoch exactly where it stopped; later
        epochs (``set_epoch``) proceed normally. The seed is taken from ``state``.

        A state saved on another number of ranks is re-dealt: the global batches no rank had
        consumed are spread over this world size with equal counts, so the rest of the epoch
        covers exactly the unseen samples once (plus the documented padding).
        """
        seed, saved = load_state(state, identity=self._identity())
        previous_seed, self._seed = self._seed, seed
        plan = self._plan(saved.epoch, saved.plan_replicas)
        available = per_rank_count(
            plan.num_batches, saved.start, saved.replicas, drop_last=self._drop_last
        )
        if saved.start > plan.num_batches or saved.consumed > available:
            self._seed = previous_seed  # leave the sampler as it was
            raise ValueError(
                f"sampler state says {saved.consumed} batches of epoch {saved.epoch} were consumed "
                f"from global batch {saved.start} on, but that epoch has {plan.num_batches} "
                f"batches, {available} per rank from there"
            )
        self._epoch = saved.epoch
        self._pending = saved.redealt(plan.num_batches, self._num_replicas)
        self._current = self._pending
        self._iterator = None


__all__ = ["GlobalPlan", "PlannedBatchSampler", "default_world", "resolve_world"]
