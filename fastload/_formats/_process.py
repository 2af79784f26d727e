"""What one process of a sharded reader holds: the shard files it has opened (each a
:class:`ShardReader`), the cache of decoded blocks they share, and its readahead descriptors.
Never pickled nor shared across a fork (``ShardedDataset`` makes a new one in each process)."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from fastload._formats._block_cache import BlockCache
from fastload._formats._readahead import AdviseFiles
from fastload._types import Column, Spans


class ShardReader(Protocol):
    """One shard file opened in the current process.

    Optional, for :meth:`ShardedDataset.willneed`: ``byte_ranges(field, rows) -> (starts,
    lengths) | None``, the byte ranges of the local file reads of the shard go to
    that hold the payload of ``rows`` of ``field`` (int64 arrays, any order), or ``None``
    where the reader does not know them. A reader without it gets no readahead hints.

    Optional: ``check_mapped()``, raising :class:`~fastload.errors.DataFormatError` when a file
    the reader reads through a memory map is shorter than when it was mapped (reading the map
    past the new end would kill the process with SIGBUS); called before every read.
    """

    def read(self, field: str, rows: npt.NDArray[np.int64]) -> Column:
        """The samples ``rows`` (shard-local, in range, any order, duplicates allowed) of
        ``field``, in that order."""
        ...

    def lengths(self, field: str) -> npt.NDArray[np.int64]:
        """Per-sample lengths of the ragged ``field``, without reading its payload."""
        ...

    def close(self) -> None: ...


# What a shard reader may offer beyond ``ShardReader``, each declared by the methods its class
# defines and tested with :func:`offers` (per class, once), never by looking up a name.


@runtime_checkable
class LocatesBytes(Protocol):
    """A shard reader that knows where the payload of rows lies in its file (readahead)."""

    def byte_ranges(self, field: str, rows: npt.NDArray[np.int64]) -> Any:
        """``(starts, lengths)`` of the bytes holding ``rows`` of ``field``, or ``None``."""


@runtime_checkable
class ChecksMapped(Protocol):
    """A shard reader that reads through a memory map and can tell when its file shrank."""

    def check_mapped(self) -> None:
        """Raise :class:`~fastload.errors.DataFormatError` when the file is shorter than
        when it was mapped (reading the map past its end would kill the process with SIGBUS)."""


@runtime_checkable
class ReadsShardInPlace(Protocol):
    """A shard reader that can leave a memory-mapped ragged field where it lies."""

    def read_in_place(self, field: str, rows: npt.NDArray[np.int64]) -> Column | Spans:
        """Like ``read``; a memory-mapped ragged field comes back as ``Spans``."""


@runtime_checkable
class MapsRaggedField(Protocol):
    """A shard reader that can hand out a ragged field's mapped values and offsets."""

    def mapped_ragged(self, field: str) -> tuple[np.ndarray, np.ndarray] | None:
        """``field``'s values and int64 offsets as mapped views, or ``None``."""


def offers(reader: object, capability: type) -> bool:
    """Whether ``reader``'s class defines what the Protocol ``capability`` declares (decided
    once per class: a read asks for each shard)."""
    key = (type(reader), capability)
    found = _OFFERS.get(key)
    if found is None:
        found = _OFFERS[key] = issubclass(key[0], capability)
    return found


_OFFERS: dict[tuple[type, type], bool] = {}


class ProcessState:
    """The shard readers opened by one process, opened on first use, and the cache of decoded
    blocks they share; and what the dataset's shard source holds for each open shard while its
    reader is open (a remote shard's pin in the cache: ``fastload._shards._cached``), least
    recently read first."""

    def __init__(self, num_shards: int, cache_bytes: int) -> None:
        self.pid = os.getpid()
        self.readers: list[ShardReader | None] = [None] * num_shards
        self.cache: BlockCache[Any] = BlockCache(cache_bytes)
        self.lock = threading.Lock()
        self.holds: OrderedDict[int, AbstractContextManager[Any]] = OrderedDict()
        self.hints = AdviseFiles()

    def close_shard(self, shard: int) -> None:
        reader = self.readers[shard]
        if reader is not None:
            reader.close()
            self.readers[shard] = None
        held = self.holds.pop(shard, None)
        if held is not None:  # after the close: a pinned file is never evicted while mapped
            held.__exit__(None, None, None)

    def close(self) -> None:
        for i in range(len(self.readers)):
            self.close_shard(i)
        self.hints.close()


__all__ = ["ProcessState", "ShardReader"]
