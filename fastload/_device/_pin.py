"""Page-locking a batch for asynchronous host-to-device copies (the generic path's way; the fast
path pins its reusable slots once instead)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch


def pin_tree(data: Any) -> Any:
    """``data`` with every CPU tensor replaced by a pinned copy, keeping the container types
    (dicts, lists, tuples, named tuples) and calling ``pin_memory()`` on objects that have one,
    as torch's DataLoader does. Call it only when CUDA is available."""
    if isinstance(data, torch.Tensor):
        return data.pin_memory()
    if isinstance(data, (str, bytes)):
        return data
    if isinstance(data, Mapping):
        pinned = {k: pin_tree(v) for k, v in data.items()}
        try:
            return type(data)(pinned)  # type: ignore[call-arg]
        except TypeError:
            return pinned
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(pin_tree(v) for v in data))
    if isinstance(data, tuple):
        return tuple(pin_tree(v) for v in data)
    if isinstance(data, Sequence):
        try:
            return type(data)([pin_tree(v) for v in data])  # type: ignore[call-arg]
        except TypeError:
            return [pin_tree(v) for v in data]
    if hasattr(data, "pin_memory"):
        return data.pin_memory()
    return data
