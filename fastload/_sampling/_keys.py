"""Sort keys that carry a sample's padded length and its index in one non-negative ``int64``.

Sorting by length inside random windows is the heart of every epoch plan. ``argsort`` and
``permutation`` on ten million elements are dominated by random memory access, whereas
``np.sort`` of plain integers is a fast cache-friendly kernel. So each sample becomes a
*payload* whose numeric order is (padded length, index); the plan puts a window label above the
payload and sorts values, never indices. The payload is unique per sample, so any correct sort
returns the same array: the plan does not depend on which sort kernel numpy picks for the CPU.

Two encodings, chosen per dataset:

* **packed** — ``code << index_bits | index``, where ``code`` is the rank of the sample's padded
  length among the distinct padded lengths; decoding the index is one in-place mask.
* **ranked** — the sample's rank in the (padded length, index) order of the whole dataset; used
  only when ``code`` and ``index`` together need more bits than the label leaves free (hundreds of
  millions of samples with millions of distinct lengths). Decoding is a gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

#: Bits of a sort key (label and payload): keys are non-negative int64, whose sort numpy runs
#: faster than uint64's.
KEY_BITS = 63
#: Above this padded length, distinct lengths are found with ``np.unique`` instead of a bincount.
_BINCOUNT_MAX_LENGTH = 1 << 22


def bit_width(count: int) -> int:
    """Bits needed to store the integers ``0 .. count - 1`` (0 for ``count <= 1``)."""
    return max(0, count - 1).bit_length()


@dataclass(frozen=True)
class LengthCodec:
    """Encodes sample indices into payloads ordered by (padded length, index), and back.

    Invariant: for samples ``i`` and ``j``, ``payload(i) < payload(j)`` exactly when
    ``(padded[i], i) < (padded[j], j)``.
    """

    payload_bits: int
    distinct_lengths: npt.NDArray[np.int64]  # ascending; a packed payload's code indexes it
    index_bits: int  # packed encoding only
    ranked_indices: npt.NDArray[np.int64] | None  # ranked encoding: sample index at each rank
    ranks: npt.NDArray[np.int64] | None  # ranked encoding: each sample's rank
    code_of_length: npt.NDArray[np.int64] | None  # code by padded length, when lengths are small

    @classmethod
    def build(cls, padded: npt.NDArray[np.int64], *, label_bits: int) -> LengthCodec:
        """A codec for samples with padded lengths ``padded`` (int64, >= 0) whose payloads leave
        ``label_bits`` free for a window label."""
        count = padded.size
        index_bits = bit_width(count)
        code_of_length = None
        if count and int(padded.max()) <= _BINCOUNT_MAX_LENGTH:
            present = np.bincount(padded) > 0
            distinct = np.flatnonzero(present).astype(np.int64)
            code_of_length = np.cumsum(present, dtype=np.int64) - 1
        else:
            distinct = np.unique(padded).astype(np.int64)
        code_bits = bit_width(distinct.size)
        if label_bits + code_bits + index_bits <= KEY_BITS:
            return cls(
                payload_bits=code_bits + index_bits,
                distinct_lengths=distinct,
                index_bits=index_bits,
                ranked_indices=None,
                ranks=None,
                code_of_length=code_of_length,
            )
        if label_bits + index_bits > KEY_BITS:
            raise ValueError(
                f"{count} samples spread over 2**{label_bits} sort windows need more than "
                f"{KEY_BITS}-bit sort keys; use a larger window"
            )
        order = np.lexsort((np.arange(count), padded))
        ranks = np.empty(count, dtype=np.int64)
        ranks[order] = np.arange(count, dtype=np.int64)
        return cls(
            payload_bits=index_bits,
            distinct_lengths=distinct,
            index_bits=index_bits,
            ranked_indices=order.astype(np.int64),
            ranks=ranks,
            code_of_length=None,
        )

    @property
    def packed(self) -> bool:
        return self.ranks is None

    def encode(
        self, indices: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.int64]:
        """Payloads (non-negative int64) of the samples ``indices``, whose padded lengths are
        ``lengths``."""
        if self.ranks is not None:
            return self.ranks[indices]
        if self.code_of_length is not None:
            payloads = self.code_of_length[lengths]
        else:
            payloads = np.searchsorted(self.distinct_lengths, lengths).astype(np.int64)
        payloads <<= self.index_bits
        payloads |= indices
        return payloads

    def to_indices(self, keys: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """The sample indices of sort keys (payloads, with or without a label above them); a
        packed encoding reuses (overwrites) ``keys``."""
        if self.ranked_indices is not None:
            keys &= (1 << self.payload_bits) - 1
            return self.ranked_indices[keys]
        keys &= (1 << self.index_bits) - 1
        return keys
