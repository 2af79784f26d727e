"""Weighted sampling and dataset mixing, both with length grouping.

Both draw each epoch's samples from a seeded generator (a pure function of ``(seed, epoch)``),
then hand the draw to the same planner, dealer and resume logic as
:class:`~fastload.LengthGroupedBatchSampler`: only *which* samples form an epoch differs.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from fastload._sampling._base import GroupedBatchSamplerBase
from fastload._sampling._options import as_lengths, check_int, check_optional_int
from fastload._sampling._plan import STREAM_DRAW, epoch_rng
from fastload._sampling._schedule import BatchSizeWarmup


def _as_weights(name: str, values: npt.ArrayLike, size: int) -> npt.NDArray[np.float64]:
    weights = np.array(values, dtype=np.float64, copy=True)
    if weights.shape != (size,):
        raise ValueError(f"{name} must have shape ({size},), one per sample; got {weights.shape}")
    bad = ~np.isfinite(weights) | (weights < 0)
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{name}[{first}] is {weights[first]}; weights must be finite and >= 0")
    weights.flags.writeable = False
    return weights


class WeightedLengthGroupedSampler(GroupedBatchSamplerBase):
    """Draws ``num_samples`` samples per epoch with probability proportional to ``weights``
    (like ``torch.utils.data.WeightedRandomSampler``), then batches them by length exactly like
    :class:`~fastload.LengthGroupedBatchSampler`, whose options it shares.

    * ``replacement=True`` (default): independent draws; a sample may appear several times in an
      epoch (in several batches or twice in one).
    * ``replacement=False``: ``num_samples`` distinct samples (at most the number of positive
      weights), drawn by weighted sampling without replacement (exponential keys).

    ``num_samples`` defaults to ``len(lengths)``. Samples that ``oversize="skip"`` leaves out, and
    samples of weight 0, are never drawn. Resume, ranks and ``len`` behave as for
    ``LengthGroupedBatchSampler``: the draw is a function of ``(seed, epoch)`` alone.
    """

    def __init__(
        self,
        lengths: npt.ArrayLike,
        weights: npt.ArrayLike,
        *,
        num_samples: int | None = None,
        replacement: bool = True,
        batch_size: int | None = None,
        max_tokens: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        pad_to_multiple_of: int | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
        longest_first: bool = False,
        oversize: str = "error",
        window: int | None = 100,
        warmup: BatchSizeWarmup | None = None,
    ) -> None:
        super().__init__(
            lengths,
            batch_size=batch_size,
            max_tokens=max_tokens,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            pad_to_multiple_of=pad_to_multiple_of,
            num_replicas=num_replicas,
            rank=rank,
            longest_first=longest_first,
            oversize=oversize,
            window=window,
            warmup=warmup,
        )
        if not isinstance(replacement, bool):
            raise TypeError(f"replacement must be True or False; got {replacement!r}")
        weights = _as_weights("weights", weights, self._lengths.size)
        self._checksum = zlib.crc32(weights.tobytes())
        effective = np.where(self._kept, weights, 0.0)
        self._candidates = np.flatnonzero(effective > 0).astype(np.int64)
        self._candidate_weights = effective[self._candidates]
        count = check_optional_int("num_samples", num_samples, minimum=0)
        self._num_samples = int(self._lengths.size) if count is None else count
        self._replacement = replacement
        if self._num_samples and not self._candidates.size:
            raise ValueError(
                "every weight is 0 (or belongs to a sample oversize='skip' left out); "
                f"cannot draw num_samples={self._num_samples}"
            )
        if not replacement and self._num_samples > self._candidates.size:
            raise ValueError(
                f"num_samples={self._num_samples} exceeds the {self._candidates.size} samples "
                "with positive weight, as replacement=False requires"
            )

    def _population_size(self) -> int:
        return self._num_samples

    def _mean_padded_length(self) -> float:
        if not self._candidates.size:
            return 1.0
        # Elementwise product and numpy's sum, not np.dot: BLAS kernels sum in a CPU-dependent
        # order, and this mean sizes the windows, which must be identical on every rank.
        padded = self._padded[self._candidates]
        weighted = (padded * self._candidate_weights).sum()
        return float(weighted / self._candidate_weights.sum())

    def _epoch_population(self, epoch: int) -> npt.NDArray[np.int64]:
        rng = epoch_rng(self._seed, epoch, STREAM_DRAW)
        if self._replacement:
            cumulative = np.cumsum(self._candidate_weights)
            targets = rng.random(self._num_samples) * cumulative[-1]
            picks = np.searchsorted(cumulative, targets, side="right")
            return self._candidates[np.minimum(picks, self._candidates.size - 1)]
        if self._num_samples == 0:
            return np.zeros(0, dtype=np.int64)
        # Efraimidis-Spirakis: the k smallest Exp(1) / weight keys are a weighted draw without
        # replacement. The chosen set does not depend on the partition algorithm; sorting it
        # fixes the order.
        keys = rng.standard_exponential(self._candidates.size) / self._candidate_weights
        chosen = np.argpartition(keys, self._num_samples - 1)[: self._num_samples]
        return self._candidates[np.sort(chosen)]

    def _population_state(self) -> dict[str, Any]:
        return {
            **super()._population_state(),
            "draws": self._num_samples,
            "replacement": self._replacement,
            "weights_crc32": self._checksum,
        }


class MixtureBatchSampler(GroupedBatchSamplerBase):
    """Length-grouped batches over several datasets mixed in given proportions.

    ``lengths`` holds one length array per dataset. Indices are global over the datasets
    concatenated in that order, as in ``torch.utils.data.ConcatDataset``: dataset ``d``'s sample
    ``i`` is index ``offsets[d] + i``.

    Each epoch has ``num_samples`` samples (default: all datasets' sizes summed), of which
    dataset ``d`` contributes ``proportions[d] / sum(proportions)`` (rounded by largest
    remainder, so the counts add up exactly). A dataset asked for more samples than it has
    repeats all of them as often as it fits and draws the rest without replacement; one asked
    for fewer contributes a fresh seeded subset each epoch. Batches mix datasets and are
    grouped by length like :class:`~fastload.LengthGroupedBatchSampler`, whose options it
    shares.
    """

    def __init__(
        self,
        lengths: Sequence[npt.ArrayLike],
        *,
        proportions: Sequence[float],
        num_samples: int | None = None,
        batch_size: int | None = None,
        max_tokens: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        pad_to_multiple_of: int | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
        longest_first: bool = False,
        oversize: str = "error",
        window: int | None = 100,
        warmup: BatchSizeWarmup | None = None,
    ) -> None:
        parts = [as_lengths(f"lengths[{d}]", part) for d, part in enumerate(lengths)]
        if not parts:
            raise ValueError("lengths must hold at least one dataset's length array; got none")
        shares = _as_weights("proportions", proportions, len(parts))
        if shares.sum() <= 0:
            raise ValueError(f"proportions must not all be 0; got {list(proportions)}")
        super().__init__(
            np.concatenate(parts),
            batch_size=batch_size,
            max_tokens=max_tokens,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            pad_to_multiple_of=pad_to_multiple_of,
            num_replicas=num_replicas,
            rank=rank,
            longest_first=longest_first,
            oversize=oversize,
            window=window,
            warmup=warmup,
        )
        sizes = np.array([part.size for part in parts], dtype=np.int64)
        self._offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
        self._offsets.flags.writeable = False
        self._shares = shares / shares.sum()
        total = int(sizes.sum()) if num_samples is None else num_samples
        self._num_samples = check_int("num_samples", total, minimum=0)
        self._counts = _largest_remainder(self._shares, self._num_samples)
        self._members = [
            np.flatnonzero(self._kept[self._offsets[d] : self._offsets[d + 1]]) + self._offsets[d]
            for d in range(len(parts))
        ]
        for d, (count, members) in enumerate(zip(self._counts, self._members, strict=True)):
            if count and not members.size:
                raise ValueError(
                    f"dataset {d} is asked for {count} samples per epoch (proportion "
                    f"{self._shares[d]:.4g}) but has none to give"
                    + (" after oversize='skip'" if sizes[d] else "")
                )

    @property
    def offsets(self) -> npt.NDArray[np.int64]:
        """Dataset ``d`` owns the global indices ``offsets[d] .. offsets[d + 1] - 1``."""
        return self._offsets

    @property
    def samples_per_dataset(self) -> list[int]:
        """How many samples each dataset contributes to every epoch."""
        return [int(count) for count in self._counts]

    def _population_size(self) -> int:
        return self._num_samples

    def _mean_padded_length(self) -> float:
        means = [
            int(self._padded[members].sum()) / members.size if members.size else 0.0
            for members in self._members
        ]
        return max(
            1.0, math.fsum(share * mean for share, mean in zip(self._shares, means, strict=True))
        )

    def _epoch_population(self, epoch: int) -> npt.NDArray[np.int64]:
        rng = epoch_rng(self._seed, epoch, STREAM_DRAW)
        chosen = []
        for count, members in zip(self._counts, self._members, strict=True):
            if not count:
                continue
            repeats, rest = divmod(int(count), members.size)
            chosen.append(np.tile(members, repeats))
            chosen.append(np.sort(rng.choice(members, rest, replace=False)))
        if not chosen:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate(chosen).astype(np.int64)

    def _population_state(self) -> dict[str, Any]:
        return {
            **super()._population_state(),
            "dataset_sizes": np.diff(self._offsets).tolist(),
            "samples_per_dataset": self.samples_per_dataset,
        }


def _largest_remainder(shares: npt.NDArray[np.float64], total: int) -> npt.NDArray[np.int64]:
    """Integer counts proportional to ``shares`` (which sum to 1) that add up to ``total``."""
    exact = shares * total
    counts = np.floor(exact).astype(np.int64)
    short = total - int(counts.sum())
    # Stable order: equal remainders go to the earlier dataset, the same in every process.
    counts[np.argsort(-(exact - counts), kind="stable")[:short]] += 1
    return counts
