"""The pure parts of sequence packing that the packing collate and the packing dataset share:
checking a :class:`~fastload._types.PackedBatch` against a sequence length, packing plain
batches next-fit, and turning per-sample columns into per-piece ones.

A *per-piece* column holds one entry per piece of a plan, in piece order: a ragged field as
:class:`~fastload._types.Spans` (each piece's tokens where they lie in the values read), a fixed
field as ``[pieces, *shape]`` (its sample's value repeated for each of its pieces) and an object
field as a list.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

from fastload._types import Column, PackedBatch, Ragged, Spans

PieceColumns = dict[str, np.ndarray | list | Spans]


def check_plan(plan: PackedBatch, seq_len: int, owner: str) -> npt.NDArray[np.int64]:
    """The length of each piece of ``plan``, after checking that the plan is for rows of
    ``seq_len`` tokens and that each piece and each row fits them; ``ValueError`` naming the
    piece or row and ``owner`` (who was handed the plan) otherwise."""
    if plan.seq_len != seq_len:
        raise ValueError(
            f"{owner} packs rows of seq_len={seq_len} but was handed a packed batch of "
            f"seq_len={plan.seq_len}: give the sampler, the dataset and the collate one seq_len"
        )
    pieces = plan.samples.size
    offsets = plan.row_offsets
    if offsets[0] != 0 or offsets[-1] != pieces or (np.diff(offsets) < 0).any():
        raise ValueError(
            f"{owner}: the packed batch's row offsets {offsets[:16].tolist()} must rise from 0 "
            f"to its {pieces} pieces"
        )
    lengths = plan.stops - plan.starts
    bad = np.flatnonzero((plan.starts < 0) | (lengths <= 0) | (lengths > seq_len))
    if bad.size:
        p = int(bad[0])
        sample, start, stop = int(plan.samples[p]), int(plan.starts[p]), int(plan.stops[p])
        why = "is longer than" if stop - start > seq_len else "is empty or starts before 0, for"
        raise ValueError(
            f"{owner}: piece {p} (tokens {start}:{stop} of sample {sample}) {why} "
            f"seq_len={seq_len}; a piece is 1..seq_len tokens of one sample"
        )
    ends = np.concatenate(([0], np.cumsum(lengths)))
    used = ends[offsets[1:]] - ends[offsets[:-1]]
    full = np.flatnonzero(used > seq_len)
    if full.size:
        r = int(full[0])
        raise ValueError(
            f"{owner}: row {r} of the packed batch holds {int(used[r])} tokens, more than "
            f"seq_len={seq_len}; its pieces (sample, start, stop) are {plan.row(r)}"
        )
    return lengths


def next_fit(lengths: npt.NDArray[np.int64], seq_len: int, rows: int | None) -> PackedBatch:
    """The samples of lengths ``lengths`` packed in order, next-fit: each sample cut into pieces
    of at most ``seq_len`` tokens (from its start; empty samples have none), each piece put in
    the current row if it fits, else in a new one. With ``rows`` the batch has exactly that many
    rows (the last ones empty if fewer are needed; ``ValueError`` if more are). A loop over the
    pieces: this packs a plain batch of a plain ``collate_fn``, where a planned packing
    (``PackedBatchSampler``) is not to be had."""
    counts = -(-lengths // seq_len)
    samples = np.repeat(np.arange(lengths.size, dtype=np.int64), counts)
    first = np.concatenate(([0], np.cumsum(counts)))[:-1]
    starts = (np.arange(samples.size, dtype=np.int64) - np.repeat(first, counts)) * seq_len
    stops = np.minimum(starts + seq_len, lengths[samples])
    row_starts = [0]
    used = 0
    for p, size in enumerate((stops - starts).tolist()):
        if used + size > seq_len:
            row_starts.append(p)
            used = 0
        used += size
    needed = len(row_starts) if samples.size else 0
    if rows is not None and needed > rows:
        raise ValueError(
            f"the batch's {int(lengths.sum())} tokens in {lengths.size} samples need "
            f"{needed} rows of seq_len={seq_len} packed in order (next-fit), more than "
            f"rows={rows}: pass fewer samples per batch, or rows=None"
        )
    total = needed if rows is None else rows
    offsets = np.full(total + 1, samples.size, dtype=np.int64)
    offsets[:needed] = row_starts[:needed]
    return PackedBatch(samples, starts, stops, offsets, seq_len)


def piece_columns(
    columns: Mapping[str, Column | Spans],
    position: npt.NDArray[np.int64],
    starts: npt.NDArray[np.int64],
    stops: npt.NDArray[np.int64],
) -> PieceColumns:
    """Per-piece columns of pieces ``starts[p]:stops[p]`` of the samples at ``position[p]`` of
    per-sample ``columns`` (bounds not checked: the caller did). Nothing is copied but the
    fixed and object values."""
    lengths = stops - starts
    out: PieceColumns = {}
    for name, column in columns.items():
        if isinstance(column, Ragged):
            begins = np.concatenate(([0], np.cumsum(column.lengths)))[:-1]
            out[name] = Spans(column.values, begins[position] + starts, lengths)
        elif isinstance(column, Spans):
            out[name] = Spans(column.source, column.starts[position] + starts, lengths)
        elif isinstance(column, np.ndarray):
            out[name] = column[position]
        else:
            out[name] = [column[i] for i in position.tolist()]
    return out


__all__ = ["PieceColumns", "check_plan", "next_fit", "piece_columns"]
