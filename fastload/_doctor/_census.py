"""How many Python objects a dataset holds, estimated within a bounded cost.

Each worker that reads a Python object writes its reference count, which copies the page the
object lives on: a dataset of millions of small objects (a list of tuples, a dict of strings)
ends up copied once per worker, however it was shared (torch's issue 13246). Arrays (numpy,
torch) hold their elements outside Python objects and cost nothing of the kind.

:func:`census` walks the objects the dataset refers to; a container of more than ``SAMPLE``
items is judged by ``SAMPLE`` of them spread evenly over it, scaled to its length, and the walk
stops after ``budget`` objects, so its cost does not grow with the dataset.
"""

from __future__ import annotations

import gc
import sys
import types
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

#: Items examined of a large container.
SAMPLE = 32

_OPAQUE = (
    str, bytes, bytearray, int, float, complex, bool, type(None), np.ndarray, np.generic, memoryview,
    type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
)


@dataclass(frozen=True)
class Census:
    """``objects``: the estimated count of Python objects; ``bytes``: their estimated size."""

    objects: float
    bytes: float


def _items(obj: Any) -> list[Any] | None:
    """The items to examine of a built-in container (a subclass's own ``__getitem__`` or
    ``__len__``, which may read files, is never called), or ``None`` for another object."""
    if isinstance(obj, (list, tuple)):
        kind: Any = list if isinstance(obj, list) else tuple
        n = kind.__len__(obj)
        at = kind.__getitem__
        return [at(obj, i) for i in range(n)] if n <= SAMPLE else [at(obj, i * n // SAMPLE) for i in range(SAMPLE)]
    if isinstance(obj, dict):
        n = dict.__len__(obj)
        step = max(1, n // SAMPLE)
        picked: list[Any] = []
        for i, kv in enumerate(dict.items(obj)):
            if i % step == 0:
                picked.extend(kv)
            if len(picked) >= 2 * SAMPLE:
                break
        return picked
    if isinstance(obj, (set, frozenset)):
        picked = []
        for i, x in enumerate(set.__iter__(obj) if isinstance(obj, set) else frozenset.__iter__(obj)):
            if i >= SAMPLE:
                break
            picked.append(x)
        return picked
    return None


def _length(obj: Any) -> int:
    kinds: tuple[Any, ...] = (list, tuple, dict, set, frozenset)
    for kind in kinds:
        if isinstance(obj, kind):
            return int(kind.__len__(obj))
    return 0


def _size(obj: Any) -> int:
    try:
        return sys.getsizeof(obj)
    except TypeError:
        return 0


def census(obj: Any, budget: int = 4000) -> Census:
    """The estimated Python objects under ``obj`` (see the module text)."""
    seen: set[int] = set()
    left = [budget]

    def walk(x: Any, depth: int) -> tuple[float, float]:
        if id(x) in seen or left[0] <= 0 or depth > 12:
            return 0.0, 0.0
        seen.add(id(x))
        left[0] -= 1
        if isinstance(x, (np.ndarray, torch.Tensor)):
            return 1.0, 64.0  # elements held outside Python objects
        if isinstance(x, _OPAQUE):
            return 1.0, float(_size(x))
        items = _items(x)
        if items is not None:
            n = _length(x)
            count, size = 1.0, float(_size(x))
            sub = [walk(i, depth + 1) for i in items]
            examined = len(items) if not isinstance(x, dict) else len(items) // 2
            scale = n / examined if examined else 0.0
            count += scale * sum(c for c, _ in sub)
            size += scale * sum(s for _, s in sub)
            return count, size
        count, size = 1.0, float(_size(x))
        for ref in gc.get_referents(x):
            c, s = walk(ref, depth + 1)
            count, size = count + c, size + s
        return count, size

    count, size = walk(obj, 0)
    return Census(count, size)


__all__ = ["Census", "census"]
