"""Page-locking a batch for asynchronous host-to-device copies (the generic path's way; the fast
path pins its reusable slots once instead)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
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


def page_lock(address: int, nbytes: int) -> Callable[[], None] | None:
    """Page-lock ``nbytes`` of host memory at ``address`` (a shared-memory segment) so that
    copies from it to the GPU run asynchronously. Returns the function that undoes it, or
    ``None`` when there is no CUDA device or the driver refused (the memory then stays pageable
    and copies are synchronous, which is still correct)."""
    if not torch.cuda.is_available():
        return None
    cudart = torch.cuda.cudart()
    if int(cudart.cudaHostRegister(address, nbytes, 0)) != 0:
        warnings.warn(
            f"cudaHostRegister refused to page-lock {nbytes / 2**20:.1f} MiB of batch slots "
            "(ulimit -l?); host-to-device copies will be synchronous",
            RuntimeWarning,
            stacklevel=2,
        )
        return None

    def unlock() -> None:
        cudart.cudaHostUnregister(address)

    return unlock
