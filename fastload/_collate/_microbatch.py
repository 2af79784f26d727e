"""Gradient accumulation: split a batch into micro-batches under a token cap, with the weights
that make the accumulated gradient equal the full batch's.

With a token-mean loss, the full batch's loss is ``sum over all real tokens / N``. Micro-batch
``i`` with ``n_i`` real tokens has mean loss ``sum_i / n_i``, so
``sum_i (n_i / N) * (sum_i / n_i)`` is exactly the full loss: the weight is ``n_i / N``, not
``1 / number of micro-batches`` (which over-weights micro-batches of short rows).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from fastload._collate._pad import LENGTHS_NAME, MASK_NAME
from fastload._types import ColumnarBatch, Ragged

WEIGHT_BY = ("tokens", "samples")


class MicroBatch(NamedTuple):
    """One micro-batch: the rows ``rows`` of the full batch.

    ``weight`` multiplies the micro-batch's mean loss before ``backward()``; the weights of a
    batch add up to 1. ``num_tokens`` counts its real tokens (of the primary field).
    """

    batch: Any
    weight: float
    num_tokens: int
    rows: slice


def split_microbatches(
    batch: Mapping[str, Any],
    *,
    max_tokens: int,
    weight_by: str = "tokens",
    pad_to_multiple_of: int | None = None,
    padding_side: str = "right",
    primary: str | None = None,
    sequence_fields: Sequence[str] | None = None,
) -> list[MicroBatch]:
    """Split ``batch`` into consecutive row ranges whose padded size — rows * longest row,
    rounded up to ``pad_to_multiple_of`` — stays within ``max_tokens`` (a single row longer than
    that forms a micro-batch of its own).

    ``batch`` is either a padded batch from :class:`PadCollate` (tensors with ``lengths`` and
    ``attention_mask``) or a columnar batch (``Ragged`` columns, lengths of ``primary`` or the
    first ragged field). Padded micro-batches are trimmed to their own longest row: the
    *sequence fields* — by default every tensor shaped ``[B, L, ...]`` like the attention mask,
    else those named in ``sequence_fields`` — lose the padding columns no row of the micro-batch
    needs (from the right, or from the left with ``padding_side="left"``).

    ``weight_by="tokens"`` (for a loss averaged over real tokens) weights each micro-batch by
    its share of the batch's real tokens; ``"samples"`` (a loss averaged over rows) by its share
    of the rows. A micro-batch without real tokens gets weight 0: skip it (its mean is 0 / 0).
    """
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an integer >= 1; got {max_tokens!r}")
    if weight_by not in WEIGHT_BY:
        raise ValueError(f"weight_by must be 'tokens' or 'samples'; got {weight_by!r}")
    if padding_side not in ("right", "left"):
        raise ValueError(f"padding_side must be 'right' or 'left'; got {padding_side!r}")
    multiple = pad_to_multiple_of or 1
    lengths = _row_lengths(batch, primary)
    padded = -(-lengths // multiple) * multiple
    bounds = _greedy_bounds(padded, max_tokens)
    total_tokens = int(lengths.sum())
    rows = lengths.size
    micro = []
    for start, stop in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        tokens = int(lengths[start:stop].sum())
        if weight_by == "tokens":
            weight = tokens / total_tokens if total_tokens else 0.0
        else:
            weight = (stop - start) / rows
        width = int(padded[start:stop].max())
        part = (
            _slice_padded(batch, start, stop, width, padding_side, sequence_fields)
            if MASK_NAME in batch
            else _slice_columnar(batch, start, stop)
        )
        micro.append(MicroBatch(part, weight, tokens, slice(start, stop)))
    return micro


def _row_lengths(batch: Mapping[str, Any], primary: str | None) -> npt.NDArray[np.int64]:
    if LENGTHS_NAME in batch and MASK_NAME in batch:
        return np.asarray(torch.as_tensor(batch[LENGTHS_NAME]).cpu(), dtype=np.int64)
    ragged = [name for name, column in batch.items() if isinstance(column, Ragged)]
    name = primary if primary is not None else (ragged[0] if ragged else None)
    if name is None or name not in ragged:
        raise ValueError(
            "split_microbatches needs a padded batch (with 'lengths' and 'attention_mask') or a "
            f"columnar batch with ragged fields; got fields {sorted(batch)}"
        )
    return np.asarray(batch[name].lengths, dtype=np.int64)


def _greedy_bounds(padded: npt.NDArray[np.int64], max_tokens: int) -> npt.NDArray[np.int64]:
    """Row boundaries ``[0, ..., B]`` of the longest runs with ``rows * running max <= cap``.

    One vectorized pass per micro-batch (running maximum of the rest), never one per row."""
    bounds = [0]
    start, rows = 0, padded.size
    while start < rows:
        longest = np.maximum.accumulate(np.maximum(padded[start:], 1))
        fits = np.arange(1, rows - start + 1) * longest <= max_tokens
        take = max(1, int(np.count_nonzero(fits)))  # rows * running max only grows
        start += take
        bounds.append(start)
    return np.asarray(bounds, dtype=np.int64)


def _slice_padded(
    batch: Mapping[str, Any],
    start: int,
    stop: int,
    width: int,
    padding_side: str,
    sequence_fields: Sequence[str] | None,
) -> dict[str, Any]:
    mask = batch[MASK_NAME]
    rows, full_width = int(mask.shape[0]), int(mask.shape[1])
    width = min(width, full_width)
    columns = slice(0, width) if padding_side == "right" else slice(full_width - width, full_width)
    if sequence_fields is None:
        sequence = {
            name
            for name, value in batch.items()
            if isinstance(value, torch.Tensor)
            and value.dim() >= 2
            and tuple(value.shape[:2]) == (rows, full_width)
        }
    else:
        sequence = set(sequence_fields)
    part: dict[str, Any] = {}
    for name, value in batch.items():
        if name in sequence:
            part[name] = value[start:stop, columns]
        else:
            part[name] = value[start:stop]
    return part


def _slice_columnar(batch: Mapping[str, Any], start: int, stop: int) -> ColumnarBatch:
    part: ColumnarBatch = {}
    for name, column in batch.items():
        if isinstance(column, Ragged):
            offsets = np.zeros(column.lengths.size + 1, dtype=np.int64)
            np.cumsum(column.lengths, out=offsets[1:])
            part[name] = Ragged(
                column.values[offsets[start] : offsets[stop]], column.lengths[start:stop]
            )
        else:
            part[name] = column[start:stop]
    return part
