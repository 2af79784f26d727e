"""Where a reader's shards live, behind one seam (:class:`ShardSource`): files on the local disk
(:class:`LocalShards`), or objects on remote storage read through the node's shard cache
(:class:`CachedShards`: the dataset's index, pinning what a process reads, checking a shard once
as it enters the cache, and the prefetcher that brings the epoch's shards ahead of the reads).
The readers in ``fastload._formats`` decode a local file and ask their source for it."""

from __future__ import annotations

from fastload._shards._cached import MAX_OPEN_REMOTE_SHARDS, CachedShards
from fastload._shards._prefetch import ShardPrefetcher
from fastload._shards._remote_source import RemoteSource, local_only, remote_fields
from fastload._shards._source import LocalShards, ShardFile, ShardSource

__all__ = [
    "MAX_OPEN_REMOTE_SHARDS",
    "CachedShards",
    "LocalShards",
    "RemoteSource",
    "ShardFile",
    "ShardPrefetcher",
    "ShardSource",
    "local_only",
    "remote_fields",
]
