"""What a slot collate's ``__call__`` returns, shared by :class:`~fastload.PadCollate` and
:class:`~fastload.PackCollate`: the arrays its plan (or a subclass's own ``layout`` and
``collate_into``) writes, as tensors, so that torch's loader and fastload's engine see the same
batch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch


def collate_to_tensors(
    collate: Any, base: type, columnar: Mapping[str, Any], prepared: Any, generated: Sequence[str] = ()
) -> dict[str, Any]:
    """The batch ``collate`` (an instance of ``base`` or of a subclass) makes of ``columnar``,
    which ``prepared`` planned: the batch's fields in its order (object fields as lists), then
    ``generated`` in that order, then any other array the layout holds."""
    cls = type(collate)
    # A subclass's own layout or collate_into is what the fast path calls: so does this.
    own = any(getattr(cls, name) is not getattr(base, name) for name in ("layout", "collate_into"))
    layout = collate.layout(columnar) if own else prepared.layout
    arrays = {name: np.empty(shape, dtype=dtype) for name, (shape, dtype) in layout.items()}
    if own:
        collate.collate_into(columnar, arrays)
    else:
        prepared.fill(arrays)
    result: dict[str, Any] = {}
    for name, column in prepared.columns.items():
        result[name] = column if isinstance(column, list) else torch.from_numpy(arrays[name])
    for name in generated:
        result[name] = torch.from_numpy(arrays[name])
    for name, array in arrays.items():
        if name not in result:
            result[name] = torch.from_numpy(array)
    return result


__all__ = ["collate_to_tensors"]
