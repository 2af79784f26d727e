"""The seam between a reader and where its shards live.

A reader (``fastload._formats``) decodes a shard file on the local disk; a :class:`ShardSource`
says which file that is and what opening it takes. :class:`LocalShards` hands over the files
the dataset was made from, described and checked at its construction. The remote source
(``_cached.CachedShards``) brings a shard into the node's cache, pins it there while it is open,
and has it checked against the index the first time it enters the cache. Only the source knows
which it is: the reader asks it to open a shard, to count a read, for the lengths an index
holds, and to prefetch the epoch's plan, the same way for both.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from fastload._types import Field, StorageCounts
from fastload.errors import DataFormatError


@dataclass(frozen=True)
class ShardFile:
    """One shard on the local disk, as a reader is to open it."""

    #: The local file that reads go to.
    path: str
    #: How messages name the shard (its file, or the URL it came from).
    name: str
    #: Whether the reader described this file when the dataset was made (a local file). A
    #: shard first seen now (a remote one, planned from its index) is described when opened,
    #: and must hold what the index says: :meth:`check_holds`.
    described: bool
    #: Whether its payload checks ran already (the reader's at construction, or the cache's
    #: record of the checks it passed when it entered the cache): a reader skips its own.
    checked: bool
    #: The samples its index lists (``-1``: a described file, nothing to compare).
    indexed_samples: int = -1

    def check_holds(self, fields: Mapping[str, Field], samples: int, expected: Mapping[str, Field]) -> None:
        """Raise :class:`DataFormatError` unless the shard holds what its index said: the
        fields ``expected`` and :attr:`indexed_samples` samples."""
        if dict(fields) != dict(expected) or samples != self.indexed_samples:
            raise DataFormatError(
                f"{self.name}: holds {samples} samples of fields {dict(fields)}, but its index "
                f"says {self.indexed_samples} of {dict(expected)}; write the index again "
                "(`fastload index`)"
            )


class OpenShards(Protocol):
    """What one process of a reader holds (``fastload._formats._process.ProcessState``), as a
    source sees it: a reader per open shard, under ``lock``; what the source holds for each
    (a pin in the cache), least recently read first; and how to close one."""

    readers: list[Any]
    holds: OrderedDict[int, AbstractContextManager[Any]]
    lock: threading.Lock

    def close_shard(self, shard: int) -> None: ...


class ShardReaderLike(Protocol):
    """What a source asks of a reader it opened: the lengths of a ragged field, and closing."""

    def lengths(self, field: str) -> npt.NDArray[np.int64]: ...

    def close(self) -> None: ...


#: The reader a source's ``open_file`` makes.
_R = TypeVar("_R", bound=ShardReaderLike)


class ShardSource(Protocol):
    """Where a reader's shards are (see the module text). Pickled with the dataset: what it
    holds in one process is reset in another."""

    #: Whether the shards come from object storage through the node's cache.
    remote: bool

    def open(self, shard: int, process: OpenShards, open_file: Callable[[ShardFile], _R]) -> _R:
        """``open_file`` of shard ``shard``'s local file, for this process to keep open (the
        caller holds ``process.lock`` and stores the reader in ``process.readers``)."""
        ...

    def read_again(self, shard: int, process: OpenShards) -> None:
        """A read of shard ``shard``, whose reader ``process`` has open."""
        ...

    def name(self, shard: int) -> str:
        """How messages name shard ``shard``."""
        ...

    def path(self, shard: int) -> str | None:
        """The local file reads of shard ``shard`` go to, where it is known before the shard
        is opened; ``None`` where it is not (a remote shard, until it is in the cache)."""
        ...

    def read_files(self) -> list[str]:
        """:meth:`path` of every shard; empty when they are not known before the shards are
        read (a remote dataset)."""
        ...

    def indexed_lengths(self) -> npt.NDArray[np.int64] | None:
        """The lengths an index lists for every sample, or ``None``: the reader computes them
        from the shards."""
        ...

    def storage_counts(self) -> StorageCounts | None:
        """What this process's reads cost in storage traffic so far; ``None``: they cost none
        (local files)."""
        ...

    def prefetch(
        self, batches: Iterator[npt.NDArray[np.int64]], consumed: Callable[[], int], *, concurrency: int
    ) -> Any:
        """Bring the shards of ``batches`` (the epoch's plan, in order; the consumer's progress
        is ``consumed()``) to the local disk ahead of the reads: a prefetcher with ``close()``,
        or ``None`` where there is nothing to bring."""
        ...

    def cache_plan(self) -> tuple[str, int | None, int] | None:
        """``(folder, cache_limit, dataset_bytes)`` of the cache the shards go through, or
        ``None`` (none)."""
        ...

    def cache_window_warning(self, shuffle_shards: int) -> str | None:
        """Why a shard window of ``shuffle_shards`` shards will starve the prefetcher in a
        bounded cache, or ``None``."""
        ...


class LocalShards:
    """Shards that are files on the local disk, read where they are: opening one hands the
    reader its file (``paths``: the files reads go to, which a reader may have chosen over the
    ones given, as for a Parquet file's decoded copy; ``names``: how messages name them).
    Nothing is counted, prefetched or cached."""

    remote = False

    def __init__(self, paths: Sequence[str], names: Sequence[str]) -> None:
        self._paths = list(paths)
        self._names = list(names)

    def open(self, shard: int, process: OpenShards, open_file: Callable[[ShardFile], _R]) -> _R:
        return open_file(ShardFile(self._paths[shard], self._names[shard], described=True, checked=True))

    def read_again(self, shard: int, process: OpenShards) -> None:
        return None

    def name(self, shard: int) -> str:
        return self._names[shard]

    def path(self, shard: int) -> str:
        return self._paths[shard]

    def read_files(self) -> list[str]:
        return list(self._paths)

    def indexed_lengths(self) -> None:
        return None

    def storage_counts(self) -> None:
        return None

    def prefetch(self, batches: Any, consumed: Any, *, concurrency: int) -> None:
        return None

    def cache_plan(self) -> None:
        return None

    def cache_window_warning(self, shuffle_shards: int) -> None:
        return None


__all__ = ["LocalShards", "OpenShards", "ShardFile", "ShardReaderLike", "ShardSource"]
