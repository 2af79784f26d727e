"""What every store hands back, and the protocol every store implements."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import NamedTuple, Protocol


class ObjectInfo(NamedTuple):
    """One object: ``name`` relative to the store's URL (``""`` is the URL itself), ``size`` in
    bytes, and ``version``: a string that changes when the object is rewritten (S3's mtime in
    nanoseconds, an HTTP ``ETag`` or ``Last-Modified``), or ``""`` where the store gives none,
    for cache keys."""

    name: str
    size: int
    version: str


class StoreStats(NamedTuple):
    """Counters since the store was opened: ``requests`` made to the store (every attempt, so
    retried ones too), payload ``bytes`` received, and ``retries`` after a transient error."""

    requests: int
    bytes: int
    retries: int


class Store(Protocol):
    """A folder (or one object) of a remote store, named by :attr:`url`.

    Names are relative to the URL and use ``/``. Every method retries transient errors (5xx,
    429, a dropped or refused connection, a timeout, a short read) under the store's
    :class:`RetryPolicy` and raises :class:`~fastload.errors.StorageNotFoundError` or
    :class:`~fastload.errors.StoragePermissionError` at once for a permanent one, or
    :class:`~fastload.errors.StorageError` once the retry budget is spent; each names the URL.
    A store may be used from several threads at once, but not across ``fork``: open one in the
    process that uses it.

    Capability flags: ``can_list`` (False for HTTP(S), which has no listing) and ``can_write``
    (False for HTTP(S); it guards ``write``, ``upload`` and ``delete``); the methods they guard
    raise :class:`StorageError` where False.
    """

    url: str
    can_list: bool
    can_write: bool

    def join(self, name: str) -> str: ...

    def info(self, name: str) -> ObjectInfo: ...

    def list(self) -> list[ObjectInfo]: ...

    def read(self, name: str) -> bytes: ...

    def read_range(self, name: str, start: int, length: int) -> bytes: ...

    def ranges(self, name: str) -> AbstractContextManager[Callable[[int, int], bytes]]:
        """A reader of object ``name`` while the ``with`` block runs: ``read_at(start,
        length)`` returns exactly those bytes, one ranged GET each, retried as
        :meth:`read_range` is; the object is opened once (on S3, one HEAD for all reads)."""
        ...

    def download(
        self,
        name: str,
        fd: int,
        *,
        size: int,
        start: int = 0,
        parallel: int = 4,
        part_bytes: int = 8 << 20,
        on_bytes: Callable[[int], None] | None = None,
    ) -> None: ...

    def write(self, name: str, data: bytes) -> None: ...

    def upload(self, name: str, local_path: str) -> None: ...

    def delete(self, name: str) -> None: ...

    def stats(self) -> StoreStats: ...
