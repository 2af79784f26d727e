"""Remote datasets: shards on object storage, read through a local cache of whole, verified
files (the readers keep reading local, memory-mapped files)."""

from __future__ import annotations

from fastload._remote._cache import ShardCache, eviction_order, parse_size

__all__ = ["ShardCache", "eviction_order", "parse_size"]
