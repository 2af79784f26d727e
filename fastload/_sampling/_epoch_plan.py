"""The epoch plan: a pure, vectorized function from (samples, seed, epoch, options) to batches.

Steps, for an epoch over a population of ``n`` sample payloads (see ``_keys``):

1. **Windows.** With ``shuffle``, every sample gets a window label drawn uniformly from
   ``0 .. num_windows - 1`` by a generator seeded from ``(seed, epoch)``; without, the population
   is cut into contiguous windows of ``samples_per_window`` in its own order.
2. **Sort.** One ``np.sort`` of ``label << payload_bits | payload`` groups the windows and sorts
   each by (padded length, index).
3. **Cut.** With only ``batch_size``: each window yields its full batches; the windows' remainders
   (fewer than ``batch_size`` each) are sorted together and cut too, so there is exactly one
   partial batch per epoch (dropped with ``drop_last``). With ``max_tokens``: each window is cut
   greedily, left to right, into the longest runs whose padded size fits the budget (and the row
   cap). All windows advance in lock-step, each step a vectorized binary search, so Python
   loops once per batch *of a window* (about ``window`` times), never per sample.
4. **Order.** With ``shuffle``, the batch order is permuted by a second seeded generator. With
   ``longest_first``, the ``num_replicas`` batches of largest padded size move to the front,
   largest first, so every rank's first step is its heaviest.

With a shard-window shuffle (``groups``, see ``_shard_window.py``) each sample's label is drawn among
its own group's windows (the windows numbered group after group, so the one sort groups the
groups too), each group's remainders form its own partial batch, and step 4 permutes batches
inside a group only. The label costs a few more passes over the samples (32 random bits scaled
per group); the rest is per window or per batch.

Every pass over the ``n`` samples is a numpy kernel, and there are few of them: draw labels,
pack, sort, unpack (about half a second for ten million samples). Nothing here reads time, pids or
worker counts: the plan depends only on its arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from fastload._sampling._batch_options import BatchingOptions
from fastload._sampling._keys import KEY_BITS, LengthCodec, bit_width
from fastload._sampling._shard_window import ShardGroups, batch_order_by_group

# Independent random streams of one (seed, epoch).
STREAM_WINDOWS = 0
STREAM_BATCH_ORDER = 1
STREAM_DRAW = 2


def epoch_rng(seed: int, epoch: int, stream: int) -> np.random.Generator:
    """The generator of one random stream of one epoch: a pure function of its arguments."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, stream])))


@dataclass(frozen=True)
class EpochPlan:
    """The global batches of one epoch, before they are dealt to ranks.

    Batch ``b`` (in training order) is ``indices[starts[b]:stops[b]]``, its samples in ascending
    padded length; ``padded`` is the padded length of every sample of the dataset. Every sample
    of the epoch's population is in exactly one batch, except those of the partial batch that
    ``drop_last`` removes (one per epoch, or one per group of shards). ``indices`` may hold
    samples twice: a shard-window plan appends its groups' remainders after the samples.
    """

    indices: npt.NDArray[np.int64]
    padded: npt.NDArray[np.int64]
    starts: npt.NDArray[np.int64]
    stops: npt.NDArray[np.int64]

    @property
    def num_batches(self) -> int:
        return int(self.starts.size)

    def batch(self, position: int) -> npt.NDArray[np.int64]:
        """The sample indices of batch ``position`` (a read-only view)."""
        view = self.indices[self.starts[position] : self.stops[position]]
        view.flags.writeable = False
        return view

    def padded_lengths(self, start: int, stop: int) -> npt.NDArray[np.int64]:
        """Padded lengths of ``indices[start:stop]``."""
        return self.padded[self.indices[start:stop]]

    def padded_sizes(self) -> npt.NDArray[np.int64]:
        """Rows * longest padded length, per batch: the tokens the padded batch occupies."""
        if self.starts.size == 0:
            return np.zeros(0, dtype=np.int64)
        longest = self.padded[self.indices[self.stops - 1]]
        return (self.stops - self.starts) * longest

    def reordered(self, starts: npt.NDArray[np.int64], stops: npt.NDArray[np.int64]) -> EpochPlan:
        """The same samples cut or ordered into the batches ``starts``/``stops``."""
        return EpochPlan(self.indices, self.padded, starts, stops)


def plan_epoch(
    payloads: npt.NDArray[np.int64],
    codec: LengthCodec,
    padded: npt.NDArray[np.int64],
    options: BatchingOptions,
    *,
    mean_padded_length: float,
    seed: int,
    epoch: int,
    num_replicas: int,
    groups: ShardGroups | None = None,
) -> EpochPlan:
    """Plan one epoch over the samples whose payloads are ``payloads`` (not modified; duplicates
    allowed: a sample drawn twice appears in two batches or twice in one). ``padded`` holds the
    padded length of every sample of the dataset.

    ``mean_padded_length`` sizes the sort windows; ``num_replicas`` matters only to
    ``longest_first``. With ``groups`` (a shard-window shuffle, ``_shard_window.py``; needs
    ``shuffle``), every step above runs inside each group of shards: a group's samples draw
    among its own windows (about ``count / samples_per_window`` of them), its remainders form
    its own partial batch, and its batches come together, group after group.
    """
    count = payloads.size
    per_window = options.samples_per_window(count, mean_padded_length)
    window_groups = None
    if groups is not None:
        assert options.shuffle, "a shard-window shuffle needs shuffle"
        windows_per_group = -(-groups.totals(groups.items_per_shard()) // per_window)
        labels = groups.window_labels(epoch_rng(seed, epoch, STREAM_WINDOWS), windows_per_group)
        num_windows = int(windows_per_group.sum())
        window_groups = np.repeat(np.arange(groups.count, dtype=np.int64), windows_per_group)
    else:
        num_windows = max(1, -(-count // per_window))
    assert bit_width(num_windows) + codec.payload_bits <= KEY_BITS, "codec built for fewer windows"
    if groups is not None:
        keys = labels
        keys <<= codec.payload_bits
    elif options.shuffle and num_windows > 1:
        labels = epoch_rng(seed, epoch, STREAM_WINDOWS).integers(
            0, num_windows, count, dtype=np.int32 if num_windows < 2**31 else np.int64
        )
        keys = np.left_shift(labels, codec.payload_bits, dtype=np.int64)  # widens as it shifts
    else:  # contiguous windows of exactly per_window samples (a multiple of batch_size)
        labels = np.arange(count, dtype=np.int64) // per_window
        keys = np.left_shift(labels, codec.payload_bits, dtype=np.int64)
    keys |= payloads
    keys.sort()
    window_starts = np.searchsorted(
        keys, np.arange(num_windows, dtype=np.int64) << codec.payload_bits
    ).astype(np.int64)
    window_ends = np.append(window_starts[1:], np.int64(count))[:num_windows]

    batch_groups = None
    if options.max_tokens is None and window_groups is not None:
        assert options.batch_size is not None and groups is not None
        indices, starts, stops, batch_groups = _grouped_fixed_size_batches(
            keys, codec, window_starts, window_ends, window_groups, groups.count,
            options.batch_size, drop_last=options.drop_last,
        )
    elif options.max_tokens is None:
        assert options.batch_size is not None
        keys = _fixed_size_order(
            keys, window_starts, window_ends, options.batch_size, codec.payload_bits
        )
        indices = codec.to_indices(keys)
        starts = np.arange(0, count, options.batch_size, dtype=np.int64)
        stops = np.minimum(starts + options.batch_size, count)
        if options.drop_last and starts.size and stops[-1] - starts[-1] < options.batch_size:
            starts, stops = starts[:-1], stops[:-1]
    else:
        indices = codec.to_indices(keys)
        starts = _token_budget_starts(
            indices,
            padded,
            window_starts,
            window_ends,
            options.max_tokens,
            options.batch_size,
        )
        stops = np.append(starts[1:], np.int64(count))
        if window_groups is not None:  # the window of a batch: the last one starting at or before it
            batch_groups = window_groups[np.searchsorted(window_starts, starts, "right") - 1]
    indices.flags.writeable = False

    if options.shuffle and starts.size > 1:
        rng = epoch_rng(seed, epoch, STREAM_BATCH_ORDER)
        if batch_groups is None or groups is None:  # both or neither
            order = rng.permutation(starts.size)
        else:
            order = batch_order_by_group(rng, batch_groups, groups.count)
            batch_groups = batch_groups[order]
        starts, stops = starts[order], stops[order]
    plan = EpochPlan(indices, padded, starts, stops)
    if not options.longest_first:
        return plan
    if batch_groups is None or not batch_groups.size:
        return _largest_first(plan, num_replicas, plan.num_batches)
    # Only the first group's batches, lest the front of the epoch need the shards of others.
    first_group = int(np.searchsorted(batch_groups, batch_groups[0], "right"))
    return _largest_first(plan, num_replicas, first_group)


def _fixed_size_order(
    keys: npt.NDArray[np.int64],
    window_starts: npt.NDArray[np.int64],
    window_ends: npt.NDArray[np.int64],
    batch_size: int,
    payload_bits: int,
) -> npt.NDArray[np.int64]:
    """Sorted keys rearranged so that consecutive runs of ``batch_size`` are batches: every
    window's full batches first, then all windows' remainders, by payload (length) alone."""
    remainders = (window_ends - window_starts) % batch_size
    if not remainders[:-1].any():
        return keys  # only the last window has a remainder: it already sits at the end
    # Positions of the remainders (each window's tail), built from per-window arrays so that
    # only the final compaction touches every sample.
    total = int(remainders.sum())
    first = window_ends - remainders
    tail = np.repeat(first - (np.cumsum(remainders) - remainders), remainders)
    tail += np.arange(total, dtype=np.int64)
    in_full_batch = np.ones(keys.size, dtype=bool)
    in_full_batch[tail] = False
    ordered = np.empty_like(keys)
    np.compress(in_full_batch, keys, out=ordered[: keys.size - total])
    ordered[keys.size - total :] = np.sort(keys[tail] & ((1 << payload_bits) - 1))
    return ordered


def _grouped_fixed_size_batches(
    keys: npt.NDArray[np.int64],
    codec: LengthCodec,
    window_starts: npt.NDArray[np.int64],
    window_ends: npt.NDArray[np.int64],
    window_groups: npt.NDArray[np.int64],
    num_groups: int,
    batch_size: int,
    *,
    drop_last: bool,
) -> tuple[
    npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]
]:
    """``(indices, starts, stops, groups)`` of batches of ``batch_size`` inside each group of
    windows: every window's full batches where they lie, then each group's remainders, sorted
    by payload (length), in a run of their own appended after the ``count`` window-sorted
    samples, cut too: one partial batch per group (dropped with ``drop_last``). Appending, not
    moving, keeps this at one copy of the keys; the remainders' places inside their windows are
    simply in no batch."""
    count = keys.size
    sizes = window_ends - window_starts
    full = sizes // batch_size
    remainders = sizes - full * batch_size
    full_before = np.cumsum(full) - full
    full_starts = np.repeat(window_starts - full_before * batch_size, full)
    full_starts += np.arange(full_starts.size, dtype=np.int64) * batch_size

    total = int(remainders.sum())
    tail = np.repeat(window_ends - remainders - (np.cumsum(remainders) - remainders), remainders)
    tail += np.arange(total, dtype=np.int64)
    mask = (1 << codec.payload_bits) - 1
    # Sorted by (group, payload): a group's first window numbers it, so the key fits the bits
    # the windows' labels have.
    first_window = np.searchsorted(window_groups, window_groups)
    tail_keys = keys[tail] & mask
    tail_keys |= np.repeat(first_window, remainders) << codec.payload_bits
    tail_keys.sort()
    tail_keys &= mask

    per_group = np.bincount(np.repeat(window_groups, remainders), minlength=num_groups)
    tail_batches = -(-per_group // batch_size)
    if drop_last:
        tail_batches = per_group // batch_size  # only the partial batch is short
    group_start = count + np.cumsum(per_group) - per_group
    tail_starts = np.repeat(group_start - (np.cumsum(tail_batches) - tail_batches) * batch_size,
                            tail_batches)
    tail_starts += np.arange(tail_starts.size, dtype=np.int64) * batch_size
    tail_stops = np.minimum(tail_starts + batch_size, np.repeat(group_start + per_group, tail_batches))

    indices = codec.to_indices(np.concatenate((keys, tail_keys)))
    starts = np.concatenate((full_starts, tail_starts))
    stops = np.concatenate((full_starts + batch_size, tail_stops))
    groups = np.concatenate((
        np.repeat(window_groups, full),
        np.repeat(np.arange(num_groups, dtype=np.int64), tail_batches),
    ))
    return indices, starts, stops, groups


def _token_budget_starts(
    indices: npt.NDArray[np.int64],
    padded: npt.NDArray[np.int64],
    window_starts: npt.NDArray[np.int64],
    window_ends: npt.NDArray[np.int64],
    max_tokens: int,
    row_cap: int | None,
) -> npt.NDArray[np.int64]:
    """Start positions of the greedy token-budget batches over window-sorted ``indices``.

    A batch ``[s, e)`` inside one window fits when ``e - s <= capacity(e - 1)``, the rows a
    batch may hold when sample ``e - 1`` is its longest (lengths ascend within a window). As
    capacity never grows along a window, the predicate holds for ``e`` from ``s + 1`` up to
    the greedy end and fails beyond, and the end is at most ``s + capacity(s)``: a binary
    search on that range finds it, for all windows at once.
    """

    def capacity(positions: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        rows = max_tokens // np.maximum(padded[indices[positions]], 1)
        return rows if row_cap is None else np.minimum(rows, row_cap)

    nonempty = window_ends > window_starts
    cursor, ends = window_starts[nonempty], window_ends[nonempty]
    found = []
    while cursor.size:  # one iteration per batch of the longest window
        found.append(cursor)
        low = cursor + 1  # one row always fits
        high = np.minimum(cursor + capacity(cursor), ends)
        while True:
            undecided = low < high
            if not undecided.any():
                break
            middle = (low + high + 1) // 2
            fits = middle - cursor <= capacity(middle - 1)
            low = np.where(fits, middle, low)
            high = np.where(fits, high, middle - 1)
        more = low < ends
        cursor, ends = low[more], ends[more]
    return np.sort(np.concatenate(found)) if found else np.zeros(0, dtype=np.int64)


def _largest_first(plan: EpochPlan, num_replicas: int, among: int) -> EpochPlan:
    """``plan`` with the ``num_replicas`` largest (padded size) of its first ``among`` batches
    moved to the front, largest first; the others keep their order."""
    if plan.num_batches <= 1:
        return plan
    front = np.argsort(-plan.padded_sizes()[:among], kind="stable")[:num_replicas]
    rest = np.ones(plan.num_batches, dtype=bool)
    rest[front] = False
    order = np.concatenate((front, np.flatnonzero(rest)))
    return plan.reordered(plan.starts[order], plan.stops[order])
