"""What the length-grouped samplers share: their options, the oversize policy, the sort-key
codec and the epoch plan (``_plan.plan_epoch``, then the warm-up's recut), on the shell of
``_stream.py`` (epochs, ranks, ``len``, iteration, exact resume). The samplers differ only in
which samples form an epoch.
"""

from __future__ import annotations

import abc
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from fastload._sampling._batch_options import (
    OVERSIZE_POLICIES,
    BatchingOptions,
    as_lengths,
    check_choice,
    round_up,
)
from fastload._sampling._epoch_plan import EpochPlan, plan_epoch
from fastload._sampling._keys import LengthCodec, bit_width
from fastload._sampling._shard_window import ShardGroups, ShardWindow
from fastload._sampling._stream import PlannedBatchSampler
from fastload._sampling._warmup import BatchSizeWarmup, warmup_recut
from fastload.errors import OversizeSampleError


class GroupedBatchSamplerBase(PlannedBatchSampler):
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
        shuffle_shards: int | None = None,
        shard_sizes: Sequence[int] | npt.ArrayLike | None = None,
    ) -> None:
        super().__init__(seed=seed, num_replicas=num_replicas, rank=rank, drop_last=drop_last)
        self._options = BatchingOptions.create(
            batch_size=batch_size,
            max_tokens=max_tokens,
            pad_to_multiple_of=pad_to_multiple_of,
            window=window,
            shuffle=shuffle,
            drop_last=drop_last,
            longest_first=longest_first,
        )
        self._oversize = check_choice("oversize", oversize, OVERSIZE_POLICIES)
        self._warmup = _check_warmup(warmup, self._options)
        self._lengths = as_lengths("lengths", lengths)
        self._shard_window = ShardWindow.create(
            shuffle_shards, shard_sizes, num_samples=self._lengths.size, shuffle=shuffle
        )
        self._padded, self._kept = self._apply_oversize_policy()
        self._codec_cache: tuple[LengthCodec, float] | None = None
        self._lengths_checksum: int | None = None
        self._plan_cache: tuple[tuple[int, int, int], EpochPlan] | None = None

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

    def _epoch_groups(self, epoch: int) -> ShardGroups | None:
        """The epoch's groups of shards and the shard of each of ``_epoch_population(epoch)``'s
        samples, for a shard-window shuffle of more than one group; else ``None``."""
        return None

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
        state: dict[str, Any] = {
            **self._options.as_state(),
            "oversize": self._oversize,
            "warmup": None
            if warmup is None
            else [warmup.start, warmup.target, warmup.steps, warmup.multiple_of],
        }
        if self._shard_window is not None:  # absent otherwise: earlier states still load
            state["shard_window"] = self._shard_window.state()
        return state

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
            if self._shard_window is not None:  # each group rounds its window count up
                windows += self._shard_window.num_groups - 1
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
            groups=self._epoch_groups(epoch),
        )
        if self._warmup is not None:
            plan = warmup_recut(
                plan,
                self._warmup,
                first_step=self._steps_before(epoch, plan_replicas, enough=self._warmup.steps),
                replicas=plan_replicas,
                by_tokens=self._options.max_tokens is not None,
            )
        self._plan_cache = (key, plan)
        return plan


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
