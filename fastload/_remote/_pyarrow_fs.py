"""S3 (and S3-compatible stores) and GCS through ``pyarrow.fs``, which fastload already depends
on: its S3 client is the AWS SDK's, its GCS client google-cloud-cpp's."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from fastload._remote._download import check_download_args, download_ranges
from fastload._remote._objects import ObjectInfo, StoreStats
from fastload._remote._retry import Retrier, ShortReadError
from fastload.errors import StorageError

# pyarrow lists at most this many keys per ListObjectsV2 request, and writes an object of less
# than one upload part with a single PUT when the stream's open is delayed (S3 only).
_LIST_PAGE = 1000
_UPLOAD_PART_BYTES = 10 << 20
# S3 always sends Last-Modified. A HEAD reply cut within its headers reaches pyarrow as a 200
# without them, and would read as an empty object (seen against moto through the test proxy).
_CUT_HEADERS = "the reply to HEAD came without Last-Modified, cut short on the way"


class ArrowStore:
    """A :class:`~fastload._remote.Store` over a ``pyarrow.fs.FileSystem``; ``base`` is the
    bucket and prefix (``bucket/corpus``), ``url`` the same with its scheme."""

    can_list = True
    can_write = True

    def __init__(self, url: str, filesystem: Any, base: str, retrier: Retrier, *, s3: bool) -> None:
        self.url = url
        self._fs = filesystem
        self._s3 = s3
        self._base = base.rstrip("/")
        self._retrier = retrier

    def __repr__(self) -> str:
        return f"ArrowStore({self.url!r})"

    def join(self, name: str) -> str:
        return f"{self.url.rstrip('/')}/{name}" if name else self.url

    def _path(self, name: str) -> str:
        return f"{self._base}/{name}" if name else self._base

    def stats(self) -> StoreStats:
        return self._retrier.stats()

    def info(self, name: str) -> ObjectInfo:
        import pyarrow.fs as pafs

        def head() -> ObjectInfo:
            self._retrier.count(requests=1)
            found = self._fs.get_file_info(self._path(name))
            if found.type != pafs.FileType.File:  # after the HEAD, a listing: is it a folder?
                self._retrier.count(requests=1)
            if found.type != pafs.FileType.File:
                what = "a folder, not an object" if found.type == pafs.FileType.Directory else "missing"
                raise FileNotFoundError(f"{self._path(name)} is {what}")
            if not found.mtime_ns:
                raise ShortReadError(f"{self.join(name)}: {_CUT_HEADERS}")
            return ObjectInfo(name, found.size, str(found.mtime_ns or ""))

        return self._retrier.call(self.join(name), head)

    def list(self) -> list[ObjectInfo]:
        import pyarrow.fs as pafs

        def listing() -> list[ObjectInfo]:
            # Not allow_not_found: with it, pyarrow lists a missing bucket as empty too.
            selector = pafs.FileSelector(self._base + "/", recursive=True)
            self._retrier.count(requests=1)
            try:
                found = [f for f in self._fs.get_file_info(selector) if f.type == pafs.FileType.File]
            except FileNotFoundError:  # no key under the prefix; a missing bucket raises otherwise
                found = []
            self._retrier.count(requests=max(0, -(-len(found) // _LIST_PAGE) - 1))
            cut = len(self._base) + 1
            return sorted(ObjectInfo(f.path[cut:], f.size, str(f.mtime_ns or "")) for f in found)

        return self._retrier.call(self.url, listing)

    def _open(self, name: str, deadline: float | None = None) -> Any:
        def head() -> Any:
            self._retrier.count(requests=1)
            handle = self._fs.open_input_file(self._path(name))
            if self._s3 and "Last-Modified" not in handle.metadata():  # a dict of str keys
                handle.close()
                raise ShortReadError(f"{self.join(name)}: {_CUT_HEADERS}")
            return handle

        return self._retrier.call(self.join(name), head, deadline=deadline)

    def _reader(self, name: str, handle: Any) -> Callable[[int, int], bytes]:
        def read_at(offset: int, length: int) -> bytes:
            if length == 0:
                return b""
            self._retrier.count(requests=1)
            data = handle.read_at(length, offset)
            self._retrier.count(received=len(data))
            if len(data) != length:
                raise ShortReadError(f"{self.join(name)}: {len(data)} of {length} bytes at offset {offset}")
            return bytes(data)

        return read_at

    def read(self, name: str) -> bytes:
        handle = self._open(name)
        with handle:
            read_at = self._reader(name, handle)
            return self._retrier.call(self.join(name), lambda: read_at(0, handle.size()))

    def read_range(self, name: str, start: int, length: int) -> bytes:
        handle = self._open(name)
        with handle:
            _check_range(self.join(name), start, length, handle.size())
            read_at = self._reader(name, handle)
            return self._retrier.call(self.join(name), lambda: read_at(start, length))

    @contextmanager
    def ranges(self, name: str) -> Iterator[Callable[[int, int], bytes]]:
        handle = self._open(name)
        with handle:
            read_at, size = self._reader(name, handle), handle.size()

            def ranged(start: int, length: int) -> bytes:
                _check_range(self.join(name), start, length, size)
                return self._retrier.call(self.join(name), lambda: read_at(start, length))

            yield ranged

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
    ) -> None:
        check_download_args(size=size, start=start, parallel=parallel, part_bytes=part_bytes)
        handle = self._open(name)
        with handle:
            if handle.size() != size:
                raise StorageError(
                    f"{self.join(name)}: the object holds {handle.size()} bytes, not the {size} expected; "
                    "it was rewritten since it was listed or indexed. Index the dataset again.",
                    self.join(name),
                )
            download_ranges(
                self.join(name), self._retrier, self._reader(name, handle), fd,
                size=size, start=start, parallel=parallel, part_bytes=part_bytes, on_bytes=on_bytes,
            )  # fmt: skip

    def _put(self, name: str, produce: Callable[[Any], None], size: int) -> None:
        def put() -> None:
            parts = -(-size // _UPLOAD_PART_BYTES)
            self._retrier.count(requests=1 if parts <= 1 else parts + 2)
            with self._fs.open_output_stream(self._path(name)) as out:
                produce(out)

        self._retrier.call(self.join(name), put)

    def write(self, name: str, data: bytes) -> None:
        """One PUT below 10 MiB (S3 makes it visible whole or not at all); a multipart upload
        above, which S3 also publishes only when complete."""
        self._put(name, lambda out: out.write(data), len(data))

    def upload(self, name: str, local_path: str) -> None:
        def copy(out: Any) -> None:
            with open(local_path, "rb") as source:
                while chunk := source.read(_UPLOAD_PART_BYTES):
                    out.write(chunk)

        self._put(name, copy, os.path.getsize(local_path))

    def delete(self, name: str) -> None:
        """Delete one object; a missing one raises :class:`StorageNotFoundError`."""

        def remove() -> None:
            # On S3 pyarrow sends a HEAD first and, after the DELETE, PUTs an empty marker for
            # the parent folder (its folder emulation; listings skip it): three requests,
            # counted against moto. GCS: one counted, not measured.
            self._retrier.count(requests=3 if self._s3 else 1)
            self._fs.delete_file(self._path(name))

        self._retrier.call(self.join(name), remove)


def _check_range(url: str, start: int, length: int, size: int) -> None:
    if start < 0 or length < 0 or start + length > size:
        raise ValueError(f"read_range({url!r}, start={start}, length={length}): outside the object's {size} bytes")
