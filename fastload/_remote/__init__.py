"""Remote storage below the readers: one small client interface (:class:`Store`) over S3 and
S3-compatible stores and GCS (``pyarrow.fs``) and read-only HTTP(S) (the standard library), with
transient errors retried under a bounded time and permanent ones raised at once, typed."""

from __future__ import annotations

from fastload._remote._objects import ObjectInfo, Store, StoreStats
from fastload._remote._retry import RetryPolicy
from fastload._remote._store import ENDPOINT_ENV, REMOTE_SCHEMES, is_remote, open_store

__all__ = [
    "ENDPOINT_ENV",
    "REMOTE_SCHEMES",
    "ObjectInfo",
    "RetryPolicy",
    "Store",
    "StoreStats",
    "is_remote",
    "open_store",
]
