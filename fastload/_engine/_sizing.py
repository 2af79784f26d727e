"""How large the fast path's batch slots are.

Where the collate says how large its batches can be (``max_layout``: packing), or the sampler
says what its batches can hold (a ``batch_size`` or a ``max_tokens``, or a list of index lists),
the regular slots are sized once for the largest batch (:func:`slot_bytes_bound`). Where it does not (a user's own batch sampler), or where that bound
would not fit in shared memory, they are sized from the batches that actually come
(:class:`SlotSizing`): the first batch sets the size (with some headroom); a batch larger than
the slots gets a temporary slot of its own; and when such outliers stop being rare the regular
slots are remade larger. Nothing is reserved that no batch needs.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from typing import Any

import numpy as np

from fastload._capabilities import Capabilities, SamplerCapabilities, resolve
from fastload._engine._arena import SlotArena, SlotDevice, align, available_memory_bytes
from fastload._protocols import Layout
from fastload._types import Field, Ragged

HEADROOM = 1.25  # regular slots hold this much more than the batch that sized them
WINDOW = 32  # batches looked back on when deciding to remake the slots
OUTLIERS = 2  # temporary slots within a window that make the regular ones grow
_LENGTH_STEP = 1.125  # lengths are rounded up to a power of this: at most 12.5 % too large
_MIN_SHARED_BYTES = 256 << 20  # the default bound of all slots never goes below this


def plan_layout(layout: Layout) -> tuple[list[tuple[str, int, tuple[int, ...], np.dtype]], int]:
    """Each output array as ``(name, byte offset, shape, dtype)``, each offset aligned, and the
    total size."""
    arrays = []
    offset = 0
    for name, (shape, dtype) in layout.items():
        dt = dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)
        arrays.append((name, offset, shape, dt))
        offset = align(offset + math.prod(shape) * dt.itemsize)
    return arrays, offset


def synthetic_batch(fields: Mapping[str, Field], rows: int, length: int) -> dict[str, Any]:
    """A columnar batch of ``rows`` samples of ``length`` elements per ragged field, built from
    zero-stride arrays (no memory), for sizing slots with the collate's own layout."""
    out: dict[str, Any] = {}
    for name, f in fields.items():
        if f.kind == "ragged":
            values = np.broadcast_to(np.zeros((), f.dtype), (rows * length, *f.shape))
            out[name] = Ragged(values, np.full(rows, length, dtype=np.int64))
        elif f.kind == "fixed":
            out[name] = np.broadcast_to(np.zeros((), f.dtype), (rows, *f.shape))
        else:
            out[name] = [""] * rows
    return out


def batch_bytes(collate: Any, fields: Mapping[str, Field], rows: int, length: int) -> int:
    """The slot bytes of a batch of ``rows`` samples ``length`` long, by the collate's layout
    (other ragged fields assumed no longer than the length field)."""
    return plan_layout(collate.layout(synthetic_batch(fields, max(1, rows), max(1, length))))[1]


def slot_bytes_bound(
    collate: Any,
    fields: Mapping[str, Field],
    lengths: np.ndarray,
    *,
    rows: int | None,
    max_tokens: int | None,
) -> int:
    """The bytes of the largest batch the plan can produce: at most ``rows`` samples of the
    longest length, or, under a token budget, either many short samples or few long ones,
    whichever needs more (a batch that is still larger gets a temporary slot)."""
    n = max(1, len(lengths))
    longest = max(1, int(lengths.max())) if len(lengths) else 1
    shortest = max(1, int(lengths.min())) if len(lengths) else 1
    if max_tokens is None:
        return batch_bytes(collate, fields, min(rows or n, n), longest)
    cap = min(n, rows or n, max(1, max_tokens // shortest))
    return max(
        batch_bytes(collate, fields, cap, max(shortest, max_tokens // cap)),
        batch_bytes(collate, fields, max(1, min(cap, max_tokens // longest)), longest),
    )


class BatchBytes:
    """The slot bytes one batch will need, from its sample indices: its rows and the longest
    of its samples (``lengths``), through the collate's layout. Layouts are computed once per
    row count and length step (lengths rounded up by at most 12.5 %), so most batches cost a
    gather of their lengths and a lookup."""

    def __init__(self, collate: Any, fields: Mapping[str, Field], lengths: np.ndarray) -> None:
        self._collate = collate
        self._fields = fields
        self._lengths = np.asarray(lengths)
        self._known: dict[tuple[int, int], int] = {}

    def __call__(self, indices: bytes) -> int | None:
        """The bytes, or ``None`` for indices the lengths cannot answer for (out of range: the
        worker says what is wrong)."""
        rows = len(indices) // 8
        if not rows:
            return None
        try:
            longest = int(self._lengths[np.frombuffer(indices, dtype=np.int64)].max())
        except IndexError:
            return None
        step = math.ceil(math.log(max(1, longest), _LENGTH_STEP))
        key = (rows, step)
        known = self._known.get(key)
        if known is None:
            length = max(longest, math.ceil(_LENGTH_STEP**step))
            known = self._known[key] = batch_bytes(self._collate, self._fields, rows, length)
        return known


class SlotSizing:
    """When the regular slots should be remade, from the bytes of the batches that come (pure:
    no memory is touched here). ``capacity`` is what the slots hold now (0: not sized yet)."""

    def __init__(self) -> None:
        self.capacity = 0
        self._recent: deque[int] = deque(maxlen=WINDOW)
        self._outliers: deque[bool] = deque(maxlen=WINDOW)

    def observe(self, need: int) -> int | None:
        """A batch needing ``need`` bytes is about to be sent. Returns the capacity to remake
        the slots with before it is (the first batch, or outliers no longer rare), else
        ``None``; a batch that still does not fit then takes a temporary slot."""
        self._recent.append(need)
        over = need > self.capacity
        self._outliers.append(over)
        if self.capacity == 0 or (over and sum(self._outliers) >= OUTLIERS):
            self.capacity = align(int(max(self._recent) * HEADROOM))
            self._outliers.clear()
            return self.capacity
        return None


def slot_arena(
    collate: Any,
    reader: Any,
    index_sampler: Any,
    *,
    slots: int,
    max_bytes: int | None,
    pin: SlotDevice | None,
    capabilities: Capabilities | None = None,
) -> tuple[SlotArena, BatchBytes | None]:
    """The slots for ``reader``'s batches padded by ``collate``: sized for the largest batch
    ``index_sampler`` can make where it says so and that fits in ``max_bytes`` (default a
    quarter of the available memory), else sized from the batches that come (then with the
    :class:`BatchBytes` that measures them)."""
    capabilities = resolve(reader, collate, index_sampler) if capabilities is None else capabilities
    fields = capabilities.dataset.fields
    assert fields is not None, "the fast path runs only for a reader with fields"
    lengths = np.asarray(reader.lengths)
    if max_bytes is None:
        max_bytes = max(_MIN_SHARED_BYTES, (available_memory_bytes() or 4 << 30) // 4)
    bound = _collate_bound(collate, reader) if capabilities.collate.max_layout else None
    rows, max_tokens = _plan_rows_and_tokens(index_sampler, capabilities.sampler)
    if bound is None and (rows is not None or max_tokens is not None):
        bound = slot_bytes_bound(collate, fields, lengths, rows=rows, max_tokens=max_tokens)
    if bound is not None and SlotArena.stride(bound) * slots <= max_bytes:
        return SlotArena(slot_bytes=bound, slots=slots, max_bytes=max_bytes, pin=pin), None
    arena = SlotArena(slot_bytes=0, slots=slots, max_bytes=max_bytes, pin=pin)
    return arena, BatchBytes(collate, fields, lengths)


def _collate_bound(collate: Any, reader: Any) -> int | None:
    """The bytes of the largest batch, where the collate can tell from the reader alone
    (``max_layout``, ``fastload._protocols``)."""
    layout = collate.max_layout(reader)
    return None if layout is None else plan_layout(layout)[1]


def _plan_rows_and_tokens(sampler: Any, says: SamplerCapabilities) -> tuple[int | None, int | None]:
    """The most rows and the token budget of the batches ``sampler`` says it makes (``says``,
    as the loader resolved them; ``None`` where it does not say)."""
    rows, max_tokens = says.batch_size, says.max_tokens
    if rows is None and max_tokens is None and isinstance(sampler, (list, tuple)):
        rows = max((len(b) for b in sampler), default=1)
    return rows, max_tokens


__all__ = ["BatchBytes", "SlotSizing", "batch_bytes", "plan_layout", "slot_arena", "slot_bytes_bound", "synthetic_batch"]
