"""``LengthGroupedBatchSampler``: every sample once per epoch, in length-grouped batches."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from fastload._sampling._base import GroupedBatchSamplerBase
from fastload._sampling._shard_window import ShardGroups
from fastload._sampling._warmup import BatchSizeWarmup


class LengthGroupedBatchSampler(GroupedBatchSamplerBase):
    """Batches of similar-length samples: far less padding, deterministic, DDP-safe, resumable.

    Yields lists of sample indices (a ``torch.utils.data.Sampler[list[int]]``, for
    ``DataLoader(batch_sampler=...)``).

    **How batches are formed** (a pure function of ``lengths``, ``seed``, the epoch, the options
    and ``num_replicas``; never of time, pids or ``num_workers``): samples are spread at random
    (seeded from ``(seed, epoch)``) over windows of about ``window`` batches' worth, sorted by
    length inside each window and cut into batches, whose order is then shuffled. Without
    ``shuffle`` the windows are contiguous in index order and the batch order is kept. On a
    lognormal length distribution (median 200) at ``batch_size=64`` this keeps about 97 % of the
    padded tokens real, against about 22 % for random batches.

    * ``batch_size``: rows per batch. Alone, every batch is full except one partial batch per
      epoch (dropped with ``drop_last``).
    * ``max_tokens``: a budget on the padded size — rows * the longest length in the batch,
      rounded up to ``pad_to_multiple_of`` — which no batch exceeds; short samples form large
      batches, long ones small. With ``batch_size`` too, both caps hold.
    * ``window``: the sort window, in batches (default 100); ``None`` sorts the whole epoch.
    * ``longest_first``: the largest batches (padded size) come first — one per rank — so an
      out-of-memory shows on step 1, not step 5,000.
    * ``oversize`` (with ``max_tokens``), for a sample whose padded length exceeds the budget:
      ``"error"`` (default) raises :class:`~fastload.errors.OversizeSampleError` here, naming the
      sample, its length and the budget; ``"skip"`` leaves it out of every epoch (the count is
      ``skipped``); ``"truncate"`` keeps it, budgeted at ``truncate_length`` tokens in a batch of
      its own — the collate must then cut it, e.g. ``PadCollate(max_length=
      sampler.truncate_length)``, which keeps its first ``truncate_length`` elements.
    * ``warmup``: a :class:`BatchSizeWarmup` whose ``target`` equals ``batch_size`` (or
      ``max_tokens``); the planned batches are split front to back so that the batch of step
      ``t`` (counted per rank from the start of epoch 0) holds at most ``warmup(t)`` rows (or
      padded tokens) — less where a planned batch runs out. With ``longest_first``, the largest
      planned batch is split like any other.
    * ``shuffle_shards=K`` with ``shard_sizes`` (samples per shard, in index order), for data
      read through a cache smaller than the dataset: the epoch visits the shards in a seeded
      random order, in groups of ``K``; windows, batches and their order are drawn inside a
      group only, and the groups' batches come one group after the other, so about ``K``
      shards need be resident at a time. Needs ``shuffle``; ``K`` >= the number of shards is
      the global plan. Each group has its own partial batch (which ``drop_last`` drops: at
      ``K=1`` a shard of fewer than ``batch_size`` samples is then never seen), and
      ``longest_first`` picks among the first group's batches. On 1,000 shards consecutive
      batches' source shards correlate 0.99, 0.14, 0.01 at K = 1, 8, 64 (0.00 global).

    **Ranks.** ``num_replicas`` and ``rank`` default to the initialised ``torch.distributed``
    group (else 1 and 0). The epoch is planned globally, then global batch ``j`` goes to rank
    ``j % num_replicas``. Every rank gets the same number of batches: the last round is padded by
    repeating the epoch's first batches (a few samples seen twice), or with ``drop_last`` the
    last ``num_batches % num_replicas`` batches are dropped. Apart from that, the ranks together
    see every sample exactly once per epoch.

    **Epochs and resume.** Call ``set_epoch(e)`` before each epoch, as with
    ``DistributedSampler``. ``state_dict()`` / ``load_state_dict()`` resume mid-epoch with exactly
    the batches an uninterrupted run would have produced, also onto another number of ranks
    (see ``load_state_dict``). The plan is deterministic for a given numpy version.
    """

    def __init__(
        self,
        lengths: npt.ArrayLike,
        *,
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
        shuffle_shards: int | None = None,
        shard_sizes: Sequence[int] | npt.ArrayLike | None = None,
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
            shuffle_shards=shuffle_shards,
            shard_sizes=shard_sizes,
        )
        # Usually every sample takes part: then skip the index and length gathers.
        self._everyone = bool(self._kept.all())
        population = (
            np.arange(self._lengths.size, dtype=np.int64)
            if self._everyone
            else np.flatnonzero(self._kept).astype(np.int64)
        )
        population.flags.writeable = False
        self._population = population
        self._payloads: npt.NDArray[np.int64] | None = None
        self._population_per_shard: npt.NDArray[np.int64] | None = None

    def _population_padded(self) -> npt.NDArray[np.int64]:
        return self._padded if self._everyone else self._padded[self._population]

    def _population_size(self) -> int:
        return int(self._population.size)

    def _mean_padded_length(self) -> float:
        if self._population.size == 0:
            return 1.0
        return int(self._population_padded().sum()) / self._population.size

    def _epoch_population(self, epoch: int) -> npt.NDArray[np.int64]:
        return self._population

    def _epoch_groups(self, epoch: int) -> ShardGroups | None:
        window = self._shard_window
        if window is None or window.num_groups == 1:
            return None  # one group holds every shard: the global plan, by construction
        if self._population_per_shard is None:  # the population ascends, so shard by shard
            self._population_per_shard = (
                window.sizes
                if self._everyone
                else np.bincount(
                    window.shard_of_samples()[self._population], minlength=window.num_shards
                ).astype(np.int64)
            )
        return ShardGroups(
            window.group_of_shards(self._seed, epoch), window.num_groups, self._population_per_shard
        )

    def _epoch_payloads(self, epoch: int) -> npt.NDArray[np.int64]:
        if self._payloads is None:  # the population is the same every epoch: encode it once
            codec = self._codec()[0]
            self._payloads = codec.encode(self._population, self._population_padded())
            self._payloads.flags.writeable = False
        return self._payloads
