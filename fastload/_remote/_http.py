"""Read-only HTTP(S) through the standard library: ``HEAD`` for the size and version, ``GET``
with ``Range`` for parts. A web server cannot be listed, so an HTTP(S) dataset needs its index."""

from __future__ import annotations

import functools
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from fastload._remote._download import check_download_args, download_ranges
from fastload._remote._objects import ObjectInfo, StoreStats
from fastload._remote._retry import Retrier, ShortReadError
from fastload.errors import StorageError

OPTIONS = ("headers", "timeout_s")
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


class HttpStore:
    """A :class:`~fastload._remote.Store` over HTTP(S). ``storage_options``: ``headers`` (sent
    with every request, e.g. ``{"Authorization": "Bearer ..."}``) and ``timeout_s`` (of each
    connect and read, default 60)."""

    can_list = False
    can_write = False

    def __init__(self, url: str, options: Mapping[str, Any], retrier: Retrier) -> None:
        self.url = url
        self._headers = dict(options.get("headers") or {})
        self._timeout_s = float(options.get("timeout_s", 60.0))
        if not self._timeout_s > 0:
            raise ValueError(f"storage_options timeout_s={self._timeout_s!r}: must be > 0 seconds")
        self._retrier = retrier

    def __repr__(self) -> str:
        return f"HttpStore({self.url!r})"

    def join(self, name: str) -> str:
        return f"{self.url.rstrip('/')}/{urllib.parse.quote(name)}" if name else self.url

    def stats(self) -> StoreStats:
        return self._retrier.stats()

    def _request(self, url: str, method: str, byte_range: tuple[int, int] | None = None) -> tuple[int, Any, bytes]:
        """(status, headers, body) of one request; an error status raises ``HTTPError``."""
        headers = dict(self._headers)
        if byte_range is not None:
            headers["Range"] = f"bytes={byte_range[0]}-{byte_range[1]}"
        self._retrier.count(requests=1)
        request = urllib.request.Request(url, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self._timeout_s) as response:
                body = response.read()  # raises IncompleteRead if the reply is cut short
                self._retrier.count(received=len(body))
                return response.status, response.headers, body
        except urllib.error.HTTPError as exc:
            exc.close()  # it holds the connection
            raise

    def info(self, name: str) -> ObjectInfo:
        def head() -> ObjectInfo:
            _, headers, _ = self._request(self.join(name), "HEAD")
            length = headers.get("Content-Length")
            if length is None:
                raise StorageError(f"{self.join(name)}: the server sends no Content-Length, so the size is unknown", self.join(name))
            return ObjectInfo(name, int(length), headers.get("ETag") or headers.get("Last-Modified") or "")

        return self._retrier.call(self.join(name), head)

    def list(self) -> list[ObjectInfo]:
        raise StorageError(
            f"{self.url}: HTTP(S) cannot be listed; publish an index beside the shards (fastload index) "
            "or name the files one by one.",
            self.url,
        )

    def read(self, name: str) -> bytes:
        return self._retrier.call(self.join(name), lambda: self._request(self.join(name), "GET")[2])

    def _reader(self, name: str, size: int | None) -> Callable[[int, int], bytes]:
        url = self.join(name)

        def read_at(offset: int, length: int) -> bytes:
            if length == 0:
                return b""
            status, headers, body = self._request(url, "GET", (offset, offset + length - 1))
            if status != 206:
                raise StorageError(f"{url}: the server ignored the Range header (status {status}); it must answer 206", url)
            match = _CONTENT_RANGE.fullmatch(headers.get("Content-Range", ""))
            if match and size is not None and match.group(3) not in ("*", str(size)):
                raise StorageError(
                    f"{url}: the object holds {match.group(3)} bytes, not the {size} expected; it was rewritten since "
                    "it was indexed. Index the dataset again.",
                    url,
                )
            if len(body) != length:
                raise ShortReadError(f"{url}: {len(body)} of {length} bytes at offset {offset}")
            return bytes(body)

        return read_at

    def read_range(self, name: str, start: int, length: int) -> bytes:
        if start < 0 or length < 0:
            raise ValueError(f"read_range({self.join(name)!r}, start={start}, length={length}): must be >= 0")
        read_at = self._reader(name, None)
        return self._retrier.call(self.join(name), lambda: read_at(start, length))

    @contextmanager
    def ranges(self, name: str) -> Iterator[Callable[[int, int], bytes]]:
        yield functools.partial(self.read_range, name)  # HTTP opens nothing: each read is one GET

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
        download_ranges(
            self.join(name), self._retrier, self._reader(name, size), fd,
            size=size, start=start, parallel=parallel, part_bytes=part_bytes, on_bytes=on_bytes,
        )  # fmt: skip

    def write(self, name: str, data: bytes) -> None:
        raise StorageError(f"{self.join(name)}: HTTP(S) stores are read-only; write to S3 or GCS instead", self.join(name))

    def upload(self, name: str, local_path: str) -> None:
        self.write(name, b"")

    def delete(self, name: str) -> None:
        self.write(name, b"")
