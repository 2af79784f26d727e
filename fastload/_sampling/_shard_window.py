"""The shard-window shuffle: an epoch that visits its shards in groups, so that a bounded cache
holds what it reads.

A global shuffle touches every shard every epoch; a cache smaller than the dataset then fetches
every shard again and again. With ``shuffle_shards=K`` the epoch visits the shards in a seeded
random order (stream ``STREAM_SHARDS`` of ``(seed, epoch)``), cut into consecutive groups of
``K`` shards. The planners (``_epoch_plan.py``, ``_packing_plan.py``) then draw each item's sort or packing
window among its own group's windows only, cut batches inside a group only, and shuffle the
batch order inside a group only, so the groups' batches come one group after the other and the
loader needs about ``K`` shards at a time.

Everything is vectorized over items (samples or documents): the per-shard tables are small, and
each item's group, window count and window offset are spread with one ``np.repeat`` (items in
shard order) or one gather from a table of shards. With a single group the samplers do not
group at all (they pass no ``ShardGroups``), so that plan *is* the global plan.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from fastload._sampling._batch_options import check_int

#: The random stream of an epoch that orders its shards (``_plan`` holds streams 0 to 2).
STREAM_SHARDS = 3


@dataclass(frozen=True)
class ShardWindow:
    """Validated ``shuffle_shards`` and ``shard_sizes``: ``shards_per_group`` shards per group,
    ``sizes[s]`` samples in shard ``s`` (shard ``s`` holds the samples from ``sum(sizes[:s])``
    on)."""

    shards_per_group: int
    sizes: npt.NDArray[np.int64]

    @classmethod
    def create(
        cls,
        shuffle_shards: object,
        shard_sizes: Sequence[int] | npt.ArrayLike | None,
        *,
        num_samples: int,
        shuffle: bool,
    ) -> ShardWindow | None:
        """The shard window, or ``None`` without ``shuffle_shards``. ``shard_sizes`` alone is
        checked (a loader passes it for every dataset) but shapes no plan."""
        sizes = None if shard_sizes is None else _as_shard_sizes(shard_sizes, num_samples)
        if shuffle_shards is None:
            return None
        per_group = check_int("shuffle_shards", shuffle_shards, minimum=1)
        if sizes is None:
            raise ValueError(
                f"shuffle_shards={per_group} needs shard_sizes (samples per shard, in index "
                "order) to know which shard each sample is in; pass the dataset's shard sizes"
            )
        if not shuffle:
            raise ValueError(
                f"shuffle_shards={per_group} shuffles the order of the shards, but "
                "shuffle=False keeps index order; pass shuffle=True or drop shuffle_shards"
            )
        return cls(per_group, sizes)

    @property
    def num_shards(self) -> int:
        return int(self.sizes.size)

    @property
    def num_groups(self) -> int:
        return max(1, -(-self.num_shards // self.shards_per_group))

    def shard_of_samples(self) -> npt.NDArray[np.int32]:
        """The shard of every sample (int32: 4 bytes a sample, for any realistic shard count)."""
        return np.repeat(np.arange(self.num_shards, dtype=np.int32), self.sizes)

    def group_of_shards(self, seed: int, epoch: int) -> npt.NDArray[np.int64]:
        """The group each shard is in for ``epoch``: the shards in a seeded random order, cut
        into consecutive runs of ``shards_per_group`` (group 0 is visited first)."""
        visit = np.random.Generator(
            np.random.PCG64(np.random.SeedSequence([seed, epoch, STREAM_SHARDS]))
        ).permutation(self.num_shards)
        groups = np.empty(self.num_shards, dtype=np.int64)
        groups[visit] = np.arange(self.num_shards, dtype=np.int64) // self.shards_per_group
        return groups

    def state(self) -> dict[str, int]:
        """What identifies the shard window in a sampler's ``state_dict``."""
        return {
            "shuffle_shards": self.shards_per_group,
            "num_shards": self.num_shards,
            "shard_sizes_crc32": zlib.crc32(self.sizes.tobytes()),
        }


def _as_shard_sizes(values: object, num_samples: int) -> npt.NDArray[np.int64]:
    array = np.asarray(values)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(
            f"shard_sizes must be a non-empty 1-D sequence (samples per shard); got shape "
            f"{array.shape}"
        )
    if not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"shard_sizes must hold integers; got dtype {array.dtype}")
    sizes = np.array(array, dtype=np.int64, copy=True)
    if int(sizes.min()) < 0:
        first = int(np.flatnonzero(sizes < 0)[0])
        raise ValueError(f"shard_sizes[{first}] is {int(sizes[first])}; sizes must be >= 0")
    total = int(sizes.sum())
    if total != num_samples:
        raise ValueError(
            f"shard_sizes sum to {total} samples over {sizes.size} shards, but lengths has "
            f"{num_samples}; pass one size per shard of this dataset, in index order"
        )
    sizes.flags.writeable = False
    return sizes


@dataclass(frozen=True)
class ShardGroups:
    """One epoch's groups of shards, and the shards of the items a planner orders.

    ``of_shard[s]`` is shard ``s``'s group (``0 .. count - 1``, in visiting order). The items
    (samples or documents) come shard after shard, ``run[s]`` of them in shard ``s``; any items
    after that run are in the shards ``rest`` (the further pieces of split documents). A packing
    plan also needs the ``tokens`` of each shard.
    """

    of_shard: npt.NDArray[np.int64]
    count: int
    run: npt.NDArray[np.int64]
    rest: npt.NDArray[np.int32] = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    tokens: npt.NDArray[np.int64] | None = None

    @property
    def num_items(self) -> int:
        return int(self.run.sum()) + int(self.rest.size)

    def items_per_shard(self) -> npt.NDArray[np.int64]:
        if not self.rest.size:
            return self.run
        return self.run + np.bincount(self.rest, minlength=self.run.size)

    def spread(self, per_shard_values: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """A value per item from a value per shard (a repeat over the run: sequential writes,
        unlike a gather)."""
        head = np.repeat(per_shard_values, self.run)
        return np.concatenate((head, per_shard_values[self.rest])) if self.rest.size else head

    def totals(self, amount_per_shard: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """The sum of a per-shard amount over each group's shards."""
        return np.bincount(
            self.of_shard, weights=amount_per_shard, minlength=self.count
        ).round().astype(np.int64)

    def window_labels(
        self,
        rng: np.random.Generator,
        windows_per_group: npt.NDArray[np.int64],
    ) -> npt.NDArray[np.int64]:
        """A window label for every item, uniform among its group's windows, which are
        numbered group after group (group ``g`` has ``windows_per_group[g]`` of them, none
        when it holds no item).

        32 random bits per item scaled by the window count (multiply and shift): one scalar-bound
        draw instead of a draw with a bound per item, at a bias below ``windows / 2**32``.
        """
        first = np.cumsum(windows_per_group) - windows_per_group
        labels = rng.integers(0, 1 << 32, self.num_items, dtype=np.int64)
        labels *= self.spread(windows_per_group[self.of_shard])
        labels >>= 32
        labels += self.spread(first[self.of_shard])
        return labels


def batch_order_by_group(
    rng: np.random.Generator, batch_groups: npt.NDArray[np.int64], num_groups: int
) -> npt.NDArray[np.int64]:
    """A random order of the batches in which the groups come one after the other: a seeded
    permutation, stably sorted by group."""
    shuffled = rng.permutation(batch_groups.size)
    groups = batch_groups[shuffled]
    # A stable sort has one result whatever the dtype; numpy radix-sorts 16-bit keys (2x faster).
    if num_groups <= np.iinfo(np.int16).max:
        groups = groups.astype(np.int16)
    return shuffled[np.argsort(groups, kind="stable")]


__all__ = ["STREAM_SHARDS", "ShardGroups", "ShardWindow", "batch_order_by_group"]
