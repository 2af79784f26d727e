"""Fixtures of the remote tests: moto's S3-compatible server started once per session on
127.0.0.1, a logging fault-injecting proxy in front of it, a fresh bucket per test, and a
static file server for HTTP. Nothing leaves the loopback interface.

Credentials come from the environment, as a user's would: each test sees the moto user's keys
in ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, no endpoint variables, and no ``~/.aws``."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest
from _servers import Credentials, FaultProxy, Faults, FileServer, LoggedRequest, MotoServer

_bucket_numbers = itertools.count()


@dataclass
class S3Server:
    """The proxy's endpoint (what the code under test talks to), the server's own endpoint
    (what tests use to put and check objects without touching the log), and the proxy."""

    endpoint: str
    direct: str
    proxy: FaultProxy
    credentials: Credentials

    @property
    def options(self) -> dict[str, Any]:
        return {"endpoint_override": self.endpoint}

    def requests(self) -> list[LoggedRequest]:
        return self.proxy.requests()

    def set_faults(self, faults: Faults) -> None:
        self.proxy.set_faults(faults)

    def filesystem(self) -> pafs.S3FileSystem:
        """A client straight to the server, for setting up and checking objects."""
        return pafs.S3FileSystem(
            endpoint_override=self.direct,
            access_key=self.credentials.access_key,
            secret_key=self.credentials.secret_key,
            allow_bucket_creation=True,
        )

    def put(self, path: str, data: bytes) -> None:
        with self.filesystem().open_output_stream(path) as out:
            out.write(data)

    def upload(self, folder: Path, bucket: str, prefix: str = "corpus", *, leave_out: str | None = None) -> str:
        """Every file of ``folder`` (but ``leave_out``) as ``s3://bucket/prefix/<name>``; that
        folder's URL."""
        for path in sorted(folder.iterdir()):
            if path.name != leave_out:
                self.put(f"{bucket}/{prefix}/{path.name}", path.read_bytes())
        return f"s3://{bucket}/{prefix}/"


@pytest.fixture(scope="session")
def _moto() -> Iterator[tuple[MotoServer, Credentials]]:
    server = MotoServer()
    credentials = server.start()
    try:
        yield server, credentials
    finally:
        server.stop()


@pytest.fixture(scope="session")
def _proxy(_moto: tuple[MotoServer, Credentials]) -> Iterator[FaultProxy]:
    proxy = FaultProxy(_moto[0].endpoint)
    try:
        yield proxy
    finally:
        proxy.close()


def _aws_environment(monkeypatch: pytest.MonkeyPatch, credentials: Credentials) -> None:
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", credentials.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", credentials.secret_key)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)


@pytest.fixture
def s3_server(
    _moto: tuple[MotoServer, Credentials], _proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> Iterator[S3Server]:
    """The S3 server behind the proxy, faults off and the request log empty."""
    _aws_environment(monkeypatch, _moto[1])
    _proxy.reset()
    yield S3Server(_proxy.endpoint, _moto[0].endpoint, _proxy, _moto[1])
    _proxy.reset()


@pytest.fixture
def faulty_s3(s3_server: S3Server) -> S3Server:
    """The same server; the test sets its faults with ``faulty_s3.set_faults(Faults(...))``
    (they are turned off again after the test)."""
    return s3_server


@pytest.fixture
def bucket(s3_server: S3Server) -> str:
    """A new, empty bucket, made straight on the server (not in the proxy's log)."""
    name = f"fastload-test-{next(_bucket_numbers)}"
    s3_server.filesystem().create_dir(name)
    return name


@dataclass
class HttpServer:
    root: Path
    endpoint: str
    proxy: FaultProxy

    def requests(self) -> list[LoggedRequest]:
        return self.proxy.requests()


@pytest.fixture
def http_server(tmp_path: Path) -> Iterator[HttpServer]:
    """Files under ``root`` served with Range support, behind a fault proxy of their own."""
    root = tmp_path / "www"
    root.mkdir()
    files = FileServer(root)
    proxy = FaultProxy(files.endpoint)
    try:
        yield HttpServer(root, proxy.endpoint, proxy)
    finally:
        proxy.close()
        files.close()
