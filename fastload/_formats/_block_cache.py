"""A small byte-bounded LRU cache for decoded blocks (HDF5 chunks, Parquet row groups,
compressed Arrow record batches), one per reader per process."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class BlockCache(Generic[V]):
    """Keeps the most recently used blocks whose sizes add up to at most ``capacity_bytes``.

    The newest block is always kept, even when it alone exceeds the capacity, so that reading one
    oversized row group sample by sample does not decode it again for every sample. Safe to use
    from several threads.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self._capacity_bytes = capacity_bytes
        self._entries: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()
        self._held_bytes = 0
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> V | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: Hashable, value: V, nbytes: int) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._held_bytes -= old[1]
            self._entries[key] = (value, nbytes)
            self._held_bytes += nbytes
            while self._held_bytes > self._capacity_bytes and len(self._entries) > 1:
                _, (_, dropped) = self._entries.popitem(last=False)
                self._held_bytes -= dropped

    @property
    def capacity_bytes(self) -> int:
        """The budget this cache was created with."""
        return self._capacity_bytes

    @property
    def held_bytes(self) -> int:
        """Bytes of the blocks held now."""
        return self._held_bytes
