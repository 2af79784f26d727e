"""The storage layer, below the readers: the local cache directory, and publishing a file into
it atomically and once per machine, however many processes ask."""

from __future__ import annotations

from fastload._storage._derived import SourceVersion, derived_path, other_versions
from fastload._storage._publish import fsync_path, publish, remove, remove_leftovers
from fastload._storage._root import CACHE_ENV, CACHE_REMEDY, cache_root

__all__ = [
    "CACHE_ENV",
    "CACHE_REMEDY",
    "SourceVersion",
    "cache_root",
    "derived_path",
    "fsync_path",
    "other_versions",
    "publish",
    "remove",
    "remove_leftovers",
]
