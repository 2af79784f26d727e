"""Servers the remote tests talk to, all on 127.0.0.1: moto's S3-compatible server (a
subprocess, so its state and its GIL stay out of the test process), a fault-injecting HTTP proxy
that logs every request (threads in the test process, so tests read its log directly), and a
static file server that answers ``Range`` requests (``http.server`` does not)."""

from __future__ import annotations

import email.utils
import http.client
import http.server
import os
import random
import re
import socket
import socketserver
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

# The IAM user the S3 tests sign as. moto checks signatures and policies once auth is on (see
# MotoServer.start), so a wrong key is refused with a real 403, as a real store would.
_POLICY = '{"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}'


def download(store: Any, name: str, path: Path, size: int, **kwargs: Any) -> bytes:
    """``store.download`` of ``name`` into a new file at ``path``; the file's bytes."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        store.download(name, fd, size=size, **kwargs)
    finally:
        os.close(fd)
    return path.read_bytes()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _no_delay(connection: socket.socket) -> None:
    # Headers and body go out in separate writes; with Nagle's algorithm the body would wait
    # for the client's delayed ACK, 40 ms per request.
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class Credentials(NamedTuple):
    access_key: str
    secret_key: str


class MotoServer:
    """``python -m moto.server`` on a free loopback port, with signature checks on."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._process: subprocess.Popen[bytes] | None = None

    def start(self, *, timeout_s: float = 30.0) -> Credentials:
        env = dict(os.environ, AWS_EC2_METADATA_DISABLED="true")
        self._process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        deadline = time.monotonic() + timeout_s
        while True:
            if self._process.poll() is not None:
                raise RuntimeError(f"moto server exited with code {self._process.returncode} while starting")
            try:
                with urllib.request.urlopen(f"{self.endpoint}/moto-api/data.json", timeout=1.0):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto server on {self.endpoint} not up after {timeout_s} s") from None
                time.sleep(0.05)
        try:
            return self._create_user()
        except BaseException:
            self.stop()
            raise

    def _create_user(self) -> Credentials:
        import boto3  # moto's own dependency; only the set-up speaks IAM

        # The next three IAM calls pass unsigned (moto's reset-auth counter); every request
        # after them must carry a valid signature of a user whose policy allows it.
        request = urllib.request.Request(
            f"{self.endpoint}/moto-api/reset-auth", data=b"3", method="POST", headers={"Content-Type": "text/plain"}
        )
        with urllib.request.urlopen(request, timeout=5.0):
            pass
        iam = boto3.client(
            "iam",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id="setup",
            aws_secret_access_key="setup",
        )
        iam.create_user(UserName="fastload-tests")
        iam.put_user_policy(UserName="fastload-tests", PolicyName="all", PolicyDocument=_POLICY)
        key = iam.create_access_key(UserName="fastload-tests")["AccessKey"]
        return Credentials(key["AccessKeyId"], key["SecretAccessKey"])

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=10.0)


# -- the fault-injecting proxy ----------------------------------------------------------------


class LoggedRequest(NamedTuple):
    """One request as the proxy saw it; ``fault`` is None, ``"status"`` (answered by the proxy
    with an error status, not forwarded) or ``"drop"`` (forwarded, reply cut short).
    ``body_bytes`` counts the bytes of the reply's body the proxy sent (what the client
    downloaded)."""

    method: str
    path: str
    query: str
    range: str | None
    status: int
    fault: str | None
    body_bytes: int = 0


@dataclass
class Faults:
    """What the proxy does to each request, drawn in arrival order from ``random.Random(seed)``:
    with probability ``error_rate`` it answers one of ``error_statuses`` itself (an S3 error body,
    ``SlowDown`` for 503 and 429); else with probability ``drop_rate`` it forwards the request and
    closes the connection halfway through the reply's body (a short read), or within its headers
    when it has no body. ``latency_s`` is added to every request. With several requests in
    flight, which request meets which fault depends on their arrival order."""

    latency_s: float = 0.0
    error_rate: float = 0.0
    drop_rate: float = 0.0
    error_statuses: tuple[int, ...] = (500, 503, 429)
    seed: int = 0


# 403 as S3 sends it for a refused request: a permanent error, not worth retrying.
_ERROR_CODES = {500: "InternalError", 503: "SlowDown", 429: "SlowDown", 403: "AccessDenied"}


def _error_body(status: int) -> bytes:
    code = _ERROR_CODES.get(status, "InternalError")
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>injected by the test proxy</Message>"
        "<RequestId>proxy</RequestId></Error>"
    ).encode()


_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "content-length"}


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _ProxyServer

    def setup(self) -> None:
        super().setup()
        _no_delay(self.connection)

    def log_message(self, format: str, *args: object) -> None:  # keep pytest's output clean
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            # Forwarded as it came (chunk framing and all), so signed headers stay true.
            raw = bytearray()
            while True:
                line = self.rfile.readline()
                raw += line
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while True:
                        trailer = self.rfile.readline()
                        raw += trailer
                        if trailer in (b"\r\n", b"\n", b""):
                            return bytes(raw)
                raw += self.rfile.read(size + 2)
        return self.rfile.read(int(self.headers.get("Content-Length", "0") or 0))

    def _handle(self) -> None:
        body = self._body()
        proxy = self.server.proxy
        fault, status = proxy.decide()
        if proxy.faults.latency_s > 0:
            time.sleep(proxy.faults.latency_s)
        path, _, query = self.path.partition("?")
        entry = LoggedRequest(self.command, path, query, self.headers.get("Range"), status, fault)
        if fault == "status":
            reply = b"" if self.command == "HEAD" else _error_body(status)
            proxy.record(entry._replace(body_bytes=len(reply)))
            self.send_response_only(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(reply)))
            if status in (429, 503):
                self.send_header("Retry-After", "0")
            self.end_headers()
            self.wfile.write(reply)
            return
        upstream = http.client.HTTPConnection(proxy.upstream_host, proxy.upstream_port, timeout=60.0)
        try:
            upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                upstream.putheader(name, value)
            upstream.endheaders(body if body else None)
            response = upstream.getresponse()
            payload = response.read()
            headers = response.getheaders()
        finally:
            upstream.close()
        sent = 0 if self.command == "HEAD" or (fault == "drop" and not payload) else len(payload)
        proxy.record(entry._replace(status=response.status, body_bytes=sent // 2 if fault == "drop" else sent))
        self.send_response_only(response.status, response.reason)
        for name, value in headers:
            if name.lower() not in _HOP_BY_HOP:
                self.send_header(name, value)
        length = next((v for n, v in headers if n.lower() == "content-length"), None)
        if self.command == "HEAD" and length is not None:
            self.send_header("Content-Length", length)
        else:
            self.send_header("Content-Length", str(len(payload)))
        if fault == "drop" and (self.command == "HEAD" or not payload):
            # Cut within the headers: a client that got no byte at all may resend the request
            # on its own (libcurl does, on a reused connection), unseen by the code under test.
            self.wfile.write(f"HTTP/1.1 {response.status} {response.reason}\r\nContent-Le".encode())
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self.end_headers()
        if fault == "drop":
            self.wfile.write(payload[: len(payload) // 2])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if self.command != "HEAD":
            self.wfile.write(payload)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _handle


class _ProxyServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    proxy: FaultProxy


@dataclass
class FaultProxy:
    """A logging, fault-injecting HTTP proxy in front of ``upstream`` (``http://host:port``).

    Tests point a client at :attr:`endpoint`, set :attr:`faults`, and read :meth:`requests`
    (every request since the last :meth:`reset`, in the order their replies were decided)."""

    upstream: str
    faults: Faults = field(default_factory=Faults)

    def __post_init__(self) -> None:
        match = re.fullmatch(r"http://([^:/]+):(\d+)/?", self.upstream)
        if match is None:
            raise ValueError(f"upstream must be http://host:port, got {self.upstream!r}")
        self.upstream_host, self.upstream_port = match.group(1), int(match.group(2))
        self._lock = threading.Lock()
        self._log: list[LoggedRequest] = []
        self._rng = random.Random(self.faults.seed)
        self._server = _ProxyServer(("127.0.0.1", 0), _ProxyHandler)
        self._server.proxy = self
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.02,), name="fault-proxy", daemon=True)
        self._thread.start()

    def set_faults(self, faults: Faults) -> None:
        with self._lock:
            self.faults = faults
            self._rng = random.Random(faults.seed)

    def decide(self) -> tuple[str | None, int]:
        with self._lock:
            draw = self._rng.random()
            if draw < self.faults.error_rate:
                return "status", self._rng.choice(self.faults.error_statuses)
            if draw < self.faults.error_rate + self.faults.drop_rate:
                return "drop", 0
            return None, 0

    def record(self, entry: LoggedRequest) -> None:
        with self._lock:
            self._log.append(entry)

    def requests(self) -> list[LoggedRequest]:
        with self._lock:
            return list(self._log)

    def reset(self) -> None:
        """Forget the log and turn faults off."""
        with self._lock:
            self._log.clear()
        self.set_faults(Faults())

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10.0)


# -- a static file server that honours Range ---------------------------------------------------

_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


class _RangeHandler(http.server.BaseHTTPRequestHandler):
    """GET and HEAD of files under the server's root, with one ``Range: bytes=a-b`` (206) and
    an ``ETag`` and ``Last-Modified`` from the file's size and mtime."""

    protocol_version = "HTTP/1.1"
    server: _FileServer

    def setup(self) -> None:
        super().setup()
        _no_delay(self.connection)

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _serve(self) -> None:
        relative = urllib.request.url2pathname(self.path.partition("?")[0]).lstrip("/")
        path = (self.server.root / relative).resolve()
        if self.server.root not in path.parents or not path.is_file():
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        stat = path.stat()
        start, end = 0, stat.st_size - 1
        status = 200
        wanted = self.headers.get("Range")
        if wanted is not None:
            match = _RANGE.fullmatch(wanted.strip())
            if match is None or not (match.group(1) or match.group(2)):
                self.send_response(416)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if match.group(1):
                start = int(match.group(1))
                end = min(int(match.group(2)), end) if match.group(2) else end
            else:  # a suffix: the last N bytes
                start = max(0, stat.st_size - int(match.group(2)))
            if start >= stat.st_size or start > end:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{stat.st_size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            status = 206
        self.send_response(status)
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("ETag", f'"{stat.st_size:x}-{stat.st_mtime_ns:x}"')
        self.send_header("Last-Modified", email.utils.formatdate(stat.st_mtime, usegmt=True))
        self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{stat.st_size}")
        self.end_headers()
        if self.command == "GET":
            with path.open("rb") as source:
                source.seek(start)
                self.wfile.write(source.read(end - start + 1))

    do_GET = do_HEAD = _serve


class _FileServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    root: Path


class FileServer:
    """Serves ``root`` on a free loopback port at :attr:`endpoint`."""

    def __init__(self, root: Path) -> None:
        self._server = _FileServer(("127.0.0.1", 0), _RangeHandler)
        self._server.root = root.resolve()
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.02,), name="file-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10.0)
