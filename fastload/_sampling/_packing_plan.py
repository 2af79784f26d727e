"""The packing plan: an epoch's documents assigned to rows of ``seq_len`` tokens, rows cut into
batches.

1. **Documents** (the same every epoch): each sample is one document, or with
   ``oversize="split"`` a sample longer than ``seq_len`` is cut into pieces of ``seq_len`` (the
   last one shorter), each a document of its own; ``"truncate"`` keeps its first ``seq_len``
   tokens. Empty samples hold no token and take no place.
2. **Windows**: the documents, in a seeded random order (index order without ``shuffle``), are
   cut into consecutive windows of about ``window`` batches' worth of tokens.
3. **Rows**: inside each window, best-fit decreasing (``_bestfit.py``) puts every document in a
   row; a window's last rows may be partly empty, the others are nearly full.
4. **Batches**: the rows, window after window, are cut into batches of ``rows`` rows (the last
   one completed with empty rows, or dropped with ``drop_last``), whose order is then shuffled.

With a shard-window shuffle (``_shard_window.py``), steps 2 to 4 run inside each group of shards:
documents draw among their group's windows, each group's rows are completed to whole batches
on their own, and batches are shuffled inside a group, the groups one after the other.

Every pass is a numpy kernel or the compiled best-fit, so ten million lengths plan in about the
time of the length-grouped plan (``benchmarks/bench_packing.py``). Nothing here reads time, pids
or worker counts: the plan depends only on its arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from fastload._sampling._bestfit import best_fit
from fastload._sampling._epoch_plan import STREAM_BATCH_ORDER, STREAM_WINDOWS, EpochPlan, epoch_rng
from fastload._sampling._keys import KEY_BITS, bit_width
from fastload._sampling._shard_window import ShardGroups, batch_order_by_group
from fastload._types import PackedBatch
from fastload.errors import OversizeSampleError

PACK_OVERSIZE_POLICIES = ("split", "truncate", "error")

_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class Documents:
    """What an epoch packs: document ``d`` is tokens ``start[d]:stop[d]`` of sample
    ``sample[d]``, every document 1 to ``seq_len`` tokens long."""

    sample: npt.NDArray[np.int64]
    start: npt.NDArray[np.int64]
    stop: npt.NDArray[np.int64]
    lengths: npt.NDArray[np.int64]
    #: Tokens that ``oversize="truncate"`` cuts off (0 under the other policies).
    truncated_tokens: int
    #: Samples of no token, which no row holds.
    empty_samples: int

    @property
    def size(self) -> int:
        return int(self.sample.size)


def cut_documents(lengths: npt.NDArray[np.int64], seq_len: int, oversize: str) -> Documents:
    """The documents of samples of ``lengths`` under the ``oversize`` policy (see the module
    text), in sample order, the further pieces of split samples after all first pieces;
    ``"error"`` raises :class:`~fastload.errors.OversizeSampleError` naming the first sample
    longer than ``seq_len``."""
    over = lengths > seq_len
    longer = int(np.count_nonzero(over))
    empty = int(np.count_nonzero(lengths == 0))
    if longer and oversize == "error":
        first = int(np.flatnonzero(over)[0])
        raise OversizeSampleError(
            f"sample {first} has length {int(lengths[first])}, more than seq_len={seq_len}; "
            f"{longer} samples in all are longer. Pass oversize='split' to cut them into "
            "documents of seq_len tokens, or oversize='truncate' to keep their first seq_len "
            "tokens"
        )
    sample = np.arange(lengths.size, dtype=np.int64) if not empty else np.flatnonzero(lengths).astype(np.int64)
    start = np.zeros(sample.size, dtype=np.int64)
    stop = lengths[sample] if empty else lengths
    truncated = 0
    if longer:
        stop = np.minimum(stop, seq_len)
        if oversize == "truncate":
            truncated = int((lengths[over] - seq_len).sum())
        else:  # split: the second and further pieces of every longer sample
            longer_ones = np.flatnonzero(over).astype(np.int64)
            further = -(-lengths[longer_ones] // seq_len) - 1
            extra_sample = np.repeat(longer_ones, further)
            piece = np.arange(extra_sample.size, dtype=np.int64) - np.repeat(
                np.cumsum(further) - further, further
            )
            extra_start = (piece + 1) * seq_len
            sample = np.concatenate((sample, extra_sample))
            start = np.concatenate((start, extra_start))
            stop = np.concatenate((stop, np.minimum(extra_start + seq_len, lengths[extra_sample])))
    lengths_of = stop - start
    for array in (sample, start, stop, lengths_of):
        array.flags.writeable = False
    return Documents(sample, start, stop, lengths_of, truncated, empty)


@dataclass(frozen=True)
class PackedEpoch:
    """One epoch's global packed batches (a ``_stream.GlobalPlan``).

    ``order`` lists the documents grouped by row; row ``r`` holds ``order[row_offsets[r] :
    row_offsets[r + 1]]`` (no document: a row of padding). ``batches`` is an
    :class:`~fastload._sampling._epoch_plan.EpochPlan` over row numbers: batch ``b`` is rows
    ``batches.starts[b]`` to ``batches.stops[b]`` (consecutive), every batch ``rows`` rows
    except those a warm-up cut smaller. Positions past the end are padding batches of ``rows``
    empty rows, which fill the last round of ranks.
    """

    documents: Documents
    order: npt.NDArray[np.int64]
    row_offsets: npt.NDArray[np.int64]
    batches: EpochPlan
    rows: int
    seq_len: int

    @property
    def num_batches(self) -> int:
        return self.batches.num_batches

    def batch(self, position: int) -> PackedBatch:
        """Batch ``position``, built straight into its int64 encoding (what travels to the
        workers), which the batch's columns view."""
        if position >= self.num_batches:
            encoded = PackedBatch.empty_encoding(self.rows, 0, self.seq_len)
            encoded[4:] = 0
            return _viewing(encoded, self.rows, 0, self.seq_len)
        first_row, last_row = int(self.batches.starts[position]), int(self.batches.stops[position])
        begin, end = int(self.row_offsets[first_row]), int(self.row_offsets[last_row])
        rows, pieces = last_row - first_row, end - begin
        encoded = PackedBatch.empty_encoding(rows, pieces, self.seq_len)
        np.subtract(self.row_offsets[first_row : last_row + 1], begin, out=encoded[4 : 5 + rows])
        docs = self.order[begin:end]
        columns = encoded[5 + rows :].reshape(3, pieces)
        documents = self.documents
        np.take(documents.sample, docs, out=columns[0])
        np.take(documents.start, docs, out=columns[1])
        np.take(documents.stop, docs, out=columns[2])
        return _viewing(encoded, rows, pieces, self.seq_len)

    def efficiency(self) -> float:
        """Real tokens over the tokens of every batch (rows × ``seq_len``); rows that
        ``drop_last`` left out count in neither."""
        first, last = self.batches.starts, self.batches.stops
        capacity = int((last - first).sum()) * self.seq_len
        if not capacity:
            return 1.0
        tokens = np.concatenate(([0], np.cumsum(self.documents.lengths[self.order])))
        before_row = tokens[self.row_offsets]  # tokens of all rows before each row
        return float((before_row[last] - before_row[first]).sum()) / capacity


def _viewing(encoded: npt.NDArray[np.int64], rows: int, pieces: int, seq_len: int) -> PackedBatch:
    """The batch whose encoding ``encoded`` is (made here, so not checked again), viewing it."""
    columns = encoded[5 + rows :].reshape(3, pieces)
    return PackedBatch(columns[0], columns[1], columns[2], encoded[4 : 5 + rows], seq_len, encoded)


def plan_packed_epoch(
    documents: Documents,
    *,
    seq_len: int,
    rows: int,
    window: int | None,
    shuffle: bool,
    drop_last: bool,
    seed: int,
    epoch: int,
    groups: ShardGroups | None = None,
) -> PackedEpoch:
    """Plan one epoch (see the module text). With ``groups`` (a shard-window shuffle,
    ``_shard_window.py``; needs ``shuffle``; its items are the documents) every
    step runs inside each group of shards: windows, rows, the last partial batch (one per
    group) and the batch order, the groups' batches coming group after group."""
    if groups is None:
        by_window, longest_first, window_ends = _windows_longest_first(
            documents.lengths, seq_len, rows, window, shuffle=shuffle, seed=seed, epoch=epoch
        )
    else:
        assert shuffle, "a shard-window shuffle needs shuffle"
        assert groups.tokens is not None, "a packing plan's groups count their tokens"
        tokens = groups.totals(groups.tokens)
        windows = np.minimum(tokens, 1) if window is None else -(-tokens // (window * rows * seq_len))
        labels = groups.window_labels(epoch_rng(seed, epoch, STREAM_WINDOWS), windows)
        by_window, longest_first, window_ends = _sorted_by_window(
            documents.lengths, labels, int(windows.sum()), seq_len
        )
    placed, row_sizes = best_fit(longest_first, window_ends, seq_len)
    order = by_window[placed]

    if groups is None:
        filled = row_sizes.size
        partial = filled % rows
        if partial and drop_last:
            total_rows = filled - partial  # the rows of the last, partial batch are left out
        else:
            total_rows = filled + (rows - partial if partial else 0)  # completed with empty rows
        sizes = np.zeros(total_rows, dtype=np.int64)
        kept = min(filled, total_rows)
        sizes[:kept] = row_sizes[:kept]
        batch_groups = None
    else:
        window_groups = np.repeat(np.arange(groups.count, dtype=np.int64), windows)
        order, sizes, batch_groups = _rows_by_group(
            order, placed, row_sizes, window_ends, window_groups, groups.count, rows, drop_last
        )
        total_rows = sizes.size
    order.flags.writeable = False
    row_offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
    row_offsets.flags.writeable = False

    starts = np.arange(0, total_rows, rows, dtype=np.int64)
    if shuffle and starts.size > 1:
        rng = epoch_rng(seed, epoch, STREAM_BATCH_ORDER)
        if batch_groups is None or groups is None:  # both or neither
            starts = starts[rng.permutation(starts.size)]
        else:
            starts = starts[batch_order_by_group(rng, batch_groups, groups.count)]
    every_row = np.arange(total_rows, dtype=np.int64)
    batches = EpochPlan(every_row, np.full(total_rows, seq_len, dtype=np.int64), starts, starts + rows)
    return PackedEpoch(documents, order, row_offsets, batches, rows, seq_len)


def _rows_by_group(
    order: npt.NDArray[np.int64],
    placed: npt.NDArray[np.int64],
    row_sizes: npt.NDArray[np.int64],
    window_ends: npt.NDArray[np.int64],
    window_groups: npt.NDArray[np.int64],
    num_groups: int,
    rows: int,
    drop_last: bool,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """``(order, sizes, batch_groups)``: the packed rows with every group's rows completed to
    whole batches by empty rows (or with ``drop_last`` its partial batch's rows left out, and
    their documents dropped from ``order``), and the group of every batch. Rows come window
    after window (``best_fit``), so each group's rows are consecutive."""
    first_doc = np.cumsum(row_sizes) - row_sizes
    row_window = np.searchsorted(window_ends, placed[first_doc], "right")
    per_group = np.bincount(window_groups[row_window], minlength=num_groups).astype(np.int64)
    batches = per_group // rows if drop_last else -(-per_group // rows)
    kept = np.minimum(per_group, batches * rows)
    if drop_last and (kept < per_group).any():
        in_group = np.arange(row_sizes.size) - np.repeat(np.cumsum(per_group) - per_group, per_group)
        row_kept = in_group < np.repeat(kept, per_group)
        order = order[np.repeat(row_kept, row_sizes)]
        row_sizes = row_sizes[row_kept]
    sizes = np.zeros(int(batches.sum()) * rows, dtype=np.int64)
    # A group's kept rows go to the front of its batches; the rest of them stay empty.
    at = np.repeat((np.cumsum(batches) - batches) * rows - (np.cumsum(kept) - kept), kept)
    sizes[at + np.arange(at.size, dtype=np.int64)] = row_sizes
    return order, sizes, np.repeat(np.arange(num_groups, dtype=np.int64), batches)


def _windows_longest_first(
    lengths: npt.NDArray[np.int64],
    seq_len: int,
    rows: int,
    window: int | None,
    *,
    shuffle: bool,
    seed: int,
    epoch: int,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """The documents ordered by window, longest first inside each window (ties by document),
    their lengths in that order, and where each window ends in it.

    With ``shuffle`` every document draws its window at random (seeded), as the length-grouped
    plan does: no permutation of the documents is ever made. Without it, windows are consecutive
    runs of ``window`` batches' worth of tokens. One sort of unique integer keys (window, seq_len
    - length, document) orders them where the key fits in 63 bits, else a lexicographic sort
    gives the same order.
    """
    count = lengths.size
    if count == 0:
        return _EMPTY, _EMPTY, _EMPTY
    per_window = None if window is None else window * rows * seq_len
    num_windows = 1 if per_window is None else max(1, -(-int(lengths.sum()) // per_window))
    if num_windows == 1:
        labels = np.zeros(count, dtype=np.int64)
    elif shuffle:
        labels = epoch_rng(seed, epoch, STREAM_WINDOWS).integers(0, num_windows, count, dtype=np.int64)
    else:
        assert per_window is not None
        labels = np.minimum((np.cumsum(lengths) - lengths) // per_window, num_windows - 1)
    return _sorted_by_window(lengths, labels, num_windows, seq_len)


def _sorted_by_window(
    lengths: npt.NDArray[np.int64],
    labels: npt.NDArray[np.int64],
    num_windows: int,
    seq_len: int,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """The documents of window ``labels`` ordered by window, longest first inside each (see
    ``_windows_longest_first``)."""
    count = lengths.size
    window_ends = np.cumsum(np.bincount(labels, minlength=num_windows)).astype(np.int64)
    index_bits = bit_width(count)
    length_bits = bit_width(seq_len)
    if bit_width(num_windows) + length_bits + index_bits > KEY_BITS:
        shortfall = seq_len - lengths
        order = np.lexsort((np.arange(count), shortfall, labels)).astype(np.int64)
        return order, lengths[order], window_ends
    keys = np.left_shift(labels, length_bits + index_bits, dtype=np.int64)
    keys |= np.left_shift(seq_len - lengths, index_bits)  # 0 for the longest possible document
    keys |= np.arange(count, dtype=np.int64)
    keys.sort()
    # The lengths come out of the keys in order, without a gather at random places.
    longest_first = seq_len - ((keys >> index_bits) & ((1 << length_bits) - 1))
    keys &= (1 << index_bits) - 1
    return keys, longest_first, window_ends


__all__ = ["PACK_OVERSIZE_POLICIES", "Documents", "PackedEpoch", "cut_documents", "plan_packed_epoch"]
