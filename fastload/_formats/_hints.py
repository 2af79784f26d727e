"""Which byte ranges of which local files hold some samples, for readahead hints
(:meth:`ShardedDataset.willneed <fastload._formats._base.ShardedDataset.willneed>`): the open
shards' readers locate the samples, :func:`~fastload._formats._readahead.coalesce_ranges`
merges them, and the process's :class:`~fastload._formats._readahead.AdviseFiles` makes the
calls."""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import numpy.typing as npt

from fastload._formats._columns import group_positions
from fastload._formats._process import LocatesBytes, offers
from fastload._formats._readahead import MAX_ADVISED_RANGES, ByteRanges, coalesce_ranges, earliest
from fastload._formats._validate import normalize_indices


def advise_samples(dataset: Any, indices: npt.ArrayLike) -> int:
    """``dataset.willneed(indices)`` (see there): the bytes advised."""
    if dataset.remote:
        return 0
    rows = normalize_indices(indices, dataset._num_samples)
    if rows.size == 0:
        return 0
    shard = np.searchsorted(dataset._shard_starts, rows, side="right") - 1
    _, groups = group_positions(shard)
    found: list[tuple[int, ByteRanges]] = []
    ranks: list[npt.NDArray[np.int64]] = []
    for group in groups:
        s = int(shard[group[0]])
        reader = dataset._reader_for_hints(s)
        if not offers(reader, LocatesBytes):
            continue
        byte_ranges = cast(LocatesBytes, reader).byte_ranges
        local = rows[group] - dataset._shard_starts[s]
        parts = [(byte_ranges(name, local), group) for name in dataset._fields]
        known = [(r, g) for r, g in parts if r is not None]
        if not known:
            continue
        starts, lengths, rank = coalesce_ranges(
            np.concatenate([r[0] for r, _ in known]),
            np.concatenate([r[1] for r, _ in known]),
            np.concatenate([g.astype(np.int64) for _, g in known]),
        )
        found.append((s, (starts, lengths)))
        ranks.append(rank)
    if not found:
        return 0
    total = sum(len(r) for r in ranks)
    if total > MAX_ADVISED_RANGES:
        kept = np.zeros(total, bool)
        kept[earliest(np.concatenate(ranks), MAX_ADVISED_RANGES)] = True
        cuts = np.cumsum([len(r) for r in ranks])[:-1]
        found = [
            (s, (starts[keep], lengths[keep]))
            for (s, (starts, lengths)), keep in zip(found, np.split(kept, cuts), strict=True)
        ]
    hints, shards = dataset._process_state().hints, dataset._shards
    return sum(hints.advise(shards.path(s), starts, lengths) for s, (starts, lengths) in found)


__all__ = ["advise_samples"]
