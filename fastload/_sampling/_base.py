"""The stateful shell shared by the length-grouped samplers: epochs, ranks, ``len``, iteration
and exact resume.

It is thin over pure functions: ``_plan.plan_epoch`` builds an epoch's global batches,
``_shard`` deals them to ranks, a ``Cursor`` records how far the epoch has gone and ``_state``
turns it into a plain dict. The samplers differ only in which samples form an epoch.
"""

from __future__ import annotations

import abc
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import torch.distributed
from torch.utils.data import Sampler

from fastload._sampling._keys import LengthCodec, bit_width
from fastload._sampling._options import (
    OVERSIZE_POLICIES,
    BatchingOptions,
    as_lengths,
    check_choice,
    check_int,
    check_optional_int,
    round_up,
)
from fastload._sampling._plan import EpochPlan, plan_epoch
from fastload._sampling._schedule import BatchSizeWarmup, warmup_recut
from fastload._sampling._shard import Cursor, per_rank_count, rank_positions
from fastload._sampling._state import dump_state, load_state
from fastload.errors import OversizeSampleError


def default_world() -> tuple[int, int]:
    """``(world size, rank)`` of the initialised default process group, else ``(1, 0)``."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return 1, 0


class _RankIterator:
    """Yields one rank's remaining batches of a plan and counts them (for ``state_dict``)."""

    def __init__(
        self, plan: EpochPlan, positions: npt.NDArray[np.int64], *, as_lists: bool
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
        return batch.tolist() if self._as_lists else batch


class GroupedBatchSamplerBase(Sampler[list[int]], abc.ABC):
    """Epochs, ranks, ``len``, iteration and exact resume, for any population of samples.

    Subclasses say which samples form an epoch (``_epoch_population``), how many there are
    (``_population_size``) and their mean padded length (``_mean_padded_length``).
    """

    def __init__(
        self,
        lengths: npt.ArrayLike,
        *,
        batch_size: int | None,
        max_tokens: int | None,
        shuffle: bool,
        seed: int,
        drop_last: bool,
        pad_to_multiple_of: int | None,
        num_replicas: int | None,
        rank: int | None,
        longest_first: bool,
        oversize: str,
        window: int | None,
        warmup: BatchSizeWarmup | None,
    ) -> None:
        super().__init__()
        self._options = BatchingOptions.create(
            batch_size=batch_size,
            max_tokens=max_tokens,
            pad_to_multiple_of=pad_to_multiple_of,
            window=window,
            shuffle=shuffle,
            drop_last=drop_last,
            longest_first=longest_first,
        )
        self._seed = check_int("seed", seed, minimum=0)
        self._oversize = check_choice("oversize", oversize, OVERSIZE_POLICIES)
        self._num_replicas, self._rank = _resolve_world(num_replicas, rank)
        self._warmup = _check_warmup(warmup, self._options)
        self._lengths = as_lengths("lengths", lengths)
        self._padded, self._kept = self._apply_oversize_policy()
        self._codec_cache: tuple[LengthCodec, float] | None = None
        self._lengths_checksum: int | None = None
        self._plan_cache: tuple[tuple[int, int, int], EpochPlan] | None = None
        self._warmup_steps: dict[tuple[int, int, int], int] = {}  # per-rank steps of epochs
        self._epoch = 0
        self._pending: Cursor | None = None  # set by load_state_dict, used by the next __iter__
        self._current = Cursor.fresh(0, self._num_replicas)  # where the latest stream began
        self._iterator: _RankIterator | None = None  # the latest stream

    # -- what subclasses provide -------------------------------------------------------------

    @abc.abstractmethod
    def _population_size(self) -> int:
        """Samples per epoch (they size the sort windows and the key bits)."""

    @abc.abstractmethod
    def _mean_padded_length(self) -> float:
        """The expected padded length of an epoch's sample (sizes the sort windows); computed
        once, with a summation order that is the same on every machine."""

    @abc.abstractmethod
    def _epoch_population(self, epoch: int) -> npt.NDArray[np.int64]:
        """The sample indices that make up ``epoch`` (duplicates allowed), in a fixed order."""

    def _epoch_payloads(self, epoch: int) -> npt.NDArray[np.int64]:
        """Sort payloads of ``_epoch_population(epoch)`` (the plan does not modify them)."""
        population = self._epoch_population(epoch)
        return self._codec()[0].encode(population, self._padded[population])

    def _population_state(self) -> dict[str, Any]:
        """What identifies the population, kept in ``state_dict`` and checked on load."""
        if self._lengths_checksum is None:
            self._lengths_checksum = zlib.crc32(self._lengths.tobytes())
        return {"num_samples": int(self._lengths.size), "lengths_crc32": self._lengths_checksum}

    # -- public properties -------------------------------------------------------------------

    @property
    def lengths(self) -> npt.NDArray[np.int64]:
        """The per-sample lengths (read-only int64)."""
        return self._lengths

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
    def batch_size(self) -> int | None:
        return self._options.batch_size

    @property
    def max_tokens(self) -> int | None:
        return self._options.max_tokens

    @property
    def pad_to_multiple_of(self) -> int | None:
        multiple = self._options.pad_to_multiple_of
        return None if multiple == 1 else multiple

    @property
    def skipped(self) -> int:
        """How many samples ``oversize="skip"`` leaves out of every epoch (0 for other policies)."""
        return int(self._lengths.size - np.count_nonzero(self._kept))

    @property
    def truncate_length(self) -> int | None:
        """With ``oversize="truncate"``: the length the collate must cut longer samples to
        (``max_tokens`` rounded down to ``pad_to_multiple_of``); else ``None``."""
        if self._oversize != "truncate" or self._options.max_tokens is None:
            return None
        multiple = self._options.pad_to_multiple_of
        return self._options.max_tokens // multiple * multiple

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
            plan.num_batches, cursor.start, cursor.replicas, drop_last=self._options.drop_last
        )
        return total - cursor.consumed

    def __iter__(self) -> Iterator[list[int]]:
        """This rank's batches of the current epoch as lists of ints (from the resume point
        after ``load_state_dict``)."""
        return self._start(as_lists=True)

    def iter_arrays(self) -> Iterator[npt.NDArray[np.int64]]:
        """Like ``iter()``, but each batch is a read-only int64 array (no Python ints made),
        for the engine's fast path. Counts towards ``state_dict`` the same way."""
        return self._start(as_lists=False)

    def _start(self, *, as_lists: bool) -> _RankIterator:
        if self._pending is not None:
            cursor, self._pending = self._pending, None
        else:
            cursor = Cursor.fresh(self._epoch, self._num_replicas)
        plan = self._plan(cursor.epoch, cursor.plan_replicas)
        positions = rank_positions(
            plan.num_batches, cursor, self._rank, drop_last=self._options.drop_last
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
        drop_last = self._options.drop_last
        available = per_rank_count(
            plan.num_batches, saved.start, saved.replicas, drop_last=drop_last
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

    # -- planning ------------------------------------------------------------------------------

    def _identity(self) -> dict[str, Any]:
        """What shaped the plan: a state is only loaded into a sampler with the same."""
        return {
            "sampler": type(self).__name__,
            "population": self._population_state(),
            "options": self._options_state(),
        }

    def _options_state(self) -> dict[str, Any]:
        warmup = self._warmup
        return {
            **self._options.as_state(),
            "oversize": self._oversize,
            "warmup": None
            if warmup is None
            else [warmup.start, warmup.target, warmup.steps, warmup.multiple_of],
        }

    def _apply_oversize_policy(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
        """Padded lengths (after truncation) of every sample, and which samples take part."""
        multiple = self._options.pad_to_multiple_of
        padded = round_up(self._lengths, multiple)
        kept = np.ones(self._lengths.size, dtype=bool)
        budget = self._options.max_tokens
        if budget is None:
            return padded, kept
        over = padded > budget
        if not over.any():
            return padded, kept
        if self._oversize == "skip":
            return padded, ~over
        if self._oversize == "truncate":
            return np.minimum(padded, budget // multiple * multiple), kept
        first = int(np.flatnonzero(over)[0])
        rounding = f" (padded to {int(padded[first])})" if multiple > 1 else ""
        raise OversizeSampleError(
            f"sample {first} has length {int(self._lengths[first])}{rounding}, more than "
            f"max_tokens={budget}; {int(over.sum())} samples in all are longer than the budget. "
            "Raise max_tokens, or pass oversize='skip' to leave them out or "
            "oversize='truncate' to cut them to the budget"
        )

    def _codec(self) -> tuple[LengthCodec, float]:
        """The sort-key codec and the population's mean padded length (built on first use)."""
        if self._codec_cache is None:
            mean = self._mean_padded_length()
            per_window = self._options.samples_per_window(self._population_size(), mean)
            windows = -(-self._population_size() // per_window)
            codec = LengthCodec.build(self._padded, label_bits=bit_width(windows))
            self._codec_cache = (codec, mean)
        return self._codec_cache

    def _plan(self, epoch: int, plan_replicas: int) -> EpochPlan:
        """The global plan of ``epoch`` built for ``plan_replicas`` ranks (cached: one epoch)."""
        key = (self._seed, epoch, plan_replicas)
        if self._plan_cache is not None and self._plan_cache[0] == key:
            return self._plan_cache[1]
        codec, mean = self._codec()
        plan = plan_epoch(
            self._epoch_payloads(epoch),
            codec,
            self._padded,
            self._options,
            mean_padded_length=mean,
            seed=self._seed,
            epoch=epoch,
            num_replicas=plan_replicas,
        )
        if self._warmup is not None:
            plan = warmup_recut(
                plan,
                self._warmup,
                first_step=self._warmup_first_step(epoch, plan_replicas),
                replicas=plan_replicas,
                by_tokens=self._options.max_tokens is not None,
            )
        self._plan_cache = (key, plan)
        return plan

    def _warmup_first_step(self, epoch: int, plan_replicas: int) -> int:
        """Steps (per rank) of the epochs before ``epoch``, as far as the warm-up needs to know:
        once they reach the warm-up's length, the exact number no longer matters."""
        assert self._warmup is not None
        steps = 0
        for earlier in range(epoch):
            if steps >= self._warmup.steps:
                break
            key = (self._seed, earlier, plan_replicas)
            if key not in self._warmup_steps:
                plan = self._plan(earlier, plan_replicas)
                self._warmup_steps[key] = per_rank_count(
                    plan.num_batches, 0, plan_replicas, drop_last=self._options.drop_last
                )
            steps += self._warmup_steps[key]
        return steps


def _resolve_world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    world, own_rank = default_world()
    replicas = check_optional_int("num_replicas", num_replicas, minimum=1) or world
    chosen = own_rank if rank is None else check_int("rank", rank, minimum=0)
    if chosen >= replicas:
        raise ValueError(f"rank must be < num_replicas={replicas}; got rank={chosen}")
    return replicas, chosen


def _check_warmup(
    warmup: BatchSizeWarmup | None, options: BatchingOptions
) -> BatchSizeWarmup | None:
    if warmup is None:
        return None
    if not isinstance(warmup, BatchSizeWarmup):
        raise TypeError(f"warmup must be a BatchSizeWarmup or None; got {type(warmup).__name__}")
    unit, target = (
        ("max_tokens", options.max_tokens)
        if options.max_tokens is not None
        else ("batch_size", options.batch_size)
    )
    if warmup.target != target:
        raise ValueError(
            f"warmup.target={warmup.target} must equal {unit}={target}: the warm-up grows the "
            f"{unit} of the batches up to it"
        )
    return warmup
