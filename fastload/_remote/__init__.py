"""Datasets where they really live (layer 1, beside ``_storage``): the dataset index; one small
client interface (:class:`Store`) over S3 and S3-compatible stores and GCS (``pyarrow.fs``) and
read-only HTTP(S) (urllib3), with transient errors retried under a bounded time
and permanent ones raised at once, typed; and the local shard cache."""

from __future__ import annotations

from fastload._remote._cache import ShardCache, eviction_order, parse_size
from fastload._remote._index import INDEX_NAME, DatasetIndex, ShardEntry, fields_equal
from fastload._remote._objects import ObjectInfo, Store, StoreStats
from fastload._remote._retry import RetryPolicy
from fastload._remote._store import ENDPOINT_ENV, REMOTE_SCHEMES, is_remote, open_store

__all__ = [
    "ENDPOINT_ENV",
    "INDEX_NAME",
    "REMOTE_SCHEMES",
    "DatasetIndex",
    "ObjectInfo",
    "RetryPolicy",
    "ShardCache",
    "ShardEntry",
    "Store",
    "StoreStats",
    "eviction_order",
    "fields_equal",
    "is_remote",
    "open_store",
    "parse_size",
]
