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
    if isinstance(obj, (list, tuple)):
        return list(obj) if len(obj) <= SAMPLE else [obj[i * len(obj) // SAMPLE] for i in range(SAMPLE)]
    if isinstance(obj, dict):
        n = len(obj)
        if n <= SAMPLE:
            return [x for kv in obj.items() for x in kv]
        step = n // SAMPLE
        picked: list[Any] = []
        for i, kv in enumerate(obj.items()):
            if i % step == 0:
                picked.extend(kv)
            if len(picked) >= 2 * SAMPLE:
                break
        return picked
    if isinstance(obj, (set, frozenset)):
        picked = []
        for i, x in enumerate(obj):
            if i >= SAMPLE:
                break
            picked.append(x)
        return picked
    return None


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
        if isinstance(x, _OPAQUE) or _is_tensor(x):
            return 1.0, float(_size(x)) if not isinstance(x, np.ndarray) and not _is_tensor(x) else 64.0
        items = _items(x)
        if items is not None:
            n = len(x)
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


def _is_tensor(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "storage_offset")


__all__ = ["Census", "census"]
