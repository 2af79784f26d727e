"""Read-only HTTP(S) through urllib3: ``HEAD`` for the size and version, ``GET`` with ``Range``
for parts, over kept-alive connections. A web server cannot be listed, so an HTTP(S) dataset
needs its index.

NOTE [credentials on redirect]: the headers of ``storage_options["headers"]`` (a bearer token,
an API key: which of them is a secret cannot be told from its name), and ``Authorization``,
``Cookie`` and ``Proxy-Authorization`` whoever set them, are sent to the URL's own origin
(scheme, host and port) only. A redirect to another origin is followed without them, and they
stay off for the rest of that request's redirects. urllib3 does the stripping (its
``Retry.remove_headers_on_redirect``, compared by origin), given every header name the user
passed; the standard library's ``urllib`` forwards every header to any host.

NOTE [servers that ignore Range]: a server that answers a ranged ``GET`` with ``200`` and the
whole body (``python -m http.server``) is still read. :meth:`HttpStore.download` notices it on
its first request and streams that body into the file, once, instead of ranged parts. A ranged
read (:meth:`HttpStore.read_range`) reads the body up to the end of its range and drops the
connection, so it downloads ``start + length`` bytes; one that would need more than
:data:`WHOLE_BODY_READ_LIMIT` is refused rather than streaming gigabytes for a footer.
"""

from __future__ import annotations

import functools
import os
import re
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import urllib3

from fastload._remote._download import check_download_args, download_ranges
from fastload._remote._objects import ObjectInfo, StoreStats
from fastload._remote._retry import HttpStatusError, Retrier, ShortReadError
from fastload.errors import StorageError

OPTIONS = ("headers", "timeout_s")
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_MAX_REDIRECTS = 10
_CHUNK_BYTES = 1 << 20
#: The most bytes of a whole body (from a server that ignores ``Range``) that one ranged read
#: may stream to reach its range: far beyond any footer or metadata read of a small shard, far
#: below the shards whose footers sit gigabytes in (see NOTE [servers that ignore Range]).
WHOLE_BODY_READ_LIMIT = 256 << 20


class HttpStore:
    """A :class:`~fastload._remote.Store` over HTTP(S). ``storage_options``: ``headers`` (sent
    with every request to the URL's origin, e.g. ``{"Authorization": "Bearer ..."}``; never to
    another origin a redirect leads to) and ``timeout_s`` (of each connect and read, default
    60). ``HTTP_PROXY``, ``HTTPS_PROXY`` and ``NO_PROXY`` apply as in the standard library."""

    can_list = False
    can_write = False

    def __init__(self, url: str, options: Mapping[str, Any], retrier: Retrier) -> None:
        self.url = url
        headers = options.get("headers") or {}
        if not isinstance(headers, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items()):
            raise ValueError(f"storage_options headers for {url}: must be a dict of str to str; got {headers!r}")
        self._headers = dict(headers)
        self._timeout_s = float(options.get("timeout_s", 60.0))
        if not self._timeout_s > 0:
            raise ValueError(f"storage_options timeout_s={self._timeout_s!r}: must be > 0 seconds")
        self._retrier = retrier
        self._pool = _pool_manager(url, self._headers, self._timeout_s)

    def __repr__(self) -> str:
        return f"HttpStore({self.url!r})"

    def join(self, name: str) -> str:
        return f"{self.url.rstrip('/')}/{urllib.parse.quote(name)}" if name else self.url

    def stats(self) -> StoreStats:
        return self._retrier.stats()

    def _open(self, url: str, method: str, byte_range: tuple[int, int] | None = None) -> Any:
        """The response to one request (redirects followed), its body not yet read; an error
        status raises :class:`HttpStatusError`. The caller reads the body, then calls
        :func:`_finish`."""
        headers = dict(self._headers)
        if byte_range is not None:
            headers["Range"] = f"bytes={byte_range[0]}-{byte_range[1]}"
        self._retrier.count(requests=1)
        response = self._pool.request(method, url, headers=headers, preload_content=False, decode_content=False)
        if response.status >= 300:  # what is left after redirects: an error, or a 3xx without Location
            _finish(response)
            raise HttpStatusError(url, response.status, response.reason or "")
        return response

    def info(self, name: str) -> ObjectInfo:
        url = self.join(name)

        def head() -> ObjectInfo:
            response = self._open(url, "HEAD")
            _finish(response)
            length = response.headers.get("Content-Length")
            if length is None:
                raise StorageError(f"{url}: the server sends no Content-Length, so the size is unknown", url)
            return ObjectInfo(name, int(length), response.headers.get("ETag") or response.headers.get("Last-Modified") or "")

        return self._retrier.call(url, head)

    def list(self) -> list[ObjectInfo]:
        raise StorageError(
            f"{self.url}: HTTP(S) cannot be listed; publish an index beside the shards (fastload index) "
            "or name the files one by one.",
            self.url,
        )

    def read(self, name: str) -> bytes:
        url = self.join(name)

        def get() -> bytes:
            response = self._open(url, "GET")
            try:
                body = bytes(response.read())  # a reply cut short raises ProtocolError (retried)
            finally:
                _finish(response)
            self._retrier.count(received=len(body))
            return body

        return self._retrier.call(url, get)

    def _reader(self, name: str, size: int | None) -> Callable[[int, int], bytes]:
        url = self.join(name)

        def read_at(offset: int, length: int) -> bytes:
            if length == 0:
                return b""
            response = self._open(url, "GET", (offset, offset + length - 1))
            try:
                if response.status == 206:
                    _check_partial(url, response, size)
                    body = bytes(response.read())
                    self._retrier.count(received=len(body))
                else:  # 200: the whole body (NOTE [servers that ignore Range])
                    _check_whole(url, response, size)
                    if offset + length > WHOLE_BODY_READ_LIMIT:
                        raise StorageError(
                            f"{url}: the server ignores Range requests (it answered 200), so reading bytes"
                            f" {offset}-{offset + length - 1} would download the first {offset + length:,}"
                            f" bytes of the object, more than the {WHOLE_BODY_READ_LIMIT:,} fastload streams"
                            " for one ranged read; serve the files with a server that answers Range"
                            " requests with 206 (nginx, Caddy, object storage), or publish an index so"
                            " that shards are downloaded whole",
                            url,
                        )
                    _skip(response, offset)
                    body = _read_exactly(response, length)
                    self._retrier.count(received=offset + len(body))
            finally:
                _finish(response)
            if len(body) != length:
                raise ShortReadError(f"{url}: {len(body)} of {length} bytes at offset {offset}")
            return body

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
        """As :meth:`Store.download`. The first part is one ranged GET; a server that answers it
        with the whole body instead has that body streamed into ``fd`` (from ``start``; a retry
        after a dropped connection continues from the last byte written), and a server that
        answers 206 has the rest fetched in parallel parts."""
        check_download_args(size=size, start=start, parallel=parallel, part_bytes=part_bytes)
        if start == size:
            return
        url = self.join(name)
        deadline = self._retrier.deadline()
        done = start  # bytes [start, done) are in the file
        write_error: list[OSError] = []  # the file's error, which is the caller's, not retried

        def write(data: bytes) -> bool:
            nonlocal done
            try:
                _write_at(fd, data, done)
            except OSError as exc:
                write_error.append(exc)
                return False
            done += len(data)
            if on_bytes is not None:
                on_bytes(len(data))
            return True

        def first() -> None:
            end = min(done + part_bytes, size)
            response = self._open(url, "GET", (done, end - 1))
            try:
                if response.status == 206:
                    _check_partial(url, response, size)
                    body = bytes(response.read())
                    self._retrier.count(received=len(body))
                    if len(body) != end - done:
                        raise ShortReadError(f"{url}: {len(body)} of {end - done} bytes at offset {done}")
                    write(body)
                    return
                _check_whole(url, response, size)
                _skip(response, done)
                self._retrier.count(received=done)
                while done < size:
                    chunk = response.read(min(_CHUNK_BYTES, size - done))
                    if not chunk:
                        raise ShortReadError(f"{url}: the body ended at byte {done} of {size}")
                    self._retrier.count(received=len(chunk))
                    if not write(chunk):
                        return
            finally:
                _finish(response)

        self._retrier.call(url, first, deadline=deadline)
        if write_error:
            raise write_error[0]
        if done < size:  # the server answers Range: the rest in parallel parts
            download_ranges(
                url, self._retrier, self._reader(name, size), fd,
                size=size, start=done, parallel=parallel, part_bytes=part_bytes, on_bytes=on_bytes,
            )  # fmt: skip

    def write(self, name: str, data: bytes) -> None:
        raise StorageError(f"{self.join(name)}: HTTP(S) stores are read-only; write to S3 or GCS instead", self.join(name))

    def upload(self, name: str, local_path: str) -> None:
        self.write(name, b"")

    def delete(self, name: str) -> None:
        self.write(name, b"")


def _pool_manager(url: str, headers: Mapping[str, str], timeout_s: float) -> urllib3.PoolManager:
    """Kept-alive connections (up to 16 per host, for parallel parts of several downloads) that
    follow redirects under NOTE [credentials on redirect] and retry nothing themselves: the
    store's :class:`Retrier` owns every retry."""
    retries = urllib3.Retry(
        total=None, connect=0, read=0, status=0, other=0,
        redirect=_MAX_REDIRECTS, raise_on_redirect=True, respect_retry_after_header=False,
        remove_headers_on_redirect=urllib3.Retry.DEFAULT_REMOVE_HEADERS_ON_REDIRECT | set(headers),
    )  # fmt: skip
    settings: dict[str, Any] = {"num_pools": 8, "maxsize": 16, "retries": retries, "timeout": urllib3.Timeout(connect=timeout_s, read=timeout_s)}
    parts = urllib.parse.urlsplit(url)
    proxy = urllib.request.getproxies().get(parts.scheme.lower())
    if proxy and not urllib.request.proxy_bypass(parts.hostname or ""):
        return urllib3.ProxyManager(proxy, **settings)
    return urllib3.PoolManager(**settings)


def _finish(response: Any) -> None:
    """Give the connection back to the pool when its body was read to the end; otherwise close
    it (reading the rest of a whole body could be gigabytes)."""
    if response.length_remaining != 0:
        response.close()
    response.release_conn()


def _check_partial(url: str, response: Any, size: int | None) -> None:
    match = _CONTENT_RANGE.fullmatch(response.headers.get("Content-Range", ""))
    if match and size is not None and match.group(3) not in ("*", str(size)):
        raise StorageError(
            f"{url}: the object holds {match.group(3)} bytes, not the {size} expected; it was rewritten since "
            "it was indexed. Index the dataset again.",
            url,
        )


def _check_whole(url: str, response: Any, size: int | None) -> None:
    if response.status != 200:
        raise StorageError(f"{url}: answered {response.status} to a ranged GET; expected 206 (or 200 with the whole body)", url)
    length = response.headers.get("Content-Length")
    if length is not None and size is not None and int(length) != size:
        raise StorageError(
            f"{url}: the object holds {length} bytes, not the {size} expected; it was rewritten since "
            "it was indexed. Index the dataset again.",
            url,
        )


def _skip(response: Any, count: int) -> None:
    """Read and drop the first ``count`` bytes of ``response``'s body."""
    while count > 0:
        chunk = response.read(min(_CHUNK_BYTES, count))
        if not chunk:
            raise ShortReadError(f"the body ended {count} bytes before the range began")
        count -= len(chunk)


def _read_exactly(response: Any, length: int) -> bytes:
    """Up to ``length`` bytes of ``response``'s body (fewer only where it ends first)."""
    parts: list[bytes] = []
    while length > 0:
        chunk = response.read(min(_CHUNK_BYTES, length))
        if not chunk:
            break
        parts.append(chunk)
        length -= len(chunk)
    return b"".join(parts)


def _write_at(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written
