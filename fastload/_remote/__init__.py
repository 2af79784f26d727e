"""Datasets where they really live (layer 1, beside ``_storage``): the dataset index, the
storage client for object stores, and the local shard cache."""

from __future__ import annotations

from fastload._remote._cache import ShardCache, eviction_order, parse_size
from fastload._remote._index import INDEX_NAME, DatasetIndex, ShardEntry, fields_equal

__all__ = [
    "INDEX_NAME",
    "DatasetIndex",
    "ShardCache",
    "ShardEntry",
    "eviction_order",
    "fields_equal",
    "parse_size",
]
