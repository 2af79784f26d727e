"""What a batch holds, for the loader's statistics, where its builder did not say."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fastload._types import Counts, PackedBatch


def planned_counts(index: Any) -> Counts | None:
    """What a packed plan says of its batch, whatever collated it: rows, real tokens (its
    pieces') and padded tokens (``rows * seq_len``); ``None`` for any other index."""
    if isinstance(index, PackedBatch):
        return Counts(index.rows, index.num_tokens, index.rows * index.seq_len)
    return None


def batch_counts(batch: Any) -> Counts:
    """Rows, real tokens and padded tokens of a host batch: exact for ``PadCollate`` output
    (``lengths`` and ``attention_mask``), rows only for anything else."""
    if isinstance(batch, dict):
        lengths, mask = batch.get("lengths"), batch.get("attention_mask")
        if isinstance(lengths, torch.Tensor) and isinstance(mask, torch.Tensor) and lengths.ndim == 1:
            real = lengths.numpy().sum() if lengths.device.type == "cpu" and not lengths.requires_grad else lengths.sum()
            return Counts(len(lengths), int(real), mask.numel())
        values = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        values = list(batch)
    else:
        values = [batch]
    for v in values:
        if isinstance(v, torch.Tensor) and v.is_nested:
            return Counts(int(v.size(0)))  # its other sizes vary: it has no .shape
        if isinstance(v, (torch.Tensor, np.ndarray)) and v.ndim:
            return Counts(int(v.shape[0]))
        if isinstance(v, (list, tuple, dict)):
            return batch_counts(v)
    return Counts(1)
